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

With fragments (``fragments=P``) and ``overlap_steps=τ``, each fragment's
round is paced (:mod:`tfsync.engine.wire.pacing`): its pieces are spread over
:data:`PACED_SHARE` of the time ``τ`` inner steps take (the median of the
last :data:`STEP_WINDOW` inner steps' intervals), so the link carries the
model at about its period's average rate instead of in bursts at line rate.
"""

import collections
import math
import statistics
import time

import keras
import tensorflow as tf

from tfsync import ops
from tfsync.engine._tf import (
    compile_flat,
    state_variable,
    tf_variable,
)
from tfsync.engine.components import StepComponent
from tfsync.engine.protocols.base import StepProtocol
from tfsync.engine.protocols.outer_path import PeriodicAfter
from tfsync.engine.wire import Round

PACED_SHARE = 0.8  # a paced fragment's round spreads over this share of its overlap window ...
STEP_WINDOW = 8  # ... estimated from the median interval of this many last inner steps


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
    def round(cls, policy):
        """With ``quantize`` set, a quantized round (:mod:`tfsync.engine.wire.quantized`)."""
        return Round(averages=cls.averages, quantize=policy.quantize)

    @classmethod
    def optimizer_path(cls, policy, engine, optimizer=None, station="apply", shared=False):
        return PeriodicAfter(policy, engine, optimizer, station, shared)

    @classmethod
    def rest_steps(cls, policy):
        """Every outer step (``inner_steps``), where the weights are ``w_outer`` on every replica;
        None when an overlapped round lands with ``mixing`` (each replica keeps a share of its own)
        or with fragments (each fragment has trained on since its own outer step)."""
        if (policy.overlap_steps and policy.mixing) or getattr(policy, "fragments", 1) > 1:
            return None
        return int(policy.inner_steps)

    def at_rest(self):
        mixed = self.overlap and self.mixing
        return self.inner_done == 0 and not self.pushed and not mixed and self.fragments == 1

    PUSH, LAND = "push", "land"  # what a step does besides the worker's own (end_inner_step)

    def __init__(self, variables, size, policy):
        self.period = int(policy.inner_steps)
        self.overlap = int(policy.overlap_steps)
        self.mixing = float(policy.mixing)
        self.fragments = int(getattr(policy, "fragments", 1))
        self.variables = [tf_variable(v) for v in variables]
        # trainable weights go through the outer optimizer; statistics are averaged plainly
        self.trainable = [bool(getattr(v, "trainable", True)) for v in variables]
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.dtypes = [v.dtype for v in self.variables]
        # the model in pieces (a weight tensor, or a range of its rows), the pieces of each fragment,
        # and (last) every piece: a final round when training ends between two fragments' outer steps
        self.pieces, parts = split_fragments(self.shapes, self.fragments)
        self.parts = parts + [list(range(len(self.pieces)))]
        with tf.init_scope():
            # w_outer: one variable per piece (the outer optimizer's slots follow it)
            self.w_outer = [state_variable(tf.identity(self._read(k))) for k in range(len(self.pieces))]
            self.outer_optimizer = build_outer_optimizer(policy.outer_optimizer_config)
            weights = [w for k, w in enumerate(self.w_outer) if self.trainable[self.pieces[k][0]]]
            if self.outer_optimizer is not None:
                self.outer_optimizer.build(weights)
        self.inner_done = 0  # inner steps of this period, this one included
        self.next_fragment = 0  # the fragment whose outer step comes next in this period
        self.in_flight = collections.deque()  # (overlapped) fragments pushed, not yet landed
        self.sent = collections.deque()  # the part each round not yet applied carries, in round order
        self.all_finite = True  # every inner step since the last push had finite gradients
        self.trained = False  # an inner step was made since the last round of the whole model
        self._intervals = collections.deque(maxlen=STEP_WINDOW)  # seconds between the last inner steps
        self._last_step_end = None
        self._spread_cap = math.inf
        self._spreads = None  # (paced) each pushed round's spread, taken by the exchange in push order
        self._pseudo_gradient, self._apply_mean, self._restart = [], [], []
        for k, part in enumerate(self.parts):
            pseudo_gradient, apply_mean, restart = self._part_functions(part, counts_iteration=k >= self.fragments - 1)
            self._pseudo_gradient.append(compile_flat(pseudo_gradient))
            specs = [tf.TensorSpec(self.w_outer[k].shape, self.w_outer[k].dtype) for k in part]
            self._apply_mean.append(compile_flat(apply_mean, specs))
            self._restart.append(compile_flat(restart))

    def bind(self, engine):
        """Overlapped fragments: the engine's exchange paces their rounds (:meth:`round_spread_s`)."""
        if self.fragments > 1 and self.overlap:
            # (a peer that lands first waits for this worker's last piece: at most a quarter of its bound)
            self._spread_cap = engine.wait_timeout_s / 4
            self._spreads = collections.deque()
            engine.exchange.spread_s = self.round_spread_s

    def round_spread_s(self):
        """The seconds the round starting now may take, as decided when it was pushed
        (:meth:`_spread_at_push`); the exchange thread asks once a round, in push order."""
        return self._spreads.popleft() if self._spreads else None

    def _spread_at_push(self, part):
        """A fragment's round pushed now may take :data:`PACED_SHARE` of ``τ`` inner steps at
        the median interval of the last ones, at most a quarter of the wait bound; None (sent at
        once) before the second inner step and for the last round of the whole model, which
        training waits for at once.  Decided on the training thread at the push, so that every
        rank decides alike (the same steps behind it), whenever its exchange thread starts it."""
        if not self._intervals or part == self.fragments:
            return None
        return min(PACED_SHARE * self.overlap * statistics.median(self._intervals), self._spread_cap)

    def _read(self, k):
        """Piece ``k`` of the model's weights: its tensor, or its rows."""
        i, rows = self.pieces[k]
        return self.variables[i] if rows is None else self.variables[i][rows[0] : rows[1]]

    def _write(self, k, value):
        i, rows = self.pieces[k]
        target = self.variables[i] if rows is None else self.variables[i][rows[0] : rows[1]]
        target.assign(value)

    def _part_functions(self, part, counts_iteration):
        """The pseudo-gradient, the application of a round's mean and the restart of the pieces
        ``part``; the outer optimizer's iteration advances once per period (at the last
        fragment's outer step, and at the final round)."""
        w_outer = [self.w_outer[k] for k in part]
        trainable = [self.trainable[self.pieces[k][0]] for k in part]
        outer, mixing = self.outer_optimizer, self.mixing
        read, write = self._read, self._write

        def pseudo_gradient():
            delta = [w - read(k) for k, w in zip(part, w_outer)]
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
                if counts_iteration:
                    outer.iterations.assign_add(1)
            for w, m, t in zip(w_outer, mean, trainable):
                if outer is None or not t:
                    w.assign_sub(m)
            for k, w in zip(part, w_outer):
                # (overlapped, mixing α: keep that share of the worker's own weights)
                write(k, w if not mixing else w + mixing * (read(k) - w))

        def restart():
            for k, w in zip(part, w_outer):
                write(k, w)

        return pseudo_gradient, apply_mean, restart

    @property
    def pushed(self) -> bool:
        """(overlapped) a contribution of this period is in flight."""
        return bool(self.in_flight)

    def _boundary(self, fragment) -> int:
        """The inner step at which ``fragment``'s outer step lands (its push comes
        ``overlap_steps`` before): the fragments' outer steps are spread evenly over the period."""
        return (fragment + 1) * self.period // self.fragments

    def end_inner_step(self, finite: bool, updated: bool = True):
        """One batch of the worker's optimizer is done (``finite``: its gradients were, so it ran;
        ``updated``: it updated the weights, False for a batch an optimizer with
        ``gradient_accumulation_steps`` only accumulated: the period counts updates).
        What else the step does: :attr:`PUSH` (the frontend calls the engine's ``sync_step``:
        at a fragment's boundary, or ``overlap_steps`` before it), :attr:`LAND` (overlapped: a
        fragment's boundary, the frontend waits for its round and applies it), or None (an
        inner step only)."""
        self.all_finite = self.all_finite and bool(finite)
        if not updated:
            return None
        if self._spreads is not None:  # (paced: time the inner steps)
            now = time.monotonic()
            if self._last_step_end is not None:
                self._intervals.append(now - self._last_step_end)
            self._last_step_end = now
        self.inner_done += 1
        self.trained = True
        if self.in_flight and self.inner_done >= self._boundary(self.in_flight[0]):
            self.in_flight.popleft()
            if self.inner_done >= self.period:
                self.end_period()
            if not self.mixing:  # the steps since the push are dropped when the round lands
                self.all_finite = True
            return self.LAND
        if self.next_fragment < self.fragments and self.inner_done >= self._boundary(self.next_fragment) - self.overlap:
            return self.PUSH
        return None

    def quiet_steps(self, n: int, finite: bool):
        """``n`` inner steps that updated the weights, and any that only accumulated, passed in
        the compiled step without a call (:class:`~tfsync.engine.protocols.outer_path.QuietSteps`;
        none of them had anything else to do); ``finite``: every one's gradients were."""
        self.all_finite = self.all_finite and bool(finite)
        self.inner_done += n
        self.trained = self.trained or n > 0

    def quiet_steps_ahead(self) -> int:
        """How many of the next inner steps that update the weights do nothing else (no push, no
        landing): they may pass in the compiled step without a call.  0 when paced (the inner
        steps are timed)."""
        if self._spreads is not None:
            return 0
        due = [self._boundary(self.in_flight[0])] if self.in_flight else []
        if self.next_fragment < self.fragments:
            due.append(self._boundary(self.next_fragment) - self.overlap)
        return max(0, min(due) - self.inner_done - 1) if due else 0

    def end_period(self):
        """The period's last round is applied: the next period begins."""
        self.inner_done, self.next_fragment = 0, 0
        self.in_flight.clear()

    def contribution(self, inputs):
        """The next fragment's pseudo-gradient ``w_outer - w`` (at the end of training, the whole
        model's) and whether each tensor of it is finite (all false when a gradient since the
        last push was not: those steps were skipped, the contribution is rejected); without
        overlap the period ends with its last fragment."""
        part = self.next_fragment if self.next_fragment < self.fragments else self.fragments
        out = self._pseudo_gradient[part]()
        finite = out[-1] if self.all_finite else tf.zeros_like(out[-1])
        self.all_finite = True
        self.sent.append(part)
        if self._spreads is not None:
            self._spreads.append(self._spread_at_push(part))
        if part < self.fragments:
            self.next_fragment += 1
            if self.overlap:
                self.in_flight.append(part)
            elif self.next_fragment >= self.fragments:
                self.end_period()
        return list(out[:-1]), finite

    def reject(self, payload):
        """A contribution that is not finite goes nowhere: this worker's weights of its fragment go
        back to ``w_outer`` (their period lost), and the round averages the others'; sends zeros."""
        self._restart[self.sent[-1]]()
        return [tf.zeros_like(t) for t in payload]

    def apply_round(self, result):
        """Move ``w_outer`` of the round's fragment by the round's mean and its weights to it
        (overlapped with mixing α: to ``(1 − α)·w_outer + α·w``); a round without a finite
        contribution (every rank rejected) moves nothing."""
        part = self.sent.popleft()
        if not result.present.any():
            self._restart[part]()
            return
        self._apply_mean[part](*result.total)

    def last_round(self, completed, required):
        return min(completed, required)  # outer step k applies round k

    def absent(self):
        return [tf.zeros_like(self.w_outer[k]) for k in self.parts[min(self.next_fragment, self.fragments)]]

    def final_round_due(self) -> bool:
        """Training ends: whether one last round must make the replicas identical: inner steps
        since the last outer step (overlapped and unfragmented, a round in flight lands instead
        and the steps after its push are dropped); with fragments, any step trained (every
        fragment but the period's last has trained on since its outer step)."""
        if self.fragments == 1:
            return bool(self.inner_done) and not self.pushed
        return self.trained

    def push_final(self):
        """The next contribution is the whole model's (:class:`FinalOuterStep`)."""
        self.next_fragment, self.trained = self.fragments, False

    def finish(self):
        """Every round applied: the weights are ``w_outer``, identical on every worker (overlapped:
        the steps since the last push, which an in-flight round has not taken, are dropped, as
        with ``mixing=0`` during training)."""
        self._restart[-1]()


def split_fragments(shapes, fragments: int):
    """The model in ``fragments`` consecutive fragments of about equal size (Streaming DiLoCo's
    fragments are consecutive layers; a dense layer's matrix can hold most of a small model,
    so a tensor is cut between rows where a fragment's share ends): ``(pieces, parts)``, the
    pieces ``(tensor index, None or (first row, end row))`` in order, and the piece indices of
    each fragment.  One fragment: every tensor whole."""
    sizes = [math.prod(s) for s in shapes]
    if fragments == 1:
        return [(i, None) for i in range(len(shapes))], [list(range(len(shapes)))]
    total = sum(sizes)
    pieces, parts, p, filled = [], [[] for _ in range(fragments)], 0, 0
    for i, shape in enumerate(shapes):
        rows = shape[0] if shape else 1
        row_size = sizes[i] // rows if rows else 0
        start = 0
        while start < rows or (start == 0 and not rows):
            end = rows
            if p < fragments - 1 and row_size:
                take = max(1, round((total * (p + 1) / fragments - filled) / row_size))
                end = min(rows, start + take)
            whole = start == 0 and end == rows
            pieces.append((i, None if whole or not shape else (start, end)))
            parts[p].append(len(pieces) - 1)
            filled += (end - start) * row_size
            start = end if rows else 1
            if p < fragments - 1 and filled >= total * (p + 1) / fragments - row_size / 2:
                p += 1
    empty = [p for p, part in enumerate(parts) if not part]
    if empty:
        raise ValueError(
            f"tfsync.DiLoCo(fragments={fragments}): the model's {len(shapes)} weight tensors ({total} values) "
            f"leave fragment(s) {empty} without any; use fewer fragments"
        )
    return pieces, parts


class FinalOuterStep(StepComponent):
    """When training ends with inner steps since the last outer step and none of them pushed,
    one last outer step for them, waited for even when overlapped (every rank has the same
    count: the frontends check every rank runs the same steps), so the replicas end identical.
    A round still in flight was applied by the engine's drain before."""

    def finish(self, apply_mean) -> bool:
        engine, protocol = self.engine, self.engine.protocol
        if protocol.final_round_due():
            protocol.push_final()
            engine.sync_step([])
            engine.wait_and_apply(engine.step - 1)  # (overlapped: the push did not wait for it)
        protocol.end_period()
        return False


__all__ = ["FinalOuterStep", "OuterStepProtocol", "build_outer_optimizer"]
