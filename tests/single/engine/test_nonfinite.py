"""A contribution with a NaN or an infinity never reaches a replica: real engines on in-process ranks.

Each job runs N real ``SyncEngine``s on threads over :mod:`fake_cluster`, one
rank's contribution at one step poisoned (NaN or infinity), in every family
of modes: the gradient protocol with open rounds (BSP) and coordinated ones
(PSP, backup workers), the update protocol (SSP, DSSP, ElasticBSP), DC-S3GD's
corrected updates, and late gradients corrected under ``compensate=``.  Each
rank applies what it receives as a tiny optimizer would (plain SGD), so the
test holds every replica's weights.  The checks: every replica ends finite
and identical; each round's result is the mean (or sum) of exactly the
contributions its metadata says it aggregated, worked out here from what the
ranks pushed; the poisoned rank counts one ``rejected`` and produced =
applied + compensated + dropped + rejected on every rank; the trace names the
rank and the step; ``on_nonfinite="raise"`` stops every rank with an error
naming them.
"""

import json
import logging
import os
import time

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, assert_no_errors, on_threads

import tfsync
from tfsync.engine import NonFiniteError, SyncEngine, WorkerLostError, nonfinite
from tfsync.engine.protocols.compensated import Corrections
from tfsync.engine.settings import EngineSettings
from tfsync.policies import BSP, DSSP, PSP, SSP, BackupWorkers, DelayCompensation, ElasticBSP, resolve
from tfsync.stragglers import Stragglers

WIDTH = 4
LR = 0.1
WAIT_S = 15.0
JOIN_S = 45.0

pytestmark = pytest.mark.usefixtures("engines_on_localhost")
# the in-process collective sums with NumPy, which warns where finite contributions overflow
OVERFLOWS = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def contribution(rank, step):
    """Rank ``rank``'s gradient (or update) at ``step``: ``[1, 2^rank, step, rank]`` (a sum over a
    set of ranks counts and names them)."""
    return np.array([1.0, 2.0**rank, step, rank], np.float32)


def poisoned(value):
    g = contribution(0, 0)
    g[1] = value
    return g


class Job:
    """``size`` engines on threads, ``steps`` steps; ``bad``: {(rank, step): value} put into that
    rank's contribution at that step; ``delays[rank]``: seconds of computation per step (or a
    list of them, per step)."""

    def __init__(self, policy, size=3, steps=10, bad=None, delays=None, on_nonfinite="reject", trace_dir=None):
        self.policy, self.size, self.steps = policy, size, steps
        self.bad = dict(bad or {})
        self.delays = delays or [0.002] * size
        self.on_nonfinite, self.trace_dir = on_nonfinite, trace_dir
        self.updates = policy.payload != "gradients"  # (the model is a variable: its update is pushed)
        self.cluster = FakeCluster(size, timeout_s=15.0)
        self.pushed = [{} for _ in range(size)]  # step -> the contribution it pushed
        self.received = [{} for _ in range(size)]  # step -> the mean it applied (gradient protocol)
        # round -> (present, rejected, accepted, {rank: step of its late gradient}) from its metadata
        self.rounds = [{} for _ in range(size)]
        self.counts, self.weights, self.engines = [None] * size, [None] * size, [None] * size

    def gradient(self, rank, step):
        g = contribution(rank, step)
        if (rank, step) in self.bad:
            g[1] = self.bad[(rank, step)]
        return g

    def _train(self, rank):
        engine = SyncEngine(
            self.policy,
            EngineSettings(
                stragglers=Stragglers(), trace_dir=self.trace_dir, wait_timeout_s=WAIT_S, on_nonfinite=self.on_nonfinite
            ),
            cluster=self.cluster.rank(rank),
        )
        self.engines[rank] = engine
        var = tf.Variable(tf.zeros([WIDTH]))
        engine.start([var])
        pop = engine.exchange.pop

        def pop_and_note(round_):
            res = pop(round_)
            late = {int(k): int(res.late_steps[k]) for k in np.flatnonzero(res.late)}  # rank -> its late step
            self.rounds[rank][round_] = (res.present.copy(), res.rejected.copy(), res.accepted, late)
            return res

        engine.exchange.pop = pop_and_note
        for step in range(self.steps):
            if engine.begin_step():
                delay = self.delays[rank]
                time.sleep(delay[step] if isinstance(delay, list) else delay)
                g = self.gradient(rank, step)
                self.pushed[rank][step] = g
                if self.updates:
                    var.assign_add(g)  # the local optimizer's step: the update is g
                    engine.sync_step([])
                    continue
                (mean,) = engine.sync_step([tf.constant(g)])
            else:
                result = engine.skip_step()
                if self.updates:
                    continue
                (mean,) = result
            self.received[rank][step] = mean.numpy()
            var.assign_sub(LR * mean)  # the optimizer: plain SGD
        # as the frontends: one more mean gradient may come (late gradients held at the end)
        engine.finish(apply_mean=None if self.updates else (lambda mean: var.assign_sub(LR * mean[0])))
        self.counts[rank], self.weights[rank] = dict(engine.counts), var.numpy()
        engine.close()

    def run(self, expect_errors=False):
        _, errors = on_threads([lambda r=r: self._train(r) for r in range(self.size)], JOIN_S)
        if any(errors):
            for e in self.engines:  # stop what each engine started, without its collective close
                if e is not None and e.started:
                    e.started = False
                    e.exchange.close(timeout_s=0.5)
                    e.control.close()
                    if e.life.server is not None:
                        e.life.server.stop()
        if expect_errors:
            return errors
        for exc in errors:
            if exc is not None:
                raise exc
        return self

    def trace(self, rank):
        with open(os.path.join(self.trace_dir, f"rank{rank}.jsonl")) as f:
            return [json.loads(line) for line in f]


def check_replicas(job):
    """Every replica ends finite and identical, and every rank's counts add up."""
    for k in range(job.size):
        assert np.all(np.isfinite(job.weights[k])), (k, job.weights[k])
        np.testing.assert_array_equal(job.weights[k], job.weights[0])
        c = job.counts[k]
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] + c["rejected"], (k, c)
        assert c["rejected"] == sum(r == k for r, _ in job.bad), (k, c)


def check_gradient_rounds(job):
    """Every round's mean, on every rank, is the mean of the contributions its metadata says were
    present; a rejected rank is not among them (and, for a coordinated round, was taken)."""
    for r in range(job.steps):
        present, rejected, accepted, _ = job.rounds[0][r]
        for k in range(job.size):
            got_present, got_rejected, *_ = job.rounds[k][r]
            np.testing.assert_array_equal(got_present, present)
            np.testing.assert_array_equal(got_rejected, rejected)
        ranks = np.flatnonzero(present).tolist()
        for k in np.flatnonzero(rejected).tolist():
            assert (k, r) in job.bad and k not in ranks, (k, r)
            if job.policy.coordinated:
                assert k in accepted, (k, r, accepted)
        want = np.mean([job.pushed[k][r] for k in ranks], axis=0) if ranks else np.zeros(WIDTH)
        for k in range(job.size):
            if r in job.received[k]:
                np.testing.assert_allclose(job.received[k][r], want, rtol=1e-6, err_msg=f"round {r}, rank {k}")
    taken = {(k, r) for r in range(job.steps) for k in np.flatnonzero(job.rounds[0][r][1]).tolist()}
    return taken


# ------------------------------------------------------------------ gradient protocol


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_bsp_leaves_a_poisoned_gradient_out_and_averages_the_rest(value, tmp_path):
    job = Job(BSP(), bad={(1, 3): value}, trace_dir=str(tmp_path)).run()
    check_replicas(job)
    assert check_gradient_rounds(job) == {(1, 3)}
    present, rejected, *_ = job.rounds[0][3]
    assert present.tolist() == [1.0, 0.0, 1.0] and rejected.tolist() == [0.0, 1.0, 0.0]
    # the mean over the two present ranks, not their sum over three
    np.testing.assert_allclose(job.received[0][3], (contribution(0, 3) + contribution(2, 3)) / 2, rtol=1e-6)
    assert job.counts[1] == {
        "produced": 10,
        "applied": 9,
        "compensated": 0,
        "dropped": 0,
        "rejected": 1,
        "lost": 0,
        "skipped": 0,
    }
    # the trace names the rank and the step, and the step's record counts it
    events = [r for r in job.trace(1) if r.get("event") == "rejected"]
    assert [(e["rank"], e["step"], e["what"], e["tensors"]) for e in events] == [(1, 3, "gradients", [0])]
    steps = {r["step"]: r for r in job.trace(1) if "step" in r and "event" not in r}
    assert [s for s, r in steps.items() if r["rejected"]] == [3] and steps[3]["rejected"] == 1
    assert not [r for r in job.trace(0) if r.get("event") == "rejected"]


def test_a_round_whose_every_contribution_was_rejected_moves_no_replica():
    job = Job(BSP(), size=2, bad={(0, 2): np.nan, (1, 2): np.inf}).run()
    check_replicas(job)
    assert job.rounds[0][2][0].tolist() == [0.0, 0.0]
    for k in range(2):
        np.testing.assert_array_equal(job.received[k][2], np.zeros(WIDTH))  # the mean of nothing


@OVERFLOWS
def test_finite_gradients_whose_sum_overflows_reject_their_round_on_every_rank(tmp_path, caplog):
    # BSP checks the round's sum, not each contribution: each of these is finite, their sum is
    # not; the redone round (each rank's own contribution checked) overflows again
    with caplog.at_level(logging.WARNING, logger="tfsync.nonfinite"):
        job = Job(BSP(), size=2, bad={(0, 3): 3e38, (1, 3): 3e38}, trace_dir=str(tmp_path)).run()
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfsync.nonfinite"]
    assert len(warnings) == 2 and all("the round was rejected on every worker" in w for w in warnings), warnings
    check_replicas(job)
    assert check_gradient_rounds(job) == {(0, 3), (1, 3)}
    for k in range(2):
        np.testing.assert_array_equal(job.received[k][3], np.zeros(WIDTH))
        events = [r for r in job.trace(k) if r.get("event") == "rejected"]
        assert [(e["rank"], e["step"], e["round"], e["tensors"]) for e in events] == [(k, 3, 3, [0])]
        assert "overflowed" in events[0]["what"], events[0]


@OVERFLOWS
def test_a_poisoned_gradient_beside_an_overflowing_sum_is_named_as_its_own(tmp_path):
    # rank 0's NaN is found when the sum is not finite; without it, ranks 1 and 2 still overflow
    job = Job(BSP(), size=3, bad={(0, 4): np.nan, (1, 4): 3e38, (2, 4): 3e38}, trace_dir=str(tmp_path)).run()
    check_replicas(job)
    assert check_gradient_rounds(job) == {(0, 4), (1, 4), (2, 4)}
    whats = [[e["what"] for e in job.trace(k) if e.get("event") == "rejected"] for k in range(3)]
    assert whats[0] == ["gradients"] and all("overflowed" in w[0] and len(w) == 1 for w in whats[1:]), whats


@OVERFLOWS
def test_with_raise_an_overflowing_sum_stops_every_rank_saying_so():
    job = Job(BSP(), size=2, bad={(0, 3): 3e38, (1, 3): 3e38}, on_nonfinite="raise")
    errors = job.run(expect_errors=True)
    for exc in errors:
        assert isinstance(exc, NonFiniteError) and "round 3's gradients overflowed" in str(exc), exc


@pytest.mark.parametrize(
    "policy, bad_rank, taken",
    [
        (PSP(min_contributions=2, push_timeout_s=0.0), 0, True),  # ready: enters with its zeros
        (PSP(min_contributions=2, push_timeout_s=0.0), 2, False),  # the slow rank: rounds close without it
        (PSP(min_contributions=3), 1, True),  # waits for every rank
        (BackupWorkers(backups=1), 0, False),  # (among the first two, nearly always)
        (BackupWorkers(backups=0), 1, True),  # waits for every rank, each entering on its answer
    ],
    ids=["psp-fast", "psp-slow", "psp-all", "backup-fast", "backup-0"],
)
def test_coordinated_rounds_take_a_rejected_contribution_as_zeros_or_close_without_it(policy, bad_rank, taken):
    delays = [0.002, 0.004, 0.03]  # rank 2 is slow: PSP and backup workers close rounds without it
    job = Job(policy, steps=12, delays=delays, bad={(bad_rank, 5): np.nan})
    if bad_rank == 2:  # it computes only some steps: poison the first it computes from step 4 on
        job.gradient = _first_computed_from(job, bad_rank, 4)
    job.run()
    check_replicas(job)
    took = check_gradient_rounds(job)  # (a rejected one a round took: in its closing, not in its mean)
    assert took <= set(job.bad) and len(job.bad) == 1
    if taken:
        assert took == set(job.bad), (took, job.bad)


def _first_computed_from(job, rank, step):
    """A ``Job.gradient`` that poisons ``rank``'s first computed step from ``step`` on (and records
    it in ``job.bad``)."""
    job.bad.clear()
    plain = Job.gradient.__get__(job)

    def gradient(k, s):
        g = plain(k, s)
        if k == rank and s >= step and not any(b[0] == rank for b in job.bad):
            job.bad[(k, s)] = np.nan
            g[1] = np.nan
        return g

    return gradient


def test_every_coordinated_rank_rejected_in_one_round_leaves_zeros_and_the_next_rounds_right():
    job = Job(PSP(min_contributions=2), size=2, bad={(0, 3): np.nan, (1, 3): np.inf}).run()
    check_replicas(job)
    assert check_gradient_rounds(job) == {(0, 3), (1, 3)}
    np.testing.assert_array_equal(job.received[0][3], np.zeros(WIDTH))


# ------------------------------------------------------------------ update protocol


@pytest.mark.parametrize(
    "policy",
    [SSP(staleness=2), DSSP(low=1, high=3), ElasticBSP(lookahead=3)],
    ids=["ssp", "dssp", "elasticbsp"],
)
@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_the_update_protocol_takes_a_poisoned_update_back_and_sums_the_rest(policy, value):
    job = Job(policy, steps=12, bad={(1, 5): value}, delays=[0.001, 0.003, 0.002])
    if isinstance(policy, ElasticBSP):  # rank 1 may skip step 5: poison the first it computes from 5 on
        job.gradient = _first_computed_from(job, 1, 5)
    job.run()
    check_replicas(job)
    assert len(job.bad) == 1
    # every replica holds w̄: the sum of every update pushed but the rejected one, over N
    want = sum(
        (g.astype(np.float64) for k in range(job.size) for s, g in job.pushed[k].items() if (k, s) not in job.bad),
        np.zeros(WIDTH),
    )
    np.testing.assert_allclose(job.weights[0], want / job.size, rtol=1e-5)
    (bad_rank, bad_step) = next(iter(job.bad))
    present, rejected, *_ = job.rounds[0][bad_step]
    assert present[bad_rank] == 0.0 and rejected[bad_rank] == 1.0


# ------------------------------------------------------------------ DC-S3GD


def test_dcs3gd_rejects_an_update_that_is_not_finite_and_moves_that_worker_back_to_the_average():
    size, steps, bad = 3, 8, (2, 4)
    cluster = FakeCluster(size, timeout_s=15.0)
    counts, final, updates = [None] * size, [None] * size, [{} for _ in range(size)]

    def train(rank):
        engine = SyncEngine(
            resolve("dcs3gd"),
            EngineSettings(stragglers=Stragglers(), wait_timeout_s=WAIT_S),
            cluster=cluster.rank(rank),
        )
        var = tf.Variable(np.linspace(-1.0, 1.0, WIDTH).astype(np.float32))
        engine.start([var])
        for step in range(steps):
            time.sleep(0.001 * (rank + 1))
            g = contribution(rank, step) * 0.1 + 0.5 * var.numpy()
            if (rank, step) == bad:
                g[2] = np.nan
            (corrected,) = engine.find(Corrections).correct([tf.constant(g)])
            before = var.numpy().copy()
            var.assign_sub(LR * corrected)  # the optimizer: plain SGD
            updates[rank][step] = var.numpy() - before
            engine.sync_step([])
            assert np.all(np.isfinite(var.numpy())), (rank, step)  # never left at a NaN
        engine.finish()
        counts[rank], final[rank] = dict(engine.counts), var.numpy()
        engine.close()

    _, errors = on_threads([lambda r=r: train(r) for r in range(size)], JOIN_S)
    for exc in errors:
        if exc is not None:
            raise exc
    for k in range(size):
        assert np.all(np.isfinite(final[k]))
        np.testing.assert_array_equal(final[k], final[0])
        c = counts[k]
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] + c["rejected"] == steps, c
        assert c["rejected"] == (k == bad[0]), (k, c)
    # w̄: the initial weights plus each round's mean over the ranks present (round 4 without rank 2)
    w = np.linspace(-1.0, 1.0, WIDTH).astype(np.float64)
    for step in range(steps):
        ranks = [k for k in range(size) if (k, step) != bad]
        w = w + np.mean([updates[k][step] for k in ranks], axis=0)
    np.testing.assert_allclose(final[0], w, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ late contributions (compensate=)


@pytest.mark.parametrize(
    "policy",
    [
        BackupWorkers(backups=1, compensate=DelayCompensation(lam=0.5)),
        PSP(min_contributions=2, push_timeout_s=0.0, compensate=DelayCompensation(lam=0.5)),
    ],
    ids=["backup", "psp"],
)
@pytest.mark.parametrize("held_to_the_end", [False, True], ids=["offered-in-a-step", "in-the-final-round"])
def test_a_late_gradient_whose_correction_overflows_is_rejected_not_offered(policy, held_to_the_end, tmp_path):
    # rank 2 is slow at one step, so its gradient misses that round and is corrected
    # (g + λ·g⊙g⊙Δw) when offered later: at a later step once it has caught up by skipping, or,
    # for the last step, in the final round.  The gradient is finite but so large that its
    # correction overflows: it must be rejected, never offered
    slow, steps = 2, 30
    late_step = steps - 1 if held_to_the_end else 3
    # the slow rank is faster than the others until its late step (so, even on a loaded machine,
    # no round closes before it computes that step, which it would then skip), then late
    delays = [0.02, 0.02, [0.25 if s == late_step else 0.0 for s in range(steps)]]
    job = Job(policy, steps=steps, delays=delays, trace_dir=str(tmp_path))
    plain = Job.gradient.__get__(job)

    def gradient(k, s):
        g = plain(k, s)
        if (k, s) == (slow, late_step):
            g[0] = 1e30  # (g⊙g overflows float32)
        return g

    job.gradient = gradient
    job.run()
    assert late_step in job.pushed[slow], "the slow rank skipped its late step: the test needs it computed"
    assert job.rounds[0][late_step][0][slow] == 0.0, "the slow gradient was taken on time: the test needs it late"
    for k in range(job.size):
        assert np.all(np.isfinite(job.weights[k])), (k, job.weights[k])
        np.testing.assert_array_equal(job.weights[k], job.weights[0])
        c = job.counts[k]
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] + c["rejected"], (k, c)
        assert c["rejected"] == (k == slow), (k, c)
    (event,) = [r for r in job.trace(slow) if r.get("event") == "rejected"]
    assert event["rank"] == slow and event["step"] == late_step and event["what"].startswith("late gradient")
    if held_to_the_end:
        assert event["offered_at"] == steps, event  # the final round's
        assert not [r for r in job.trace(slow) if r.get("event") == "final_round"]  # no holder was left
    else:
        assert late_step < event["offered_at"] < steps, event
    # no round took it (the other late gradients, finite, are compensated as usual)
    assert not any(job.rounds[0][r][3].get(slow) == late_step for r in job.rounds[0]), job.rounds[0]


# ------------------------------------------------------------------ on_nonfinite="raise"


@pytest.mark.parametrize(
    "policy",
    [BSP(), PSP(min_contributions=2, push_timeout_s=0.0), SSP(staleness=1), "dcs3gd"],
    ids=["bsp", "psp", "ssp", "dcs3gd"],
)
def test_raise_stops_every_rank_naming_the_rank_and_the_step(policy):
    if policy == "dcs3gd":
        policy = tfsync.DCS3GD()
        job = _DCRaise(bad=(1, 3))
    else:
        job = Job(policy, bad={(1, 3): np.nan}, on_nonfinite="raise")
    errors = job.run(expect_errors=True)
    assert isinstance(errors[1], NonFiniteError), errors[1]
    assert "rank 1's" in str(errors[1]) and "step 3" in str(errors[1]), errors[1]
    for k in (0, 2):
        # from the round's metadata, or from rank 1's stop notice where no round took its row
        assert isinstance(errors[k], NonFiniteError | WorkerLostError), errors[k]
        assert "rank 1" in str(errors[k]) and "step 3" in str(errors[k]), errors[k]
    if isinstance(policy, BSP):  # the round completed with rank 1's zeros: every rank read it there
        assert all(isinstance(e, NonFiniteError) for e in errors)


class _DCRaise:
    """DC-S3GD under ``on_nonfinite="raise"``, rank ``bad[0]``'s gradient NaN at step ``bad[1]``."""

    def __init__(self, bad, size=3, steps=8):
        self.bad, self.size, self.steps = bad, size, steps
        self.cluster = FakeCluster(size, timeout_s=15.0)
        self.engines = [None] * size

    def _train(self, rank):
        engine = SyncEngine(
            resolve("dcs3gd"),
            EngineSettings(stragglers=Stragglers(), wait_timeout_s=WAIT_S, on_nonfinite="raise"),
            cluster=self.cluster.rank(rank),
        )
        self.engines[rank] = engine
        var = tf.Variable(tf.zeros([WIDTH]))
        engine.start([var])
        for step in range(self.steps):
            g = contribution(rank, step)
            if (rank, step) == self.bad:
                g[0] = np.nan
            (corrected,) = engine.find(Corrections).correct([tf.constant(g)])
            var.assign_sub(LR * corrected)
            engine.sync_step([])
        engine.finish()
        engine.close()

    run = Job.run


# ------------------------------------------------------------------ settings and warnings


def test_on_nonfinite_takes_reject_or_raise_and_says_so():
    with pytest.raises(ValueError, match=r"on_nonfinite='ignore' is not one of \['reject', 'raise'\]"):
        SyncEngine(resolve("bsp"), EngineSettings(on_nonfinite="ignore"))
    assert SyncEngine(resolve("bsp"), EngineSettings()).on_nonfinite == "reject"


def test_each_rejection_is_logged_as_a_warning_at_most_once_per_interval(caplog, monkeypatch):
    monkeypatch.setattr(nonfinite, "WARN_INTERVAL_S", 3600.0)
    with caplog.at_level(logging.WARNING, logger="tfsync.nonfinite"):
        job = Job(BSP(), size=2, steps=8, bad={(1, 2): np.nan, (1, 4): np.nan, (1, 5): np.inf}).run()
    check_replicas(job)
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfsync.nonfinite"]
    assert len(warnings) == 1, warnings  # the others within the interval: counted, not logged
    assert "rank 1 rejected its gradients at step 2" in warnings[0], warnings
    monkeypatch.setattr(nonfinite, "WARN_INTERVAL_S", 0.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfsync.nonfinite"):
        Job(BSP(), size=2, steps=8, bad={(1, 2): np.nan, (1, 4): np.nan}).run()
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfsync.nonfinite"]
    assert [("step 2" in w, "step 4" in w) for w in warnings] == [(True, False), (False, True)], warnings


# ------------------------------------------------------------------ through SyncCallback and model.fit


def _fit_with_a_poisoned_batch(mode, on_nonfinite, size=2, steps=6, bad=(1, 2), optimizer=None, value=np.nan):
    """Each rank fits a small regression with ``SyncCallback(mode, on_nonfinite=...)`` on the fake
    cluster; rank ``bad[0]``'s batch ``bad[1]`` has a NaN input (or ``value``).  ``(results, errors)`` per rank,
    a result being ``(weights, counts, history)``; ``optimizer``: a function returning the
    Keras optimizer (default plain SGD)."""
    fake = FakeCluster(size, timeout_s=60)

    def fit(rank):
        import keras

        rng = np.random.default_rng(rank)
        x = rng.normal(size=(4 * steps, 3)).astype(np.float32)
        y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
        if rank == bad[0]:
            x[4 * bad[1], 1] = value
        keras.utils.set_random_seed(0)  # (the same initial weights; the callback broadcasts rank 0's anyway)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.05), loss="mse")
        sync = tfsync.keras.SyncCallback(mode, cluster=fake.rank(rank), wait_timeout_s=30, on_nonfinite=on_nonfinite)
        history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[sync])
        return model.get_weights(), sync.counts, history.history

    return on_threads([lambda r=r: fit(r) for r in range(size)], 120.0)


# PSP through its coordinator, every contribution awaited: with c = 1 of 2 a round may close before
# the poisoned batch's step, which the slow rank then skips (a skip, not a rejection: which one
# happens would depend on the machine's load, and this test counts the rejection)
@pytest.mark.parametrize(
    "mode", ["bsp", tfsync.PSP(min_contributions=2), "ssp", "dcs3gd"], ids=["bsp", "psp", "ssp", "dcs3gd"]
)
def test_sync_callback_rejects_a_nan_batch_and_logs_it(mode):
    results, errors = _fit_with_a_poisoned_batch(mode, "reject")
    assert_no_errors(errors)
    weights = [w for w, _, _ in results]
    for w in weights:
        for a, b in zip(w, weights[0]):
            assert np.all(np.isfinite(a))
            np.testing.assert_array_equal(a, b)
    rejected = [counts["rejected"] for _, counts, _ in results]
    assert rejected == [0, 1], rejected  # the poisoned batch's contribution, and only it
    for _, c, history in results:
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] + c["rejected"], c
        assert history["tfsync_rejected"] == [sum(rejected) / 2]  # the epoch logs, averaged over the two ranks


@pytest.mark.parametrize(
    "mode",
    ["ssp", "dssp", "dcs3gd", tfsync.DCS3GD(tfsync.DelayCompensation(lam=2.0, adaptive=True))],
    ids=["ssp", "dssp", "dcs3gd", "dcs3gd-adaptive"],
)
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_a_nan_batch_leaves_the_optimizer_of_a_mode_that_applies_its_own_gradients_untouched(mode, optimizer):
    # these modes run the optimizer on the worker's own gradients before the exchange: a NaN
    # there would stay in its slots (momentum, Adam's moments, DC-ASGD-a's v) and every later
    # update of that worker would be NaN and rejected too; the step is skipped instead
    import keras

    make = {"momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9), "adam": lambda: keras.optimizers.Adam(0.01)}
    results, errors = _fit_with_a_poisoned_batch(mode, "reject", steps=8, optimizer=make[optimizer])
    assert_no_errors(errors)
    rejected = [counts["rejected"] for _, counts, _ in results]
    assert rejected == [0, 1], rejected
    weights = [w for w, _, _ in results]
    for w in weights:
        for a, b in zip(w, weights[0]):
            assert np.all(np.isfinite(a))
            np.testing.assert_array_equal(a, b)
    for _, c, _ in results:
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] + c["rejected"], c


@pytest.mark.parametrize("adaptive", [False, True], ids=["constant", "adaptive"])
def test_a_gradient_whose_dcs3gd_correction_overflows_reaches_no_optimizer(adaptive):
    # a finite gradient of about 1e30 (one input of 1e15): its correction
    # g + lam * g * g * (w_now - w_stale) overflows float32 although the gradient is finite, and
    # must reach neither the momentum slot nor, adaptive, DC-ASGD-a's v
    import keras

    mode = tfsync.DCS3GD(tfsync.DelayCompensation(lam=0.04, adaptive=adaptive))
    results, errors = _fit_with_a_poisoned_batch(
        mode, "reject", steps=8, optimizer=lambda: keras.optimizers.SGD(0.05, momentum=0.9), value=1e15
    )
    assert_no_errors(errors)
    assert [counts["rejected"] for _, counts, _ in results] == [0, 1]
    weights = [w for w, _, _ in results]
    for w in weights:
        for a, b in zip(w, weights[0]):
            assert np.all(np.isfinite(a))
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["ssp", "dcs3gd"])
def test_under_sync_strategy_a_nan_batch_reaches_no_optimizer_slot(mode):
    # SyncStrategy hands the optimizer zeros for such a step (its all-reduce is the hook; the
    # optimizer's apply is Keras' own), and the engine rejects the step's contribution
    import keras

    fake, steps = FakeCluster(2, timeout_s=60), 8

    def fit(rank):
        rng = np.random.default_rng(rank)
        x = rng.normal(size=(4 * steps, 3)).astype(np.float32)
        y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
        if rank == 1:
            x[4 * 2, 1] = np.nan
        strategy = tfsync.distribute.SyncStrategy(mode, cluster=fake.rank(rank), wait_timeout_s=30)
        try:
            with strategy.scope():
                model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
                model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
            rejected = strategy.engine.counts["rejected"]
            strategy.finish()
        finally:
            if strategy.engine is not None:
                strategy.engine.abandon()
        return [v.numpy() for v in model.variables + list(model.optimizer.variables)], rejected

    results, errors = on_threads([lambda r=r: fit(r) for r in range(2)], 120.0)
    assert_no_errors(errors)
    assert [rejected for _, rejected in results] == [0, 1]
    for variables, _ in results:
        for v in variables:
            assert np.all(np.isfinite(v)), variables  # weights and Adam's moments
    weights = [variables[:4] for variables, _ in results]  # the two Dense layers' kernels and biases
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)


def test_sync_callback_with_raise_stops_every_rank_naming_the_rank_and_step():
    _, errors = _fit_with_a_poisoned_batch("bsp", "raise")
    for e in errors:
        assert isinstance(e, NonFiniteError), errors
        assert "rank 1" in str(e) and "step 2" in str(e), e


def test_the_frontends_check_on_nonfinite_when_they_are_built():
    with pytest.raises(ValueError, match="on_nonfinite='skip' is not one of"):
        tfsync.keras.SyncCallback("bsp", on_nonfinite="skip")
    with pytest.raises(ValueError, match="on_nonfinite='skip' is not one of"):
        tfsync.distribute.SyncStrategy("bsp", on_nonfinite="skip", cluster=FakeCluster(1).rank(0))


def test_the_timeline_summary_counts_the_rejected_contributions(tmp_path):
    from tfsync import timeline

    job = Job(BSP(), size=2, steps=8, bad={(1, 2): np.nan, (1, 5): np.inf}, trace_dir=str(tmp_path)).run()
    check_replicas(job)
    summary = timeline.summarize(timeline.load_trace(str(tmp_path)))
    assert [summary["ranks"][k]["rejected"] for k in (0, 1)] == [0, 2], summary["ranks"]
    assert summary["overall"]["rejected"] == 2
    assert timeline.summarize(timeline.load_trace(str(tmp_path)), start_step=3)["ranks"][1]["rejected"] == 1
    table = timeline.format_summary(summary)
    assert "rejected" in table.splitlines()[1], table
