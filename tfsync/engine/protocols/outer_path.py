"""Local SGD's and DiLoCo's optimizer path (:class:`PeriodicAfter`): the worker's own optimizer
runs every step, and every ``H``-th step (an outer step) pushes its pseudo-gradient
(:mod:`tfsync.engine.protocols.outer` is the protocol).
"""

import tensorflow as tf

from tfsync.engine._tf import floating_statistics, gradients_finite, state_variable
from tfsync.engine.protocols.path import OptimizerPath, accumulation_steps, finish_in_graph, is_loss_scaled


class QuietSteps:
    """The inner steps that pass in the compiled step without a call, and what the engine must
    learn of them (one per path, as the compiled step it is traced into).

    Most inner steps of a period only count: the worker's optimizer ran, nothing is pushed or
    landed.  The protocol says after each call how many of the next steps are such steps
    (:meth:`OuterStepProtocol.quiet_steps_ahead
    <tfsync.engine.protocols.outer.OuterStepProtocol.quiet_steps_ahead>`), the compiled step counts
    them down in :attr:`left` and keeps how many passed and whether their gradients were all
    finite; the next call (the step that pushes or lands) hands both to the protocol first, as
    does :meth:`fold` when the engine's state is read between steps (its counts, the finish).
    A rank whose steps sleep a simulated delay (stragglers) calls the engine every step.
    """

    def __init__(self):
        with tf.init_scope():
            self.left = state_variable(tf.constant(0, tf.int64))
            self.passed = state_variable(tf.constant(0, tf.int64))
            self.finite = state_variable(tf.constant(True))
        self.engine = None

    def attach(self, engine):
        """Serve ``engine`` (started): nothing passes quietly before its first call."""
        self.engine = engine
        engine.graph = self
        with tf.init_scope():
            self.left.assign(0)
            self.passed.assign(0)
            self.finite.assign(True)

    def fold(self, engine):
        """Hand the quiet steps since the last call to ``engine``'s protocol (between steps, or
        from the call itself: :meth:`SyncEngine.catch_up <tfsync.engine.SyncEngine.catch_up>`)."""
        if engine is not self.engine:
            return
        passed, finite = int(self.passed.numpy()), bool(self.finite.numpy())
        if passed or not finite:
            self.passed.assign(0)
            self.finite.assign(True)
            engine.protocol.quiet_steps(passed, finite)

    def leave(self, engine):
        if engine is self.engine:
            self.fold(engine)
            self.engine = None

    def last(self, engine):
        return engine._last

    def step(self, engine, variables, applied=None, updated=None):
        """After the local optimizer step (traced): count it quietly, or call the engine
        (:func:`exchange_periodically`)."""
        after_update = [tf.raw_ops.VariableShape(input=v.handle) for v in variables]
        finite = tf.reduce_all(tf.reshape(applied, [-1])) if applied is not None else tf.constant(True)
        updated = tf.constant(True) if updated is None else updated

        def call():
            return tf.group(self.left.assign(exchange_periodically(engine, [finite, updated, *after_update])))

        def quiet():
            n = tf.cast(updated, tf.int64)
            all_finite = tf.logical_and(self.finite, finite)
            return tf.group(self.left.assign_sub(n), self.passed.assign_add(n), self.finite.assign(all_finite))

        # (a step that only accumulated gradients is quiet: the protocol would only note its flag)
        return tf.cond(tf.logical_or(self.left > 0, tf.logical_not(updated)), quiet, call)


def exchange_periodically(engine, inputs):
    """The call of a step that is not quiet (:class:`QuietSteps`): the quiet steps before it
    handed to the protocol, then this step counted; the ``H``-th step of a period is an outer
    step (the engine's ``sync_step``: the pseudo-gradient's round, bounded, counted, applied),
    the others are the worker's own (:meth:`SyncEngine.local_step`).  DiLoCo overlapped: the
    push comes ``overlap_steps`` before the period's end, whose step waits for the round and
    applies it.  ``inputs``: this step's finite flag and whether the optimizer updated the
    weights (an accumulating optimizer's other batches count as no step of the period; a
    contribution with a step whose gradients were not finite is rejected at its push), and each
    variable's shape through its handle (so the call is ordered after the optimizer's writes).
    Returns how many of the next steps are quiet.  ``engine``: a callable returning the engine."""

    def step(finite, update, *_):
        running = engine()
        protocol = running.protocol
        running.catch_up()  # (the quiet steps first)
        action = protocol.end_inner_step(bool(finite.numpy()), bool(update.numpy()))
        if action == protocol.PUSH:
            running.sync_step([])
        elif action == protocol.LAND:  # (DiLoCo overlapped: the round pushed overlap_steps ago)
            running.local_step(required_round=running.step - 1)
        else:
            running.local_step()
        return protocol.quiet_steps_ahead() if running.delays.idle else 0

    left = tf.py_function(step, inputs, Tout=tf.int64, name="tfsync_step")
    left.set_shape([])
    return left


def zeros_unless(keep, grad):
    """``grad`` where ``keep`` is true, else zeros of its shape (a sparse gradient's values)."""
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(zeros_unless(keep, grad.values), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    return tf.where(keep, grad, tf.zeros_like(grad))


def updates_counter(optimizer):
    """The variable that counts ``optimizer``'s updates of the weights when it accumulates
    gradients (``gradient_accumulation_steps``; a ``LossScaleOptimizer``'s inner one), else None.
    Keras' ``iterations`` is then the update count, ``_iterations // steps``: it moves at the
    batch that updates and not at the others, nor at a batch the optimizer skipped."""
    if optimizer is None or not accumulation_steps(optimizer):
        return None
    return getattr(optimizer, "inner_optimizer", optimizer)


class PeriodicAfter(OptimizerPath):
    """The worker's own optimizer runs every step (on finite gradients only), then the step is
    counted and every ``H``-th pushes its pseudo-gradient.  The model's non-trainable
    floating-point statistics ride in the outer round with the weights.  Under a
    ``LossScaleOptimizer`` its own decision stands (it skips an overflowed step itself).

    An optimizer with ``gradient_accumulation_steps=k`` (under ``SyncCallback``) updates the
    weights at every ``k``-th batch and only adds to its accumulators at the others, all on
    the worker: the period counts updates, so an outer step comes after ``H`` updates
    (``H·k`` batches), when the accumulators are empty, and its pseudo-gradient is the change
    of ``H`` whole updates.  A batch whose gradients are not finite is not skipped then (a
    skipped batch would move that worker's updates, and so its outer steps, off the others'):
    the optimizer gets zeros for it, and the period's contribution is rejected."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # an accumulating optimizer's trace: (its update count before the step, the batch's flags)
        self._accumulating = None
        self._quiet = None  # the inner steps counted in the compiled step (QuietSteps), once bound

    def bind(self, engine):
        if self._quiet is None:  # (its variables made before the step is traced: a trace that makes
            self._quiet = QuietSteps()  # variables is traced twice)
        self._quiet.attach(engine)

    def check_optimizer(self, optimizer, who):
        if self.station != "apply":
            super().check_optimizer(optimizer, who)
        elif accumulation_steps(optimizer) and is_loss_scaled(optimizer):
            raise ValueError(
                f"{who}(mode={self.policy.name!r}): a LossScaleOptimizer over an optimizer with "
                f"gradient_accumulation_steps={accumulation_steps(optimizer)} skips a batch whose "
                f"gradients overflowed on its worker alone, which moves that worker's updates, and so "
                f"its outer steps, off the others'. Use a fixed loss_scale_factor on the optimizer "
                f"instead of a LossScaleOptimizer, or leave gradient_accumulation_steps unset"
            )

    def before(self, grads):
        counter = updates_counter(self.optimizer)
        if counter is None:
            self._accumulating = None
            return list(grads)
        finite = gradients_finite(grads)
        every = tf.reduce_all(finite)
        # (the count is read before the optimizer's writes: automatic control dependencies keep
        # the program's order)
        self._accumulating = (tf.identity(counter.iterations), finite)
        return [zeros_unless(every, g) for g in grads]

    def guard(self, to_apply):
        if is_loss_scaled(self.optimizer) or self._accumulating is not None:
            return None
        return gradients_finite(to_apply)

    def after(self, variables, applied):
        updated = None
        if self._accumulating is not None:
            count, applied = self._accumulating
            updated = tf.not_equal(updates_counter(self.optimizer).iterations, count)
            self._accumulating = None
        if self._quiet is None:
            self._quiet = QuietSteps()
            self._quiet.attach(self.engine)
        # (the protocol's variables: the weights and the statistics that ride in the outer round,
        # which a BatchNormalization layer writes in the step's forward pass)
        self._quiet.step(self._engine, self.engine.protocol.variables, applied, updated)

    def extra_tensors(self, model=None):
        return [] if model is None else floating_statistics(model)

    def after_step(self, updated, applied, start):
        start(list(updated))
        self.after(updated, applied)

    def before_other_step(self):
        engine = self.engine
        return [] if engine is None else [finish_in_graph(engine)]


__all__ = ["PeriodicAfter", "QuietSteps", "exchange_periodically", "updates_counter", "zeros_unless"]
