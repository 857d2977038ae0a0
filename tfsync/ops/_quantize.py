"""The quantization ops (:func:`quantize_blocks`, :func:`dequantize_blocks`,
:func:`dequantize_sum`, :func:`quantized_row_bytes`), checked and dispatched to the chosen
implementation; :mod:`tfsync.ops` exports them (its docstring says what each is for).
"""

import math

import tensorflow as tf

from tfsync.ops._select import backend as _backend

QUANTIZE_BITS = (8, 4)


def quantized_row_bytes(length, bits, block_size):
    """Bytes of one packed row of ``length`` values: the codes (``bits`` each), then one
    float32 scale per block of ``block_size``."""
    return length * bits // 8 + 4 * (length // block_size)


def _check_quantize(bits, block_size, length):
    if bits not in QUANTIZE_BITS:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be an even int >= 2, got {block_size!r}")
    if length is not None and (length <= 0 or length % block_size):
        raise ValueError(
            f"the row length must be a positive multiple of block_size={block_size}, got {length}; "
            "pad each row with zeros to a whole number of blocks"
        )


def quantize_blocks(x, bits, block_size, residual=False, name=None):
    """Symmetric block quantization of each row of ``x``: int8 (``bits=8``, codes in
    [-127, 127]) or 4-bit (``bits=4``, codes in [-7, 7], two per byte), one float32 scale
    per block of ``block_size`` values (the block's largest magnitude over the largest
    code, so the block's extreme value comes back to within a rounding), values rounded
    to the nearest code (ties to even).

    Args:
      x: a float32 tensor ``[rows, length]``, ``length`` a multiple of ``block_size``.
      bits: 8 or 4.
      block_size: an even int, the values sharing one scale.
      residual: also return ``x`` minus what the codes decode to (the quantization
        error, which error feedback adds to the next contribution).
      name: optional name scope.

    Returns:
      ``packed``, uint8 ``[rows, quantized_row_bytes(length, bits, block_size)]``: each
      row's codes then its scales (little-endian float32); with ``residual``,
      ``(packed, residual)``, ``residual`` float32 of ``x``'s shape.

    Raises:
      ValueError: bits other than 8 or 4, a bad block size or row length, not a matrix.
      TypeError: ``x`` is not float32.
    """
    x = x if tf.is_tensor(x) else tf.convert_to_tensor(x, tf.float32)
    if x.dtype != tf.float32:
        raise TypeError(f"x must be float32, got {x.dtype.name}; cast it first")
    if x.shape.rank != 2 or x.shape[1] is None or x.shape[0] is None:
        raise ValueError(f"x must be a matrix [rows, length] of known shape, got shape {x.shape}")
    _check_quantize(bits, block_size, int(x.shape[1]))
    return _backend().quantize_blocks(x, bits, block_size, residual=residual, name=name)


def _check_packed(packed, bits, block_size, length):
    _check_quantize(bits, block_size, length)
    packed = packed if tf.is_tensor(packed) else tf.convert_to_tensor(packed, tf.uint8)
    if packed.dtype != tf.uint8:
        raise TypeError(f"packed must be uint8 (quantize_blocks' output), got {packed.dtype.name}")
    want = quantized_row_bytes(length, bits, block_size)
    if packed.shape.rank != 2 or packed.shape[0] is None or packed.shape[1] != want:
        raise ValueError(
            f"packed must be a matrix [rows, {want}] (rows of {length} values at {bits} bits in blocks of "
            f"{block_size}), got shape {packed.shape}"
        )
    return packed


def dequantize_blocks(packed, bits, block_size, length, name=None):
    """The values ``packed`` rows (:func:`quantize_blocks`) stand for: float32 ``[rows, length]``."""
    packed = _check_packed(packed, bits, block_size, length)
    return _backend().dequantize_blocks(packed, bits, block_size, length, name=name)


def dequantize_sum(packed, bits, block_size, length, scale=1.0, name=None):
    """``scale`` times the sum of the values every row of ``packed`` stands for, summed in
    row order in float32, in one pass: float32 ``[length]``.  A worker sums the rows its
    peers sent it for its share of a quantized reduce-scatter with it."""
    packed = _check_packed(packed, bits, block_size, length)
    if not tf.is_tensor(scale) and not math.isfinite(float(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return _backend().dequantize_sum(packed, bits, block_size, length, tf.cast(scale, tf.float32), name=name)
