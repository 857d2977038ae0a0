"""Pure-TensorFlow twins of the compiled ops, selected with ``TFSYNC_OPS_IMPL=reference``.

Same functions, signatures, outputs and error messages as :mod:`tfsync.ops._compiled`
(composed from stock TensorFlow ops, so slower: every intermediate is a tensor), for
machines without the compiled library and as the oracle the tests compare with:

* :func:`delay_compensate`, :func:`delay_compensate_adaptive`: DC-ASGD-c and
  DC-ASGD-a (Zheng et al., 2017).
* :func:`update_push_share`, :func:`update_apply_round`: the "updates"
  protocol's state updates (SSP, DSSP, ElasticBSP); also what runs on a GPU,
  where the compiled kernels (CPU only) do not.
* :func:`all_finite`: whether each tensor of a list is finite; also what runs on a
  GPU when the compiled library has no GPU kernels (a build without CUDA).
* :func:`scale_all_finite`: each tensor scaled, and whether it is finite; on a GPU
  likewise.

Errors follow the compiled kernels: in eager mode an ``InvalidArgumentError``; while
building a graph, a shape error is a ``ValueError`` (as from a shape function) and a
value error an ``InvalidArgumentError`` when the graph runs.
"""

import tensorflow as tf


def _accumulator(dtype):
    # As in the kernels: half and bfloat16 are summed and multiplied in float32.
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _shape_error(message):
    if tf.executing_eagerly():
        return tf.errors.InvalidArgumentError(None, None, message)
    return ValueError(message)


def _require(condition, *message):
    """Fails with ``message`` unless ``condition``; returns control dependencies.

    Eagerly the error is raised at once with the values formatted into the text;
    in a graph it is a ``tf.debugging.Assert`` that fails when the graph runs.
    """
    if tf.executing_eagerly():
        if not bool(condition):
            text = "".join(str(part.numpy()) if isinstance(part, tf.Tensor) else str(part) for part in message)
            raise tf.errors.InvalidArgumentError(None, None, text)
        return []
    return [tf.debugging.Assert(condition, list(message), summarize=16)]


def _require_scalar(tensor, name):
    if tensor.shape.rank is not None and tensor.shape.rank != 0:
        raise _shape_error(f"{name} must be a scalar, got shape {tensor.shape}")


def _require_same_shape(gradient, other, other_name):
    if not gradient.shape.is_compatible_with(other.shape):
        raise _shape_error(
            f"{other_name} must have the same shape as gradient: gradient has shape "
            f"{gradient.shape}, {other_name} has shape {other.shape}"
        )
    if tf.executing_eagerly():
        return []
    return [
        tf.debugging.assert_equal(
            tf.shape(gradient), tf.shape(other), message=f"{other_name} must have the same shape as gradient"
        )
    ]


def _require_finite(value, name):
    return _require(
        tf.math.is_finite(value),
        name,
        " must be finite, got ",
        value,
        "; check the schedule or config that produced it",
    )


def delay_compensate(gradient, w_now, w_stale, lambda_, name=None):
    with tf.name_scope(name or "delay_compensate"):
        checks = _require_same_shape(gradient, w_now, "w_now")
        checks += _require_same_shape(gradient, w_stale, "w_stale")
        _require_scalar(lambda_, "lambda_")
        checks += _require_finite(lambda_, "lambda_")
        acc = _accumulator(gradient.dtype)
        with tf.control_dependencies(checks):
            g = tf.cast(gradient, acc)
            # The kernel's association: g + ((lambda * g) * g) * (w_now - w_stale).
            out = g + tf.cast(lambda_, acc) * g * g * (tf.cast(w_now, acc) - tf.cast(w_stale, acc))
            return tf.stop_gradient(tf.cast(out, gradient.dtype))


def delay_compensate_adaptive(gradient, w_now, w_stale, mean_square, lambda0, momentum, epsilon, name=None):
    with tf.name_scope(name or "delay_compensate_adaptive"):
        checks = _require_same_shape(gradient, w_now, "w_now")
        checks += _require_same_shape(gradient, w_stale, "w_stale")
        for value, arg in ((lambda0, "lambda0"), (momentum, "momentum"), (epsilon, "epsilon")):
            _require_scalar(value, arg)
            checks += _require_finite(value, arg)
        checks += _require(
            (momentum >= 0.0) & (momentum <= 1.0),
            "momentum must be in [0, 1], got ",
            momentum,
            " (DC-ASGD-a uses 0.95)",
        )
        checks += _require(
            epsilon > 0.0, "epsilon must be > 0 so that lambda0 / sqrt(v + " "epsilon) stays finite, got ", epsilon
        )
        acc = _accumulator(gradient.dtype)
        if not gradient.shape.is_compatible_with(mean_square.shape):
            raise _shape_error(
                "mean_square must have the same shape as gradient: gradient has shape "
                f"{gradient.shape}, mean_square has shape {mean_square.shape}"
            )
        with tf.control_dependencies(checks):
            g = tf.cast(gradient, acc)
            gg = g * g
            m = tf.cast(momentum, acc)
            v = m * mean_square + (tf.constant(1.0, acc) - m) * gg
            assign = mean_square.assign(v)
        with tf.control_dependencies([assign]):
            lam = tf.cast(lambda0, acc) / tf.sqrt(v + tf.cast(epsilon, acc))
            out = g + lam * gg * (tf.cast(w_now, acc) - tf.cast(w_stale, acc))
            return tf.stop_gradient(tf.cast(out, gradient.dtype))


def update_push_share(variable, w_bar, pending, size, name=None):
    with tf.name_scope(name or "update_push_share"):
        _require_scalar(size, "size")
        checks = _require(size >= 1.0, "size is the number of workers, at least 1, got ", size)
        dtype, acc = variable.dtype, _accumulator(variable.dtype)
        with tf.control_dependencies(checks):
            w, p = tf.cast(w_bar, acc), tf.cast(pending, acc)
            share = tf.cast((tf.cast(variable, acc) - (w + p)) / tf.cast(size, acc), dtype)
            # as the kernel: pending stays where the share is not finite (the share is
            # then rejected whole, and pending restored)
            finite = tf.math.is_finite(share)
            new_pending = tf.where(finite, tf.cast(p + tf.cast(share, acc), dtype), pending.read_value())
            pending.assign(new_pending)
            variable.assign(tf.cast(w + tf.cast(new_pending, acc), dtype))
        return share, tf.reduce_all(finite)


def update_apply_round(variable, w_bar, pending, total, own_share, name=None):
    with tf.name_scope(name or "update_apply_round"):
        dtype, acc = variable.dtype, _accumulator(variable.dtype)
        if acc == dtype:
            # in-place variable ops, no temporaries (XLA's fusion of the same sums allocates
            # its results)
            w_bar.assign_add(total)
            pending.assign_sub(own_share)
            variable.assign(w_bar)
            variable.assign_add(pending)
            return
        new_w = tf.cast(tf.cast(w_bar, acc) + tf.cast(total, acc), dtype)
        new_p = tf.cast(tf.cast(pending, acc) - tf.cast(own_share, acc), dtype)
        w_bar.assign(new_w)
        pending.assign(new_p)
        variable.assign(tf.cast(tf.cast(new_w, acc) + tf.cast(new_p, acc), dtype))


def all_finite(tensors, name=None):
    with tf.name_scope(name or "all_finite"):
        return tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])


def scale_all_finite(tensors, scale, name=None):
    with tf.name_scope(name or "scale_all_finite"):
        scale = tf.convert_to_tensor(scale, tf.float64)
        scaled = []
        for t in tensors:
            acc = _accumulator(t.dtype)
            # float32 and the half types: the scale rounded to float32 first, as the kernel does
            scaled.append(tf.cast(tf.cast(scale, acc) * tf.cast(t, acc), t.dtype))
        return scaled, all_finite(tensors)


def _qmax(bits):
    return 127 if bits == 8 else 7


def _codes_bytes(length, bits):
    return length * bits // 8


def quantize_blocks(x, bits, block_size, residual=False, name=None):
    with tf.name_scope(name or "quantize_blocks"):
        rows, length = x.shape[0], x.shape[1]
        blocks = tf.reshape(x, [rows, length // block_size, block_size])
        qmax = _qmax(bits)
        scale = tf.reduce_max(tf.abs(blocks), axis=-1) / tf.constant(qmax, tf.float32)
        safe = tf.where(scale > 0, scale, tf.ones_like(scale))[..., None]
        q = tf.clip_by_value(tf.round(blocks / safe), -qmax, qmax)
        if bits == 8:
            codes = tf.bitcast(tf.cast(q, tf.int8), tf.uint8)
        else:
            pairs = tf.reshape(tf.cast(q + 8.0, tf.uint8), [rows, length // 2, 2])
            codes = tf.bitwise.bitwise_or(pairs[..., 0], tf.bitwise.left_shift(pairs[..., 1], tf.constant(4, tf.uint8)))
        scale_bytes = tf.reshape(tf.bitcast(scale, tf.uint8), [rows, -1])
        packed = tf.concat([tf.reshape(codes, [rows, _codes_bytes(length, bits)]), scale_bytes], axis=1)
        if not residual:
            return packed
        return packed, x - tf.reshape(q * scale[..., None], [rows, length])


def dequantize_blocks(packed, bits, block_size, length, name=None):
    with tf.name_scope(name or "dequantize_blocks"):
        rows = tf.shape(packed)[0]
        n_codes = _codes_bytes(length, bits)
        codes, scale_bytes = packed[:, :n_codes], packed[:, n_codes:]
        scale = tf.bitcast(tf.reshape(scale_bytes, [rows, length // block_size, 4]), tf.float32)
        if bits == 8:
            q = tf.cast(tf.bitcast(codes, tf.int8), tf.float32)
        else:
            low = tf.bitwise.bitwise_and(codes, tf.constant(15, tf.uint8))
            high = tf.bitwise.right_shift(codes, tf.constant(4, tf.uint8))
            q = tf.cast(tf.reshape(tf.stack([low, high], axis=-1), [rows, length]), tf.float32) - 8.0
        q = tf.reshape(q, [rows, length // block_size, block_size])
        return tf.reshape(q * scale[..., None], [rows, length])


def dequantize_sum(packed, bits, block_size, length, scale, name=None):
    with tf.name_scope(name or "dequantize_sum"):
        values = dequantize_blocks(packed, bits, block_size, length)
        total = tf.zeros([length], tf.float32)
        for i in range(packed.shape[0]):  # (in row order, as the kernel sums)
            total = total + values[i]
        return total * tf.cast(scale, tf.float32)
