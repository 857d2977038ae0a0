"""The outer-step protocol (``"pseudo_gradients"``): Local SGD's and DiLoCo's step.

Each worker trains ``H`` steps with its own optimizer; the engine sees only
every ``H``-th step, the *outer step* (the frontends call
:meth:`SyncEngine.local_step <tfsync.engine.SyncEngine.local_step>` for the
others, which sleeps a simulated straggler's delay and nothing else), so the
engine's steps and rounds are outer steps, and every wait, count and trace
record is one outer step's.

The protocol keeps ``w_outer``, the weights of the last outer step (one copy
of the weights beside them, identical on every replica).  At an outer step
the contribution is the pseudo-gradient ``Δ_i = w_outer - w_i`` (DiLoCo,
Algorithm 1, line 10); the round averages it over the workers whose
contribution was finite, and every replica then moves ``w_outer`` by it:

* Local SGD (no outer optimizer): ``w_outer ← w_outer - mean Δ``, the mean of
  the workers' weights;
* DiLoCo: the outer optimizer (a Keras optimizer over ``w_outer``, the same
  configuration and the same state on every replica) applies the mean ``Δ``
  as its gradient.

Then every worker's weights become ``w_outer``.

DiLoCo's streaming variant (``overlap_steps=τ > 0``) sends the contribution
``τ`` inner steps before the period ends (the engine's step then waits only
for the previous round, applied already) and trains on while the round is in
flight; at the period's end the frontend waits for that round
(:meth:`SyncEngine.local_step <tfsync.engine.SyncEngine.local_step>` with the
round), the outer optimizer steps, and the worker's weights become
``(1 − α)·w_outer + α·w_i`` (``α``: ``mixing``).  The model's non-trainable
floating-point variables (BatchNormalization's statistics), when the frontend
passes them, ride in the same round and are averaged plainly.  The worker's
own optimizer state is not touched (it stays local, as in both papers).
"""

import keras
import tensorflow as tf

from tfsync import ops
from tfsync.engine.components import StepComponent
from tfsync.engine.protocols._tf import (
    compile_flat,
    floating_statistics,
    gradients_finite,
    state_variable,
    tf_variable,
)
from tfsync.engine.protocols.base import StepProtocol
from tfsync.engine.protocols.path import OptimizerPath, finish_in_graph, is_loss_scaled


def build_outer_optimizer(config):
    """A fresh Keras optimizer from a policy's ``outer_optimizer_config`` (None: no optimizer)."""
    if config is None:
        return None
    return keras.optimizers.deserialize(config)


class OuterStepProtocol(StepProtocol):
    """Local SGD's and DiLoCo's step (see the module docstring)."""

    payload = "pseudo_gradients"
    describes = "outer-step pseudo-gradient (its period's change; steps here count outer steps)"
    averages = True  # the round's result is the mean pseudo-gradient over the ranks present

    @classmethod
    def components(cls, policy):
        """The last, shorter outer step when training ends mid-period."""
        return [FinalOuterStep()]

    @classmethod
    def optimizer_path(cls, policy, engine, optimizer=None, station="apply", shared=False):
        return PeriodicAfter(policy, engine, optimizer, station, shared)

    @classmethod
    def rest_steps(cls, policy):
        """Every outer step (``inner_steps``), where the weights are ``w_outer`` on every replica;
        None when an overlapped round lands with ``mixing`` (each replica keeps a share of its own)."""
        if policy.overlap_steps and policy.mixing:
            return None
        return int(policy.inner_steps)

    def at_rest(self):
        return self.inner_done == 0 and not self.pushed and not (self.overlap and self.mixing)

    PUSH, LAND = "push", "land"  # what a step does besides the worker's own (end_inner_step)

    def __init__(self, variables, size, policy):
        self.period = int(policy.inner_steps)
        self.overlap = int(policy.overlap_steps)
        self.mixing = float(policy.mixing)
        self.variables = [tf_variable(v) for v in variables]
        # trainable weights go through the outer optimizer; statistics are averaged plainly
        self.trainable = [bool(getattr(v, "trainable", True)) for v in variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.dtypes = [v.dtype for v in self.variables]
        with tf.init_scope():
            self.w_outer = [state_variable(tf.identity(v)) for v in self.variables]
            self._zeros = [tf.zeros(v.shape, v.dtype) for v in self.variables]
            self.outer_optimizer = build_outer_optimizer(policy.outer_optimizer_config)
            weights = [w for w, t in zip(self.w_outer, self.trainable) if t]
            if self.outer_optimizer is not None:
                self.outer_optimizer.build(weights)
        self.inner_done = 0  # inner steps of this period, this one included
        self.pushed = False  # (overlapped) this period's contribution is in flight
        self.all_finite = True  # every inner step since the last push had finite gradients
        variables, w_outer, trainable, outer = self.variables, self.w_outer, self.trainable, self.outer_optimizer
        mixing = self.mixing
        specs = [tf.TensorSpec(s, d) for s, d in zip(self.shapes, self.dtypes)]

        def pseudo_gradient():
            delta = [w - v for w, v in zip(w_outer, variables)]
            return [*delta, ops.all_finite(delta)]

        def apply_mean(*mean):
            if outer is not None:
                # the optimizer's own rule for each weight (Keras' documented ``update_step``) at its
                # learning rate now (a schedule counts outer steps), then one more iteration: what
                # its ``apply`` does for the settings the policy allows, without ``apply``'s
                # tf.distribute merge call (under SyncStrategy this runs outside a replica context)
                learning_rate = outer.learning_rate
                for m, w, t in zip(mean, w_outer, trainable):
                    if t:
                        outer.update_step(m, w, tf.cast(learning_rate, w.dtype))
                outer.iterations.assign_add(1)
            for w, m, t in zip(w_outer, mean, trainable):
                if outer is None or not t:
                    w.assign_sub(m)
            for v, w in zip(variables, w_outer):
                # (overlapped, mixing α: keep that share of the worker's own weights)
                v.assign(w if not mixing else w + mixing * (v - w))

        def restart():
            for v, w in zip(variables, w_outer):
                v.assign(w)

        self._pseudo_gradient = compile_flat(pseudo_gradient)
        self._apply_mean = compile_flat(apply_mean, specs)
        self._restart = compile_flat(restart)

    def end_inner_step(self, finite: bool):
        """One step of the worker's optimizer is done (``finite``: its gradients were, so it ran).
        What else the step does: :attr:`PUSH` (the frontend calls the engine's ``sync_step``: at
        the period's end, or ``overlap_steps`` before it), :attr:`LAND` (overlapped: the period
        ends, the frontend waits for its round and applies it), or None (an inner step only)."""
        self.inner_done += 1
        self.all_finite = self.all_finite and bool(finite)
        if not self.pushed and self.inner_done >= self.period - self.overlap:
            return self.PUSH
        if self.inner_done >= self.period:  # (overlapped: pushed overlap_steps ago)
            self.end_period()
            if not self.mixing:  # the steps since the push are dropped when the round lands
                self.all_finite = True
            return self.LAND
        return None

    def end_period(self):
        """The period's round is applied: the next period begins."""
        self.inner_done, self.pushed = 0, False

    def contribution(self, inputs):
        """The pseudo-gradient ``w_outer - w`` and whether each tensor of it is finite (all false
        when a gradient since the last push was not: those steps were skipped, the contribution
        is rejected); without overlap a new period begins."""
        out = self._pseudo_gradient()
        finite = out[-1] if self.all_finite else tf.zeros_like(out[-1])
        self.all_finite = True
        if self.overlap:
            self.pushed = True
        else:
            self.end_period()
        return list(out[:-1]), finite

    def reject(self, _payload):
        """A contribution that is not finite goes nowhere: this worker goes back to ``w_outer`` (its
        period lost), and the round averages the others'; sends zeros."""
        self._restart()
        return self._zeros

    def apply_round(self, result):
        """Move ``w_outer`` by the round's mean and every weight to it (overlapped with mixing α:
        to ``(1 − α)·w_outer + α·w``); a round without a finite contribution (every rank
        rejected) moves nothing."""
        if not result.present.any():
            self._restart()
            return
        self._apply_mean(*result.total)

    def last_round(self, completed, required):
        return min(completed, required)  # outer step k applies round k

    def absent(self):
        return self._zeros

    def finish(self):
        """Every round applied: the weights are ``w_outer``, identical on every worker (overlapped:
        the steps since the last push, which an in-flight round has not taken, are dropped, as
        with ``mixing=0`` during training)."""
        self._restart()


class FinalOuterStep(StepComponent):
    """When training ends with inner steps since the last outer step and none of them pushed,
    one last outer step for them, waited for even when overlapped (every rank has the same
    count: the frontends check every rank runs the same steps), so the replicas end identical.
    A round still in flight was applied by the engine's drain before."""

    def finish(self, apply_mean) -> bool:
        engine, protocol = self.engine, self.engine.protocol
        if protocol.inner_done and not protocol.pushed:
            engine.sync_step([])
            engine.wait_and_apply(engine.step - 1)  # (overlapped: the push did not wait for it)
        protocol.end_period()
        return False


def exchange_periodically(engine, variables, applied=None):
    """After the local optimizer step, count it; the ``H``-th step of a period is an outer step
    (the engine's ``sync_step``: the pseudo-gradient's round, bounded, counted, applied), the
    others are the worker's own (:meth:`SyncEngine.local_step`).  DiLoCo overlapped: the push
    comes ``overlap_steps`` before the period's end, whose step waits for the round and applies
    it.  One ``tf.py_function`` per step, ordered after the optimizer's writes (it takes each
    variable's shape through its handle); ``applied``: the path's guard (a contribution with a
    step whose gradients were not finite is rejected at its push).  ``engine``: a callable
    returning the engine."""
    # (the protocol's variables: the weights and the statistics that ride in the outer round, which
    # a BatchNormalization layer writes in the step's forward pass)
    variables = engine().protocol.variables
    after_update = [tf.raw_ops.VariableShape(input=v.handle) for v in variables]
    flags = tf.reshape(applied, [-1]) if applied is not None else tf.constant([True])

    def step(finite, *_):
        running = engine()
        protocol = running.protocol
        action = protocol.end_inner_step(bool(finite.numpy().all()))
        if action == protocol.PUSH:
            running.sync_step([])
        elif action == protocol.LAND:  # (DiLoCo overlapped: the round pushed overlap_steps ago)
            running.local_step(required_round=running.step - 1)
        else:
            running.local_step()

    return tf.py_function(step, [flags, *after_update], Tout=[], name="tfsync_step")


class PeriodicAfter(OptimizerPath):
    """The worker's own optimizer runs every step (on finite gradients only), then the step is
    counted and every ``H``-th pushes its pseudo-gradient.  The model's non-trainable
    floating-point statistics ride in the outer round with the weights.  Under a
    ``LossScaleOptimizer`` its own decision stands (it skips an overflowed step itself)."""

    def guard(self, to_apply):
        return None if is_loss_scaled(self.optimizer) else gradients_finite(to_apply)

    def after(self, variables, applied):
        exchange_periodically(self._engine, variables, applied)

    def extra_tensors(self, model=None):
        return [] if model is None else floating_statistics(model)

    def after_step(self, updated, applied, start):
        start(list(updated))
        self.after(updated, applied)

    def before_other_step(self):
        engine = self.engine
        return [] if engine is None else [finish_in_graph(engine)]


__all__ = ["FinalOuterStep", "OuterStepProtocol", "build_outer_optimizer"]
