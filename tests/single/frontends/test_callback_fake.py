"""``SyncCallback`` and ``model.fit``, N ranks on threads of one process.

The callback reaches the other workers only through its cluster
(:mod:`tfsync.engine.cluster`), so the in-process ranks of :mod:`fake_cluster`
stand in for Horovod: each rank's thread builds its own Keras model, compiles
it and runs ``fit`` with ``SyncCallback(mode, cluster=fake.rank(r))``; the
engine, its control path, the compiled train step and the callback's hooks
are production's.  Without ``horovodrun`` these run in seconds, so the
callback's own logic (start checks, epoch logs, the drain, auto mode's
decisions) is tested here; tests/parallel runs the same under Horovod.
"""

import threading
import time
import weakref

import keras
import numpy as np
import pytest
from fake_cluster import FakeCluster, assert_no_errors, on_threads
from training_fake import BATCH, EPOCHS, SIZE, STEPS, data, train_on_mean_gradients

import tfsync
from tfsync.engine import COUNTS
from tfsync.keras import fit_data

# real engines on localhost, without stragglers from the environment (conftest.py)
pytestmark = pytest.mark.usefixtures("engines_on_localhost")

JOIN_S = 120.0  # one deadline for the job's threads (tracing two models on two cores included)


def build(initial=None):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    if initial is not None:
        model.set_weights(initial)
    return model


def fit(cluster, mode, initial=None, **kwargs):
    """One rank's ``fit``: its final weights, the callback and the history's logs."""
    model = build(initial if cluster.rank() == 0 else None)  # (the others' are overwritten)
    sync = tfsync.keras.SyncCallback(mode, cluster=cluster, wait_timeout_s=60, **kwargs)
    x, y = data(cluster.rank())
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[sync])
    return model.get_weights(), sync, history.history


def job(mode, size=SIZE, initial=None, **kwargs):
    fake = FakeCluster(size, timeout_s=60)
    fns = [lambda r=r: fit(fake.rank(r), mode, initial, **kwargs) for r in range(size)]
    results, errors = on_threads(fns, JOIN_S)
    assert_no_errors(errors)
    return results, fake


@pytest.mark.parametrize("mode", ["bsp", "ssp", "psp", "backup", "dcs3gd", "elasticbsp"])
def test_replicas_end_identical_and_every_contribution_is_counted(mode):
    results, fake = job(mode)
    weights = [w for w, _, _ in results]
    for w in weights[1:]:
        for a, b in zip(weights[0], w):
            np.testing.assert_array_equal(a, b)
    for _, sync, logs in results:
        counts = sync.counts
        assert counts["produced"] + counts["skipped"] == STEPS * EPOCHS, counts
        assert counts["produced"] == counts["applied"] + counts["compensated"] + counts["dropped"], counts
        # the epoch logs are averaged over the ranks: the same on every rank
        assert logs["tfsync_produced"] == results[0][2]["tfsync_produced"]
    names = {name for _, _, name in fake.log}
    # the callback's own collectives went through the cluster, not Horovod
    assert {"tfsync.steps", "tfsync.weights", "tfsync.epoch_logs", "tfsync.statistics.shapes"} <= names, names


def test_bsp_trains_as_one_model_on_every_ranks_mean_gradient():
    """Two ranks under BSP end where one model that applies, at each step, the mean of both
    shards' gradients ends (from rank 0's initial weights: the callback's broadcast)."""
    reference = build()
    initial = reference.get_weights()
    results, _ = job("bsp", initial=initial)
    for w, expected in zip(results[1][0], train_on_mean_gradients(reference)):
        np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)


def test_ranks_with_different_step_counts_are_refused_on_every_rank():
    fake = FakeCluster(SIZE, timeout_s=60)

    def fit_steps(rank):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        x, y = data(rank)
        n = BATCH * (STEPS - rank)  # rank 1 has one batch fewer
        sync = tfsync.keras.SyncCallback("bsp", cluster=fake.rank(rank), wait_timeout_s=30)
        model.fit(x[:n], y[:n], batch_size=BATCH, epochs=1, verbose=0, callbacks=[sync])

    _, errors = on_threads([lambda r=r: fit_steps(r) for r in range(SIZE)], JOIN_S)
    for e in errors:
        assert isinstance(e, ValueError) and "different or unknown numbers of steps" in str(e), errors


def test_auto_mode_decides_the_same_on_every_rank_and_counts_every_engine():
    auto = tfsync.Auto(window_steps=4, confirm=1)
    results, fake = job(auto)
    decisions = [sync.auto_decisions for _, sync, _ in results]
    assert decisions[0], "auto mode took no decision"
    keys = ("epoch", "batch", "profile", "mode", "switched")
    for d in decisions[1:]:
        assert [{k: x[k] for k in keys} for x in d] == [{k: x[k] for k in keys} for x in decisions[0]]
    for _, sync, _ in results:
        counts = sync.counts
        assert counts["produced"] + counts["skipped"] == STEPS * EPOCHS, counts
        assert sum(counts[k] for k in COUNTS if k not in ("produced", "skipped")) == counts["produced"]
    assert any(name == "tfsync.auto.window" for _, _, name in fake.log)


def test_a_fit_that_raised_leaves_no_engine_in_the_way_of_the_next():
    """Keras calls no ``on_train_end`` when ``fit`` raises: the next ``fit`` with the same
    callback abandons the engine left running and trains as usual."""
    fake = FakeCluster(SIZE, timeout_s=60)

    class Boom(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("boom")

    def fit_twice(rank):
        model = build()
        sync = tfsync.keras.SyncCallback("bsp", cluster=fake.rank(rank), wait_timeout_s=30)
        x, y = data(rank)
        with pytest.raises(RuntimeError, match="boom"):
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[sync, Boom()])
        first = sync.engine
        assert first.started  # left running
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[sync])
        assert not first.started and sync.engine is not first and not sync.engine.started
        return model.get_weights(), sync.counts

    results, errors = on_threads([lambda r=r: fit_twice(r) for r in range(SIZE)], JOIN_S)
    assert_no_errors(errors)
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_array_equal(a, b)
    assert results[0][1]["produced"] == STEPS * EPOCHS


def test_every_epochs_input_iterator_is_dropped_on_the_release_thread_not_the_training_one():
    """Destroying a ``tf.data`` iterator can wait seconds for its autotuning thread
    (:mod:`tfsync.keras.fit_data`): each epoch's iterator (Keras builds one per epoch of data)
    is dropped on the callback's release thread, not on the thread that runs the fit."""
    fake = FakeCluster(SIZE, timeout_s=60)
    dropped_on = {r: [] for r in range(SIZE)}  # rank -> the threads that dropped its iterators

    def one(rank):
        model = build()
        sync = tfsync.keras.SyncCallback("bsp", cluster=fake.rank(rank), wait_timeout_s=60)
        watched = set()

        def note():
            dropped_on[rank].append(threading.current_thread().name)

        class Watch(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                iterator = sync._fit_data._current
                if id(iterator) not in watched:
                    watched.add(id(iterator))
                    weakref.finalize(iterator, note)

        x, y = data(rank)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[sync, Watch()])
        return threading.current_thread().name

    trained_on, errors = on_threads([lambda r=r: one(r) for r in range(SIZE)], JOIN_S)
    assert_no_errors(errors)
    deadline = time.monotonic() + 30.0
    while any(len(d) < EPOCHS for d in dropped_on.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dropped_on == {r: [fit_data.THREAD_NAME] * EPOCHS for r in range(SIZE)}, (dropped_on, trained_on)


class Counted(keras.Sequential):
    """A model that counts the traces of its train step (Python runs only while tracing)."""

    traces = 0

    def train_step(self, data):
        self.traces += 1
        return super().train_step(data)


def build_counted(initial=None):
    model = Counted([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    if initial is not None:
        model.set_weights(initial)
    return model


def fits(fake, mode, between=None, initial=None, epochs=EPOCHS):
    """Each rank runs ``epochs`` fits of one epoch with one callback (``between(model, epoch)``
    after each): its weights, the traces of its train step, its counts and its model."""

    def one(rank):
        model = build_counted(initial if rank == 0 else None)
        sync = tfsync.keras.SyncCallback(mode, cluster=fake.rank(rank), wait_timeout_s=60)
        x, y = data(rank)
        for epoch in range(epochs):
            model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=epoch + 1,
                initial_epoch=epoch,
                shuffle=False,
                verbose=0,
                callbacks=[sync],
            )
            if between is not None:
                between(model, epoch)
        return model.get_weights(), model.traces, sync.counts, model

    results, errors = on_threads([lambda r=r: one(r) for r in range(SIZE)], JOIN_S)
    assert_no_errors(errors)
    return results


@pytest.mark.parametrize("mode", ["bsp", "backup", "ssp", "elasticbsp", "diloco"])
def test_a_later_fit_reuses_the_compiled_train_step_on_its_new_engine(mode):
    """A fit per epoch traces the train step once: each later fit's new engine runs the step
    the first fit compiled, the replicas end identical and every contribution is counted."""
    results = fits(FakeCluster(SIZE, timeout_s=60), mode, epochs=3)
    for weights, traces, counts, model in results:
        assert traces == 1, f"the train step was traced {traces} times in 3 fits"
        for a, b in zip(results[0][0], weights):
            np.testing.assert_array_equal(a, b)
        assert sum(counts[k] for k in COUNTS if k not in ("produced", "skipped")) == counts["produced"], counts
        # after the fits, the model is Keras' own again: nothing of the callback's is left on it
        assert "train_step" not in vars(model) and "apply" not in vars(model.optimizer)


def test_bsp_fits_on_the_reused_step_train_as_one_model_on_every_ranks_mean_gradient():
    reference = build()
    initial = reference.get_weights()
    results = fits(FakeCluster(SIZE, timeout_s=60), "bsp", initial=initial)
    for w, expected in zip(results[1][0], train_on_mean_gradients(reference)):
        np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)


def test_a_recompiled_or_refrozen_model_gets_a_new_train_step():
    """``model.compile`` between fits replaces Keras' train function, and freezing a layer
    changes the variables the step updates: either way the next fit compiles its own step."""

    def change(model, epoch):
        if epoch == 0:
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        else:
            model.layers[0].trainable = False

    results = fits(FakeCluster(SIZE, timeout_s=60), "bsp", between=change, epochs=3)
    for weights, traces, _, _ in results:
        assert traces == 3
        for a, b in zip(results[0][0], weights):
            np.testing.assert_array_equal(a, b)


def test_a_kept_step_serves_only_its_own_mode_and_only_once():
    from tfsync.engine.protocols import optimizer_path
    from tfsync.keras.compiled_step import KeptStep

    model = build()
    path = optimizer_path(tfsync.BSP(), lambda: None, model.optimizer)
    kept = KeptStep()

    def fit_ends(kept):
        kept.installed(model, path, model.optimizer, "compiled")
        kept.keep(model)

    for policy, served in ((tfsync.SSP(staleness=2), False), (tfsync.BSP(), True)):
        fit_ends(kept)
        assert kept.take(model, policy, shared=False) == ((path, "compiled") if served else None)
        assert kept.take(model, policy, shared=False) is None  # (taken: nothing kept after)
    fit_ends(kept)
    assert kept.take(model, tfsync.BSP(), shared=True) is None  # (auto mode's step is another)
    fit_ends(kept)
    model.make_train_function(force=True)  # (what model.compile does too)
    assert kept.take(model, tfsync.BSP(), shared=False) is None
    # the variables it was compiled for, not those at the fit's end: a layer frozen during the fit
    kept.installed(model, path, model.optimizer, "compiled")
    model.layers[0].trainable = False
    kept.keep(model)
    assert kept.take(model, tfsync.BSP(), shared=False) is None


def test_without_a_fit_there_is_nothing_to_release():
    assert fit_data.FitData().release() is False
