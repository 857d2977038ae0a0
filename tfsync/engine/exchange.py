"""Numbered rounds of one grouped allreduce, run in order on a communication thread.

Round ``r`` sums every worker's contribution for its step ``r``.  The payload
is a list of tensors (one per trainable variable) that this module never
looks into: it hands it to the injected ``collective`` as it is, so in
production the tensors go straight into ``hvd.grouped_allreduce`` (on a GPU
they stay on the device and Horovod's NCCL path serves them), and a test can
pass NumPy arrays and an in-process fake.

One small metadata block rides in the same collective: one row per rank,
filled only by that rank, so that after the reduction every worker holds
every worker's step, push timestamp and compute time for the round (the
replicated clock table the policies read).  On the wire a row is float32
digits of base 2^16 (:func:`encode_meta`): a row is non-zero on one rank
only, so the sum is exact, and digits that small come back exactly from a
mean too (``round(mean * size)``), so the metadata can share one grouped call
with a payload that Horovod averages.

The training thread submits and waits; this thread talks to Horovod.  So a
worker computes step ``r + 1`` while round ``r`` is in flight.  A caller that
would only wait for the round it submits (BSP) runs it on its own thread
instead (``submit(..., inline=True)``) when nothing is queued ahead of it:
the same collective in the same order, without two thread hand-offs per
step, which cost milliseconds on a machine whose cores are all busy.  Every other
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

META_FIELDS = ("present", "step", "push_time", "compute_s")
_K = len(META_FIELDS)
# wire digits per field: present 1, step 2 (< 2^32), push time and compute time in
# microseconds 3 each (< 2^48 us, 8.9 years)
_DIGITS = (1, 2, 3, 3)
META_WIDTH = sum(_DIGITS)
_BASE = 1 << 16


def encode_meta(meta: np.ndarray) -> np.ndarray:
    """``[size, 4]`` float64 rows -> flat float32 base-2^16 digits (``size * META_WIDTH``)."""
    meta = np.asarray(meta, np.float64)
    ints = np.stack([meta[:, 0], meta[:, 1], meta[:, 2] * 1e6, meta[:, 3] * 1e6], axis=1)
    ints = np.rint(np.maximum(ints, 0.0)).astype(np.int64)
    digits = []
    for field, n in enumerate(_DIGITS):
        value = ints[:, field]
        for _ in range(n):
            digits.append(value % _BASE)
            value = value // _BASE
    return np.stack(digits, axis=1).astype(np.float32).reshape(-1)


def decode_meta(wire, size: int, mean: bool = False) -> np.ndarray:
    """The inverse of :func:`encode_meta` after a sum (or, with ``mean``, an average) over ranks."""
    digits = np.asarray(wire, np.float64).reshape(size, META_WIDTH)
    digits = np.rint(digits * size if mean else digits).astype(np.int64)
    out, col = np.zeros((size, _K), np.float64), 0
    for field, n in enumerate(_DIGITS):
        value = np.zeros(size, np.int64)
        for k in range(n):
            value += digits[:, col + k] << (16 * k)
        out[:, field] = value
        col += n
    out[:, 2:] /= 1e6
    return out


@dataclasses.dataclass
class RoundResult:
    """What every worker receives for a completed round."""

    round: int
    total: list  # the collective's result, one tensor per payload tensor
    present: np.ndarray  # [size] 1.0 where that rank contributed
    steps: np.ndarray  # [size] step each rank stamped its contribution with
    push_times: np.ndarray  # [size] seconds since the job's t0
    compute_s: np.ndarray  # [size]
    contribution: list = None  # this worker's own payload for the round

    @property
    def contributors(self) -> int:
        return int(round(float(self.present.sum())))


class WorkerLostError(RuntimeError):
    """A peer stopped: raised on every surviving worker, naming the lost rank(s)."""


class RoundExchange:
    """Ordered rounds over ``collective(payload, meta) -> (total, meta_sum)`` on one thread.

    ``payload`` is a list of tensors, ``meta`` a ``[size, 4]`` float64 array;
    the collective returns the element-wise reduction of both over every rank
    (a sum for the metadata; the payload's reduction is the collective's own,
    e.g. a mean of gradients).
    """

    def __init__(self, collective, rank: int, size: int, t0: float):
        self._collective = collective
        self.rank, self.size, self.t0 = rank, size, t0
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

    def submit(self, round_: int, payload: list, push_time: float, compute_s: float,
               inline: bool = False):
        """Queue round ``round_``; with ``inline``, run it now on this thread if nothing is queued."""
        meta = np.zeros((self.size, _K), np.float64)
        meta[self.rank] = (1.0, round_, push_time, compute_s)
        item = (round_, list(payload), meta)
        if inline and self._running.acquire(blocking=False):
            try:
                with self._cond:
                    idle = self._unfinished == 0
                if idle:
                    self._run_round(item)
                    return
            finally:
                self._running.release()
        self._put(item)

    def _put(self, item):
        with self._cond:
            self._unfinished += 1
        self._queue.put(item)

    def call(self, fn, timeout_s: float):
        """Run ``fn()`` (a collective) on the exchange thread after every queued round."""
        future = concurrent.futures.Future()
        self._put(("call", fn, future))
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
            with self._running:
                try:
                    if item[0] == "call":
                        _, fn, future = item
                        try:
                            future.set_result(fn())
                        except BaseException as exc:
                            future.set_exception(exc)
                    elif not self._run_round(item):
                        return
                finally:
                    with self._cond:
                        self._unfinished -= 1

    def _run_round(self, item) -> bool:
        """One round's collective; False (and the error kept for ``wait``) if it failed."""
        round_, payload, meta = item
        try:
            total, meta = self._collective(payload, meta)
        except BaseException as exc:  # carried to the training thread by wait()
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            return False
        meta = np.asarray(meta, np.float64).reshape(self.size, _K)
        result = RoundResult(
            round=round_, total=list(total), present=meta[:, 0], steps=meta[:, 1],
            push_times=meta[:, 2], compute_s=meta[:, 3], contribution=payload)
        with self._cond:
            self._results[round_] = result
            self._completed = round_
            self._cond.notify_all()
        return True
