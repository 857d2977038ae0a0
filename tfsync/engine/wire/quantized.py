"""Quantized outer rounds (Local SGD's and DiLoCo's ``quantize="int8"|"int4"``).

A plain allreduce of quantized values cannot stay quantized: the sum of int8
codes needs a wider type on the wire, and every worker's codes have their own
scales.  So a quantized round is, as torchft's quantized allreduce is, a
reduce-scatter done as an alltoall of quantized chunks, a local sum, and an
all-gather of the quantized result:

1. Each worker flattens its contribution to float32, pads it with zeros to
   ``size`` chunks of ``L`` values (``L`` a multiple of :data:`BLOCK`) and
   quantizes each chunk into one packed row (:func:`tfsync.ops.quantize_blocks`:
   the codes and one float32 scale per block of :data:`BLOCK` values).  With
   4-bit codes, error feedback: the worker adds the quantization error it kept
   from its last contribution of the same layout (DiLoCo's fragments each have
   their own) before it quantizes, and keeps the new one (a contribution's
   error is not lost, it arrives one round later).
2. An alltoall sends row ``j`` to worker ``j``, which receives every worker's
   row ``j``; it dequantizes and sums them in float32, in rank order, in one
   pass (:func:`tfsync.ops.dequantize_sum`), times the round's scale (the mean's
   ``1 / size``, or the engine's divisor), and quantizes that chunk of the
   result once more, without error feedback (the result's rounding is the same
   for every worker, so nothing is owed to anyone).
3. An all-gather gives every worker every chunk of the result: the same bytes
   on every worker, decoded alike, so the replicas stay bit-identical.
4. The round's metadata (:mod:`tfsync.engine.wire.layout`) rides in a float32
   allreduce of its own: a few hundred bytes.

Per worker and round, each collective sends and receives ``size - 1`` rows, so
the bytes on the wire are ``2 (size - 1) / size`` of the quantized contribution,
as a ring allreduce's are of a float32 one: about 0.25 (int8) and 0.13 (4-bit)
of the float32 round's at any worker count (:func:`wire_bytes`).

A contribution the engine rejected, or a rank absent from the round, sends
zeros, which quantize to zeros exactly; its error feedback is left as it was.
"""

import numpy as np

from tfsync import _horovod, ops
from tfsync.engine.wire import layout
from tfsync.engine.wire.layout import decode_meta, encode_meta
from tfsync.policies.local import QUANTIZE
from tfsync.policies.local import QUANTIZE_BLOCK as BLOCK  # values per float32 scale

BITS = {"int8": 8, "int4": 4}


def chunk_length(values: int, size: int) -> int:
    """``L``: each worker's chunk of a round of ``values`` floats (a compressed round's,
    :func:`tfsync.engine.wire.layout.chunk_length`), rounded up to a whole number of blocks."""
    return -(-layout.chunk_length(values, size) // BLOCK) * BLOCK


def wire_bytes(values: int, size: int, quantize) -> int:
    """Bytes one worker sends (and receives) for a round of ``values`` floats: a ring
    allreduce's ``2 (size - 1) / size`` of ``4 * values`` for float32; for a quantized round the
    alltoall's and the all-gather's ``size - 1`` packed rows each."""
    if size <= 1:
        return 0
    if quantize is None:
        return int(round(2 * (size - 1) / size * 4 * values))
    row = ops.quantized_row_bytes(chunk_length(values, size), BITS[quantize], BLOCK)
    return 2 * (size - 1) * row


def quantized_collective(quantize: str, average: bool, hvd=None):
    """``collective(payload, meta, divisor=None)`` whose payload travels quantized (the module
    docstring), with :func:`tfsync.engine.wire.horovod.horovod_collective`'s meaning: the payload's
    mean over every rank with ``average`` (and no ``divisor``), its sum divided by ``divisor``
    when given; the metadata summed.

    ``hvd``: ``horovod.tensorflow`` (default), or a stand-in with ``size()``, ``rank()``,
    ``Sum``, ``grouped_allreduce``, ``alltoall`` and ``allgather``.
    """
    import tensorflow as tf  # (here: the module's arithmetic above runs without TensorFlow)

    if quantize not in BITS:
        raise ValueError(f"tfsync: quantize={quantize!r}; expected one of {[q for q in QUANTIZE if q]}")
    if hvd is None:
        hvd = _horovod.horovod()
    size, rank, bits = hvd.size(), hvd.rank(), BITS[quantize]
    errors = {}  # 4-bit: this worker's quantization error per payload layout (a DiLoCo fragment's, a piece's own)

    def collective(payload, meta, divisor=None, part=None):
        # ``part``: a paced round's piece (tfsync.engine.wire.pacing), whose error feedback is its own
        shapes = [tuple(t.shape) for t in payload]
        dtypes = [t.dtype for t in payload]
        counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        values = sum(counts)
        length = chunk_length(values, size)
        flat = layout.as_chunks([tf.cast(t, tf.float32) for t in payload], size, length)
        present = bool(np.asarray(meta)[rank, 0] > 0)
        if bits == 4 and present:
            key = (part, *zip(shapes, dtypes))
            if key in errors:
                flat = flat + errors[key]
            rows, errors[key] = ops.quantize_blocks(flat, bits, BLOCK, residual=True)
        else:
            rows = ops.quantize_blocks(flat, bits, BLOCK)
        received = hvd.alltoall(rows, name="tfsync.quantized.scatter")
        factor = 1.0 / size if average and divisor is None else 1.0 / (divisor or 1)
        chunk = ops.dequantize_sum(received, bits, BLOCK, length, factor)
        mine = ops.quantize_blocks(tf.reshape(chunk, [1, length]), bits, BLOCK)
        gathered = hvd.allgather(mine, name="tfsync.quantized.gather")
        result = tf.reshape(ops.dequantize_blocks(gathered, bits, BLOCK, length), [-1])
        (wire,) = hvd.grouped_allreduce([encode_meta(meta)], op=hvd.Sum, name="tfsync.quantized.meta")
        total, offset = [], 0
        for shape, dtype, n in zip(shapes, dtypes, counts):
            total.append(tf.cast(tf.reshape(result[offset : offset + n], shape), dtype))
            offset += n
        return total, decode_meta(np.asarray(wire), size)

    return collective


__all__ = ["BITS", "BLOCK", "QUANTIZE", "chunk_length", "quantized_collective", "wire_bytes"]
