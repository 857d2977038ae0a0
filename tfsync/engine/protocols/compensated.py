"""The compensated-update protocol (``"compensated_updates"``): DC-S3GD's step.

The gradient is corrected for the one round it is late
(:func:`tfsync.ops.delay_compensate`) before the optimizer runs; the change
the optimizer then made, ``Δ``, is pushed and averaged into ``w̄``.  So a step
waits twice: before the optimizer, for the round the correction needs
(:class:`Corrections`, one ``tf.py_function``), and after it, to push the
update.  The first wait is the step's wait, not its computation, and a
contribution whose gradient was corrected against moved weights counts as
``compensated`` when its round is applied.

:class:`Compensator` (DC-ASGD's correction over a model's tensors) serves the
gradient protocol's late contributions too.
"""

import tensorflow as tf

from tfsync import ops
from tfsync.engine._tf import gradients_finite, py_step, run_compiled, state_variable, tf_variable
from tfsync.engine.components import StepComponent
from tfsync.engine.protocols.base import StepProtocol
from tfsync.engine.protocols.path import (
    OptimizerPath,
    Unscaled,
    finish_in_graph,
    is_loss_scaled,
    require_model,
    scaled_for_optimizer,
    static_loss_scale,
    unscaled_or_zeros,
)


class CompensatedUpdateProtocol(StepProtocol):
    """DC-S3GD's step (:class:`tfsync.DCS3GD`): correct the gradient, push the update.

    Two hooks per step.  Before the optimizer, the engine waits for round
    ``t - 1`` and hands its mean update over (:meth:`take_mean`);
    :meth:`correct_in_graph` adds it to ``w̄`` and returns
    ``g̃ = g + λ·g⊙g⊙(w̄ − w_local)``, ``w_local`` being the weights ``g`` was
    computed at.  After the optimizer moved the variables to
    ``w_local + U(g̃)``, :meth:`push_in_graph` takes ``Δ = U(g̃)``, moves the
    variables to ``w̄ + Δ`` and returns ``Δ``, which the engine pushes;
    Horovod averages the round.

    Both hooks are plain TensorFlow ops that the optimizer path builds into the
    compiled train step, so a step costs two ``tf.py_function`` calls (wait,
    push) and no extra function dispatch (a compiled function per hook would
    cost about as much per step as the allreduce the overlap hides).  :meth:`correct` and :meth:`contribution`
    run the same ops eagerly (the engine's own API, used by the tests).

    The correction runs after any change the optimizer makes before its
    exchange hook (a Keras strategy's weight decay), so ``Δ`` is measured from
    ``w_local``, the weights at the step's start, and never from a read taken
    mid-step.  State in device variables: ``w̄`` and ``w_local`` (plus ``v``,
    adaptive): two or three copies of the parameters, and the update in flight.
    """

    payload = "compensated_updates"
    describes = "update"
    averages = True  # the round's result is the mean update (1/N) Σ_j Δ_j

    @classmethod
    def components(cls, policy):
        return [Corrections()]

    @classmethod
    def optimizer_path(cls, policy, engine, optimizer=None, station="apply", shared=False):
        if is_loss_scaled(optimizer):
            return LossScaledCorrection(policy, engine, optimizer, station, shared)
        path = CorrectThenPush(policy, engine, optimizer, station, shared)
        factor = static_loss_scale(optimizer)
        return Unscaled(path, factor) if factor is not None else path

    def __init__(self, variables, size, policy):
        self.variables = [tf_variable(v) for v in variables]
        self.dtypes = [v.dtype for v in self.variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        with tf.init_scope():
            self.w_bar = [state_variable(tf.identity(v)) for v in self.variables]
            self.w_local = [state_variable(tf.identity(v)) for v in self.variables]
            self._no_round = [tf.zeros(v.shape, v.dtype) for v in self.variables]
        self._compensator = Compensator(policy.compensation, self.variables)
        # the correction keeps state (DC-ASGD-a's v) that gradients which are not finite must not reach
        self.stateful_correction = policy.compensation.adaptive
        self._pending = []  # round results applied by the engine, not yet added to w̄

    def apply_round(self, result):
        self._pending.append(result.total)

    def last_round(self, completed, required):
        return min(completed, required)  # step t applies round t - 1: one round per step

    def absent(self):
        return self._no_round

    def take_mean(self):
        """The mean update of the rounds applied since the last call (zeros: none)."""
        pending, self._pending = self._pending, []
        if not pending:
            return self._no_round
        return [tf.add_n(list(parts)) if len(parts) > 1 else parts[0] for parts in zip(*pending)]

    def correct_in_graph(self, grads, mean, finite=None):
        """``w̄ += mean``; the gradients corrected with ``w_now = w̄``, ``w_stale = w_local``.
        ``finite``: whether each gradient is finite; unless all are, the adaptive correction's
        ``v`` is left alone (the optimizer is then skipped, and the update is rejected)."""
        for w, m in zip(self.w_bar, mean):
            w.assign_add(m)
        if finite is None or not self.stateful_correction:
            return self._compensator(grads, self.w_bar, self.w_local)
        return tf.cond(
            tf.reduce_all(finite),
            lambda: self._compensator(grads, self.w_bar, self.w_local),
            lambda: [tf.identity(g) for g in grads],
        )

    def push_in_graph(self, applied=None):
        """The optimizer moved the variables to ``w_local + Δ``: move them to ``w̄ + Δ``; ``Δ``,
        then whether each tensor of it is finite (the engine's ``sync_step`` takes both; with
        ``applied``, the path's guard, the gradients' too)."""
        updates = []
        for v, w, local in zip(self.variables, self.w_bar, self.w_local):
            update = v - local
            moved = w + update
            v.assign(moved)
            local.assign(moved)
            updates.append(update)
        finite = ops.all_finite(updates)
        return [*updates, finite if applied is None else tf.logical_and(finite, applied)]

    def correct(self, grads, mean):
        """:meth:`correct_in_graph`, eagerly."""
        return run_compiled(self.correct_in_graph, [tf.convert_to_tensor(g) for g in grads], mean)

    def contribution(self, inputs):
        """``Δ`` and whether each tensor of it is finite: pushed in the train step already
        (``inputs``), or now, eagerly."""
        out = list(inputs) if inputs else run_compiled(self.push_in_graph)
        return out[:-1], out[-1]

    def reject(self, _updates):
        """An update that is not finite goes nowhere: this worker moves back to ``w̄`` (its update
        zero), as every replica's ``w̄`` takes the round without it; sends zeros."""
        for v, w, local in zip(self.variables, self.w_bar, self.w_local):
            v.assign(w)
            local.assign(w)
        return self._no_round

    def finish(self):
        """Every round applied: the weights become ``w̄``, identical on every worker."""
        mean = self.take_mean()
        for v, w, local, m in zip(self.variables, self.w_bar, self.w_local, mean):
            w.assign_add(m)
            v.assign(w)
            local.assign(w)


class Compensator:
    """DC-ASGD's correction with a :class:`tfsync.DelayCompensation`'s settings, over a model's
    tensors: ``compensator(grads, w_now, w_stale)``, as TensorFlow ops (eager or in a graph),
    one fused :func:`tfsync.ops.delay_compensate` (or ``_adaptive``) per tensor.  With
    ``adaptive=True`` it keeps ``v`` per parameter in variables of the accumulation dtype.
    """

    def __init__(self, compensation, variables):
        self.compensation = compensation
        with tf.init_scope():
            self.mean_square = (
                [state_variable(tf.zeros(v.shape, _accumulation_dtype(v.dtype))) for v in variables]
                if compensation.adaptive
                else None
            )
            self.lam = tf.constant(compensation.strength, tf.float32)

    def __call__(self, grads, w_now, w_stale):
        c = self.compensation
        if c.adaptive:
            return [
                ops.delay_compensate_adaptive(g, now, stale, v, self.lam, c.momentum, c.epsilon)
                for g, now, stale, v in zip(grads, w_now, w_stale, self.mean_square)
            ]
        return [ops.delay_compensate(g, now, stale, self.lam) for g, now, stale in zip(grads, w_now, w_stale)]


def _accumulation_dtype(dtype):
    return tf.float64 if dtype == tf.float64 else tf.float32


class Corrections(StepComponent):
    """The wait before the optimizer and what it applied, until the step pushes."""

    def __init__(self):
        self._wait = None  # (wait_s, rounds applied) of this step's correction, until its push
        self._rounds = set()  # own contributions whose gradient was corrected against moved weights

    def round_mean(self):
        """Wait for the round this step's gradients are applied after, apply it, and return the
        mean update the correction adds to ``w̄``."""
        engine = self.engine
        with engine.guard():
            engine.delays.sleep()
            t = engine.now()
            applied = engine.wait_and_apply(engine.policy.sync_round(engine.step))
            self._wait = (engine.now() - t, applied)
            if engine.applied_through >= 0:  # w̄ moved past the weights the gradients were computed at
                self._rounds.add(engine.step)
            return engine.protocol.take_mean()

    def correct(self, grads):
        """:meth:`round_mean`, then the gradients corrected (eager; the optimizer path builds the
        correction into the compiled step instead, :func:`correct_gradients`)."""
        return self.engine.protocol.correct(grads, self.round_mean())

    def before_push(self, step):
        if self._wait is None:
            raise RuntimeError(
                f"tfsync: policy {self.engine.policy.name!r} corrects each step's gradients before the "
                f"optimizer runs: call Corrections.round_mean (or correct) before SyncEngine.sync_step"
            )
        waited, self._wait = self._wait, None
        return waited

    def own_count(self, res):
        if res.round in self._rounds:
            self._rounds.discard(res.round)
            return "compensated"
        return None

    def after_apply(self, res):
        self._rounds.discard(res.round)  # (a rejected contribution's round: not counted here)


def correct_gradients(engine, grads, finite=None):
    """This step's gradients, corrected for the weights they will be applied at (``engine``:
    the running engine).

    One ``tf.py_function`` waits for the round the correction needs and returns
    its mean (:meth:`Corrections.round_mean`); the correction itself is built
    into the compiled step (``protocol.correct_in_graph``: the fused
    :func:`tfsync.ops.delay_compensate`), so the engine must be started.  ``finite``:
    gradients that are not finite are handed back uncorrected and leave the
    correction's state alone.
    """
    protocol = engine.protocol
    grads = [tf.convert_to_tensor(g) for g in grads]  # IndexedSlices become dense
    mean = py_step(engine.find(Corrections).round_mean, [], protocol.dtypes, protocol.shapes, "tfsync_round_mean")
    return protocol.correct_in_graph(grads, mean, finite)


class CorrectThenPush(OptimizerPath):
    """The gradient corrected before the optimizer; the optimizer runs on it (finite ones
    only), then its update is pushed.  A correction that keeps state (DC-ASGD-a's ``v``) is
    kept from gradients that are not finite."""

    def serves(self, policy):
        return False  # (its step calls this engine's Corrections.round_mean, bound at the trace)

    def before(self, grads):
        engine = self.engine
        raw = gradients_finite(grads) if engine.protocol.stateful_correction else None
        return correct_gradients(engine, grads, raw)

    def guard(self, to_apply):
        return gradients_finite(to_apply)

    def after(self, variables, applied):
        engine = self._engine
        updates = engine().protocol.push_in_graph(applied)
        tf.py_function(lambda *u: engine().sync_step(u), updates, Tout=[], name="tfsync_step")

    def before_step(self, model, start):
        if self.engine is None:  # gradients are corrected against the weights: start from the model's
            start(list(require_model(model, self.policy).trainable_variables))

    def after_step(self, updated, applied, start):
        start(list(updated))  # (started on the model's variables: checks the step updated those)
        self.after(updated, applied)

    def before_other_step(self):
        engine = self.engine
        return [] if engine is None else [finish_in_graph(engine)]


class LossScaledCorrection(CorrectThenPush):
    """DC-S3GD under a ``LossScaleOptimizer``: the correction (``g + λ·g⊙g⊙Δw``) is not linear
    in ``g``, so it is applied to the unscaled gradient; an overflowed one is corrected as
    zeros (it must not reach the correction's state) and handed to the optimizer as NaN, which
    then skips the step itself (no guard).  At the all-reduce station the path stands at the
    optimizer's ``apply`` (:attr:`hooks_apply`)."""

    hooks_apply = True

    def _scale(self, dtype):
        return tf.cast(self.optimizer.dynamic_scale, dtype)

    def before(self, grads):
        safe, overflowed = unscaled_or_zeros(grads, self._scale)
        return scaled_for_optimizer(correct_gradients(self.engine, safe), overflowed, self._scale)

    def guard(self, to_apply):
        return None


__all__ = ["CompensatedUpdateProtocol", "Compensator", "Corrections", "correct_gradients"]
