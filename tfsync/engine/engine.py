"""The sync engine: one per worker process; clocks, rounds, waits, metrics.

The engine asks its :class:`~tfsync.policies.Policy` which round must be
complete before a worker may pass its synchronization point, and runs that on
the :class:`~tfsync.engine.exchange.RoundExchange` (a communication thread
over ``hvd.grouped_allreduce``) and the control path
(:mod:`tfsync.engine.control`).  Everything it takes from its peers goes
through one injected cluster object (:mod:`tfsync.engine.cluster`): Horovod
in production, N ranks on threads in the single-process tests.  What a worker
contributes and what it does with a completed round is the business of the
step protocol the policy names (:mod:`tfsync.engine.protocols`), built once
when the engine starts:

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

With ``compensate=`` (PSP, backup workers), a contribution that missed its
round is withdrawn from the outbox with a snapshot of the weights it was
computed on, corrected at the worker's next computed step (whose weights
are those its round applies to) and offered to that round
(:meth:`SyncEngine.begin_step`); those still held when training ends go into
one final round (:meth:`SyncEngine.finish`).  DC-S3GD's protocol corrects every gradient
before the optimizer runs (:meth:`SyncEngine.correct_gradients`) and pushes
the optimizer's update after it (:meth:`SyncEngine.sync_step`).

Every contribution is accounted for, per worker: ``produced`` = ``applied`` +
``compensated`` + ``dropped`` (checked when training finishes, after the
last one in flight is drained); steps that computed nothing are
``skipped``.  All five are in the totals, the Keras logs and the trace.
BSP and SSP accept every contribution (SSP bounds staleness by waiting, not
by dropping) and never skip.

With PSP's partial pulling (``pull_fraction < 1``) a completed round's mean
goes to :class:`tfsync.engine.pull.BlockPull`, which applies it block by
block through the applier the frontend set
(:meth:`SyncEngine.set_block_applier`) as the blocks arrive; the step goes on
once enough of its round's blocks have.  When the step's own round arrived
whole, it is handed back to the compiled step instead, which applies it as
without partial pulling.  Simulated slow pulls
(``Stragglers(pull_prob=, pull_s=)``) hold a round's blocks back on the
receive side; a mode without partial pulling waits for all of them.
"""

import contextlib
import json
import os
import secrets
import statistics
import threading
import time
import weakref

import numpy as np

from tfsync import _env
from tfsync.engine import protocols
from tfsync.engine.address import choose as choose_control_address
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.control import ControlClient, ControlServer
from tfsync.engine.diagnosis import Diagnosis
from tfsync.engine.exchange import RoundExchange
from tfsync.engine.pull import BlockPull, partition
from tfsync.policies import resolve
from tfsync.stragglers import Stragglers

# What happened to this worker's contributions (and steps), in totals, logs and trace.
COUNTS = ("produced", "applied", "compensated", "dropped", "skipped")

WAIT_TIMEOUT_ENV = _env.WAIT_TIMEOUT_S.name
DEFAULT_WAIT_TIMEOUT_S = float(_env.WAIT_TIMEOUT_S.default)


POST_PUSH_SMOOTHING = 0.2  # ElasticBSP: weight of the newest step in the post-push time's average
WAIT_POLL_S = 1.0  # a waiting worker checks the control path (losses, stops, its deadline) this often
ABANDON_JOIN_S = 2.0  # at exit, how long an unclosed engine waits for its communication thread

_running = weakref.WeakSet()  # engines started and not closed, in this process
_exit_hook_registered = False


def _leave_at_exit(engine):
    """Abandon ``engine`` at interpreter exit if it is still running then.

    The hook goes in ``threading``'s exit list, which runs before Python joins
    the non-daemon threads, the gRPC server's handler pool among them (an
    ``atexit`` function runs after that join, too late).  It is registered
    after the server exists, so it runs before ``concurrent.futures`` joins
    that pool.
    """
    global _exit_hook_registered
    _running.add(engine)
    if not _exit_hook_registered:
        threading._register_atexit(_abandon_running)
        _exit_hook_registered = True


def _abandon_running():
    for engine in list(_running):
        try:
            engine.abandon()
        except Exception:  # exiting anyway: one engine's failure must not keep the others
            pass


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
        cluster: what the engine takes from its peers: ``rank()``, ``size()``,
            ``allgather_object(obj, name)``, ``broadcast_object(obj, root_rank, name)``,
            ``collective(average)`` and ``barrier(name)`` (see :mod:`tfsync.engine.cluster`).
            Default ``None``: :class:`~tfsync.engine.cluster.HorovodCluster`, built
            by :meth:`start` (which checks that Horovod is initialized and the
            process launched by ``horovodrun``).  Tests and simulators pass N
            in-process ranks instead.

    Example::

        engine = SyncEngine("psp", trace_dir="traces")   # Horovod's ranks
        engine.start(model.trainable_variables)
    """

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
        self.policy.validate(self.size)
        protocol_cls = protocols.for_policy(self.policy)
        if self.policy.coordinated and not protocol_cls.reduces_gradients:
            raise ValueError(
                f"tfsync: policy {self.policy.name!r} is coordinated but names the "
                f"{protocol_cls.payload!r} protocol; coordinated rounds carry gradients"
            )
        shapes = [[int(d) for d in t.shape] for t in tensors]
        self.num_params = int(sum(np.prod(s, dtype=np.int64) for s in shapes))
        blocks = self._pull_blocks(shapes)
        config = {
            "policy": self.policy.config(),
            "num_params": self.num_params,
            "weights": shapes,
            "stragglers": self.stragglers.spec(),
            **(extra_config or {}),
        }
        configs = cluster.allgather_object(config, name="tfsync.config")
        mismatched = [r for r, c in enumerate(configs) if c != configs[0]]
        if mismatched:
            diffs = {
                k: [c.get(k) for c in configs] for k in config if any(c.get(k) != configs[0].get(k) for c in configs)
            }
            raise ValueError(
                f"tfsync: ranks {mismatched} are configured differently from rank 0: "
                + "; ".join(f"{k} per rank = {v}" for k, v in diffs.items())
                + ". Every worker must run the same mode, model and straggler settings: "
                "launch the same script with the same arguments on every rank"
            )
        self.t0 = cluster.broadcast_object(time.time(), root_rank=0, name="tfsync.t0")
        self._server = None
        if self.rank == 0:
            # the job's token reaches the workers over Horovod's own channel, never the control path
            token = secrets.token_hex(16)
            chosen = choose_control_address()
            try:
                self._server = ControlServer(
                    self.size, self.t0, token, host=chosen.bind, advertise=chosen.advertise, policy=self.policy
                )
            except RuntimeError as exc:
                raise RuntimeError(f"{exc} (the address came from {chosen.source})") from exc
            contact = (self._server.address, token)
        else:
            contact = None
        _leave_at_exit(self)  # from here on something runs that must not outlive the process
        address, token = cluster.broadcast_object(contact, root_rank=0, name="tfsync.control_address")

        coordinated = {}
        self._compensates = getattr(self.policy, "compensate", None) is not None
        if self.policy.coordinated:
            coordinated = dict(
                absent=lambda: self.protocol.absent(),
                mask=protocols.mask_stale_payload,
                keep_stale=self._compensates,
                takes_present=self.policy.enters_when_ready,
            )
        # the exchange first: a frontend may route the protocol's variable creation
        # (SyncStrategy broadcasts initial values) through it
        self.exchange = RoundExchange(
            cluster.collective(protocol_cls.average),
            self.rank,
            self.size,
            self.t0,
            abort=getattr(cluster, "abort", None),
            **coordinated,
        )
        self.protocol = protocol_cls(tensors, self.size, self.policy)
        on_close = self.exchange.close_round if self.policy.coordinated else None
        self.control = ControlClient(address, self.rank, token, on_close=on_close)
        # an inline round that waits reports this worker's clock, as the polling wait does
        self.exchange.on_inline_wait = lambda: self.control.report(self._last_pushed, min_interval_s=0.0)
        self._diagnosis = Diagnosis(self.control, self.rank, self.policy.name, self.wait_timeout_s, WAIT_TIMEOUT_ENV)
        self._delays = self.stragglers.for_rank(self.rank)
        self._pull = None  # PSP's partial pulling: the blocks not applied yet
        self._handed = None  # partial pulling: the step's own round, whole, for the compiled step to apply
        self._pull_blocks_n = len(blocks)  # a mode without it waits for a round's last block
        self._slow_pulls = bool(self.stragglers.pull_prob and self.stragglers.pull_s)
        if self.policy.pulls_partially:
            self._pull = BlockPull(
                blocks,
                self.policy.blocks_needed(len(blocks)),
                self.policy.pull_timeout_s,
                self._delays.pull_delays_s,
            )
        self.step = 0
        self._produced = self._own_applied = self._own_compensated = 0  # not yet moved into the totals
        self._corrected_rounds = set()  # own contributions whose gradient was delay-compensated
        self._corrected_wait = None  # (wait_s, applied) of this step's correction, until its push
        self._held = None  # (stamp, payload): a contribution that missed its round, to compensate
        # DSSP: extra steps granted past the lower bound and not yet used; the steps they cover;
        # the latest grant decision, until the wait it predicted is known
        self._dssp = hasattr(self.policy, "grant")
        self._grant_left, self._granted, self._open_grant, self._closing_grant = 0, set(), None, None
        # ElasticBSP: the current superstep, and this worker's latest iteration interval
        self._schedule = self.policy.first_schedule(self.size) if hasattr(self.policy, "next_schedule") else None
        self._superstep_compute = []  # ElasticBSP: this superstep's computation times
        self._post_push_s = 0.0  # ElasticBSP: mean time from a push to the next step (no barrier)
        self._at_barrier = None  # the step whose sync waits for the barrier round
        # ElasticBSP's barriers on this worker: how many, the waits at them, the decisions' time
        self.barriers = {"count": 0, "wait_s": 0.0, "decision_s": 0.0}
        self._last_pushed = -1
        self._applied_through = -1
        self._trace = None
        if self.trace_dir:
            os.makedirs(self.trace_dir, exist_ok=True)
            self._trace = open(os.path.join(self.trace_dir, f"rank{self.rank}.jsonl"), "w")
            self._write({"event": "start", "rank": self.rank, "size": self.size, "t0": self.t0, **config})
        self.counts = dict.fromkeys(COUNTS, 0)
        self.reset_totals()
        self.last = {}
        self._full_round_times = None
        self.started = True
        self._t_step_start = self._now()

    def _pull_blocks(self, shapes):
        """The parameter blocks of PSP's partial pulling (one per weight tensor without it)."""
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        count = getattr(self.policy, "pull_blocks", None)
        if count is not None and count > len(sizes):
            raise ValueError(
                f"tfsync: PSP(pull_blocks={count}) with a model of {len(sizes)} weight tensors "
                f"({self.num_params} parameters): a block is a group of whole weight tensors (the "
                f"optimizer updates each on its own), so use pull_blocks <= {len(sizes)}, or None "
                f"for one block per weight tensor"
            )
        return partition(sizes, count or len(sizes))

    def set_block_applier(self, applier):
        """Partial pulling: how this worker applies one block of a round's mean
        (:attr:`tfsync.engine.pull.BlockPull.applier`; the frontends set it before the first step)."""
        if self._pull is None:
            raise ValueError(f"tfsync: mode {self.policy.name!r} does not pull partially; it has no block applier")
        self._pull.applier = applier

    @property
    def pulls_partially(self) -> bool:
        """Whether rounds are applied by the engine block by block (the step then returns
        ``[*mean, True]`` only when its own round arrived whole, else ``[*zeros, False]``)."""
        return self._pull is not None

    @property
    def pull_groups(self) -> list:
        """Partial pulling: the blocks, each a list of indices into the weight tensors."""
        return self._pull.groups if self._pull is not None else []

    @property
    def pull_counts(self) -> dict:
        """Partial pulling: blocks applied, applied after their step went on, delayed (simulated)."""
        return dict(self._pull.counts) if self._pull is not None else {}

    def reset_totals(self):
        """Zero the totals (per epoch); ``counts`` keeps the whole run's."""
        self.totals = {"steps": 0, "compute_s": 0.0, "wait_s": 0.0, **dict.fromkeys(COUNTS, 0)}

    def finish(self, apply_mean=None):
        """Wait for every pushed round and apply it (eager; identical weights on every rank).

        Then every contribution this worker produced has been applied,
        compensated or dropped: checked, so nothing is lost silently.

        ``apply_mean``: with ``compensate=``, how to apply one more mean
        gradient through the optimizer (the frontends pass it; collective:
        pass it on every rank or on none).  Late gradients still held then
        are corrected against the final weights and averaged in one last
        round (:meth:`RoundExchange.final_round`) that every replica applies;
        without it they are dropped.
        """
        if self._applied_through < self.step - 1:
            t = self._now()
            applied = self._wait_and_apply(self.step - 1)
            self._record_extra_wait(t, applied)
        if self._pull is not None:
            self._pull.drain(self._now, time.monotonic() + self.wait_timeout_s)
        if self._compensates and apply_mean is not None:
            self._final_round(apply_mean)
        drained = self.policy.coordinated and self.exchange.drain_outbox()
        if self._held is not None:  # no round is left to take it
            self.exchange.drop(self._held[0], self.exchange.closed_through + 1)
            self._held, drained = None, True
        if drained:
            drops = self._count_drops()
            if self._trace is not None:
                self._write(
                    {"event": "drain", "rank": self.rank, "t": self._now(), "drops": drops, "dropped": len(drops)}
                )
        self.protocol.finish()
        c = self.counts
        if c["produced"] != c["applied"] + c["compensated"] + c["dropped"]:
            raise RuntimeError(
                f"tfsync: rank {self.rank} lost track of contributions: produced {c['produced']}, "
                f"applied {c['applied']}, compensated {c['compensated']}, dropped {c['dropped']} "
                f"after every round was drained"
            )

    def close(self):
        """Leave the control path and stop the threads (collective: call on every rank)."""
        if not self.started:
            return
        self.started = False
        _running.discard(self)
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
        if self._server is not None:
            self._server.stop()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def abandon(self):
        """Leave without :meth:`close`'s handshake with the other ranks (local, bounded).

        For an engine still running when the interpreter exits: ``fit``
        raised (Keras calls no ``on_train_end`` then), or a
        ``SyncStrategy`` was never finished.  Its control path's gRPC
        handler threads would otherwise keep the process alive forever.
        The replicas' weights may differ; nothing is drained.  Also for a
        start that failed after rank 0's control server came up.
        """
        if self not in _running:
            return
        self.started = False
        _running.discard(self)
        parts = self.__dict__  # what a failed start got to build
        try:
            if "exchange" in parts:
                self.exchange.close(timeout_s=ABANDON_JOIN_S)
        finally:
            if "control" in parts:
                self.control.close()
            if self._server is not None:
                self._server.stop()
            if parts.get("_trace") is not None:
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
            self._delays.sleep()
            t = self._now()
            applied = self._wait_and_apply(self.protocol.sync_round(self.policy, self.step))
            self._corrected_wait = (self._now() - t, applied)
            if self._applied_through >= 0:  # w̄ moved past the weights the gradients were computed at
                self._corrected_rounds.add(self.step)
            return self.protocol.take_mean()

    def begin_step(self) -> bool:
        """Whether this step computes: False when its round already closed without this
        worker (policies that skip), and the frontend then calls :meth:`skip_step`."""
        with self._keep_error():
            self._check_started()
            if self._schedule is not None:
                return self._schedule.computes(self.rank, self.step)
            if self.policy.skips and self.exchange.closed_through >= self.step:
                return False
            if self._held is not None:
                return self._offer_late()
            return True

    def _offer_late(self) -> bool:
        """Compensate the held contribution for this step's round and offer it there.

        This step's weights are the ones its round's mean will be applied to
        (every earlier round is applied), i.e. ``w_now``.  False when the round
        closed meanwhile: the step is skipped and the offer made again at the next.
        """
        stamp, payload = self._held
        self.exchange.set_late(self.step, stamp, self.protocol.compensate(payload))
        if not self.control.join_late(self.step):
            self.exchange.clear_late()
            return False
        self._held = None
        return True

    def skip_step(self):
        """A skipped step: no contribution; wait for its round and return its result."""
        with self._keep_error():
            self._check_started()
            step, t_start = self.step, self._t_step_start
            if self._schedule is not None:  # ElasticBSP: zeros in this step's round, which needs every rank
                self.exchange.submit(step, self.protocol.absent(), self._now(), 0.0, inline=False, present=False)
                self._last_pushed = step
                required = self._schedule_required(step)
            else:
                required = self.protocol.sync_round(self.policy, step)
            applied = self._wait_and_apply(required)
            self._end_step(step, t_start, t_start, applied, skipped=True)
            return self.protocol.result()

    def _check_started(self):
        if not self.started:
            raise RuntimeError("tfsync: the engine is not started (SyncCallback.on_train_begin starts it)")

    def _step(self, inputs):
        self._check_started()
        corrected, self._corrected_wait = self._corrected_wait, None
        if self.protocol.corrects_gradients and corrected is None:
            raise RuntimeError(
                f"tfsync: policy {self.policy.name!r} corrects each step's gradients before the "
                f"optimizer runs: call SyncEngine.correct_gradients before sync_step"
            )
        if corrected is None:
            self._delays.sleep()  # (correct_gradients slept already)
        step, t_start = self.step, self._t_step_start
        payload = self.protocol.contribution(list(inputs))
        t_push = self._now()
        required = self.protocol.sync_round(self.policy, step)
        compute_s = t_push - t_start
        if self._schedule is not None:
            required = self._schedule_required(step)
            # its rows carry the interval the predictor uses: push to push, i.e. the median
            # computation of the superstep and the engine's own work after a push
            self._superstep_compute.append(compute_s)
            compute_s = statistics.median(self._superstep_compute) + self._post_push_s
        self._last_pushed = step  # (before an inline round: its watchdog reports this clock)
        if self.policy.coordinated:
            self.exchange.push(step, payload, t_push, compute_s)
            if self.policy.enters_when_ready:  # (PSP) the round takes what its ranks hold when they enter
                self.exchange.enter_accepted(step)
                self.control.ready(step)
            else:
                self.control.ready(step, on_accepted=self.exchange.enter_accepted)
        else:
            # a worker that would wait for this very round anyway runs it on its own thread
            # (not one that may be granted extra steps instead)
            inline = required >= step and not (self._dssp and self.policy.extra_max > 0)
            self.exchange.submit(step, payload, t_push, compute_s, inline=inline, timeout_s=self.wait_timeout_s)
            if self._dssp:
                required = self._dssp_required(step, required)
        self._produced += 1
        self.control.report(step)
        applied = self._wait_and_apply(required, hand_back=self._pull is not None)
        if corrected is not None:  # waited before the optimizer, not after the push
            waited_s, applied_before = corrected
            self._end_step(step, t_start, t_push, applied_before + applied, waited_before_push_s=waited_s)
        else:
            self._end_step(step, t_start, t_push, applied)
        if self._pull is not None:
            return self._pull_result()
        return self.protocol.result()

    def _pull_result(self):
        """Partial pulling: ``[*mean, True]`` when the step's own round arrived whole (the
        compiled step applies it, as without partial pulling), else ``[*zeros, False]``
        (every block that arrived is applied already)."""
        handed, self._handed = self._handed, None
        if handed is None:
            return [*self.protocol.absent(), False]
        return [*handed, True]

    # ------------------------------------------------------------------ internals
    def _schedule_required(self, step):
        """ElasticBSP: the barrier round at the superstep's last step, else none (-1)."""
        if step != self._schedule.barrier:
            return -1
        self._at_barrier = step
        return step

    def _dssp_required(self, step, required):
        """DSSP, after pushing ``step``: the round step ``step + 1`` waits for.

        The lower bound's (``required``) unless a grant covers the step; a
        worker past the lower bound without one asks the coordinator.  Any
        granted step still waits for the upper bound's round.
        """
        nxt = step + 1
        hard = self.policy.hard_round(nxt)
        ahead = nxt - (self.exchange.completed + 1)
        room = self.policy.high - ahead + 1  # steps computable before the upper bound binds
        asks = self._grant_left == 0 and required > self.exchange.completed and room > 0
        if not asks:  # (a grant request carries the push itself)
            self.control.pushed(step)
        if self._grant_left > 0:  # one per push, fastest or not (Algorithm 1, lines 3-5)
            self._grant_left -= 1
            self._granted.add(nxt)
            return hard
        if self._open_grant is not None:  # used up: the wait that follows is the one it predicted
            self._closing_grant, self._open_grant = self._open_grant, None
        if not asks:
            return required
        t = self._now()
        reply = self.control.grant(step, room)
        extra = min(int(reply.get("extra", 0)), room)
        decision = {
            "step": nxt,
            "t": t,
            "extra": extra,
            "room": room,
            "ahead": ahead,
            "reason": reply.get("reason"),
            "slowest": None if reply.get("slowest") is None else int(reply["slowest"]),
            "predicted_wait_s": reply.get("predicted_wait_s"),
            "counts": [int(c) for c in reply.get("counts", ())],
        }
        if extra > 0:
            self._grant_left = extra - 1
            self._granted.add(nxt)
            self._open_grant = decision
            return hard
        self._closing_grant = decision  # no extra steps: this step's wait is the one predicted
        return required

    def _now(self):
        return time.time() - self.t0

    def _wait_and_apply(self, required_round, hand_back=False):
        """Wait (bounded) until ``required_round`` is complete, then apply every complete round.

        ``hand_back`` (partial pulling): keep ``required_round`` for the compiled step to
        apply if it arrived whole (:meth:`_pull_result`)."""
        if required_round > self.exchange.completed:
            self._wait_round(required_round)
        applied = []
        last = self.exchange.completed
        if self.protocol.one_round_per_step:  # a later round belongs to a later step
            last = min(last, required_round)
        for r in range(self._applied_through + 1, last + 1):
            res = self.exchange.pop(r)
            if self._compensates and r == self._last_pushed and self.rank not in res.accepted:
                self._hold_late(r)  # before its mean moves the weights it was computed on
            if self._pull is not None:
                self._pull.land(r, res.total, self._now())
            else:
                self.protocol.apply_round(res)
                if self._slow_pulls:
                    self._receive_delay()
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
                    self._own_compensated += 1
                else:
                    self._own_applied += 1
            if res.late[self.rank] == 1.0:
                self._own_compensated += 1
            self._applied_through = r
            if self._schedule is not None and r == self._schedule.barrier:
                self._next_superstep(res)
        if self._pull is not None:
            if 0 <= required_round <= self._applied_through:
                self._wait_blocks(required_round)
            self._handed = self._pull.apply_arrived(self._now(), hand_back=required_round if hand_back else None)
        return applied

    def _wait_blocks(self, round_):
        """Partial pulling: wait (bounded) until enough of ``round_``'s blocks arrived."""
        try:
            self._pull.wait(round_, self._now, time.monotonic() + self.wait_timeout_s)
        except TimeoutError as exc:
            raise self._diagnosis.stop(
                RuntimeError(
                    f"tfsync: rank {self.rank} waited {self.wait_timeout_s:.0f} s for the blocks of round "
                    f"{round_} ({exc}); a simulated pull delay (Stragglers.pull_s) longer than "
                    f"wait_timeout_s cannot end: shorten it or raise {WAIT_TIMEOUT_ENV}"
                )
            ) from exc

    def _receive_delay(self):
        """Simulated slow pulls, without partial pulling: the worker waits for a round's
        last block (``Stragglers(pull_prob=, pull_s=)``)."""
        delay = float(np.max(self._delays.pull_delays_s(self._pull_blocks_n)))
        if delay > 0:
            time.sleep(delay)

    def _next_superstep(self, res):
        """ElasticBSP: the barrier round ``res`` is applied; settle and schedule the next superstep
        from its replicated metadata (the same decision on every worker)."""
        self.protocol.settle()
        present = np.flatnonzero(res.present == 1.0)
        self._schedule = self.policy.next_schedule(
            res.round, [float(res.push_times[k]) for k in present], [float(c) for c in res.compute_s]
        )
        self._superstep_compute = []
        self.barriers["decision_s"] += self._schedule.decision_s
        if self._trace is not None:
            self._write({"event": "barrier", "rank": self.rank, "t": self._now(), **self._schedule.record()})

    def _final_round(self, apply_mean):
        """The late gradients held when training ends, compensated and applied everywhere."""
        holders = self.exchange.call(
            lambda: self.cluster.allgather_object(self._held is not None, name="tfsync.final_round"),
            timeout_s=self.wait_timeout_s,
        )
        holders = [r for r, holds in enumerate(holders) if holds]
        if not holders:
            return
        round_, late = self.step, None
        if self._held is not None:
            stamp, payload = self._held
            late = (stamp, self.protocol.compensate(payload))  # w_now: the final weights
        total = self.exchange.final_round(round_, late, holders, self.protocol.absent(), self.wait_timeout_s)
        apply_mean(total)
        if self._held is not None:
            self._held = None
            self._own_compensated += 1
        compensated = self._own_compensated
        self._count_drops()
        if self._trace is not None:
            self._write(
                {
                    "event": "final_round",
                    "rank": self.rank,
                    "t": self._now(),
                    "round": round_,
                    "late": holders,
                    "compensated": compensated,
                }
            )

    def _hold_late(self, round_):
        """This worker's contribution to ``round_`` missed it: keep it, and the weights it was
        computed on, for compensation (a worker holds one at most: an older one is dropped)."""
        payload = self.exchange.withdraw(round_)
        if payload is None:
            return
        if self._held is not None:
            self.exchange.drop(self._held[0], round_)
        self._held = (round_, payload)
        self.protocol.keep_weights()

    def _count_drops(self):
        """This worker's contributions dropped since the last call, counted; ``[[stamp, round]]``."""
        drops = [[int(s), int(r)] for s, r in self.exchange.take_drops()]
        for key, n in (
            ("produced", self._produced),
            ("applied", self._own_applied),
            ("compensated", self._own_compensated),
            ("dropped", len(drops)),
        ):
            self.totals[key] += n
            self.counts[key] += n
        self._produced = self._own_applied = self._own_compensated = 0
        return drops

    def _wait_round(self, round_):
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            try:
                done = self.exchange.wait(round_, min(WAIT_POLL_S, max(deadline - time.monotonic(), 0.0)))
            except Exception as exc:  # the collective failed: find out who is gone
                if self.exchange.inline_expired is not None:  # no: its inline wait reached the bound
                    self.control.report(self._last_pushed, min_interval_s=0.0)
                    raise self._diagnosis.stop(self._diagnosis.timeout_error(self.exchange.inline_expired)) from exc
                raise self._diagnosis.stop(self._diagnosis.lost_error(round_, exc)) from exc
            if done:
                return
            self._diagnosis.check_while_waiting(round_, self._last_pushed, deadline)

    def _end_step(self, step, t_start, t_push, applied, skipped=False, waited_before_push_s=0.0):
        t_end = self._now()
        compute_s = t_push - t_start - waited_before_push_s
        wait_s = t_end - t_push + waited_before_push_s
        # staleness of a contribution: steps between its round and the step that next uses it
        staleness = [step - r for r, _, _ in applied]
        compensated = self._own_compensated  # (moved into the totals by _count_drops)
        drops = self._count_drops()
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
        if self._at_barrier == step:
            self._at_barrier = None
            self.barriers["count"] += 1
            self.barriers["wait_s"] += wait_s
        elif self._schedule is not None and not skipped:  # a moving average: recent steps count most
            self._post_push_s += POST_PUSH_SMOOTHING * (t_end - t_push - self._post_push_s)
        granted = step in self._granted
        self._granted.discard(step)
        tot = self.totals
        tot["steps"] += 1
        tot["compute_s"] += compute_s
        tot["wait_s"] += wait_s
        tot["skipped"] += int(skipped)
        self.counts["skipped"] += int(skipped)
        if self._trace is not None:
            self._write(
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
                    "applied_through": self._applied_through,
                    "dropped": len(drops),
                    "drops": drops,
                    "compensated": compensated,
                    "skipped": skipped,
                    **({"granted": granted} if self._dssp else {}),
                    **({"queued_blocks": self._pull.queued, **self._pull.counts} if self._pull is not None else {}),
                }
            )
            if self._closing_grant is not None:
                self._write({"event": "grant", "rank": self.rank, **self._closing_grant, "actual_wait_s": wait_s})
        self._closing_grant = None
        self.step = step + 1
        self._t_step_start = t_end

    def _record_extra_wait(self, t, applied):
        wait_s = self._now() - t
        self.totals["wait_s"] += wait_s
        compensated = self._own_compensated
        drops = self._count_drops()
        if self._trace is not None:
            self._write(
                {
                    "event": "finish",
                    "rank": self.rank,
                    "t": t,
                    "wait_s": wait_s,
                    "applied": [[r, self.step - 1 - r, n] for r, n, _ in applied],
                    "stamps": [[r, s] for r, _, s in applied],
                    "applied_through": self._applied_through,
                    "dropped": len(drops),
                    "drops": drops,
                    "compensated": compensated,
                }
            )

    def _write(self, record):
        self._trace.write(json.dumps(record) + "\n")
