"""Local SGD's and DiLoCo's optimizer path (:class:`PeriodicAfter`): the worker's own optimizer
runs every step, and every ``H``-th step (an outer step) pushes its pseudo-gradient
(:mod:`tfsync.engine.protocols.outer` is the protocol).
"""

import tensorflow as tf

from tfsync.engine._tf import floating_statistics, gradients_finite
from tfsync.engine.protocols.path import OptimizerPath, accumulation_steps, finish_in_graph, is_loss_scaled


def exchange_periodically(engine, variables, applied=None, updated=None):
    """After the local optimizer step, count it; the ``H``-th step of a period is an outer step
    (the engine's ``sync_step``: the pseudo-gradient's round, bounded, counted, applied), the
    others are the worker's own (:meth:`SyncEngine.local_step`).  DiLoCo overlapped: the push
    comes ``overlap_steps`` before the period's end, whose step waits for the round and applies
    it.  One ``tf.py_function`` per step, ordered after the optimizer's writes (it takes each
    variable's shape through its handle); ``applied``: the path's guard (a contribution with a
    step whose gradients were not finite is rejected at its push); ``updated``: whether the
    optimizer updated the weights (None: every step does; an accumulating optimizer's other
    batches count as no step of the period).  ``engine``: a callable returning the engine."""
    # (the protocol's variables: the weights and the statistics that ride in the outer round, which
    # a BatchNormalization layer writes in the step's forward pass)
    variables = engine().protocol.variables
    after_update = [tf.raw_ops.VariableShape(input=v.handle) for v in variables]
    flags = tf.reshape(applied, [-1]) if applied is not None else tf.constant([True])
    updated = tf.constant(True) if updated is None else updated

    def step(finite, update, *_):
        running = engine()
        protocol = running.protocol
        action = protocol.end_inner_step(bool(finite.numpy().all()), bool(update.numpy()))
        if action == protocol.PUSH:
            running.sync_step([])
        elif action == protocol.LAND:  # (DiLoCo overlapped: the round pushed overlap_steps ago)
            running.local_step(required_round=running.step - 1)
        else:
            running.local_step()

    return tf.py_function(step, [flags, updated, *after_update], Tout=[], name="tfsync_step")


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
        exchange_periodically(self._engine, variables, applied, updated)

    def extra_tensors(self, model=None):
        return [] if model is None else floating_statistics(model)

    def after_step(self, updated, applied, start):
        start(list(updated))
        self.after(updated, applied)

    def before_other_step(self):
        engine = self.engine
        return [] if engine is None else [finish_in_graph(engine)]


__all__ = ["PeriodicAfter", "exchange_periodically", "updates_counter", "zeros_unless"]
