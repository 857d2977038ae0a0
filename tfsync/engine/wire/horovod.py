"""The round over Horovod's allreduce: one ``hvd.grouped_allreduce`` per round, its metadata
in the same call (:func:`horovod_collective`).

Built on the cluster's Horovod operations (:meth:`~tfsync.engine.cluster.HorovodCluster.wire_ops`:
``horovod.tensorflow`` in production, the in-process fake's ranks in the single-process tests),
so the tests run production's own round.
"""

import numpy as np

from tfsync import _horovod
from tfsync.engine.wire.compression import compresses, wire_dtype
from tfsync.engine.wire.layout import as_chunks, chunk_length, decode_meta, encode_meta


def horovod_collective(average: bool, hvd=None, compression=None):
    """``collective(payload, meta)`` over Horovod: one ``hvd.grouped_allreduce`` per round.

    The payload is averaged by Horovod itself with ``average`` (a post-scale
    in its fusion buffer, as ``hvd.Average`` does for plain Horovod users) or
    summed.  The metadata rides in the same call, encoded as float32 digits
    that survive either reduction exactly (:func:`encode_meta`):
    a second allreduce for it would cost a second negotiation per round.  A group
    must share one dtype, so a model with several weight dtypes makes one call
    per dtype (the metadata joins the float32 one).

    ``compression`` (``"fp16"``, ``"bf16"``; :mod:`tfsync.engine.wire.compression`):
    the floating tensors wider than 16 bits are cast to the wire type and the
    result back to their own dtype, as Horovod's ``Compression.fp16`` does:
    float16 summed by one grouped float16 allreduce, bfloat16 by an alltoall
    and an all-gather of 16-bit words with each chunk summed in float32
    (:mod:`tfsync.engine.wire.compression`).  The round's scale is applied after the
    cast back.  The metadata then goes alone in its float32 call, exact as ever.

    ``hvd``: ``horovod.tensorflow`` (default: as checked by
    :func:`tfsync._horovod.horovod`), or a stand-in with ``size()``, ``Sum``,
    ``Average``, ``grouped_allreduce`` and (bf16) ``alltoall`` and
    ``allgather`` (an in-process fake's ranks run this very function).
    """
    import tensorflow as tf  # (here: the round's bookkeeping above runs without TensorFlow)

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
        and an all-gather of the summed chunks (:mod:`tfsync.engine.wire.compression`)."""
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
        # ``part``: a paced round's piece (tfsync.engine.wire.pacing), the same reduction
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


__all__ = ["horovod_collective"]
