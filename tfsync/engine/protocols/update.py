"""The update protocol (``"updates"``): SSP's, DSSP's and ElasticBSP's step.

Additive updates with read-my-writes (SSP's model, Ho et al. 2013): the local
optimizer runs first; the change it made, ``Δ``, is pushed as the share ``Δ/N``
and the worker goes on at ``w̄ + Σ own pending shares``, where ``w̄`` (the sum
of every completed round, identical on every worker) and the pending sum live
in TensorFlow variables on the worker's device.  The bookkeeping runs as two
compiled functions over the variables (the share by one fused kernel, a
completed round by in-place variable ops), so no payload-sized buffer crosses
NumPy or is allocated per step beyond the share itself.

The optimizer path (:class:`PushAfter`): the optimizer runs on this worker's
own gradients, only on finite ones (a NaN in its slots would poison every later
update of this worker), then one ``tf.py_function`` pushes the share.
"""

import tensorflow as tf

from tfsync import ops
from tfsync.engine._tf import compile_flat, gradients_finite, state_variable, tf_variable
from tfsync.engine.protocols.base import StepProtocol
from tfsync.engine.protocols.path import (
    OptimizerPath,
    finish_in_graph,
    is_loss_scaled,
    require_model,
    skippable_train_step,
)


class UpdateProtocol(StepProtocol):
    """Additive updates with read-my-writes (SSP's model); state in device variables."""

    payload = "updates"
    describes = "update"

    @classmethod
    def optimizer_path(cls, policy, engine, optimizer=None, station="apply", shared=False):
        return PushAfter(policy, engine, optimizer, station, shared)

    def __init__(self, variables, size, policy=None):
        self.variables = [tf_variable(v) for v in variables]
        with tf.init_scope():
            self.w_bar = [state_variable(tf.identity(v)) for v in self.variables]
            self.pending = [state_variable(tf.zeros_like(v)) for v in self.variables]
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
        is finite (from the push's own pass, and the step's gradients' when the path guarded the
        optimizer: ``inputs``); moves to ``w̄ + pending``."""
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


def push_after_update(engine, variables, applied=None):
    """After the local optimizer step, push its share and move the weights (``engine``: a
    callable returning it).

    The engine reads and writes the variables in place.  The step's
    ``py_function`` must run after the optimizer's writes: it takes each
    variable's shape, read through the variable's handle, as input, and
    TensorFlow orders every op on a variable's handle in program order.  (It
    does not take the values: a live read would make the engine's in-place
    writes copy the buffer first.)  ``applied``: the path's guard (the optimizer
    did not run unless every flag is true): a contribution whose gradients were
    not finite is rejected.
    """
    after_update = [tf.raw_ops.VariableShape(input=tf_variable(v).handle) for v in variables]
    if applied is None:
        return tf.py_function(lambda *_: engine().sync_step([]), after_update, Tout=[], name="tfsync_step")
    return tf.py_function(lambda a, *_: engine().sync_step([a]), [applied, *after_update], Tout=[], name="tfsync_step")


class PushAfter(OptimizerPath):
    """The optimizer runs on this worker's own gradients (finite ones only: a skipped step's
    contribution is rejected), then the update it made is pushed.  Under a
    ``LossScaleOptimizer`` its own decision stands: it skips an overflowed step itself, which
    then pushes no update, and each worker's loss scale follows its own gradients."""

    def guard(self, to_apply):
        return None if is_loss_scaled(self.optimizer) else gradients_finite(to_apply)

    def after(self, variables, applied):
        push_after_update(self._engine, variables, applied)

    def after_step(self, updated, applied, start):
        start(list(updated))  # (the engine starts on the variables the first step updated)
        self.after(updated, applied)

    def train_step(self, model, step, apply_mean, after=None):
        if not self.policy.skips:  # (ElasticBSP skips the steps before its chosen ones)
            return step
        if after is not None:  # the update is pushed in the branch that computes, never on a skip

            def step_then_push(data):
                out = step(data)
                after()
                return out

            return skippable_train_step(self._engine, require_model(model, self.policy), step_then_push, None)
        return skippable_train_step(self._engine, model, step, None)

    def before_other_step(self):
        engine = self.engine
        return [] if engine is None else [finish_in_graph(engine)]


__all__ = ["PushAfter", "UpdateProtocol", "push_after_update"]
