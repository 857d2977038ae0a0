"""The bytes a worker's rounds put on the wire, counted per collective call (:class:`WireBytes`).

What :class:`WireBytes` counts: the bytes on the wire, by the engine for every
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
from tfsync.engine.wire import quantized
from tfsync.engine.wire.compression import compresses
from tfsync.engine.wire.layout import chunk_length


class WireBytes:
    """The bytes this worker's rounds put on the wire (module docstring), counted per collective
    call from the exchange thread (from the payload the call carried: DiLoCo's fragments make
    rounds of different sizes) and taken per step from the training thread.

    Args:
        size: the number of workers.
        compression: None, ``"fp16"`` or ``"bf16"``.
        meta_width: the metadata's float32 values per worker.
        quantize: None, ``"int8"`` or ``"int4"`` (Local SGD's and DiLoCo's quantized rounds,
            :func:`tfsync.engine.wire.quantized.wire_bytes`; their metadata goes in an allreduce of
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
            wire = quantized.wire_bytes(sum(counts), self.size, self.quantize) + ring * meta
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

    def count_calls(self, shapes, dtypes, n: int):
        """``n`` uncompressed calls of tensors of ``shapes`` and ``dtypes`` and no metadata ran
        (BSP's in-graph rounds, :mod:`tfsync.engine.protocols.in_graph`, counted when folded in)."""
        call = self.per_call(shapes, dtypes)
        with self._lock:
            for k, v in call.items():
                self._total[k] += n * (v - self._ring * self._meta)

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


def counted(collective, wire_bytes):
    """``collective`` that counts each call in ``wire_bytes``."""

    def run(payload, meta, divisor=None, part=None):
        # (``part``: a paced round's piece, given only to a collective that paces)
        out = collective(payload, meta, divisor=divisor, **({} if part is None else {"part": part}))
        wire_bytes.count(payload)
        return out

    return run


__all__ = ["BYTES", "WireBytes", "counted"]
