"""TensorFlow glue shared by the Keras callback and the strategy.

Both call the engine from *inside* the compiled train step with one
``tf.py_function`` per step.  ``tf.py_function`` hands the Python side the
tensors themselves (eager tensors over the same buffers, on the same device),
not NumPy copies as ``tf.numpy_function`` would, so the payload goes from the
gradient to Horovod's allreduce and back to the optimizer without leaving
TensorFlow.
"""
import tensorflow as tf

from tfsync.engine.protocols import tf_variable


def exchange_gradients(engine, grads):
    """Gradient protocol: the gradients every worker applies this step (the round's mean)."""
    protocol = engine.protocol
    grads = [tf.zeros(s, d) if g is None else tf.convert_to_tensor(g)  # IndexedSlices become dense
             for g, s, d in zip(grads, protocol.shapes, protocol.dtypes)]
    out = tf.py_function(lambda *g: engine.sync_step(g), grads, Tout=protocol.dtypes, name="tfsync_step")
    for o, s in zip(out, protocol.shapes):
        o.set_shape(s)
    return out


def exchange_updates(engine, variables):
    """Update protocol: after the local optimizer step, push its share and move the weights.

    The engine reads and writes the variables in place.  The step's
    ``py_function`` must run after the optimizer's writes: it takes each
    variable's shape, read through the variable's handle, as input, and
    TensorFlow orders every op on a variable's handle in program order.  (It
    does not take the values: a live read would make the engine's in-place
    writes copy the buffer first.)
    """
    after_update = [tf.raw_ops.VariableShape(input=tf_variable(v).handle) for v in variables]
    return tf.py_function(lambda *_: engine.sync_step([]), after_update, Tout=[], name="tfsync_step")


def finish_in_graph(engine):
    """Drain every round in flight from inside a compiled step; returns a tensor to depend on."""

    def finish():
        engine.finish()
        return tf.constant(0.0)

    return tf.py_function(finish, [], Tout=tf.float32, name="tfsync_finish")
