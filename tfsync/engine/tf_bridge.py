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


def _getter(engine):
    """``engine`` or a callable returning the engine (looked up at every step: auto mode
    swaps the engine under a compiled step) as a callable."""
    return engine if callable(engine) else (lambda: engine)


def exchange_gradients(engine, grads):
    """Gradient protocol: the gradients every worker applies this step (the round's mean).

    ``engine`` may be a callable returning the engine: the step then serves
    whichever gradient-protocol engine is current when it runs (the shapes and
    dtypes, fixed at tracing, are the model's).
    """
    get_engine = _getter(engine)
    protocol = get_engine().protocol
    grads = [
        tf.zeros(s, d) if g is None else tf.convert_to_tensor(g)  # IndexedSlices become dense
        for g, s, d in zip(grads, protocol.shapes, protocol.dtypes)
    ]
    out = tf.py_function(lambda *g: get_engine().sync_step(g), grads, Tout=protocol.dtypes, name="tfsync_step")
    for o, s in zip(out, protocol.shapes):
        o.set_shape(s)
    return out


def correct_gradients(engine, grads):
    """Protocols that correct gradients (DC-S3GD): this step's gradients, corrected for
    the weights they will be applied at.

    One ``tf.py_function`` waits for the round the correction needs and returns
    its mean (:meth:`SyncEngine.round_mean`); the correction itself is built
    into the compiled step (``protocol.correct_in_graph``: the fused
    :func:`tfsync.ops.delay_compensate`), so the engine must be started.
    """
    protocol = engine.protocol
    grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices become dense
    mean = tf.py_function(engine.round_mean, [], Tout=protocol.dtypes, name="tfsync_round_mean")
    for m, s in zip(mean, protocol.shapes):
        m.set_shape(s)
    return protocol.correct_in_graph(grads, mean)


def exchange_updates(engine, variables):
    """Update protocol: after the local optimizer step, push its share and move the weights.

    The engine reads and writes the variables in place.  The step's
    ``py_function`` must run after the optimizer's writes: it takes each
    variable's shape, read through the variable's handle, as input, and
    TensorFlow orders every op on a variable's handle in program order.  (It
    does not take the values: a live read would make the engine's in-place
    writes copy the buffer first.)
    """
    push_in_graph = getattr(engine.protocol, "push_in_graph", None)
    if push_in_graph is not None:  # DC-S3GD: the update is computed in the step, the engine pushes it
        updates = push_in_graph()
        return tf.py_function(lambda *u: engine.sync_step(u), updates, Tout=[], name="tfsync_step")
    after_update = [tf.raw_ops.VariableShape(input=tf_variable(v).handle) for v in variables]
    return tf.py_function(lambda *_: engine.sync_step([]), after_update, Tout=[], name="tfsync_step")


def finish_in_graph(engine):
    """Drain every round in flight from inside a compiled step; returns a tensor to depend on."""

    def finish():
        engine.finish()
        return tf.constant(0.0)

    return tf.py_function(finish, [], Tout=tf.float32, name="tfsync_finish")


def skippable_train_step(engine, model, train_step, apply_mean):
    """Wrap a Keras ``train_step`` so a worker whose round closed without it skips the step.

    At run time the step first asks :meth:`SyncEngine.begin_step`; when it says
    the step's round has closed already, the forward and backward passes are
    not run: the round's mean (:meth:`SyncEngine.skip_step`) goes through
    ``apply_mean`` (the optimizer, without another exchange), so weights and
    optimizer state stay identical to every other replica's, and the metrics
    are returned unchanged (a skipped step adds nothing to them).  ``engine``
    may be a callable returning the engine, for frontends that start it while
    the first step is traced.  ``apply_mean=None``: the update protocol
    (ElasticBSP), whose skipped step contributes zeros and moves the weights
    in place (the engine applies the rounds), so nothing is applied here.
    """
    get_engine = _getter(engine)

    def step(data):
        compute = tf.py_function(lambda: get_engine().begin_step(), [], Tout=tf.bool, name="tfsync_begin_step")
        compute.set_shape([])

        def skip():
            if apply_mean is None:
                done = tf.py_function(
                    lambda: (get_engine().skip_step(), tf.constant(True))[1],
                    [],
                    Tout=tf.bool,
                    name="tfsync_skip_step",
                )
                with tf.control_dependencies([done]):
                    return tf.nest.map_structure(tf.identity, model.get_metrics_result())
            protocol = get_engine().protocol
            mean = tf.py_function(lambda: get_engine().skip_step(), [], Tout=protocol.dtypes, name="tfsync_skip_step")
            for o, s in zip(mean, protocol.shapes):
                o.set_shape(s)
            apply_mean(mean)  # stateful: a tf.function runs it (automatic control dependencies)
            return model.get_metrics_result()

        return tf.cond(compute, lambda: train_step(data), skip)

    return step
