"""A round's payload on the wire in 16 bits (``compression="fp16" | "bf16"``), and its bytes.

Horovod's meaning (``horovod.tensorflow.compression``): each floating tensor
of 32 or 64 bits is cast to the wire type for the exchange and the result is
cast back to its own dtype; integer and 16-bit tensors go as they are.  The
round's metadata (:mod:`tfsync.engine.rounds`) is not compressed: it goes in
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
:mod:`tfsync.engine.quantized` does): concatenated in the wire type and cut
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

Bytes on the wire (:class:`WireBytes`), counted by the engine for every
collective a round runs (a redone BSP round counts twice) and for nothing
else (broadcasts, the control path and the epoch logs' averages are not
counted).  The model is a ring: an allreduce of ``B`` bytes over ``n``
workers sends and receives ``2·(n-1)/n·B`` bytes on each worker
(reduce-scatter then all-gather: NCCL's ring and Gloo's ring algorithms),
float16 ones included; a bfloat16 round's alltoall and all-gather send and
receive ``n - 1`` chunks each (:func:`chunk_length` values of 2 bytes).
``bytes_sent``/``bytes_received``: what went on the wire (the payload in its
wire dtype plus the float32 metadata, ``META_WIDTH`` per worker);
``uncompressed_bytes_sent``/``uncompressed_bytes_received``: the same rounds
with the payload in its own dtype (what they cost without compression).
With one worker nothing crosses a wire: all are 0.
"""

import threading

import numpy as np

from tfsync.engine.tally import BYTES
from tfsync.policies.base import COMPRESSIONS, check_compression

# the wire type's largest finite value and its unit roundoff (half an ulp at 1)
_WIRE = {"fp16": ("float16", 65504.0, 2.0**-11), "bf16": ("bfloat16", 3.3895313892515355e38, 2.0**-8)}


def chunk_length(values: int, size: int) -> int:
    """The values in each rank's chunk of a compressed round of ``values`` (the round is padded
    with zeros to ``size`` equal chunks)."""
    return -(-max(values, 1) // size)


def as_chunks(tensors, size: int, length: int):
    """``tensors`` flattened in order and padded with zeros into ``size`` rows (chunks) of
    ``length`` values, in their common dtype: the padding joins the same concat, so the round's
    values are copied once."""
    import tensorflow as tf

    flat = [tf.reshape(t, [-1]) for t in tensors]
    values = sum(int(np.prod(t.shape, dtype=np.int64)) for t in tensors)
    padding = tf.zeros([size * length - values], flat[0].dtype)
    return tf.reshape(tf.concat([*flat, padding], 0), [size, length])


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
            from tfsync.engine.protocols._tf import compile_flat

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


class WireBytes:
    """The bytes this worker's rounds put on the wire (module docstring), counted per collective
    call from the exchange thread (from the payload the call carried: DiLoCo's fragments make
    rounds of different sizes) and taken per step from the training thread.

    Args:
        size: the number of workers.
        compression: None, ``"fp16"`` or ``"bf16"``.
        meta_width: the metadata's float32 values per worker.
        quantize: None, ``"int8"`` or ``"int4"`` (Local SGD's and DiLoCo's quantized rounds,
            :func:`tfsync.engine.quantized.wire_bytes`; their metadata goes in an allreduce of
            its own).
    """

    def __init__(self, size: int, compression=None, meta_width: int = 0, quantize=None):
        self.size, self.compression, self.quantize = size, compression, quantize
        self._meta = size * meta_width * 4
        self._ring = 2.0 * (size - 1) / size if size > 1 else 0.0
        self._layouts = {}  # (shapes, dtypes) -> per-call bytes
        self._lock = threading.Lock()
        self._total = dict.fromkeys(BYTES, 0.0)
        self._taken = dict.fromkeys(BYTES, 0.0)

    def per_call(self, shapes, dtypes) -> dict:
        """The bytes one call carrying tensors of ``shapes`` and ``dtypes`` puts on the wire, each way."""
        import tensorflow as tf

        dtypes = [tf.as_dtype(d) for d in dtypes]
        key = (tuple(tuple(s) for s in shapes), tuple(d.name for d in dtypes))
        if key in self._layouts:
            return self._layouts[key]
        counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        ring, meta, compression = self._ring, self._meta, self.compression
        raw = sum(n * d.size for n, d in zip(counts, dtypes))
        if self.quantize is not None:
            from tfsync.engine.quantized import wire_bytes

            wire = wire_bytes(sum(counts), self.size, self.quantize) + ring * meta
        elif compression is None:
            wire = ring * (raw + meta)
        else:
            squeezed = sum(n for n, d in zip(counts, dtypes) if compresses(d, compression))
            kept = sum(n * d.size for n, d in zip(counts, dtypes) if not compresses(d, compression))
            if compression == "fp16":  # (a float16 allreduce: a ring of 2-byte values)
                wire = ring * (2 * squeezed + kept + meta)
            else:  # the alltoall's and the all-gather's n - 1 chunks of 2-byte values each way
                chunks = 2 * (self.size - 1) * chunk_length(squeezed, self.size) * 2 if squeezed else 0
                wire = chunks + ring * (kept + meta)
        uncompressed = ring * (raw + meta)
        self._layouts[key] = {
            "bytes_sent": wire,
            "bytes_received": wire,
            "uncompressed_bytes_sent": uncompressed,
            "uncompressed_bytes_received": uncompressed,
        }
        return self._layouts[key]

    def count(self, payload):
        """One collective call of a round ran, carrying ``payload``."""
        call = self.per_call([tuple(t.shape) for t in payload], [t.dtype for t in payload])
        with self._lock:
            for k, v in call.items():
                self._total[k] += v

    @property
    def total(self) -> dict:
        """Every call so far (this engine's run)."""
        with self._lock:
            return dict(self._total)

    def take(self) -> dict:
        """The bytes of the calls since the last :meth:`take`."""
        with self._lock:
            out = {k: self._total[k] - self._taken[k] for k in BYTES}
            self._taken = dict(self._total)
        return out


def wire_settings(policy, size: int):
    """``(compression, WireBytes, WireFormat or None)`` of an engine running ``policy``: its
    compression, checked; its bytes, counted per round; the range a contribution must keep to."""
    from tfsync.engine.rounds import META_WIDTH

    compression = check_compression(type(policy).__name__, policy.compression)
    wire_bytes = WireBytes(size, compression, META_WIDTH, getattr(policy, "quantize", None))
    per_rank = 2 if getattr(policy, "compensate", None) is not None else 1  # (a late contribution beside a fresh one)
    return compression, wire_bytes, WireFormat(compression, size, per_rank) if compression else None


def counted(collective, wire_bytes):
    """``collective`` that counts each call in ``wire_bytes``."""

    def run(payload, meta, divisor=None, part=None):
        # (``part``: a paced round's piece, given only to a collective that paces)
        out = collective(payload, meta, divisor=divisor, **({} if part is None else {"part": part}))
        wire_bytes.count(payload)
        return out

    return run


__all__ = ["BYTES", "WireBytes", "WireFormat", "compresses", "counted", "wire_dtype", "wire_settings"]
