"""The step protocols a policy can name, and the Horovod collective they use.

A policy names its protocol by ``policy.payload``; the engine builds the
protocol object once, when it starts, as Horovod's ``DistributedOptimizer``
factory decides its exchange once.  Nothing else compares payload strings.

* :class:`GradientProtocol` (``"gradients"``): the raw gradients are pushed
  before the optimizer runs; the round's result is the workers' mean gradient,
  which every worker's optimizer applies (what ``hvd.allreduce`` + optimizer
  does).
* :class:`UpdateProtocol` (``"updates"``): the local optimizer runs first; the
  change it made, ``Δ``, is pushed as the share ``Δ/N`` and the worker goes on
  at ``w̄ + Σ own pending shares``, where ``w̄`` (the sum of every completed
  round, identical on every worker) and the pending sum live in TensorFlow
  variables on the worker's device.
* :class:`CompensatedUpdateProtocol` (``"compensated_updates"``, DC-S3GD): the
  gradient is corrected for the one round it is late
  (:func:`tfsync.ops.delay_compensate`) before the optimizer runs; the change
  the optimizer then made, ``Δ``, is pushed and averaged into ``w̄``.
* :class:`~tfsync.engine.outer.OuterStepProtocol` (``"pseudo_gradients"``, Local SGD and
  DiLoCo): every worker's optimizer runs every step; only every ``H``-th step contributes,
  the change of the weights since the last outer step, averaged and applied (DiLoCo: by an
  outer optimizer) identically on every replica.

The payload never leaves TensorFlow: the frontends hand the tensors to the
engine through ``tf.py_function`` (which passes the tensors themselves, not
NumPy copies), the exchange thread gives them to ``hvd.grouped_allreduce``,
and the update bookkeeping runs as two compiled functions over the variables
(the share by one XLA-fused kernel, a completed round by in-place variable
ops), so no payload-sized buffer crosses NumPy or is allocated per step
beyond the share itself (the in-flight payload).

One grouped call per round, not one flat buffer: Horovod's tensor fusion packs
the group into its fusion buffer anyway (``HOROVOD_FUSION_THRESHOLD``, 128 MiB
by default), so concatenating first and splitting after only adds two payload
copies.

Every contribution comes with whether each of its tensors is finite
(``contribution`` returns ``(payload, finite)``), found where the payload is
built: the update protocol's push kernel says it from the pass that computes
the share; the gradient protocol under open rounds (BSP) says ``None``: the
round's sum is checked instead, by the pass that divides it
(:meth:`GradientProtocol.scale_sum`, see :mod:`tfsync.engine.exchange`);
under coordinated rounds it checks the train step's gradients with one
read-only pass (:func:`tfsync.ops.all_finite`), and so do a late gradient's
correction and DC-S3GD's update, inside the compiled function that computes
them.  The engine rejects a contribution that
is not finite (:mod:`tfsync.engine.nonfinite`): it sends :meth:`reject`'s
zeros instead, and :meth:`reject` first takes back what the contribution
already did to this worker's weights (the update protocols apply their own
update before the exchange), so the replicas stay identical.
"""

import numpy as np
import tensorflow as tf

from tfsync import _horovod, ops
from tfsync.engine.exchange import decode_meta, encode_meta


def tf_variable(v):
    """The ``tf.Variable`` behind a Keras 3 variable (or ``v`` itself)."""
    if isinstance(v, tf.Variable):
        return v
    inner = getattr(v, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(f"tfsync: expected a TensorFlow or Keras variable, got {type(v).__name__}")


def horovod_collective(average: bool, hvd=None):
    """``collective(payload, meta)`` over Horovod: one ``hvd.grouped_allreduce`` per round.

    The payload is averaged by Horovod itself with ``average`` (a post-scale
    in its fusion buffer, as ``hvd.Average`` does for plain Horovod users) or
    summed.  The metadata rides in the same call, encoded as float32 digits
    that survive either reduction exactly (:func:`~tfsync.engine.exchange.encode_meta`):
    a second allreduce for it would cost a second negotiation per round.  A group
    must share one dtype, so a model with several weight dtypes makes one call
    per dtype (the metadata joins the float32 one).

    ``hvd``: ``horovod.tensorflow`` (default: as checked by
    :func:`tfsync._horovod.horovod`), or a stand-in with ``size()``, ``Sum``,
    ``Average`` and ``grouped_allreduce`` (an in-process fake's ranks run this
    very function).
    """
    if hvd is None:
        hvd = _horovod.horovod()
    size = hvd.size()

    def collective(payload, meta, divisor=None):
        # ``divisor``: a sum post-scaled by ``1 / divisor`` in Horovod's fusion buffer (a
        # coordinated round's guess of d, rescaled afterwards if wrong; the final round's d),
        # 1 for the plain sum an open round divides and checks itself (RoundExchange.sum_check)
        op = hvd.Average if average and divisor is None else hvd.Sum
        scale = {} if divisor in (None, 1) else {"postscale_factor": 1.0 / divisor}  # (1: a plain sum)
        groups = {}
        for i, t in enumerate(payload):
            groups.setdefault(t.dtype, []).append(i)
        groups.setdefault(tf.float32, [])
        total = [None] * len(payload)
        for k, (dtype, index) in enumerate(groups.items()):
            tensors = [payload[i] for i in index]
            if dtype == tf.float32:  # (NumPy: the op converts it itself)
                tensors.append(encode_meta(meta))
            outs = hvd.grouped_allreduce(tensors, op=op, name=f"tfsync.round.{k}", **scale)
            for i, o in zip(index, outs):
                total[i] = o
            if dtype == tf.float32:
                wire = outs[-1].numpy()
        return total, decode_meta(wire, size, mean=average and divisor is None, divisor=divisor)

    return collective


class GradientProtocol:
    """Push this step's gradients; return the round's sum over its number of fresh
    contributions (its mean; a late, compensated gradient adds on top, see exchange.py)."""

    payload = "gradients"
    average = True
    reduces_gradients = True  # the frontends exchange before the optimizer runs
    corrects_gradients = False
    periodic = False  # every step is a contribution (the outer-step protocol's are every H-th)
    one_round_per_step = True  # step r's optimizer applies round r's mean, and only it

    @staticmethod
    def components():
        """What the engine adds to its step for this protocol (nothing)."""
        return []

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
                self.w_stale = [_state_variable(tf.zeros_like(v)) for v in self.variables]
            self._compensator = compensator = Compensator(self.compensation, self.variables)
            variables, w_stale = self.variables, self.w_stale

            def compensate(*grads):  # the corrected gradient, then whether each tensor of it is finite
                corrected = compensator(list(grads), variables, w_stale)
                return [*corrected, ops.all_finite(corrected)]

            self._keep_weights = compile_flat(lambda: _copy(variables, w_stale))
            self._compensate = compile_flat(compensate, specs)

    def keep_weights(self):
        """Snapshot the weights a late gradient was computed on (its ``w_stale``)."""
        self._keep_weights()

    def compensate(self, grads):
        """A late gradient corrected for the current weights (``w_now`` = the variables now),
        and whether each of its tensors is finite: ``(corrected, finite)``."""
        out = self._compensate(*grads)
        return list(out[:-1]), out[-1]

    def absent(self):
        """What a rank that contributes nothing to a coordinated round sends (built once)."""
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

    def result(self):
        mean, self.mean = self.mean, None  # not held past the step: the optimizer owns it now
        return mean

    def finish(self):
        pass


class UpdateProtocol:
    """Additive updates with read-my-writes (SSP's model); state in device variables."""

    payload = "updates"
    average = False
    reduces_gradients = False  # the frontends exchange after the optimizer ran
    corrects_gradients = False
    periodic = False
    one_round_per_step = False  # every complete round is added to w̄ at once

    @staticmethod
    def components():
        """What the engine adds to its step for this protocol (nothing)."""
        return []

    def __init__(self, variables, size, policy=None):
        self.variables = [tf_variable(v) for v in variables]
        with tf.init_scope():
            self.w_bar = [
                tf.Variable(tf.identity(v), trainable=False, synchronization=tf.VariableSynchronization.NONE)
                for v in self.variables
            ]
            self.pending = [
                tf.Variable(tf.zeros_like(v), trainable=False, synchronization=tf.VariableSynchronization.NONE)
                for v in self.variables
            ]
        self._size_t = tf.constant(size, tf.float32)
        self._zeros = None
        variables, w_bar, pending, size_t = self.variables, self.w_bar, self.pending, self._size_t
        specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
        n = len(variables)
        # every step pushes a share and applies a round, every barrier settles: compiled once
        # over these variables, each called with tensors only (see compile_flat).  The
        # per-tensor updates are tfsync.ops' one-pass kernels on CPU; where the reference's
        # TensorFlow ops run instead (a GPU, TFSYNC_OPS_IMPL=reference), XLA fuses the push
        # (the apply is in-place variable ops, faster than XLA's allocated results)
        jit = not all(ops.compiled_update_kernels(v) for v in variables)
        self._push_share = compile_flat(lambda: _push_share(variables, w_bar, pending, size_t), jit_compile=jit)
        self._apply_round = compile_flat(lambda *t: _apply_round(variables, w_bar, pending, t[:n], t[n:]), specs * 2)
        self._settle = compile_flat(lambda: _settle(variables, w_bar, pending))
        self._take_back = None  # compiled on the first rejected share

    def absent(self):
        """A skipped step's share: zeros (built once)."""
        if self._zeros is None:
            with tf.init_scope():
                self._zeros = [tf.zeros(v.shape, v.dtype) for v in self.variables]
        return self._zeros

    def settle(self):
        """Nothing in flight (a barrier): the weights become ``w̄`` exactly.

        ``pending`` is zero up to rounding once every own share is subtracted
        again; clearing it makes the replicas bit-identical at the barrier.
        """
        self._settle()

    def contribution(self, inputs):
        """The share ``Δ/N`` of the update the optimizer just made, and whether each tensor of it
        is finite (from the push's own pass, and the step's gradients' when the frontend
        guarded the optimizer: ``inputs``, see :func:`tfsync.engine.tf_bridge.apply_if_finite`);
        moves to ``w̄ + pending``."""
        out = self._push_share()
        finite = out[-1] if not inputs else tf.logical_and(out[-1], inputs[0])
        return list(out[:-1]), finite

    def reject(self, shares):
        """A share that is not finite goes nowhere: take it back out of ``pending`` and move the
        weights to ``w̄ + pending`` again, the weights this step was computed on (the push left
        ``pending`` as it was where the share is not finite; elsewhere the share is subtracted).
        The step's update is lost on this worker as on every other; sends zeros."""
        if self._take_back is None:
            variables, w_bar, pending = self.variables, self.w_bar, self.pending
            specs = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
            self._take_back = compile_flat(lambda *s: _take_back(variables, w_bar, pending, s), specs)
        self._take_back(*shares)
        return self.absent()

    def apply_round(self, result):
        self._apply_round(*result.total, *result.contribution)

    def result(self):
        return []

    def finish(self):
        """Every round applied: the weights become ``w̄``, identical on every worker."""
        for v, w in zip(self.variables, self.w_bar):
            v.assign(w)


def _push_share(variables, w_bar, pending, size):
    # The variables hold L + Δ, where L = w̄ + pending is what the step was
    # computed on (assigned as exactly that sum at the previous step), so the
    # share is recovered without keeping a copy of L.  The shares, then whether each is finite
    pushed = [ops.update_push_share(v, w, p, size, return_finite=True) for v, w, p in zip(variables, w_bar, pending)]
    return [share for share, _ in pushed] + [tf.stack([finite for _, finite in pushed])]


def _take_back(variables, w_bar, pending, shares):
    for v, w, p, share in zip(variables, w_bar, pending, shares):
        p.assign(tf.where(tf.math.is_finite(share), p - share, p))
        v.assign(w + p)


def _settle(variables, w_bar, pending):
    for v, w, p in zip(variables, w_bar, pending):
        p.assign(tf.zeros_like(p))
        v.assign(w)


def _apply_round(variables, w_bar, pending, totals, own_shares):
    for v, w, p, total, own in zip(variables, w_bar, pending, totals, own_shares):
        ops.update_apply_round(v, w, p, total, own)


def compile_flat(fn, specs=(), jit_compile=False):
    """``fn`` (TensorFlow ops over variables it captures and ``len(specs)`` tensor
    arguments) traced once, as a callable taking those tensors positionally.

    A ``tf.function`` call binds its arguments to the traced signature in Python
    every time, and that is most of what a small model's per-step state update
    costs; the concrete function's flat entry point, which TensorFlow itself
    calls once the arguments are bound, skips the binding.  That entry point is
    private (``_call_flat``): where a TensorFlow lacks it, the concrete function
    is called as it is.
    """
    with tf.init_scope():  # (an engine may start while a frontend traces its first step)
        concrete = tf.function(fn, autograph=False, jit_compile=jit_compile).get_concrete_function(*specs)
    call_flat = getattr(concrete, "_call_flat", None)
    if call_flat is None:
        return concrete
    captured = concrete.captured_inputs
    return lambda *tensors: call_flat(list(tensors), captured)


class CompensatedUpdateProtocol:
    """DC-S3GD's step (:class:`tfsync.DCS3GD`): correct the gradient, push the update.

    Two hooks per step.  Before the optimizer, the engine waits for round
    ``t - 1`` and hands its mean update over (:meth:`take_mean`);
    :meth:`correct_in_graph` adds it to ``w̄`` and returns
    ``g̃ = g + λ·g⊙g⊙(w̄ − w_local)``, ``w_local`` being the weights ``g`` was
    computed at.  After the optimizer moved the variables to
    ``w_local + U(g̃)``, :meth:`push_in_graph` takes ``Δ = U(g̃)``, moves the
    variables to ``w̄ + Δ`` and returns ``Δ``, which the engine pushes;
    Horovod averages the round.

    Both hooks are plain TensorFlow ops that the frontends build into the
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
    average = True  # the round's result is the mean update (1/N) Σ_j Δ_j
    reduces_gradients = False  # the update is pushed after the optimizer ran ...
    corrects_gradients = True  # ... on the gradient corrected before it
    periodic = False
    one_round_per_step = True  # step t applies round t - 1: one round per step

    @staticmethod
    def components():
        """What the engine adds to its step for this protocol: the wait before the optimizer."""
        from tfsync.engine.corrections import Corrections

        return [Corrections()]

    def __init__(self, variables, size, policy):
        self.variables = [tf_variable(v) for v in variables]
        self.dtypes = [v.dtype for v in self.variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        with tf.init_scope():
            self.w_bar = [_state_variable(tf.identity(v)) for v in self.variables]
            self.w_local = [_state_variable(tf.identity(v)) for v in self.variables]
            self._no_round = [tf.zeros(v.shape, v.dtype) for v in self.variables]
        self._compensator = Compensator(policy.compensation, self.variables)
        # the correction keeps state (DC-ASGD-a's v) that gradients which are not finite must not reach
        self.stateful_correction = policy.compensation.adaptive
        self._pending = []  # round results applied by the engine, not yet added to w̄

    def apply_round(self, result):
        self._pending.append(result.total)

    def take_mean(self):
        """The mean update of the rounds applied since the last call (zeros: none)."""
        pending, self._pending = self._pending, []
        if not pending:
            return self._no_round
        return [tf.add_n(list(parts)) if len(parts) > 1 else parts[0] for parts in zip(*pending)]

    def correct_in_graph(self, grads, mean, finite=None):
        """``w̄ += mean``; the gradients corrected with ``w_now = w̄``, ``w_stale = w_local``.
        ``finite``: whether each gradient is finite; unless all are, the adaptive correction's
        ``v`` is left alone (the frontend then skips the optimizer, and the update is rejected)."""
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
        ``applied``, from :func:`tfsync.engine.tf_bridge.apply_if_finite`, the gradients' too)."""
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
        return _run(self.correct_in_graph, [tf.convert_to_tensor(g) for g in grads], mean)

    def contribution(self, inputs):
        """``Δ`` and whether each tensor of it is finite: pushed in the train step already
        (``inputs``), or now, eagerly."""
        out = list(inputs) if inputs else _run(self.push_in_graph)
        return out[:-1], out[-1]

    def reject(self, _updates):
        """An update that is not finite goes nowhere: this worker moves back to ``w̄`` (its update
        zero), as every replica's ``w̄`` takes the round without it; sends zeros."""
        for v, w, local in zip(self.variables, self.w_bar, self.w_local):
            v.assign(w)
            local.assign(w)
        return self._no_round

    def result(self):
        return []

    def finish(self):
        """Every round applied: the weights become ``w̄``, identical on every worker."""
        mean = self.take_mean()
        for v, w, local, m in zip(self.variables, self.w_bar, self.w_local, mean):
            w.assign_add(m)
            v.assign(w)
            local.assign(w)


# autograph=False: straight-line code; conversion would only trip over the op loader
@tf.function(autograph=False)
def _run(fn, *args):
    return fn(*args)


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
                [_state_variable(tf.zeros(v.shape, _accumulation_dtype(v.dtype))) for v in variables]
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


def _state_variable(initial):
    return tf.Variable(initial, trainable=False, synchronization=tf.VariableSynchronization.NONE)


def _copy(sources, targets):
    for s, t in zip(sources, targets):
        t.assign(s)


def _accumulation_dtype(dtype):
    return tf.float64 if dtype == tf.float64 else tf.float32


# (imported here, at the end: the outer-step protocol builds on this module's helpers)
from tfsync.engine.outer import OuterStepProtocol  # noqa: E402

PROTOCOLS = {p.payload: p for p in (GradientProtocol, UpdateProtocol, CompensatedUpdateProtocol, OuterStepProtocol)}


def for_policy(policy):
    """The protocol class a policy names (``policy.payload``)."""
    try:
        return PROTOCOLS[policy.payload]
    except KeyError:
        raise ValueError(
            f"tfsync: policy {policy.name!r} names the unknown protocol {policy.payload!r}; "
            f"expected one of {sorted(PROTOCOLS)}"
        ) from None


def dense(tensors, shapes, dtypes):
    """Gradients as dense tensors of the variables' shapes (``None`` becomes zeros)."""
    out = []
    for t, shape, dtype in zip(tensors, shapes, dtypes):
        out.append(tf.zeros(shape, dtype) if t is None else tf.convert_to_tensor(t))
    return out


__all__ = [
    "GradientProtocol",
    "UpdateProtocol",
    "CompensatedUpdateProtocol",
    "OuterStepProtocol",
    "for_policy",
    "horovod_collective",
]
