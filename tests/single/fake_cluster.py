"""N ranks of one job on threads of this process: the engine's cluster, without Horovod.

``FakeCluster(size).rank(r)`` is what ``SyncEngine(..., cluster=...)`` takes
(:mod:`tfsync.engine.cluster`).  Every collective meets as Horovod's do: the
k-th collective call of every rank meets the k-th call of every other rank;
they must agree on the kind, the name and the operation (a disagreement fails
every rank, where Horovod would stall), and every wait is bounded: a rank that
never arrives makes the others raise ``TimeoutError`` naming it, never hang.
``abort()`` is Horovod's shutdown: every pending and later collective of every
rank raises at once, with Horovod's "has been shut down" in its message.  The
arrival record (``arrival_key``, ``arrive``, ``leave``, ``missing``) is kept
here, per rank, as production's keeps it in Horovod's rendezvous store.

The round collective is production's own
:func:`tfsync.engine.wire.horovod.horovod_collective` (grouping by dtype, the
metadata row appended to the float32 group as :func:`encode_meta` digits,
:func:`decode_meta` of the result), run over this module's
``grouped_allreduce``, which reduces as Horovod does: the element-wise sum
over ranks in float32, then ``Average`` times ``1 / size`` and
``postscale_factor`` applied to it, both in float64 and rounded to float32
(Horovod's ``ScaleBuffer``); float16 is summed one rank at a time, each
addition rounded to float16, as Horovod's own float16 sum does, so a
compressed round (``compression="fp16"``) rounds and overflows here as it
does in production.  ``allgather`` (bf16's wire) concatenates the ranks'
tensors in rank order.
"""

import collections
import copy
import faulthandler
import sys
import tempfile
import threading
import time

import numpy as np
import tensorflow as tf

from tfsync.engine import protocols

DEFAULT_TIMEOUT_S = 10.0


class FakeCluster:
    """The shared meeting point of ``size`` ranks; ``rank(r)`` is rank ``r``'s cluster."""

    Sum, Average = "Sum", "Average"

    def __init__(self, size, timeout_s=DEFAULT_TIMEOUT_S):
        self.size, self.timeout_s = size, timeout_s
        self._cond = threading.Condition()
        self._calls = [0] * size
        self._slots = {}  # call index -> {rank: (signature, value)}
        self._out = {}  # call index -> [results per rank or an exception, ranks yet to read]
        self.log = []  # (call index, kind, name) of every collective that completed
        self.reductions = []  # (op, postscale_factor) of every grouped allreduce, in order
        self.entered = []  # (rank, name, time.monotonic()) of every collective call, as it began
        self.aborted_at = None  # time.monotonic() of the first abort()
        self.aborted_by = None  # the rank that called it
        self._keys = [collections.Counter() for _ in range(size)]  # per rank: calls per name
        self.arrivals = {}  # arrival key -> ranks arrived and not left

    def rank(self, rank):
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a cluster of {self.size}")
        return FakeRank(self, rank)

    def abort(self, rank):
        """Horovod's shutdown, called by ``rank``: every pending and later collective raises."""
        with self._cond:
            if self.aborted_at is None:
                self.aborted_at, self.aborted_by = time.monotonic(), rank
            self._cond.notify_all()

    def _shut_down(self, rank, kind, name):
        return RuntimeError(
            f"fake cluster: Horovod has been shut down (rank {self.aborted_by} called abort()); "
            f"rank {rank}'s {kind} {name!r} failed"
        )

    def meet(self, rank, kind, name, value, reduce, detail=None):
        """Rank ``rank``'s next collective: wait (bounded) for every rank's, reduce, return this rank's."""
        signature = (kind, name, detail)
        with self._cond:
            self.entered.append((rank, name, time.monotonic()))
            if self.aborted_at is not None:
                raise self._shut_down(rank, kind, name)
            k = self._calls[rank]
            self._calls[rank] += 1
            slot = self._slots.setdefault(k, {})
            slot[rank] = (signature, value)
            if len(slot) == self.size:
                signatures = {s for s, _ in slot.values()}
                if len(signatures) != 1:
                    out = RuntimeError(
                        f"fake cluster, collective {k}: the ranks disagree: "
                        + "; ".join(f"rank {r} called {slot[r][0]}" for r in sorted(slot))
                    )
                else:
                    try:
                        out = reduce([slot[r][1] for r in range(self.size)])
                        self.log.append((k, kind, name))
                    except Exception as exc:  # noqa: BLE001 - every rank raises it
                        out = exc
                self._out[k] = [out, self.size]
                del self._slots[k]
                self._cond.notify_all()
            deadline = time.monotonic() + self.timeout_s
            while k not in self._out:
                if self.aborted_at is not None:
                    raise self._shut_down(rank, kind, name)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.size)) - set(self._slots.get(k, {})))
                    raise TimeoutError(
                        f"fake cluster: rank {rank} waited {self.timeout_s:g} s for ranks {missing} "
                        f"in {kind} {name!r} (collective {k})"
                    )
                self._cond.wait(left)
            entry = self._out[k]
            entry[1] -= 1
            if entry[1] == 0:
                del self._out[k]
        if isinstance(entry[0], Exception):
            raise entry[0]
        return entry[0][rank]


def _scale(total, factor):
    """Horovod's post-scale of a float32 buffer: the product in float64, rounded to float32."""
    return (total.astype(np.float64) * factor).astype(total.dtype)


class FakeRank:
    """One rank's view: the engine's cluster interface, plus the few Horovod names
    (``size``, ``Sum``, ``Average``, ``grouped_allreduce``) production's
    :func:`~tfsync.engine.wire.horovod.horovod_collective` calls."""

    Sum, Average = FakeCluster.Sum, FakeCluster.Average

    def __init__(self, cluster, rank):
        self._cluster, self._rank = cluster, rank

    # the engine's cluster interface
    def rank(self):
        return self._rank

    def size(self):
        return self._cluster.size

    def allgather_object(self, obj, name):
        # every rank gets its own copies, as Horovod's pickling gives
        return self._cluster.meet(
            self._rank, "allgather_object", name, obj, lambda objs: [copy.deepcopy(objs) for _ in objs]
        )

    def broadcast_object(self, obj, root_rank, name):
        return self._cluster.meet(
            self._rank,
            "broadcast_object",
            name,
            obj,
            lambda objs: [copy.deepcopy(objs[root_rank]) for _ in objs],
            detail=root_rank,
        )

    def local_rank(self):
        return self._rank  # (every rank on one host)

    def broadcast(self, tensor, root_rank, name):
        value = np.asarray(tensor)
        return tf.constant(
            self._cluster.meet(
                self._rank, "broadcast", name, value, lambda vs: [vs[root_rank]] * len(vs), detail=root_rank
            )
        )

    def broadcast_variables(self, variables, root_rank, name):
        values = [np.asarray(protocols.tf_variable(v).numpy()) for v in variables]
        signature = tuple((str(a.dtype), a.shape) for a in values)
        out = self._cluster.meet(
            self._rank,
            "broadcast_variables",
            name,
            values,
            lambda vs: [copy.deepcopy(vs[root_rank]) for _ in vs],
            detail=(root_rank, signature),
        )
        for v, value in zip(variables, out):
            protocols.tf_variable(v).assign(value)

    def average(self, tensors, name):
        return self.grouped_allreduce(tensors, self.Average, name)

    def wire_ops(self):
        """This rank itself: production's rounds (tfsync.engine.wire) run over its Horovod names."""
        return self

    def barrier(self, name):
        return lambda: self._cluster.meet(self._rank, "barrier", name, None, lambda objs: [None] * len(objs))

    def abort(self):
        self._cluster.abort(self._rank)

    # the arrival record, kept in the shared cluster
    def arrival_key(self, name):
        with self._cluster._cond:
            counter = self._cluster._keys[self._rank]
            n = counter[name]
            counter[name] += 1
        return f"{name}#{n}"

    def arrive(self, key):
        with self._cluster._cond:
            self._cluster.arrivals.setdefault(key, set()).add(self._rank)

    def leave(self, key):
        with self._cluster._cond:
            ranks = self._cluster.arrivals.get(key, set())
            ranks.discard(self._rank)
            if not ranks:
                self._cluster.arrivals.pop(key, None)

    def missing(self, key):
        with self._cluster._cond:
            return sorted(set(range(self._cluster.size)) - self._cluster.arrivals.get(key, set()))

    # what the wire's collectives need from Horovod (horovod_collective, quantized_collective)
    def alltoall(self, tensor, name):
        """Equal splits of the first dimension: row block ``j`` goes to rank ``j``."""
        value = np.asarray(tensor)
        size = self._cluster.size

        def exchange(per_rank):
            parts = [np.split(v, size) for v in per_rank]
            return [tf.constant(np.concatenate([parts[src][dst] for src in range(size)])) for dst in range(size)]

        detail = (str(value.dtype), value.shape)
        return self._cluster.meet(self._rank, "alltoall", name, value, exchange, detail=detail)

    def allgather(self, tensor, name):
        value = np.asarray(tensor)
        out = self._cluster.meet(
            self._rank,
            "allgather",
            name,
            value,
            lambda vs: [np.concatenate(vs, axis=0)] * len(vs),
            detail=(str(value.dtype), value.shape[1:]),
        )
        return tf.constant(out)

    def grouped_allreduce(self, tensors, op, name, postscale_factor=1.0):
        arrays = [np.asarray(t) for t in tensors]
        dtypes = tuple(str(a.dtype) for a in arrays)
        shapes = tuple(a.shape for a in arrays)
        size = self._cluster.size

        def summed(parts):
            if parts[0].dtype != np.float16:
                return np.sum(parts, axis=0, dtype=parts[0].dtype)
            total = parts[0]
            for p in parts[1:]:  # (each addition in float32, rounded to float16)
                total = (total.astype(np.float32) + p.astype(np.float32)).astype(np.float16)
            return total

        def reduce(per_rank):
            totals = [summed([p[i] for p in per_rank]) for i in range(len(arrays))]
            factor = postscale_factor / size if op == self.Average else postscale_factor
            if factor != 1.0:
                totals = [_scale(t, factor) for t in totals]
            self._cluster.reductions.append((op, postscale_factor))
            return [[tf.constant(t) for t in totals] for _ in per_rank]

        return self._cluster.meet(
            self._rank, "grouped_allreduce", name, arrays, reduce, detail=(op, float(postscale_factor), dtypes, shapes)
        )


def on_threads(fns, timeout_s):
    """Run ``fns`` (one per rank) on threads; ``(results, errors)`` per rank.

    Bounded: a thread still running after ``timeout_s`` fails the test ("a rank hung").
    The first rank that raises while others still run prints where each of them
    was at that moment (their stacks, on stderr: pytest shows it with a failing
    test), so a failure that names a rank that did not come also says why.
    """
    results, errors = [None] * len(fns), [None] * len(fns)
    first_failure = threading.Lock()
    threads = []

    def guarded(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors[i] = exc
            if first_failure.acquire(blocking=False):
                _print_stacks(i, exc, [(r, t) for r, t in enumerate(threads) if r != i and t.is_alive()])

    threads.extend(threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(len(fns)))
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"a rank hung (errors elsewhere: {describe(errors)})"
    return results, errors


def _print_stacks(rank, exc, others):
    """Print every thread's stack, saying which thread is which rank.

    Through ``faulthandler``, which walks the stacks in C while holding the GIL:
    walking another running thread's frames from Python (``sys._current_frames``
    and ``traceback``) lets that thread run on between two frames (``linecache``
    releases the GIL) and crashed the interpreter on Python 3.11.
    """
    lines = [f"rank {rank} raised {type(exc).__name__}: {exc}"]
    with tempfile.TemporaryFile() as dump:
        faulthandler.dump_traceback(file=dump, all_threads=True)
        dump.seek(0)
        blocks = dump.read().decode(errors="replace").split("\n\n")
    # the ranks' own stacks first: a long dump is shortened in its middle by CI's log
    ranks = {f"0x{t.ident:016x}": r for r, t in others if t.ident is not None}
    for ident, r in ranks.items():
        lines += [f"rank {r}: {b}" for b in blocks if ident in b.split("\n", 1)[0]]
    lines += [b for b in blocks if not any(ident in b.split("\n", 1)[0] for ident in ranks)]
    print("\n".join(lines), file=sys.stderr)


def describe(errors):
    """Every rank's error, whole (an assertion's message: pytest shortens a list's repr)."""
    return "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in enumerate(errors) if e is not None) or "none"


def assert_no_errors(errors):
    """Fail naming every rank's error in full."""
    assert not any(errors), describe(errors)
