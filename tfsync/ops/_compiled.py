"""The compiled implementation of :mod:`tfsync.ops`: thin calls of the raw ops.

Same functions and signatures as :mod:`tfsync.ops._reference`; arguments arrive
already converted and checked by :mod:`tfsync.ops`. The kernels are in
``ops/cc/kernels`` (DC-ASGD delay compensation, the "updates" protocol's state
updates, the finiteness check).
"""

from tfsync.ops._loader import load_library


def delay_compensate(gradient, w_now, w_stale, lambda_, name=None):
    return load_library().tf_sync_delay_compensate(
        gradient=gradient, w_now=w_now, w_stale=w_stale, lambda_=lambda_, name=name
    )


def delay_compensate_adaptive(gradient, w_now, w_stale, mean_square, lambda0, momentum, epsilon, name=None):
    return load_library().tf_sync_delay_compensate_adaptive(
        mean_square=mean_square.handle,
        gradient=gradient,
        w_now=w_now,
        w_stale=w_stale,
        lambda0=lambda0,
        momentum=momentum,
        epsilon=epsilon,
        name=name,
    )


def update_push_share(variable, w_bar, pending, size, name=None):
    share, finite = load_library().tf_sync_update_push_share(
        variable=variable.handle, w_bar=w_bar.handle, pending=pending.handle, size=size, T=variable.dtype, name=name
    )
    return share, finite


def update_apply_round(variable, w_bar, pending, total, own_share, name=None):
    return load_library().tf_sync_update_apply_round(
        variable=variable.handle,
        w_bar=w_bar.handle,
        pending=pending.handle,
        total=total,
        own_share=own_share,
        name=name,
    )


def all_finite(tensors, name=None):
    return load_library().tf_sync_all_finite(tensors=tensors, name=name)


def scale_all_finite(tensors, scale, name=None):
    scaled, finite = load_library().tf_sync_scale_all_finite(tensors=tensors, scale=scale, name=name)
    return list(scaled), finite


def quantize_blocks(x, bits, block_size, residual=False, name=None):
    packed, rest = load_library().tf_sync_quantize_blocks(
        x=x, bits=bits, block_size=block_size, with_residual=residual, name=name
    )
    return (packed, rest) if residual else packed


def dequantize_blocks(packed, bits, block_size, length, name=None):
    return load_library().tf_sync_dequantize_blocks(
        packed=packed, bits=bits, block_size=block_size, length=length, name=name
    )


def dequantize_sum(packed, bits, block_size, length, scale, name=None):
    return load_library().tf_sync_dequantize_sum(
        packed=packed, scale=scale, bits=bits, block_size=block_size, length=length, name=name
    )
