"""The exchange's coordinated rounds (PSP, backup workers), in one process without Horovod.

N ranks on threads, an in-process allreduce that divides by ``d`` as Horovod's
post-scale does, and a coordinator that accepts only ranks whose contribution
was pushed before the close, over thousands of random rounds.  Every wait is
bounded, so a bug fails instead of hanging.
"""

import contextlib
import random
import threading
import time

import numpy as np
import pytest
from fake_cluster import FakeCluster

from tfsync.engine.exchange import RoundExchange
from tfsync.engine.wire.layout import decode_meta, encode_meta

TOKEN = "p" * 32
WAIT_S = 10.0  # bound of every wait in this file: far above what a passing test needs


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
