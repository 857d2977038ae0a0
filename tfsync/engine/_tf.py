"""TensorFlow helpers the engine's layers share: variables, dense gradients, compiled state updates.

A leaf: it imports nothing of tfsync but the ops, so each protocol module, the optimizer
paths, the wire (a compressed round's range check) and the cluster build on it without
importing each other.
"""

import tensorflow as tf

from tfsync import ops


def tf_variable(v):
    """The ``tf.Variable`` behind a Keras 3 variable (or ``v`` itself)."""
    if isinstance(v, tf.Variable):
        return v
    inner = getattr(v, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(f"tfsync: expected a TensorFlow or Keras variable, got {type(v).__name__}")


def state_variable(initial):
    """A protocol's own state beside the weights: not trained, not synchronized by a strategy."""
    return tf.Variable(initial, trainable=False, synchronization=tf.VariableSynchronization.NONE)


def floating_statistics(model):
    """The model's non-trainable floating-point variables (integer state such as seeds is left
    alone): ``BatchNormalization``'s moving statistics, which Local SGD and DiLoCo average with
    the weights at every outer step, and ``average_statistics`` at the end of training."""
    return [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]


def copy_values(sources, targets):
    """``targets[i] = sources[i]`` for every pair (inside a compiled function)."""
    for s, t in zip(sources, targets):
        t.assign(s)


def dense(tensors, shapes, dtypes):
    """Gradients as dense tensors of the variables' shapes: zeros for a weight without one,
    ``IndexedSlices`` densified."""
    return [tf.zeros(s, d) if t is None else tf.convert_to_tensor(t) for t, s, d in zip(tensors, shapes, dtypes)]


def gradients_finite(grads):
    """Whether each gradient in ``grads`` is finite, a bool vector (one read-only pass,
    :func:`tfsync.ops.all_finite`; a missing gradient is not read and counts as finite)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    flags = [tf.constant(True)] * len(grads)
    if present:
        tensors = [grads[i].values if isinstance(grads[i], tf.IndexedSlices) else grads[i] for i in present]
        checked = ops.all_finite(tensors)
        for k, i in enumerate(present):
            flags[i] = checked[k]
    return tf.stack(flags)


def compile_flat(fn, specs=(), jit_compile=False):
    """``fn`` (TensorFlow ops over variables it captures and ``len(specs)`` tensor
    arguments) traced once, as a callable taking those tensors positionally.

    A ``tf.function`` call binds its arguments to the traced signature in Python
    every time, and that is most of what a small model's per-step state update
    costs; the concrete function's flat entry point, which TensorFlow itself
    calls once the arguments are bound, skips the binding.  That entry point is
    private (``_call_flat``): where a TensorFlow lacks it, the concrete function
    is called as it is.
    """
    with tf.init_scope():  # (an engine may start while a frontend traces its first step)
        concrete = tf.function(fn, autograph=False, jit_compile=jit_compile).get_concrete_function(*specs)
    call_flat = getattr(concrete, "_call_flat", None)
    if call_flat is None:
        return concrete
    captured = concrete.captured_inputs
    return lambda *tensors: call_flat(list(tensors), captured)


# autograph=False: straight-line code; conversion would only trip over the op loader
@tf.function(autograph=False)
def run_compiled(fn, *args):
    """``fn(*args)`` (TensorFlow ops building a step protocol's in-graph hook) run as one
    function: the hook's eager twin for the engine's own API."""
    return fn(*args)


def py_step(fn, inputs, dtypes, shapes, name):
    """One ``tf.py_function`` calling the engine from inside a compiled step: ``fn(*inputs)``,
    its results given ``dtypes`` and, where known, ``shapes``.  ``tf.py_function`` hands the
    Python side the tensors themselves (eager tensors over the same buffers, on the same
    device), not NumPy copies as ``tf.numpy_function`` would, so the payload goes from the
    gradient to Horovod's allreduce and back without leaving TensorFlow."""
    out = tf.py_function(fn, list(inputs), Tout=list(dtypes), name=name)
    for o, s in zip(out, shapes):
        o.set_shape(s)
    return out
