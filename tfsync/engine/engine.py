"""The sync engine: one per worker process; clocks, rounds, waits, counters, faults.

The engine runs numbered rounds for every mode alike.  Its policy
(:mod:`tfsync.policies`) says which round must be complete before a worker
passes the synchronization point of a step; the round exchange
(:mod:`tfsync.engine.exchange`, a communication thread over
``hvd.grouped_allreduce``) runs the rounds, and the control path
(:mod:`tfsync.engine.control`) carries clocks, losses and rank 0's
decisions.  Everything it takes from its peers goes through one injected
cluster object (:mod:`tfsync.engine.cluster`): Horovod in production, N
ranks on threads in the single-process tests.

Three things are decided once, when the engine starts, as Horovod's
``DistributedOptimizer`` factory decides its exchange once:

* the step protocol the policy names (:mod:`tfsync.engine.protocols`): what a
  worker contributes (gradients before the optimizer, or its update after)
  and what a completed round does to its weights;
* the round entry (:mod:`tfsync.engine.entry`): every worker enters every
  round, or rank 0's coordinator closes rounds on the policy's decision;
* the policy's components (:mod:`tfsync.engine.components`): what only its
  mode does to a step (DSSP's grants, ElasticBSP's supersteps, partial
  pulling, late contributions).

A step runs as one :meth:`SyncEngine.sync_step`, called from inside the
compiled train step (:mod:`tfsync.engine.tf_bridge`) with the tensors
themselves: the payload never crosses NumPy.  When a step's round already
closed without this worker, :meth:`SyncEngine.begin_step` says so and the
frontends skip its computation (:meth:`SyncEngine.skip_step`).

Every contribution is accounted for, per worker (:mod:`tfsync.engine.tally`):
``produced`` = ``applied`` + ``compensated`` + ``dropped``, checked when
training finishes; steps that computed nothing are ``skipped``.  All five
are in the totals, the Keras logs and the trace.
"""

import contextlib
import json
import os
import time

import numpy as np

from tfsync import _env
from tfsync.engine import protocols, startup
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.control import ControlClient
from tfsync.engine.diagnosis import Diagnosis
from tfsync.engine.entry import CoordinatedRounds, OpenRounds
from tfsync.engine.exchange import RoundExchange
from tfsync.engine.tally import COUNTS, Tally
from tfsync.policies import resolve
from tfsync.stragglers import Stragglers

WAIT_TIMEOUT_ENV = _env.WAIT_TIMEOUT_S.name
DEFAULT_WAIT_TIMEOUT_S = float(_env.WAIT_TIMEOUT_S.default)
WAIT_POLL_S = 1.0  # a waiting worker checks the control path (losses, stops, its deadline) this often
ABANDON_JOIN_S = 2.0  # at exit, how long an unclosed engine waits for its communication thread


class SyncEngine:
    """Synchronization engine of one worker.

    Args:
        mode: ``"bsp"``, ``"ssp"`` or a policy object (``tfsync.SSP(staleness=3)``).
        stragglers: a :class:`tfsync.Stragglers`; default: from ``TFSYNC_STRAGGLERS``
            (off when unset).
        trace_dir: directory for the JSON-lines trace, one ``rank<R>.jsonl`` per
            worker; ``None`` (default) writes no trace.
        wait_timeout_s: bound on any single wait for peers (default 120 s, or
            ``TFSYNC_WAIT_TIMEOUT_S``); past it the engine raises
            :class:`SyncTimeoutError` naming the ranks that are behind.
        cluster: what the engine takes from its peers (see :mod:`tfsync.engine.cluster`).
            Default ``None``: :class:`~tfsync.engine.cluster.HorovodCluster`, built
            by :meth:`start`.  Tests and simulators pass N in-process ranks instead.

    Example::

        engine = SyncEngine("psp", trace_dir="traces")   # Horovod's ranks
        engine.start(model.trainable_variables)
    """

    WAIT_TIMEOUT_ENV = WAIT_TIMEOUT_ENV

    def __init__(self, mode="bsp", *, stragglers=None, trace_dir=None, wait_timeout_s=None, cluster=None):
        self.policy = resolve(mode)
        if stragglers is None:
            stragglers = Stragglers.from_env()
        if not isinstance(stragglers, Stragglers):
            raise TypeError(f"stragglers must be a tfsync.Stragglers, got {type(stragglers).__name__}")
        self.stragglers = stragglers
        self.trace_dir = trace_dir
        if wait_timeout_s is None:
            raw = _env.WAIT_TIMEOUT_S.get()
            try:
                wait_timeout_s = float(raw)
            except ValueError:
                raise ValueError(
                    f"{WAIT_TIMEOUT_ENV}={raw!r} is not a number of seconds; set it "
                    f"to e.g. {int(DEFAULT_WAIT_TIMEOUT_S)} or unset it"
                ) from None
        if not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s={wait_timeout_s!r} must be a positive number of seconds")
        self.wait_timeout_s = float(wait_timeout_s)
        self._cluster = cluster
        self.started = False
        self.error = None
        self._server = None
        self._trace = None

    # ----------------------------------------------------------------- lifecycle
    def start(self, tensors, extra_config=None):
        """Check the job, agree on t0, start the control path, the exchange and the protocol.

        ``tensors``: the model's trainable variables (in the order the
        optimizer sees them), already identical on every rank.  A gradient
        protocol needs only their shapes and dtypes (symbolic gradients do);
        an update protocol keeps its state beside the variables themselves.
        """
        self.cluster = cluster = self._cluster if self._cluster is not None else HorovodCluster()
        tensors = list(tensors)
        if not tensors:
            raise ValueError("tfsync: the model has no trainable weights to synchronize")
        self.rank, self.size = cluster.rank(), cluster.size()
        policy = self.policy
        policy.validate(self.size)
        self.protocol_cls = protocols.for_policy(policy)
        self.entry = (CoordinatedRounds if policy.coordinated else OpenRounds)(self)
        self.shapes = [[int(d) for d in t.shape] for t in tensors]
        self.num_params = int(sum(np.prod(s, dtype=np.int64) for s in self.shapes))
        self.components = list(policy.components())
        for c in self.components:  # the model against the mode's settings, before any collective
            c.plan(self.shapes, self.num_params)
        config = {
            "policy": policy.config(),
            "num_params": self.num_params,
            "weights": self.shapes,
            "stragglers": self.stragglers.spec(),
            **(extra_config or {}),
        }
        startup.agree_config(cluster, config)
        self.t0 = startup.agree_t0(cluster)
        self._server, address, token = startup.open_control(self, cluster)
        options = self.entry.exchange_options()
        for c in self.components:
            options.update(c.exchange_options())
        # the exchange first: a frontend may route the protocol's variable creation
        # (SyncStrategy broadcasts initial values) through it
        self.exchange = RoundExchange(
            cluster.collective(self.protocol_cls.average),
            self.rank,
            self.size,
            self.t0,
            abort=getattr(cluster, "abort", None),
            **options,
        )
        self.protocol = self.protocol_cls(tensors, self.size, policy)
        self.control = ControlClient(address, self.rank, token, on_close=self.entry.on_close())
        # an inline round that waits reports this worker's clock, as the polling wait does
        self.exchange.on_inline_wait = lambda: self.control.report(self.last_pushed, min_interval_s=0.0)
        self._diagnosis = Diagnosis(self.control, self.rank, policy.name, self.wait_timeout_s, WAIT_TIMEOUT_ENV)
        self.delays = self.stragglers.for_rank(self.rank)
        self._slow_pulls = bool(self.stragglers.pull_prob and self.stragglers.pull_s)
        self.step, self.last_pushed, self.applied_through = 0, -1, -1
        self._corrected_rounds = set()  # own contributions whose gradient was delay-compensated
        self._corrected_wait = None  # (wait_s, applied) of this step's correction, until its push
        self.tally = Tally()
        self.last = {}
        self._full_round_times = None
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            self._trace = open(os.path.join(self.trace_dir, f"rank{self.rank}.jsonl"), "w")
            self.trace({"event": "start", "rank": self.rank, "size": self.size, "t0": self.t0, **config})
        for c in self.components:
            c.bind(self)
        self.started = True
        self._t_step_start = self.now()

    def find(self, kind):
        """The policy's component of class ``kind`` (e.g. :class:`tfsync.engine.pull.PartialPull`), or None."""
        return next((c for c in self.components if isinstance(c, kind)), None)

    @property
    def counts(self) -> dict:
        """The whole run's contribution counts (:data:`COUNTS`)."""
        return self.tally.counts

    @property
    def totals(self) -> dict:
        """This epoch's counts, steps, compute and wait seconds."""
        return self.tally.totals

    def reset_totals(self):
        """Zero the totals (per epoch); ``counts`` keeps the whole run's."""
        self.tally.reset_totals()

    def finish(self, apply_mean=None):
        """Wait for every pushed round and apply it (eager; identical weights on every rank).

        Then every contribution this worker produced has been applied,
        compensated or dropped: checked, so nothing is lost silently.
        ``apply_mean``: how to apply one more mean gradient through the
        optimizer (the frontends pass it; collective: pass it on every rank or
        on none); components that hold late contributions use it for a final
        round, and drop them without it.
        """
        if self.applied_through < self.step - 1:
            t = self.now()
            applied = self._wait_and_apply(self.step - 1)
            self._record_extra_wait(t, applied)
        drained = False
        for c in self.components:
            drained = c.finish(apply_mean) or drained
        drained = self.entry.drain() or drained
        if drained:
            drops = self.tally.settle(self.exchange)
            self.trace({"event": "drain", "rank": self.rank, "t": self.now(), "drops": drops, "dropped": len(drops)})
        self.protocol.finish()
        self.tally.check(self.rank)

    def close(self):
        """Leave the control path and stop the threads (collective: call on every rank)."""
        if not self.started:
            return
        self.started = False
        startup.forget(self)
        # Two barriers on the exchange thread, after every round, each bounded: every
        # rank is done with the control path before any leaves it, and every rank has
        # left it (its stream ended, its channel closed) before rank 0 stops the server,
        # so no server goes away under a worker's open stream.
        try:
            self.exchange.call(self.cluster.barrier("tfsync.close"), timeout_s=self.wait_timeout_s)
            self.control.close()
            self.exchange.call(self.cluster.barrier("tfsync.left"), timeout_s=self.wait_timeout_s)
        finally:
            self.exchange.close()
            self.control.close()
        self._release()

    def abandon(self):
        """Leave without :meth:`close`'s handshake with the other ranks (local, bounded).

        For an engine still running when the interpreter exits: ``fit``
        raised (Keras calls no ``on_train_end`` then), or a
        ``SyncStrategy`` was never finished.  Its control path's gRPC
        handler threads would otherwise keep the process alive forever.
        The replicas' weights may differ; nothing is drained.  Also for a
        start that failed after rank 0's control server came up.
        """
        if not startup.running(self):
            return
        self.started = False
        startup.forget(self)
        parts = self.__dict__  # what a failed start got to build
        try:
            if "exchange" in parts:
                self.exchange.close(timeout_s=ABANDON_JOIN_S)
        finally:
            if "control" in parts:
                self.control.close()
            self._release()

    def _release(self):
        if self._server is not None:
            self._server.stop()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    # ------------------------------------------------------------------- the step
    def begin_step(self) -> bool:
        """Whether this step computes: False when its round already closed without this
        worker or the policy's components say it skips; the frontend then calls :meth:`skip_step`."""
        with self._keep_error():
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
        with self._keep_error():
            self._check_started()
            corrected, self._corrected_wait = self._corrected_wait, None
            if self.protocol.corrects_gradients and corrected is None:
                raise RuntimeError(
                    f"tfsync: policy {self.policy.name!r} corrects each step's gradients before the "
                    f"optimizer runs: call SyncEngine.correct_gradients before sync_step"
                )
            if corrected is None:
                self.delays.sleep()  # (correct_gradients slept already)
            step, t_start = self.step, self._t_step_start
            payload = self.protocol.contribution(list(inputs))
            t_push = self.now()
            compute_s = t_push - t_start
            required = self.protocol.sync_round(self.policy, step)
            inline = required >= step and not any(c.runs_ahead(step) for c in self.components)
            for c in self.components:
                compute_s = c.interval(step, compute_s)
            self.last_pushed = step  # (before an inline round: its watchdog reports this clock)
            self.entry.push(step, payload, t_push, compute_s, inline)
            for c in self.components:
                required = c.required(step, required)
            self.tally.add("produced")
            self.control.report(step)
            applied = self._wait_and_apply(required, hand_back=True)
            waited_s, applied_before = corrected if corrected is not None else (0.0, [])
            self._end_step(step, t_start, t_push, applied_before + applied, waited_before_push_s=waited_s)
            result = self.protocol.result()
            for c in self.components:
                result = c.result(result)
            return result

    def skip_step(self):
        """A skipped step: no contribution; wait for its round and return its result."""
        with self._keep_error():
            self._check_started()
            step, t_start = self.step, self._t_step_start
            if self.entry.skip(step):
                self.last_pushed = step
            required = None
            for c in self.components:
                answer = c.skip(step)
                required = answer if answer is not None else required
            if required is None:
                required = self.protocol.sync_round(self.policy, step)
            applied = self._wait_and_apply(required)
            self._end_step(step, t_start, t_start, applied, skipped=True)
            return self.protocol.result()

    def correct_gradients(self, grads):
        """Protocols that correct gradients (DC-S3GD), before the optimizer runs: wait for
        the round this step's gradients are applied after, apply it, return them corrected.

        :meth:`sync_step` follows after the optimizer, and pushes its update.
        The frontends build the correction into the compiled step instead
        (:func:`tfsync.engine.tf_bridge.correct_gradients`) and call only
        :meth:`round_mean` from it.
        """
        with self._keep_error():
            return self.protocol.correct(grads, self.round_mean())

    def round_mean(self):
        """The wait of :meth:`correct_gradients`: the mean update its correction adds to ``w̄``."""
        with self._keep_error():
            self._check_started()
            self.delays.sleep()
            t = self.now()
            applied = self._wait_and_apply(self.protocol.sync_round(self.policy, self.step))
            self._corrected_wait = (self.now() - t, applied)
            if self.applied_through >= 0:  # w̄ moved past the weights the gradients were computed at
                self._corrected_rounds.add(self.step)
            return self.protocol.take_mean()

    # ---------------------------------------------------- what components may use
    def now(self) -> float:
        """Seconds since the job's t0 (the same clock on every rank)."""
        return time.time() - self.t0

    @property
    def tracing(self) -> bool:
        return self._trace is not None

    def trace(self, record: dict) -> None:
        """One line of this worker's JSON-lines trace (nothing without ``trace_dir``)."""
        if self._trace is not None:
            self._trace.write(json.dumps(record) + "\n")

    def stop(self, error):
        """Tell every worker why this one stops; returns ``error`` to raise."""
        return self._diagnosis.stop(error)

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _keep_error(self):
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

    def _wait_and_apply(self, required_round, hand_back=False):
        """Wait (bounded) until ``required_round`` is complete, then apply every complete round.

        ``hand_back``: the step may return its own round whole (partial pulling)."""
        if required_round > self.exchange.completed:
            self._wait_round(required_round)
        applied = []
        last = self.exchange.completed
        if self.protocol.one_round_per_step:  # a later round belongs to a later step
            last = min(last, required_round)
        for r in range(self.applied_through + 1, last + 1):
            res = self.exchange.pop(r)
            for c in self.components:
                c.before_apply(res)
            if not any(c.apply(res) for c in self.components):
                self.protocol.apply_round(res)
                if self._slow_pulls:  # simulated slow pulls: wait for the round's last block
                    delay = float(np.max(self.delays.pull_delays_s(len(self.shapes))))
                    if delay > 0:
                        time.sleep(delay)
            # the contributions' stamps are for the trace only: not computed without one
            stamps = None
            if self._trace is not None:
                stamps = [int(res.steps[k]) for k in np.flatnonzero(res.present)]
                stamps += [int(res.late_steps[k]) for k in np.flatnonzero(res.late)]
            applied.append((r, res.contributors, stamps))
            if res.present.all():  # every rank's time for round r, the same table on every rank
                self._full_round_times = res.compute_s  # (the round's own decoded array: no copy)
            if res.present[self.rank] == 1.0:
                if r in self._corrected_rounds:
                    self._corrected_rounds.discard(r)
                    self.tally.add("compensated")
                else:
                    self.tally.add("applied")
            if res.late[self.rank] == 1.0:
                self.tally.add("compensated")
            self.applied_through = r
            for c in self.components:
                c.after_apply(res)
        for c in self.components:
            c.rounds_applied(required_round, hand_back)
        return applied

    def _wait_round(self, round_):
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            try:
                done = self.exchange.wait(round_, min(WAIT_POLL_S, max(deadline - time.monotonic(), 0.0)))
            except Exception as exc:  # the collective failed: find out who is gone
                if self.exchange.inline_expired is not None:  # no: its inline wait reached the bound
                    self.control.report(self.last_pushed, min_interval_s=0.0)
                    raise self.stop(self._diagnosis.timeout_error(self.exchange.inline_expired)) from exc
                raise self.stop(self._diagnosis.lost_error(round_, exc)) from exc
            if done:
                return
            self._diagnosis.check_while_waiting(round_, self.last_pushed, deadline)

    def _end_step(self, step, t_start, t_push, applied, skipped=False, waited_before_push_s=0.0):
        t_end = self.now()
        compute_s = t_push - t_start - waited_before_push_s
        wait_s = t_end - t_push + waited_before_push_s
        # staleness of a contribution: steps between its round and the step that next uses it
        staleness = [step - r for r, _, _ in applied]
        compensated = self.tally.pending("compensated")
        self.tally.add("skipped", int(skipped))
        drops = self.tally.settle(self.exchange)
        round_times, self._full_round_times = self._full_round_times, None
        self.last = {
            "wait_s": wait_s,
            "compute_s": compute_s,
            # every rank's compute time for the last round applied in this step that took every
            # rank (replicated metadata: identical on every rank), or None
            "round_compute_s": round_times,
            "staleness": max(staleness) if staleness else 0,
            "applied": sum(n for _, n, _ in applied),
            "dropped": len(drops),
            "compensated": compensated,
            "skipped": int(skipped),
        }
        tot = self.tally.totals
        tot["steps"] += 1
        tot["compute_s"] += compute_s
        tot["wait_s"] += wait_s
        extra = {}
        for c in self.components:
            extra.update(c.end_step(step, wait_s, skipped))
        self.trace(
            {
                "rank": self.rank,
                "step": step,
                "t_start": t_start,
                "t_push": t_push,
                "t_end": t_end,
                "compute_s": compute_s,
                "wait_s": wait_s,
                "applied": [[r, step - r, n] for r, n, _ in applied],
                "stamps": [[r, s] for r, _, s in applied],
                "applied_through": self.applied_through,
                "dropped": len(drops),
                "drops": drops,
                "compensated": compensated,
                "skipped": skipped,
                **extra,
            }
        )
        self.step = step + 1
        self._t_step_start = t_end

    def _record_extra_wait(self, t, applied):
        wait_s = self.now() - t
        self.tally.totals["wait_s"] += wait_s
        compensated = self.tally.pending("compensated")
        drops = self.tally.settle(self.exchange)
        self.trace(
            {
                "event": "finish",
                "rank": self.rank,
                "t": t,
                "wait_s": wait_s,
                "applied": [[r, self.step - 1 - r, n] for r, n, _ in applied],
                "stamps": [[r, s] for r, _, s in applied],
                "applied_through": self.applied_through,
                "dropped": len(drops),
                "drops": drops,
                "compensated": compensated,
            }
        )


__all__ = ["COUNTS", "SyncEngine"]
