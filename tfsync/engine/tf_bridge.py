"""TensorFlow glue shared by the Keras callback and the strategy.

Both call the engine from *inside* the compiled train step with one
``tf.numpy_function`` per step on one flat float32 buffer (all trainable
weights fused, as Horovod's tensor fusion does), so the exchange costs one
collective per step whatever the number of layers.
"""
import numpy as np
import tensorflow as tf


class FlatVariables:
    """A fixed list of variables viewed as one flat float32 vector."""

    def __init__(self, variables):
        self.variables = list(variables)
        if not self.variables:
            raise ValueError("tfsync: the model has no trainable weights to synchronize")
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dtypes = [tf.as_dtype(v.dtype) for v in self.variables]
        self.size = sum(self.sizes)

    def flatten(self, tensors):
        parts = []
        for t, shape, dtype in zip(tensors, self.shapes, self.dtypes):
            if t is None:
                t = tf.zeros(shape, tf.float32)
            t = tf.convert_to_tensor(t)  # IndexedSlices become dense
            parts.append(tf.reshape(tf.cast(t, tf.float32), [-1]))
        return tf.concat(parts, axis=0)

    def unflatten(self, flat):
        pieces = tf.split(flat, self.sizes)
        return [tf.cast(tf.reshape(p, s), d) for p, s, d in zip(pieces, self.shapes, self.dtypes)]

    def read(self):
        return self.flatten([_value(v) for v in self.variables])

    def assign(self, flat):
        return tf.group(*[v.assign(p) for v, p in zip(self.variables, self.unflatten(flat))])

    def read_numpy(self):
        return np.concatenate([np.asarray(_value(v), np.float32).reshape(-1) for v in self.variables])

    def assign_numpy(self, flat):
        offset = 0
        for v, n, s in zip(self.variables, self.sizes, self.shapes):
            v.assign(np.asarray(flat[offset:offset + n]).reshape(s))
            offset += n


def _value(v):
    return v.value if hasattr(v, "value") and not isinstance(v, tf.Tensor) else tf.convert_to_tensor(v)


def exchange_gradients(engine, flat_vars, grads):
    """``payload="gradients"``: the gradients every worker applies this step."""
    flat = flat_vars.flatten(grads)
    mean = tf.numpy_function(engine.step_gradients, [flat], tf.float32, stateful=True,
                             name="tfsync_step_gradients")
    mean.set_shape(flat.shape)
    return flat_vars.unflatten(mean)


def apply_and_exchange_updates(engine, flat_vars, apply_fn, size):
    """``payload="updates"``: apply locally, push the share Δ/N, load the next step's weights."""
    before = flat_vars.read()
    with tf.control_dependencies([before]):
        applied = apply_fn()
    deps = [d for d in tf.nest.flatten(applied) if d is not None and not isinstance(d, (int, float))]
    with tf.control_dependencies([tf.identity(before)] + [tf.identity(_value(d)) if hasattr(d, "value") else d for d in deps]):
        after = flat_vars.read()
    share = (after - before) / tf.constant(size, tf.float32)
    local = tf.numpy_function(engine.step_updates, [share], tf.float32, stateful=True,
                              name="tfsync_step_updates")
    local.set_shape(share.shape)
    return flat_vars.assign(local)
