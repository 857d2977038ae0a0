"""Synchronization timed from measured iteration times: DSSP and ElasticBSP.

* :class:`DSSP`: dynamic stale synchronous parallel (*Dynamic Stale
  Synchronous Parallel Distributed Training for Deep Learning*, Zhao et al. 2019,
  Section III, Algorithms 1-2): SSP with the lower bound
  ``s_L``, where a worker that reaches it as the fastest may be granted up to
  ``s_U - s_L`` extra iterations, as many as the synchronization controller
  predicts minimize its wait.
* :class:`ElasticBSP`: barriers placed by ZipLine (the ElasticBSP and
  ZipLine paper, Zhao et al., Sections 3-5): at every barrier, each worker's
  next ``R`` iteration end times are predicted and one is chosen per worker so
  that their spread (the wait) is smallest; the next barrier follows the
  latest chosen iteration, and each worker runs its chosen number of
  iterations until then.

Both exchange updates as SSP does (:class:`tfsync.SSP`, the ``"updates"``
protocol): a worker applies its own update at once and its share ``Δ/N`` is
summed with the other workers' in round ``r``.  Delay compensation
(``compensate=``) does not apply to them: what they exchange is each
worker's update after its own optimizer ran, not a gradient that a shared
optimizer applies at other weights, so DC-ASGD's correction, defined for a
gradient and the weights it was computed at, has no term to correct.
"""

import dataclasses
import time

import numpy as np

from tfsync.policies.base import Policy
from tfsync.policies.partial import _check_int

# ElasticBSP's monitoring phase: the first steps are barriers, so that every worker has
# pushed twice (the paper's minimum, Fig. 5) before the first prediction
MONITORING_STEPS = 2
MIN_INTERVAL_S = 1e-6  # an iteration measured shorter than this is predicted at this length


@dataclasses.dataclass(frozen=True)
class Grant:
    """The synchronization controller's answer to a worker at the lower bound (DSSP).

    ``extra``: iterations granted past the lower bound (``r*``, 0: wait now);
    ``predicted_wait_s``: the controller's objective at ``r*``, the distance
    from the worker's predicted stop to the slowest worker's nearest predicted
    push; ``slowest``: the rank it predicted from; ``reason``: ``"granted"``,
    ``"within"`` (the coordinator's clocks put the worker within ``s_L`` of the
    slowest: its wait is about to end), ``"not_fastest"`` or ``"no_history"``
    (fewer than two pushes of the worker or of the slowest).
    """

    extra: int
    predicted_wait_s: float = None
    slowest: int = None
    reason: str = "granted"


@dataclasses.dataclass(frozen=True)
class DSSP(Policy):
    """Dynamic stale synchronous parallel (Zhao et al. 2019, Algorithms 1-2) on allreduce.

    SSP with the bound ``s_L = low`` (:class:`tfsync.SSP`: updates applied at
    once, summed in rounds the workers' communication threads enter), plus the
    paper's synchronization controller.  When a worker finds the round it needs
    for its next step incomplete (it is more than ``s_L`` steps ahead of the
    slowest worker) and holds no grant, it asks rank 0's coordinator, which
    keeps the paper's table of every worker's two latest push timestamps and
    push counts (each worker tells it of every push).  If the worker is the
    fastest, the coordinator simulates its next iterations and the slowest
    worker's from their latest intervals and grants the ``r*`` that minimizes
    ``|Sim_slowest[k] - Sim_p[r]|`` (Algorithm 2); the worker then computes
    ``r*`` steps past the lower bound, one per push, whether or not it is
    still the fastest, and asks again when the grant is used up.

    The coordinator decides, not each worker from the replicated round
    metadata: the rule needs every worker's *current* push count and latest
    pushes, and the round metadata carries the slowest worker's push only once
    its round completes, which is the moment the decision is no longer needed.

    Guarantees (tested from recorded traces):

    * the clock gap never exceeds ``s_U = high``: a grant is capped so that it
      cannot, and every step also waits for round ``c - s_U - 1``;
    * it exceeds ``s_L`` only at steps computed under a grant;
    * ``DSSP(s, s)`` waits exactly where ``SSP(s)`` waits (it never asks);
    * every decision is in the trace (``"grant"`` events): ``r*``, the
      predicted wait, and the wait that followed when the grant was used up;
    * replicas end bit-identical, as SSP's.

    Args:
        low: ``s_L`` (int, ``>= 0``). Default 3, the paper's.
        high: ``s_U`` (int, ``>= low``). Default 15: the paper's range of
            extra iterations ``[0, 12]``.
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.DSSP(low=3, high=15))   # or mode="dssp"
    """

    low: int = 3
    high: int = 15
    name = "dssp"
    payload = "updates"

    def __post_init__(self):
        super().__post_init__()
        hint = "e.g. tfsync.DSSP(low=3, high=15)"
        _check_int("DSSP", "low", self.low, 0, hint)
        _check_int("DSSP", "high", self.high, 0, hint)
        if self.low > self.high:
            raise ValueError(
                f"DSSP(low={self.low}, high={self.high}): the lower staleness bound must not exceed the upper "
                f"one; use low <= high (DSSP(low=s, high=s) is SSP(s)); {hint}"
            )

    @property
    def extra_max(self) -> int:
        """``r_max = s_U - s_L``: the most iterations a worker may run past the lower bound."""
        return self.high - self.low

    def required_round(self, step: int) -> int:
        """The lower bound's round; a grant relaxes it down to :meth:`hard_round`."""
        return step - self.low - 1

    def hard_round(self, step: int) -> int:
        """The round every step waits for, granted or not: the upper bound's."""
        return step - self.high - 1

    def next_required(self, step: int, required: int, completed: int, grant_left: int):
        """After pushing ``step``: what its next step waits for and whether to ask for a grant.

        ``required``: the lower bound's round for step ``step + 1``; ``completed``:
        the newest complete round; ``grant_left``: extra steps granted and not yet
        used.  Returns ``(round, room, asks)``: the round to wait for unless a grant
        is asked for and given (then :meth:`hard_round`), how many steps the upper
        bound leaves (``room``), and whether to ask the coordinator (:meth:`grant`).
        """
        nxt = step + 1
        room = self.high - (nxt - (completed + 1)) + 1  # steps computable before the upper bound binds
        if grant_left > 0:  # one per push, fastest or not (Algorithm 1, lines 3-5)
            return self.hard_round(nxt), room, False
        return required, room, required > completed and room > 0

    def grant(self, pushes: "PushTable", rank: int, room: int) -> Grant:
        """The synchronization controller (Algorithm 1, lines 7-16, and Algorithm 2).

        Array operations over the table, so a decision among 10,000 workers
        takes well under a millisecond (``python -m tfsync.simulate`` measures it).

        Args:
            pushes: the coordinator's :class:`PushTable` (every rank's push
                count and two latest push times).
            rank: the worker at the lower bound (its latest push is included).
            room: how many steps it could compute before the upper bound binds.
        """
        counts, latest, previous = pushes.counts, pushes.latest_s, pushes.previous_s
        # the slowest: fewest pushes; among those, the one that pushed least recently
        # (never: 0.0), the lowest rank on ties
        fewest = np.flatnonzero(counts == counts.min())
        slowest = int(fewest[np.argmin(np.nan_to_num(latest[fewest], nan=0.0))])
        if counts[rank] - counts[slowest] <= self.low:
            return Grant(0, None, slowest, "within")
        if counts[rank] < counts.max():
            return Grant(0, None, slowest, "not_fastest")
        p0, p1, s0, s1 = latest[rank], previous[rank], latest[slowest], previous[slowest]
        if np.isnan([p0, p1, s0, s1]).any():
            return Grant(0, None, slowest, "no_history")
        r_max = min(self.extra_max, room)
        interval_p, interval_s = p0 - p1, s0 - s1
        sim_p = p0 + np.arange(r_max + 1) * interval_p
        sim_s = s0 + interval_s + np.arange(self.extra_max + 1) * interval_s
        gaps = np.abs(sim_s[None, :] - sim_p[:, None]).min(axis=1)
        best = int(np.argmin(gaps))  # the first (fewest extra iterations) on ties
        return Grant(best, float(gaps[best]), slowest, "granted" if best else "wait")


class PushTable:
    """DSSP's table on the coordinator: per rank, how many pushes it has heard of and the
    times of the two latest (``NaN`` while there are fewer), as arrays."""

    def __init__(self, size: int):
        self.counts = np.zeros(size, np.int64)
        self.latest_s = np.full(size, np.nan)
        self.previous_s = np.full(size, np.nan)

    @classmethod
    def from_rows(cls, rows) -> "PushTable":
        """From ``(count, latest_s, previous_s)`` rows (``None`` for a missing time)."""
        table = cls(len(rows))
        for rank, (count, latest, previous) in enumerate(rows):
            table.counts[rank] = count
            table.latest_s[rank] = np.nan if latest is None else latest
            table.previous_s[rank] = np.nan if previous is None else previous
        return table

    def record(self, rank: int, step: int, now_s: float) -> None:
        """Rank ``rank`` pushed its update of ``step`` at ``now_s``; a repeat is ignored
        (a notice and a grant request may both carry the same push)."""
        if step + 1 > self.counts[rank]:
            self.counts[rank] = step + 1
            self.previous_s[rank], self.latest_s[rank] = self.latest_s[rank], now_s

    def copy(self) -> "PushTable":
        table = PushTable(0)
        table.counts, table.latest_s, table.previous_s = (
            self.counts.copy(),
            self.latest_s.copy(),
            self.previous_s.copy(),
        )
        return table


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One ElasticBSP superstep: the steps ``start`` to ``barrier`` (its barrier round).

    ``iterations``: per rank, how many of them it computes: the *last* ones,
    after skipping the others.  Skipping first lets a worker's communication
    thread enter the skipped steps' rounds (with zeros) while the others
    compute, so that the barrier round waits only for the last computations
    and not for a burst of rounds queued behind them.
    ``predicted_t_sync_s`` and ``predicted_wait_s`` are ZipLine's (seconds
    since the job's t0), and ``decision_s`` how long the decision took on this
    worker.
    """

    start: int
    barrier: int
    iterations: tuple
    predicted_t_sync_s: float = None
    predicted_wait_s: float = 0.0
    decision_s: float = 0.0

    def computes(self, rank: int, step: int) -> bool:
        return step > self.barrier - self.iterations[rank]

    def computing(self, steps):
        """:meth:`computes` for every rank (rows) and each of ``steps`` (columns) at once."""
        return np.asarray(steps)[None, :] > self.barrier - np.asarray(self.iterations)[:, None]

    def record(self) -> dict:
        return {
            "start": self.start,
            "barrier": self.barrier,
            "iterations": list(self.iterations),
            "predicted_t_sync_s": self.predicted_t_sync_s,
            "predicted_wait_s": self.predicted_wait_s,
            "decision_s": self.decision_s,
        }


@dataclasses.dataclass(frozen=True)
class ElasticBSP(Policy):
    """ElasticBSP (Zhao et al.): barriers where ZipLine predicts the least waiting.

    Between barriers the workers run asynchronously: each applies its own
    update at once and its share ``Δ/N`` is summed with the others' in the
    rounds their communication threads enter (tfsync's SSP exchange with no
    staleness bound, the decentralized form of the paper's ASP within a
    superstep; summed shares, as a parameter server applies each worker's
    update, scaled by ``1/N`` so that a superstep where each worker computes
    once moves the weights as one BSP step of averaged updates).  At a barrier
    round every worker waits for it and every round before it; then every
    replica holds the same weights, ``w̄``.

    The schedule of the next superstep is decided at the barrier, on every
    worker, from the barrier round's replicated metadata: each worker's
    iteration interval (its median over the iterations it computed since the
    previous barrier, each from the end of its previous wait to its push, so
    no wait is counted as work) and the barrier's time.  Each worker's next ``R``
    end times are predicted (:func:`tfsync.scheduler.predict_end_times`, the
    paper's Section 4) and ZipLine (:func:`tfsync.scheduler.zipline`) chooses
    one per worker with the smallest spread, the earliest on ties.  Every
    worker computes the same decision from the same table, so no message is
    needed.  Worker ``p`` then computes its chosen ``k_p`` steps; Keras gives
    every worker the same number of steps, so the superstep lasts
    ``max_p k_p`` steps and the others skip the difference (counted as
    ``skipped``), first (see :class:`Schedule`): the fast workers set the pace.

    The monitoring phase (every worker pushes twice before its interval is
    predicted, Fig. 5) is the job's first ``MONITORING_STEPS`` steps, which are
    barriers.  After that, a worker's interval is measured by its latest push
    itself, with the barrier's wait excluded, so the next barrier is decided at
    the barrier rather than two iterations later; this is the paper's latest
    interval without its wait, the median over the superstep (one interval of
    a shared machine is noisy, and an error in it grows with every predicted
    iteration; a median also ignores a one-off stall, such as a worker's
    first step of an epoch, which a mean would carry into the next superstep
    as a slow worker that must skip), and it makes ``lookahead=1`` a barrier
    at every step, i.e. BSP's waiting.

    Guarantees (tested): after every barrier, identical weights on every
    replica; every worker computes at least one step per superstep and skips
    only before its chosen steps; ``ElasticBSP(lookahead=1)`` waits where
    BSP waits; every decision (iterations, predicted barrier time and wait,
    the decision's own time) is in the trace (``"barrier"`` events).

    Args:
        lookahead: ``R``, the number of future iterations predicted per
            worker (int ``>= 1``). Default 15, the paper's.
        algorithm: the ZipLine variant, one of
            :data:`tfsync.scheduler.ALGORITHMS`. Default ``"optbs"``
            (ZipLineOptBS).
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.ElasticBSP(lookahead=15))   # or mode="elasticbsp"
    """

    lookahead: int = 15
    algorithm: str = "optbs"
    name = "elasticbsp"
    payload = "updates"
    skips = True

    def __post_init__(self):
        super().__post_init__()
        from tfsync.scheduler import ALGORITHMS

        _check_int("ElasticBSP", "lookahead", self.lookahead, 1, "e.g. tfsync.ElasticBSP(lookahead=15)")
        if not isinstance(self.algorithm, str) or self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"ElasticBSP(algorithm={self.algorithm!r}): unknown ZipLine algorithm; expected one of "
                f"{', '.join(map(repr, ALGORITHMS))} (default 'optbs', ZipLineOptBS, the fastest)"
            )

    def required_round(self, step: int) -> int:
        """Without a schedule (the monitoring phase): every step is a barrier."""
        return step

    def first_schedule(self, size: int) -> Schedule:
        """The job's first superstep (a monitoring barrier); loads the scheduler's kernels now,
        so that the first decision's time is the decision's own."""
        from tfsync.scheduler import zipline

        zipline([[1.0], [1.0]], self.algorithm)
        return Schedule(start=0, barrier=0, iterations=(1,) * size)

    def next_schedule(self, barrier: int, push_times, intervals) -> Schedule:
        """The superstep after barrier round ``barrier``: a pure function of its metadata.

        ``push_times``: the barrier round's push times (every worker computes
        the barrier step; the barrier is imposed at the latest); ``intervals``:
        each worker's iteration interval, seconds.
        """
        from tfsync.scheduler import predict_end_times, zipline

        size = len(intervals)
        start = barrier + 1
        if start < MONITORING_STEPS:
            return Schedule(start=start, barrier=start, iterations=(1,) * size)
        t_start = float(np.max(push_times))
        t = time.perf_counter()
        intervals = np.asarray(intervals, np.float64)
        intervals = np.where(np.isfinite(intervals), np.maximum(intervals, MIN_INTERVAL_S), MIN_INTERVAL_S)
        ends = predict_end_times(np.stack([t_start - intervals, np.full(size, t_start)], axis=1), R=self.lookahead)
        result = zipline(ends, self.algorithm)
        decision_s = time.perf_counter() - t
        iterations = tuple(result.iterations.tolist())
        return Schedule(
            start=start,
            barrier=barrier + max(iterations),
            iterations=iterations,
            predicted_t_sync_s=float(result.t_sync),
            predicted_wait_s=float(result.wait),
            decision_s=decision_s,
        )
