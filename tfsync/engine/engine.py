"""The sync engine: one per worker process; clocks, rounds, waits, metrics.

The engine asks its :class:`~tfsync.policies.Policy` which round must be
complete before a worker may pass its synchronization point, and runs that on
the :class:`~tfsync.engine.exchange.RoundExchange` (a communication thread
over ``hvd.grouped_allreduce``) and the control path
(:mod:`tfsync.engine.control`).  What a worker contributes and what it does
with a completed round is the business of the step protocol the policy names
(:mod:`tfsync.engine.protocols`), built once when the engine starts:

* gradient protocol (BSP): push this step's gradients, wait for the policy's
  round, return the mean of the contributions;
* update protocol (SSP): after the local optimizer step, push its share
  ``Δ/N``, wait for the policy's round for the next step, and move the
  weights to ``w̄ + Σ own pending shares``, where ``w̄`` is the sum of every
  completed round (identical on every worker) and the pending shares are this
  worker's own updates whose rounds are still in flight (read-my-writes).

Both run as one :meth:`SyncEngine.sync_step` per training step, called from inside
the compiled train step (see :mod:`tfsync.engine.tf_bridge`) with the tensors
themselves: the payload never crosses NumPy.

Coordinated policies (PSP, backup workers) push into the exchange's outbox
and tell rank 0's coordinator; the round closes on its decision, possibly
without this worker (see :mod:`tfsync.engine.exchange`).  When the round of a
worker's next step has already closed, :meth:`SyncEngine.begin_step` says so
and the frontends skip that step's computation (:meth:`SyncEngine.skip_step`
applies the round's mean all the same), so a slow worker keeps pace with the
rounds instead of setting the job's length.

Every contribution is accounted for, per worker: ``produced`` = ``applied`` +
``dropped`` (checked when training finishes, after the last one in flight
is drained); steps that computed nothing are ``skipped``.  All four are in
the totals, the Keras logs and the trace.  BSP and SSP accept every
contribution (SSP bounds staleness by waiting, not by dropping) and never
skip.
"""
import contextlib
import json
import os
import secrets
import socket
import time

import numpy as np

from tfsync import _horovod
from tfsync.engine import protocols
from tfsync.engine.control import ControlClient, ControlServer
from tfsync.engine.exchange import RoundExchange, WorkerLostError
from tfsync.policies import resolve
from tfsync.stragglers import Stragglers

# What happened to this worker's contributions (and steps), in totals, logs and trace.
COUNTS = ("produced", "applied", "dropped", "skipped")

WAIT_TIMEOUT_ENV = "TFSYNC_WAIT_TIMEOUT_S"
DEFAULT_WAIT_TIMEOUT_S = 120.0


class SyncTimeoutError(RuntimeError):
    """A wait exceeded its bound; the message names the ranks that are behind."""


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
    """

    def __init__(self, mode="bsp", *, stragglers=None, trace_dir=None, wait_timeout_s=None):
        self.policy = resolve(mode)
        if stragglers is None:
            stragglers = Stragglers.from_env()
        if not isinstance(stragglers, Stragglers):
            raise TypeError(f"stragglers must be a tfsync.Stragglers, got {type(stragglers).__name__}")
        self.stragglers = stragglers
        self.trace_dir = trace_dir
        if wait_timeout_s is None:
            wait_timeout_s = float(os.environ.get(WAIT_TIMEOUT_ENV, DEFAULT_WAIT_TIMEOUT_S))
        if not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s={wait_timeout_s!r} must be a positive number of seconds")
        self.wait_timeout_s = float(wait_timeout_s)
        self.started = False
        self.error = None

    # ----------------------------------------------------------------- lifecycle
    def start(self, tensors, extra_config=None):
        """Check the job, agree on t0, start the control path, the exchange and the protocol.

        ``tensors``: the model's trainable variables (in the order the
        optimizer sees them), already identical on every rank.  A gradient
        protocol needs only their shapes and dtypes (symbolic gradients do);
        an update protocol keeps its state beside the variables themselves.
        """
        hvd = _horovod.horovod()

        tensors = list(tensors)
        if not tensors:
            raise ValueError("tfsync: the model has no trainable weights to synchronize")
        self.rank, self.size = hvd.rank(), hvd.size()
        self.policy.validate(self.size)
        protocol_cls = protocols.for_policy(self.policy)
        if self.policy.coordinated and not protocol_cls.reduces_gradients:
            raise ValueError(f"tfsync: policy {self.policy.name!r} is coordinated but names the "
                             f"{protocol_cls.payload!r} protocol; coordinated rounds carry gradients")
        shapes = [[int(d) for d in t.shape] for t in tensors]
        self.num_params = int(sum(np.prod(s, dtype=np.int64) for s in shapes))
        config = {"policy": self.policy.config(), "num_params": self.num_params, "weights": shapes,
                  "stragglers": self.stragglers.spec(), **(extra_config or {})}
        configs = hvd.allgather_object(config, name="tfsync.config")
        mismatched = [r for r, c in enumerate(configs) if c != configs[0]]
        if mismatched:
            diffs = {k: [c.get(k) for c in configs] for k in config if any(c.get(k) != configs[0].get(k) for c in configs)}
            raise ValueError(
                f"tfsync: ranks {mismatched} are configured differently from rank 0: "
                + "; ".join(f"{k} per rank = {v}" for k, v in diffs.items())
                + ". Every worker must run the same mode, model and straggler settings: "
                  "launch the same script with the same arguments on every rank")
        self.t0 = hvd.broadcast_object(time.time(), root_rank=0, name="tfsync.t0")
        self._server = None
        if self.rank == 0:
            # the job's token reaches the workers over Horovod's own channel, never the control path
            token = secrets.token_hex(16)
            host = os.environ.get("TFSYNC_CONTROL_HOST") or socket.gethostname()
            self._server = ControlServer(self.size, self.t0, token, host=host, policy=self.policy)
            contact = (self._server.address, token)
        else:
            contact = None
        address, token = hvd.broadcast_object(contact, root_rank=0, name="tfsync.control_address")

        self.protocol = protocol_cls(tensors, self.size)
        coordinated = {}
        if self.policy.coordinated:
            coordinated = dict(absent=self.protocol.absent(), mask=protocols.mask_stale_payload)
        self.exchange = RoundExchange(protocols.horovod_collective(protocol_cls.average),
                                      self.rank, self.size, self.t0, **coordinated)
        self.control = ControlClient(address, self.rank, token, on_close=(
            self.exchange.close_round if self.policy.coordinated else None))
        self._delays = self.stragglers.for_rank(self.rank)
        self.step = 0
        self._produced = self._own_applied = 0  # not yet moved into the totals
        self._last_pushed = -1
        self._applied_through = -1
        self._trace = None
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            self._trace = open(os.path.join(self.trace_dir, f"rank{self.rank}.jsonl"), "w")
            self._write({"event": "start", "rank": self.rank, "size": self.size, "t0": self.t0,
                         **config})
        self.counts = dict.fromkeys(COUNTS, 0)
        self.reset_totals()
        self.last = {}
        self.started = True
        self._t_step_start = self._now()

    def reset_totals(self):
        """Zero the totals (per epoch); ``counts`` keeps the whole run's."""
        self.totals = {"steps": 0, "compute_s": 0.0, "wait_s": 0.0, **dict.fromkeys(COUNTS, 0)}

    def finish(self):
        """Wait for every pushed round and apply it (eager; identical weights on every rank).

        Then every contribution this worker produced has been applied or dropped:
        checked, so nothing is lost silently.
        """
        if self._applied_through < self.step - 1:
            t = self._now()
            applied = self._wait_and_apply(self.step - 1)
            self._record_extra_wait(t, applied)
        if self.policy.coordinated and self.exchange.drain_outbox():
            drops = self._count_drops()
            if self._trace is not None:
                self._write({"event": "drain", "rank": self.rank, "t": self._now(), "drops": drops,
                             "dropped": len(drops)})
        self.protocol.finish()
        c = self.counts
        if c["produced"] != c["applied"] + c["dropped"]:
            raise RuntimeError(
                f"tfsync: rank {self.rank} lost track of contributions: produced {c['produced']}, "
                f"applied {c['applied']}, dropped {c['dropped']} after every round was drained")

    def close(self):
        """Leave the control path and stop the threads (collective: call on every rank)."""
        if not self.started:
            return
        self.started = False
        hvd = _horovod.horovod()
        import tensorflow as tf

        # Nobody stops the control server before every rank has left it: a
        # barrier on the exchange thread, after every round, and bounded.
        try:
            self.exchange.call(lambda: hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name="tfsync.close"),
                               timeout_s=self.wait_timeout_s)
        finally:
            self.exchange.close()
            self.control.close()
        if self._server is not None:
            self._server.stop()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    # ------------------------------------------------------------------- the step
    def sync_step(self, inputs):
        """One step's synchronization: push, wait for the policy's round, apply what completed.

        ``inputs``: this step's gradients (gradient protocol) or nothing (update
        protocol: the optimizer already ran).  Returns the protocol's result:
        the mean gradients, or nothing (the weights were moved in place).
        """
        with self._keep_error():
            return self._step(inputs)

    @contextlib.contextmanager
    def _keep_error(self):
        # TensorFlow re-wraps exceptions raised inside tf.py_function; keep the
        # original so the frontends can re-raise it with its type.
        try:
            yield
        except Exception as exc:
            self.error = exc
            raise

    def begin_step(self) -> bool:
        """Whether this step computes: False when its round already closed without this
        worker (policies that skip), and the frontend then calls :meth:`skip_step`."""
        with self._keep_error():
            self._check_started()
            return not (self.policy.skips and self.exchange.closed_through >= self.step)

    def skip_step(self):
        """A skipped step: no contribution; wait for its round and return its result."""
        with self._keep_error():
            self._check_started()
            step, t_start = self.step, self._t_step_start
            applied = self._wait_and_apply(self.protocol.sync_round(self.policy, step))
            self._end_step(step, t_start, t_start, applied, skipped=True)
            return self.protocol.result()

    def _check_started(self):
        if not self.started:
            raise RuntimeError("tfsync: the engine is not started (SyncCallback.on_train_begin starts it)")

    def _step(self, inputs):
        self._check_started()
        self._delays.sleep()
        step, t_start = self.step, self._t_step_start
        payload = self.protocol.contribution(list(inputs))
        t_push = self._now()
        required = self.protocol.sync_round(self.policy, step)
        if self.policy.coordinated:
            self.exchange.push(step, payload, t_push, t_push - t_start)
            self.control.ready(step)
        else:
            # a worker that would wait for this very round anyway runs it on its own thread
            self.exchange.submit(step, payload, t_push, t_push - t_start, inline=required >= step)
        self._produced += 1
        self._last_pushed = step
        self.control.report(step)
        applied = self._wait_and_apply(required)
        self._end_step(step, t_start, t_push, applied)
        return self.protocol.result()

    # ------------------------------------------------------------------ internals
    def _now(self):
        return time.time() - self.t0

    def _wait_and_apply(self, required_round):
        """Wait (bounded) until ``required_round`` is complete, then apply every complete round."""
        if required_round > self.exchange.completed:
            self._wait_round(required_round)
        applied = []
        last = self.exchange.completed
        if self.protocol.one_round_per_step:  # a later round belongs to a later step
            last = min(last, required_round)
        for r in range(self._applied_through + 1, last + 1):
            res = self.exchange.pop(r)
            self.protocol.apply_round(res)
            stamps = [int(res.steps[k]) for k in np.flatnonzero(res.present)]
            applied.append((r, res.contributors, stamps))
            self._own_applied += int(res.present[self.rank] == 1.0)
            self._applied_through = r
        return applied

    def _count_drops(self):
        """This worker's contributions dropped since the last call, counted; ``[[stamp, round]]``."""
        drops = [[int(s), int(r)] for s, r in self.exchange.take_drops()]
        for key, n in (("produced", self._produced), ("applied", self._own_applied),
                       ("dropped", len(drops))):
            self.totals[key] += n
            self.counts[key] += n
        self._produced = self._own_applied = 0
        return drops

    def _wait_round(self, round_):
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            try:
                done = self.exchange.wait(round_, min(1.0, max(deadline - time.monotonic(), 0.0)))
            except Exception as exc:  # the collective failed: find out who is gone
                raise self._stop(self._lost_error(round_, exc)) from exc
            if done:
                return
            # waiting for over a second: make sure rank 0's clock table shows this
            # rank's last push, so a timeout names only the ranks really behind
            self.control.report(self._last_pushed, min_interval_s=0.0)
            lost = self.control.known_lost or self.control.table(timeout_s=1.0).get("lost", [])
            # checked after the table query: a peer that stopped (rank 0 included)
            # told everyone why before it went, and that beats "rank 0 is unreachable"
            peer_stop = self._peer_stop()
            if peer_stop is not None and not self.control.known_lost:
                raise peer_stop
            if lost:
                raise self._stop(self._lost_error(round_, None, lost))
            if time.monotonic() >= deadline:
                peer_stop = self._peer_stop()
                if peer_stop is not None:
                    raise peer_stop
                raise self._stop(SyncTimeoutError(
                    f"tfsync: rank {self.rank} waited {self.wait_timeout_s:.0f} s for round {round_} "
                    f"(mode {self.policy.name}); {self._behind(round_)}. A worker is hung or far "
                    f"slower than the others; raise wait_timeout_s (or {WAIT_TIMEOUT_ENV}) if that "
                    f"is expected"))

    def _behind(self, round_):
        """Which ranks have not pushed ``round_``, from rank 0's (or the last known) clock table."""
        clocks = [int(c) for c in self.control.table(timeout_s=1.0).get("clocks") or []]
        behind = [r for r, c in enumerate(clocks) if c < round_]
        if not clocks:
            return "no clock table was available to say which rank is behind"
        return (f"ranks {behind} have not pushed it (last pushed step per rank, as reported at "
                f"most 1 s ago: {clocks})")

    def _stop(self, error):
        self.control.announce_stop(type(error).__name__, str(error))
        return error

    def _peer_stop(self):
        """The error another rank stopped with, if one did (pushed by the control path)."""
        for notice in self.control.known_stopped:
            if int(notice["rank"]) != self.rank:
                cls = SyncTimeoutError if notice.get("kind") == "SyncTimeoutError" else WorkerLostError
                return cls(f"tfsync: rank {int(notice['rank'])} stopped the job: {notice['message']}")
        return None

    def _lost_error(self, round_, exc, lost=None):
        deadline = time.monotonic() + 5.0
        while not self.control.known_lost and time.monotonic() < deadline:
            lost = lost or self.control.table(timeout_s=1.0).get("lost", [])
            peer_stop = self._peer_stop()
            if peer_stop is not None and not self.control.known_lost:
                return peer_stop
            if lost:
                break
            time.sleep(0.2)
        lost = self.control.known_lost or lost
        if lost:
            names = ", ".join(f"rank {int(d['rank'])} ({d['reason']}"
                              + (f", last pushed step {int(d['clock'])}" if d.get("clock") is not None else "")
                              + ")" for d in lost)
            return WorkerLostError(
                f"tfsync: lost {names} while rank {self.rank} waited for round {round_}; "
                f"{self._behind(round_)}. Stopping this worker too; restart the job (from a "
                f"checkpoint, if you keep one)")
        return WorkerLostError(
            f"tfsync: the collective for round {round_} failed on rank {self.rank} ({exc}); "
            "no peer was reported lost by the control path")

    def _end_step(self, step, t_start, t_push, applied, skipped=False):
        t_end = self._now()
        compute_s, wait_s = t_push - t_start, t_end - t_push
        # staleness of a contribution: steps between its round and the step that next uses it
        staleness = [step - r for r, _, _ in applied]
        drops = self._count_drops()
        self.last = {"wait_s": wait_s, "compute_s": compute_s,
                     "staleness": max(staleness) if staleness else 0,
                     "applied": sum(n for _, n, _ in applied), "dropped": len(drops),
                     "skipped": int(skipped)}
        tot = self.totals
        tot["steps"] += 1
        tot["compute_s"] += compute_s
        tot["wait_s"] += wait_s
        tot["skipped"] += int(skipped)
        self.counts["skipped"] += int(skipped)
        if self._trace is not None:
            self._write({"rank": self.rank, "step": step, "t_start": t_start, "t_push": t_push,
                         "t_end": t_end, "compute_s": compute_s, "wait_s": wait_s,
                         "applied": [[r, step - r, n] for r, n, _ in applied],
                         "stamps": [[r, s] for r, _, s in applied],
                         "applied_through": self._applied_through, "dropped": len(drops),
                         "drops": drops, "skipped": skipped})
        self.step = step + 1
        self._t_step_start = t_end

    def _record_extra_wait(self, t, applied):
        wait_s = self._now() - t
        self.totals["wait_s"] += wait_s
        drops = self._count_drops()
        if self._trace is not None:
            self._write({"event": "finish", "rank": self.rank, "t": t, "wait_s": wait_s,
                         "applied": [[r, self.step - 1 - r, n] for r, n, _ in applied],
                         "stamps": [[r, s] for r, _, s in applied],
                         "applied_through": self._applied_through, "dropped": len(drops),
                         "drops": drops})

    def _write(self, record):
        self._trace.write(json.dumps(record) + "\n")
