"""TensorFlow ops for relaxed synchronization: delay compensation, the "updates"
protocol's state updates, and the finiteness check of a worker's contribution.

* :func:`delay_compensate`, :func:`delay_compensate_adaptive`: DC-ASGD's first-order
  correction of a stale gradient (Zheng et al., 2017), as used by DC-S3GD.
* :func:`update_push_share`, :func:`update_apply_round`: the state updates of the
  "updates" protocol (SSP, DSSP, ElasticBSP) on every step, each one pass over a
  weight tensor's three variables in place; the push also says whether its share
  is finite.
* :func:`all_finite`: whether each tensor of a list is finite, one read-only pass
  (the engine checks a contribution with it before it enters a round).
* :func:`scale_all_finite`: each tensor of a list scaled, and whether it is finite,
  from the one pass that scales it (the engine divides an open round's sum by its
  number of contributions with it, and so checks the sum for free).
* :func:`quantize_blocks`, :func:`dequantize_blocks`, :func:`dequantize_sum`: int8 and
  4-bit codes with one float32 scale per block, the residual for error feedback, and
  the fused dequantize-and-sum of received rows (Local SGD's and DiLoCo's quantized
  outer rounds, :mod:`tfsync.engine.wire.quantized`).

Each op has a compiled kernel (``ops/cc``, loaded lazily by
:mod:`tfsync.ops._loader`) and a pure-TensorFlow twin (:mod:`tfsync.ops._reference`);
``TFSYNC_OPS_IMPL=compiled|reference`` or :func:`set_implementation` chooses. All
ops accept float16, bfloat16, float32 and float64 (half and bfloat16 are computed in
float32) and have no gradient. See ``docs/ops.md``.
"""

import contextlib
import math

import tensorflow as tf  # noqa: E402

from tfsync.ops import _loader  # noqa: E402
from tfsync.ops._loader import OpLibraryError, load_library  # noqa: E402
from tfsync.ops._quantize import QUANTIZE_BITS as QUANTIZE_BITS  # noqa: E402
from tfsync.ops._quantize import (  # noqa: E402
    dequantize_blocks,
    dequantize_sum,
    quantize_blocks,
    quantized_row_bytes,
)

# First, so that a bad TFSYNC_OPS_IMPL fails before TensorFlow is loaded.
from tfsync.ops._select import backend as _backend
from tfsync.ops._select import get_implementation, set_implementation

__all__ = [
    "OpLibraryError",
    "all_finite",
    "delay_compensate",
    "delay_compensate_adaptive",
    "dequantize_blocks",
    "dequantize_sum",
    "get_implementation",
    "load_library",
    "quantize_blocks",
    "quantized_row_bytes",
    "scale_all_finite",
    "set_implementation",
    "update_apply_round",
    "update_push_share",
]

_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _float_tensor(value, arg, dtype=None, of="gradient"):
    # Python numbers and lists take the gradient's dtype; tensors must already have it.
    tensor = value if tf.is_tensor(value) else tf.convert_to_tensor(value, dtype=dtype)
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{arg} must be float16, bfloat16, float32 or float64, got {tensor.dtype.name}; "
            "cast it first (integer gradients are not supported)"
        )
    if dtype is not None and tensor.dtype != dtype:
        raise TypeError(f"{arg} must have the dtype of {of} ({dtype.name}), got " f"{tensor.dtype.name}")
    return tensor


def delay_compensate(gradient, w_now, w_stale, lambda_, name=None):
    """DC-ASGD-c: ``gradient + lambda_ * gradient * gradient * (w_now - w_stale)``.

    One fused element-wise pass. ``gradient`` was computed at the weights ``w_stale``
    and is about to be applied at ``w_now``.

    Args:
      gradient: float tensor.
      w_now: tensor of the same shape and dtype, the current weights.
      w_stale: tensor of the same shape and dtype, the weights ``gradient`` was
        computed at.
      lambda_: finite float scalar, the compensation strength (cast to float32).
      name: optional name scope.

    Returns:
      The compensated gradient, same shape and dtype as ``gradient``.

    Raises:
      tf.errors.InvalidArgumentError: mismatched shapes or non-finite ``lambda_``.
      TypeError: a non-float dtype or ``w_now``/``w_stale`` of another dtype.
    """
    gradient = _float_tensor(gradient, "gradient")
    return _backend().delay_compensate(
        gradient,
        _float_tensor(w_now, "w_now", gradient.dtype),
        _float_tensor(w_stale, "w_stale", gradient.dtype),
        tf.cast(lambda_, tf.float32),
        name=name,
    )


def delay_compensate_adaptive(gradient, w_now, w_stale, mean_square, lambda0, momentum=0.95, epsilon=1e-7, name=None):
    """DC-ASGD-a: delay compensation with ``lambda_t = lambda0 / sqrt(v_t + epsilon)``.

    Updates ``mean_square`` in place to ``v_t = momentum * v_{t-1} + (1 - momentum) *
    gradient**2`` and returns ``gradient + lambda_t * gradient * gradient * (w_now -
    w_stale)``, all in one fused pass.

    Args:
      gradient: as for :func:`delay_compensate`.
      w_now: as for :func:`delay_compensate`.
      w_stale: as for :func:`delay_compensate`.
      mean_square: ``tf.Variable`` holding ``v``, same shape as ``gradient``, dtype
        float32 (float64 when ``gradient`` is float64), e.g.
        ``tf.Variable(tf.zeros(shape, tf.float32))``.
      lambda0: finite float scalar.
      momentum: float scalar in ``[0, 1]`` (default 0.95, as in DC-ASGD-a).
      epsilon: float scalar ``> 0`` (default 1e-7).
      name: optional name scope.

    Returns:
      The compensated gradient, same shape and dtype as ``gradient``.

    Raises:
      tf.errors.InvalidArgumentError: mismatched shapes, non-finite scalars,
        ``momentum`` outside ``[0, 1]``, ``epsilon <= 0``.
      TypeError: ``mean_square`` is not a variable of the accumulation dtype.
    """
    gradient = _float_tensor(gradient, "gradient")
    if not isinstance(mean_square, tf.Variable):
        raise TypeError(
            f"mean_square must be a tf.Variable (the DC-ASGD-a state, updated in "
            f"place), got {type(mean_square).__name__}"
        )
    state_dtype = tf.float64 if gradient.dtype == tf.float64 else tf.float32
    if mean_square.dtype != state_dtype:
        raise TypeError(
            f"mean_square must have dtype {state_dtype.name} for "
            f"{gradient.dtype.name} gradients (the state is kept in the "
            f"accumulation type), got {mean_square.dtype.name}"
        )
    return _backend().delay_compensate_adaptive(
        gradient,
        _float_tensor(w_now, "w_now", gradient.dtype),
        _float_tensor(w_stale, "w_stale", gradient.dtype),
        mean_square,
        tf.cast(lambda0, tf.float32),
        tf.cast(momentum, tf.float32),
        tf.cast(epsilon, tf.float32),
        name=name,
    )


def _update_variables(variable, w_bar, pending):
    """The three variables of one weight tensor, checked: ``tf.Variable``s of one float
    dtype and one shape."""
    named = (("variable", variable), ("w_bar", w_bar), ("pending", pending))
    for arg, v in named:
        if not isinstance(v, tf.Variable):
            raise TypeError(
                f"{arg} must be a tf.Variable (the op updates it in place), got {type(v).__name__}; "
                "for a Keras variable pass its .value"
            )
    for i, (arg, v) in enumerate(named):
        for other, u in named[:i]:
            if u is v:
                raise ValueError(
                    f"{other} and {arg} are the same variable; pass three different variables "
                    "(the op updates each in place)"
                )
    if variable.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"variable must be float16, bfloat16, float32 or float64, got {variable.dtype.name}; "
            "integer variables are not trained"
        )
    for arg, v in named[1:]:
        if v.dtype != variable.dtype:
            raise TypeError(f"{arg} must have the dtype of variable ({variable.dtype.name}), got {v.dtype.name}")
        if not v.shape.is_compatible_with(variable.shape):
            raise ValueError(
                f"{arg} must have the shape of variable: variable has shape {variable.shape}, "
                f"{arg} has shape {v.shape}"
            )
    return variable, w_bar, pending


def _on_cpu(variable):
    """Whether the compiled kernels (CPU only) can update ``variable`` in place."""
    device = tf.DeviceSpec.from_string(variable.device or "").device_type
    if device is None:  # unplaced: where TensorFlow would put it
        return not tf.config.list_logical_devices("GPU")
    return device.upper() == "CPU"


def compiled_update_kernels(variable):
    """Whether :func:`update_push_share` and :func:`update_apply_round` run the compiled
    kernels on ``variable`` (the compiled implementation selected, the variable on CPU)."""
    return get_implementation() == "compiled" and _on_cpu(variable)


def _update_backend(variable):
    # The compiled kernels are CPU only: a variable on a GPU is updated by the reference's
    # TensorFlow ops, which run on the device (a placement rule, not a fallback: with
    # "compiled" selected and the library missing, a CPU variable still raises)
    if _on_cpu(variable):
        return _backend()
    from tfsync.ops import _reference

    return _reference


def update_push_share(variable, w_bar, pending, size, name=None, return_finite=False):
    """The "updates" protocol's push (SSP, DSSP, ElasticBSP), in place.

    Between steps ``variable == w_bar + pending``: ``w_bar`` is the sum of every
    complete round (identical on every worker) and ``pending`` the sum of this
    worker's shares in rounds not complete yet. After the optimizer moved
    ``variable`` by ``D``, one pass computes ``share = (variable - (w_bar +
    pending)) / size`` (``D / size``, what the worker pushes into its round),
    ``pending += share`` and ``variable = w_bar + pending``.

    The same pass says whether the share is finite. An element whose share is NaN
    or infinite leaves ``pending`` as it was there (and ``variable`` at ``w_bar +
    pending``), so a caller that rejects such a share can restore ``pending``
    exactly where it is not finite and by subtracting the share elsewhere.

    The compiled kernel runs on CPU (on a GPU, the reference's TensorFlow ops
    run instead) and reuses its released output buffers, so that the shares in
    flight do not fault fresh memory in on every step.

    Args:
      variable: ``tf.Variable``, the weight tensor the optimizer moved.
      w_bar: ``tf.Variable`` of the variable's dtype and shape, the sum of every
        complete round.
      pending: ``tf.Variable`` of the variable's dtype and shape, this worker's
        shares in rounds not complete yet.
      size: float scalar ``>= 1``, the number of workers.
      name: optional name scope.
      return_finite: also return whether every element of the share is finite.

    Returns:
      ``share``, a tensor of the variable's shape and dtype; with
      ``return_finite=True``, ``(share, finite)``, ``finite`` a bool scalar.

    Raises:
      TypeError, ValueError: a non-variable, mismatched dtypes or shapes.
      tf.errors.InvalidArgumentError: ``size < 1``.
    """
    variable, w_bar, pending = _update_variables(variable, w_bar, pending)
    share, finite = _update_backend(variable).update_push_share(
        variable, w_bar, pending, tf.cast(size, tf.float32), name=name
    )
    return (share, finite) if return_finite else share


def update_apply_round(variable, w_bar, pending, total, own_share, name=None):
    """The "updates" protocol's application of a complete round, in place.

    One pass: ``w_bar += total`` (the round's sum of every worker's share),
    ``pending -= own_share`` (this worker's share in it, now part of ``w_bar``)
    and ``variable = w_bar + pending``. ``w_bar`` changes by the same sum on every
    worker, so it stays bit-identical across them.

    Args:
      variable: as for :func:`update_push_share`.
      w_bar: as for :func:`update_push_share`.
      pending: as for :func:`update_push_share`.
      total: tensor of the variable's shape and dtype.
      own_share: tensor of the variable's shape and dtype, the share this
        worker pushed into the round.
      name: optional name scope.

    Raises:
      TypeError, ValueError: a non-variable, mismatched dtypes or shapes.
    """
    variable, w_bar, pending = _update_variables(variable, w_bar, pending)
    total = _float_tensor(total, "total", variable.dtype, of="variable")
    own_share = _float_tensor(own_share, "own_share", variable.dtype, of="variable")
    for arg, t in (("total", total), ("own_share", own_share)):
        if not t.shape.is_compatible_with(variable.shape):
            raise ValueError(
                f"{arg} must have the shape of variable: variable has shape {variable.shape}, "
                f"{arg} has shape {t.shape}"
            )
    _update_backend(variable).update_apply_round(variable, w_bar, pending, total, own_share, name=name)


def _finite_backend(tensors):
    """Where :func:`all_finite` and :func:`scale_all_finite` run, decided once per call:
    ``(implementation, device)``.

    Tensors on CPU: the selected implementation, pinned to their CPU (a library with GPU
    kernels would otherwise have TensorFlow copy them to a GPU). Tensors on a GPU: the
    compiled kernels when the compiled implementation is selected and the library was
    built with CUDA kernels, placed by TensorFlow with the tensors; else the reference's
    TensorFlow ops, which run on the device (a placement rule, not a fallback: with
    ``compiled`` selected and the library missing, this raises its error).
    """
    if all(_on_cpu(t) for t in tensors):
        return _backend(), next((t.device for t in tensors if t.device), None)
    if get_implementation() == "compiled" and _loader.has_gpu_kernels():
        return _backend(), None
    from tfsync.ops import _reference

    return _reference, None


def _on(device):
    return tf.device(device) if device else contextlib.nullcontext()


def all_finite(tensors, name=None):
    """Whether each tensor of ``tensors`` is finite: no element is NaN or infinite.

    One read-only pass over each tensor (its elements' exponent bits, tested
    without a branch), split over TensorFlow's intra-op threads for large
    tensors on CPU, one CUDA kernel per tensor on a GPU; one op for the whole
    list, so checking a model's gradients costs one call. Tensors on a GPU run
    the compiled GPU kernel when the library was built with CUDA (see
    ``docs/install.md``, "GPU build"), else the reference's TensorFlow ops, on
    the device.

    Args:
      tensors: a non-empty list of float16, bfloat16, float32 or float64 tensors
        (of any shapes and dtypes).
      name: optional name scope.

    Returns:
      A bool vector of ``len(tensors)``: ``finite[i]`` for ``tensors[i]``.

    Raises:
      ValueError: an empty list.
      TypeError: a tensor that is not floating point.
    """
    tensors = [_float_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    if not tensors:
        raise ValueError("tensors must hold at least one tensor to check; got an empty list")
    backend, device = _finite_backend(tensors)
    with _on(device):
        return backend.all_finite(tensors, name=name)


def scale_all_finite(tensors, scale, name=None):
    """``scale * tensors[i]`` for each tensor of ``tensors``, and whether each is finite.

    One pass over each tensor that reads it, tests each element's exponent bits
    and writes the scaled element, split over TensorFlow's intra-op threads for
    large tensors: what Horovod's ``Average`` does to a sum in its fusion buffer
    (``scale`` rounded to the tensor's precision, half and bfloat16 in float32, so
    the result equals Horovod's), with the finiteness check riding along.  The
    engine asks Horovod for a round's plain sum and divides it with this op, so
    the sum of every worker's gradients is checked without a pass of its own.
    Tensors on a GPU run the compiled GPU kernel when the library was built
    with CUDA (see ``docs/install.md``, "GPU build"), else the reference's
    TensorFlow ops, on the device.

    Args:
      tensors: a non-empty list of float16, bfloat16, float32 or float64 tensors.
      scale: a finite Python or float64 scalar.
      name: optional name scope.

    Returns:
      ``(scaled, finite)``: a list of tensors of ``tensors``' shapes and dtypes, and
      a bool vector of ``len(tensors)``, ``finite[i]`` for ``tensors[i]`` (before
      scaling).

    Raises:
      ValueError: an empty list, or a scale that is not finite.
      TypeError: a tensor that is not floating point.
    """
    tensors = [_float_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    if not tensors:
        raise ValueError("tensors must hold at least one tensor to scale; got an empty list")
    if not tf.is_tensor(scale):
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale must be a finite number, got {scale!r}")
        scale = tf.constant(float(scale), tf.float64)
    backend, device = _finite_backend(tensors)
    with _on(device):
        return backend.scale_all_finite(tensors, scale, name=name)
