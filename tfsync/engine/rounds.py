"""What a round carries besides the payload, and the collective that carries it.

One small metadata block rides in every round's collective: one row per rank,
filled only by that rank, so that after the reduction every worker holds
every worker's step, push timestamp and compute time for the round (the
replicated clock table the policies read), and what happened to its
contribution (``present``, ``late``, ``rejected``).  On the wire a row is
float32 digits of base 2^16 (:func:`encode_meta`): a row is non-zero on one
rank only, so the sum is exact, and digits that small come back exactly from
a mean too (``round(mean * size)``), so the metadata can share one grouped
call with a payload that Horovod averages (:func:`horovod_collective`).
A completed round reaches the engine as a :class:`RoundResult`.
"""

import dataclasses

import numpy as np

from tfsync import _horovod

META_FIELDS = ("present", "step", "push_time", "compute_s", "late", "late_step", "rejected")
META_COLUMNS = len(META_FIELDS)
REJECTED = META_FIELDS.index("rejected")  # the column of the rejected flag
# wire digits per field: present 1, step 2 (< 2^32), push time and compute time in
# microseconds 3 each (< 2^48 us, 8.9 years), late 1, late step 2, rejected 1
_DIGITS = (1, 2, 3, 3, 1, 2, 1)
_TIMES = (2, 3)  # the fields in seconds, sent as microseconds
META_WIDTH = sum(_DIGITS)
_BASE = 1 << 16


_FIELD_SCALE = tuple(1e6 if k in _TIMES else 1.0 for k in range(META_COLUMNS))  # field -> its integer on the wire
# decoding: wire column -> field, weighted by its digit's place (2^0, 2^16, 2^32), and the
# fields' scales back to seconds.  In float64 every value is an integer below 2^53, so the
# product with the weights is exact
_DIGIT_WEIGHTS = np.zeros((META_WIDTH, META_COLUMNS))
_DIGIT_WEIGHTS[np.arange(META_WIDTH), np.repeat(np.arange(META_COLUMNS), _DIGITS)] = np.concatenate(
    [float(_BASE) ** np.arange(n) for n in _DIGITS]
)
_FIELD_DIVISOR = np.asarray(_FIELD_SCALE)


def encode_meta(meta: np.ndarray) -> np.ndarray:
    """``[size, len(META_FIELDS)]`` float64 rows (missing trailing fields are 0) -> flat
    float32 base-2^16 digits (``size * META_WIDTH``).

    Only the non-zero rows are encoded (a rank fills its own row), one Python
    integer at a time: for a few small rows that is cheaper than a chain of
    NumPy calls, and it runs on every round's path.
    """
    meta = np.asarray(meta, np.float64)
    wire = np.zeros((meta.shape[0], META_WIDTH), np.float32)
    for i in np.flatnonzero(meta.any(axis=1)).tolist():
        digits = []
        for value, scale, n in zip(meta[i].tolist(), _FIELD_SCALE, _DIGITS):
            value = max(round(value * scale), 0)
            for _ in range(n):
                digits.append(value & (_BASE - 1))
                value >>= 16
        wire[i, : len(digits)] = digits  # (fields the rows leave out stay 0)
    return wire.reshape(-1)


def decode_meta(wire, size: int, mean: bool = False, divisor: int = None) -> np.ndarray:
    """The inverse of :func:`encode_meta` after a sum over ranks (or, with ``mean``, an
    average; with ``divisor``, a sum divided by it)."""
    scale = size if mean else (divisor or 1)
    digits = np.rint(np.asarray(wire, np.float64).reshape(size, META_WIDTH) * scale)
    return (digits @ _DIGIT_WEIGHTS) / _FIELD_DIVISOR


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
    accepted: tuple = None  # coordinated rounds: the ranks whose contribution it aggregated
    late: np.ndarray = None  # [size] 1.0 where that rank added a late, delay-compensated contribution
    late_steps: np.ndarray = None  # [size] the step that late contribution was computed for
    rejected: np.ndarray = None  # [size] 1.0 where that rank's contribution was rejected (not finite): zeros
    # open rounds whose sum is checked: ("own", tensors) when this rank's contribution was found not
    # finite after the sum was, ("sum", tensors) when finite contributions' sum overflowed; else None
    rejected_after_sum: tuple = None

    @property
    def contributors(self) -> int:
        late = 0.0 if self.late is None else float(self.late.sum())
        return int(round(float(self.present.sum()) + late))


class WorkerLostError(RuntimeError):
    """A peer stopped: raised on every surviving worker, naming the lost rank(s).

    ``ranks``: the ranks it names as lost or at fault, sorted (None: it names none), as its
    message does."""

    def __init__(self, message, ranks=None):
        super().__init__(message)
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})


def horovod_collective(average: bool, hvd=None, compression=None):
    """``collective(payload, meta)`` over Horovod: one ``hvd.grouped_allreduce`` per round.

    The payload is averaged by Horovod itself with ``average`` (a post-scale
    in its fusion buffer, as ``hvd.Average`` does for plain Horovod users) or
    summed.  The metadata rides in the same call, encoded as float32 digits
    that survive either reduction exactly (:func:`encode_meta`):
    a second allreduce for it would cost a second negotiation per round.  A group
    must share one dtype, so a model with several weight dtypes makes one call
    per dtype (the metadata joins the float32 one).

    ``compression`` (``"fp16"``, ``"bf16"``; :mod:`tfsync.engine.compression`):
    the floating tensors wider than 16 bits are cast to the wire type and the
    result back to their own dtype, as Horovod's ``Compression.fp16`` does:
    float16 summed by one grouped float16 allreduce, bfloat16 by an alltoall
    and an all-gather of 16-bit words with each chunk summed in float32
    (:mod:`tfsync.engine.compression`).  The round's scale is applied after the
    cast back.  The metadata then goes alone in its float32 call, exact as ever.

    ``hvd``: ``horovod.tensorflow`` (default: as checked by
    :func:`tfsync._horovod.horovod`), or a stand-in with ``size()``, ``Sum``,
    ``Average``, ``grouped_allreduce`` and (bf16) ``alltoall`` and
    ``allgather`` (an in-process fake's ranks run this very function).
    """
    import tensorflow as tf  # (here: the round's bookkeeping above runs without TensorFlow)

    from tfsync.engine.compression import as_chunks, chunk_length, compresses, wire_dtype

    if hvd is None:
        hvd = _horovod.horovod()
    size = hvd.size()
    wire = wire_dtype(compression)

    def squeezed(tensors):
        """The sum of ``tensors`` (in the wire type) over the ranks, in the wire type, each the
        same bytes on every rank.  float16: Horovod's float16 allreduce (Gloo's ring sums float16
        with AVX where Horovod is built with it, as third_party/horovod's patch builds it; NCCL
        on GPUs).  bfloat16, which Horovod's allreduce does not take: a reduce-scatter (an
        alltoall of each rank's ``size`` chunks, each rank summing the chunk it owns in float32)
        and an all-gather of the summed chunks (:mod:`tfsync.engine.compression`)."""
        if wire == tf.float16:
            return hvd.grouped_allreduce(tensors, op=hvd.Sum, name="tfsync.round.wire")
        shapes = [t.shape for t in tensors]
        counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        values, length = sum(counts), chunk_length(sum(counts), size)
        flat = as_chunks(tensors, size, length)
        # (16-bit words: Horovod's alltoall and allgather take no bfloat16)
        received = hvd.alltoall(tf.bitcast(flat, tf.uint16), name="tfsync.round.scatter")
        rows = tf.cast(tf.bitcast(tf.reshape(received, [size, length]), wire), tf.float32)
        chunk = tf.reduce_sum(rows, axis=0)
        mine = tf.bitcast(tf.reshape(tf.cast(chunk, wire), [1, length]), tf.uint16)
        gathered = hvd.allgather(mine, name="tfsync.round.gather")
        summed = tf.reshape(tf.bitcast(gathered, wire), [-1])[:values]
        parts = tf.split(summed, counts)
        return [tf.reshape(p, s) for p, s in zip(parts, shapes)]

    def collective(payload, meta, divisor=None, part=None):
        # ``divisor``: a sum post-scaled by ``1 / divisor`` in Horovod's fusion buffer (a
        # coordinated round's guess of d, rescaled afterwards if wrong; the final round's d),
        # 1 for the plain sum an open round divides and checks itself (RoundExchange.sum_check);
        # ``part``: a paced round's piece (tfsync.engine.pacing), the same reduction
        mean = average and divisor is None
        op = hvd.Average if mean else hvd.Sum
        scale = {} if divisor in (None, 1) else {"postscale_factor": 1.0 / divisor}  # (1: a plain sum)
        groups, to_wire = {}, []
        for i, t in enumerate(payload):
            if wire is not None and compresses(t.dtype, compression):
                to_wire.append(i)
            else:
                groups.setdefault(t.dtype, []).append(i)
        groups.setdefault(tf.float32, [])
        total = [None] * len(payload)
        if to_wire:
            factor = 1.0 / size if mean else 1.0 / (divisor or 1)
            wire_tensors = [tf.cast(payload[i], wire) for i in to_wire]
            for i, out in zip(to_wire, squeezed(wire_tensors)):
                out = tf.cast(out, tf.as_dtype(payload[i].dtype))
                total[i] = out * factor if factor != 1.0 else out
        for k, (dtype, index) in enumerate(groups.items()):
            tensors = [payload[i] for i in index]
            if dtype == tf.float32:  # (NumPy: the op converts it itself)
                tensors.append(encode_meta(meta))
            outs = hvd.grouped_allreduce(tensors, op=op, name=f"tfsync.round.{k}", **scale)
            for i, o in zip(index, outs):
                total[i] = o
            if dtype == tf.float32:
                wire_meta = outs[-1].numpy()
        return total, decode_meta(wire_meta, size, mean=mean, divisor=divisor)

    return collective
