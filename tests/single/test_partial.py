"""Partial aggregation (PSP, backup workers) in one process, without Horovod (no TensorFlow op runs).

Three layers, each against what it promises:

* the policies' ``close_round`` as pure functions (hypothesis over arrival
  orders, clocks and sizes 1..16) and their argument checks;
* :class:`RoundExchange` in coordinated mode: N ranks on threads, an
  in-process allreduce that divides by ``d`` as Horovod's post-scale does, and
  a coordinator that accepts only ranks whose
  contribution was pushed before the close, over thousands of random rounds;
* rank 0's coordinator in :class:`ControlServer`, over gRPC on localhost.

Every wait is bounded, so a bug fails instead of hanging.
"""

import contextlib
import random
import threading
import time

import numpy as np
import pytest
from fake_cluster import FakeCluster
from hypothesis import given, settings
from hypothesis import strategies as st

from tfsync.engine.control import ControlClient, ControlServer
from tfsync.engine.exchange import RoundExchange
from tfsync.engine.rounds import decode_meta, encode_meta
from tfsync.policies import BSP, PSP, SSP, BackupWorkers, Closing, DelayCompensation, Policy
from tfsync.policies.partial import ADAPTIVE_PUSH_TIMEOUT_FRACTION

TOKEN = "p" * 32
WAIT_S = 10.0  # bound of every wait in this file: far above what a passing test needs


# ----------------------------------------------------------------------------- policies


@st.composite
def arrivals(draw, max_size=16):
    """``(size, ready, opened_s)``: some ranks in a random order, at non-decreasing times."""
    size = draw(st.integers(1, max_size))
    order = draw(st.permutations(range(size)))
    k = draw(st.integers(0, size))
    opened_s = draw(st.floats(0.0, 1e4, allow_nan=False))
    gaps = draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=k, max_size=k))
    ready, t = [], opened_s
    for rank, gap in zip(order[:k], gaps):
        t += gap
        ready.append((rank, t))
    return size, tuple(ready), opened_s


def _first_close(policy, ready, opened_s, size):
    """What a coordinator sees: ask on every arrival and at every recheck time;
    ``(closing, how many had arrived, now)`` of the first closing, or None."""
    for k in range(len(ready) + 1):
        now = ready[k - 1][1] if k else opened_s
        nxt = ready[k][1] if k < len(ready) else float("inf")
        while True:
            decision = policy.close_round(ready[:k], opened_s, now, size)
            if decision.accepted is not None:
                return decision, k, now
            if decision.recheck_s is None or decision.recheck_s >= nxt:
                break
            assert decision.recheck_s > now, "a recheck time must lie in the future"
            now = decision.recheck_s
    return None


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_psp_closes_iff_everyone_or_c_and_the_timeout(case, data):
    size, ready, opened_s = case
    c = data.draw(st.one_of(st.none(), st.integers(1, size)), label="min_contributions")
    timeout = data.draw(st.one_of(st.none(), st.floats(0.0, 5.0, allow_nan=False)), label="push_timeout_s")
    policy = PSP(min_contributions=c, push_timeout_s=timeout)
    policy.validate(size)
    last = ready[-1][1] if ready else opened_s
    now = last + data.draw(st.floats(0.0, 20.0, allow_nan=False), label="now - last arrival")
    decision = policy.close_round(ready, opened_s, now, size)
    assert isinstance(decision, Closing)

    need = c if c is not None else max(1, size - 1)
    assert policy.contributions_needed(size) == need
    ranks = tuple(sorted(r for r, _ in ready))
    if len(ready) == size:  # everyone's contribution is in: no reason to wait, whatever the clock
        assert decision == Closing(ranks)
        return
    if len(ready) < need:
        assert decision == Closing()  # only a new arrival can change this: no recheck
        return
    t_c = sorted(t for _, t in ready)[need - 1]
    wait = timeout if timeout is not None else ADAPTIVE_PUSH_TIMEOUT_FRACTION * (t_c - opened_s)
    if now >= t_c + wait:
        assert decision.accepted == ranks and len(decision.accepted) >= need
    else:
        assert decision.accepted is None
        assert decision.recheck_s == pytest.approx(t_c + wait, rel=1e-12, abs=1e-9)
        # asked again at the recheck time, with nobody new: it closes with the same ranks
        again = policy.close_round(ready, opened_s, decision.recheck_s, size)
        assert again.accepted == ranks


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_psp_as_a_coordinator_runs_it_accepts_everything_ready_and_at_least_c(case, data):
    size, ready, opened_s = case
    c = data.draw(st.integers(1, size), label="min_contributions")
    timeout = data.draw(st.one_of(st.none(), st.floats(0.0, 5.0, allow_nan=False)), label="push_timeout_s")
    found = _first_close(PSP(min_contributions=c, push_timeout_s=timeout), ready, opened_s, size)
    if len(ready) < c:
        assert found is None  # fewer than c contributions never close a round
        return
    assert found is not None  # c contributions and the clock always close it eventually
    decision, k, now = found
    assert decision.accepted == tuple(sorted(r for r, _ in ready[:k]))  # every one ready by then
    assert c <= len(decision.accepted) <= size and k >= c
    if timeout == 0.0:  # push_timeout_s=0: exactly at the c-th contribution, with exactly c
        assert (k, len(decision.accepted)) == (c, c)


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_psp_with_zero_timeout_closes_at_the_cth_arrival_exactly(case, data):
    size, ready, opened_s = case
    c = data.draw(st.integers(1, size))
    policy = PSP(min_contributions=c, push_timeout_s=0.0)
    for k in range(len(ready) + 1):
        now = ready[k - 1][1] if k else opened_s
        decision = policy.close_round(ready[:k], opened_s, now, size)
        assert (decision.accepted is not None) == (k >= c)


def test_psp_adaptive_timeout_is_a_tenth_of_the_rounds_own_iteration_time():
    policy = PSP(min_contributions=2)  # push_timeout_s=None: adaptive
    ready = ((3, 11.0), (1, 12.0))  # the 2nd contribution 2 s after the round opened at 10 s
    decision = policy.close_round(ready, 10.0, 12.0, 4)
    assert decision.accepted is None and decision.recheck_s == pytest.approx(12.2)
    assert policy.close_round(ready, 10.0, 12.19, 4).accepted is None
    assert policy.close_round(ready, 10.0, 12.2, 4).accepted == (1, 3)
    late = ready + ((0, 12.1),)  # arrives within the timeout: it counts
    assert policy.close_round(late, 10.0, 12.2, 4).accepted == (0, 1, 3)
    # everyone ready: closes at once, no timeout
    assert policy.close_round(late + ((2, 12.15),), 10.0, 12.15, 4).accepted == (0, 1, 2, 3)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 16), st.data())
def test_psp_adaptive_recheck_time(size, data):
    # PSP() defaults: c = size - 1 and the adaptive timeout, asked at the c-th arrival
    order = data.draw(st.permutations(range(size)))
    opened_s = data.draw(st.floats(0.0, 1e4, allow_nan=False))
    times = sorted(
        data.draw(
            st.lists(st.floats(opened_s, opened_s + 100.0, allow_nan=False), min_size=size - 1, max_size=size - 1)
        )
    )
    ready = tuple(zip(order, times))
    t_c = times[-1]
    decision = PSP().close_round(ready, opened_s, t_c, size)
    wait = 0.1 * (t_c - opened_s)
    accepted = tuple(sorted(order[:-1]))
    if t_c + wait > t_c:
        assert decision.accepted is None
        assert decision.recheck_s == pytest.approx(t_c + wait, rel=1e-12, abs=1e-9)
        assert PSP().close_round(ready, opened_s, decision.recheck_s, size).accepted == accepted
    else:  # the c-th came as the round opened: nothing to wait for
        assert decision.accepted == accepted


@pytest.mark.parametrize("size,need", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_psp_default_leaves_out_one_slow_worker(size, need):
    policy = PSP(push_timeout_s=0.0)
    assert policy.contributions_needed(size) == need
    ready = tuple((r, float(r)) for r in range(need))
    assert policy.close_round(ready[:-1], 0.0, 100.0, size).accepted is None
    assert policy.close_round(ready, 0.0, 100.0, size).accepted == tuple(range(need))


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_backup_workers_accept_the_first_size_minus_b_arrivals(case, data):
    size, ready, opened_s = case
    b = data.draw(st.integers(0, size - 1), label="backups")
    policy = BackupWorkers(backups=b)
    policy.validate(size)
    n = size - b
    for k in range(len(ready) + 1):
        now = ready[k - 1][1] if k else opened_s
        decision = policy.close_round(ready[:k], opened_s, now + 1e6, size)  # the clock never matters
        assert decision.recheck_s is None
        if k < n:
            assert decision.accepted is None
        else:  # arrival order, not rank order: the first n to arrive, whoever they are
            assert decision.accepted == tuple(sorted(r for r, _ in ready[:n]))


def test_backup_workers_go_by_arrival_not_by_rank():
    ready = ((2, 0.5), (0, 0.7), (1, 0.71))
    assert BackupWorkers(backups=1).close_round(ready, 0.0, 1.0, 3).accepted == (0, 2)
    assert BackupWorkers(backups=2).close_round(ready, 0.0, 1.0, 3).accepted == (2,)


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.floats(0.0, 1e6, allow_nan=False))
def test_full_psp_and_zero_backups_close_only_when_all_are_ready(case, later):
    size, ready, opened_s = case
    last = ready[-1][1] if ready else opened_s
    for policy in (
        PSP(min_contributions=size),
        PSP(min_contributions=size, push_timeout_s=0.0),
        BackupWorkers(backups=0),
    ):
        decision = policy.close_round(ready, opened_s, last + later, size)
        if len(ready) == size:  # BSP's rule: every worker, all of them accepted
            assert decision.accepted == tuple(range(size))
        else:
            assert decision == Closing()


def test_partial_policies_describe_themselves():
    assert PSP(min_contributions=3).config() == {
        "mode": "psp",
        "min_contributions": 3,
        "push_timeout_s": None,
        "compensate": None,
        "pull_fraction": 1.0,
        "pull_timeout_s": None,
        "pull_blocks": None,
    }
    assert BackupWorkers().config() == {"mode": "backup", "backups": 1, "compensate": None}
    assert BackupWorkers(compensate=DelayCompensation(lam=0.1)).config()["compensate"] == {
        "lam": 0.1,
        "adaptive": False,
        "momentum": 0.95,
        "epsilon": 1e-7,
    }
    for policy in (PSP(), BackupWorkers()):
        assert (policy.payload, policy.coordinated, policy.skips) == ("gradients", True, True)
        assert [policy.required_round(s) for s in range(3)] == [0, 1, 2]
    assert not BSP().coordinated and not SSP().coordinated
    with pytest.raises(NotImplementedError, match="every worker contributed"):
        BSP().close_round((), 0.0, 0.0, 2)


@pytest.mark.parametrize(
    "bad,error,message",
    [
        (0, ValueError, r"PSP\(min_contributions=0\): min_contributions must be >= 1"),
        (-3, ValueError, r"min_contributions must be >= 1"),
        (1.5, TypeError, r"PSP\(min_contributions=1.5\): min_contributions must be an int >= 1, got float"),
        (True, TypeError, r"min_contributions must be an int >= 1, got bool"),
        ("2", TypeError, r"min_contributions must be an int >= 1, got str"),
    ],
)
def test_psp_refuses_a_bad_min_contributions(bad, error, message):
    with pytest.raises(error, match=message) as info:
        PSP(min_contributions=bad)
    assert "tfsync.PSP(min_contributions=3" in str(info.value)  # says how to write it


@pytest.mark.parametrize(
    "bad,error",
    [
        (-0.5, ValueError),
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
        (True, TypeError),
        ([1.0], TypeError),
    ],
)
def test_psp_refuses_a_bad_push_timeout(bad, error):
    with pytest.raises(error, match=r"push_timeout_s must be a (finite )?number of seconds >= 0 or None"):
        PSP(push_timeout_s=bad)


def test_psp_accepts_integer_and_zero_timeouts():
    assert PSP(push_timeout_s=0).push_timeout_s == 0
    assert PSP(min_contributions=1, push_timeout_s=2).push_timeout_s == 2


def test_psp_validate_refuses_more_contributions_than_workers():
    PSP(min_contributions=4).validate(4)
    PSP().validate(1)
    with pytest.raises(ValueError, match=r"PSP\(min_contributions=5\) with 4 workers.*min_contributions <= 4"):
        PSP(min_contributions=5).validate(4)


@pytest.mark.parametrize(
    "bad,error,message",
    [
        (-1, ValueError, r"BackupWorkers\(backups=-1\): backups must be >= 0"),
        (2.0, TypeError, r"BackupWorkers\(backups=2.0\): backups must be an int >= 0, got float"),
        (None, TypeError, r"backups must be an int >= 0, got NoneType"),
        (False, TypeError, r"backups must be an int >= 0, got bool"),
    ],
)
def test_backup_workers_refuse_a_bad_count(bad, error, message):
    with pytest.raises(error, match=message):
        BackupWorkers(backups=bad)


def test_backup_workers_validate_keeps_at_least_one_worker_per_round():
    BackupWorkers(backups=0).validate(1)
    BackupWorkers(backups=3).validate(4)
    for backups, size in ((1, 1), (4, 4), (5, 4)):
        with pytest.raises(
            ValueError, match=rf"BackupWorkers\(backups={backups}\) with {size} workers" rf".*backups <= {size - 1}"
        ):
            BackupWorkers(backups=backups).validate(size)


# ------------------------------------------------------------- the exchange, coordinated


class FakeAllreduce:
    """N ranks' collectives on threads, as Horovod runs them (:meth:`FakeCluster.meet`: the
    k-th call of every rank meets the k-th call of every other, bounded by ``timeout_s``);
    the payload is summed and post-scaled by ``1 / divisor`` in float32, the metadata
    travels as :func:`encode_meta` digits in the same reduction."""

    def __init__(self, size, timeout_s=WAIT_S):
        self.size = size
        self._cluster = FakeCluster(size, timeout_s=timeout_s)
        self.divisors = {}  # call index -> divisor every rank passed

    def for_rank(self, rank):
        return lambda payload, meta, divisor=None: self._enter(rank, payload, meta, divisor)

    def _enter(self, rank, payload, meta, divisor):
        value = ([np.asarray(p, np.float32) for p in payload], encode_meta(meta), divisor)
        total, wire = self._cluster.meet(rank, "allreduce", "round", value, self._reduce)
        return [t.copy() for t in total], decode_meta(wire, self.size, divisor=divisor)

    def _reduce(self, per_rank):
        k = len(self.divisors)  # calls complete in order: every rank makes call k before k + 1
        divisors = {d for _, _, d in per_rank}
        if len(divisors) != 1:
            raise RuntimeError(f"fake allreduce {k}: the ranks disagree about the divisor: {divisors}")
        (divisor,) = divisors
        self.divisors[k] = divisor
        parts = [p for p, _, _ in per_rank]
        total = [np.sum([p[i] for p in parts], axis=0, dtype=np.float32) for i in range(len(parts[0]))]
        wire = np.sum([w for _, w, _ in per_rank], axis=0, dtype=np.float32)
        if divisor is not None:
            scale = np.float32(1.0 / divisor)
            total = [(t * scale).astype(np.float32) for t in total]
            wire = (wire * scale).astype(np.float32)
        return [(total, wire)] * self.size


SHAPES = ((3,), (2, 2))


def contribution(rank, round_):
    """A distinct, exactly summable payload per rank and round."""
    base = np.float32(rank * 1000 + round_ + 1)
    return [np.full(SHAPES[0], base, np.float32), np.arange(4, dtype=np.float32).reshape(2, 2) + base]


def expected_mean(accepted, round_, guess):
    """What every rank applies: Horovod's sum over every rank (zeros from the others),
    post-scaled by ``1 / guess`` (the previous round's d: a rank that entered early did not
    know this round's), then rescaled by ``guess / d`` if d differs."""
    d = len(accepted)
    parts = [contribution(r, round_) for r in accepted]
    sums = [np.sum([p[i] for p in parts], axis=0, dtype=np.float32) for i in range(len(SHAPES))]
    means = [(t * np.float32(1.0 / guess)).astype(np.float32) for t in sums]
    return means if d == guess else [t * (guess / d) for t in means]


def _exchanges(size, collective_for, t0=0.0, enters_when_ready=False):
    absent = [np.zeros(s, np.float32) for s in SHAPES]
    return [
        RoundExchange(collective_for(r), rank=r, size=size, t0=t0, absent=absent, enters_when_ready=enters_when_ready)
        for r in range(size)
    ]


@contextlib.contextmanager
def _fake_ranks(size, timeout_s=WAIT_S, enters_when_ready=False):
    """``(allreduce, exchanges)``: ``size`` ranks' exchanges over one fake allreduce, closed after."""
    allreduce = FakeAllreduce(size, timeout_s=timeout_s)
    exchanges = _exchanges(size, allreduce.for_rank, enters_when_ready=enters_when_ready)
    try:
        yield allreduce, exchanges
    finally:
        for ex in exchanges:
            ex.close()


class FakeCoordinator:
    """Rank 0's coordinator, driven by a plan: round r waits for every rank planned on time,
    then accepts a random non-empty subset of the ranks ready by then (those whose push
    happened before the close, as ``ready`` follows ``push``), and every rank hears of the
    close, in a random order of ranks.  A ready notice for a closed round is ignored."""

    def __init__(self, exchanges, plan, rng):
        self.exchanges, self.plan, self.rng = exchanges, plan, rng
        self.cond = threading.Condition()
        self.ready = {}
        self.closed = []  # accepted ranks per round
        self.late_notices = 0

    def notify_ready(self, rank, round_):
        with self.cond:
            if round_ < len(self.closed):
                self.late_notices += 1
            else:
                self.ready.setdefault(round_, []).append(rank)
            self.cond.notify_all()

    def run(self, rounds):
        for r in range(rounds):
            on_time = {k for k, p in enumerate(self.plan) if p[r] == "on_time"}
            with self.cond:
                if not self.cond.wait_for(lambda on_time=on_time, r=r: on_time <= set(self.ready.get(r, ())), WAIT_S):
                    raise TimeoutError(f"round {r}: ranks {sorted(on_time)} never became ready")
                ready = sorted(self.ready.pop(r))
                assert set(ready) == on_time, (r, ready, on_time)  # the late ones cannot be ready yet
                if self.rng.random() < 0.5:
                    accepted = tuple(ready)  # PSP-like: everything ready
                else:  # backup-like: some of them; the rest are dropped
                    accepted = tuple(sorted(self.rng.sample(ready, self.rng.randint(1, len(ready)))))
                self.closed.append(accepted)
            for k in self.rng.sample(range(len(self.exchanges)), len(self.exchanges)):
                self.exchanges[k].close_round(r, accepted)
            with self.cond:
                self.cond.notify_all()

    def wait_closed(self, exchange, round_):
        with self.cond:
            if not self.cond.wait_for(lambda: exchange.closed_through >= round_, WAIT_S):
                raise TimeoutError(f"rank {exchange.rank}: round {round_} never closed")


def _train(rank, ex, plan, coordinator, rounds, results, pushed):
    """A worker's training thread, as SyncEngine drives a coordinated policy; ``pushed``
    gets ``(round, "on_time" | "late")`` for every contribution it produced."""
    for r in range(rounds):
        if plan[r] == "on_time":  # computes and pushes before its round closes
            assert ex.closed_through < r
            ex.push(r, contribution(rank, r), push_time=float(r), compute_s=0.25)
            coordinator.notify_ready(rank, r)
            pushed.append((r, "on_time"))
        elif plan[r] == "late" and ex.closed_through < r:  # began before the close, pushes after
            coordinator.wait_closed(ex, r)
            ex.push(r, contribution(rank, r), push_time=float(r), compute_s=0.5)
            coordinator.notify_ready(rank, r)
            pushed.append((r, "late"))
        else:  # begin_step found its round closed: it computes nothing (counted as skipped)
            coordinator.wait_closed(ex, r)
        if not ex.wait(r, timeout_s=WAIT_S):
            raise TimeoutError(f"rank {rank}: round {r} did not complete")
        results[r] = ex.pop(r)


def _run_threads(targets):
    errors = []

    def guarded(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 3 * WAIT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not [t for t in threads if t.is_alive()], "a simulated thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("seed", range(8))
def test_random_schedules_apply_the_same_mean_of_exactly_the_accepted(seed):
    rng = random.Random(seed)
    size = [1, 2, 3, 4, 5, 2, 3, 6][seed]
    rounds = 2400 // (size + 2)
    p_late, p_skip = rng.uniform(0.0, 0.4), rng.uniform(0.0, 0.3)
    plan = [
        [rng.choices(("on_time", "late", "skip"), (1 - p_late - p_skip, p_late, p_skip))[0] for _ in range(rounds)]
        for _ in range(size)
    ]
    for r in range(rounds):  # somebody must be on time, or the round never closes
        if all(p[r] != "on_time" for p in plan):
            plan[rng.randrange(size)][r] = "on_time"

    allreduce = FakeAllreduce(size)
    exchanges = _exchanges(size, allreduce.for_rank)
    coordinator = FakeCoordinator(exchanges, plan, rng)
    results, pushes = [dict() for _ in range(size)], [[] for _ in range(size)]
    try:
        _run_threads(
            [lambda: coordinator.run(rounds)]
            + [
                (lambda k: lambda: _train(k, exchanges[k], plan[k], coordinator, rounds, results[k], pushes[k]))(k)
                for k in range(size)
            ]
        )
        for ex in exchanges:
            ex.drain_outbox()
    finally:
        for ex in exchanges:
            ex.close()

    assert len(coordinator.closed) == rounds
    assert coordinator.late_notices == sum(kind == "late" for p in pushes for _, kind in p)
    # every rank asks Horovod for the sum post-scaled by the previous round's d (the same on
    # every rank: the fake refuses ranks that disagree) and rescales when this round's differs
    guesses = [size] + [len(accepted) for accepted in coordinator.closed[:-1]]
    assert allreduce.divisors == dict(enumerate(guesses))
    for r, accepted in enumerate(coordinator.closed):
        mean = expected_mean(accepted, r, guesses[r])
        for k in range(size):
            res = results[k][r]
            assert res.round == r and res.accepted == accepted
            assert np.flatnonzero(res.present).tolist() == list(accepted)  # one row per accepted rank
            assert res.contributors == len(accepted)
            assert res.steps[list(accepted)].tolist() == [r] * len(accepted)  # staleness 0
            assert res.compute_s[list(accepted)].tolist() == [0.25] * len(accepted)
            for got, want in zip(res.total, mean):
                np.testing.assert_array_equal(got, want)
            own = contribution(k, r) if k in accepted else [np.zeros(s, np.float32) for s in SHAPES]
            for got, want in zip(res.contribution, own):
                np.testing.assert_array_equal(got, want)

    for k, ex in enumerate(exchanges):
        kinds = dict(pushes[k])
        pushed = sorted(kinds)
        applied = [r for r in pushed if k in coordinator.closed[r]]
        missed = [r for r in pushed if k not in coordinator.closed[r]]
        # each pushed contribution is in its round's metadata (applied) or dropped, not both
        assert [r for r in pushed if results[k][r].present[k] == 1.0] == applied
        # A contribution that missed its round is dropped at the next round this rank's thread
        # enters, or by its next push, or at the drain.  Pushed before the close (and not
        # accepted), that is round r + 1; pushed after it, later rounds may have closed
        # meanwhile, but it goes no later than the round of its next contribution.
        drops = ex.take_drops()
        assert [s for s, _ in drops] == missed
        for r, at in drops:
            following = [q for q in pushed if q > r]
            if kinds[r] == "on_time":
                assert at == r + 1, (k, r, at)
            else:
                assert r < at <= (following[0] if following else rounds), (k, r, at)
        assert ex.take_drops() == []
        assert ex.closed_through == rounds - 1 and ex.error is None


def test_a_contribution_that_missed_its_round_is_dropped_at_the_next_or_at_the_drain():
    size = 2
    allreduce = FakeAllreduce(size)
    ex0, ex1 = _exchanges(size, allreduce.for_rank)
    try:
        ex0.push(0, contribution(0, 0), 0.0, 0.1)
        for ex in (ex0, ex1):
            ex.close_round(0, (0,))
        ex1.push(0, contribution(1, 0), 0.5, 0.5)  # too late for round 0: it waits, fresh, in the outbox
        assert ex0.wait(0, WAIT_S) and ex1.wait(0, WAIT_S)
        assert ex1.pop(0).present[1] == 0.0 and ex1.take_drops() == []  # not in round 0, not dropped yet

        ex0.push(1, contribution(0, 1), 1.0, 0.1)
        for ex in (ex0, ex1):
            ex.close_round(1, (0,))
        assert ex0.wait(1, WAIT_S) and ex1.wait(1, WAIT_S)
        assert ex1.take_drops() == [(0, 1)]  # stale at round 1: zeros went in its place
        np.testing.assert_array_equal(ex1.pop(1).contribution[0], np.zeros(3, np.float32))
        res0 = ex0.pop(1)
        np.testing.assert_array_equal(res0.total[0], contribution(0, 1)[0])
        assert res0.present[0] == 1.0 and ex0.pop(0).present[0] == 1.0

        ex1.push(2, contribution(1, 2), 2.0, 0.1)  # never closed: only the drain can drop it
        assert ex1.closed_through == 1
        assert ex1.drain_outbox() == 1 and ex1.drain_outbox() == 0
        assert ex1.take_drops() == [(2, 2)]
        assert ex0.drain_outbox() == 0 and ex0.take_drops() == []
    finally:
        ex0.close()
        ex1.close()


def test_a_newer_push_drops_the_contribution_still_waiting():
    ex = RoundExchange(
        lambda *a, **k: pytest.fail("no round was closed"),
        rank=0,
        size=2,
        t0=0.0,
        absent=[np.zeros(3, np.float32)],
    )
    try:
        ex.push(3, [np.ones(3, np.float32)], 0.0, 0.0)
        ex.push(5, [np.ones(3, np.float32)], 0.0, 0.0)
        assert ex.take_drops() == [(3, 5)]
    finally:
        ex.close()


def _one_rank(collective=None, enters_when_ready=False):
    """Rank 1 of 3 alone, with a collective that must not be reached unless given."""
    calls = []

    def refuse(payload, meta, divisor=None):
        calls.append(divisor)
        raise AssertionError("the collective was entered")

    ex = RoundExchange(
        collective or refuse,
        rank=1,
        size=3,
        t0=0.0,
        absent=[np.zeros(3, np.float32)],
        enters_when_ready=enters_when_ready,
    )
    return ex, calls


def test_an_accepted_rank_with_an_empty_outbox_fails_instead_of_hanging():
    ex, calls = _one_rank()
    try:
        ex.close_round(0, (0, 1))
        with pytest.raises(RuntimeError, match=r"rank 1 was accepted for round 0 but has no contribution"):
            ex.wait(0, timeout_s=WAIT_S)
        assert calls == []  # it never entered a collective the others would run without it
    finally:
        ex.close()


def test_an_accepted_rank_whose_contribution_is_stale_fails_and_counts_the_drop():
    ex, calls = _one_rank()
    try:
        ex.push(0, [np.ones(3, np.float32)], 0.0, 0.0)
        ex.close_round(1, (1, 2))  # round 0's notice never came: the outbox holds round 0's
        with pytest.raises(RuntimeError, match=r"accepted for round 1 but has no contribution"):
            ex.wait(1, timeout_s=WAIT_S)
        assert ex.take_drops() == [(0, 1)] and calls == []
    finally:
        ex.close()


def test_a_rank_whose_outbox_holds_a_later_round_fails():
    ex, calls = _one_rank()
    try:
        ex.push(1, [np.ones(3, np.float32)], 0.0, 0.0)
        ex.close_round(0, (1,))
        with pytest.raises(RuntimeError, match=r"enters round 0 with a contribution to the later round 1"):
            ex.wait(0, timeout_s=WAIT_S)
        assert calls == []
    finally:
        ex.close()


def test_a_round_whose_contributors_differ_from_the_decision_fails():
    # the collective hears from rank 1 only, but the decision accepted ranks 0 and 1
    ex, _ = _one_rank(collective=lambda payload, meta, divisor=None: (payload, meta))
    try:
        ex.push(0, [np.ones(3, np.float32)], 0.0, 0.0)
        ex.close_round(0, (0, 1))
        with pytest.raises(
            RuntimeError,
            match=r"should aggregate ranks \[0, 1\].*ranks \[1\] and late \[\] contributed; the workers disagree",
        ):
            ex.wait(0, timeout_s=WAIT_S)
    finally:
        ex.close()


def test_ranks_told_that_their_contribution_counts_enter_before_the_closing_reaches_them():
    with _fake_ranks(3) as (allreduce, exchanges):
        for k in (0, 1):
            exchanges[k].push(0, contribution(k, 0), 0.0, 0.1)
            exchanges[k].enter_accepted(0)  # the ready notice's answer: round 0 takes it
        exchanges[2].close_round(0, (0, 1))  # rank 2 contributes nothing: it follows the closing
        for ex in exchanges:  # complete before ranks 0 and 1 heard the closing
            assert ex.wait(0, timeout_s=WAIT_S)
        results = [ex.pop(0) for ex in exchanges]
        for res in results:
            assert res.accepted == (0, 1) and res.contributors == 2
            assert res.present.tolist() == [1.0, 1.0, 0.0]
            for got, want in zip(res.total, expected_mean((0, 1), 0, guess=3)):
                np.testing.assert_array_equal(got, want)
        assert [ex.closed_through for ex in exchanges] == [0, 0, 0]  # completing it implies it closed
        for k in (0, 1):  # the closing comes later: checked against the round, nothing entered again
            exchanges[k].close_round(0, (0, 1))
            exchanges[k].call(lambda: None, timeout_s=WAIT_S)
            assert exchanges[k].error is None
        assert allreduce.divisors == {0: 3}  # one collective; d unknown: the first guess is every rank


def test_an_acceptance_that_arrives_after_the_closing_enters_nothing():
    with _fake_ranks(2) as (allreduce, exchanges):
        for k in range(2):
            exchanges[k].push(0, contribution(k, 0), 0.0, 0.1)
            exchanges[k].close_round(0, (0, 1))
        for ex in exchanges:
            assert ex.wait(0, timeout_s=WAIT_S)
            ex.enter_accepted(0)  # the answer lost the race against the stream
            ex.call(lambda: None, timeout_s=WAIT_S)
            assert ex.error is None
        assert allreduce.divisors == {0: 2}


@pytest.mark.parametrize("enters_when_ready", [False, True], ids=["exact", "enters_when_ready"])
def test_a_closing_that_differs_from_what_an_early_round_aggregated_fails(enters_when_ready):
    # rank 1 entered on its acceptance; the collective heard from it alone, the closing names 0 and 1
    # (under enters_when_ready too: a round may aggregate more than its closing's ranks, never fewer)
    ex, _ = _one_rank(
        collective=lambda payload, meta, divisor=None: (payload, meta), enters_when_ready=enters_when_ready
    )
    try:
        ex.push(0, [np.ones(3, np.float32)], 0.0, 0.0)
        ex.enter_accepted(0)
        assert ex.wait(0, timeout_s=WAIT_S)
        ex.close_round(0, (0, 1))
        deadline = time.monotonic() + WAIT_S
        while ex.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(
            RuntimeError, match=r"round 0 aggregated ranks \[1\].*closing names ranks \[0, 1\].*workers disagree"
        ):
            ex.wait(0, timeout_s=WAIT_S)
    finally:
        ex.close()


def test_with_enters_when_ready_a_rank_ready_before_the_closing_reaches_it_contributes():
    # PSP (enters_when_ready): ranks 0 and 1 entered when ready; rank 2 became ready after the
    # coordinator closed round 0 with (0, 1) but before its communication thread heard of it
    with _fake_ranks(3, enters_when_ready=True) as (allreduce, exchanges):
        for k in (0, 1):
            exchanges[k].push(0, contribution(k, 0), 0.0, 0.1)
            exchanges[k].enter_accepted(0)
        exchanges[2].push(0, contribution(2, 0), 0.0, 0.3)
        exchanges[2].close_round(0, (0, 1))  # enters on the closing, with what it holds: its gradient
        for ex in exchanges:
            assert ex.wait(0, timeout_s=WAIT_S)
        for res in [ex.pop(0) for ex in exchanges]:
            assert res.accepted == (0, 1, 2) and res.contributors == 3  # from the metadata, on every rank
            assert res.present.tolist() == [1.0, 1.0, 1.0]
            for got, want in zip(res.total, expected_mean((0, 1, 2), 0, guess=3)):
                np.testing.assert_array_equal(got, want)
        for k in (0, 1):  # their closing names fewer ranks than the round took: that agrees
            exchanges[k].close_round(0, (0, 1))
            exchanges[k].call(lambda: None, timeout_s=WAIT_S)
            assert exchanges[k].error is None
        assert [ex.take_drops() for ex in exchanges] == [[], [], []]


def test_without_enters_when_ready_a_rank_ready_after_the_closing_waits_and_is_dropped():
    # backup workers: exactly the closing's ranks; rank 2's gradient is stale at round 1
    with _fake_ranks(3) as (_, exchanges):
        for k in (0, 1):
            exchanges[k].push(0, contribution(k, 0), 0.0, 0.1)
            exchanges[k].enter_accepted(0)
        exchanges[2].push(0, contribution(2, 0), 0.0, 0.3)
        exchanges[2].close_round(0, (0, 1))
        for ex in exchanges:
            assert ex.wait(0, timeout_s=WAIT_S)
        results = [ex.pop(0) for ex in exchanges]
        assert [res.accepted for res in results] == [(0, 1)] * 3
        assert results[2].present[2] == 0.0
        for k in (0, 1):
            exchanges[k].push(1, contribution(k, 1), 0.0, 0.1)
            exchanges[k].enter_accepted(1)
        exchanges[2].close_round(1, (0, 1))
        for ex in exchanges:
            assert ex.wait(1, timeout_s=WAIT_S)
        assert exchanges[2].take_drops() == [(0, 1)]


def test_an_acceptance_for_a_round_the_outbox_does_not_hold_fails_instead_of_entering():
    ex, calls = _one_rank()
    try:
        ex.push(1, [np.ones(3, np.float32)], 0.0, 0.0)
        ex.enter_accepted(0)
        with pytest.raises(
            RuntimeError, match=r"told that round 0 takes its contribution but its outbox holds one to round 1"
        ):
            ex.wait(0, timeout_s=WAIT_S)
        assert calls == []
    finally:
        ex.close()


def test_a_failing_rank_makes_the_others_fail_too_not_hang():
    with _fake_ranks(3, timeout_s=0.5) as (_, exchanges):
        for k in (0, 2):
            exchanges[k].push(0, contribution(k, 0), 0.0, 0.1)
        for ex in exchanges:
            ex.close_round(0, (0, 1, 2))  # rank 1 never pushed
        with pytest.raises(RuntimeError, match="rank 1 was accepted for round 0 but has no contribution"):
            exchanges[1].wait(0, timeout_s=WAIT_S)
        for k in (0, 2):
            with pytest.raises(TimeoutError, match="waited 0.5 s for ranks \\[1\\]"):
                exchanges[k].wait(0, timeout_s=WAIT_S)


# ------------------------------------------------------------- rank 0's coordinator


class Closes:
    """One client's ``on_close`` notices, in the order its stream delivered them."""

    def __init__(self):
        self.seen, self._cond = [], threading.Condition()

    def __call__(self, round_, accepted, late=()):
        with self._cond:
            self.seen.append((round_, accepted) + ((late,) if late else ()))
            self._cond.notify_all()

    def wait_for(self, n, timeout_s=WAIT_S):
        with self._cond:
            self._cond.wait_for(lambda: len(self.seen) >= n, timeout_s)
            return list(self.seen)


@pytest.fixture
def coordinated():
    """``start(policy, size)`` -> (server, clients, closes); everything stopped afterwards."""
    made = []

    def start(policy, size=3, attach=None):
        server = ControlServer(size=size, t0=time.time(), token=TOKEN, policy=policy)
        made.append(server)
        closes = [Closes() for _ in range(size)]
        clients = []
        for r in range(size) if attach is None else attach:
            clients.append(ControlClient(server.address, r, TOKEN, connect_timeout_s=WAIT_S, on_close=closes[r]))
            made.append(clients[-1])
        return server, clients, closes

    yield start
    for thing in reversed(made):
        if isinstance(thing, ControlClient):
            if not thing._closing:
                thing.close()
        else:
            thing.stop()


def ready(client, round_):
    """``client.ready`` is fire-and-forget; here the notice has reached rank 0 on return."""
    client.ready(round_)
    client._ready_calls[-1].result(timeout=WAIT_S)


def _closed(server, n):
    deadline = time.monotonic() + WAIT_S
    while len(server.closed) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return server.closed


def test_psp_coordinator_closes_rounds_in_order_and_ignores_late_notices(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=2, push_timeout_s=0.0))
    ready(clients[0], 0)
    ready(clients[2], 0)
    assert _closed(server, 1) == [[0, [0, 2]]]
    ready(clients[1], 0)  # late: round 0 closed without it
    ready(clients[0], 1)
    time.sleep(0.3)  # had the late notice counted towards round 1, c = 2 would close it now
    assert server.closed == [[0, [0, 2]]]
    ready(clients[2], 1)
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 2]]]
    ready(clients[1], 2)
    ready(clients[0], 2)
    assert _closed(server, 3) == [[0, [0, 2]], [1, [0, 2]], [2, [0, 1]]]
    want = [(0, (0, 2)), (1, (0, 2)), (2, (0, 1))]
    for c in closes:  # every worker hears of every closing, once, in order
        assert c.wait_for(3) == want
    time.sleep(0.1)
    assert [c.seen for c in closes] == [want] * 3


def test_psp_coordinator_waits_for_the_push_timeout_and_takes_who_came_meanwhile(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=1, push_timeout_s=0.5))
    start = time.time()
    ready(clients[1], 0)
    ready(clients[2], 0)  # within τ1 of the first: it counts
    assert _closed(server, 1) == [[0, [1, 2]]]
    assert time.time() - start >= 0.45  # not before τ1 after the c-th contribution
    assert closes[0].wait_for(1) == [(0, (1, 2))]


@pytest.mark.parametrize("policy", [PSP(min_contributions=1, push_timeout_s=0.3), BackupWorkers(backups=0)])
def test_a_closing_that_took_every_rank_goes_down_the_streams_only_when_someone_needs_it(coordinated, policy):
    # PSP's ready ranks enter on their own (enters_when_ready): a round that took every rank
    # has nobody to move, so its closing is kept on rank 0 but not sent; backup workers'
    # ranks follow the closings (or their answers), so every closing goes out
    server, clients, closes = coordinated(policy, size=2)
    ready(clients[0], 0)
    ready(clients[1], 0)  # round 0: both
    ready(clients[0], 1)
    ready(clients[1], 1)  # round 1: both
    assert _closed(server, 2) == [[0, [0, 1]], [1, [0, 1]]]
    if policy.enters_when_ready:
        ready(clients[0], 2)  # round 2: rank 1 is late (τ1 passes); the closing moves it
        assert _closed(server, 3)[2] == [2, [0]]
        want = [(2, (0,))]
    else:
        want = [(0, (0, 1)), (1, (0, 1))]
    for c in closes:
        assert c.wait_for(len(want)) == want
    time.sleep(0.2)
    assert [c.seen for c in closes] == [want] * 2


def test_psp_coordinator_counts_an_early_notice_once_its_round_is_the_oldest_open(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=2, push_timeout_s=0.0))
    ready(clients[1], 1)  # for round 1, while round 0 is open
    ready(clients[0], 0)
    time.sleep(0.2)
    assert server.closed == []  # round 0 has one contribution, round 1's does not count
    ready(clients[2], 0)
    ready(clients[0], 1)
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 1]]]


def test_backup_coordinator_takes_the_first_arrivals(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1))
    ready(clients[2], 0)
    ready(clients[0], 0)
    assert _closed(server, 1) == [[0, [0, 2]]]
    ready(clients[1], 0)  # the backup's contribution: ignored, not kept for later rounds
    ready(clients[1], 1)
    time.sleep(0.3)
    assert server.closed == [[0, [0, 2]]]
    ready(clients[2], 1)
    ready(clients[0], 1)  # third to arrive: round 1 closed with the first two
    assert _closed(server, 2) == [[0, [0, 2]], [1, [1, 2]]]
    for c in closes:
        assert c.wait_for(2) == [(0, (0, 2)), (1, (1, 2))]


def test_a_worker_that_attaches_late_hears_every_earlier_closing_in_order(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1), attach=(0, 1))
    for r in range(3):
        ready(clients[r % 2], r)
        ready(clients[(r + 1) % 2], r)
    assert len(_closed(server, 3)) == 3
    late = ControlClient(server.address, 2, TOKEN, connect_timeout_s=WAIT_S, on_close=closes[2])
    try:
        assert closes[2].wait_for(3) == [(0, (0, 1)), (1, (0, 1)), (2, (0, 1))]
    finally:
        late.close()


@pytest.mark.parametrize("policy", [None, BSP(), SSP(staleness=1)])
def test_uncoordinated_policies_have_no_coordinator(coordinated, policy):
    server, clients, closes = coordinated(policy, size=2)
    assert not hasattr(server, "_coordinator")
    for c in clients:
        ready(c, 0)
    time.sleep(0.3)
    assert server.closed == [] and [c.seen for c in closes] == [[], []]


class _Broken(Policy):
    name, payload, coordinated = "broken", "gradients", True

    def required_round(self, step):
        return step

    def close_round(self, ready, opened_s, now_s, size):
        raise ZeroDivisionError("bad rule")


def test_a_failing_policy_stops_the_job_with_its_reason(coordinated):
    server, clients, closes = coordinated(_Broken(), size=2)
    deadline = time.monotonic() + WAIT_S
    while not clients[1].known_stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    (stopped,) = clients[1].known_stopped
    assert "_Broken.close_round failed on round 0: ZeroDivisionError: bad rule" in stopped["message"]
    assert server.closed == []


class _AcceptsTheAbsent(_Broken):
    def close_round(self, ready, opened_s, now_s, size):
        return Closing(tuple(range(size)) if ready else None)  # every rank, whoever is ready


def test_a_policy_that_accepts_a_rank_that_is_not_ready_stops_the_job(coordinated):
    # every replica would divide the round's sum by a count that includes an absent rank
    server, clients, closes = coordinated(_AcceptsTheAbsent(), size=2)
    ready(clients[0], 0)
    deadline = time.monotonic() + WAIT_S
    while not clients[1].known_stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    (stopped,) = clients[1].known_stopped
    assert "_AcceptsTheAbsent.close_round accepted [0, 1] with ranks [0] ready" in stopped["message"]
    assert "(not ready: [1])" in stopped["message"] and server.closed == []


def answer(client, round_):
    """The coordinator's answer to a ready notice: 1 if the round takes the contribution for
    certain (the worker enters at once), 0 if the worker follows the closing."""
    client.ready(round_)
    return client._ready_calls[-1].result(timeout=WAIT_S)["accepted"]


def test_psp_coordinator_tells_every_rank_ready_for_the_open_round_that_it_counts(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=2, push_timeout_s=0.0))
    assert answer(clients[1], 1) == 0  # not the oldest open round: it follows the closing
    assert answer(clients[0], 0) == 1  # open: PSP takes every rank ready when it closes
    assert answer(clients[2], 0) == 1  # the c-th: closes round 0 with it
    assert answer(clients[1], 0) == 0  # late: closed without it
    assert _closed(server, 1)[0] == [0, [0, 2]]
    assert answer(clients[0], 1) == 1  # closes round 1 with rank 1's early notice
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 1]]]


def test_backup_coordinator_tells_the_first_n_and_only_them(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1))
    assert [answer(clients[k], 0) for k in (2, 0, 1)] == [1, 1, 0]
    assert _closed(server, 1) == [[0, [0, 2]]]


class _ClosesOnTwo(_Broken):
    def close_round(self, ready, opened_s, now_s, size):
        return Closing(tuple(r for r, _ in ready)) if len(ready) >= 2 else Closing()


def test_a_policy_that_does_not_promise_to_accept_the_ready_gets_no_early_entries(coordinated):
    server, clients, closes = coordinated(_ClosesOnTwo(), size=3)
    assert answer(clients[0], 0) == 0  # open, but the policy made no promise
    assert answer(clients[1], 0) == 1  # its notice closed the round with it
    assert _closed(server, 1) == [[0, [0, 1]]]


class _BreaksItsPromise(_Broken):
    accepts_ready = True

    def close_round(self, ready, opened_s, now_s, size):
        return Closing((ready[-1][0],)) if len(ready) >= 2 else Closing()  # not the first ready rank


def test_a_policy_that_breaks_its_promise_to_accept_the_ready_stops_the_job(coordinated):
    # rank 0 entered the round's allreduce on the promise: a closing without it cannot be run
    server, clients, closes = coordinated(_BreaksItsPromise(), size=2)
    assert answer(clients[0], 0) == 1
    answer(clients[1], 0)
    deadline = time.monotonic() + WAIT_S
    while not clients[1].known_stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    (stopped,) = clients[1].known_stopped
    assert "_BreaksItsPromise.close_round accepted [1] on round 0 but ranks [0] were told" in stopped["message"]
    assert server.closed == []


def test_coordinator_takes_a_late_offer_only_into_the_open_round(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1, compensate=DelayCompensation()))
    ready(clients[2], 0)
    ready(clients[0], 0)
    assert _closed(server, 1) == [[0, [0, 2]]]
    assert not clients[1].join_late(0)  # round 0 is closed: refused
    assert clients[1].join_late(1) and clients[1].join_late(1)  # round 1 is open: taken (once)
    assert not clients[1].join_late(2)  # not the open round
    ready(clients[0], 1)
    time.sleep(0.2)
    assert server.closed == [[0, [0, 2]]]  # an extra: it does not count toward N = 2
    ready(clients[2], 1)
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 2], [1]]]
    for c in closes:
        assert c.wait_for(2) == [(0, (0, 2)), (1, (0, 2), (1,))]
