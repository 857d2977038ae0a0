"""Numbered rounds of one grouped allreduce, run in order on a communication thread.

Round ``r`` sums every worker's contribution for its step ``r``.  The payload
is a list of tensors (one per trainable variable) that this module never
looks into: it hands it to the injected ``collective`` as it is, so in
production the tensors go straight into ``hvd.grouped_allreduce`` (on a GPU
they stay on the device and Horovod's NCCL path serves them), and a test can
pass NumPy arrays and an in-process fake.

The round's metadata (:mod:`tfsync.engine.wire.layout`) rides in the same
collective, so after every round each worker holds every worker's step, push
time and compute time for it.

The training thread submits and waits; this thread talks to Horovod.  So a
worker computes step ``r + 1`` while round ``r`` is in flight.  A caller that
would only wait for the round it submits (BSP) runs it on its own thread
instead (``submit(..., inline=True)``) when nothing is queued ahead of it:
the same collective in the same order, without two thread hand-offs per
step, which cost milliseconds on a machine whose cores are all busy.  That
wait sits inside Horovod, which never times out a peer that is alive but
stuck, so a watchdog thread bounds it (``submit``'s ``timeout_s``).  Every other
collective a worker issues while training (e.g. averaging epoch logs) goes
through :meth:`RoundExchange.call` on the same thread: Horovod's eager ops
fail when two threads of one process run collectives at once, and one queue
also keeps every rank's collectives in the same order.

An open round of gradients (BSP) checks its *sum* instead of each
contribution (:attr:`RoundExchange.sum_check`, set by the engine;
:mod:`tfsync.engine.wire.checked`): a non-finite sum is redone without the
contributions that are not finite, and the engine counts what
:attr:`RoundResult.rejected_after_sum` says when it applies the round.
Elsewhere a contribution that is not finite is rejected by the engine before it gets
here (:mod:`tfsync.engine.nonfinite`): it comes as zeros with ``rejected``
set, and its row says ``present`` 0, ``rejected`` 1.  So an open round whose
collective averages over every rank (``averages``: BSP's gradients,
DC-S3GD's updates) is rescaled to the mean over the ranks present, as a
coordinated round is divided by its ``d`` of fresh contributions; a round
with no rank present keeps its zeros.  A coordinated round that takes a
rejected contribution counts that rank among those it took (its closing
named it) but not in ``d``; one that does not take it discards it: it is
neither dropped nor withdrawn, since it was counted when it was rejected.

Coordinated rounds (PSP, backup workers), entered on rank 0's decision, are
the outbox's (:mod:`tfsync.engine.outbox`).

A round queued for this thread may be paced (:mod:`tfsync.engine.wire.pacing`:
DiLoCo's overlapped fragments): :attr:`RoundExchange.spread_s`, set by the
protocol, says over how many seconds its pieces may go; waiting for the
round, queueing a collective behind it or closing sends the rest at once.
"""

import concurrent.futures
import functools
import queue
import threading
import time

import numpy as np

from tfsync.engine.outbox import CoordinatedOutbox
from tfsync.engine.rounds import RoundResult
from tfsync.engine.wire.checked import checked_round
from tfsync.engine.wire.layout import META_COLUMNS, REJECTED
from tfsync.engine.wire.pacing import paced_round, payload_bytes

INLINE_WATCH_S = 1.0  # how often the watchdog of inline rounds looks (so an abort comes at most this late)


class RoundExchange(CoordinatedOutbox):
    """Ordered rounds over ``collective(payload, meta) -> (total, meta_sum)`` on one thread.

    ``payload`` is a list of tensors, ``meta`` a ``[size, len(META_FIELDS)]``
    float64 array; the collective returns the element-wise reduction of both
    over every rank (a sum for the metadata; the payload's reduction is the
    collective's own, e.g. a mean of gradients: then ``averages``, and a round
    with ranks absent is rescaled to the mean of those present).
    """

    def __init__(
        self,
        collective,
        rank: int,
        size: int,
        t0: float,
        *,
        absent=None,
        keep_stale=False,
        enters_when_ready=False,
        abort=None,
        averages=False,
    ):
        self._collective = collective
        self._averages = averages  # the collective divides an open round's sum by size (hvd.Average)
        # open rounds whose sum is checked instead of each contribution (set by the engine once its
        # protocol exists): scale_sum(total, d) -> (total / d, finite), finite(payload), absent()
        self.sum_check = None
        # in_range(payload) -> a bool per tensor: under compression=, whether a contribution fits the
        # wire type (tfsync.engine.wire.compression; set by the engine); a checked round's redo
        # rejects one that does not
        self.in_range = None
        # abort(): make the pending collective fail (the cluster's); bounds a round run inline
        self._abort = abort
        self.inline_expired = None  # the inline round whose bound ran out (the collective was aborted)
        self.on_inline_wait = None  # called about once a second while an inline round waits
        # spread_s(): the seconds a queued open round's pieces may be spread over (None: sent
        # at once; set by a protocol whose rounds are needed only some steps later)
        self.spread_s = None
        self.wire_bytes = None  # wire_bytes(payload): what a round of it puts on the wire (paced rounds' pieces)
        self._hurried_through = -1  # rounds up to this one are needed now: not paced
        self._queued_through = -1  # the newest round queued for this thread
        self._inline = None  # (round, started, deadline) of the inline round running, polled by the watchdog
        self._watchdog = None
        self._closing = threading.Event()
        self.rank, self.size, self.t0 = rank, size, t0
        # coordinated rounds: the payload of a rank that contributes nothing (or a
        # function returning it, called once when first needed), the outbox and
        # what happened to this rank's contributions
        self._absent = absent
        # keep_stale: a contribution that missed its round stays for the engine to
        # withdraw (and delay-compensate) instead of being dropped here
        self._keep_stale = keep_stale
        # enters_when_ready (Policy.enters_when_ready): a round aggregates every fresh contribution
        # its ranks hold when they enter it; the closing's accepted ranks are a lower bound
        self._enters_when_ready = enters_when_ready
        # coordinated rounds: d of the previous one (the same on every rank), which Horovod's
        # post-scale divides the next one's sum by; only a round whose d differs is rescaled
        self._last_d = size
        self._outbox = None  # (stamp, payload, push_time, compute_s, rejected)
        self._late = None  # (round, stamp, payload): a compensated contribution the coordinator took for round
        self._closed_through = -1
        self._entered_through = -1  # newest coordinated round this rank entered (on a closing or early)
        self._entered_early = {}  # round -> (ranks, late ranks) it aggregated, until its closing is checked
        self.early_rounds = 0  # coordinated rounds this rank entered on its ready notice's answer
        # this rank's drops (stamp, round at which it was found stale) not yet taken; the rest of
        # what happens to its contributions is in the rounds' metadata (the engine's Tally counts)
        self._drops = []  # (stamp, round at which it was found stale) not yet taken
        self._queue = queue.Queue()
        self._results = {}
        self._cond = threading.Condition()
        self._completed = -1
        self._error = None
        self._unfinished = 0  # queued or running items, guarded by _cond
        self._running = threading.Lock()  # held while an item talks to the collective
        self._thread = threading.Thread(target=self._run, name="tfsync-exchange", daemon=True)
        self._thread.start()

    @property
    def completed(self) -> int:
        """Newest round whose sum has arrived (-1: none)."""
        return self._completed

    @property
    def error(self):
        return self._error

    @property
    def closed_through(self) -> int:
        """Newest round the coordinator has closed, as far as this worker has heard (-1: none)."""
        return self._closed_through

    def submit(
        self,
        round_: int,
        payload: list,
        push_time: float,
        compute_s: float,
        inline: bool = False,
        present=True,
        timeout_s: float = None,
        rejected=False,
    ):
        """Queue round ``round_``; with ``inline``, run it now on this thread if nothing is queued.

        ``present=False``: this worker skipped the step (ElasticBSP) and ``payload`` is
        zeros; its row still carries ``compute_s``, its latest iteration interval.
        ``rejected``: this worker's contribution was not finite and ``payload`` is
        zeros; its row says so, and is not present.

        ``timeout_s`` bounds an inline round as the caller's wait would be
        bounded: a watchdog aborts the collective (the cluster's ``abort``)
        if it has not returned by then, the round fails, and
        :attr:`inline_expired` names it, so the caller can say that it timed
        out.  Without it, a peer whose process is alive but whose training
        thread is stuck would hold this thread in Horovod for as long as it
        stays stuck, until that rank exits.
        """
        meta = np.zeros((self.size, META_COLUMNS), np.float64)
        meta[self.rank, :4] = (1.0 if present and not rejected else 0.0, round_, push_time, compute_s)
        meta[self.rank, REJECTED] = 1.0 if rejected else 0.0
        item = (round_, list(payload), meta)
        if inline and self._running.acquire(blocking=False):
            try:
                with self._cond:
                    idle = self._unfinished == 0
                if idle:
                    self._run_inline(item, timeout_s)
                    return
            finally:
                self._running.release()
        self._put(item)

    def _run_inline(self, item, timeout_s):
        if timeout_s is None or self._abort is None:
            self._run_round(item)
            return
        if self._watchdog is None:  # one thread for the exchange's life, not one per round
            self._watchdog = threading.Thread(target=self._watch_inline, name="tfsync-inline-watchdog", daemon=True)
            self._watchdog.start()
        now = time.monotonic()
        # a plain attribute the watchdog polls: no thread is woken on the step's path
        self._inline = (item[0], now, now + timeout_s)
        try:
            self._run_round(item)
        finally:
            self._inline = None

    def _watch_inline(self):
        """Every ``INLINE_WATCH_S``: an inline round running for longer reports this worker's
        clock (``on_inline_wait``, as a waiting worker does); one past its bound is aborted."""
        while not self._closing.wait(INLINE_WATCH_S):
            running = self._inline
            if running is None:
                continue
            round_, started, deadline = running
            now = time.monotonic()
            if now >= deadline and self._inline is running:
                self.inline_expired = round_
                self._abort()
            elif now - started >= INLINE_WATCH_S and self.on_inline_wait is not None:
                self.on_inline_wait()

    def _put(self, item):
        with self._cond:
            self._unfinished += 1
            if not isinstance(item[0], str):  # (a round's number; not a call, a closing, an entry)
                self._queued_through = max(self._queued_through, item[0])
        self._queue.put(item)

    def call(self, fn, timeout_s: float):
        """Run ``fn()`` (a collective) on the exchange thread after every queued round (sent
        unpaced from now on)."""
        future = concurrent.futures.Future()
        with self._cond:
            self._hurry(self._queued_through)
        self._put(("call", fn, future))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"tfsync: a collective did not finish within {timeout_s:.0f} s") from None

    def wait(self, round_: int, timeout_s: float) -> bool:
        """Block until round ``round_`` is complete; False on timeout. Re-raises thread errors."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._hurry(round_)
            while self._completed < round_ and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            if self._error is not None:
                raise self._error
        return True

    def pop(self, round_: int) -> RoundResult:
        with self._cond:
            return self._results.pop(round_)

    def _hurry(self, round_):
        """Rounds up to ``round_`` are needed: their pieces left go at once (holding ``_cond``)."""
        if round_ > self._hurried_through:
            self._hurried_through = round_
            self._cond.notify_all()

    def _pause(self, round_, seconds) -> bool:
        """A paced round's pause: up to ``seconds``; False (pace no more) once the round is needed
        or the exchange closes."""
        deadline = time.monotonic() + seconds
        with self._cond:
            while self._hurried_through < round_ and not self._closing.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return True
                self._cond.wait(left)
        return False

    def close(self, timeout_s: float = 10.0):
        self._closing.set()
        with self._cond:
            self._cond.notify_all()  # (a paced round's pause ends)
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._running:
                try:
                    if item[0] == "call":
                        _, fn, future = item
                        try:
                            future.set_result(fn())
                        except BaseException as exc:
                            future.set_exception(exc)
                    elif item[0] == "close":
                        if not self._run_closed_round(*item[1:]):
                            return
                    elif item[0] == "enter":
                        if not self._run_accepted_round(item[1]):
                            return
                    elif not self._run_round(item):
                        return
                finally:
                    with self._cond:
                        self._unfinished -= 1

    def _fail(self, exc) -> bool:
        with self._cond:
            self._error = exc
            self._cond.notify_all()
        return False

    def _run_round(self, item, accepted=None, late=(), coordinated=False) -> bool:
        """One round's collective; False (and the error kept for ``wait``) if it failed.

        ``coordinated``: the payload's sum is divided by ``d``, the number of
        fresh contributions in the round's metadata (late ones add on top).  A
        rank that entered early does not know ``d`` yet, so Horovod post-scales
        the sum by ``1 / d`` of the previous round (identical on every rank:
        rounds run in order), and a round whose ``d`` differs is rescaled by
        ``guess / d`` afterwards, the same way on every rank.  With a steady
        ``d`` (no straggler: every rank; a persistent one or backup workers:
        the same count each round) no eager operation touches the payload
        after the collective (a division of every tensor after every round
        would sit on the training thread's path).
        ``accepted`` (None: entered early) and ``late`` are then checked
        against it.
        """
        round_, payload, meta = item
        after_sum = None
        try:
            if not coordinated and self.sum_check is not None:
                payload, total, meta, after_sum = checked_round(
                    self._collective, payload, meta, self.rank, self.size, self.sum_check, self.in_range
                )
            elif not coordinated:
                spread = self.spread_s() if self.spread_s is not None else None
                if spread is not None and threading.current_thread() is self._thread:  # (the same on every rank)
                    pause = functools.partial(self._pause, round_)
                    wire = (self.wire_bytes or payload_bytes)(payload)
                    total, meta = paced_round(self._collective, payload, meta, spread, pause, self.size, wire)
                else:
                    total, meta = self._collective(payload, meta)
            else:
                guess = self._last_d
                total, meta = self._collective(payload, meta, divisor=guess)
            meta = np.asarray(meta, np.float64).reshape(self.size, META_COLUMNS)
            d = int(np.count_nonzero(meta[:, 0]))  # the fresh contributions (a late one adds on top)
            # a rejected rank's zeros (a checked sum was divided by d already)
            if not coordinated and self._averages and self.sum_check is None and 0 < d < self.size:
                total = [t * (self.size / d) for t in total]
            if coordinated:
                # the ranks it took: those whose contribution it aggregated, and those whose
                # contribution it took but had rejected (their zeros; not in d)
                entered = np.flatnonzero(meta[:, 0] + meta[:, REJECTED]).tolist()
                took = tuple(entered), tuple(np.flatnonzero(meta[:, 4]).tolist())
                if d != guess and d > 0:  # (no rank present: zeros, and d stays)
                    total = [t * (guess / d) for t in total]
                    self._last_d = d
                if accepted is None:  # entered early: the closing, when it comes, is checked against this
                    accepted = took[0]
                    with self._cond:
                        self._entered_early[round_] = took
                        self.early_rounds += 1
                elif not self._agrees(took, accepted, late):
                    raise RuntimeError(
                        f"tfsync: round {round_} should aggregate ranks {sorted(accepted)}"
                        f"{' (at least)' if self._enters_when_ready else ''} and the late "
                        f"contributions of {sorted(late)} (the coordinator's decision) but ranks "
                        f"{list(took[0])} and late {list(took[1])} contributed; the workers disagree about the round"
                    )
                else:
                    accepted = took[0]  # (more than the closing's under enters_when_ready)
        except BaseException as exc:  # carried to the training thread by wait()
            return self._fail(exc)
        result = RoundResult(
            round=round_,
            total=list(total),
            present=meta[:, 0],
            steps=meta[:, 1],
            push_times=meta[:, 2],
            compute_s=meta[:, 3],
            contribution=payload,
            accepted=accepted,
            late=meta[:, 4],
            late_steps=meta[:, 5],
            rejected=meta[:, REJECTED],
            rejected_after_sum=after_sum,
        )
        with self._cond:
            self._results[round_] = result
            self._completed = round_
            if coordinated:  # a round that completed was closed, whether or not its closing came yet
                self._closed_through = max(self._closed_through, round_)
            self._cond.notify_all()
        return True
