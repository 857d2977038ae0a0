"""``SyncCallback``: tfsync's synchronization for an ordinary compiled Keras 3 model.

Horovod's own Keras layer does not work on Keras 3 (upstream issue 4290), so
this is written against Keras 3's public hooks: the callback wraps the model
optimizer's ``apply_gradients`` for the duration of ``fit`` and retraces the
train function, so the exchange runs inside the compiled step for any Keras
optimizer.
"""

import json
import logging
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfsync import _horovod
from tfsync.engine import COUNTS, SyncEngine, protocols
from tfsync.engine.protocols import tf_variable
from tfsync.engine.pull import PartialPull
from tfsync.engine.tf_bridge import (
    OptimizerBlocks,
    check_blockwise_optimizer,
    correct_gradients,
    exchange_gradients,
    exchange_gradients_blockwise,
    exchange_updates,
    skippable_train_step,
)
from tfsync.keras.statistics import average_statistics
from tfsync.launch import describe_mode
from tfsync.policies import Auto, resolve_mode
from tfsync.policies.auto import PROFILES, classify, early

log = logging.getLogger("tfsync.auto")


class SyncCallback(keras.callbacks.Callback):
    """Synchronize data-parallel training across Horovod workers.

    Put it first in ``callbacks`` so the tfsync metrics it adds to the logs
    reach later callbacks (``TensorBoard``, ``EarlyStopping``, the progress bar).

    On ``on_train_begin`` it broadcasts rank 0's weights, checks that every
    rank runs the same configuration and number of steps, and starts the
    engine; on ``on_train_end`` it waits for every in-flight round, so all
    replicas end with identical weights (and, with ``average_statistics``,
    identical non-trainable statistics).  State is reset at every ``fit``.

    Args:
        mode: ``"bsp"`` (default), ``"ssp"``, ``"dssp"``, ``"elasticbsp"``, ``"psp"``, ``"backup"``,
            ``"dcs3gd"``, ``"auto"`` or a policy object such as ``tfsync.SSP(staleness=3)`` or
            ``tfsync.PSP(min_contributions=3)``.  ``"auto"`` (``tfsync.Auto``) classifies the
            workers' measured iteration times (first after ``window_steps`` steps, mid-epoch, or
            after ``tfsync.policies.auto.EARLY_STEPS`` under BSP when one worker is persistently
            slow; then at epoch ends) and switches to the mode chosen for the profile; each decision
            is in ``auto_decisions``, the trace
            (``trace_dir/auto.jsonl``; each mode's engine traces to ``trace_dir/<k>-<mode>/``)
            and the epoch logs (``tfsync_auto_profile``, ``tfsync_auto_switches``).
        stragglers: ``tfsync.Stragglers`` to inject simulated delays; default:
            from the ``TFSYNC_STRAGGLERS`` environment variable (off if unset).
        trace_dir: write a JSON-lines trace per worker there (default: none).
        wait_timeout_s: bound on one wait for peers (default 120 s).
        average_epoch_logs: average the epoch logs over workers, as Horovod's
            ``MetricAverageCallback`` does (default True).  This waits for every
            worker to finish the epoch.
        average_statistics: at the end of ``fit``, set the model's non-trainable
            floating-point variables (``BatchNormalization``'s moving mean and
            variance) to their mean over the workers, so every replica ends
            identical, statistics included (default True;
            :func:`tfsync.keras.average_statistics`).  Each worker's statistics
            follow its own batches during training, as under plain Horovod.

    Logs added: per batch ``tfsync_wait_s``, ``tfsync_staleness``; per epoch
    ``tfsync_wait_fraction`` and this worker's contributions: ``tfsync_produced``
    = ``tfsync_applied`` + ``tfsync_compensated`` (applied after a delay
    compensation, DC-S3GD) + ``tfsync_dropped`` (the last epoch's counts include
    the contributions drained at its end), and ``tfsync_skipped`` steps (PSP,
    backup workers: steps whose round closed before this worker computed it).
    With PSP's partial pulling also ``tfsync_blocks``, ``tfsync_late_blocks``
    and ``tfsync_delayed_blocks`` (since ``fit`` began).
    Averaged over workers with ``average_epoch_logs``.

    Example::

        hvd.init()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
                  callbacks=[tfsync.keras.SyncCallback(mode=tfsync.SSP(staleness=3))])
    """

    def __init__(
        self,
        mode="bsp",
        *,
        stragglers=None,
        trace_dir=None,
        wait_timeout_s=None,
        average_epoch_logs=True,
        average_statistics=True,
    ):
        super().__init__()
        mode = resolve_mode(mode)
        self.auto = mode if isinstance(mode, Auto) else None
        self.policy = mode.initial if self.auto else mode
        self._engine_args = dict(stragglers=stragglers, trace_dir=trace_dir, wait_timeout_s=wait_timeout_s)
        SyncEngine(self.policy, **self._engine_args)  # validates the arguments now
        self.auto_decisions = []
        self.average_epoch_logs = average_epoch_logs
        for flag, value in (("average_epoch_logs", average_epoch_logs), ("average_statistics", average_statistics)):
            if not isinstance(value, bool):
                raise TypeError(f"tfsync.keras.SyncCallback: {flag} must be True or False, got {value!r}")
        self.average_statistics = average_statistics
        self.engine = None

    # -------------------------------------------------------------------- train
    def on_train_begin(self, logs=None):
        hvd = _horovod.horovod()
        model = self.model
        if getattr(model, "optimizer", None) is None:
            raise ValueError(
                "tfsync.keras.SyncCallback: the model has no optimizer; call "
                "model.compile(optimizer=..., loss=...) before model.fit"
            )
        steps = self.params.get("steps")
        all_steps = hvd.allgather_object(steps, name="tfsync.steps")
        if len(set(all_steps)) != 1 or steps is None:
            raise ValueError(
                f"tfsync: the ranks run different or unknown numbers of steps per epoch "
                f"({all_steps}); every worker must take the same number of steps: shard the data "
                f"into equal parts (e.g. x[rank::size] with len(x) divisible by size) or pass "
                f"steps_per_epoch to model.fit"
            )
        self._broadcast_weights(hvd, model)
        self.variables = list(model.trainable_variables)
        self._steps = steps
        self._earlier_counts = dict.fromkeys(COUNTS, 0)  # of the engines auto mode stopped
        self._compiled_kind = None  # what the compiled train step serves, if engines can share it
        if self.auto is not None:
            self.policy = self.auto.initial
            self.auto_decisions, self._segment, self._switches = [], 0, 0
            self._window, self._window_steps, self._candidate = [], 0, (None, 0)
            self._shared = [[] for _ in range(hvd.size())]  # every rank's times, from BSP's rounds
            self._steps_left = steps * self.params.get("epochs", 1)
            if hvd.size() < 2:
                raise ValueError("tfsync.keras.SyncCallback: mode 'auto' compares workers; launch 2 or more")
            for policy in (self.auto.initial, *self.auto.modes.values()):
                policy.validate(hvd.size())  # before training, not at a switch
        self._start_engine()

    def _start_engine(self):
        """Start the engine of ``self.policy``; compile a train step for it unless the one
        compiled already serves it (auto mode between gradient-protocol modes)."""
        model, engine_args = self.model, dict(self._engine_args)
        if self.policy.pulls_partially:
            check_blockwise_optimizer(model.optimizer, self.policy)
        if self.auto is not None and engine_args["trace_dir"]:
            name = f"{self._segment}-{self.policy.name}"
            engine_args["trace_dir"] = os.path.join(engine_args["trace_dir"], name)
        self.engine = SyncEngine(self.policy, **engine_args)
        self.engine.start(
            self.variables, extra_config={"steps": self._steps, "optimizer": type(model.optimizer).__name__}
        )
        if self._keeps_step(self.policy):
            return
        kind = self._compiled_kind = self._step_kind(self.policy)
        self._wrap_optimizer(model.optimizer)
        if self.policy.skips or kind is not None:
            # (partial pulling: the engine applies the rounds itself, block by block)
            blockwise = self.engine.find(PartialPull) is not None
            apply_mean = self._apply_mean if self.engine.protocol.reduces_gradients and not blockwise else None
            model.train_step = skippable_train_step(
                lambda: self.engine, model, type(model).train_step.__get__(model), apply_mean
            )
        model.make_train_function(force=True)
        train_function = model.train_function

        def train_function_reraising(iterator):
            try:
                return train_function(iterator)
            except tf.errors.OpError as exc:
                if self.engine.error is not None:  # a tfsync error surfaced through the graph
                    raise self.engine.error from exc
                raise

        model.train_function = train_function_reraising

    def _step_kind(self, policy):
        """What the compiled train step must do for ``policy``, when auto mode can share it
        between engines; None when each engine needs its own (or auto mode is off).

        Gradient-protocol modes (BSP, PSP, backup workers) share one: the skippable step
        (under BSP it never skips), whose exchange finds the current engine at every step,
        so a switch among them costs no retracing.  Update protocols (SSP family,
        DC-S3GD) keep their state in variables of their own: a step per engine.
        """
        if self.auto is None:
            return None
        protocol = protocols.for_policy(policy)
        return "gradients" if protocol.reduces_gradients and not protocol.corrects_gradients else None

    def _keeps_step(self, policy):
        """Whether the compiled train step serves ``policy``'s engine as it is."""
        kind = self._step_kind(policy)
        return kind is not None and kind == self._compiled_kind

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._unmeasured = epoch, True
        self._switched_totals = None  # the epoch's totals of engines auto mode stopped during it
        if self.engine is not None:
            self.engine.reset_totals()

    def on_train_batch_end(self, batch, logs=None):
        if self.engine is None:
            return
        last = self.engine.last
        if logs is not None:
            logs["tfsync_wait_s"] = last.get("wait_s", 0.0)
            logs["tfsync_staleness"] = last.get("staleness", 0)
        if self.auto is not None:
            self._window_steps += 1
            self._steps_left -= 1
            # an epoch's first step also times what ran between epochs (evaluation, callbacks), and
            # an engine's first step its retracing: left out, or they would look like rare delays
            measured = not self._unmeasured
            if measured and not last.get("skipped", 0) and "compute_s" in last:
                self._window.append(last["compute_s"])
            self._unmeasured = False
            if self.auto_decisions:
                return
            # before the first decision under BSP: every round's metadata has every rank's time,
            # the same table on every rank, so a persistently slow worker is acted on early
            # (auto.early) at the same step everywhere, without a gather
            times = last.get("round_compute_s")
            if self.policy.name != "bsp" or times is None:
                self._shared = None  # not every rank's time in this step's round: no shared table
            elif measured and self._shared is not None:
                for row, t in zip(self._shared, times):
                    row.append(float(t))
                found = early(self._shared) if self._steps_left >= self.auto.window_steps else None
                if found is not None:
                    self._auto_decide(self._epoch, batch, found=found)
                    return
            # the first decision as soon as the window is full, mid-epoch included (Keras looks
            # its train function up at every step); the later ones at epoch ends (on_epoch_end)
            if self._window_full():
                self._auto_decide(self._epoch, batch)

    def _window_full(self):
        """A decision is due: a full window, and enough steps left for a switch to pay."""
        return self._window_steps >= self.auto.window_steps and self._steps_left >= self.auto.window_steps

    @property
    def counts(self):
        """This worker's contributions over the whole ``fit`` (every engine auto mode ran)."""
        now = self.engine.counts if self.engine is not None else dict.fromkeys(COUNTS, 0)
        return {k: self._earlier_counts[k] + now[k] for k in COUNTS}

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self.engine is None:
            return
        if epoch + 1 == self.params.get("epochs"):
            # drain the rounds still in flight now, so the last epoch's logs count every
            # contribution (on_train_end drains again if fit stops early)
            self._drain()
        if self.auto is not None and self.auto_decisions and self._window_full():
            # at the epoch end, where the epoch logs' averaging waits for every worker anyway: a
            # decision mid-epoch is one more barrier, which a rare delay makes every worker wait
            # at.  Before the logs: a switch's drain applies rounds this epoch's counts include.
            self._auto_decide(epoch, self._steps - 1)
        tot = self.engine.totals
        if self._switched_totals is not None:
            tot = {k: self._switched_totals[k] + tot[k] for k in tot}
        busy = tot["wait_s"] + tot["compute_s"]
        logs["tfsync_wait_fraction"] = tot["wait_s"] / busy if busy else 0.0
        for key in COUNTS:
            logs[f"tfsync_{key}"] = float(tot[key])
        pull = self.engine.find(PartialPull)
        for key, n in (pull.counts if pull is not None else {}).items():  # partial pulling, since fit began
            logs[f"tfsync_{key}"] = float(n)
        if self.average_epoch_logs:
            hvd = _horovod.horovod()
            keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
            values = np.array([float(logs[k]) for k in keys], np.float64)
            mean = self.engine.exchange.call(
                lambda: hvd.allreduce(tf.constant(values), op=hvd.Average, name="tfsync.epoch_logs").numpy(),
                timeout_s=self.engine.wait_timeout_s,
            )
            logs.update({k: float(v) for k, v in zip(keys, mean)})
        if self.auto is not None and self.auto_decisions:
            logs["tfsync_auto_profile"] = float(PROFILES.index(self.auto_decisions[-1]["profile"]))
            logs["tfsync_auto_switches"] = float(self._switches)

    def _auto_decide(self, epoch, batch, found=None):
        """Classify the window's step times (every rank the same table, the same answer); switch
        at the first decision, later only after ``confirm`` consecutive decisions agree.

        Every rank calls this after the same step (the same window length and steps left).
        ``found``: the profile :func:`tfsync.policies.auto.early` found in every rank's times
        from BSP's replicated metadata (an early decision), instead of gathering the windows."""
        hvd = _horovod.horovod()
        window, t = self._window, time.monotonic()
        profile = found
        if found is None:
            every = self.engine.exchange.call(
                lambda: hvd.allgather_object(window, name="tfsync.auto.window"),
                timeout_s=self.engine.wait_timeout_s,
            )
        wait_s = time.monotonic() - t
        self._window, self._window_steps, self._shared = [], 0, None
        if found is None:
            if min(len(w) for w in every) == 0:
                return  # a worker computed nothing in the window (it skipped every step): decide later
            profile = classify(every)
        current = self.auto_decisions[-1]["profile"] if self.auto_decisions else None
        in_force, self._candidate = self.auto.in_force(current, self._candidate, profile.name)
        wanted = self.auto.mode_for(in_force)
        switch = wanted != self.policy
        decision = {
            "epoch": epoch,
            "batch": batch,
            "profile": in_force,
            "observed": profile.name,
            "reason": profile.reason,
            "slowest_ratio": profile.slowest_ratio,
            "rare_fraction": profile.rare_fraction,
            "spread": profile.spread,
            "steps": profile.steps,
            "early": found is not None,  # from the rounds' metadata after auto.EARLY_STEPS steps
            "running": describe_mode(self.policy),
            "mode": describe_mode(wanted),
            "switched": switch,
            "wait_s": wait_s,  # this rank's wait for the others to reach the decision
        }
        self.auto_decisions.append(decision)
        if switch:
            t = time.monotonic()
            decision["retraced"] = self._switch(wanted)
            decision["switch_s"] = time.monotonic() - t  # the retracing, if any, is in the next step
        if hvd.rank() == 0:
            log.info(
                "tfsync auto, epoch %d batch %d: %s (%s) -> %s",
                epoch,
                batch,
                profile.name,
                profile.reason,
                decision["mode"],
            )
            if self._engine_args["trace_dir"]:
                with open(os.path.join(self._engine_args["trace_dir"], "auto.jsonl"), "a") as f:
                    f.write(json.dumps({"event": "auto", **decision}) + "\n")

    def _switch(self, policy):
        """Drain the running mode (identical weights on every replica), give every replica rank 0's
        optimizer state, and start ``policy``'s engine (collective).  Returns whether the train
        step was compiled again."""
        keep_step = self._keeps_step(policy)
        self._stop_engine(keep_step=keep_step)
        for k in COUNTS:
            self._earlier_counts[k] += self.engine.counts[k]
        before, now = self._switched_totals, self.engine.totals
        self._switched_totals = now if before is None else {k: before[k] + now[k] for k in now}
        self._unmeasured = not keep_step  # the new engine's first step retraces
        hvd = _horovod.horovod()
        opt = self.model.optimizer
        hvd.broadcast_variables([tf_variable(v) for v in self.model.variables + list(opt.variables)], root_rank=0)
        self.policy = policy
        self._segment += 1
        self._switches += 1
        self._start_engine()
        return not keep_step

    def on_train_end(self, logs=None):
        if self.engine is None or not self.engine.started:
            return
        self._stop_engine()
        if self.average_statistics:  # the engine is closed: no other thread issues collectives
            average_statistics(self.model)

    # ---------------------------------------------------------------- internals
    def _stop_engine(self, keep_step=False):
        """Drain, unwrap and close the running engine (it stays in ``engine`` for its counts and
        totals); ``keep_step``: the compiled train step stays for the next engine."""
        try:
            self._drain()
        finally:
            if not keep_step:
                self._unwrap_optimizer()
                if "train_step" in vars(self.model):
                    del self.model.train_step
                self._compiled_kind = None
            self.engine.close()
            if not keep_step:
                self.model.make_train_function(force=True)

    def _drain(self):
        """Wait for every round in flight and load the final weights (identical on all ranks)."""
        # compensate=: the late gradients still held get one last round, applied by the optimizer
        self.engine.finish(apply_mean=self._apply_mean)

    @staticmethod
    def _broadcast_weights(hvd, model):
        """Every model variable (trainable or not) from rank 0, in its own dtype.

        Horovod's ``broadcast_variables`` launches the broadcasts together in
        one compiled function and assigns in place: no copy of the model is
        assembled on the host.
        """
        hvd.broadcast_variables([tf_variable(v) for v in model.variables], root_rank=0)

    def _wrap_optimizer(self, optimizer):
        engine, expected = self.engine, [id(v) for v in self.variables]
        pull = engine.find(PartialPull)
        current = engine if self._compiled_kind is None else (lambda: self.engine)
        original = type(optimizer).apply_gradients.__get__(optimizer)

        def apply_gradients(grads_and_vars):
            grads_and_vars = list(grads_and_vars)
            grads = [g for g, _ in grads_and_vars]
            variables = [v for _, v in grads_and_vars]
            if [id(v) for v in variables] != expected:
                raise ValueError(
                    "tfsync: the optimizer was asked to update other variables than the "
                    "model's trainable weights at the start of fit; do not change "
                    "trainability during fit"
                )
            if pull is not None:
                return exchange_gradients_blockwise(current, grads, lambda mean: original(zip(mean, variables)))
            if engine.protocol.reduces_gradients:
                return original(zip(exchange_gradients(current, grads), variables))
            if engine.protocol.corrects_gradients:
                grads = correct_gradients(engine, grads)
            result = original(zip(grads, variables))
            exchange_updates(engine, variables)
            return result

        optimizer.apply_gradients = apply_gradients
        self._wrapped_optimizer = optimizer
        if pull is not None:
            pull.applier = OptimizerBlocks(optimizer, original, self.variables, pull.groups)
        # a skipped step applies the round's mean without exchanging again
        self._apply_mean = lambda mean: original(zip(mean, self.variables))

    def _unwrap_optimizer(self):
        opt = getattr(self, "_wrapped_optimizer", None)
        if opt is not None and "apply_gradients" in vars(opt):
            del opt.apply_gradients
        self._wrapped_optimizer = None
