"""A round's payload on the wire in 16 bits (``compression="fp16" | "bf16"``), and its bytes.

Horovod's meaning (``horovod.tensorflow.compression``): each floating tensor
of 32 or 64 bits is cast to the wire type for the exchange and the result is
cast back to its own dtype; integer and 16-bit tensors go as they are.  The
round's metadata (:mod:`tfsync.engine.wire.layout`) is not compressed: it goes in
a float32 call of its own, exact as ever, so a compressed round is two
grouped allreduces (one more negotiation; its bytes are counted).

A round's float16 tensors are summed by Horovod's own float16 allreduce, as
``Compression.fp16`` sums them: one grouped call, each of the ring's ``n - 1``
additions done in float32 and rounded to float16 (Gloo's AVX/F16C sum where
Horovod is built with AVX, which third_party/horovod's patch turns on: without
it Gloo converts element by element in software, 3x a float32 allreduce's time
on this project's machine; NCCL on GPUs).  The sum is cast back to each
tensor's dtype and scaled there (the mean's ``1 / size`` or the engine's
divisor).  Horovod's allreduce takes no bfloat16, so a round's bfloat16 tensors
are reduced as torchft reduces its quantized ones (and as
:mod:`tfsync.engine.wire.quantized` does): concatenated in the wire type and cut
into ``size`` chunks, an alltoall (of 16-bit words) sends chunk ``j`` to rank
``j``, which sums the ``size`` chunks it receives in float32 (converted
exactly) and casts its summed chunk to bfloat16 once; an all-gather gives
every rank every summed chunk.  Either way every rank decodes the same bytes,
so the replicas stay identical, and the bytes each way are a ring allreduce's
in the wire type, ``2·(n-1)/n`` of the payload, at any worker count.  What
each costs across slow links: docs/results/compression.

* ``"fp16"``: float16's largest value is 65504, so ``n`` finite
  contributions can sum to an infinity.  Horovod lets that infinity through;
  here a contribution with an element above :attr:`WireFormat.limit` in
  magnitude (65504 over ``n``, over the rounding the casts can add, and over 2
  where a rank's row may carry a late, compensated contribution besides its
  fresh one) is rejected before it is sent: counted as ``rejected``, traced
  and logged (:mod:`tfsync.engine.nonfinite`), never clipped or sent as an
  infinity.  Then no round's sum can overflow on the wire.  Under BSP, whose
  contributions are not checked one by one (the round's sum is), an
  overflow shows in the sum, which is redone without the contributions
  beyond that bound, and a redone sum still not finite rejects the round
  whole, counted as such (:mod:`tfsync.engine.exchange`).  Rejecting rather
  than scaling: dividing each contribution by ``n`` before the cast would
  lift the bound to 65504 but send every value below about ``6e-8·n`` as
  zero, and gradients live at the small end of the range; rejecting keeps
  float16's resolution and makes the rare large value visible and counted.
* ``"bf16"``: bfloat16 has float32's range (8 exponent bits) and 8 bits of
  mantissa: it rounds more than float16 and overflows only where float32
  would; the bound is bfloat16's largest value over ``n`` as above.
"""

import numpy as np

from tfsync.policies.base import COMPRESSIONS, check_compression

# the wire type's largest finite value and its unit roundoff (half an ulp at 1)
_WIRE = {"fp16": ("float16", 65504.0, 2.0**-11), "bf16": ("bfloat16", 3.3895313892515355e38, 2.0**-8)}


def wire_dtype(compression):
    """The TensorFlow dtype ``compression`` sends floating tensors in (None: none)."""
    if compression is None:
        return None
    import tensorflow as tf

    return tf.as_dtype(_WIRE[check_compression("compression", compression)][0])


def compresses(dtype, compression) -> bool:
    """Whether a tensor of ``dtype`` is cast for the wire under ``compression``: floating and wider
    than 16 bits."""
    import tensorflow as tf

    dtype = tf.as_dtype(dtype)
    return compression is not None and dtype.is_floating and dtype.size > 2


class WireFormat:
    """What ``compression`` means for one job: the range a contribution must stay in.

    Args:
        compression: ``"fp16"`` or ``"bf16"``.
        size: the number of workers.
        per_rank: contributions a rank's row may carry in one round (2 where a late,
            compensated contribution rides beside a fresh one: ``compensate=``).
    """

    def __init__(self, compression, size: int, per_rank: int = 1):
        if compression not in COMPRESSIONS:
            check_compression("WireFormat", compression)
            raise ValueError(f"tfsync: WireFormat needs a compression, one of {list(COMPRESSIONS)}")
        self.compression, self.size = compression, size
        dtype, largest, roundoff = _WIRE[compression]
        self.dtype_name = dtype
        # the sum of n rows, each of per_rank contributions with every |x| <= limit, is at most
        # n * per_rank * limit before rounding; the cast to the wire type and each of the n - 1
        # additions (rounded to the wire type in a float16 ring, to float32 and then once to the
        # wire type in a bfloat16 round) add at most a relative (1 + u): (1 + u)^(n + 1) bounds them
        self.limit = largest / (size * per_rank * (1.0 + roundoff) ** (size + 1))
        self._check = None

    def describe(self) -> str:
        return f"{self.dtype_name} (compression={self.compression!r})"

    def in_range(self, payload) -> np.ndarray:
        """Whether each tensor of ``payload`` stays within :attr:`limit` (a bool per tensor;
        tensors that go uncompressed are in range).  One compiled pass over the compressed ones,
        built at the first call."""
        import tensorflow as tf

        if self._check is None:
            from tfsync.engine._tf import compile_flat

            specs = [tf.TensorSpec(t.shape, t.dtype) for t in payload]
            limit = self.limit

            def check(*tensors):
                flags = []
                for t in tensors:
                    if compresses(t.dtype, self.compression):
                        # (a NaN compares False: it is not in range either)
                        flags.append(tf.reduce_all(tf.abs(t) <= tf.cast(limit, t.dtype)))
                    else:
                        flags.append(tf.constant(True))
                return tf.stack(flags)

            self._check = compile_flat(check, specs)
        return np.asarray(self._check(*payload), bool)


__all__ = ["WireFormat", "compresses", "wire_dtype"]
