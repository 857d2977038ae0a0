"""tfsync.ops' block quantization (int8 and 4-bit codes, one float32 scale per block) against
NumPy, for BOTH implementations (the compiled kernels and the pure-TensorFlow twin), which
must give the same bytes: the replicas of a quantized round decode what the other workers
encoded."""

import numpy as np
import pytest
import tensorflow as tf

import tfsync.ops as ops
from tfsync.ops import _select

IMPLS = ("compiled", "reference")
BITS = (8, 4)
BLOCK = 8


@pytest.fixture(params=IMPLS)
def impl(request):
    previous = _select.get_implementation()
    _select.set_implementation(request.param)
    yield request.param
    _select.set_implementation(previous)


def numpy_codes(x, bits, block):
    """The codes and scales the format promises: scale = max|x| / qmax per block, codes
    round-half-even(x / scale) clipped to [-qmax, qmax]."""
    qmax = 127 if bits == 8 else 7
    blocks = x.reshape(x.shape[0], -1, block)
    scale = (np.abs(blocks).max(axis=-1) / np.float32(qmax)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))[..., None]
    codes = np.clip(np.round(blocks / safe), -qmax, qmax)
    return codes.reshape(x.shape), scale


def sample(rng, rows=3, length=4 * BLOCK):
    x = rng.normal(size=(rows, length)).astype(np.float32)
    x[0, :BLOCK] = 0.0  # a block of zeros: scale 0, codes 0
    x[1, BLOCK : 2 * BLOCK] = np.float32(7.0) * np.arange(-3.5, 4.5)[:BLOCK].astype(np.float32)  # ties at int4
    return x


@pytest.mark.parametrize("bits", BITS)
def test_the_codes_are_the_nearest_and_each_blocks_extreme_value_comes_back(impl, bits):
    x = sample(np.random.default_rng(0))
    packed, residual = ops.quantize_blocks(x, bits, BLOCK, residual=True)
    assert packed.dtype == tf.uint8 and packed.shape == (3, ops.quantized_row_bytes(x.shape[1], bits, BLOCK))
    values = ops.dequantize_blocks(packed, bits, BLOCK, x.shape[1]).numpy()
    codes, scale = numpy_codes(x, bits, BLOCK)
    expected = (codes.reshape(3, -1, BLOCK) * scale[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(values, expected)
    np.testing.assert_array_equal(residual.numpy(), x - values)
    assert np.all(np.abs(x - values) <= np.repeat(scale, BLOCK, axis=1) / 2 + 1e-7)
    blocks = x.reshape(3, -1, BLOCK)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    decoded = np.take_along_axis(values.reshape(3, -1, BLOCK), np.abs(blocks).argmax(-1)[..., None], -1)
    np.testing.assert_allclose(decoded, extreme, rtol=2.4e-7)  # (qmax * (max / qmax): one rounding)
    assert not values[0, :BLOCK].any()


@pytest.mark.parametrize("bits", BITS)
def test_both_implementations_write_the_same_bytes(bits):
    x = sample(np.random.default_rng(1), rows=5, length=64 * BLOCK)
    out = {}
    previous = _select.get_implementation()
    try:
        for name in IMPLS:
            _select.set_implementation(name)
            packed = ops.quantize_blocks(x, bits, BLOCK)
            out[name] = (packed.numpy(), ops.dequantize_sum(packed, bits, BLOCK, x.shape[1], 0.25).numpy())
    finally:
        _select.set_implementation(previous)
    np.testing.assert_array_equal(out["compiled"][0], out["reference"][0])
    np.testing.assert_allclose(out["compiled"][1], out["reference"][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_sum_is_the_scaled_sum_of_the_rows(impl, bits):
    x = sample(np.random.default_rng(2), rows=4, length=6 * BLOCK)
    packed = ops.quantize_blocks(x, bits, BLOCK)
    rows = ops.dequantize_blocks(packed, bits, BLOCK, x.shape[1]).numpy()
    total = ops.dequantize_sum(packed, bits, BLOCK, x.shape[1], 0.5).numpy()
    np.testing.assert_allclose(total, rows.sum(axis=0) * np.float32(0.5), rtol=1e-6, atol=1e-6)


def test_large_rows_split_over_threads_give_the_reference_bytes():
    """More blocks than the kernels' thread split takes at once."""
    x = np.random.default_rng(3).normal(size=(2, 1 << 20)).astype(np.float32)
    previous = _select.get_implementation()
    try:
        out = []
        for name in IMPLS:
            _select.set_implementation(name)
            out.append(ops.quantize_blocks(x, 4, 256).numpy())
    finally:
        _select.set_implementation(previous)
    np.testing.assert_array_equal(out[0], out[1])


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda: ops.quantize_blocks(np.zeros((2, 16), np.float32), 5, BLOCK), r"bits must be 8 or 4, got 5"),
        (lambda: ops.quantize_blocks(np.zeros((2, 16), np.float32), 8, 3), r"block_size must be an even int"),
        (lambda: ops.quantize_blocks(np.zeros((2, 12), np.float32), 8, BLOCK), r"multiple of block_size=8, got 12"),
        (lambda: ops.quantize_blocks(np.zeros((16,), np.float32), 8, BLOCK), r"must be a matrix"),
        (lambda: ops.quantize_blocks(tf.zeros((2, 16), tf.float64), 8, BLOCK), r"x must be float32, got float64"),
        (lambda: ops.dequantize_blocks(tf.zeros((2, 15), tf.uint8), 8, BLOCK, 16), r"a matrix \[rows, 24\]"),
        (lambda: ops.dequantize_sum(tf.zeros((2, 24), tf.int8), 8, BLOCK, 16), r"packed must be uint8"),
        (lambda: ops.dequantize_sum(tf.zeros((2, 24), tf.uint8), 8, BLOCK, 16, float("nan")), r"scale must be"),
    ],
    ids=["bits", "block", "length", "rank", "dtype", "packed-shape", "packed-dtype", "scale"],
)
def test_bad_arguments_are_refused_saying_what_was_expected(impl, call, error):
    with pytest.raises((ValueError, TypeError), match=error):
        call()
