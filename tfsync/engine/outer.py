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

Then every worker's weights become ``w_outer``.  The model's non-trainable
floating-point variables (BatchNormalization's statistics), when the frontend
passes them, ride in the same round and are averaged plainly.  The worker's
own optimizer state is not touched (it stays local, as in both papers).
"""

import keras
import tensorflow as tf

from tfsync import ops
from tfsync.engine.components import StepComponent
from tfsync.engine.protocols import compile_flat, tf_variable


def _state_variable(initial):
    return tf.Variable(initial, trainable=False, synchronization=tf.VariableSynchronization.NONE)


def build_outer_optimizer(config):
    """A fresh Keras optimizer from a policy's ``outer_optimizer_config`` (None: no optimizer)."""
    if config is None:
        return None
    return keras.optimizers.deserialize(config)


class OuterStepProtocol:
    """Local SGD's and DiLoCo's step (see the module docstring)."""

    payload = "pseudo_gradients"
    average = True  # the round's result is the mean pseudo-gradient over the ranks present
    reduces_gradients = False  # the worker's own optimizer runs every step ...
    corrects_gradients = False
    periodic = True  # ... and only every H-th step is a contribution
    one_round_per_step = True  # outer step k applies round k

    @staticmethod
    def components():
        """The last, shorter outer step when training ends mid-period."""
        return [FinalOuterStep()]

    def __init__(self, variables, size, policy):
        self.period = int(policy.inner_steps)
        self.variables = [tf_variable(v) for v in variables]
        # trainable weights go through the outer optimizer; statistics are averaged plainly
        self.trainable = [bool(getattr(v, "trainable", True)) for v in variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.dtypes = [v.dtype for v in self.variables]
        with tf.init_scope():
            self.w_outer = [_state_variable(tf.identity(v)) for v in self.variables]
            self._zeros = [tf.zeros(v.shape, v.dtype) for v in self.variables]
            self.outer_optimizer = build_outer_optimizer(policy.outer_optimizer_config)
            weights = [w for w, t in zip(self.w_outer, self.trainable) if t]
            if self.outer_optimizer is not None:
                self.outer_optimizer.build(weights)
        self.inner_done = 0  # inner steps since the last outer step, this one included
        self.all_finite = True  # every inner step of the period had finite gradients
        variables, w_outer, trainable, outer = self.variables, self.w_outer, self.trainable, self.outer_optimizer
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
                v.assign(w)

        def restart():
            for v, w in zip(variables, w_outer):
                v.assign(w)

        self._pseudo_gradient = compile_flat(pseudo_gradient)
        self._apply_mean = compile_flat(apply_mean, specs)
        self._restart = compile_flat(restart)

    def end_inner_step(self, finite: bool) -> bool:
        """One step of the worker's optimizer is done (``finite``: its gradients were, so it ran);
        whether it ends the period (then the frontend calls the engine's ``sync_step``)."""
        self.inner_done += 1
        self.all_finite = self.all_finite and bool(finite)
        return self.inner_done >= self.period

    def contribution(self, inputs):
        """The pseudo-gradient ``w_outer - w`` and whether each tensor of it is finite (all false
        when a gradient of the period was not: the period's steps were skipped, the contribution
        is rejected); a new period begins."""
        out = self._pseudo_gradient()
        finite = out[-1] if self.all_finite else tf.zeros_like(out[-1])
        self.inner_done, self.all_finite = 0, True
        return list(out[:-1]), finite

    def reject(self, _payload):
        """A contribution that is not finite goes nowhere: this worker goes back to ``w_outer`` (its
        period lost), and the round averages the others'; sends zeros."""
        self._restart()
        return self._zeros

    def apply_round(self, result):
        """Move ``w_outer`` by the round's mean and every weight to it; a round without a finite
        contribution (every rank rejected) moves nothing."""
        if not result.present.any():
            self._restart()
            return
        self._apply_mean(*result.total)

    def result(self):
        return []

    def finish(self):
        """Every round applied: the weights are ``w_outer``, identical on every worker."""
        self._restart()


class FinalOuterStep(StepComponent):
    """When training ends with inner steps since the last outer step, one last outer step for
    them (every rank has the same count: the frontends check every rank runs the same steps),
    so the replicas end identical."""

    def finish(self, apply_mean) -> bool:
        engine = self.engine
        if engine.protocol.inner_done:
            engine.sync_step([])
        return False


__all__ = ["OuterStepProtocol", "FinalOuterStep", "build_outer_optimizer"]
