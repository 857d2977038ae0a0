"""What the optimizer's update becomes under a step protocol: :class:`OptimizerPath`.

Horovod decides its exchange once, in its ``DistributedOptimizer`` factory;
tfsync does the same: each step protocol builds, once, the path of the
optimizer's update (:meth:`StepProtocol.optimizer_path
<tfsync.engine.protocols.base.StepProtocol.optimizer_path>`): what the optimizer
applies (:meth:`OptimizerPath.before`: the round's mean, a corrected gradient,
the worker's own), whether a gradient that is not finite must be kept from it
(:meth:`OptimizerPath.guard`) and what follows it (:meth:`OptimizerPath.after`:
the update pushed, the period counted).  Loss scaling wraps the protocol's path
(:class:`Unscaled` for a fixed scale; a ``LossScaleOptimizer``'s path is each
protocol's own, since the rule for an overflow differs).  The frontends call
only the path's hooks:

* ``SyncCallback`` stands at the optimizer's ``apply`` (``station="apply"``):
  :meth:`OptimizerPath.apply` replaces it, :meth:`OptimizerPath.train_step`
  wraps the train step, :meth:`OptimizerPath.apply_mean` applies a skipped
  step's round;
* ``SyncStrategy`` stands at the optimizer's gradient all-reduce
  (``station="all_reduce"``), after Keras unscaled a fixed loss scale, clipped
  and accumulated: :meth:`OptimizerPath.at_all_reduce`, then
  :meth:`OptimizerPath.after_step` once the step's updates are made (and
  :meth:`OptimizerPath.at_apply` for a path that must see the optimizer's
  ``apply`` itself, :attr:`OptimizerPath.hooks_apply`).

Every hook runs while the compiled train step is traced; what it adds to the
step calls the engine through one ``tf.py_function`` per step.
"""

import tensorflow as tf

from tfsync.engine._tf import py_step


class OptimizerPath:
    """The optimizer's update under one step protocol (base class: the update as it is).

    Args:
        policy: the mode.
        engine: the engine, or a callable returning it (looked up at every step: auto mode
            swaps engines under one compiled step; the strategy starts it while tracing).
        optimizer: the Keras optimizer the frontend hooks (None: not known, a custom loop).
        station: ``"apply"`` or ``"all_reduce"`` (module docstring).
        shared: a compiled step built on this path serves later engines too (auto mode).
    """

    hooks_apply = False  # at the all-reduce station: this path acts at the optimizer's apply instead

    def __init__(self, policy, engine, optimizer=None, station="apply", shared=False):
        if station not in ("apply", "all_reduce"):
            raise ValueError(f"tfsync: station={station!r}; expected 'apply' or 'all_reduce'")
        self.policy = policy
        self._engine = engine if callable(engine) else (lambda: engine)
        self.optimizer = optimizer
        self.station = station
        self.shared = shared

    @property
    def engine(self):
        return self._engine()

    # ------------------------------------------------ what each protocol defines
    def before(self, grads) -> list:
        """What the optimizer applies this step (default: the gradients as they are)."""
        return list(grads)

    def guard(self, to_apply):
        """Bool flags: the optimizer runs only when every one is true; None: it always runs."""
        return None

    def after(self, variables, applied) -> None:
        """Once the optimizer ran on ``variables`` (``applied``: :meth:`guard`'s flags, None
        when unguarded): the protocol's exchange after the update, if it has one."""

    def mean_for_optimizer(self, mean) -> list:
        """A round's mean as the optimizer applies it without another exchange."""
        return list(mean)

    def extra_tensors(self, model=None) -> list:
        """What the engine exchanges beside the trainable weights (``model``: the Keras model)."""
        return []

    def check_optimizer(self, optimizer, who: str) -> None:
        """Refuse, before training, an optimizer path this protocol cannot synchronize;
        ``who`` makes the error's subject (``tfsync.keras.SyncCallback``).  By default an
        optimizer that accumulates gradients: a step of this path is not an update."""
        instead = ACCUMULATION_AT_ALL_REDUCE if self.station == "all_reduce" else ACCUMULATION_UPDATES
        check_accumulation(optimizer, self.policy, who, instead)

    def serves(self, policy) -> bool:
        """Whether a train step compiled on this path serves ``policy``'s engine as it is.  By
        default: an engine of the same mode, since the step looks the engine up at every step; a
        path whose step holds one engine's state serves none."""
        return policy == self.policy

    def install(self, optimizer, original, variables) -> None:
        """Once, when the frontend hooks ``optimizer`` (``original``: its own ``apply``)."""

    def bind(self, engine) -> None:
        """Each time an engine starts on this path (the callback's; before the step is traced)."""

    # ------------------------------------------------------- the frontends' hooks
    def engine_tensors(self, tensors, model=None) -> list:
        """What the engine starts on: ``tensors`` (trainable variables or gradients) and what the
        path exchanges beside them."""
        return [*tensors, *self.extra_tensors(model)]

    def apply(self, original, grads, variables):
        """The optimizer's ``apply(grads, variables)`` under this protocol (``original``: its own)."""
        to_apply = self.before(grads)
        guard = self.guard(to_apply)
        if guard is None:
            result = original(list(to_apply), variables)
            self.after(variables, None)
            return result
        applied = apply_if_finite(guard, lambda: original(list(to_apply), variables))
        self.after(variables, applied)
        return None

    def at_apply(self, grads, variables, start) -> list:
        """(:attr:`hooks_apply` paths at the all-reduce station) what the optimizer's ``apply``
        applies; the engine started first (``start(tensors)``: the frontend adds
        :meth:`extra_tensors`)."""
        if self.engine is None:
            start(list(variables))
        return self.before(grads)

    def at_all_reduce(self, values, start):
        """At the optimizer's gradient all-reduce: ``(what it applies, guard)``; a guarded value
        that is not finite becomes zeros (the optimizer cannot be skipped from here).  A path that
        stands at the optimizer's ``apply`` (:attr:`hooks_apply`) lets the values pass."""
        if self.hooks_apply:
            return list(values), None
        to_apply = self.before([tf.convert_to_tensor(v) for v in values])
        guard = self.guard(to_apply)
        if guard is None:
            return to_apply, None
        kept = tf.cond(
            tf.reduce_all(guard),
            lambda: [tf.identity(v) for v in to_apply],
            lambda: [tf.zeros_like(v) for v in to_apply],
        )
        return kept, guard

    def before_step(self, model, start) -> None:
        """Before a train step is traced (all-reduce station; ``model``: its Keras model, or None
        for a custom loop's step)."""

    def after_step(self, updated, applied, start) -> None:
        """After a train step whose optimizer updated ``updated`` (all-reduce station)."""

    def apply_mean(self, original, variables):
        """How a skipped step's round mean (or a final round of late contributions) goes
        through the optimizer: ``fn(mean)``."""
        return lambda mean: original(self.mean_for_optimizer(mean), variables)

    def train_step(self, model, step, apply_mean, after=None):
        """The Keras ``train_step`` to compile (``apply_mean``: :meth:`apply_mean`; ``after``: the
        all-reduce station's :meth:`after_step`, for a step that pushes only when it computes)."""
        return step

    def before_other_step(self) -> list:
        """Before an evaluation or prediction step: ops it must depend on (none by default)."""
        return []


class Unscaled(OptimizerPath):
    """A protocol's path under an optimizer with a fixed loss scale ``factor``
    (``loss_scale_factor``: the loss is multiplied by it, ``apply`` divides the gradients).

    A round's mean is linear in the gradients, but the corrections (DC-S3GD's, a late
    gradient's) are not: on scaled gradients they would be ``factor`` times too strong.  So at
    the apply station the protocol sees the true gradients and what the optimizer applies is
    multiplied by ``factor`` again; at the all-reduce station Keras has divided already.  A
    round's mean applied without an exchange is multiplied by ``factor`` at both.
    """

    def __init__(self, inner, factor):
        super().__init__(inner.policy, inner._engine, inner.optimizer, inner.station, inner.shared)
        self.inner, self.factor = inner, factor
        self.hooks_apply = inner.hooks_apply

    def before(self, grads):
        if self.station != "apply":
            return self.inner.before(grads)
        f = self.factor
        grads = [None if g is None else tf.convert_to_tensor(g) / tf.cast(f, g.dtype) for g in grads]
        return [g * tf.cast(f, g.dtype) for g in self.inner.before(grads)]

    def guard(self, to_apply):
        return self.inner.guard(to_apply)

    def after(self, variables, applied):
        self.inner.after(variables, applied)

    def mean_for_optimizer(self, mean):
        return [m * tf.cast(self.factor, m.dtype) for m in self.inner.mean_for_optimizer(mean)]

    def extra_tensors(self, model=None):
        return self.inner.extra_tensors(model)

    def check_optimizer(self, optimizer, who):
        self.inner.check_optimizer(optimizer, who)

    def serves(self, policy):
        return self.inner.serves(policy)

    def bind(self, engine):
        self.inner.bind(engine)

    def install(self, optimizer, original, variables):
        self.inner.install(optimizer, original, variables)

    def at_apply(self, grads, variables, start):
        return self.inner.at_apply(grads, variables, start)

    def at_all_reduce(self, values, start):
        return self.inner.at_all_reduce(values, start)  # (Keras divided by the factor already)

    def before_step(self, model, start):
        self.inner.before_step(model, start)

    def after_step(self, updated, applied, start):
        self.inner.after_step(updated, applied, start)

    def train_step(self, model, step, apply_mean, after=None):
        return self.inner.train_step(model, step, apply_mean, after)

    def before_other_step(self):
        return self.inner.before_other_step()


def require_model(model, policy):
    """The Keras model a path needs at the all-reduce station (to skip a step, or to start from
    the model's weights); a custom loop's step function has none, and is refused."""
    if model is None:
        raise ValueError(
            f"tfsync.SyncStrategy(mode={policy.name!r}) reaches the model through Keras' Model.train_step "
            f"(to skip a slow worker's steps, or to start from the model's weights), and this step is a "
            f"custom loop's function. Train with model.fit"
        )
    return model


# ----------------------------------------------------------------- the optimizer
def is_loss_scaled(optimizer) -> bool:
    """Whether ``optimizer`` is Keras' ``LossScaleOptimizer`` (mixed precision): it wraps the
    optimizer that updates the weights, checks every step's gradients for overflow, and skips
    the step (halving its loss scale) when one is not finite."""
    return hasattr(optimizer, "inner_optimizer") and hasattr(optimizer, "check_finite")


def static_loss_scale(optimizer):
    """A Keras optimizer's fixed loss scale (``loss_scale_factor``), or None."""
    return getattr(optimizer, "loss_scale_factor", None) or None


def accumulation_steps(optimizer):
    """The ``gradient_accumulation_steps`` of the optimizer that updates the weights (a
    ``LossScaleOptimizer``'s inner one), or None."""
    return getattr(getattr(optimizer, "inner_optimizer", optimizer), "gradient_accumulation_steps", None) or None


# why an accumulating optimizer is refused, and what to do instead, by what the path exchanges
ACCUMULATION_UPDATES = (
    "this mode exchanges the update each step made and counts its staleness bound (or "
    "corrects its delay, or its period of local steps) in steps, which would then not be "
    "updates. Use a mode that exchanges gradients ('bsp', 'psp', 'backup'), where each "
    "step's gradients are averaged before they are accumulated, or a larger batch instead "
    "of accumulating"
)
ACCUMULATION_AT_ALL_REDUCE = (
    "Keras' optimizer all-reduces the accumulated gradients only at those steps, which BSP's "
    "rounds follow, but a mode that skips steps or exchanges updates counts every step. Use "
    "mode='bsp', or tfsync.keras.SyncCallback, which synchronizes accumulation under 'bsp', "
    "'psp', 'backup', 'localsgd' and 'diloco'"
)


def check_accumulation(optimizer, policy, who, instead):
    """Refuse, before training, an optimizer that accumulates gradients: ``who`` makes the
    error's subject, ``instead`` says why and what to do."""
    steps = accumulation_steps(optimizer) if optimizer is not None else None
    if steps:
        raise ValueError(
            f"{who}(mode={policy.name!r}): the optimizer accumulates gradients "
            f"(gradient_accumulation_steps={steps}): only every {steps}th step updates the weights, "
            f"the others add to the accumulators; {instead}"
        )


def scaled_for_optimizer(grads, overflowed, scale):
    """What a ``LossScaleOptimizer`` takes: ``grads`` times its loss scale ``scale(dtype)``, or
    NaN when ``overflowed`` (it then skips the step and halves its scale)."""
    out = []
    for g in grads:
        poison = tf.where(overflowed, tf.constant(float("nan"), g.dtype), tf.constant(1.0, g.dtype))
        out.append(g * scale(g.dtype) * poison)
    return out


def unscaled_or_zeros(grads, scale):
    """A ``LossScaleOptimizer``'s gradients unscaled, or zeros where any overflowed (so no
    infinity or NaN crosses the wire or reaches a correction), and whether they did."""
    grads = [tf.convert_to_tensor(g) for g in grads]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
    return [tf.where(finite, g / scale(g.dtype), tf.zeros_like(g)) for g in grads], tf.logical_not(finite)


# ------------------------------------------------------------------ the train step
def apply_if_finite(finite, apply):
    """Run ``apply()`` (the optimizer's step) only when every flag of ``finite`` is true;
    returns ``finite``, once the step ran or was skipped.

    A NaN or an infinity that reaches the optimizer stays in its slots
    (momentum, Adam's moments) and makes every later update of this worker
    NaN, each rejected in turn: the worker would train nothing for the rest of
    the job.  The step is skipped instead, as Keras' ``LossScaleOptimizer``
    skips one whose gradients overflowed (weights, slots and ``iterations``
    untouched), and the engine rejects its contribution, so it is counted.
    """

    def run():
        apply()  # stateful: the taken branch runs it
        return tf.constant(True)

    ran = tf.cond(tf.reduce_all(finite), run, lambda: tf.constant(False))
    with tf.control_dependencies([ran]):
        return tf.identity(finite)


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
    are returned unchanged (a skipped step adds nothing to them).  ``engine``:
    a callable returning the engine.  ``apply_mean=None``: the engine applies
    the rounds itself (the update protocol, partial pulling), and a skipped
    step applies nothing here.
    """

    def step(data):
        compute = tf.py_function(lambda: engine().begin_step(), [], Tout=tf.bool, name="tfsync_begin_step")
        compute.set_shape([])

        def skip():
            if apply_mean is None:
                done = tf.py_function(
                    lambda: (engine().skip_step(), tf.constant(True))[1], [], Tout=tf.bool, name="tfsync_skip_step"
                )
                with tf.control_dependencies([done]):
                    return tf.nest.map_structure(tf.identity, model.get_metrics_result())
            protocol = engine().protocol
            mean = py_step(lambda: engine().skip_step(), [], protocol.dtypes, protocol.shapes, "tfsync_skip_step")
            apply_mean(mean)  # stateful: a tf.function runs it (automatic control dependencies)
            return model.get_metrics_result()

        return tf.cond(compute, lambda: train_step(data), skip)

    return step


__all__ = [
    "OptimizerPath",
    "Unscaled",
    "apply_if_finite",
    "finish_in_graph",
    "is_loss_scaled",
    "skippable_train_step",
    "static_loss_scale",
]
