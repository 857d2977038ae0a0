"""Tests of tfsync.ops (DC-ASGD delay compensation, the "updates" protocol's state
updates, the finiteness check) against NumPy, run for BOTH implementations: the compiled kernels and the
pure-TensorFlow reference. The compiled library must be built first
(``pip install --no-build-isolation -e .``); a missing library fails these tests, it
is never skipped.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

import tfsync.ops as ops
from tfsync.launch import REPO_ROOT
from tfsync.ops import _loader, _select

IMPLS = ("compiled", "reference")
DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# rtol/atol per dtype: inputs are already rounded to the dtype, so only the final
# rounding (half: 2^-11, bfloat16: 2^-8) and float32 intermediates remain.
TOLERANCE = {
    tf.float16: (2e-3, 2e-3),
    tf.bfloat16: (1.6e-2, 1.6e-2),
    tf.float32: (2e-6, 1e-6),
    tf.float64: (1e-13, 1e-13),
}
SHAPES = ((), (0,), (7,), (3, 5, 7), (2, 0, 3))

LARGE = 1_000_001  # > 2 blocks of the kernels' thread split: exercises threading
STREAMED = 2_100_003  # float32 outputs >= 8 MiB take the non-temporal store path


def _values(rng, shape, dtype, scale=1.0):
    """A tensor of `dtype` and the same values as float64 NumPy (after rounding)."""
    t = tf.cast(tf.constant(rng.standard_normal(shape) * scale), dtype)
    return t, tf.cast(t, tf.float64).numpy()


def _some_not_finite(rng, in_blocks, scale=1.0):
    """Arrays of every shape the finiteness kernels split differently (a scalar, an empty one, a
    short and a 2-D one, one over two thread blocks; ``scale`` times standard normals), the short
    and the 2-D one ending in a NaN and an infinity; then three large ones holding ``in_blocks``
    in a different thread block each (first, middle, last element)."""
    arrays = []
    for shape, bad in (((), None), ((0,), None), ((7,), "nan"), ((3, 5), "inf"), ((LARGE,), None)):
        a = rng.standard_normal(shape) * scale
        if bad:
            a.reshape(-1)[-1] = float(bad)
        arrays.append(a)
    for position in (0, LARGE // 2, LARGE - 1):
        a = rng.standard_normal(LARGE)
        a[position] = in_blocks
        arrays.append(a)
    return arrays


def np_delay_compensate(g, w_now, w_stale, lam):
    return g + lam * g * g * (w_now - w_stale)


class OpsTestCase(tf.test.TestCase, parameterized.TestCase):
    # tf.test.TestCase's deprecated test_session() is not a test; keep pytest off it.
    test_session = None

    def use(self, impl):
        previous = ops.get_implementation()
        ops.set_implementation(impl)
        self.addCleanup(ops.set_implementation, previous)

    def assertClose(self, actual, expected, dtype):
        rtol, atol = TOLERANCE[dtype]
        self.assertAllClose(tf.cast(actual, tf.float64).numpy(), expected, rtol=rtol, atol=atol)


class DelayCompensateTest(OpsTestCase):
    @parameterized.product(impl=IMPLS, dtype=DTYPES, shape=SHAPES + ((LARGE,),))
    def test_matches_numpy(self, impl, dtype, shape):
        self.use(impl)
        rng = np.random.default_rng(4)
        g, g64 = _values(rng, shape, dtype)
        w_now, w_now64 = _values(rng, shape, dtype)
        w_stale, w_stale64 = _values(rng, shape, dtype)
        out = ops.delay_compensate(g, w_now, w_stale, 0.5)
        self.assertEqual(out.dtype, dtype)
        self.assertEqual(out.shape, shape)
        self.assertClose(out, np_delay_compensate(g64, w_now64, w_stale64, 0.5), dtype)

    @parameterized.product(impl=IMPLS, dtype=(tf.float32, tf.float64))
    def test_in_place_inside_tf_function(self, impl, dtype):
        # Inside a graph the gradient is a temporary, so the kernel writes into it.
        self.use(impl)
        rng = np.random.default_rng(5)
        g, g64 = _values(rng, (LARGE,), dtype)
        w_now, w_now64 = _values(rng, (LARGE,), dtype)
        fn = tf.function(lambda g, w_now: ops.delay_compensate(g * 2.0, w_now, w_now * 0.5, 0.25))
        self.assertClose(fn(g, w_now), np_delay_compensate(2 * g64, w_now64, 0.5 * w_now64, 0.25), dtype)
        self.assertClose(g, g64, dtype)  # the caller's tensor is untouched

    @parameterized.product(impl=IMPLS, dtype=(tf.float32, tf.float64))
    def test_large_outputs_streamed(self, impl, dtype):
        self.use(impl)
        rng = np.random.default_rng(9)
        g, g64 = _values(rng, (STREAMED,), dtype)
        w_now, w_now64 = _values(rng, (STREAMED,), dtype)
        w_stale, w_stale64 = _values(rng, (STREAMED,), dtype)
        self.assertClose(
            ops.delay_compensate(g, w_now, w_stale, 0.375),  # exact in float32
            np_delay_compensate(g64, w_now64, w_stale64, 0.375),
            dtype,
        )
        state_dtype = tf.float64 if dtype == tf.float64 else tf.float32
        v = tf.Variable(tf.fill([STREAMED], tf.constant(0.5, state_dtype)))
        out = ops.delay_compensate_adaptive(g, w_now, w_stale, v, 0.5, 0.5, 0.25)
        v64 = 0.25 + 0.5 * g64 * g64
        self.assertClose(out, np_delay_compensate(g64, w_now64, w_stale64, 0.5 / np.sqrt(v64 + 0.25)), dtype)
        self.assertAllClose(v.numpy(), v64, rtol=1e-6, atol=1e-6)

    @parameterized.product(impl=IMPLS)
    def test_held_results_survive_later_calls(self, impl):
        # The kernel reuses its previous output buffer only once it is released.
        self.use(impl)
        rng = np.random.default_rng(7)
        w_now, w_now64 = _values(rng, (LARGE,), tf.float32)
        w_stale, w_stale64 = _values(rng, (LARGE,), tf.float32)
        held, expected = [], []
        for i in range(3):
            g, g64 = _values(rng, (LARGE,), tf.float32)
            out = ops.delay_compensate(g, w_now, w_stale, 0.1)
            # Keep a tensor, a NumPy view of one, and drop one.
            held.append(out if i == 0 else out.numpy())
            expected.append(np_delay_compensate(g64, w_now64, w_stale64, 0.1))
            ops.delay_compensate(w_now, g, w_stale, 0.1)
        for out, exp in zip(held, expected):
            self.assertClose(out, exp, tf.float32)

    @parameterized.product(impl=IMPLS)
    def test_zero_lambda_is_identity(self, impl):
        self.use(impl)
        g = tf.constant([1.5, -2.0, 3.25])
        self.assertAllEqual(ops.delay_compensate(g, [1.0, 2.0, 3.0], [0.0, 0.0, 0.0], 0.0), g)

    @parameterized.product(
        impl=IMPLS,
        case=(
            (dict(w_now=tf.ones([4])), r"w_now must have the same shape as gradient"),
            (dict(w_stale=tf.ones([3, 1])), r"w_stale must have the same shape as gradient"),
            (dict(lambda_=float("inf")), r"lambda_ must be finite, got inf"),
            (dict(lambda_=float("nan")), r"lambda_ must be finite, got nan"),
            (dict(lambda_=[0.1]), r"lambda_ must be a scalar"),
        ),
    )
    def test_bad_input_raises(self, impl, case):
        self.use(impl)
        overrides, message = case
        args = dict(gradient=tf.ones([3]), w_now=tf.ones([3]), w_stale=tf.ones([3]), lambda_=0.1)
        args.update(overrides)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, message):
            ops.delay_compensate(**args)

    @parameterized.product(impl=IMPLS)
    def test_graph_construction_checks_shapes(self, impl):
        self.use(impl)
        with self.assertRaisesRegex(ValueError, "w_now must have the same shape as gradient"):
            tf.function(lambda: ops.delay_compensate(tf.ones([3]), tf.ones([4]), tf.ones([3]), 1.0))()

    def test_dtypes_are_checked(self):
        with self.assertRaisesRegex(TypeError, "gradient must be float16, bfloat16, float32 or float64"):
            ops.delay_compensate(tf.ones([2], tf.int32), tf.ones([2], tf.int32), tf.ones([2], tf.int32), 1.0)
        with self.assertRaisesRegex(TypeError, r"w_now must have the dtype of gradient \(float32\)"):
            ops.delay_compensate(tf.ones([2]), tf.ones([2], tf.float64), tf.ones([2]), 1.0)

    @parameterized.product(impl=IMPLS)
    def test_has_no_gradient(self, impl):
        self.use(impl)
        g = tf.Variable([1.0, 2.0])
        with tf.GradientTape() as tape:
            out = ops.delay_compensate(g * 1.0, [1.0, 1.0], [0.0, 0.0], 0.1)
            loss = tf.reduce_sum(out)
        self.assertIsNone(tape.gradient(loss, g))


class DelayCompensateAdaptiveTest(OpsTestCase):
    @parameterized.product(impl=IMPLS, dtype=DTYPES, shape=((), (0,), (7,), (3, 5, 7), (LARGE,)))
    def test_state_and_output_over_two_calls(self, impl, dtype, shape):
        self.use(impl)
        rng = np.random.default_rng(6)
        state_dtype = tf.float64 if dtype == tf.float64 else tf.float32
        v = tf.Variable(tf.zeros(shape, state_dtype))
        v64 = np.zeros(shape)
        # The hyperparameters are float32 scalars, also for float64 gradients.
        lambda0, momentum, epsilon = (float(np.float32(x)) for x in (0.5, 0.9, 1e-3))
        for _ in range(2):
            g, g64 = _values(rng, shape, dtype)
            w_now, w_now64 = _values(rng, shape, dtype)
            w_stale, w_stale64 = _values(rng, shape, dtype)
            out = ops.delay_compensate_adaptive(g, w_now, w_stale, v, lambda0, momentum, epsilon)
            v64 = momentum * v64 + (1 - momentum) * g64 * g64
            lam = lambda0 / np.sqrt(v64 + epsilon)
            self.assertEqual(out.dtype, dtype)
            self.assertClose(out, np_delay_compensate(g64, w_now64, w_stale64, lam), dtype)
            rtol = 1e-13 if dtype == tf.float64 else 1e-6
            self.assertAllClose(v.numpy(), v64, rtol=rtol, atol=rtol)

    @parameterized.product(impl=IMPLS)
    def test_pending_read_keeps_old_value(self, impl):
        # Copy-on-write: a tensor read before the update must not change under it.
        self.use(impl)
        v = tf.Variable(tf.fill([LARGE], 4.0))
        before = v.read_value()
        ops.delay_compensate_adaptive(tf.ones([LARGE]), tf.ones([LARGE]), tf.zeros([LARGE]), v, 1.0, 0.5, 1e-7)
        self.assertAllEqual(before[:3], [4.0, 4.0, 4.0])
        self.assertAllClose(v[:3], [2.5, 2.5, 2.5])

    @parameterized.product(impl=IMPLS)
    def test_inside_tf_function_updates_state(self, impl):
        self.use(impl)
        v = tf.Variable(tf.zeros([LARGE]))

        @tf.function
        def step(g):
            return ops.delay_compensate_adaptive(g * 1.5, tf.ones([LARGE]), tf.zeros([LARGE]), v, 1.0, 0.5, 1e-7)

        out = step(tf.ones([LARGE]))
        # v = 0.5 * 2.25 = 1.125; out = 1.5 + 1 / sqrt(1.125 + 1e-7) * 2.25 * 1
        self.assertAllClose(v[:2], [1.125, 1.125])
        self.assertAllClose(out[-2:], [1.5 + 2.25 / np.sqrt(1.125 + 1e-7)] * 2)
        step(tf.ones([LARGE]))
        self.assertAllClose(v[:2], [0.5 * 1.125 + 0.5 * 2.25] * 2)

    @parameterized.product(
        impl=IMPLS,
        case=(
            (dict(lambda0=float("nan")), r"lambda0 must be finite"),
            (dict(momentum=1.5), r"momentum must be in \[0, 1\], got 1.5"),
            (dict(momentum=float("inf")), r"momentum must be finite"),
            (dict(epsilon=0.0), r"epsilon must be > 0"),
            (dict(w_stale=tf.ones([2])), r"w_stale must have the same shape as gradient"),
            (dict(mean_square=tf.Variable(tf.zeros([4]))), r"mean_square must have the same shape as gradient"),
        ),
    )
    def test_bad_input_raises(self, impl, case):
        self.use(impl)
        overrides, message = case
        args = dict(
            gradient=tf.ones([3]),
            w_now=tf.ones([3]),
            w_stale=tf.ones([3]),
            mean_square=tf.Variable(tf.zeros([3])),
            lambda0=1.0,
            momentum=0.9,
            epsilon=1e-7,
        )
        args.update(overrides)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, message):
            ops.delay_compensate_adaptive(**args)

    def test_state_must_be_a_variable_of_the_accumulation_dtype(self):
        with self.assertRaisesRegex(TypeError, "mean_square must have dtype float32 for float16"):
            ops.delay_compensate_adaptive(
                tf.ones([2], tf.float16),
                tf.ones([2], tf.float16),
                tf.ones([2], tf.float16),
                tf.Variable(tf.zeros([2], tf.float16)),
                1.0,
            )
        with self.assertRaisesRegex(TypeError, "mean_square must be a tf.Variable"):
            ops.delay_compensate_adaptive(tf.ones([2]), tf.ones([2]), tf.ones([2]), tf.zeros([2]), 1.0)


class UpdateProtocolOpsTest(OpsTestCase):
    """update_push_share / update_apply_round against NumPy, over a push, rounds and
    more pushes, as the "updates" protocol calls them."""

    def state(self, rng, shape, dtype):
        w, w64 = _values(rng, shape, dtype)
        p, p64 = _values(rng, shape, dtype, 0.01)
        v = tf.Variable(tf.cast(tf.cast(w, tf.float32) + tf.cast(p, tf.float32), dtype))
        return v, tf.Variable(w), tf.Variable(p), v.numpy().astype(np.float64), w64, p64

    @parameterized.product(impl=IMPLS, dtype=DTYPES, shape=((), (0,), (7,), (3, 5, 7), (LARGE,)))
    def test_push_then_apply_against_numpy(self, impl, dtype, shape):
        self.use(impl)
        rng = np.random.default_rng(7)
        v, w, p, v64, w64, p64 = self.state(rng, shape, dtype)
        d, d64 = _values(rng, shape, dtype, 0.1)
        v.assign_add(d)
        v64 = tf.cast(v, tf.float64).numpy()
        share = ops.update_push_share(v, w, p, 4)
        share64 = (v64 - (w64 + p64)) / 4
        self.assertEqual(share.dtype, dtype)
        self.assertClose(share, share64, dtype)
        p64 = p64 + share64
        self.assertClose(p, p64, dtype)
        self.assertClose(v, w64 + p64, dtype)
        total, total64 = _values(rng, shape, dtype, 0.05)
        ops.update_apply_round(v, w, p, total, share)
        w64, p64 = w64 + total64, p64 - tf.cast(share, tf.float64).numpy()
        self.assertClose(w, w64, dtype)
        self.assertClose(p, p64, dtype)
        self.assertClose(v, w64 + p64, dtype)

    @parameterized.product(dtype=DTYPES)
    def test_compiled_is_bit_identical_to_reference(self, dtype):
        # the compiled kernels replaced these TensorFlow ops in the protocol: same
        # arithmetic, same rounding, so training is unchanged bit for bit
        outputs = {}
        for impl in IMPLS:
            self.use(impl)
            rng = np.random.default_rng(8)
            v, w, p, *_ = self.state(rng, (3, 1001), dtype)
            seen = []
            for _ in range(3):
                v.assign_add(tf.cast(rng.standard_normal((3, 1001)) * 0.1, dtype))
                share = ops.update_push_share(v, w, p, 3)
                ops.update_apply_round(v, w, p, tf.cast(rng.standard_normal((3, 1001)) * 0.01, dtype), share)
                seen += [tf.cast(x, tf.float64).numpy() for x in (share, v, w, p)]
            outputs[impl] = seen
        for compiled, reference in zip(outputs["compiled"], outputs["reference"]):
            self.assertAllEqual(compiled, reference)

    @parameterized.product(impl=IMPLS)
    def test_shares_in_flight_are_never_overwritten(self, impl):
        # the compiled push reuses released share buffers: shares still held (rounds in
        # flight) must keep their values while later pushes run
        self.use(impl)
        v, w, p = (tf.Variable(tf.zeros([LARGE])) for _ in range(3))
        held = []
        for k in range(12):
            v.assign_add(tf.fill([LARGE], float(k + 1)))
            held.append(ops.update_push_share(v, w, p, 1))
            if k % 3 == 2:  # a round applied: its share released, later pushes may reuse it
                ops.update_apply_round(v, w, p, held[0], held[0])
                held.pop(0)
        for share in held:
            self.assertEqual(float(tf.reduce_min(share)), float(tf.reduce_max(share)))
        self.assertAllEqual([float(s[0]) for s in held], [float(k + 1) for k in range(4, 12)])

    @parameterized.product(impl=IMPLS)
    def test_pending_read_keeps_old_value(self, impl):
        # copy-on-write: tensors read before the update must not change under it
        self.use(impl)
        v, w, p = (tf.Variable(tf.fill([LARGE], 2.0)) for _ in range(3))
        before = [x.read_value() for x in (v, w, p)]
        share = ops.update_push_share(v, w, p, 2)  # (2 - 4) / 2 = -1
        ops.update_apply_round(v, w, p, tf.ones([LARGE]), share)
        for t in before:
            self.assertAllEqual(t[:2], [2.0, 2.0])
        self.assertAllEqual(w[:2], [3.0, 3.0])
        self.assertAllEqual(p[:2], [2.0, 2.0])  # 2 + (-1), then - (-1)
        self.assertAllEqual(v[:2], [5.0, 5.0])

    @parameterized.product(impl=IMPLS)
    def test_inside_tf_function(self, impl):
        self.use(impl)
        v, w, p = (tf.Variable(tf.zeros([LARGE])) for _ in range(3))

        @tf.function
        def step(d, total):
            v.assign_add(d)
            share = ops.update_push_share(v, w, p, 2)
            ops.update_apply_round(v, w, p, total, share)
            return share

        share = step(tf.fill([LARGE], 4.0), tf.fill([LARGE], 3.0))
        self.assertAllEqual(share[-2:], [2.0, 2.0])
        self.assertAllEqual(v[-2:], [3.0, 3.0])  # w = 3, p = 2 - 2
        step(tf.fill([LARGE], 4.0), tf.fill([LARGE], 0.0))
        self.assertAllEqual(w[:2], [3.0, 3.0])
        self.assertAllEqual(v[:2], [3.0, 3.0])

    @parameterized.product(impl=IMPLS)
    def test_size_below_one_raises(self, impl):
        self.use(impl)
        v, w, p = (tf.Variable(tf.zeros([3])) for _ in range(3))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "size is the number of workers, at least 1"):
            ops.update_push_share(v, w, p, 0.0)

    def test_bad_arguments_raise_before_running(self):
        v, w, p = (tf.Variable(tf.zeros([3])) for _ in range(3))
        with self.assertRaisesRegex(TypeError, "w_bar must be a tf.Variable"):
            ops.update_push_share(v, tf.zeros([3]), p, 2)
        with self.assertRaisesRegex(TypeError, r"pending must have the dtype of variable \(float32\)"):
            ops.update_push_share(v, w, tf.Variable(tf.zeros([3], tf.float64)), 2)
        with self.assertRaisesRegex(ValueError, "w_bar must have the shape of variable"):
            ops.update_apply_round(v, tf.Variable(tf.zeros([4])), p, tf.zeros([3]), tf.zeros([3]))
        with self.assertRaisesRegex(ValueError, "own_share must have the shape of variable"):
            ops.update_apply_round(v, w, p, tf.zeros([3]), tf.zeros([2]))
        with self.assertRaisesRegex(TypeError, r"total must have the dtype of variable \(float32\)"):
            ops.update_apply_round(v, w, p, tf.zeros([3], tf.float64), tf.zeros([3]))
        with self.assertRaisesRegex(ValueError, "variable and pending are the same variable"):
            ops.update_push_share(v, w, v, 2)
        with self.assertRaisesRegex(TypeError, "variable must be float16, bfloat16, float32 or float64"):
            ops.update_push_share(*(tf.Variable(tf.zeros([3], tf.int32)) for _ in range(3)), 2)

    def test_kernel_rejects_one_variable_passed_twice(self):
        # the raw op, past the Python check: two handles of one variable (as a graph may hold)
        v, p = tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([3]))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "variable and w_bar are the same variable"):
            _loader.load_library().tf_sync_update_push_share(
                variable=v.handle, w_bar=v.handle, pending=p.handle, size=2.0, T=tf.float32
            )

    def test_compiled_kernels_run_on_cpu_variables(self):
        self.use("compiled")
        with tf.device("/CPU:0"):
            v = tf.Variable(tf.zeros([3]))
        self.assertTrue(ops.compiled_update_kernels(v))
        self.use("reference")
        self.assertFalse(ops.compiled_update_kernels(v))


class PushShareFinitenessTest(OpsTestCase):
    """update_push_share's flag: whether the share is finite, from the push's own pass; where
    it is not, pending stays as it was (so a rejected share can be taken back)."""

    @parameterized.product(impl=IMPLS, dtype=DTYPES, shape=((7,), (LARGE,)), bad=("nan", "inf", "-inf", None))
    def test_the_flag_says_whether_every_share_is_finite(self, impl, dtype, shape, bad):
        self.use(impl)
        rng = np.random.default_rng(3)
        v, w, p = (tf.Variable(_values(rng, shape, dtype, 0.1)[0]) for _ in range(3))
        d = rng.standard_normal(shape) * 0.1
        positions = [1, shape[0] - 2] if bad else []  # one in the first thread block, one in the last
        for i in positions:
            d[i] = float(bad)
        v.assign_add(tf.cast(d, dtype))
        p_before, w_before = p.numpy().astype(np.float64), w.numpy().astype(np.float64)
        share, finite = ops.update_push_share(v, w, p, 2, return_finite=True)
        self.assertEqual(bool(finite), bad is None)
        self.assertEqual(finite.shape, ())
        ok = np.ones(shape, bool)
        ok[positions] = False
        share64 = tf.cast(share, tf.float64).numpy()
        self.assertFalse(np.isfinite(share64[~ok]).any())
        # pending and the weights as before where the share is not finite, moved elsewhere
        self.assertAllEqual(p.numpy().astype(np.float64)[~ok], p_before[~ok])
        self.assertClose(tf.boolean_mask(p, ok), p_before[ok] + share64[ok], dtype)
        self.assertClose(v, w_before + p.numpy().astype(np.float64), dtype)
        self.assertTrue(np.isfinite(v.numpy().astype(np.float64)).all())

    @parameterized.product(dtype=DTYPES)
    def test_compiled_flags_and_selects_as_the_reference(self, dtype):
        outputs = {}
        for impl in IMPLS:
            self.use(impl)
            v, w, p = (tf.Variable(tf.zeros([3, 1001], dtype)) for _ in range(3))
            d = np.random.default_rng(9).standard_normal((3, 1001))
            d[1, 500], d[2, 7] = np.nan, np.inf
            v.assign_add(tf.cast(d, dtype))
            share, finite = ops.update_push_share(v, w, p, 3, return_finite=True)
            outputs[impl] = [bool(finite)] + [tf.cast(x, tf.float64).numpy() for x in (share, v, p)]
        self.assertEqual(outputs["compiled"][0], outputs["reference"][0])
        for compiled, reference in zip(outputs["compiled"][1:], outputs["reference"][1:]):
            self.assertAllEqual(compiled, reference)

    def test_without_return_finite_the_share_comes_alone(self):
        v, w, p = (tf.Variable(tf.zeros([3])) for _ in range(3))
        self.assertEqual(ops.update_push_share(v, w, p, 2).shape, (3,))


class AllFiniteTest(OpsTestCase):
    """all_finite: one bool per tensor of a list, as NumPy's isfinite says."""

    @parameterized.product(impl=IMPLS, dtype=DTYPES)
    def test_matches_numpy_per_tensor(self, impl, dtype):
        self.use(impl)
        tensors = [tf.cast(a, dtype) for a in _some_not_finite(np.random.default_rng(4), in_blocks=-np.inf)]
        out = ops.all_finite(tensors)
        self.assertEqual(out.dtype, tf.bool)
        self.assertAllEqual(out, [bool(np.isfinite(tf.cast(t, tf.float64).numpy()).all()) for t in tensors])

    @parameterized.product(impl=IMPLS)
    def test_mixed_dtypes_in_one_call_and_inside_tf_function(self, impl):
        self.use(impl)
        tensors = [tf.constant([1.0, np.nan]), tf.constant([1.0], tf.float64), tf.constant([np.inf], tf.float16)]
        self.assertAllEqual(ops.all_finite(tensors), [False, True, False])
        fn = tf.function(lambda a, b: ops.all_finite([a, b]), autograph=False)
        self.assertAllEqual(fn(tf.ones([4]), tf.fill([2, 2], np.nan)), [True, False])
        self.assertEqual(fn.get_concrete_function(tf.ones([4]), tf.ones([2, 2])).structured_outputs.shape, (2,))

    def test_bad_arguments_say_what_was_expected(self):
        with self.assertRaisesRegex(ValueError, "at least one tensor"):
            ops.all_finite([])
        with self.assertRaisesRegex(TypeError, r"tensors\[1\] must be float16, bfloat16, float32 or float64"):
            ops.all_finite([tf.ones([2]), tf.ones([2], tf.int32)])


class ScaleAllFiniteTest(OpsTestCase):
    """scale_all_finite: each tensor times the scale as Horovod's Average scales a sum (float32:
    the scale rounded to float32 first; half and bfloat16 in float32), and one bool per tensor."""

    @parameterized.product(impl=IMPLS, dtype=DTYPES)
    def test_matches_horovods_scaling_and_numpys_isfinite(self, impl, dtype):
        self.use(impl)
        arrays = _some_not_finite(np.random.default_rng(5), scale=100, in_blocks=np.nan)
        tensors = [tf.cast(a, dtype) for a in arrays]
        scaled, finite = ops.scale_all_finite(tensors, 1.0 / 3)
        self.assertEqual(finite.dtype, tf.bool)
        self.assertAllEqual(finite, [bool(np.isfinite(tf.cast(t, tf.float64).numpy()).all()) for t in tensors])
        acc = np.float64 if dtype == tf.float64 else np.float32
        for t, out in zip(tensors, scaled):
            self.assertEqual((out.dtype, out.shape), (t.dtype, t.shape))
            want = tf.cast(acc(1.0 / 3) * tf.cast(t, acc).numpy(), dtype)  # ScaleBufferCPUImpl's arithmetic
            self.assertAllEqual(tf.cast(out, tf.float64), tf.cast(want, tf.float64))

    @parameterized.product(impl=IMPLS)
    def test_an_output_still_held_is_not_overwritten_by_the_next_call(self, impl):
        self.use(impl)
        first, _ = ops.scale_all_finite([tf.ones([LARGE])], 2.0)
        second, _ = ops.scale_all_finite([tf.ones([LARGE])], 3.0)
        third, _ = ops.scale_all_finite([tf.ones([LARGE])], 4.0)
        self.assertAllEqual([first[0][0], second[0][-1], third[0][LARGE // 2]], [2.0, 3.0, 4.0])
        del first, second
        again, _ = ops.scale_all_finite([tf.ones([LARGE])], 5.0)  # (a released buffer, reused)
        self.assertAllEqual([third[0][0], again[0][0]], [4.0, 5.0])

    @parameterized.product(impl=IMPLS)
    def test_mixed_dtypes_in_one_call_and_inside_tf_function(self, impl):
        self.use(impl)
        tensors = [tf.constant([1.0, np.nan]), tf.constant([4.0], tf.float64), tf.constant([np.inf], tf.float16)]
        scaled, finite = ops.scale_all_finite(tensors, 0.5)
        self.assertAllEqual(finite, [False, True, False])
        self.assertAllEqual(scaled[1], [2.0])
        fn = tf.function(lambda a, b: ops.scale_all_finite([a, b], 0.25), autograph=False)
        (a, b), finite = fn(tf.ones([4]), tf.fill([2, 2], np.nan))
        self.assertAllEqual(finite, [True, False])
        self.assertAllEqual(a, [0.25] * 4)

    def test_bad_arguments_say_what_was_expected(self):
        with self.assertRaisesRegex(ValueError, "at least one tensor"):
            ops.scale_all_finite([], 1.0)
        with self.assertRaisesRegex(TypeError, r"tensors\[1\] must be float16, bfloat16, float32 or float64"):
            ops.scale_all_finite([tf.ones([2]), tf.ones([2], tf.int32)], 1.0)
        with self.assertRaisesRegex(ValueError, "scale must be a finite number, got inf"):
            ops.scale_all_finite([tf.ones([2])], float("inf"))


class ImplementationSwitchTest(tf.test.TestCase):
    test_session = None

    def create_tempdir(self):
        path = tempfile.mkdtemp(prefix="tfsync_ops_test_")
        self.addCleanup(shutil.rmtree, path)
        return path

    def test_env_values(self):
        self.assertEqual(_select.implementation_from_env({}), "compiled")
        self.assertEqual(_select.implementation_from_env({"TFSYNC_OPS_IMPL": "reference"}), "reference")
        self.assertEqual(_select.implementation_from_env({"TFSYNC_OPS_IMPL": "compiled"}), "compiled")
        with self.assertRaisesRegex(ValueError, "TFSYNC_OPS_IMPL='fast' is not an implementation"):
            _select.implementation_from_env({"TFSYNC_OPS_IMPL": "fast"})

    def test_env_var_is_read_at_import(self):
        for value, expected in (("reference", "reference"),):
            out = subprocess.run(
                [sys.executable, "-c", "import tfsync.ops as o; print(o.get_implementation())"],
                env=dict(os.environ, TFSYNC_OPS_IMPL=value, TF_CPP_MIN_LOG_LEVEL="3"),
                capture_output=True,
                text=True,
                check=True,
                timeout=120,
                cwd=REPO_ROOT,
            )
            self.assertEqual(out.stdout.strip().splitlines()[-1], expected)
        bad = subprocess.run(
            [sys.executable, "-c", "import tfsync.ops"],
            env=dict(os.environ, TFSYNC_OPS_IMPL="gpu", TF_CPP_MIN_LOG_LEVEL="3"),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("TFSYNC_OPS_IMPL='gpu' is not an implementation", bad.stderr)

    def test_set_implementation(self):
        previous = ops.get_implementation()
        self.addCleanup(ops.set_implementation, previous)
        ops.set_implementation("reference")
        self.assertEqual(ops.get_implementation(), "reference")
        with self.assertRaisesRegex(ValueError, "unknown tfsync.ops implementation 'numpy'"):
            ops.set_implementation("numpy")
        self.assertEqual(ops.get_implementation(), "reference")

    def test_missing_library_is_an_error_not_a_fallback(self):
        previous = ops.get_implementation()
        self.addCleanup(ops.set_implementation, previous)
        ops.set_implementation("compiled")
        empty = self.create_tempdir()
        with mock.patch.object(_loader, "_library", None), mock.patch.object(_loader, "library_dir", lambda: empty):
            with self.assertRaisesRegex(
                ops.OpLibraryError, r"_tfsync_ops.so does not exist.*pip install --no-build-isolation -e \."
            ):
                ops.delay_compensate([1.0], [1.0], [1.0], 0.1)

    def test_version_mismatch_says_rebuild(self):
        directory = self.create_tempdir()
        shutil.copy(os.path.join(_loader.library_dir(), _loader.LIBRARY_FILE), directory)
        with open(os.path.join(directory, _loader.BUILD_INFO_FILE), "w") as f:
            json.dump({"tensorflow_version": "1.0.0"}, f)
        with self.assertRaisesRegex(
            _loader.OpLibraryError, r"built against TensorFlow 1.0.0, but TensorFlow .* is running.*Rebuild"
        ):
            _loader._load(directory)

    def test_missing_build_info_says_rebuild(self):
        directory = self.create_tempdir()
        shutil.copy(os.path.join(_loader.library_dir(), _loader.LIBRARY_FILE), directory)
        with self.assertRaisesRegex(_loader.OpLibraryError, r"_build_info.json is missing.*rebuild"):
            _loader._load(directory)

    def test_compiled_library_loads_and_registers_all_ops(self):
        library = ops.load_library()  # public: `make install` calls it to check the build
        self.assertIs(_loader.load_library(), library)  # loaded once
        for op_name in _loader.OP_NAMES:
            # "TfSync>DelayCompensateAdaptive" -> tf_sync_delay_compensate_adaptive
            snake = "".join("_" + c.lower() if c.isupper() else c for c in op_name.split(">")[1])
            self.assertTrue(callable(getattr(library, "tf_sync" + snake)), op_name)


if __name__ == "__main__":
    tf.test.main()


class BenchmarkTest(tf.test.TestCase):
    """`python -m tfsync.bench ops` at a tiny size, so the benchmark cannot rot."""

    test_session = None

    def test_tiny_run_writes_records(self):
        from tfsync.bench import ops as bench_ops

        path = os.path.join(tempfile.mkdtemp(prefix="tfsync_bench_"), "ops.json")
        self.addCleanup(shutil.rmtree, os.path.dirname(path))
        previous = ops.get_implementation()
        self.addCleanup(ops.set_implementation, previous)
        self.assertEqual(bench_ops.main(["--sizes", "1K", "--repeats", "1", "--warmup", "0", "--json", path]), 0)
        with open(path) as f:
            records = json.load(f)
        seen = {(r["op"], r["impl"]) for r in records}
        for op in ("delay_compensate", "delay_compensate_adaptive"):
            for impl in ("fused", "composed_eager", "composed_xla", "fused_result_held"):
                self.assertIn((op, impl), seen)
        for op in ("update_push_share", "update_apply_round"):
            for impl in ("fused", "composed_eager", "composed_xla"):
                self.assertIn((op, impl), seen)
        self.assertIn(("update_push_share", "fused_result_held"), seen)
        self.assertNotIn(("update_apply_round", "fused_result_held"), seen)
        self.assertIn(("copy", "numpy_copyto"), seen)
        for r in records:
            self.assertEqual(r["elements"], 1024)
            self.assertGreater(r["seconds"], 0)
            self.assertAlmostEqual(r["gbytes_per_s"], r["bytes"] / r["seconds"] / 1e9)
