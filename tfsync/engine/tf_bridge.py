"""TensorFlow glue shared by the Keras callback and the strategy.

Both call the engine from *inside* the compiled train step with one
``tf.py_function`` per step.  ``tf.py_function`` hands the Python side the
tensors themselves (eager tensors over the same buffers, on the same device),
not NumPy copies as ``tf.numpy_function`` would, so the payload goes from the
gradient to Horovod's allreduce and back to the optimizer without leaving
TensorFlow.
"""

import tensorflow as tf

from tfsync.engine.corrections import Corrections
from tfsync.engine.protocols import compile_flat, tf_variable


def _getter(engine):
    """``engine`` or a callable returning the engine (looked up at every step: auto mode
    swaps the engine under a compiled step) as a callable."""
    return engine if callable(engine) else (lambda: engine)


def _dense(grads, protocol):
    """The step's gradients as dense tensors: zeros for a weight without one, IndexedSlices densified."""
    return [
        tf.zeros(s, d) if g is None else tf.convert_to_tensor(g)
        for g, s, d in zip(grads, protocol.shapes, protocol.dtypes)
    ]


def exchange_gradients(engine, grads):
    """Gradient protocol: the gradients every worker applies this step (the round's mean).

    ``engine`` may be a callable returning the engine: the step then serves
    whichever gradient-protocol engine is current when it runs (the shapes and
    dtypes, fixed at tracing, are the model's).
    """
    get_engine = _getter(engine)
    protocol = get_engine().protocol
    grads = _dense(grads, protocol)
    out = tf.py_function(lambda *g: get_engine().sync_step(g), grads, Tout=protocol.dtypes, name="tfsync_step")
    for o, s in zip(out, protocol.shapes):
        o.set_shape(s)
    return out


def exchange_gradients_blockwise(engine, grads, apply):
    """Gradient protocol with PSP's partial pulling: push this step's gradients.

    The engine applies what arrived of the rounds' means block by block
    through the frontend's applier (in place).  When the step's own round
    arrived whole, it hands that mean back instead, and ``apply(mean)`` (the
    optimizer, in the compiled step) applies it, as without partial pulling:
    the common case then costs no extra call.  Returns a boolean tensor:
    whether ``apply`` ran.
    """
    get_engine = _getter(engine)
    protocol = get_engine().protocol
    grads = _dense(grads, protocol)
    out = tf.py_function(
        lambda *g: get_engine().sync_step(g), grads, Tout=[*protocol.dtypes, tf.bool], name="tfsync_step"
    )
    mean, whole = out[:-1], out[-1]
    for m, s in zip(mean, protocol.shapes):
        m.set_shape(s)
    whole.set_shape([])

    def applied():
        apply(mean)  # stateful: the taken branch runs it
        return tf.constant(True)

    return tf.cond(whole, applied, lambda: tf.constant(False))


class OptimizerBlocks:
    """Partial pulling's applier (:attr:`tfsync.engine.pull.BlockPull.applier`): one block of a
    round's mean through the optimizer, with ``optimizer.iterations`` at that round's count.

    Keras 3 optimizers update each weight from its gradient, its own slots and
    the learning rate at ``iterations`` (``update_step``), and count one
    iteration per ``apply``.  Applying round ``r``'s block with ``iterations``
    set to ``base + r`` therefore does exactly what round ``r``'s whole apply
    does to that block's weights and slots, whenever the block lands; after a
    step, ``iterations`` is left at ``base + rounds`` applied.  Optimizers
    that couple the weights (``global_clipnorm``, EMA, gradient accumulation,
    loss scaling) are refused (:func:`check_blockwise_optimizer`).

    ``apply_gradients``: the optimizer's own (unwrapped) ``apply_gradients``.
    """

    def __init__(self, optimizer, apply_gradients, variables, groups):
        if not optimizer.built:
            optimizer.build(variables)
        self._iterations = optimizer.iterations
        self._base = int(self._iterations.numpy())
        self._dtype = tf.as_dtype(self._iterations.dtype)
        self._fns = [self._compile(apply_gradients, [variables[i] for i in group]) for group in groups]
        self._all = self._compile(apply_gradients, list(variables))  # a round whose blocks came together

    def _compile(self, apply_gradients, variables):
        iterations = self._iterations

        def apply_block(iteration, *grads):
            iterations.assign(iteration)
            apply_gradients(zip(grads, variables))

        specs = [tf.TensorSpec([], self._dtype)] + [tf.TensorSpec(v.shape, v.dtype) for v in variables]
        return compile_flat(apply_block, specs)

    def apply(self, block, round_, tensors):
        self._fns[block](tf.constant(self._base + round_, self._dtype), *tensors)

    def apply_all(self, round_, tensors):
        self._all(tf.constant(self._base + round_, self._dtype), *tensors)

    def settle(self, rounds):
        self._iterations.assign(self._base + rounds)


def check_blockwise_optimizer(optimizer, policy):
    """Refuse, before training, an optimizer whose update of one weight reads the others."""
    problems = []
    if hasattr(optimizer, "inner_optimizer"):
        problems.append(f"{type(optimizer).__name__} (loss scaling checks every gradient at once)")
    if getattr(optimizer, "global_clipnorm", None):
        problems.append(f"global_clipnorm={optimizer.global_clipnorm} (use clipnorm, per weight)")
    if getattr(optimizer, "use_ema", False):
        problems.append("use_ema=True")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        problems.append(f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}")
    if problems:
        raise ValueError(
            f"tfsync: {type(policy).__name__}(pull_fraction={policy.pull_fraction}) applies a round's "
            f"mean block by block through the optimizer, which needs an optimizer that updates each "
            f"weight on its own; this one has {'; '.join(problems)}. Change that setting, or use "
            f"pull_fraction=1.0"
        )


def correct_gradients(engine, grads):
    """Protocols that correct gradients (DC-S3GD): this step's gradients, corrected for
    the weights they will be applied at.

    One ``tf.py_function`` waits for the round the correction needs and returns
    its mean (:meth:`tfsync.engine.corrections.Corrections.round_mean`); the correction itself is built
    into the compiled step (``protocol.correct_in_graph``: the fused
    :func:`tfsync.ops.delay_compensate`), so the engine must be started.
    """
    protocol = engine.protocol
    grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices become dense
    round_mean = engine.find(Corrections).round_mean
    mean = tf.py_function(round_mean, [], Tout=protocol.dtypes, name="tfsync_round_mean")
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


def before_optimizer(protocol, engine, grads):
    """What the optimizer applies this step, by the step protocol (class) ``protocol``: the
    round's mean (gradient protocol), the gradients corrected for the weights they will be
    applied at (DC-S3GD), or this worker's own (update protocols).

    One half of the frontends' hook on the optimizer's path, :func:`after_optimizer` the
    other; ``engine`` may be a callable returning the engine (gradient protocol only).
    """
    if protocol.reduces_gradients:
        return exchange_gradients(engine, grads)
    if protocol.corrects_gradients:
        return correct_gradients(_getter(engine)(), grads)
    return grads


def after_optimizer(protocol, engine, variables):
    """After the optimizer applied this step: the update protocols push its share and move the
    weights (:func:`exchange_updates`); the gradient protocol has nothing left to do (None)."""
    if protocol.reduces_gradients:
        return None
    return exchange_updates(_getter(engine)(), variables)


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
