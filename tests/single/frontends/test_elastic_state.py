"""tfsync.elastic in one process: the state's commit and restore, the models it refuses, which failures reset, and the
reset loop of ``run`` against a stand-in for Horovod (the launches are tests/parallel/test_elastic_launcher.py)."""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

import tfsync
import tfsync.elastic as elastic
from tfsync.control.client import ControlUnreachableError
from tfsync.engine import SyncTimeoutError, WorkerLostError
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.tally import Tally


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return model


def _train_one_step(model):
    x, y = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    model.train_on_batch(x, y)


def test_the_state_restores_the_model_the_optimizer_and_its_attributes_from_the_commit():
    model = _model()
    state = elastic.KerasState(model, epoch=0, scale=1.0)
    assert model.optimizer.built  # its slots exist before the first commit
    _train_one_step(model)
    state.epoch, state.counts["produced"] = 3, 7
    state.save()
    committed = [v.numpy().copy() for v in model.variables + list(model.optimizer.variables)]
    state.counts["produced"] += 5  # a commit is a copy: later changes do not reach it
    state.epoch, state.scale = 4, 0.5
    _train_one_step(model)
    state.restore()
    now = [v.numpy() for v in model.variables + list(model.optimizer.variables)]
    assert all(np.array_equal(a, b) for a, b in zip(now, committed, strict=True))
    assert int(model.optimizer.iterations.numpy()) == 1  # the optimizer's step count too
    assert (state.epoch, state.scale, state.counts["produced"]) == (3, 1.0, 7)
    state.counts["produced"] += 1  # nor does a change after a restore
    state.restore()
    assert state.counts["produced"] == 7


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: keras.Sequential([keras.layers.Dense(2)]), "has no optimizer"),
        (
            lambda: (m := keras.Sequential([keras.layers.Dense(2)]), m.compile(optimizer="sgd", loss="mse"))[0],
            "not built",
        ),
    ],
)
def test_the_state_refuses_a_model_it_cannot_keep(build, message):
    with pytest.raises(ValueError, match=message):
        elastic.KerasState(build())


def test_the_state_keeps_its_own_attribute_names():
    with pytest.raises(ValueError, match="'resets' is the state's own attribute"):
        elastic.KerasState(_model(), resets=2)


def _strategy():
    return tfsync.distribute.SyncStrategy("bsp", cluster=FakeCluster(1).rank(0), wait_timeout_s=10)


def test_a_model_built_under_sync_strategy_is_refused_saying_why():
    # the strategy's traced step would call the engine a reset abandoned; refused before any work
    with _strategy().scope():
        model = _model()
    with pytest.raises(ValueError) as info:
        elastic.KerasState(model, epoch=0)
    message = str(info.value)
    assert message.startswith("tfsync.elastic.KerasState: the model trains under tfsync.distribute.SyncStrategy")
    assert "callbacks=[tfsync.keras.SyncCallback(mode, elastic=state)]" in message  # what is expected
    assert "build the model and the state outside strategy.scope()" in message  # the fix
    assert "Keras reuses that traced step in every later fit" in message  # why it cannot re-form


def test_the_callback_takes_only_a_keras_state():
    with pytest.raises(TypeError, match="elastic must be a tfsync.elastic.KerasState"):
        tfsync.keras.SyncCallback("bsp", elastic=object())


@pytest.mark.parametrize(
    "exc,resets",
    [
        (WorkerLostError("tfsync: lost rank 1"), True),
        (SyncTimeoutError("tfsync: rank 0 waited 30 s"), True),
        (HorovodInternalError("x"), True),
        (ControlUnreachableError("tfsync: rank 1 could not reach the control service of rank 0"), True),
        (TimeoutError("a program's own timeout"), False),
        (tf.errors.UnknownError(None, None, "HorovodAllreduce failed: Horovod has been shut down"), True),
        (tf.errors.UnknownError(None, None, "gloo/transport/tcp/pair.cc: Connection reset by peer"), True),
        (tf.errors.InvalidArgumentError(None, None, "Incompatible shapes: [2] vs. [3]"), False),
        (ValueError("tfsync: ranks [1] are configured differently"), False),
    ],
)
def test_a_reset_answers_lost_peers_and_failed_collectives_only(exc, resets):
    assert elastic.is_reset_error(exc) is resets
    try:  # and the same failure as the cause of another error (Keras re-raises some)
        raise RuntimeError("fit failed") from exc
    except RuntimeError as wrapped:
        assert elastic.is_reset_error(wrapped) is resets


def test_in_flight_contributions_are_counted_lost_and_the_counts_add_up():
    tally = Tally()
    tally.add("produced", 5)
    tally.add("applied", 2)
    tally.add("dropped", 1)

    class Exchange:
        def take_drops(self):
            return []

    tally.settle(Exchange())
    with pytest.raises(RuntimeError, match="lost track of contributions"):
        tally.check(0)
    assert tally.lose_unsettled() == 2
    assert tally.counts["lost"] == tally.totals["lost"] == 2
    tally.check(0)


class FakeHorovod:
    """What ``run`` asks of ``horovod.tensorflow``: a rank, a size, shutdown and init."""

    def __init__(self, init_error=None):
        self.calls, self.init_error = [], init_error

    def rank(self):
        return 0

    def size(self):
        return 1

    def shutdown(self):
        self.calls.append("shutdown")

    def init(self):
        self.calls.append("init")
        error = self.init_error.pop(0) if isinstance(self.init_error, list) else self.init_error
        if error is not None:
            raise error


class LocalState(elastic.KerasState):
    """A KerasState whose sync (a broadcast from rank 0) is this process's own commit."""

    syncs = 0

    def sync(self):
        self.syncs += 1
        self.save()


@pytest.fixture
def fake_horovod(monkeypatch):
    hvd = FakeHorovod()
    monkeypatch.setattr(elastic.loop._horovod, "horovod", lambda: hvd)
    monkeypatch.setenv(elastic.ELASTIC_ENV, "1")
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", raising=False)  # (no launcher to notify)
    return hvd


@pytest.mark.parametrize("failure", [WorkerLostError("tfsync: lost rank 1"), HostsUpdatedInterrupt(False)])
def test_run_resets_restores_the_commit_and_calls_again(fake_horovod, failure):
    model = _model()
    state = LocalState(model, epoch=0)
    committed = [v.numpy().copy() for v in model.variables]
    keys_before = HorovodCluster._keys
    calls = []

    @elastic.run
    def train(state, tag):
        calls.append((state.epoch, tag))
        if len(calls) == 1:
            state.epoch = 2  # uncommitted progress, then a failure
            _train_one_step(model)
            raise failure
        return "done"

    assert train(state, "x") == "done"
    assert calls == [(0, "x"), (0, "x")]  # the second call starts from the commit
    assert all(np.array_equal(v.numpy(), c) for v, c in zip(model.variables, committed, strict=True))
    assert state.resets == 1 and state.syncs == 2
    assert fake_horovod.calls == ["shutdown", "init"]
    assert HorovodCluster._keys is not keys_before  # collectives numbered anew for the new members


def test_a_reset_collects_the_interrupted_fits_garbage_on_a_thread_of_its_own(fake_horovod):
    """A finalizer of the interrupted call's garbage that blocks (a tf.data iterator's destructor
    waiting for its thread, in the chaos soak) holds the reset's collector, not the next call."""
    import gc
    import threading

    release, finalized = threading.Event(), []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            finalized.append(threading.current_thread().name)
            release.wait(30)

    state = LocalState(_model(), epoch=0)
    calls = []

    @elastic.run
    def train(state):
        calls.append(1)
        if len(calls) == 1:
            Cycle()  # (garbage in a reference cycle, left by the failed call)
            raise WorkerLostError("tfsync: lost rank 1")
        return "done"

    gc.disable()  # (no collection on this thread in between)
    try:
        assert train(state) == "done"  # the second call ran while the finalizer blocked
        deadline = time.monotonic() + 30
        while not finalized and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finalized == ["tfsync-reset-gc"]
    finally:
        release.set()
        gc.enable()


def test_run_raises_any_other_error_as_it_is(fake_horovod):
    @elastic.run
    def train(state):
        raise ValueError("the program's own error")

    with pytest.raises(ValueError, match="the program's own error"):
        train(LocalState(_model()))
    assert fake_horovod.calls == []


def test_a_job_horovod_cannot_re_form_fails_saying_why(fake_horovod, monkeypatch):
    monkeypatch.setattr(elastic.loop, "REFORM_PAUSE_S", 0.0)
    monkeypatch.setattr(elastic.loop._horovod, "init_error", lambda: None)  # (Horovod as released)
    fake_horovod.init_error = RuntimeError("rendezvous stopped")

    @elastic.run
    def train(state):
        raise WorkerLostError("tfsync: lost rank 1")

    with pytest.raises(elastic.ElasticResetError, match="--reset-limit") as info:
        train(LocalState(_model()))
    assert "rendezvous stopped" in str(info.value) and "lost rank 1" in str(info.value)


@pytest.fixture
def init_fails(monkeypatch, fake_horovod):
    """Horovod's reason for a failed init (patched Horovod's horovod_tfsync_init_error), no pause."""
    monkeypatch.setattr(elastic.loop, "REFORM_PAUSE_S", 0.0)
    reasons = {"why": "Wait timeout after 30 seconds for key(s): 3"}
    monkeypatch.setattr(elastic.loop._horovod, "init_error", lambda: reasons["why"])
    return reasons


def test_a_rendezvous_that_fails_is_tried_again_after_a_shutdown(fake_horovod, init_fails, caplog):
    # (a member lost while the contexts formed: patched Horovod's init raises; the next try works)
    fake_horovod.init_error = [ValueError("Horovod initialization failed"), None]
    calls = []

    @elastic.run
    def train(state):
        calls.append(state.resets)
        if len(calls) == 1:
            raise WorkerLostError("tfsync: lost rank 1")
        return "done"

    state = LocalState(_model())
    with caplog.at_level("WARNING", logger=elastic.loop.log.name):
        assert train(state) == "done"
    assert fake_horovod.calls == ["shutdown", "init", "shutdown", "init"]
    assert calls == [0, 1] and state.resets == 1  # one reset, two tries
    assert "could not re-form the job (try 1 of 3: Wait timeout after 30 seconds for key(s): 3)" in caplog.text


def test_a_job_that_cannot_re_form_gives_up_after_the_tries(fake_horovod, init_fails):
    fake_horovod.init_error = [ValueError("Horovod initialization failed")] * elastic.loop.REFORM_ATTEMPTS

    @elastic.run
    def train(state):
        raise WorkerLostError("tfsync: lost rank 1")

    with pytest.raises(elastic.ElasticResetError, match=r"in 3 tries \(the last: Wait timeout") as info:
        train(LocalState(_model()))
    assert "lost rank 1" in str(info.value)
    assert fake_horovod.calls == ["shutdown"] + ["init", "shutdown"] * 2 + ["init"]


def test_a_worker_whose_host_was_removed_does_not_try_again(fake_horovod, init_fails):
    # (a try would record it as ready in the launcher's next round, which it is not part of)
    init_fails["why"] = "198.18.0.2[0] has been removed from elastic job"
    fake_horovod.init_error = [ValueError("Horovod initialization failed")] * elastic.loop.REFORM_ATTEMPTS

    @elastic.run
    def train(state):
        raise WorkerLostError("tfsync: lost rank 1")

    with pytest.raises(elastic.ElasticResetError, match="removed this worker's host from the job"):
        train(LocalState(_model()))
    assert fake_horovod.calls == ["shutdown", "init"]


def test_run_wants_the_state_first():
    @elastic.run
    def train(state):
        return state

    with pytest.raises(TypeError, match="must be the elastic state"):
        train(42)


def test_run_called_in_sync_strategys_scope_is_refused_before_the_sync():
    state = LocalState(_model(), epoch=0)
    calls = []

    @elastic.run
    def train(state):
        calls.append(state.epoch)

    with _strategy().scope(), pytest.raises(ValueError, match=r"tfsync\.elastic\.run \(train\): the model trains"):
        train(state)
    assert calls == [] and state.syncs == 0


def test_the_callback_commits_at_epoch_ends_and_counts_what_a_reset_lost(monkeypatch):
    """One rank on the in-process cluster: commits at epoch ends; a failure mid-epoch, the reset's
    part of the callback (lost counted, engine abandoned without a leave, hooks undone), the
    restore, and a second fit from the committed epoch."""
    from fake_cluster import FakeCluster

    from tfsync.control import ControlClient

    leaves, close = [], ControlClient.close
    monkeypatch.setattr(ControlClient, "close", lambda self, leave=True: (leaves.append(leave), close(self, leave))[1])

    model = _model()
    state = elastic.KerasState(model, epoch=0)
    sync = tfsync.keras.SyncCallback(
        tfsync.SSP(staleness=2), cluster=FakeCluster(1).rank(0), elastic=state, wait_timeout_s=10
    )
    x, y = np.ones((32, 3), "float32"), np.zeros((32, 2), "float32")  # 8 steps of 4 per epoch

    class FailOnce(keras.callbacks.Callback):
        failed = False

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 3) and not FailOnce.failed:
                FailOnce.failed = True
                raise WorkerLostError("tfsync: lost rank 1 (a test)")

    fit = dict(batch_size=4, epochs=3, verbose=0, shuffle=False, callbacks=[sync, FailOnce()])
    with pytest.raises(WorkerLostError):
        model.fit(x, y, **fit)
    # committed at epoch 0's end: its settled contributions (SSP may have one in flight then)
    assert state.epoch == 1 and 6 <= state.counts["produced"] <= 8, state.counts
    assert state.counts["produced"] == state.counts["applied"]
    committed = [v.copy() for v in state._saved_values]
    lost = sync.elastic.reset("WorkerLostError: a test")
    assert "train_step" not in vars(model) and "apply" not in vars(model.optimizer)  # hooks undone
    # (every member resets and rank 0 closes its service: a leave's answer could only time out)
    assert leaves == [False]
    counts = sync.counts
    assert counts["produced"] == 12 and counts["lost"] == lost, counts  # epoch 0, 4 steps of epoch 1
    assert counts["produced"] == sum(counts[k] for k in ("applied", "compensated", "dropped", "rejected", "lost"))
    state.restore()
    now = [v.numpy() for v in model.variables + list(model.optimizer.variables)]
    assert all(np.array_equal(a, b) for a, b in zip(now, committed, strict=True))

    model.fit(x, y, initial_epoch=state.epoch, **fit)  # epochs 1 and 2 again, on a new engine
    assert state.epoch == 3
    job = state.counts  # epoch 0, the 4 steps rolled back (and what they lost), epochs 1-2
    assert job["produced"] == 28 and job["lost"] == lost, job
    assert job["produced"] == sum(job[k] for k in ("applied", "compensated", "dropped", "rejected", "lost"))
    assert sync.counts == job  # one worker: the job's counts are its own


def test_a_reset_after_an_engine_whose_start_failed_folds_nothing_from_it():
    # (found by the chaos soak: a fit whose engine start failed, then a reset, folded the engine's
    # counts, which it had none of: AttributeError ended the worker)
    callback = tfsync.keras.SyncCallback("bsp")
    callback.set_model(_model())
    engine = tfsync.engine.SyncEngine(tfsync.BSP())  # constructed, its start never got through
    callback.frontend.engine = engine
    assert not engine.started and all(v == 0 for v in engine.counts.values())
    assert callback.abandon_engine("WorkerLostError: tfsync: lost rank 1") == 0
    assert all(v == 0 for v in callback.run_counts.counts(None).values())
