"""Delay compensation and DC-S3GD: settings, and real engines on in-process ranks.

The DC-S3GD jobs run N real ``SyncEngine`` s on threads over the fake cluster
(:mod:`fake_cluster`); each rank's loop is a tiny training loop with plain SGD
as the optimizer: compute a gradient at its weights, ``correct_gradients``,
``w -= lr * g̃``, ``sync_step``.  The test keeps its own record of what every
rank computed and received and works out from it, with NumPy, what the
engine must have used and produced; the values the correction actually
consumed are read off the protocol's variables at the moment it runs.
"""

import random
import time

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, on_threads

import tfsync
from tfsync import timeline
from tfsync.engine import SyncEngine
from tfsync.engine.protocols.compensated import Corrections
from tfsync.engine.settings import EngineSettings
from tfsync.policies import DCS3GD, DelayCompensation, resolve
from tfsync.stragglers import Stragglers

WIDTH = 4
LR = 0.1
JOIN_S = 45.0


# real engines on localhost, without stragglers from the environment (conftest.py)
pytestmark = pytest.mark.usefixtures("engines_on_localhost")


# ------------------------------------------------------------------- settings


def test_defaults_are_dc_asgds():
    assert DelayCompensation().strength == 0.04
    assert DelayCompensation(adaptive=True).strength == 2.0
    assert DelayCompensation(lam=0).strength == 0.0
    assert resolve("dcs3gd") == DCS3GD()
    assert tfsync.DCS3GD().compensation == DelayCompensation()


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(lam=-0.1), ValueError, ">= 0"),
        (dict(lam=float("nan")), ValueError, "finite"),
        (dict(lam="big"), TypeError, "number"),
        (dict(adaptive=True, momentum=1.0), ValueError, "< 1"),
        (dict(adaptive=True, momentum=-0.5), ValueError, ">= 0"),
        (dict(adaptive="yes"), TypeError, "True or False"),
        (dict(epsilon=0.0), ValueError, "> 0"),
    ],
)
def test_bad_compensation_settings_say_what_and_how(kwargs, error, words):
    with pytest.raises(error) as info:
        DelayCompensation(**kwargs)
    message = str(info.value)
    assert words in message and "e.g. tfsync.DelayCompensation(" in message, message


def test_dcs3gd_takes_only_a_delay_compensation():
    with pytest.raises(TypeError, match="must be a tfsync.DelayCompensation"):
        DCS3GD(compensation=0.04)


# ------------------------------------------------------------------ DC-S3GD jobs


def gradient_at(rank, step, w):
    """A gradient that depends on the weights it was computed at (so staleness matters)."""
    return (np.array([1.0, -0.5, 0.25, 2.0], np.float32) * (rank + 1) + 0.3 * step + 0.8 * w).astype(np.float32)


class DCJob:
    def __init__(self, policy, size=3, steps=8, seed=0, max_delay_s=0.02):
        rng = random.Random(seed)
        self.policy, self.size, self.steps = policy, size, steps
        self.delays = [[rng.uniform(0.0, max_delay_s) for _ in range(steps)] for _ in range(size)]
        self.w0 = np.linspace(-1.0, 1.0, WIDTH).astype(np.float32)
        self.cluster = FakeCluster(size, timeout_s=15.0)
        self.records = [[] for _ in range(size)]  # (step, w, g, g̃, w_bar used, w_local used)
        self.counts, self.final = [None] * size, [None] * size

    def _train(self, rank):
        engine = SyncEngine(
            self.policy, EngineSettings(stragglers=Stragglers(), wait_timeout_s=15.0), cluster=self.cluster.rank(rank)
        )
        var = tf.Variable(self.w0)
        engine.start([var])
        protocol, used = engine.protocol, {}
        original = protocol.correct

        def recording_correct(grads, mean):  # what the op read: w̄ after the mean was added
            out = original(grads, mean)
            used["w_bar"] = protocol.w_bar[0].numpy().copy()
            used["w_local"] = protocol.w_local[0].numpy().copy()
            return out

        protocol.correct = recording_correct
        for step in range(self.steps):
            w = var.numpy().copy()
            time.sleep(self.delays[rank][step])
            g = gradient_at(rank, step, w)
            (corrected,) = engine.find(Corrections).correct([tf.constant(g)])
            corrected = corrected.numpy()
            var.assign_sub(LR * corrected)  # the optimizer: plain SGD
            engine.sync_step([])
            self.records[rank].append((step, w, g, corrected, used["w_bar"], used["w_local"]))
        engine.finish()
        self.counts[rank], self.final[rank] = dict(engine.counts), var.numpy()
        engine.close()

    def run(self):
        _, errors = on_threads([lambda r=r: self._train(r) for r in range(self.size)], JOIN_S)
        for exc in errors:
            if exc is not None:
                raise exc
        return self

    def expected_w_bar(self):
        """``w̄`` before each step, from the updates the ranks made: ``w0 + Σ_{k<t} mean_j Δ_j^k``."""
        w_bar = [self.w0.astype(np.float64)]
        for step in range(self.steps):
            mean_update = np.mean([-LR * self.records[r][step][3].astype(np.float64) for r in range(self.size)], axis=0)
            w_bar.append(w_bar[-1] + mean_update)
        return w_bar


@pytest.mark.parametrize("seed", [0, 1])
def test_dcs3gd_corrects_each_gradient_with_the_average_and_its_own_weights(seed):
    lam = 0.5
    job = DCJob(DCS3GD(DelayCompensation(lam=lam)), seed=seed).run()
    w_bar = job.expected_w_bar()
    for rank in range(job.size):
        for step, w, g, corrected, used_bar, used_local in job.records[rank]:
            # w_stale: the weights this rank computed the gradient at
            np.testing.assert_allclose(used_local, w, rtol=0, atol=1e-6)
            # w_now: the average after every round of the steps before this one (staleness 1)
            np.testing.assert_allclose(used_bar, w_bar[step], rtol=0, atol=1e-5)
            expected = g + lam * g * g * (used_bar.astype(np.float64) - used_local)
            np.testing.assert_allclose(corrected, expected, rtol=1e-5, atol=1e-6)
            if step == 0:  # nothing in flight yet: w̄ is the initial weights, no correction
                np.testing.assert_array_equal(corrected, g)
        # the local weights: w_i = w̄ + Δ_i (equation 12) at every step after the first
        for (step, w, *_), prev in zip(job.records[rank][1:], job.records[rank]):
            np.testing.assert_allclose(w, w_bar[step - 1] - LR * prev[3], rtol=0, atol=1e-5)
    for rank in range(job.size):
        np.testing.assert_array_equal(job.final[rank], job.final[0])
        assert job.counts[rank] == {
            "produced": job.steps,
            "applied": 1,  # step 0: computed at w̄ itself
            "compensated": job.steps - 1,
            "dropped": 0,
            "rejected": 0,
            "lost": 0,
            "skipped": 0,
        }, job.counts[rank]
    np.testing.assert_allclose(job.final[0], w_bar[-1], rtol=0, atol=1e-5)


def test_dcs3gd_with_lambda_zero_applies_the_gradients_uncorrected():
    job = DCJob(DCS3GD(DelayCompensation(lam=0.0)), seed=2).run()
    for rank in range(job.size):
        for _, _, g, corrected, _, _ in job.records[rank]:
            np.testing.assert_array_equal(corrected, g)
    np.testing.assert_allclose(job.final[0], job.expected_w_bar()[-1], rtol=0, atol=1e-5)


def test_dcs3gd_adaptive_follows_dc_asgd_a():
    comp = DelayCompensation(lam=1.5, adaptive=True, momentum=0.9, epsilon=1e-7)
    job = DCJob(DCS3GD(comp), size=2, steps=6, seed=3).run()
    for rank in range(job.size):
        v = np.zeros(WIDTH, np.float64)
        for _, _, g, corrected, used_bar, used_local in job.records[rank]:
            g64 = g.astype(np.float64)
            v = comp.momentum * v + (1 - comp.momentum) * g64 * g64
            lam_t = comp.lam / np.sqrt(v + comp.epsilon)
            expected = g64 + lam_t * g64 * g64 * (used_bar.astype(np.float64) - used_local)
            np.testing.assert_allclose(corrected, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(job.final[1], job.final[0])


def test_sync_step_before_the_correction_is_refused():
    cluster = FakeCluster(1, timeout_s=5.0)
    engine = SyncEngine(
        resolve("dcs3gd"), EngineSettings(stragglers=Stragglers(), wait_timeout_s=5.0), cluster=cluster.rank(0)
    )
    engine.start([tf.Variable(np.zeros(WIDTH, np.float32))])
    try:
        with pytest.raises(RuntimeError, match="before SyncEngine.sync_step"):
            engine.sync_step([])
    finally:
        engine.close()


# ---------------------------------------------- PSP and backup workers with compensate=


class LateJob:
    """Coordinated rounds with ``compensate=``: rank ``slow`` takes ``slow_s`` per step, the
    others ``fast_s``; every rank applies each round's mean with plain SGD."""

    def __init__(self, policy, size=3, steps=14, slow=2, fast_s=0.01, slow_s=0.045, final_round=True, trace_dir=None):
        self.policy, self.size, self.steps, self.trace_dir = policy, size, steps, trace_dir
        self.final_round = final_round  # finish(apply_mean=...), as the frontends call it
        self.delays = [[slow_s if r == slow else fast_s for _ in range(steps)] for r in range(size)]
        self.w0 = np.linspace(-1.0, 1.0, WIDTH).astype(np.float32)
        self.cluster = FakeCluster(size, timeout_s=15.0)
        self.pushed = [{} for _ in range(size)]  # step -> (weights it was computed at, gradient)
        self.offers = [[] for _ in range(size)]  # (step offered at, weights then, w_now, w_stale, g, g̃)
        self.means = [{} for _ in range(size)]  # step -> the mean this rank applied
        self.aggregated = [{} for _ in range(size)]  # round -> the fresh ranks its metadata names
        self.counts, self.final, self.engines = [None] * size, [None] * size, [None] * size

    def _train(self, rank):
        engine = SyncEngine(
            self.policy,
            EngineSettings(stragglers=Stragglers(), wait_timeout_s=15.0, trace_dir=self.trace_dir),
            cluster=self.cluster.rank(rank),
        )
        self.engines[rank] = engine
        var = tf.Variable(self.w0)
        engine.start([var])
        pop = engine.exchange.pop

        def pop_and_note(round_):  # what the round aggregated (PSP: the closing's ranks, or more)
            res = pop(round_)
            self.aggregated[rank][round_] = tuple(res.accepted)
            return res

        engine.exchange.pop = pop_and_note
        protocol, original = engine.protocol, engine.protocol.compensate
        state = {}

        def recording_compensate(grads):  # what the op reads, at the moment it runs
            out, finite = original(grads)
            self.offers[rank].append(
                (
                    state["step"],
                    state["w"],
                    protocol.variables[0].numpy().copy(),
                    protocol.w_stale[0].numpy().copy(),
                    grads[0].numpy().copy(),
                    out[0].numpy().copy(),
                )
            )
            return out, finite

        protocol.compensate = recording_compensate
        for step in range(self.steps):
            state["step"], state["w"] = step, var.numpy().copy()
            if engine.begin_step():
                w = var.numpy().copy()
                time.sleep(self.delays[rank][step])
                g = gradient_at(rank, step, w)
                self.pushed[rank][step] = (w, g)
                (mean,) = engine.sync_step([tf.constant(g)])
            else:
                (mean,) = engine.skip_step()
            self.means[rank][step] = mean.numpy()
            var.assign_sub(LR * mean)
        state["step"], state["w"] = self.steps, var.numpy().copy()

        def apply_final(mean):
            self.means[rank][self.steps] = mean[0].numpy()
            var.assign_sub(LR * mean[0])

        engine.finish(apply_mean=apply_final if self.final_round else None)
        self.counts[rank], self.final[rank] = dict(engine.counts), var.numpy()
        engine.close()

    def run(self):
        DCJob.run(self)
        self.closed = self.engines[0].life.server.closed
        return self


@pytest.mark.parametrize(
    "policy",
    [
        tfsync.BackupWorkers(backups=1, compensate=DelayCompensation(lam=0.5)),
        tfsync.PSP(min_contributions=2, push_timeout_s=0.0, compensate=DelayCompensation(lam=0.5)),
    ],
    ids=["backup", "psp"],
)
def test_late_contributions_are_compensated_not_dropped(policy):
    job = LateJob(policy).run()
    slow = 2
    assert [c[0] for c in job.closed] == list(range(job.steps))
    # which ranks were late is the coordinator's record (rank `slow` is, by far; on a loaded
    # machine a fast rank may be too): every expectation below follows from what happened
    late_rounds = {c[0]: c[2] for c in job.closed if len(c) > 2}
    assert late_rounds and slow in set().union(*late_rounds.values()), job.closed

    offered = [{} for _ in range(job.size)]  # rank -> round -> the corrected gradient it sent in it
    final = {}  # rank -> the corrected gradient it sent in the final round
    for k in range(job.size):
        for step, w_then, w_now, w_stale, g, corrected in job.offers[k]:
            if step == job.steps:
                final[k] = corrected
            stamp = next(s for s, (_, pushed_g) in job.pushed[k].items() if np.array_equal(pushed_g, g))
            # w_stale: the weights the gradient was computed at; w_now: this step's weights
            np.testing.assert_array_equal(w_stale, job.pushed[k][stamp][0])
            np.testing.assert_array_equal(w_now, w_then)
            expected = g + 0.5 * g.astype(np.float64) * g * (w_now.astype(np.float64) - w_stale)
            np.testing.assert_allclose(corrected, expected, rtol=1e-5, atol=1e-6)
            if k in late_rounds.get(step, ()):
                offered[k][step] = corrected
    for r, ranks in late_rounds.items():
        assert all(r in offered[k] for k in ranks), (r, ranks)
    # every round's update: the fresh gradients it aggregated and the late corrected ones, over
    # the number of fresh ones (a late gradient weighs what a fresh one does, on top of them).
    # What it aggregated is its metadata's: the closing's ranks, or more under PSP, whose ranks
    # ready before the closing reached them enter with their gradient
    for entry in job.closed:
        r, accepted = entry[0], job.aggregated[0][entry[0]]
        assert set(entry[1]) <= set(accepted) and all(a[r] == accepted for a in job.aggregated), (entry, r)
        parts = [job.pushed[k][r][1].astype(np.float64) for k in accepted]
        parts += [offered[k][r].astype(np.float64) for k in late_rounds.get(r, ())]
        for k in range(job.size):
            np.testing.assert_allclose(job.means[k][r], np.sum(parts, axis=0) / len(accepted), rtol=1e-5, atol=1e-6)
    if final:  # after the last step: the late gradients still held, corrected at the final weights,
        # each weighing what it would in the last round (its fresh count)
        d_last = len(job.aggregated[0][job.steps - 1])
        for k in range(job.size):
            want = np.sum([c.astype(np.float64) for c in final.values()], axis=0) / d_last
            np.testing.assert_allclose(job.means[k][job.steps], want, rtol=1e-5, atol=1e-6)

    for k in range(job.size):
        np.testing.assert_array_equal(job.final[k], job.final[0])
        c = job.counts[k]
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"], c
        assert c["dropped"] == 0, c  # the ones held at the end went into the final round
        late = sum(k in ranks for ranks in late_rounds.values())
        assert c["compensated"] == late + (k in final), (k, c)


def test_without_a_final_round_the_gradient_held_at_the_end_is_dropped_and_counted():
    job = LateJob(tfsync.BackupWorkers(backups=1, compensate=DelayCompensation()), final_round=False).run()
    for k in range(job.size):
        c = job.counts[k]
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] and c["dropped"] <= 1, c
        np.testing.assert_array_equal(job.final[k], job.final[0])


def test_compensation_with_lambda_zero_applies_the_late_gradient_as_it_was():
    job = LateJob(tfsync.BackupWorkers(backups=1, compensate=DelayCompensation(lam=0.0))).run()
    assert job.offers[2]
    for *_, g, corrected in job.offers[2]:
        np.testing.assert_array_equal(corrected, g)


def test_the_timeline_counts_what_the_engine_counted(tmp_path):
    job = LateJob(tfsync.BackupWorkers(backups=1, compensate=DelayCompensation()), trace_dir=str(tmp_path)).run()
    summary = timeline.summarize(timeline.load_trace(str(tmp_path)))
    for k in range(job.size):
        row, counts = summary["ranks"][k], job.counts[k]
        assert (row["compensated"], row["dropped"], row["skipped"]) == (
            counts["compensated"],
            counts["dropped"],
            counts["skipped"],
        ), (k, row, counts)
    assert summary["overall"]["compensated"] == sum(c["compensated"] for c in job.counts) > 0
