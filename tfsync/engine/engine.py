"""The sync engine: one per worker process; clocks, rounds, waits, counters, faults.

The engine runs numbered rounds for every mode alike.  Its policy
(:mod:`tfsync.policies`) says which round must be complete before a worker
passes the synchronization point of a step; the round exchange
(:mod:`tfsync.engine.exchange`, a communication thread over
``hvd.grouped_allreduce``) runs the rounds, and the control path
(:mod:`tfsync.control`) carries clocks, losses and rank 0's
decisions.  Everything it takes from its peers goes through one injected
cluster object (:mod:`tfsync.engine.cluster`): Horovod in production, N
ranks on threads in the single-process tests.

The engine takes a resolved policy and checked settings
(:class:`~tfsync.engine.settings.EngineSettings`); four things are decided
once, when it starts, as Horovod's ``DistributedOptimizer`` factory decides
its exchange once: the step protocol the policy names
(:mod:`tfsync.engine.protocols`: what a worker contributes and what a completed
round does to its weights), the wire that protocol's round asks for
(:mod:`tfsync.engine.wire`), the round entry (:mod:`tfsync.engine.entry`: every
worker enters every round, or rank 0's coordinator closes rounds) and the step
components (:mod:`tfsync.engine.components`: what only its protocol or its mode
does to a step).  What it starts is owned by one object (:mod:`tfsync.engine.lifecycle`).

A step runs as one :meth:`SyncEngine.sync_step`, called from inside the compiled train step
by the protocol's optimizer path (:mod:`tfsync.engine.protocols.path`) with the tensors
themselves, or in the compiled step alone where nothing needs the engine's Python (BSP's round,
:mod:`tfsync.engine.protocols.in_graph`; Local SGD's and DiLoCo's quiet inner steps), folded in
whenever the engine's state is read (:meth:`SyncEngine.catch_up`).  A step whose round closed
without this worker is skipped (:meth:`SyncEngine.begin_step`, :meth:`SyncEngine.skip_step`);
Local SGD's and DiLoCo's steps between two contributions are the worker's own
(:meth:`SyncEngine.local_step`).  A contribution with a NaN or an infinity never reaches a round
(:mod:`tfsync.engine.nonfinite`).  Per worker, ``produced`` = ``applied`` + ``compensated`` +
``dropped`` + ``rejected`` + ``lost`` (and ``skipped`` steps), counted once
(:mod:`tfsync.engine.tally`) and checked when training finishes.
"""

import contextlib
import functools
import time

from tfsync import _env
from tfsync.engine import lifecycle
from tfsync.engine.diagnosis import Diagnosis
from tfsync.engine.settings import EngineSettings
from tfsync.engine.tally import COUNTS, Tally, Trace, round_stamps, settled_fields
from tfsync.policies import Policy

WAIT_TIMEOUT_ENV = _env.WAIT_TIMEOUT_S.name
WAIT_POLL_S = 1.0  # a waiting worker checks the control path (losses, stops, its deadline) this often


class SyncEngine:
    """Synchronization engine of one worker.

    Args:
        policy: the mode, resolved (a policy object such as ``tfsync.SSP(staleness=3)``;
            :func:`tfsync.policies.resolve` turns a name into one).
        settings: an :class:`~tfsync.engine.settings.EngineSettings`, checked when it was built
            (default: ``EngineSettings()``, from the environment).
        cluster: what the engine takes from its peers (see :mod:`tfsync.engine.cluster`).
            Default ``None``: :class:`~tfsync.engine.cluster.HorovodCluster`, built
            by :meth:`start`.  Tests and simulators pass N in-process ranks instead.

    Example:

        engine = SyncEngine(tfsync.PSP(), EngineSettings(trace_dir="traces"))   # Horovod's ranks
        engine.start(model.trainable_variables)
    """

    WAIT_TIMEOUT_ENV = WAIT_TIMEOUT_ENV

    def __init__(self, policy, settings=None, *, cluster=None):
        if not isinstance(policy, Policy):
            raise TypeError(
                f"tfsync.engine.SyncEngine: policy must be a resolved mode (a tfsync.policies.Policy), got "
                f"{policy!r}; pass e.g. tfsync.policies.resolve({policy!r}) or tfsync.BSP()"
            )
        settings = settings if settings is not None else EngineSettings()
        if not isinstance(settings, EngineSettings):
            raise TypeError(
                f"tfsync.engine.SyncEngine: settings must be a tfsync.engine.EngineSettings, got "
                f"{type(settings).__name__}; pass e.g. EngineSettings(wait_timeout_s=60)"
            )
        self.policy, self.settings = policy, settings
        self.on_nonfinite, self.elastic = settings.on_nonfinite, settings.elastic
        self.stragglers, self.trace_dir = settings.stragglers, settings.trace_dir
        self.wait_timeout_s = settings.wait_timeout_s
        self._cluster = cluster
        self.started = False
        self.error = None
        self.life = lifecycle.Life(self)  # what it starts, stopped together (tfsync.engine.lifecycle)
        self._trace = self.life.trace
        self.tally = Tally()  # (an engine whose start failed counts nothing: an elastic reset folds it)
        # BSP's round in-graph (decided at start), run by the path's GraphRound (tfsync.engine.protocols.in_graph)
        self.in_graph, self.graph, self._last = False, None, {}

    # ----------------------------------------------------------------- lifecycle
    def start(self, tensors, extra_config=None):
        """Check the job, agree on t0, start the control path, the exchange and the protocol
        (:func:`tfsync.engine.lifecycle.start`).

        ``tensors``: the model's trainable variables (in the order the
        optimizer sees them), already identical on every rank.  A gradient
        protocol needs only their shapes and dtypes (symbolic gradients do);
        an update protocol keeps its state beside the variables themselves.
        """
        config = lifecycle.start(self, list(tensors), extra_config)
        # an inline round that waits reports this worker's clock, as the polling wait does
        self.exchange.on_inline_wait = lambda: self.control.report(self.last_pushed, min_interval_s=0.0, waiting=True)
        # rounds run inline (on the training thread) only on one host: across hosts a collective can
        # hang in a Gloo transfer to a cut-off or frozen host, which the watchdog's abort cannot end
        self._inline_rounds = len(set(self.hosts)) == 1
        self._diagnosis = Diagnosis.of(self, WAIT_TIMEOUT_ENV)
        self.delays = self.stragglers.for_rank(self.rank)
        self.step, self.last_pushed, self.applied_through = 0, -1, -1
        self._full_round_times = None
        self._trace = self.life.trace = Trace(self.trace_dir, self.rank)
        self.trace({"event": "start", "rank": self.rank, "size": self.size, "t0": self.t0, **config})
        for c in self.components:
            c.bind(self)
        self.started = True
        self._t_step_start = self.now()

    def find(self, kind):
        """The component of class ``kind`` (e.g. :class:`tfsync.engine.components.pull.PartialPull`), or None."""
        return next((c for c in self.components if isinstance(c, kind)), None)

    def epoch_logs(self) -> dict:
        """What the components add to the epoch logs (:meth:`StepComponent.epoch_logs
        <tfsync.engine.components.base.StepComponent.epoch_logs>`), by name."""
        return {name: value for c in self.components for name, value in c.epoch_logs().items()}

    @property
    def counts(self) -> dict:
        """The whole run's contribution counts (:data:`COUNTS`)."""
        self.catch_up()
        return self.tally.counts

    @property
    def bytes(self) -> dict:
        """This engine's bytes on the wire so far (:mod:`tfsync.engine.wire.counting`'s model)."""
        self.catch_up()
        return self.wire.bytes.total

    @property
    def totals(self) -> dict:
        """This epoch's counts, steps, compute and wait seconds."""
        self.catch_up()
        return self.tally.totals

    @property
    def last(self) -> dict:
        """The last step's wait, compute and what it settled (the callback logs some per batch)."""
        return self.graph.last(self) if self.graph is not None else self._last

    def catch_up(self):
        """Bring the step number, counts and totals up to the steps that ran in-graph (between steps)."""
        if self.graph is not None:
            self.graph.fold(self)

    def reset_totals(self):
        """Zero the totals (per epoch); ``counts`` keeps the whole run's."""
        self.catch_up()
        self.tally.reset_totals()

    def finish(self, apply_mean=None):
        """Wait for every pushed round and apply it (eager; identical weights on every rank).

        Then every contribution this worker produced has been applied, compensated, dropped or
        rejected: checked, so nothing is lost silently.  ``apply_mean``: how to apply one more mean
        gradient through the optimizer (the frontends pass it; collective: on every rank or on
        none); components that hold late contributions use it for a final round, else drop them.
        """
        self.catch_up()
        if self.applied_through < self.step - 1:  # the rounds still in flight: waited for, recorded
            self._apply_between_steps(self.step - 1, "finish")
        drained = False
        for c in self.components:
            drained = c.finish(apply_mean) or drained
        drained = self.entry.drain() or drained
        drops = self.tally.settle(self.exchange)  # (and what the components counted: a final round's rejection)
        sent = self.tally.add_bytes(self.wire.bytes.take())  # (the rounds since the last step's, a final one's)
        if drained:
            self.trace({"event": "drain", "rank": self.rank, "t": self.now(), "drops": drops, "dropped": len(drops)})
        if any(sent.values()):
            self.trace({"event": "bytes", "rank": self.rank, "t": self.now(), **sent})
        self.protocol.finish()
        self.tally.check(self.rank)

    def close(self):
        """Leave the control path and stop the threads (collective: call on every rank;
        :meth:`Life.close <tfsync.engine.lifecycle.Life.close>`)."""
        if not self.started:
            return
        if self.graph is not None:
            self.graph.leave(self)
        self.started = False
        self.life.close()

    def abandon(self, leave=True):
        """Leave without :meth:`close`'s handshake with the other ranks (local, bounded): for an
        engine still running when the interpreter exits (see :meth:`Life.abandon
        <tfsync.engine.lifecycle.Life.abandon>`)."""
        if self.life.running:
            if self.graph is not None:
                self.graph.leave(self)
            self.started = False
            self.life.abandon(leave=leave)

    def job_went_on(self) -> bool:
        """Whether the job no longer waits for this worker (a peer's stop, a lost rank, rank 0
        unreachable), as the control path has pushed it: no call, for any thread
        (:meth:`ControlClient.job_went_on`); False before the engine started."""
        control = getattr(self, "control", None)
        return control is not None and control.job_went_on()

    def at_rest(self) -> bool:
        """Whether this worker's weights hold every round it pushed and nothing else: where every
        worker is at rest after the same step the replicas are identical (:mod:`tfsync.keras.commits`)."""
        self.catch_up()
        done = self.applied_through >= self.step - 1 and self.protocol.at_rest()
        return done and all(c.at_rest() for c in self.components)

    rest_steps = staticmethod(lifecycle.rest_steps)

    def lose_in_flight(self, reason: str) -> int:
        """After a failure that ends this engine unfinished (elastic training resets): count this
        worker's contributions that were produced and never settled (in flight in a round that
        will not complete) as ``lost``, trace it, and abandon the engine.  Returns how many."""
        try:
            self.catch_up()
            self.tally.settle(self.exchange)
        except Exception:  # noqa: BLE001 - the exchange may be half torn down: its drops are gone too
            pass
        lost = self.tally.lose_unsettled()
        self.trace(
            {"event": "reset", "rank": self.rank, "t": self.now(), "step": self.step, "lost": lost, "reason": reason}
        )
        self.abandon(leave=False)  # (every member resets: no one to leave)
        return lost

    # ------------------------------------------------------------------- the step
    def begin_step(self) -> bool:
        """Whether this step computes: False when its round already closed without this
        worker or the policy's components say it skips; the frontend then calls :meth:`skip_step`."""
        with self.guard():
            self._check_started()
            if not self.entry.computes(self.step):
                return False
            return all(c.computes(self.step) for c in self.components)

    def sync_step(self, inputs):
        """One step's synchronization: push, wait for the policy's round, apply what completed.

        ``inputs``: this step's gradients (gradient protocol) or nothing (update
        protocol: the optimizer already ran).  Returns the protocol's result:
        the mean gradients, or nothing (the weights were moved in place).
        """
        with self.guard():
            self._check_started()
            self.catch_up()  # (a step the in-graph round redoes here: its sum was not finite)
            before = [w for w in (c.before_push(self.step) for c in self.components) if w is not None]
            if not before:
                self.delays.sleep()  # (a component that waited before the push slept already)
            step, t_start = self.step, self._t_step_start
            payload, rejected = self.nonfinite.screen(step, *self.protocol.contribution(list(inputs)))
            t_push = self.now()
            compute_s = t_push - t_start
            required = self.policy.sync_round(step)
            inline = self._inline_rounds and required >= step and not any(c.runs_ahead(step) for c in self.components)
            for c in self.components:
                compute_s = c.interval(step, compute_s)
            self.last_pushed = step  # (before an inline round: its watchdog reports this clock)
            self.entry.push(step, payload, t_push, compute_s, inline, rejected)
            self.nonfinite.pushed()  # (on_nonfinite="raise": a rejected one stops the job, its round pushed)
            for c in self.components:
                required = c.required(step, required)
            self.tally.add("produced")
            self.control.report(step)
            applied = self.wait_and_apply(required, hand_back=True)
            waited_s, applied_before = before[0] if before else (0.0, [])
            self._end_step(step, t_start, t_push, applied_before + applied, waited_before_push_s=waited_s)
            result = self.protocol.result()
            for c in self.components:
                result = c.result(result)
            return result

    def local_step(self, required_round=None):
        """A step that computes without contributing (an inner step of Local SGD or DiLoCo, whose
        step protocol says only every ``H``-th step contributes): this rank's simulated compute
        delay.  It enters no round and is no contribution; its time counts into the next
        contribution's compute time (the engine's steps are the contributing ones).

        ``required_round``: a round this step must apply first (DiLoCo's overlapped outer step
        lands here), waited for (bounded, as every wait), counted and traced (an ``apply``
        event); None: none."""
        with self.guard():
            self._check_started()
            self.delays.sleep()
            if required_round is None or required_round <= self.applied_through:
                return
            self._apply_between_steps(required_round, "apply")

    def skip_step(self):
        """A skipped step: no contribution; wait for its round and return its result."""
        with self.guard():
            self._check_started()
            step, t_start = self.step, self._t_step_start
            if self.entry.skip(step):
                self.last_pushed = step
            required = None
            for c in self.components:
                answer = c.skip(step)
                required = answer if answer is not None else required
            if required is None:
                required = self.policy.sync_round(step)
            applied = self.wait_and_apply(required)
            self._end_step(step, t_start, t_start, applied, skipped=True)
            return self.protocol.result()

    # ---------------------------------------------------- what components may use
    def now(self) -> float:
        """Seconds since the job's t0 (the same clock on every rank)."""
        return time.time() - self.t0

    @property
    def tracing(self) -> bool:
        return self._trace.enabled

    def trace(self, record: dict) -> None:
        """One line of this worker's JSON-lines trace (nothing without ``trace_dir``)."""
        self._trace.write(record)

    def stop(self, error):
        """Tell every worker why this one stops; returns ``error`` to raise."""
        return self._diagnosis.stop(error)

    def call(self, fn, timeout_s: float, what: str):
        """Run ``fn``, a collective (``what``, in words), on the exchange thread after every queued
        round, within ``timeout_s``, its wait watched and its failure explained as a round's are
        (:class:`~tfsync.engine.diagnosis.Diagnosis`); its own bound is the caller's (run_bounded)."""
        watch = functools.partial(self._diagnosis.watch_call, self, what=what)
        return self._diagnosis.explained(lambda: self.exchange.call(fn, timeout_s, watch=watch), what)

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def guard(self):
        # TensorFlow re-wraps exceptions raised inside tf.py_function; keep the
        # original so the frontends can re-raise it with its type.
        try:
            yield
        except Exception as exc:
            self.error = exc
            raise

    def _check_started(self):
        if not self.started:
            raise RuntimeError("tfsync: the engine is not started (SyncCallback.on_train_begin starts it)")

    def wait_and_apply(self, required_round, hand_back=False):
        """Wait (bounded) until ``required_round`` is complete, then apply every complete round.

        ``hand_back``: the step may return its own round whole (partial pulling)."""
        if required_round > self.exchange.completed:
            self._wait_round(required_round)
        applied = []
        last = self.protocol.last_round(self.exchange.completed, required_round)
        for r in range(self.applied_through + 1, last + 1):
            res = self.exchange.pop(r)
            for c in self.components:
                c.before_apply(res)
            if not any(c.apply(res) for c in self.components):
                self.protocol.apply_round(res)
                self.delays.sleep_for_round(len(self.shapes))  # (simulated slow pulls)
            # the contributions' stamps are for the trace only: not computed without one
            applied.append((r, res.contributors, round_stamps(res) if self._trace.enabled else None))
            if res.present.all():  # every rank's time for round r, the same table on every rank
                self._full_round_times = res.compute_s  # (the round's own decoded array: no copy)
            self.tally.count_round(res, self.rank, self.components)
            self.applied_through = r
            for c in self.components:
                c.after_apply(res)
        for c in self.components:
            c.rounds_applied(required_round, hand_back)
        return applied

    def _apply_between_steps(self, required_round, event):
        """Wait for ``required_round`` and apply the rounds up to it outside a step (its wait
        counted, what settled traced as an ``event``)."""
        t = self.now()
        applied = self.wait_and_apply(required_round)
        self.tally.totals["wait_s"] += (wait_s := self.now() - t)
        drops, compensated = self.tally.settle_step(self.exchange)
        if self.tracing:
            settled = settled_fields(applied, self.step - 1, self.applied_through, drops, compensated)
            self.trace({"event": event, "rank": self.rank, "t": t, "wait_s": wait_s, **settled})

    def _wait_round(self, round_):
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            try:
                done = self.exchange.wait(round_, min(WAIT_POLL_S, max(deadline - time.monotonic(), 0.0)))
            except Exception as exc:  # the collective failed: find out who is gone
                if self.exchange.inline_expired is not None:  # no: its inline wait reached the bound
                    self.control.report(self.last_pushed, min_interval_s=0.0, waiting=True)
                    raise self.stop(self._diagnosis.timeout_error(self.exchange.inline_expired)) from exc
                raise self.stop(self._diagnosis.lost_error(round_, exc)) from exc
            if done:
                return
            self._diagnosis.check_while_waiting(round_, self.last_pushed, deadline)

    def _end_step(self, step, t_start, t_push, applied, skipped=False, waited_before_push_s=0.0):
        t_end = self.now()
        compute_s = t_push - t_start - waited_before_push_s
        wait_s = t_end - t_push + waited_before_push_s
        self.tally.add("skipped", int(skipped))
        drops, compensated = self.tally.settle_step(self.exchange)
        round_times, self._full_round_times = self._full_round_times, None
        self._last = {
            "wait_s": wait_s,
            "compute_s": compute_s,
            # every rank's compute time for the last round applied in this step that took every
            # rank (replicated metadata: identical on every rank), or None
            "round_compute_s": round_times,
            # staleness of a contribution: steps between its round and the step that next uses it
            "staleness": max((step - r for r, _, _ in applied), default=0),
            "applied": sum(n for _, n, _ in applied),
            "dropped": len(drops),
            "compensated": compensated,
            "skipped": int(skipped),
        }
        sent = self.tally.add_bytes(self.wire.bytes.take())
        self._last.update(sent)
        tot = self.tally.totals
        tot["steps"] += 1
        tot["compute_s"] += compute_s
        tot["wait_s"] += wait_s
        extra = {}
        for c in self.components:
            extra.update(c.end_step(step, wait_s, skipped))
        if self.tracing:  # (the record is built only for a trace: every step runs this)
            times = {"t_start": t_start, "t_push": t_push, "t_end": t_end, "compute_s": compute_s, "wait_s": wait_s}
            settled = settled_fields(applied, step, self.applied_through, drops, compensated)
            self.trace({"rank": self.rank, "step": step, **times, **settled, "skipped": skipped, **sent, **extra})
        self.step = step + 1
        self._t_step_start = t_end


__all__ = ["COUNTS", "SyncEngine"]
