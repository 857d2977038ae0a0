"""The gradient protocol (``"gradients"``): BSP's, PSP's and backup workers' step.

The raw gradients are pushed before the optimizer runs; the round's result is
the workers' mean gradient, which every worker's optimizer applies (what
``hvd.allreduce`` + optimizer does).  A late gradient of PSP or backup workers
(``compensate=``, :mod:`tfsync.engine.components.late`) is corrected against the weights
it is applied at (:class:`~tfsync.engine.protocols.compensated.Compensator`),
so with compensation the protocol keeps the weights it was computed on.

Under open rounds (BSP) the round's *sum* is checked, by the pass that divides
it (:meth:`GradientProtocol.scale_sum`, see :mod:`tfsync.engine.exchange`);
under coordinated rounds each contribution is checked before it is offered,
with one read-only pass (:func:`tfsync.ops.all_finite`).

The optimizer path (:class:`ExchangeBefore`): the frontend's hook hands the
step's gradients to the engine through one ``tf.py_function`` and the
optimizer applies the mean that comes back.  Under a ``LossScaleOptimizer``
every rank must skip the same steps (:class:`LossScaledExchange`); under PSP's
partial pulling the engine applies the rounds block by block itself
(:class:`BlockwiseExchange`, :mod:`tfsync.engine.components.pull`).
"""

import numpy as np
import tensorflow as tf

from tfsync import ops
from tfsync.engine._tf import compile_flat, copy_values, dense, py_step, state_variable, tf_variable
from tfsync.engine.components.pull import PartialPull
from tfsync.engine.protocols.base import StepProtocol
from tfsync.engine.protocols.compensated import Compensator
from tfsync.engine.protocols.in_graph import GraphRound
from tfsync.engine.protocols.path import (
    ACCUMULATION_AT_ALL_REDUCE,
    OptimizerPath,
    Unscaled,
    check_accumulation,
    is_loss_scaled,
    require_model,
    scaled_for_optimizer,
    skippable_train_step,
    static_loss_scale,
    unscaled_or_zeros,
)


class GradientProtocol(StepProtocol):
    """Push this step's gradients; return the round's sum over its number of fresh
    contributions (its mean; a late, compensated gradient adds on top, see exchange.py)."""

    payload = "gradients"
    describes = "gradients"
    averages = True

    @classmethod
    def check_policy(cls, policy):
        pass  # (open or coordinated rounds alike)

    @classmethod
    def optimizer_path(cls, policy, engine, optimizer=None, station="apply", shared=False):
        if policy.pulls_partially:
            return BlockwiseExchange(policy, engine, optimizer, station, shared)
        if is_loss_scaled(optimizer):  # (it unscales, and skips an overflowed step, itself)
            return LossScaledExchange(policy, engine, optimizer, station, shared)
        path = ExchangeBefore(policy, engine, optimizer, station, shared)
        factor = static_loss_scale(optimizer)
        return Unscaled(path, factor) if factor is not None else path

    def __init__(self, tensors, size, policy=None):
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtypes = [tf.as_dtype(t.dtype) for t in tensors]
        self._zeros = None
        self.mean = None  # the applied round's mean until the step returns it (none under partial pulling)
        specs = [tf.TensorSpec(s, d) for s, d in zip(self.shapes, self.dtypes)]
        self._finite = compile_flat(lambda *g: ops.all_finite(list(g)), specs)
        # open rounds: the round's sum is checked (scale_sum), not each contribution; a
        # coordinated round's contribution is checked before it is offered
        self.checks_sum = policy is not None and not getattr(policy, "coordinated", False)
        self.compensation = None if policy is None else policy.compensate
        if self.compensation is not None:
            # a late gradient is corrected against the weights: they, not gradients, start the engine
            self.variables = [tf_variable(v) for v in tensors]
            with tf.init_scope():
                self.w_stale = [state_variable(tf.zeros_like(v)) for v in self.variables]
            self._compensator = compensator = Compensator(self.compensation, self.variables)
            variables, w_stale = self.variables, self.w_stale

            def compensate(*grads):  # the corrected gradient, then whether each tensor of it is finite
                corrected = compensator(list(grads), variables, w_stale)
                return [*corrected, ops.all_finite(corrected)]

            self._keep_weights = compile_flat(lambda: copy_values(variables, w_stale))
            self._compensate = compile_flat(compensate, specs)

    def bind(self, engine):
        if self.checks_sum:  # an open round's sum is checked, not each contribution
            engine.exchange.sum_check = self

    def keep_weights(self):
        """Snapshot the weights a late gradient was computed on (its ``w_stale``)."""
        self._keep_weights()

    def compensate(self, grads):
        """A late gradient corrected for the current weights (``w_now`` = the variables now),
        and whether each of its tensors is finite: ``(corrected, finite)``."""
        out = self._compensate(*grads)
        return list(out[:-1]), out[-1]

    def absent(self):
        if self._zeros is None:
            with tf.init_scope():
                self._zeros = [tf.zeros(s, d) for s, d in zip(self.shapes, self.dtypes)]
        return self._zeros

    def contribution(self, grads):
        """This step's gradients as they are, and whether each is finite: one read-only pass,
        or ``None`` (not checked here) where the round's sum is checked instead."""
        if self.checks_sum:
            return grads, None
        return grads, self._finite(*grads)

    def scale_sum(self, total, d):
        """An open round's sum divided by its ``d`` contributions, and whether each tensor of
        the sum is finite, from one pass (:func:`tfsync.ops.scale_all_finite`): the division
        Horovod's ``Average`` would make, with the check riding along."""
        scaled, finite = ops.scale_all_finite(total, 1.0 / d)
        return scaled, np.asarray(finite)

    def finite(self, payload):
        """Whether each tensor of this worker's contribution is finite (after a sum was not)."""
        return np.asarray(self._finite(*payload))

    def reject(self, payload):
        """What a rejected contribution sends instead: zeros (the gradients moved nothing yet)."""
        return self.absent()

    def apply_round(self, result):
        self.mean = result.total

    def last_round(self, completed, required):
        return min(completed, required)  # step r's optimizer applies round r's mean, and only it

    def result(self):
        mean, self.mean = self.mean, None  # not held past the step: the optimizer owns it now
        return mean


def exchange_gradients(engine, grads):
    """The gradients every worker applies this step (the round's mean), from one
    ``tf.py_function`` calling the engine (``engine``: a callable returning it; the shapes and
    dtypes, fixed at tracing, are the model's)."""
    protocol = engine().protocol
    grads = dense(grads, protocol.shapes, protocol.dtypes)
    return py_step(lambda *g: engine().sync_step(g), grads, protocol.dtypes, protocol.shapes, "tfsync_step")


class ExchangeBefore(OptimizerPath):
    """The gradients are exchanged before the optimizer, which applies the round's mean.

    Under plain BSP on one host, with the callback, the round runs as in-graph ops
    (:mod:`tfsync.engine.protocols.in_graph`): the path holds that round's variables, as it
    holds the compiled step they are traced into, and :meth:`bind` hands them to each later
    engine it serves.  A step traced without them keeps the Python path for every engine.
    """

    def __init__(self, policy, engine, optimizer=None, station="apply", shared=False):
        super().__init__(policy, engine, optimizer, station, shared)
        self._graph = None  # the in-graph round's variables (made before the step is traced)
        self._traced = False

    def bind(self, engine):
        if self._graph is None and not self._traced and self._serves_in_graph(engine):
            self._graph = GraphRound()  # (a trace that makes variables is traced twice)
        if self._graph is not None:
            self._graph.attach(engine, engine.in_graph)

    def _serves_in_graph(self, engine):
        # auto mode's step serves engines of every gradient mode, and the strategy starts its
        # engine while tracing and raises Horovod's own errors: the Python path
        return engine.in_graph and self.station == "apply" and not self.shared

    def before(self, grads):
        return self._exchange(grads)

    def _exchange(self, tensors):
        """The round's mean of ``tensors`` (the engine's tensors, in its order), traced."""
        engine = self._engine
        self._traced = True
        if self._graph is None:
            return exchange_gradients(engine, tensors)
        protocol = engine().protocol
        tensors = dense(tensors, protocol.shapes, protocol.dtypes)

        def python_round(g):
            return py_step(lambda *x: engine().sync_step(x), g, protocol.dtypes, protocol.shapes, "tfsync_step")

        return self._graph.round(tensors, engine().cluster.wire_ops(), python_round)

    def check_optimizer(self, optimizer, who):
        # each step's gradients are averaged before the optimizer accumulates them, the same
        # update; at the all-reduce, Keras exchanges only the accumulated ones, at update steps
        if self.station == "all_reduce" and self.policy.skips:
            check_accumulation(optimizer, self.policy, who, ACCUMULATION_AT_ALL_REDUCE)

    def serves(self, policy):
        return not policy.pulls_partially and policy.payload == GradientProtocol.payload

    def at_all_reduce(self, values, start):
        if self.engine is None:  # (the engine starts on the first step's gradients)
            start(list(values))
        return super().at_all_reduce(values, start)

    def before_step(self, model, start):
        if self.policy.compensate is not None and self.engine is None:
            # late gradients are corrected against the weights: start from the model's
            start(list(require_model(model, self.policy).trainable_variables))

    def train_step(self, model, step, apply_mean, after=None):
        if not (self.policy.skips or self.shared):
            return step
        # (under auto mode, every gradient mode's step is the skippable one: it never skips under BSP)
        return skippable_train_step(self._engine, require_model(model, self.policy), step, apply_mean)


class LossScaledExchange(ExchangeBefore):
    """The gradient exchange under a ``LossScaleOptimizer``: every rank skips the same steps.

    Its gradients arrive scaled by the loss scale, and a step whose gradients overflowed is
    skipped.  Every rank must skip the same steps, or the replicas' weights, slots and loss
    scales part.  This rank's gradients are pushed unscaled (a late gradient then adds
    correctly to a round of another scale) with one more float, 1 when they overflowed (sent
    as zeros, so no inf or NaN crosses the wire); the round's mean goes back to the optimizer
    scaled again, or as NaN when any rank's overflowed, and every rank's
    ``LossScaleOptimizer`` skips that step and halves its scale, as one optimizer on all the
    gradients would.  A loss scale that is a power of two (Keras' default, and every doubling
    or halving of it) makes unscaling and scaling again exact.  At the all-reduce station the
    path stands at the optimizer's ``apply`` (:attr:`hooks_apply`): its own all-reduce happens
    only for gradients it found finite.
    """

    hooks_apply = True

    def __init__(self, policy, engine, optimizer, station="apply", shared=False):
        super().__init__(policy, engine, optimizer, station, shared)
        self._flag = None  # the overflow flag's spec to the engine: a scalar variable, built on first use

    def _scale(self, dtype):
        return tf.cast(self.optimizer.dynamic_scale, dtype)

    def extra_tensors(self, model=None):
        if self._flag is None:
            with tf.init_scope():  # (a weight to the engine: it never changes)
                self._flag = tf.Variable(0.0, trainable=False, name="tfsync_overflowed")
        return [self._flag]

    def before(self, grads):
        protocol = self.engine.protocol  # (the flag's spec is left out: zip stops at the gradients)
        safe, overflowed = unscaled_or_zeros(dense(grads, protocol.shapes, protocol.dtypes), self._scale)
        out = self._exchange([*safe, tf.cast(overflowed, tf.float32)])
        return self.mean_for_optimizer(out)

    def mean_for_optimizer(self, mean):
        """The round's mean gradients and the overflow flag's mean, as the optimizer takes them."""
        mean = list(mean)
        return scaled_for_optimizer(mean[:-1], mean[-1] > 0, self._scale)


class BlockwiseExchange(ExchangeBefore):
    """PSP's partial pulling: push this step's gradients; the engine applies what arrived of
    the rounds' means block by block through the optimizer (:class:`OptimizerBlocks`).  When
    the step's own round arrived whole, the engine hands that mean back instead and the
    optimizer applies it in the compiled step, as without partial pulling: the common case
    then costs no extra call.  Only the callback drives it (the strategy refuses)."""

    def check_optimizer(self, optimizer, who):
        if self.station != "apply":
            raise ValueError(
                f"{who}(mode=PSP(pull_fraction={self.policy.pull_fraction})): partial pulling applies "
                f"each round block by block through the optimizer, which only tfsync.keras.SyncCallback "
                f"drives (the strategy's optimizer applies every weight at once); use SyncCallback "
                f"with model.fit, or pull_fraction=1.0 here"
            )
        check_blockwise_optimizer(optimizer, self.policy)

    def serves(self, policy):
        return False

    def install(self, optimizer, original, variables):
        pull = self.engine.find(PartialPull)
        pull.applier = OptimizerBlocks(
            optimizer, lambda pairs: original(*map(list, zip(*pairs))), variables, pull.groups
        )

    def apply(self, original, grads, variables):
        engine = self._engine
        protocol = engine().protocol
        grads = dense(grads, protocol.shapes, protocol.dtypes)
        out = py_step(
            lambda *g: engine().sync_step(g), grads, [*protocol.dtypes, tf.bool], [*protocol.shapes, []], "tfsync_step"
        )
        mean, whole = out[:-1], out[-1]

        def applied():
            original(list(mean), variables)  # stateful: the taken branch runs it
            return tf.constant(True)

        return tf.cond(whole, applied, lambda: tf.constant(False))

    def train_step(self, model, step, apply_mean, after=None):
        # the engine applies the rounds itself, block by block: a skipped step applies nothing here
        return skippable_train_step(self._engine, model, step, None) if self.policy.skips else step


class OptimizerBlocks:
    """Partial pulling's applier (:attr:`tfsync.engine.components.pull.BlockPull.applier`): one block of a
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


__all__ = ["GradientProtocol", "OptimizerBlocks", "check_blockwise_optimizer", "exchange_gradients"]
