"""TensorFlow glue shared by the Keras callback and the strategy.

Both call the engine from *inside* the compiled train step with one
``tf.numpy_function`` per step on one flat float32 buffer (all trainable
weights fused, as Horovod's tensor fusion does), so the exchange costs one
collective per step whatever the number of layers.
"""
import numpy as np
import tensorflow as tf


class FlatLayout:
    """Shapes and dtypes of a fixed list of tensors, packed into one flat float32 vector."""

    def __init__(self, tensors):
        tensors = list(tensors)
        if not tensors:
            raise ValueError("tfsync: the model has no trainable weights to synchronize")
        self.shapes = [tuple(t.shape) for t in tensors]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dtypes = [tf.as_dtype(t.dtype) for t in tensors]
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


class FlatVariables(FlatLayout):
    """A fixed list of variables viewed as one flat float32 vector."""

    def __init__(self, variables):
        self.variables = list(variables)
        super().__init__(self.variables)

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
    # Keras 3 variables and tf.Variables both convert to their current value.
    return tf.convert_to_tensor(v)


def exchange_gradients(engine, layout, grads):
    """``payload="gradients"``: the gradients every worker applies this step."""
    flat = layout.flatten(grads)
    mean = tf.numpy_function(engine.step_gradients, [flat], tf.float32, stateful=True,
                             name="tfsync_step_gradients")
    mean.set_shape(flat.shape)
    return layout.unflatten(mean)


def apply_and_exchange_updates(engine, flat_vars, apply_fn, size):
    """``payload="updates"``: apply locally, push the share Δ/N, load the next step's weights."""
    # tf.function orders reads and writes of one variable in program order, so
    # `before` is read before the optimizer writes and `after` once it has.
    before = flat_vars.read()
    apply_fn()
    after = flat_vars.read()
    return push_updates(engine, flat_vars, before, after, size)


def push_updates(engine, flat_vars, before, after, size):
    """Push the share ``(after - before) / size`` and assign the weights the engine returns."""
    share = (after - before) / tf.constant(size, tf.float32)
    local = tf.numpy_function(engine.step_updates, [share], tf.float32, stateful=True,
                              name="tfsync_step_updates")
    local.set_shape(share.shape)
    return flat_vars.assign(local)
