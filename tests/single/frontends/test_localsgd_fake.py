"""Local SGD and DiLoCo (:mod:`tfsync.policies.local`) through both frontends, two ranks on
threads of one process (:mod:`fake_cluster`): the engine, the compiled step and the frontends'
hooks are production's.

The guarantees their docstrings state, each tested here: the replicas (weights and
BatchNormalization statistics) are identical after every outer step and differ between them;
``LocalSGD(period=1)`` with plain SGD trains as BSP; DiLoCo with outer ``SGD(1.0)`` trains as
Local SGD; both match a reference of H independent local steps and an average (DiLoCo: the
paper's Nesterov outer step); the inner optimizer's state stays local and its ``iterations``
count inner steps; every outer step is one counted contribution and a period with a gradient
that is not finite is rejected; with gradient accumulation the period counts updates.
"""

import json
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, assert_no_errors, on_threads
from training_fake import BATCH, EPOCHS, JOIN_S, SIZE, STEPS, data, layers

import tfsync
from tfsync import timeline
from tfsync.engine import NonFiniteError, WorkerLostError, exchange
from tfsync.engine.protocols.outer import split_fragments
from tfsync.engine.wire import pacing

pytestmark = pytest.mark.usefixtures("engines_on_localhost")

TOTAL = STEPS * EPOCHS  # each rank's steps in one fit (12)


def bn_layers():
    return [keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(), keras.layers.Dense(1)]


class Record(keras.callbacks.Callback):
    """Every step's weights (``model.get_weights()``: BatchNormalization's statistics included)."""

    def on_train_begin(self, logs=None):
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(self.model.get_weights())


def fit_rank(
    cluster,
    frontend,
    mode,
    make_layers=layers,
    make_optimizer=None,
    initial=None,
    trace_dir=None,
    on_nonfinite="reject",
    **data_kw,
):
    """One rank's fit: its final weights, optimizer variables, every step's weights, the counts."""
    rank = cluster.rank()
    make_optimizer = make_optimizer or (lambda: keras.optimizers.Adam(0.01))
    record = Record()

    def build():
        model = keras.Sequential(make_layers())
        model.compile(optimizer=make_optimizer(), loss="mse")
        if initial is not None and rank == 0:
            model.set_weights(initial)
        return model

    x, y = data(rank, **data_kw)
    if frontend == "callback":
        model = build()
        sync = tfsync.keras.SyncCallback(
            mode,
            cluster=cluster,
            wait_timeout_s=30,
            average_statistics=False,
            trace_dir=trace_dir,
            on_nonfinite=on_nonfinite,
        )
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[sync, record])
        counts = sync.counts
    else:
        strategy = tfsync.distribute.SyncStrategy(mode, cluster=cluster, wait_timeout_s=30)
        try:
            with strategy.scope():
                model = build()
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record])
            engine = strategy.engine
            strategy.finish()  # (the last outer step, if the run ended mid-period)
        finally:
            if strategy.engine is not None:
                strategy.engine.abandon()
        counts = engine.counts
    return {
        "weights": model.get_weights(),
        "optimizer": [v.numpy() for v in model.optimizer.variables],
        "iterations": int(model.optimizer.iterations.numpy()),
        "steps": record.steps,
        "counts": counts,
    }


def job(frontend, mode, **kwargs):
    fake = FakeCluster(SIZE, timeout_s=60)
    results, errors = on_threads(
        [lambda r=r: fit_rank(fake.rank(r), frontend, mode, **kwargs) for r in range(SIZE)], JOIN_S
    )
    assert_no_errors(errors)
    return results


def initial_weights(make_layers=layers):
    return keras.Sequential(make_layers()).get_weights()


def assert_replicas_identical(results, finite=False):
    """Both ranks' final weights equal (and finite, with ``finite``)."""
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)
        assert not finite or np.isfinite(a).all()


def assert_close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


FRONTENDS = ["callback", "strategy"]
MODES = {"localsgd": tfsync.LocalSGD(period=4), "diloco": tfsync.DiLoCo(inner_steps=4)}


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", sorted(MODES))
def test_replicas_are_identical_after_every_outer_step_and_apart_between(frontend, name):
    """With a BatchNormalization layer: at every 4th step every replica's weights and moving
    statistics are bit-identical; at the steps between they differ (each trains alone)."""
    results = job(frontend, MODES[name], make_layers=bn_layers)
    steps0, steps1 = results[0]["steps"], results[1]["steps"]
    assert len(steps0) == len(steps1) == TOTAL
    for k in range(TOTAL):
        same = all(np.array_equal(a, b) for a, b in zip(steps0[k], steps1[k]))
        if (k + 1) % 4 == 0:
            assert same, f"step {k}: an outer step, the replicas differ"
        else:
            assert not same, f"step {k}: an inner step, yet the replicas are identical"
    assert_replicas_identical(results)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_localsgd_with_period_1_and_plain_sgd_trains_as_bsp(frontend):
    initial = initial_weights()
    sgd = lambda: keras.optimizers.SGD(0.05)  # noqa: E731
    local = job(frontend, tfsync.LocalSGD(period=1), make_optimizer=sgd, initial=initial)
    bsp = job(frontend, "bsp", make_optimizer=sgd, initial=initial)
    assert_close(local[0]["weights"], bsp[0]["weights"])
    assert_close(local[1]["weights"], bsp[1]["weights"])
    assert not np.allclose(local[0]["weights"][0], initial[0])  # (it trained)
    assert local[0]["counts"]["produced"] == TOTAL  # period 1: every step is an outer step


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_diloco_with_outer_sgd_at_1_and_no_momentum_trains_as_localsgd(frontend):
    initial = initial_weights()
    outer = keras.optimizers.SGD(learning_rate=1.0)
    diloco = job(frontend, tfsync.DiLoCo(inner_steps=5, outer_optimizer=outer), initial=initial)
    local = job(frontend, tfsync.LocalSGD(period=5), initial=initial)
    for r in range(SIZE):
        assert_close(diloco[r]["weights"], local[r]["weights"])


def local_step(models, shards, k, loss):
    """Each replica's own optimizer step on batch ``k`` of its own shard."""
    for m, (x, y) in zip(models, shards):
        xb, yb = x[k * BATCH : (k + 1) * BATCH], y[k * BATCH : (k + 1) * BATCH]
        with tf.GradientTape() as tape:
            value = loss(yb, m(xb))
        m.optimizer.apply(tape.gradient(value, m.trainable_variables), m.trainable_variables)


def reference(initial, period, outer=None, overlap=0, mixing=0.0, accumulate=None):
    """Two replicas from ``initial``, each with its own Adam on its own shard (accumulating
    ``accumulate`` batches per update, when given).  Every ``period`` updates (and at the end) an
    outer step: the mean of ``w_outer - w_i`` as taken ``overlap`` updates before, applied to the
    last outer weights as the average (``outer`` None) or by ``outer`` (a Keras optimizer); the
    replicas then go on from ``(1 - mixing)·w_outer + mixing·w_i``.  The final weights are
    ``w_outer``, each replica's."""
    models = []
    for _ in range(SIZE):
        m = keras.Sequential(layers())
        m.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulate), loss="mse")
        m.set_weights(initial)
        models.append(m)
    anchor = [tf.Variable(w) for w in initial]
    if outer is not None:
        outer.build(anchor)
    shards = [data(r) for r in range(SIZE)]
    loss = keras.losses.MeanSquaredError()

    def pseudo_gradient():
        per_weight = zip(*(m.get_weights() for m in models))
        return [np.mean([a.numpy() - w for w in ws], axis=0) for a, ws in zip(anchor, per_weight)]

    def outer_step(mean):
        if outer is None:
            for a, g in zip(anchor, mean):
                a.assign_sub(g)
        else:
            outer.apply([tf.constant(g) for g in mean], anchor)
        for m in models:
            m.set_weights([(1 - mixing) * a.numpy() + mixing * w for a, w in zip(anchor, m.get_weights())])

    done, batches, in_flight = 0, 0, None
    for _ in range(EPOCHS):
        for k in range(STEPS):
            local_step(models, shards, k, loss)
            batches += 1
            if batches % (accumulate or 1):  # (a batch that only accumulated: no update to count)
                continue
            done += 1
            if done % period == (period - overlap) % period:
                in_flight = pseudo_gradient()
            if done % period == 0:
                outer_step(in_flight)
                in_flight = None
    if in_flight is not None:  # (the drain: the round in flight lands)
        outer_step(in_flight)
    elif done % period:  # (a last, shorter period: its outer step)
        outer_step(pseudo_gradient())
    return [[a.numpy() for a in anchor] for _ in models]


@pytest.mark.parametrize(
    "mode,outer",
    [
        (tfsync.LocalSGD(period=5), None),
        (tfsync.DiLoCo(inner_steps=5), keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)),
    ],
    ids=["localsgd", "diloco-nesterov"],
)
def test_the_outer_steps_match_local_training_and_the_papers_outer_step(mode, outer):
    """Period 5 over 12 steps: outer steps after steps 5 and 10 and a last one for steps 11-12
    (the run ends mid-period); DiLoCo's default outer optimizer is the paper's Nesterov SGD
    (momentum 0.9, learning rate 0.7)."""
    initial = initial_weights()
    results = job("callback", mode, initial=initial)
    expected = reference(initial, 5, outer)
    for r in range(SIZE):
        assert_close(results[r]["weights"], expected[r])
    counts = results[0]["counts"]
    assert counts["produced"] == counts["applied"] == math.ceil(TOTAL / 5) == 3, counts


@pytest.mark.parametrize("name", sorted(MODES))
def test_the_inner_optimizer_state_stays_local_and_counts_inner_steps(name):
    """Adam's moments are not averaged (they differ between the replicas at the end, whose
    weights are identical), and each one's ``iterations`` (what a learning-rate schedule reads)
    counts every inner step."""
    results = job("callback", MODES[name])
    assert_replicas_identical(results)
    assert results[0]["iterations"] == results[1]["iterations"] == TOTAL
    moments = [not np.array_equal(a, b) for a, b in zip(results[0]["optimizer"], results[1]["optimizer"])]
    assert any(moments), "the replicas' Adam moments are identical: they were averaged"


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", sorted(MODES))
def test_every_outer_step_is_one_counted_contribution(frontend, name):
    for result in job(frontend, MODES[name]):
        counts = result["counts"]
        assert counts["produced"] == TOTAL // 4 == 3, counts  # 12 steps, period 4: no inner step counts
        assert counts["produced"] == counts["applied"] + counts["compensated"] + counts["dropped"] + counts["rejected"]
        assert counts["skipped"] == counts["rejected"] == 0, counts


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize(
    "mode,calls",
    [
        # the first step (nothing is known quiet yet) and each period's outer step (3 in 12 steps)
        (tfsync.DiLoCo(inner_steps=4), 1 + 3),
        # overlapped: each push (one step before its period's end) and each landing
        (tfsync.DiLoCo(inner_steps=4, overlap_steps=1), 1 + 3 + 3),
    ],
    ids=["diloco", "diloco-overlapped"],
)
def test_inner_steps_that_neither_push_nor_land_call_nothing_outside_the_graph(monkeypatch, frontend, mode, calls):
    """Only the steps that push or land call the engine (from the compiled step); the others are
    counted in it, and the protocol still sees every one of them (the outer steps come when due)."""
    made = []
    real = tfsync.engine.protocols.outer_path.exchange_periodically

    def counting(engine, inputs):
        def step(*args):
            made.append(engine().rank)
            return None

        tf.py_function(step, [], Tout=[])
        return real(engine, inputs)

    monkeypatch.setattr(tfsync.engine.protocols.outer_path, "exchange_periodically", counting)
    for result in job(frontend, mode):
        assert result["counts"]["produced"] == result["counts"]["applied"] == 3, result["counts"]
    assert sorted(made) == [0] * calls + [1] * calls, made


QUANTIZED = {
    "localsgd-int8": tfsync.LocalSGD(period=4, quantize="int8"),
    "diloco-int4": tfsync.DiLoCo(inner_steps=4, quantize="int4"),
}


@pytest.mark.parametrize("name", sorted(MODES) + sorted(QUANTIZED))
def test_a_period_with_a_gradient_that_is_not_finite_is_rejected(name):
    """Rank 1's third batch of every epoch overflows (steps 2 and 8): its guard skips those
    steps, and the contributions of its periods 1 and 3 (steps 0-3, 8-11) are rejected (it
    restarts from the others' average); the replicas stay identical and finite."""
    results = job("callback", {**MODES, **QUANTIZED}[name], overflow_at=2)
    c0, c1 = results[0]["counts"], results[1]["counts"]
    assert c1["rejected"] == 2 and c1["applied"] == 1 and c1["produced"] == 3, c1
    assert c0["rejected"] == 0 and c0["applied"] == 3, c0
    assert_replicas_identical(results, finite=True)
    for k in (3, 7, 11):  # every outer step, the rejected ones included
        assert all(np.array_equal(a, b) for a, b in zip(results[0]["steps"][k], results[1]["steps"][k]))


def test_the_trace_and_the_timeline_show_one_round_per_outer_step(tmp_path):
    """Period 5 over 12 steps: three outer steps per rank in the trace (the last one, for steps
    11-12, in the drain at the end), each applying its round; the timeline reads and plots it."""
    job("callback", tfsync.LocalSGD(period=5), trace_dir=str(tmp_path))
    trace = timeline.load_trace(str(tmp_path))
    summary = timeline.summarize(trace)
    assert summary["overall"]["max_clock_gap"] <= 1
    for r in range(SIZE):
        with open(os.path.join(tmp_path, f"rank{r}.jsonl")) as f:
            steps = [line for line in f if '"step"' in line and '"event"' not in line]
        assert len(steps) == 3, steps
    timeline.plot_timeline(trace, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_mixed_precision_loss_scaling_trains_under_local_steps(frontend):
    """A ``LossScaleOptimizer`` as the inner optimizer: it skips its own overflowed steps (none
    here), the replicas are identical after training and every outer step counted."""
    lso = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))  # noqa: E731
    results = job(frontend, tfsync.DiLoCo(inner_steps=4), make_optimizer=lso)
    assert_replicas_identical(results)
    assert results[0]["counts"]["applied"] == 3


ACCUMULATING = {
    "localsgd": (tfsync.LocalSGD(period=4), None),
    "diloco": (tfsync.DiLoCo(inner_steps=4), keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)),
}


def accumulating_adam():
    return keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)


@pytest.mark.parametrize("name", sorted(ACCUMULATING))
def test_with_gradient_accumulation_the_period_counts_updates(name):
    """Adam with ``gradient_accumulation_steps=2``, period 4 over 12 batches: 6 updates, an outer
    step after the 4th (batch 8) and a last one for updates 5-6; the weights match local
    training that accumulates the same way, the replicas are identical at the outer step and
    apart after each update between, and at a batch that only accumulates no weight moves."""
    mode, outer = ACCUMULATING[name]
    initial = initial_weights()
    results = job("callback", mode, initial=initial, make_optimizer=accumulating_adam)
    expected = reference(initial, 4, outer, accumulate=2)
    for r in range(SIZE):
        assert_close(results[r]["weights"], expected[r])
        assert results[r]["iterations"] == TOTAL // 2  # (Keras counts updates)
        counts = results[r]["counts"]
        assert counts["produced"] == counts["applied"] == 2 and counts["rejected"] == 0, counts
    steps0, steps1 = results[0]["steps"], results[1]["steps"]
    for k in range(TOTAL):
        same = all(np.array_equal(a, b) for a, b in zip(steps0[k], steps1[k]))
        # (identical before the first update, at the outer step and at the batch after it, which
        # only accumulates)
        assert same == (k in (0, 7, 8)), f"batch {k}: replicas {'identical' if same else 'apart'}"
        if k % 2 == 0 and k:  # (a batch that only accumulates)
            assert all(np.array_equal(a, b) for a, b in zip(steps0[k], steps0[k - 1])), k


def test_with_gradient_accumulation_a_batch_that_is_not_finite_rejects_its_period():
    """Rank 1's third batch of every epoch overflows (batches 2 and 8): its accumulator gets zeros
    for it (skipping it would move rank 1's updates off rank 0's), and both of its periods'
    contributions are rejected; every rank makes the same two outer steps, and the replicas end
    identical and finite."""
    results = job("callback", tfsync.LocalSGD(period=4), make_optimizer=accumulating_adam, overflow_at=2)
    c0, c1 = results[0]["counts"], results[1]["counts"]
    assert c1["produced"] == 2 and c1["rejected"] == 2 and c1["applied"] == 0, c1
    assert c0["produced"] == 2 and c0["applied"] == 2 and c0["rejected"] == 0, c0
    assert_replicas_identical(results, finite=True)
    assert results[1]["iterations"] == TOTAL // 2


def loss_scaled_accumulating_adam():
    return keras.optimizers.LossScaleOptimizer(accumulating_adam())


@pytest.mark.parametrize(
    "frontend,make_optimizer",
    [("strategy", accumulating_adam), ("callback", loss_scaled_accumulating_adam)],
    ids=["strategy", "callback-loss-scaled"],
)
def test_gradient_accumulation_is_refused_where_the_workers_updates_could_drift_apart(frontend, make_optimizer):
    """Under ``SyncStrategy`` (Keras all-reduces only at update batches) and under a
    ``LossScaleOptimizer`` (it skips an overflowed batch on its worker alone): every rank
    refuses before training."""
    fake = FakeCluster(SIZE, timeout_s=60)
    fns = [lambda r=r: fit_rank(fake.rank(r), frontend, "localsgd", make_optimizer=make_optimizer) for r in range(SIZE)]
    _, errors = on_threads(fns, JOIN_S)
    for e in errors:
        assert isinstance(e, ValueError) and "gradient_accumulation_steps=2" in str(e), e


def test_an_outer_learning_rate_schedule_counts_outer_steps():
    """Outer SGD whose schedule gives learning rate 1.0 at its first iteration and 0 after: the
    first outer step (after step 4) averages, the later ones (after steps 8 and 12) move
    nothing, so training ends on the first outer step's weights.  (Counting inner steps, the
    schedule would be past its boundary at the first outer step already.)"""
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(boundaries=[0], values=[1.0, 0.0])
    mode = tfsync.DiLoCo(inner_steps=4, outer_optimizer=keras.optimizers.SGD(learning_rate=schedule))
    results = job("callback", mode)
    for result in results:
        first = result["steps"][3]
        for a, b in zip(result["weights"], first):
            np.testing.assert_array_equal(a, b)
        assert not all(np.array_equal(a, b) for a, b in zip(result["steps"][2], first))  # (it moved there)


def test_raise_stops_every_rank_at_the_outer_step_of_the_period():
    """``on_nonfinite="raise"``: rank 1's third step overflows; the job stops at the end of
    that period (outer step 0), every rank's error naming rank 1 and the outer step."""
    fake = FakeCluster(SIZE, timeout_s=60)
    fns = [
        lambda r=r: fit_rank(fake.rank(r), "callback", MODES["localsgd"], on_nonfinite="raise", overflow_at=2)
        for r in range(SIZE)
    ]
    _, errors = on_threads(fns, JOIN_S)
    assert isinstance(errors[1], NonFiniteError), errors[1]
    assert "rank 1's outer-step pseudo-gradient" in str(errors[1]) and "step 0" in str(errors[1]), errors[1]
    assert isinstance(errors[0], NonFiniteError | WorkerLostError) and "rank 1" in str(errors[0]), errors[0]


STREAMING = {
    "tau2": tfsync.DiLoCo(inner_steps=4, overlap_steps=2),
    "tau1-mixing": tfsync.DiLoCo(inner_steps=4, overlap_steps=1, mixing=0.5),
}


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_overlapped_replicas_are_identical_when_each_round_lands(frontend):
    """DiLoCo(inner_steps=4, overlap_steps=2): a worker pushes after steps 2, 6, 10 and its
    round lands at steps 4, 8, 12; with mixing 0 the replicas are identical there (and
    apart at the steps between, the push steps included); one counted contribution each."""
    results = job(frontend, STREAMING["tau2"])
    steps0, steps1 = results[0]["steps"], results[1]["steps"]
    for k in range(TOTAL):
        same = all(np.array_equal(a, b) for a, b in zip(steps0[k], steps1[k]))
        assert same == ((k + 1) % 4 == 0), f"step {k}: identical={same}"
    assert_replicas_identical(results)
    for result in results:
        counts = result["counts"]
        assert counts["produced"] == counts["applied"] == 3 and counts["rejected"] == 0, counts


@pytest.mark.parametrize("name", sorted(STREAMING))
def test_overlapped_outer_steps_match_the_reference(name):
    """The pseudo-gradient is taken ``overlap_steps`` before the period's end, the steps after it
    are kept with the weight ``mixing`` when the round lands (0: dropped), and the job ends on
    ``w_outer``, identical everywhere."""
    mode = STREAMING[name]
    initial = initial_weights()
    results = job("callback", mode, initial=initial)
    outer = keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)
    expected = reference(initial, 4, outer, overlap=mode.overlap_steps, mixing=mode.mixing)
    for r in range(SIZE):
        assert_close(results[r]["weights"], expected[r])
    if mode.mixing:  # the replicas keep part of their own progress: apart after a round lands
        assert not all(np.array_equal(a, b) for a, b in zip(results[0]["steps"][3], results[1]["steps"][3]))


def test_an_overlapped_run_ending_mid_period_gets_a_last_outer_step():
    """inner_steps=5, overlap_steps=2 over 12 steps: pushes after steps 3 and 8, landing at 5
    and 10; steps 11-12 push nothing before the end, so the drain's last outer step takes them."""
    initial = initial_weights()
    results = job("callback", tfsync.DiLoCo(inner_steps=5, overlap_steps=2), initial=initial)
    outer = keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)
    expected = reference(initial, 5, outer, overlap=2)
    for r in range(SIZE):
        assert_close(results[r]["weights"], expected[r])
        assert results[r]["counts"]["produced"] == results[r]["counts"]["applied"] == 3


def test_an_overlapped_round_landing_is_traced_and_the_timeline_reads_it(tmp_path):
    """overlap_steps=2, period 4 over 12 steps: three outer-step records per rank (the pushes)
    and three apply events (the landings, each applying the round pushed before it)."""
    job("callback", STREAMING["tau2"], trace_dir=str(tmp_path))
    for r in range(SIZE):
        with open(os.path.join(tmp_path, f"rank{r}.jsonl")) as f:
            records = [json.loads(line) for line in f]
        steps = [x for x in records if "event" not in x]
        lands = [x for x in records if x.get("event") == "apply"]
        assert [x["step"] for x in steps] == [0, 1, 2], steps
        assert len(lands) == 3 and all(x["wait_s"] >= 0 for x in lands), lands
    summary = timeline.summarize(timeline.load_trace(str(tmp_path)))
    assert summary["overall"]["max_clock_gap"] <= 1


def test_overlapped_a_gradient_that_is_not_finite_rejects_only_a_contribution_it_reaches():
    """overlap_steps=2, period 4: rank 1's third batch of each epoch overflows (steps 2 and 8).
    Step 2 falls after the first push (step 1) and is dropped with that window when the round
    lands (mixing 0): no rejection; step 8 falls before the third push (step 9), whose
    contribution is rejected.  Replicas identical and finite at the end."""
    results = job("callback", STREAMING["tau2"], overflow_at=2)
    c0, c1 = results[0]["counts"], results[1]["counts"]
    assert c1["rejected"] == 1 and c1["applied"] == 2 and c1["produced"] == 3, c1
    assert c0["rejected"] == 0 and c0["applied"] == 3, c0
    assert_replicas_identical(results, finite=True)


def fragment_reference(initial, period, fragments):
    """Two replicas from ``initial``, each with its own Adam on its own shard; at inner step
    ``(p + 1)·period/fragments`` of each period, fragment ``p``'s pieces (``split_fragments``)
    averaged over the replicas (DiLoCo with outer ``SGD(1.0)``), and at the end the whole
    model; every replica's final weights."""
    models = []
    for _ in range(SIZE):
        m = keras.Sequential(layers())
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        m.set_weights(initial)
        models.append(m)
    pieces, parts = split_fragments([w.shape for w in initial], fragments)
    shards = [data(r) for r in range(SIZE)]
    loss = keras.losses.MeanSquaredError()

    def average(part):
        weights = [m.get_weights() for m in models]
        for k in part:
            i, rows = pieces[k]
            where = slice(None) if rows is None else slice(*rows)
            mean = np.mean([w[i][where] for w in weights], axis=0)
            for w in weights:
                w[i][where] = mean
        for m, w in zip(models, weights):
            m.set_weights(w)

    done = 0
    for _ in range(EPOCHS):
        for k in range(STEPS):
            local_step(models, shards, k, loss)
            done += 1
            for p in range(fragments):
                if done % period == ((p + 1) * period // fragments) % period:
                    average(parts[p])
    average(list(range(len(pieces))))  # (the last round: the whole model)
    return [m.get_weights() for m in models]


def test_fragments_take_their_outer_steps_in_turn_over_the_period():
    """DiLoCo(H=4, fragments=2) with outer SGD(1.0) (plain averaging) over 12 steps: the first
    fragment averaged at steps 2, 6, 10, the second at 4, 8, 12, each round carrying its
    fragment only, and a last round of the whole model (the first fragment trained on after
    step 10): the replicas' first fragment is identical after step 2 while the rest differs;
    the weights match that schedule applied to local training."""
    initial = initial_weights()
    mode = tfsync.DiLoCo(inner_steps=4, fragments=2, outer_optimizer=keras.optimizers.SGD(1.0))
    results = job("callback", mode, initial=initial)
    expected = fragment_reference(initial, 4, 2)
    for r in range(SIZE):
        assert_close(results[r]["weights"], expected[r])
        counts = results[r]["counts"]
        assert counts["produced"] == counts["applied"] == 7 and counts["rejected"] == 0, counts
    pieces, parts = split_fragments([w.shape for w in initial], 2)
    first = [k for k in parts[0]]
    after = results[0]["steps"][1], results[1]["steps"][1]  # (after step 2: the first fragment's outer step)
    for k in first:
        i, rows = pieces[k]
        where = slice(None) if rows is None else slice(*rows)
        np.testing.assert_array_equal(after[0][i][where], after[1][i][where])
    assert not all(np.array_equal(a, b) for a, b in zip(*after))  # (the second fragment: apart)
    assert_replicas_identical(results)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_overlapped_quantized_fragments_end_with_identical_replicas(frontend):
    """Fragments with their exchange overlapping an inner step and 4-bit codes: every fragment's
    round counted, a last round for the whole model (training ends mid-period), identical
    replicas."""
    results = job(frontend, tfsync.DiLoCo(inner_steps=5, fragments=2, overlap_steps=1, quantize="int4"))
    assert_replicas_identical(results, finite=True)
    for result in results:
        counts = result["counts"]
        # 12 steps, H = 5, P = 2: fragment rounds sent at steps 1, 4, 6, 9 and 11 (a step before their
        # outer steps at 2, 5, 7, 10, 12; the last lands in the drain), then the last round
        assert counts["produced"] == counts["applied"] == 6, counts


def test_a_model_too_small_for_its_fragments_is_refused_before_training():
    fake = FakeCluster(SIZE, timeout_s=60)
    mode = tfsync.DiLoCo(inner_steps=32, fragments=32)
    fns = [lambda r=r: fit_rank(fake.rank(r), "callback", mode) for r in range(SIZE)]
    _, errors = on_threads(fns, JOIN_S)
    for e in errors:
        assert isinstance(e, ValueError) and "fragments=32" in str(e) and "use fewer fragments" in str(e), e


def test_paced_fragments_train_as_unpaced_ones_do(monkeypatch):
    """DiLoCo with overlapped fragments on two fake ranks, its rounds in pieces (the piece size
    lowered to this small model), ends with the weights of the same run unpaced."""
    mode = tfsync.DiLoCo(inner_steps=6, fragments=2, overlap_steps=2, outer_optimizer=keras.optimizers.SGD(0.7))

    def wide():  # (about 2,600 values a fragment: several pieces of the lowered size)
        return [keras.Input((3,)), keras.layers.Dense(1024), keras.layers.Dense(1)]

    initial = initial_weights(wide)
    unpaced = job("callback", mode, make_layers=wide, initial=initial)
    calls = []
    real = pacing.paced_round

    def spy(collective, payload, *args, **kwargs):
        values = sum(int(np.prod(t.shape)) for t in payload)
        calls.append(len(pacing.piece_bounds(values, 4 * values, 2)))
        return real(collective, payload, *args, **kwargs)

    monkeypatch.setattr(pacing, "PIECE_BYTES", 256)
    monkeypatch.setattr(exchange, "paced_round", spy)
    paced = job("callback", mode, make_layers=wide, initial=initial)
    assert_replicas_identical(paced, finite=True)
    assert calls and max(calls) > 1, calls
    for a, b in zip(unpaced[0]["weights"], paced[0]["weights"]):
        np.testing.assert_array_equal(a, b)
    assert paced[0]["counts"] == unpaced[0]["counts"]
