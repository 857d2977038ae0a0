"""BSP's round as in-graph ops: a steady-state step that never leaves the compiled train step.

Plain Horovod decides its exchange once and then runs an in-graph op whose work happens in
Horovod's C++ background thread.  BSP's round can be the same: its result is the mean of
every worker's gradients, every rank enters every round, and nothing is decided per step.
So where nothing needs the engine's Python on the step's path, the round is
``hvd.grouped_allreduce(gradients, op=Average)`` inside the compiled step, followed by one
read-only finiteness pass over the mean (:func:`tfsync.ops.all_finite`), and the step's counts
and times are kept in variables (:class:`GraphRound`), read where users see them (the epoch
logs, the finish check: :meth:`GraphRound.fold`).

Every guarantee of the Python path holds:

* A mean that is not finite (some worker's gradients had a NaN or an infinity, or finite ones
  overflowed in their sum) is seen by every rank alike, and every rank then runs that step
  through the engine's Python path (:meth:`SyncEngine.sync_step
  <tfsync.engine.SyncEngine.sync_step>`), whose checked round rejects the contributions that
  are not finite, counts them, warns or raises (``on_nonfinite``) and returns a finite mean.
  That is the rare step; the steady state crosses into Python never.
* The wait is bounded: a watch thread (:meth:`GraphRound.attach`) reads the round's start
  from a variable every :data:`WATCH_S`, reports this worker's clock to the control path
  (what the Python path's steps do, throttled the same way), and aborts the collective (the
  cluster's ``abort``: ``hvd.shutdown()``) once a round runs past the wait bound; the
  frontend then raises the engine's diagnosis, naming the ranks at fault
  (:meth:`GraphRound.error`).
* Counts: every in-graph step is one contribution produced and applied, and its round's
  bytes, folded into the engine's tally whenever the engine's counts or totals are read.

Where the in-graph round is not used (:func:`step_path` says why), the same compiled step
runs the Python path (``tf.cond`` on :attr:`GraphRound.enabled`), so a step compiled once
serves any later engine: a trace (its per-step records), simulated stragglers (per-step
sleeps), gradient compression, an elastic job (its resets count rounds in flight), more than
one host (a Gloo transfer to a cut-off host is not ended by an abort, which the exchange
thread's polling wait covers), weights that are not all float32 (one grouped call per dtype),
and the in-process test cluster; and, by the optimizer path's own choice, auto mode's step
(shared by every gradient mode) and ``SyncStrategy``'s (its engine starts while the step is
traced).  The choice is part of the configuration every rank agrees
on before the first step (:mod:`tfsync.engine.agreement`): the ranks run the same collectives.
"""

import threading
import time

import tensorflow as tf

from tfsync import ops
from tfsync.engine._tf import state_variable
from tfsync.engine.cluster import HorovodCluster

WATCH_S = 0.25  # how often the watch thread reads the step's variables (so an abort comes at most this late)


IN_GRAPH = "in-graph"


def step_path(engine, protocol_cls, tensors) -> str:
    """:data:`IN_GRAPH` where this engine's rounds can run in the compiled step, else the
    engine's path and why (``"the engine's: a trace is written"``): decided once, from what this
    rank knows before the ranks agree on their configuration, so a rank that differs (one that
    traces alone) is named with the reason before any round runs.  ``protocol_cls``: the step
    protocol the policy names; ``tensors``: what the engine starts on.  The engine adds that
    every rank is on one host once it knows the hosts."""
    s = engine.stragglers
    reasons = {
        "the mode decides per step": not engine.policy.every_round_whole
        or any(c is not engine.nonfinite for c in engine.components),
        "the step protocol is not the gradient exchange": protocol_cls.payload != "gradients",
        "a trace is written": bool(engine.trace_dir),
        "stragglers are simulated": bool(s.base_s or s.slow_ranks or s.rare_prob or s.jitter_s or s.pull_prob),
        "the job is elastic": bool(engine.elastic),
        "gradients are compressed": getattr(engine.policy, "compression", None) is not None,
        "not every weight is float32": any(tf.as_dtype(t.dtype) != tf.float32 for t in tensors),
        "the cluster is not Horovod's": not isinstance(engine.cluster, HorovodCluster),
    }
    why = "; ".join(k for k, v in reasons.items() if v)
    return f"the engine's: {why}" if why else IN_GRAPH


class GraphRound:
    """The in-graph round of one optimizer path and its variables (module docstring).

    It belongs to the path (:class:`~tfsync.engine.protocols.gradient.ExchangeBefore`), as the
    compiled step does, and serves each engine that path starts: :meth:`attach` resets the
    variables to the engine's step and enables the in-graph round where the engine's
    configuration allows it; :meth:`detach` disables it when that engine ends.
    """

    def __init__(self):
        with tf.init_scope():

            def var(value, dtype, name):
                return state_variable(tf.constant(value, dtype, name=f"tfsync_graph_{name}"))

            self.enabled = var(False, tf.bool, "enabled")
            # since the engine attached: [steps, rounds run in-graph (each one contribution produced
            # and applied), their compute seconds, their wait seconds] (float64: exact counts to 2**53)
            self.totals = var([0.0] * 4, tf.float64, "totals")
            self.ends = var([0.0, 0.0], tf.float64, "ends")  # [when the last step ended (time.time()), its wait]
            self.started = var(0.0, tf.float64, "started")  # when the running round started; 0: none
        self.engine = None
        self.expired = None  # the step whose round the watch thread aborted at the wait bound
        self._folded = (0, 0.0, 0.0)
        self._stop = None
        self._thread = None

    # ------------------------------------------------------------ the compiled step
    def round(self, grads, hvd, python_round):
        """The step's mean gradients (traced into the compiled step): in-graph where
        :attr:`enabled`, else ``python_round(grads)`` (the engine's Python path)."""
        grads = list(grads)
        return tf.cond(self.enabled, lambda: self._in_graph(grads, hvd, python_round), lambda: python_round(grads))

    def _in_graph(self, grads, hvd, python_round):
        t_push = tf.timestamp()
        with tf.control_dependencies([self.started.assign(t_push)]):
            outs = hvd.grouped_allreduce(grads, op=hvd.Average, name="tfsync.round.graph")
        finite = tf.reduce_all(ops.all_finite(outs))
        # not finite: every rank sees the same mean, so every rank redoes the step in Python
        mean = tf.cond(finite, lambda: outs, lambda: python_round(grads))
        with tf.control_dependencies(mean):
            t_end = tf.timestamp()
            wait_s = t_end - t_push
            fast = tf.cast(finite, tf.float64)  # (a step redone in Python counts itself)
            updates = [
                self.started.assign(0.0),
                self.totals.assign_add(tf.stack([1.0, fast, fast * (t_push - self.ends[0]), fast * wait_s])),
                self.ends.assign(tf.stack([t_end, wait_s])),
            ]
        with tf.control_dependencies(updates):
            return [tf.identity(m) for m in mean]

    # -------------------------------------------------------------- the engine's side
    def attach(self, engine, enabled: bool):
        """Serve ``engine`` (started): the variables at its step, the in-graph round enabled
        when ``enabled`` (every rank decided alike), and the watch thread started."""
        self.detach()
        self.engine, self.expired = engine, None
        with tf.init_scope():  # (now, also when the step that traces this round calls it)
            self.totals.assign([float(engine.step), 0.0, 0.0, 0.0])
            self.ends.assign([time.time(), 0.0])
            self.started.assign(0.0)
            self.enabled.assign(enabled)
        self._folded = (0, 0.0, 0.0)
        engine.graph = self
        if enabled:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._watch, args=(engine, self._stop), daemon=True)
            self._thread.name = "tfsync-graph-watch"
            self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def detach(self):
        """The engine ended: the compiled step goes back to the Python path for whatever comes
        next, and the watch thread ends."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(2 * WATCH_S + 1.0)
            self._thread = None
        with tf.init_scope():
            self.enabled.assign(False)

    def leave(self, engine):
        """``engine`` ends: its in-graph steps folded in, then :meth:`detach`."""
        if engine is self.engine:
            self.fold(engine)
            self.detach()

    def fold(self, engine):
        """Bring the engine up to the in-graph steps: its step number, and the steps' counts,
        times and bytes into its tally (call between steps, on the training thread)."""
        if self._thread is None or engine is not self.engine:
            return
        step, rounds, compute_s, wait_s = self.totals.numpy().tolist()
        n, c, w = int(rounds) - self._folded[0], compute_s - self._folded[1], wait_s - self._folded[2]
        self._folded = (int(rounds), compute_s, wait_s)
        engine.step = int(step)
        engine.applied_through = engine.last_pushed = engine.step - 1
        engine._t_step_start = float(self.ends.numpy()[0]) - engine.t0
        if n:
            tally = engine.tally
            for key in ("produced", "applied"):
                tally.counts[key] += n
                tally.totals[key] += n
            tally.totals["steps"] += n
            tally.totals["compute_s"] += c
            tally.totals["wait_s"] += w
            engine.wire.bytes.count_calls(engine.protocol.shapes, engine.protocol.dtypes, n)
            tally.add_bytes(engine.wire.bytes.take())

    def last(self, engine) -> dict:
        """``engine.last``: the last step's figures, the Python path's where it ran."""
        if self._thread is None or engine is not self.engine:
            return engine._last
        return {"wait_s": float(self.ends.numpy()[1]), "staleness": 0}

    def error(self, engine, exc):
        """The engine's error for a failed in-graph round (``exc``: Horovod's op error): the
        wait bound's when the watch thread aborted it, else a lost or stopped peer's."""
        step = int(self.totals.numpy()[0])
        if self.expired is not None:
            return engine.stop(engine._diagnosis.timeout_error(self.expired))
        return engine.stop(engine._diagnosis.lost_error(step, exc))

    def _watch(self, engine, stop):
        """Report this worker's clock as its steps pass (rank 0's control path names the ranks
        behind from it) and abort a round past the wait bound."""
        while not stop.wait(WATCH_S):
            started = float(self.started.numpy())
            step = int(self.totals.numpy()[0])
            if not started:
                engine.control.report(step - 1)
                continue
            # pushed, the round for ``step`` runs: past a second this worker waits for its peers,
            # which a timeout must not count against it (as the inline round's watchdog reports)
            waited = time.time() - started
            engine.control.report(step, **({"min_interval_s": 0.0, "waiting": True} if waited >= 1.0 else {}))
            if waited >= engine.wait_timeout_s and self.expired is None:
                self.expired = step
                engine.cluster.abort()


__all__ = ["IN_GRAPH", "GraphRound", "WATCH_S", "step_path"]
