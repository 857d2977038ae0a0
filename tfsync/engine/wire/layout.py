"""A round's layout on the wire: the metadata block beside the payload, and the chunks a
reduce-scatter cuts the payload into.

One small metadata block rides in every round's collective: one row per rank,
filled only by that rank, so that after the reduction every worker holds
every worker's step, push timestamp and compute time for the round (the
replicated clock table the policies read), and what happened to its
contribution (``present``, ``late``, ``rejected``).  On the wire a row is
float32 digits of base 2^16 (:func:`encode_meta`): a row is non-zero on one
rank only, so the sum is exact, and digits that small come back exactly from
a mean too (``round(mean * size)``), so the metadata can share one grouped
call with a payload that Horovod averages (:func:`tfsync.engine.wire.horovod.horovod_collective`).

A round reduced as a reduce-scatter (bfloat16's, :mod:`~tfsync.engine.wire.compression`; a
quantized one, :mod:`~tfsync.engine.wire.quantized`) goes as ``size`` equal chunks of its
values, padded with zeros (:func:`chunk_length`, :func:`as_chunks`).
"""

import numpy as np

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


__all__ = [
    "META_COLUMNS",
    "META_FIELDS",
    "META_WIDTH",
    "REJECTED",
    "as_chunks",
    "chunk_length",
    "decode_meta",
    "encode_meta",
]
