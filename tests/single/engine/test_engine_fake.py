"""Real ``SyncEngine``s, N ranks on threads of one process, every policy.

Each rank runs the real engine (real control path and coordinator over gRPC on
localhost, real policies, real step protocols, production's round collective)
over :mod:`fake_cluster`, an in-process stand-in for
Horovod injected as ``SyncEngine(..., cluster=...)``.  A rank's thread is a
training loop: ``begin_step()``, sleep a delay drawn from its seeded profile
(the step's computation), ``sync_step([gradient])``, or ``skip_step()``; then
``finish()`` and ``close()``.  A contribution encodes who computed it and for
which step (:func:`contribution`), so the test works out, from what it drove
and what rank 0's coordinator decided, what every rank must have received and
counted, and compares: it never re-runs engine code to get its expectations.

Every wait is bounded (the fake's collectives, the engine's own waits, the
threads' joins), so a bug fails instead of hanging.
"""

import collections
import json
import os
import random
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, describe, on_threads
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tfsync import _horovod, simulate
from tfsync.engine import SyncEngine, WorkerLostError
from tfsync.engine.settings import EngineSettings
from tfsync.engine.wire.horovod import horovod_collective
from tfsync.policies import BSP, DSSP, PSP, SSP, BackupWorkers, resolve
from tfsync.stragglers import Stragglers

WIDTH = 4
WAIT_S = 15.0  # the engine's wait_timeout_s: far above what a passing test waits
COLLECTIVE_TIMEOUT_S = 15.0  # the fake's bound on one collective
JOIN_S = 45.0  # one shared deadline for a job's threads (longer than WAIT_S: errors surface first)
# A job takes about a second: few examples, and no shrinking (hundreds of jobs) on failure;
# the falsifying example is printed all the same.
EXAMPLES = settings(
    max_examples=6,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# real engines on localhost, without stragglers from the environment (conftest.py)
pytestmark = pytest.mark.usefixtures("engines_on_localhost")


def contribution(rank, step):
    """Rank ``rank``'s gradient (or update) at step ``step``: ``[1, 2^rank, step, rank]``.

    Summed over a set of ranks, the components count them, name them (a bit mask)
    and add up their steps, so a mean of the wrong contributions cannot pass.
    """
    return np.array([1.0, 2.0**rank, step, rank], np.float32)


def mean_of(ranks, step):
    return np.mean([contribution(r, step).astype(np.float64) for r in ranks], axis=0)


# ------------------------------------------------------------------------ the job


class Worker:
    """What one simulated worker did and saw."""

    def __init__(self):
        self.computed, self.skipped = [], []  # steps
        self.means = {}  # step -> the mean gradients it received (gradient protocol)
        self.views = []  # (step, weights it computed that step on, or found it skipped) (update protocol)
        self.counts = self.weights = None
        self.early_rounds = 0  # coordinated rounds it entered on its ready notice's answer
        self.aggregated = {}  # coordinated round -> the ranks it aggregated, from its metadata


class Job:
    """``size`` engines on threads; ``delays[rank][step]`` seconds of computation per step.

    The model: one ``[WIDTH]`` weight per dtype in ``dtypes`` (the update protocol: one
    float32 variable); weight ``i``'s gradient is ``(i + 1) * contribution(rank, step)``.
    """

    def __init__(
        self, policy, delays, trace_dir, dtypes=(tf.float32,), dies=None, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    ):
        self.policy, self.delays, self.trace_dir = policy, delays, trace_dir
        self.size, self.steps = len(delays), len(delays[0])
        self.updates = policy.payload != "gradients"  # (the model is a variable: its update is pushed)
        assert not self.updates or dtypes == (tf.float32,)
        self.dtypes = dtypes
        self.dies = dies  # (rank, step): that rank's process "ends" before that step
        self.cluster = FakeCluster(self.size, timeout_s=collective_timeout_s)
        self.engines = [
            SyncEngine(
                policy,
                EngineSettings(stragglers=Stragglers(), trace_dir=trace_dir, wait_timeout_s=WAIT_S),
                cluster=self.cluster.rank(r),
            )
            for r in range(self.size)
        ]
        self.workers = [Worker() for _ in range(self.size)]
        self.events = []  # ("compute" | "push", rank, step) in real-time order
        self._events_lock = threading.Lock()

    def _log(self, kind, rank, step):
        with self._events_lock:
            self.events.append((kind, rank, step))

    def _train(self, rank):
        engine, me = self.engines[rank], self.workers[rank]
        var = tf.Variable(tf.zeros([WIDTH])) if self.updates else None
        engine.start([var] if self.updates else [tf.zeros([WIDTH], d) for d in self.dtypes])
        pop = engine.exchange.pop

        def pop_and_note(round_):  # what each round aggregated, as this rank received it
            res = pop(round_)
            me.aggregated[round_] = res.accepted
            return res

        engine.exchange.pop = pop_and_note
        for step in range(self.steps):
            if self.dies == (rank, step):  # as rank 0 sees a crash: its control stream ends
                engine.control._closing = True
                engine.control._stream.cancel()
                return
            if engine.begin_step():
                self._log("compute", rank, step)
                if self.updates:
                    me.views.append((step, var.numpy().copy()))
                time.sleep(self.delays[rank][step])
                g = contribution(rank, step)
                self._log("push", rank, step)
                if self.updates:
                    var.assign_add(g)  # the local optimizer step: the update is g
                    result = engine.sync_step([])
                else:
                    result = engine.sync_step([tf.constant(g * (i + 1), d) for i, d in enumerate(self.dtypes)])
                me.computed.append(step)
            else:
                if self.updates:  # ElasticBSP: the weights a skipped step found
                    me.views.append((step, var.numpy().copy()))
                result = engine.skip_step()
                me.skipped.append(step)
            if not self.updates:
                me.means[step] = [m.numpy() for m in result]
        engine.finish()
        me.counts = dict(engine.counts)
        me.early_rounds = engine.exchange.early_rounds
        if self.updates:
            me.weights = var.numpy()
        engine.close()

    def run(self, expect_errors=False):
        errors = [None] * self.size

        def guarded(rank):
            try:
                self._train(rank)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors[rank] = exc

        threads = [threading.Thread(target=guarded, args=(r,), daemon=True, name=f"rank{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + JOIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung or any(errors):
            self._abandon()
        assert not hung, f"ranks {hung} hung (errors elsewhere: {describe(errors)})"
        if expect_errors:
            return errors
        for exc in errors:
            if exc is not None:
                raise exc
        # what rank 0's coordinator decided (all ranks, every round, for BSP and SSP), and what
        # each round aggregated (its metadata: the closing's ranks, or more under enters_when_ready)
        if self.policy.coordinated:
            self.closed = self.engines[0].life.server.closed
            self.aggregated = [self.workers[0].aggregated[r] for r in range(self.steps)]
            for w in self.workers[1:]:
                assert [w.aggregated[r] for r in range(self.steps)] == self.aggregated
        else:
            self.closed = [[r, list(range(self.size))] for r in range(self.steps)]
            self.aggregated = [tuple(range(self.size))] * self.steps
        return self

    def _abandon(self):
        """A failed job: stop what each engine started, without its (collective) close."""
        for e in self.engines:
            if e.started:
                e.started = False
                e.exchange.close(timeout_s=0.5)
                e.control.close()
                if e.life.server is not None:
                    e.life.server.stop()

    def trace(self, rank):
        with open(os.path.join(self.trace_dir, f"rank{rank}.jsonl")) as f:
            return [json.loads(line) for line in f]


def delay_profiles(rng, size, steps, base_ms, jitter_ms, spike_p, spike_ms):
    """``delays[rank][step]`` in seconds: base + uniform jitter + rare spikes, per rank."""
    return [
        [
            (base_ms[r] + rng[r].uniform(0.0, jitter_ms[r]) + (spike_ms[r] if rng[r].random() < spike_p[r] else 0.0))
            / 1e3
            for _ in range(steps)
        ]
        for r in range(size)
    ]


@st.composite
def jobs(draw, min_size=2, max_size=4):
    """``delays[rank][step]``: per-rank profiles (ms): base 0-1.5, jitter 0-1.5, rare 2-8 ms spikes."""
    size = draw(st.integers(min_size, max_size), label="size")
    steps = draw(st.integers(20, 60), label="steps")
    seed = draw(st.integers(0, 2**20), label="seed")
    ms = st.floats(0.0, 1.5, allow_nan=False)
    base = draw(st.lists(ms, min_size=size, max_size=size), label="base_ms")
    jitter = draw(st.lists(ms, min_size=size, max_size=size), label="jitter_ms")
    spike_p = draw(st.lists(st.floats(0.0, 0.15), min_size=size, max_size=size), label="spike_p")
    spike = draw(st.lists(st.floats(2.0, 8.0), min_size=size, max_size=size), label="spike_ms")
    rng = [random.Random(seed * 64 + r) for r in range(size)]
    return delay_profiles(rng, size, steps, base, jitter, spike_p, spike)


# ----------------------------------------------------------------- the checks


def check_rounds_and_counts(job):
    """What every policy promises; returns the accepted ranks per round."""
    size, steps = job.size, job.steps
    closed = [r for r, _ in job.closed]
    accepted = [tuple(a) for a in job.aggregated]
    if job.policy.enters_when_ready:
        # PSP's ready ranks enter without the coordinator, whose notices are fire-and-forget: it
        # closes rounds in order, once each, but may not have closed the last ones when training
        # ends; a round it never closed was entered by every rank on its own
        assert closed == list(range(len(closed))), "the coordinator closes rounds once, in order"
        assert all(accepted[r] == tuple(range(size)) for r in range(len(closed), steps)), (closed, accepted)
    else:
        assert closed == list(range(steps)), "every round closes once, in order"
    for r, closing in job.closed:  # PSP: also every rank ready by the time it entered the round
        assert set(closing) <= set(accepted[r]) if job.policy.enters_when_ready else tuple(closing) == accepted[r]
    computed = [set(w.computed) for w in job.workers]
    for r, acc in enumerate(accepted):
        assert acc and list(acc) == sorted(set(acc)), (r, acc)
        # only contributions computed for round r (on the weights after round r - 1)
        assert all(r in computed[k] for k in acc), (r, acc, [sorted(c) for c in computed])

    for k, w in enumerate(job.workers):
        assert sorted(w.computed + w.skipped) == list(range(steps))
        produced, applied = len(w.computed), sum(k in acc for acc in accepted)
        assert w.counts == {
            "produced": produced,
            "applied": applied,
            "compensated": 0,
            "dropped": produced - applied,
            "rejected": 0,
            "lost": 0,
            "skipped": len(w.skipped),
        }, k
        assert w.counts["produced"] == w.counts["applied"] + w.counts["dropped"]
        assert w.counts["produced"] + w.counts["skipped"] == steps
        assert w.early_rounds <= applied  # only a contribution a round takes enters early
    if job.policy.coordinated:
        # the fast path is taken: a ready notice that closes its round is answered "it counts"
        assert sum(w.early_rounds for w in job.workers) > 0

    # the engine's trace: every round applied once per rank, each contribution stamped with it
    for k in range(size):
        stamps = {}
        for record in job.trace(k):
            for r, s in record.get("stamps", ()):
                assert r not in stamps, (k, r)
                stamps[r] = s
        assert stamps == {r: [r] * len(acc) for r, acc in enumerate(accepted)}, k

    # the collectives: the same calls, names and order on every rank (one grouped allreduce
    # per dtype and round, the metadata in the float32 one); coordinated rounds are Horovod's
    # sum post-scaled by the previous round's d (a rank that entered on its own or on its ready
    # notice's answer did not know this round's; rescaled after when it differs), BSP's mean is
    # Horovod's plain sum, divided and checked by tfsync (ops.scale_all_finite)
    groups = len(set(job.dtypes) | {tf.float32})
    names = [name for _, _, name in job.cluster.log]
    assert names == (
        ["tfsync.config", "tfsync.t0", "tfsync.control_address"]
        + [f"tfsync.round.{k}" for k in range(groups)] * steps
        + ["tfsync.close", "tfsync.left"]
    )
    if job.policy.coordinated:
        guesses = [size] + [len(acc) for acc in accepted[:-1]]
        want = [("Sum", 1.0 / g) for g in guesses for _ in range(groups)]
    else:  # BSP's sum divided by tfsync, SSP's sum of shares
        want = [("Sum", 1.0)] * (steps * groups)
    assert job.cluster.reductions == want
    return accepted


def check_means(job, accepted):
    """Gradient protocol: every rank received, per round, the same mean of exactly the accepted."""
    for r, acc in enumerate(accepted):
        first = job.workers[0].means[r]
        for w in job.workers[1:]:
            for got, want in zip(w.means[r], first):
                np.testing.assert_array_equal(got, want)
        assert [m.dtype for m in first] == [d.as_numpy_dtype for d in job.dtypes]
        for i, got in enumerate(first):
            np.testing.assert_allclose(got, (i + 1) * mean_of(acc, r), rtol=1e-6, err_msg=f"round {r}, {acc}")


def check_ssp(job, staleness):
    size, steps = job.size, job.steps
    # the clock gap: a worker computes step c only once every worker pushed step c - s - 1
    pushes = [0] * size
    widest = 0
    for kind, rank, step in job.events:
        if kind == "push":
            assert step == pushes[rank]
            pushes[rank] += 1
        else:
            widest = max(widest, step - min(pushes))
            assert step - min(pushes) <= staleness, (rank, step, pushes)

    # read-my-writes: step c of rank k computed on every worker's updates of rounds <= A
    # (complete rounds, A >= c - s - 1) plus all of k's own since
    def included(k, c, a):
        return sum((mean_of(range(size), s) for s in range(a + 1)), np.zeros(WIDTH)) + sum(
            (contribution(k, s).astype(np.float64) / size for s in range(a + 1, c)), np.zeros(WIDTH)
        )

    for k, w in enumerate(job.workers):
        assert [c for c, _ in w.views] == list(range(steps))
        for c, view in w.views:
            fits = [
                a
                for a in range(max(c - staleness - 1, -1), c)
                if np.allclose(view, included(k, c, a), rtol=1e-5, atol=1e-3)
            ]
            assert fits, (k, c, view)

    # at the end: bit-identical weights, the sum of every worker's every update over N
    total = sum(mean_of(range(size), s) for s in range(steps))
    for w in job.workers:
        np.testing.assert_array_equal(w.weights, job.workers[0].weights)
    np.testing.assert_allclose(job.workers[0].weights, total, rtol=1e-5)
    return widest


def trace_dir(factory):
    return str(factory.mktemp("trace"))


# ----------------------------------------------------------------- the policies


@EXAMPLES
@given(delays=jobs())
def test_bsp_every_rank_applies_the_mean_of_all(tmp_path_factory, delays):
    job = Job(BSP(), delays, trace_dir(tmp_path_factory)).run()
    accepted = check_rounds_and_counts(job)  # BSP's rounds take every rank
    check_means(job, accepted)
    assert all(w.counts["skipped"] == w.counts["dropped"] == 0 for w in job.workers)


def test_rank_0_stops_the_control_server_only_after_every_rank_has_left_it(tmp_path, monkeypatch):
    # a server that goes away under a worker's open stream races that worker's channel close
    from tfsync.control import ControlClient, ControlServer

    job = Job(PSP(), [[0.0] * 3, [0.01] * 3, [0.0] * 3], str(tmp_path))
    left_at_stop = []
    stop, close = ControlServer.stop, ControlClient.close

    def recording_stop(self):
        left_at_stop.append(sorted(self._left))
        stop(self)

    def slow_close(self):  # rank 1 is slow to leave
        time.sleep(0.3 if self.rank == 1 else 0.0)
        close(self)

    monkeypatch.setattr(ControlServer, "stop", recording_stop)
    monkeypatch.setattr(ControlClient, "close", slow_close)
    job.run()
    assert left_at_stop == [[0, 1, 2]]


@EXAMPLES
@given(delays=jobs(), staleness=st.integers(0, 3))
def test_ssp_bounds_the_clock_gap_and_ends_identical(tmp_path_factory, delays, staleness):
    job = Job(SSP(staleness=staleness), delays, trace_dir(tmp_path_factory)).run()
    check_rounds_and_counts(job)
    check_ssp(job, staleness)
    assert all(w.counts["skipped"] == w.counts["dropped"] == 0 for w in job.workers)


def test_ssp_lets_a_fast_rank_run_exactly_s_steps_ahead(tmp_path):
    delays = [[0.0] * 20, [0.02] * 20]  # rank 1 is slow: rank 0 reaches the bound and waits there
    job = Job(SSP(staleness=2), delays, str(tmp_path)).run()
    check_rounds_and_counts(job)
    assert check_ssp(job, 2) == 2


@EXAMPLES
@given(delays=jobs(max_size=5), data=st.data())
def test_psp_aggregates_at_least_c_fresh_contributions(tmp_path_factory, delays, data):
    size = len(delays)
    c = data.draw(st.one_of(st.none(), st.integers(1, size)), label="min_contributions")
    timeout = data.draw(st.sampled_from([None, 0.0, 0.001]), label="push_timeout_s")
    policy = PSP(min_contributions=c, push_timeout_s=timeout)
    job = Job(policy, delays, trace_dir(tmp_path_factory)).run()
    accepted = check_rounds_and_counts(job)
    check_means(job, accepted)
    assert all(len(acc) >= policy.contributions_needed(size) for acc in accepted)
    if policy.contributions_needed(size) == size:  # waits for everyone: BSP's rounds
        assert all(w.counts["skipped"] == w.counts["dropped"] == 0 for w in job.workers)


@EXAMPLES
@given(delays=jobs(max_size=5), data=st.data())
def test_backup_workers_aggregate_exactly_size_minus_b(tmp_path_factory, delays, data):
    size = len(delays)
    b = data.draw(st.integers(0, size - 1), label="backups")
    job = Job(BackupWorkers(backups=b), delays, trace_dir(tmp_path_factory)).run()
    accepted = check_rounds_and_counts(job)
    check_means(job, accepted)
    assert all(len(acc) == size - b for acc in accepted)
    if b == 0:
        assert all(w.counts["skipped"] == w.counts["dropped"] == 0 for w in job.workers)


@pytest.mark.parametrize(
    "policy", [PSP(min_contributions=3, push_timeout_s=0.0), BackupWorkers(backups=0)], ids=["psp-c=size", "backup-0"]
)
def test_waiting_for_everyone_never_drops_or_skips(tmp_path, policy):
    rng = [random.Random(10 + r) for r in range(3)]
    delays = delay_profiles(rng, 3, 40, [0.0, 0.5, 1.0], [2.0, 1.0, 2.0], [0.1] * 3, [5.0] * 3)
    job = Job(policy, delays, str(tmp_path)).run()
    accepted = check_rounds_and_counts(job)
    assert accepted == [(0, 1, 2)] * job.steps
    check_means(job, accepted)
    for w in job.workers:
        assert w.counts == {
            "produced": 40,
            "applied": 40,
            "compensated": 0,
            "dropped": 0,
            "rejected": 0,
            "lost": 0,
            "skipped": 0,
        }


@pytest.mark.parametrize("policy", [PSP(push_timeout_s=0.0), BackupWorkers(backups=1)], ids=["psp", "backup"])
def test_a_persistently_slow_rank_skips_and_does_not_set_the_pace(tmp_path, policy):
    size, steps, slow = 3, 40, 2
    delays = [[0.0005] * steps, [0.0005] * steps, [0.05] * steps]  # rank 2: 100 times slower
    job = Job(policy, delays, str(tmp_path)).run()
    accepted = check_rounds_and_counts(job)
    check_means(job, accepted)
    slow_counts = job.workers[slow].counts
    # It computes a few steps, each outlasting several rounds, and skips the rest ...
    assert slow_counts["skipped"] >= steps // 2, slow_counts
    assert slow_counts["dropped"] >= 1, slow_counts
    # ... and the rounds go on without it: the fast ranks compute and count in nearly all
    assert sum(slow in acc for acc in accepted) <= steps // 4, accepted
    for k in range(size):
        if k != slow:
            assert job.workers[k].counts["applied"] >= steps * 3 // 4, job.workers[k].counts


@pytest.mark.parametrize(
    "policy", [BSP(), PSP(push_timeout_s=0.0), BackupWorkers(backups=1)], ids=["bsp", "psp", "backup"]
)
def test_weights_of_two_dtypes_go_in_one_grouped_call_each(tmp_path, policy):
    rng = [random.Random(20 + r) for r in range(3)]
    delays = delay_profiles(rng, 3, 30, [0.0] * 3, [2.0] * 3, [0.1] * 3, [6.0] * 3)
    job = Job(policy, delays, str(tmp_path), dtypes=(tf.float64, tf.float32)).run()
    check_means(job, check_rounds_and_counts(job))


@pytest.mark.parametrize("policy", [BSP(), SSP(staleness=1), PSP(push_timeout_s=0.0)], ids=["bsp", "ssp", "psp"])
def test_a_rank_that_dies_stops_the_others_naming_it(tmp_path, policy):
    # its collectives never come (the fake times out, as Horovod's would fail) and rank 0's
    # control path reports it lost: every survivor stops with WorkerLostError naming it
    job = Job(policy, [[0.001] * 30] * 3, str(tmp_path), dies=(2, 10), collective_timeout_s=1.0)
    errors = job.run(expect_errors=True)
    assert errors[2] is None
    for k in (0, 1):
        assert isinstance(errors[k], WorkerLostError) and "lost rank 2" in str(errors[k]), errors[k]


# ------------------------------------------------ the engine and the simulator, one scenario


def decisions(events, size, skipped, accepted=None):
    """What a run decided, from its events in time order (``(kind, rank, step)``): per rank,
    the steps it computed, each with the rounds every rank had pushed when it started (the
    rounds complete by then: what a bounded mode waited for), and the steps it skipped;
    with ``accepted``, the ranks each round's closing took."""
    pushes, complete, out = collections.Counter(), 0, [{"computed": [], "skipped": sorted(s)} for s in skipped]
    for kind, rank, step in events:
        if kind == "push":
            pushes[step] += 1
            while pushes[complete] == size:
                complete += 1
        elif kind == "compute":
            out[rank]["computed"].append((step, complete))
    return out if accepted is None else (out, accepted)


SCENARIO = {  # one slow rank, far enough apart that the engine's own time cannot reorder a decision
    # (a fast rank's step starts when the slow one's push lets it: only a stall of the fast rank's
    # thread longer than the slow rank's step, 0.4 s, could make it see one more round complete)
    "bounded": [[0.02] * 8, [0.4] * 8],
    "coordinated": [[0.02] * 8, [1.0] * 8],  # the slow rank's first step outlasts every round
}


@pytest.mark.parametrize(
    "policy",
    [BSP(), SSP(staleness=1), SSP(staleness=2), DSSP(low=1, high=3), BackupWorkers(backups=1)],
    ids=["bsp", "ssp1", "ssp2", "dssp", "backup"],
)
def test_the_simulator_decides_as_the_engine_does(tmp_path, policy):
    """One scenario through the real engines (on threads, in real time) and through
    ``tfsync.simulate`` (the same policy objects, simulated time): the same steps computed and
    skipped, each computed step started with the same rounds complete (SSP's and DSSP's waits),
    the same ranks in every round (the coordinator's closings).

    ElasticBSP is not compared: ZipLine picks the barrier whose predicted wait is least, and
    with real times a few milliseconds apart decide between barriers whose predicted waits
    differ by that much (the engine's and the simulator's schedules come from the same
    ``next_schedule``, and which steps a schedule computes from the same ``Schedule.computes``).
    """
    delays = SCENARIO["coordinated" if policy.coordinated else "bounded"]
    job = Job(policy, delays, str(tmp_path)).run()
    size = len(delays)
    engine = decisions(
        job.events,
        size,
        [w.skipped for w in job.workers],
        [sorted(a) for _, a in job.closed] if policy.coordinated else None,
    )
    log = simulate.Log()
    simulate.simulate(policy, np.array(delays), allreduce_s=0.002, control_s=0.001, log=log)
    events = sorted(log.events, key=lambda e: (e[0], e[1] != "push"))  # a push before what it allows
    simulated = decisions(
        [(kind, rank, step) for _, kind, rank, step in events],
        size,
        [[k for _, kind, r, k in log.events if kind == "skip" and r == rank] for rank in range(size)],
        [log.accepted[r] for r in sorted(log.accepted)] if policy.coordinated else None,
    )
    assert engine == simulated


# ----------------------------------------------------------------- the fake itself


def _on_threads(fns, timeout_s=JOIN_S):
    return on_threads(fns, timeout_s)


@pytest.mark.parametrize("average,divisor", [(True, None), (False, None), (True, 2), (True, 3)])
def test_the_fake_reduces_as_horovods_grouped_allreduce(average, divisor):
    size = 3
    cluster = FakeCluster(size, timeout_s=5.0)
    rng = np.random.default_rng(7)
    payloads = [
        [
            tf.constant(rng.normal(size=(2, 3)).astype(np.float32)),
            tf.constant(rng.normal(size=5)),
        ]  # float64: a second group, without the metadata
        for _ in range(size)
    ]
    metas = []
    for r in range(size):
        meta = np.zeros((size, 4))
        meta[r] = (1.0, 40 + r, 12.5 + r, 0.25 * r)
        metas.append(meta)

    def call(r):
        return horovod_collective(average, hvd=cluster.rank(r).wire_ops())(payloads[r], metas[r], divisor=divisor)

    results, errors = _on_threads([lambda r=r: call(r) for r in range(size)])
    assert errors == [None] * size
    f32 = np.sum([p[0].numpy() for p in payloads], axis=0, dtype=np.float32)
    f64 = np.sum([p[1].numpy() for p in payloads], axis=0)
    scale = 1.0 / divisor if divisor else (1.0 / size if average else 1.0)
    for total, meta in results:
        assert total[0].dtype == tf.float32 and total[1].dtype == tf.float64
        np.testing.assert_array_equal(total[0].numpy(), (f32.astype(np.float64) * scale).astype(np.float32))
        np.testing.assert_allclose(total[1].numpy(), f64 * scale, rtol=1e-12)
        np.testing.assert_array_equal(total[0].numpy(), results[0][0][0].numpy())
        want = np.sum(metas, axis=0)
        np.testing.assert_allclose(meta[:, :4], want, atol=1e-6)  # every rank's row, exactly decoded
        assert not meta[:, 4:].any()  # no late contributions
    assert [name for _, _, name in cluster.log] == ["tfsync.round.0", "tfsync.round.1"]


def test_a_rank_that_never_arrives_makes_the_others_time_out():
    cluster = FakeCluster(3, timeout_s=0.3)
    # (bounded: a rank still waiting after 5 s fails the test as hung)
    _, errors = _on_threads([lambda r=r: cluster.rank(r).allgather_object(r, name="x") for r in (0, 2)], timeout_s=5.0)
    for exc in errors:
        assert isinstance(exc, TimeoutError) and "for ranks [1]" in str(exc), exc


def test_ranks_that_call_different_collectives_all_fail():
    cluster = FakeCluster(2, timeout_s=5.0)
    _, errors = _on_threads(
        [
            lambda: cluster.rank(0).broadcast_object(1, root_rank=0, name="a"),
            lambda: cluster.rank(1).allgather_object(1, name="a"),
        ]
    )
    for exc in errors:
        assert isinstance(exc, RuntimeError) and "the ranks disagree" in str(exc), exc


def test_an_engine_whose_peer_never_starts_fails_at_start_instead_of_hanging():
    cluster = FakeCluster(3, timeout_s=0.5)
    engines = [
        SyncEngine(
            resolve("bsp"), EngineSettings(stragglers=Stragglers(), wait_timeout_s=WAIT_S), cluster=cluster.rank(r)
        )
        for r in range(3)
    ]
    _, errors = _on_threads([lambda r=r: engines[r].start([tf.zeros([WIDTH])]) for r in (0, 1)], timeout_s=10.0)
    for exc in errors:
        assert isinstance(exc, TimeoutError) and "'tfsync.config'" in str(exc) and "[2]" in str(exc), exc
    assert not any(e.started for e in engines)


def test_a_rank_0_gone_after_its_address_went_out_ends_its_peers_attach(monkeypatch):
    # (the chaos soak: a rank 0 killed as the engines started; its peers waited 30 s to attach
    # before their reset could begin).  Its service refuses connections: they give up at once;
    # a link that answers nothing waits the engine's wait bound (10 s there), not 30 s
    from tfsync.control.client import CONNECT_TIMEOUT_S, ControlUnreachableError, connect_bound
    from tfsync.engine import lifecycle

    open_control, client = lifecycle.open_control, lifecycle.ControlClient
    bounds = []

    def rank_0_gone(engine, cluster):
        contact = open_control(engine, cluster)
        if engine.rank == 0:
            engine.life.server.stop()  # (its process "dies" once every rank has its address)
        return contact

    def recording(*args, **kwargs):
        bounds.append(kwargs["connect_timeout_s"])
        return client(*args, **kwargs)

    monkeypatch.setattr(lifecycle, "open_control", rank_0_gone)
    monkeypatch.setattr(lifecycle, "ControlClient", recording)
    wait_s = 6.0
    assert connect_bound(wait_s) == wait_s < CONNECT_TIMEOUT_S
    assert connect_bound(0.5) >= 5.0 and connect_bound(120.0) == CONNECT_TIMEOUT_S
    cluster = FakeCluster(2, timeout_s=5.0)
    engines = [
        SyncEngine(
            resolve("bsp"), EngineSettings(stragglers=Stragglers(), wait_timeout_s=wait_s), cluster=cluster.rank(r)
        )
        for r in range(2)
    ]
    _, errors = _on_threads([lambda r=r: engines[r].start([tf.Variable(tf.zeros([WIDTH]))]) for r in (0, 1)])
    assert bounds == [wait_s, wait_s]
    for exc in errors:
        assert isinstance(exc, ControlUnreachableError) and "nothing listens at" in str(exc), exc


def test_ranks_configured_differently_are_refused_on_every_rank():
    cluster = FakeCluster(2, timeout_s=5.0)
    engines = [
        SyncEngine(
            resolve(mode), EngineSettings(stragglers=Stragglers(), wait_timeout_s=WAIT_S), cluster=cluster.rank(r)
        )
        for r, mode in enumerate(("bsp", SSP(staleness=2)))
    ]
    _, errors = _on_threads([lambda r=r: engines[r].start([tf.Variable(tf.zeros([WIDTH]))]) for r in (0, 1)])
    for exc in errors:
        assert isinstance(exc, ValueError) and "ranks [1] are configured differently" in str(exc), exc


# ------------------------------------------------------------ the Horovod default


class RecordingHorovod:
    """``horovod.tensorflow`` as the engine sees it, one rank, recording every call."""

    Sum, Average = "Sum", "Average"

    def __init__(self):
        self.calls = []
        self._fake = FakeCluster(1, timeout_s=5.0).rank(0)

    def rank(self):
        self.calls.append(("rank",))
        return 0

    def size(self):
        self.calls.append(("size",))
        return 1

    def allgather_object(self, obj, name=None):
        self.calls.append(("allgather_object", name))
        return [obj]

    def broadcast_object(self, obj, root_rank=0, name=None):
        self.calls.append(("broadcast_object", root_rank, name))
        return obj

    def grouped_allreduce(self, tensors, op=None, name=None, **scale):
        self.calls.append(("grouped_allreduce", op, name, tuple(scale)))
        return self._fake.grouped_allreduce(tensors, op=op, name=name, **scale)

    def allreduce(self, tensor, op=None, name=None):
        self.calls.append(("allreduce", op, name, float(tensor.numpy())))
        return tensor


def test_the_default_cluster_makes_horovods_calls_in_horovods_order(monkeypatch, tmp_path):
    hvd = RecordingHorovod()
    checks = []
    monkeypatch.setattr(_horovod, "horovod", lambda: (checks.append(len(hvd.calls)), hvd)[1])
    engine = SyncEngine(
        resolve("bsp"), EngineSettings(stragglers=Stragglers(), wait_timeout_s=WAIT_S)
    )  # cluster=None: Horovod
    engine.start([tf.zeros([WIDTH])])
    for step in range(3):
        assert engine.begin_step()
        np.testing.assert_array_equal(
            engine.sync_step([tf.constant(contribution(0, step))])[0].numpy(), contribution(0, step)
        )
    engine.finish()
    engine.close()
    assert hvd.calls == [
        ("rank",),
        ("size",),
        ("allgather_object", "tfsync.config"),
        ("broadcast_object", 0, "tfsync.t0"),
        ("broadcast_object", 0, "tfsync.control_address"),
        ("size",),  # horovod_collective
        *[("grouped_allreduce", "Sum", "tfsync.round.0", ())] * 3,
        ("allreduce", "Sum", "tfsync.close", 0.0),
        ("allreduce", "Sum", "tfsync.left", 0.0),
    ]
    # the launch checks ran when the engine started, for the collective, and again at each
    # of close's two barriers
    assert checks == [0, 5, 9, 10]
