"""DSSP and ElasticBSP: the controllers as pure functions, and real engines on in-process ranks.

The jobs are :class:`test_engine_fake.Job`: N real ``SyncEngine``s on threads,
each a training loop of simulated computation (sleeps drawn from a seeded
delay profile).  The checks read what the ranks did (which steps they
computed, the weights each step started from, the order of computations and
pushes) and the engines' traces; they never re-run engine code to get an
expectation.
"""

import random

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster
from hypothesis import given
from hypothesis import strategies as st
from test_engine_fake import (
    EXAMPLES,
    WAIT_S,
    WIDTH,
    Job,
    _on_threads,
    check_ssp,
    contribution,
    delay_profiles,
    trace_dir,
)

import tfsync
from tfsync.engine import SyncEngine
from tfsync.engine.settings import EngineSettings
from tfsync.policies import DSSP, SSP, ElasticBSP, resolve
from tfsync.policies.dynamic import PushTable
from tfsync.stragglers import Stragglers

pytestmark = pytest.mark.usefixtures("engines_on_localhost")


@st.composite
def uneven_jobs(draw, min_size=2, max_size=4, steps=(30, 70)):
    """``delays[rank][step]``: ranks of different speeds (base 0-3 ms), jitter 0-2 ms, rare spikes."""
    size = draw(st.integers(min_size, max_size), label="size")
    n = draw(st.integers(*steps), label="steps")
    seed = draw(st.integers(0, 2**20), label="seed")
    base = draw(st.lists(st.floats(0.0, 3.0), min_size=size, max_size=size), label="base_ms")
    jitter = draw(st.lists(st.floats(0.0, 2.0), min_size=size, max_size=size), label="jitter_ms")
    spike_p = draw(st.lists(st.floats(0.0, 0.1), min_size=size, max_size=size), label="spike_p")
    rng = [random.Random(seed * 64 + r) for r in range(size)]
    return delay_profiles(rng, size, n, base, jitter, spike_p, [6.0] * size)


def events_of(job, kind):
    return [r for k in range(job.size) for r in job.trace(k) if r.get("event") == kind]


# ------------------------------------------------------------------- DSSP


def table(*rows):
    """Push table rows ``(count, latest_s, previous_s)``."""
    return PushTable.from_rows(rows)


def test_the_controller_grants_the_extra_steps_algorithm_2_picks():
    # worker 0 (fastest, 10 pushes) every 1.0 s, last at 20.0; the slowest (worker 1,
    # 5 pushes) every 3.0 s, last at 19.5: its next pushes 22.5, 25.5, 28.5, ...
    # Sim_p = 20, 21, 22, 23, ...: |22.5 - 22| = |22.5 - 23| = 0.5 first at r = 2
    policy = DSSP(low=3, high=9)
    grant = policy.grant(table((10, 20.0, 19.0), (5, 19.5, 16.5), (9, 19.8, 18.8)), rank=0, room=6)
    assert (grant.extra, grant.predicted_wait_s, grant.slowest, grant.reason) == (2, 0.5, 1, "granted")
    # the slowest's next push (20.1) comes right after the fastest stops: waiting now is
    # best (r = 3, 23 against 23.1, is as close: the first wins)
    grant = policy.grant(table((10, 20.0, 19.0), (5, 17.1, 14.1)), rank=0, room=6)
    assert (grant.extra, grant.reason) == (0, "wait") and grant.predicted_wait_s == pytest.approx(0.1)
    # room caps r: the best point (r = 2) is beyond the upper bound's room of 1
    grant = policy.grant(table((10, 20.0, 19.0), (5, 19.5, 16.5)), rank=0, room=1)
    assert grant.extra <= 1


def test_the_controller_grants_only_the_fastest_worker_past_the_lower_bound():
    policy = DSSP(low=2, high=6)
    within = policy.grant(table((5, 9.0, 8.0), (3, 8.5, 7.0), (6, 9.5, 9.0)), rank=0, room=4)
    assert (within.extra, within.reason) == (0, "within")
    behind = policy.grant(table((6, 9.0, 8.0), (3, 8.5, 7.0), (7, 9.5, 9.0)), rank=0, room=4)
    assert (behind.extra, behind.reason, behind.slowest) == (0, "not_fastest", 1)
    fresh = policy.grant(table((6, 9.0, None), (3, 8.5, 7.0)), rank=0, room=4)
    assert (fresh.extra, fresh.reason) == (0, "no_history")


def check_dssp(job, policy):
    """DSSP's promises from what the ranks did and traced; returns (widest gap, grants)."""
    widest = check_ssp(job, policy.high)  # the upper bound, read-my-writes, identical end
    granted = {
        (k, r["step"]): r.get("granted", False)
        for k in range(job.size)
        for r in job.trace(k)
        if "step" in r and "event" not in r
    }
    pushes = [0] * job.size
    for kind, rank, step in job.events:
        if kind == "push":
            pushes[rank] += 1
        elif step - min(pushes) > policy.low:
            assert granted[(rank, step)], (rank, step, pushes)  # past s_L only under a grant
    grants = events_of(job, "grant")
    for g in grants:
        assert 0 <= g["extra"] <= g["room"] <= policy.extra_max, g
        assert g["actual_wait_s"] >= 0.0
        if g["reason"] in ("granted", "wait"):  # the controller predicted: beside the actual wait
            assert g["predicted_wait_s"] is not None and g["predicted_wait_s"] >= 0.0, g
        else:
            assert g["extra"] == 0, g
    # a grant of r covers exactly r steps of its rank, from the one it was asked for
    for g in grants:
        if g["extra"]:
            k = g["rank"]
            covered = [granted.get((k, g["step"] + i)) for i in range(g["extra"])]
            assert all(covered), (g, covered)
    return widest, grants


@EXAMPLES
@given(delays=uneven_jobs(), bounds=st.sampled_from([(0, 2), (1, 3), (1, 5), (2, 6)]))
def test_dssp_keeps_the_gap_within_the_upper_bound_and_past_the_lower_only_under_a_grant(
    tmp_path_factory, delays, bounds
):
    policy = DSSP(*bounds)
    check_dssp(Job(policy, delays, trace_dir(tmp_path_factory)).run(), policy)


def test_dssp_grants_a_fast_worker_extra_steps_and_records_each_prediction(tmp_path):
    # rank 0 fast and steady; rank 1 slow with jitter: the controller has room to choose
    rng = [random.Random(7), random.Random(8)]
    delays = delay_profiles(rng, 2, 80, [0.5, 2.5], [0.2, 3.0], [0.0, 0.0], [0.0, 0.0])
    policy = DSSP(low=1, high=5)
    widest, grants = check_dssp(Job(policy, delays, str(tmp_path)).run(), policy)
    assert any(g["extra"] > 0 for g in grants), grants
    assert widest > policy.low  # a grant was used


@pytest.mark.parametrize("staleness", [0, 2])
def test_dssp_with_equal_bounds_waits_exactly_where_ssp_waits(tmp_path, staleness):
    rng = [random.Random(3 + r) for r in range(3)]
    delays = delay_profiles(rng, 3, 40, [0.2, 0.5, 2.5], [0.5, 0.5, 1.0], [0.0] * 3, [0.0] * 3)
    job = Job(DSSP(staleness, staleness), delays, str(tmp_path)).run()
    # SSP(s)'s guarantees, to the bound s itself, and the controller never asked
    check_ssp(job, staleness)
    assert events_of(job, "grant") == []
    assert not any(r.get("granted") for k in range(job.size) for r in job.trace(k))


@pytest.mark.timeout(180)  # (10,000 steps of simulated delays: about 20 s alone)
def test_dssp_runs_ten_thousand_steps_within_its_bounds(tmp_path):
    # 4 ranks x 2500 steps: one rank slower, with jitter and spikes
    rng = [random.Random(40 + r) for r in range(4)]
    delays = delay_profiles(rng, 4, 2500, [0.0, 0.0, 0.1, 0.4], [0.3, 0.3, 0.3, 0.8], [0.0, 0.0, 0.0, 0.02], [3.0] * 4)
    policy = DSSP(low=1, high=4)
    job = Job(policy, delays, str(tmp_path)).run()
    pushes, widest = [0] * job.size, 0
    granted = {
        (k, r["step"]): r.get("granted")
        for k in range(job.size)
        for r in job.trace(k)
        if "step" in r and "event" not in r
    }
    for kind, rank, step in job.events:
        if kind == "push":
            pushes[rank] += 1
            continue
        gap = step - min(pushes)
        widest = max(widest, gap)
        assert gap <= policy.high and (gap <= policy.low or granted[(rank, step)]), (rank, step, pushes)
    for w in job.workers:
        np.testing.assert_array_equal(w.weights, job.workers[0].weights)
    assert sum(w.counts["applied"] for w in job.workers) == 4 * 2500


# -------------------------------------------------------------- ElasticBSP


def test_zipline_schedules_the_superstep_from_the_barriers_intervals():
    policy = ElasticBSP(lookahead=5)
    # worker 2 takes twice as long: two steps of the others end with one of its
    s = policy.next_schedule(9, push_times=[1.0, 1.0, 1.0], intervals=[0.1, 0.1, 0.2])
    assert (s.start, s.barrier, s.iterations) == (10, 11, (2, 2, 1))
    assert s.predicted_t_sync_s == pytest.approx(1.2) and s.predicted_wait_s == pytest.approx(0.0)
    # worker 2 skips step 10 and computes step 11, the barrier step, with the others
    assert [[s.computes(k, c) for c in (10, 11)] for k in range(3)] == [[True, True], [True, True], [False, True]]
    # the monitoring phase: the first steps are barriers, whatever the intervals
    assert policy.next_schedule(0, [0.1], [5.0]).iterations == (1,)
    # R = 1: every worker's next step is the barrier (BSP)
    assert ElasticBSP(lookahead=1).next_schedule(9, [1.0] * 3, [0.1, 0.3, 0.2]).iterations == (1, 1, 1)


def check_elastic(job, policy):
    """ElasticBSP's promises; returns the schedules (identical on every rank)."""
    size, steps = job.size, job.steps
    barriers = [[r for r in job.trace(k) if r.get("event") == "barrier"] for k in range(size)]
    decisions = [[{k: v for k, v in b.items() if k not in ("rank", "t", "decision_s")} for b in bs] for bs in barriers]
    assert all(d == decisions[0] for d in decisions), "every worker decides the same schedule"
    schedules = decisions[0]
    # the supersteps tile the steps: monitoring barriers first, then ZipLine's choices
    start = 0
    supersteps = [{"start": 0, "barrier": 0, "iterations": [1] * size}] + schedules
    for s in supersteps:
        assert s["start"] == start, (s, start)
        its = s["iterations"]
        assert all(1 <= i <= max(policy.lookahead, 1) for i in its), s
        assert s["barrier"] == start + max(its) - 1, s
        start = s["barrier"] + 1
    assert start >= steps  # the last schedule reaches past the end of training
    # each rank skips the first steps of a superstep and computes its chosen number, up to the barrier
    for k, w in enumerate(job.workers):
        want_computed = [
            c for s in supersteps for c in range(s["barrier"] - s["iterations"][k] + 1, s["barrier"] + 1) if c < steps
        ]
        assert w.computed == want_computed, k
        assert sorted(w.computed + w.skipped) == list(range(steps))
        assert w.counts == {
            "produced": len(w.computed),
            "applied": len(w.computed),
            "compensated": 0,
            "dropped": 0,
            "rejected": 0,
            "lost": 0,
            "skipped": len(w.skipped),
        }
    # after every barrier every replica starts from the same weights: every update so far, over N
    done = {(k, c) for k, w in enumerate(job.workers) for c in w.computed}
    views = [dict(w.views) for w in job.workers]
    for s in supersteps[1:]:
        c = s["start"]
        if c >= steps:
            continue
        want = sum(
            (contribution(k, d).astype(np.float64) / size for k in range(size) for d in range(c) if (k, d) in done),
            np.zeros(WIDTH),
        )
        for k in range(size):
            np.testing.assert_array_equal(views[k][c], views[0][c])
        np.testing.assert_allclose(views[0][c], want, rtol=1e-5, atol=1e-4, err_msg=f"after barrier {c - 1}")
    final = sum((contribution(k, d).astype(np.float64) / size for k, d in done), np.zeros(WIDTH))
    for w in job.workers:
        np.testing.assert_array_equal(w.weights, job.workers[0].weights)
    np.testing.assert_allclose(job.workers[0].weights, final, rtol=1e-5, atol=1e-4)
    for bs in barriers:
        assert all(b["decision_s"] >= 0.0 for b in bs)
    return schedules


@EXAMPLES
@given(delays=uneven_jobs(), lookahead=st.sampled_from([2, 5, 15]))
def test_elasticbsp_barriers_leave_identical_replicas_and_skip_only_after_the_chosen_steps(
    tmp_path_factory, delays, lookahead
):
    policy = ElasticBSP(lookahead=lookahead)
    check_elastic(Job(policy, delays, trace_dir(tmp_path_factory)).run(), policy)


def test_elasticbsp_lets_the_fast_workers_set_the_pace(tmp_path):
    # rank 2 takes 2.5 times as long: it skips steps, the others compute (nearly) every one.  Steps
    # of tens of milliseconds: a loaded machine's scheduling noise (a few ms) then moves the
    # measured intervals, and so ZipLine's choices, too little to change who skips
    delays = [[0.02] * 60, [0.02] * 60, [0.05] * 60]
    policy = ElasticBSP(lookahead=8)
    job = Job(policy, delays, str(tmp_path)).run()
    check_elastic(job, policy)
    skipped = [len(w.skipped) for w in job.workers]
    # (the fast ranks' measured intervals differ by the noise of a shared machine, so the
    # schedule may make one of them skip a step now and then)
    assert skipped[2] > 15 and max(skipped[0], skipped[1]) <= skipped[2] // 2, skipped


def test_elasticbsp_with_lookahead_one_waits_where_bsp_waits(tmp_path):
    rng = [random.Random(11 + r) for r in range(3)]
    delays = delay_profiles(rng, 3, 40, [0.2, 0.5, 2.5], [0.5, 0.5, 1.0], [0.0] * 3, [0.0] * 3)
    job = Job(ElasticBSP(lookahead=1), delays, str(tmp_path)).run()
    check_ssp(job, 0)  # SSP(0): every step computed on every update of every earlier step
    assert all(not w.skipped for w in job.workers)
    assert [b["barrier"] for b in job.trace(0) if b.get("event") == "barrier"] == list(range(1, 41))


@pytest.mark.timeout(180)  # (10,000 steps of simulated delays: about 20 s alone)
def test_elasticbsp_runs_ten_thousand_steps(tmp_path):
    delays = [[0.0005] * 2500, [0.0005] * 2500, [0.001] * 2500, [0.0015] * 2500]
    policy = ElasticBSP(lookahead=6)
    job = Job(policy, delays, str(tmp_path)).run()
    for w in job.workers:
        np.testing.assert_array_equal(w.weights, job.workers[0].weights)
    assert sum(len(w.computed) + len(w.skipped) for w in job.workers) == 4 * 2500
    barriers = [b for b in job.trace(0) if b.get("event") == "barrier"]
    assert len(barriers) > 100 and max(max(b["iterations"]) for b in barriers) <= 6


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "make, kind, words",
    [
        (lambda: DSSP(low=5, high=2), ValueError, "low <= high"),
        (lambda: DSSP(low=-1, high=2), ValueError, "low must be >= 0"),
        (lambda: DSSP(low=1, high=2.5), TypeError, "high must be an int"),
        (lambda: ElasticBSP(lookahead=0), ValueError, "lookahead must be >= 1"),
        (lambda: ElasticBSP(lookahead=True), TypeError, "lookahead must be an int"),
        (lambda: ElasticBSP(algorithm="fast"), ValueError, "'optbs'"),
    ],
)
def test_bad_settings_fail_before_training_saying_what_to_use(make, kind, words):
    with pytest.raises(kind) as err:
        make()
    assert words in str(err.value) and "e.g." in str(err.value) or "expected one of" in str(err.value)


def test_the_mode_strings_name_the_paper_defaults():
    assert resolve("dssp") == tfsync.DSSP(low=3, high=15)
    assert resolve("elasticbsp") == tfsync.ElasticBSP(lookahead=15, algorithm="optbs")


@pytest.mark.parametrize("modes", [(DSSP(1, 4), DSSP(1, 5)), (ElasticBSP(lookahead=4), ElasticBSP(lookahead=5))])
def test_ranks_with_different_settings_are_refused_on_every_rank(modes):
    cluster = FakeCluster(2, timeout_s=5.0)
    engines = [
        SyncEngine(
            resolve(mode), EngineSettings(stragglers=Stragglers(), wait_timeout_s=WAIT_S), cluster=cluster.rank(r)
        )
        for r, mode in enumerate(modes)
    ]
    _, errors = _on_threads([lambda r=r: engines[r].start([tf.Variable(tf.zeros([WIDTH]))]) for r in (0, 1)])
    for exc in errors:
        assert isinstance(exc, ValueError) and "ranks [1] are configured differently" in str(exc), exc


def test_ssp_is_not_dssp():
    assert SSP(3) != DSSP(3, 3) and DSSP(3, 3).config() == {"mode": "dssp", "low": 3, "high": 3, "compression": None}
