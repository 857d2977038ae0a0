"""Numbered rounds of one fused allreduce, run in order on a communication thread.

Round ``r`` sums every worker's contribution for its step ``r``.  The buffer
carries a small metadata block after the payload: one row per rank, filled
only by that rank, so that after the sum every worker knows every worker's
step, push timestamp and compute time for the round (the replicated clock
table the policies read).  Timestamps ride as a float32 hi/lo pair: a row is
non-zero on one rank only, so the sum is exact and the float64 time survives.

The training thread submits and waits; this thread talks to Horovod.  So a
worker computes step ``r + 1`` while round ``r`` is in flight.  Every other
collective a worker issues while training (e.g. averaging epoch logs) goes
through :meth:`RoundExchange.call` on the same thread: Horovod's eager ops
fail when two threads of one process run collectives at once, and one queue
also keeps every rank's collectives in the same order.
"""
import concurrent.futures
import dataclasses
import queue
import threading
import time

import numpy as np

META_FIELDS = ("present", "step", "push_hi", "push_lo", "compute_s")
_K = len(META_FIELDS)


@dataclasses.dataclass
class RoundResult:
    """What every worker receives for a completed round."""

    round: int
    total: np.ndarray  # sum of the payloads, float32
    present: np.ndarray  # [size] 1.0 where that rank contributed
    steps: np.ndarray  # [size] step each rank stamped its contribution with
    push_times: np.ndarray  # [size] float64 seconds since the job's t0
    compute_s: np.ndarray  # [size]

    @property
    def contributors(self) -> int:
        return int(round(float(self.present.sum())))


class WorkerLostError(RuntimeError):
    """A peer stopped: raised on every surviving worker, naming the lost rank(s)."""


class RoundExchange:
    """Ordered rounds over ``allreduce_sum(np.ndarray) -> np.ndarray`` on one thread."""

    def __init__(self, allreduce_sum, rank: int, size: int, t0: float):
        self._allreduce_sum = allreduce_sum
        self.rank, self.size, self.t0 = rank, size, t0
        self._queue = queue.Queue()
        self._results = {}
        self._cond = threading.Condition()
        self._completed = -1
        self._error = None
        self._thread = threading.Thread(target=self._run, name="tfsync-exchange", daemon=True)
        self._thread.start()

    @property
    def completed(self) -> int:
        """Newest round whose sum has arrived (-1: none)."""
        return self._completed

    @property
    def error(self):
        return self._error

    def submit(self, round_: int, payload: np.ndarray, push_time: float, compute_s: float):
        p = payload.size
        buf = np.zeros(p + self.size * _K, dtype=np.float32)
        buf[:p] = payload.reshape(-1)
        hi = np.float32(push_time)
        row = buf[p + self.rank * _K: p + (self.rank + 1) * _K]
        row[:] = (1.0, round_, hi, np.float32(push_time - float(hi)), compute_s)
        self._queue.put((round_, p, buf))

    def call(self, fn, timeout_s: float):
        """Run ``fn()`` (a collective) on the exchange thread after every queued round."""
        future = concurrent.futures.Future()
        self._queue.put(("call", fn, future))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"tfsync: a collective did not finish within {timeout_s:.0f} s") from None

    def wait(self, round_: int, timeout_s: float) -> bool:
        """Block until round ``round_`` is complete; False on timeout. Re-raises thread errors."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
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

    def close(self, timeout_s: float = 10.0):
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            if item[0] == "call":
                _, fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
                continue
            round_, p, buf = item
            try:
                summed = self._allreduce_sum(buf)
            except BaseException as exc:  # carried to the training thread by wait()
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            meta = summed[p:].reshape(self.size, _K).astype(np.float64)
            result = RoundResult(
                round=round_, total=summed[:p], present=meta[:, 0], steps=meta[:, 1],
                push_times=meta[:, 2] + meta[:, 3], compute_s=meta[:, 4])
            with self._cond:
                self._results[round_] = result
                self._completed = round_
                self._cond.notify_all()
