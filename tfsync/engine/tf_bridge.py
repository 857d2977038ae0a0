"""TensorFlow glue shared by the Keras callback and the strategy.

Both call the engine from *inside* the compiled train step with one
``tf.py_function`` per step.  ``tf.py_function`` hands the Python side the
tensors themselves (eager tensors over the same buffers, on the same device),
not NumPy copies as ``tf.numpy_function`` would, so the payload goes from the
gradient to Horovod's allreduce and back to the optimizer without leaving
TensorFlow.  The frontends hook the Keras optimizer's ``apply`` (the callback)
or its all-reduce (the strategy); what a ``LossScaleOptimizer``, a fixed loss
scale and gradient accumulation need there is here too.
"""

import tensorflow as tf

from tfsync import ops
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


def is_loss_scaled(optimizer) -> bool:
    """Whether ``optimizer`` is Keras' ``LossScaleOptimizer`` (mixed precision): it wraps the
    optimizer that updates the weights, checks every step's gradients for overflow, and skips
    the step (halving its loss scale) when one is not finite."""
    return hasattr(optimizer, "inner_optimizer") and hasattr(optimizer, "check_finite")


def accumulation_steps(optimizer):
    """The ``gradient_accumulation_steps`` of the optimizer that updates the weights (a
    ``LossScaleOptimizer``'s inner one), or None."""
    return getattr(getattr(optimizer, "inner_optimizer", optimizer), "gradient_accumulation_steps", None) or None


def static_loss_scale(optimizer):
    """A Keras optimizer's fixed loss scale (``loss_scale_factor``: the loss is multiplied by it,
    and ``apply`` divides the gradients by it), or None."""
    return getattr(optimizer, "loss_scale_factor", None) or None


def before_optimizer_unscaled(factor, protocol, engine, grads, finite=None):
    """:func:`before_optimizer` on the true gradients of an optimizer with the fixed loss scale
    ``factor``: they are divided by it first, and what the optimizer applies is multiplied by it
    again (``apply`` divides).  A round's mean is linear in the gradients, but the corrections
    (DC-S3GD's, a late gradient's) are not: on scaled gradients they would be ``factor`` times
    too strong."""
    if not (protocol.reduces_gradients or protocol.corrects_gradients):
        return grads
    grads = [None if g is None else tf.convert_to_tensor(g) / tf.cast(factor, g.dtype) for g in grads]
    return [g * tf.cast(factor, g.dtype) for g in before_optimizer(protocol, engine, grads, finite)]


class LossScaling:
    """The frontends' hook on a ``LossScaleOptimizer``'s ``apply`` (:func:`is_loss_scaled`).

    Its gradients arrive scaled by the loss scale, and a step whose gradients
    overflowed is skipped.  What each step protocol needs:

    * gradient protocol: every rank must skip the same steps, or the replicas'
      weights, slots and loss scales part.  This rank's gradients are pushed
      unscaled (a late gradient then adds correctly to a round of another
      scale) with one more float, 1 when they overflowed (sent as zeros, so no
      inf or NaN crosses the wire); the round's mean goes back to the
      optimizer scaled again, or as NaN when any rank's overflowed, and every
      rank's ``LossScaleOptimizer`` skips that step and halves its scale, as one
      optimizer on all the gradients would;
    * DC-S3GD: the correction (``g + λ·g⊙g⊙Δw``) is not linear in ``g``, so it is
      applied to the unscaled gradient; an overflowed one is corrected as zeros
      (it must not reach the correction's state) and handed back as NaN;
    * update protocols: the optimizer's own decision stands (a skipped step
      pushes no update); each worker's loss scale follows its own gradients,
      as its slots do.

    A loss scale that is a power of two (Keras' default, and every doubling or
    halving of it) makes unscaling and scaling again exact.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._flag = None

    def engine_tensors(self, tensors, protocol):
        """What the engine exchanges for ``tensors`` (the trainable variables): the gradient
        protocol adds the overflow flag, a scalar variable (a protocol that corrects late
        gradients reads it as a weight; it never changes)."""
        if not protocol.reduces_gradients:
            return list(tensors)
        if self._flag is None:
            with tf.init_scope():
                self._flag = tf.Variable(0.0, trainable=False, name="tfsync_overflowed")
        return [*tensors, self._flag]

    def _scale(self, dtype):
        return tf.cast(self.optimizer.dynamic_scale, dtype)

    def before_optimizer(self, protocol, engine, grads):
        """What the ``LossScaleOptimizer`` applies this step (see the class docstring)."""
        if not (protocol.reduces_gradients or protocol.corrects_gradients):
            return grads
        if protocol.reduces_gradients:  # (the flag's spec is left out: zip stops at the gradients)
            grads = _dense(grads, _getter(engine)().protocol)
        else:
            grads = [tf.convert_to_tensor(g) for g in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        safe = [tf.where(finite, g / self._scale(g.dtype), tf.zeros_like(g)) for g in grads]
        if protocol.reduces_gradients:
            out = exchange_gradients(engine, [*safe, tf.cast(tf.logical_not(finite), self._flag.dtype)])
            return self.round_for_optimizer(out)
        return self._for_optimizer(correct_gradients(_getter(engine)(), safe), tf.logical_not(finite))

    def round_for_optimizer(self, mean):
        """A gradient protocol's round (the mean gradients and the overflow flag's mean), as the
        ``LossScaleOptimizer`` takes it: scaled, or NaN when a rank's gradients overflowed."""
        return self._for_optimizer(mean[:-1], mean[-1] > 0)

    def _for_optimizer(self, grads, overflowed):
        out = []
        for g in grads:
            poison = tf.where(overflowed, tf.constant(float("nan"), g.dtype), tf.constant(1.0, g.dtype))
            out.append(g * self._scale(g.dtype) * poison)
        return out


def check_accumulation(optimizer, policy, synchronized, who, instead):
    """Refuse, before training, an optimizer that accumulates gradients under a mode whose
    exchange ``synchronized(policy)`` says it cannot follow; ``who`` makes the error's subject,
    ``instead`` its fix."""
    steps = accumulation_steps(optimizer)
    if steps and not synchronized(policy):
        raise ValueError(
            f"{who}(mode={policy.name!r}): the optimizer accumulates gradients "
            f"(gradient_accumulation_steps={steps}): only every {steps}th step updates the weights, "
            f"the others add to the accumulators; {instead}"
        )


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


def correct_gradients(engine, grads, finite=None):
    """Protocols that correct gradients (DC-S3GD): this step's gradients, corrected for
    the weights they will be applied at.

    One ``tf.py_function`` waits for the round the correction needs and returns
    its mean (:meth:`tfsync.engine.corrections.Corrections.round_mean`); the correction itself is built
    into the compiled step (``protocol.correct_in_graph``: the fused
    :func:`tfsync.ops.delay_compensate`), so the engine must be started.  ``finite``
    (:func:`gradients_finite`): gradients that are not finite are handed back uncorrected
    and leave the correction's state alone.
    """
    protocol = engine.protocol
    grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices become dense
    round_mean = engine.find(Corrections).round_mean
    mean = tf.py_function(round_mean, [], Tout=protocol.dtypes, name="tfsync_round_mean")
    for m, s in zip(mean, protocol.shapes):
        m.set_shape(s)
    return protocol.correct_in_graph(grads, mean, finite)


def exchange_updates(engine, variables, applied=None):
    """Update protocol: after the local optimizer step, push its share and move the weights.

    The engine reads and writes the variables in place.  The step's
    ``py_function`` must run after the optimizer's writes: it takes each
    variable's shape, read through the variable's handle, as input, and
    TensorFlow orders every op on a variable's handle in program order.  (It
    does not take the values: a live read would make the engine's in-place
    writes copy the buffer first.)  ``applied``: what :func:`apply_if_finite`
    returned (the optimizer did not run unless every flag is true): a
    contribution whose gradients were not finite is rejected.
    """
    if engine.protocol.periodic:  # Local SGD, DiLoCo: only every H-th step contributes
        return exchange_periodically(engine, variables, applied)
    push_in_graph = getattr(engine.protocol, "push_in_graph", None)
    if push_in_graph is not None:  # DC-S3GD: the update is computed in the step, the engine pushes it
        updates = push_in_graph(applied)
        return tf.py_function(lambda *u: engine.sync_step(u), updates, Tout=[], name="tfsync_step")
    after_update = [tf.raw_ops.VariableShape(input=tf_variable(v).handle) for v in variables]
    if applied is None:
        return tf.py_function(lambda *_: engine.sync_step([]), after_update, Tout=[], name="tfsync_step")
    return tf.py_function(lambda a, *_: engine.sync_step([a]), [applied, *after_update], Tout=[], name="tfsync_step")


def exchange_periodically(engine, variables, applied=None):
    """The outer-step protocol (:mod:`tfsync.engine.outer`): after the local optimizer step,
    count it; the ``H``-th step of a period is an outer step (the engine's ``sync_step``: the
    pseudo-gradient's round, bounded, counted, applied), the others are the worker's own
    (:meth:`SyncEngine.local_step`).  DiLoCo overlapped: the push comes ``overlap_steps``
    before the period's end, whose step waits for the round and applies it.  One
    ``tf.py_function`` per step, ordered after the optimizer's writes as
    :func:`exchange_updates`'s is; ``applied``: from :func:`apply_if_finite` (a contribution
    with a step whose gradients were not finite is rejected at its push)."""
    # (the protocol's variables: the weights and the statistics that ride in the outer round, which
    # a BatchNormalization layer writes in the step's forward pass)
    variables = engine.protocol.variables
    after_update = [tf.raw_ops.VariableShape(input=v.handle) for v in variables]
    flags = tf.reshape(applied, [-1]) if applied is not None else tf.constant([True])

    def step(finite, *_):
        protocol = engine.protocol
        action = protocol.end_inner_step(bool(finite.numpy().all()))
        if action == protocol.PUSH:
            engine.sync_step([])
        elif action == protocol.LAND:  # (DiLoCo overlapped: the round pushed overlap_steps ago)
            engine.local_step(required_round=engine.step - 1)
        else:
            engine.local_step()

    return tf.py_function(step, [flags, *after_update], Tout=[], name="tfsync_step")


def guards_optimizer(protocol) -> bool:
    """Whether the optimizer runs on this worker's own gradients before the exchange (the
    update protocols, DC-S3GD), so a gradient that is not finite must be kept from it
    (:func:`apply_if_finite`).  Under the gradient protocol it only ever applies a round's
    mean, from which a non-finite contribution was rejected."""
    return not protocol.reduces_gradients


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


def apply_if_finite(finite, apply):
    """Run ``apply()`` (the optimizer's step) only when every flag of ``finite``
    (:func:`gradients_finite`) is true; returns ``finite``, once the step ran or was skipped.

    A NaN or an infinity that reaches the optimizer stays in its slots
    (momentum, Adam's moments) and makes every later update of this worker
    NaN, each rejected in turn: the worker would train nothing for the rest of
    the job.  The step is skipped instead, as Keras' ``LossScaleOptimizer``
    skips one whose gradients overflowed (weights, slots and ``iterations``
    untouched), and the engine rejects its contribution (``exchange_updates``'s
    ``applied``), so it is counted.
    """

    def run():
        apply()  # stateful: the taken branch runs it
        return tf.constant(True)

    ran = tf.cond(tf.reduce_all(finite), run, lambda: tf.constant(False))
    with tf.control_dependencies([ran]):
        return tf.identity(finite)


def before_optimizer(protocol, engine, grads, finite=None):
    """What the optimizer applies this step, by the step protocol (class) ``protocol``: the
    round's mean (gradient protocol), the gradients corrected for the weights they will be
    applied at (DC-S3GD), or this worker's own (update protocols).

    One half of the frontends' hook on the optimizer's path, :func:`after_optimizer` the
    other; ``engine`` may be a callable returning the engine (gradient protocol only);
    ``finite``: :func:`gradients_finite` of ``grads``, where the frontend guards the
    optimizer (DC-S3GD's correction then leaves its state alone for gradients that are not).
    """
    if protocol.reduces_gradients:
        return exchange_gradients(engine, grads)
    if protocol.corrects_gradients:
        return correct_gradients(_getter(engine)(), grads, finite)
    return grads


def after_optimizer(protocol, engine, variables, applied=None):
    """After the optimizer applied this step: the update protocols push its share and move the
    weights (:func:`exchange_updates`; ``applied``: from :func:`apply_if_finite`), the
    outer-step protocol counts the step and pushes at every ``H``-th
    (:func:`exchange_periodically`); the gradient protocol has nothing left to do (None)."""
    if protocol.reduces_gradients:
        return None
    return exchange_updates(_getter(engine)(), variables, applied)


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
