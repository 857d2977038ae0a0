"""``SyncCallback``: tfsync's synchronization for an ordinary compiled Keras 3 model.

Horovod's own Keras layer does not work on Keras 3 (upstream issue 4290), so
this is written against Keras 3's public hooks: the callback wraps the model
optimizer's ``apply`` (Keras 3's one entry for updates: ``apply_gradients``
calls it) for the duration of ``fit`` and retraces the train function, so the
exchange runs inside the compiled step for any Keras optimizer and any
``train_step`` that applies its gradients through it.
"""

import json
import logging
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfsync.engine import COUNTS, lifecycle
from tfsync.engine.pull import PartialPull
from tfsync.engine.tally import SETTLED
from tfsync.engine.tf_bridge import (
    LossScaling,
    OptimizerBlocks,
    after_optimizer,
    apply_if_finite,
    before_optimizer,
    before_optimizer_unscaled,
    check_accumulation,
    check_blockwise_optimizer,
    exchange_gradients_blockwise,
    gradients_finite,
    guards_optimizer,
    is_loss_scaled,
    skippable_train_step,
    static_loss_scale,
)
from tfsync.frontend import FINGERPRINT_FIX, Frontend, fingerprint
from tfsync.keras.statistics import average_statistics, floating_statistics
from tfsync.policies import Auto, resolve_mode
from tfsync.policies.auto import AutoController

log = logging.getLogger("tfsync.auto")


class SyncCallback(keras.callbacks.Callback):
    """Synchronize data-parallel training across Horovod workers.

    Put it first in ``callbacks`` so the tfsync metrics it adds to the logs
    reach later callbacks (``TensorBoard``, ``EarlyStopping``, the progress bar).

    On ``on_train_begin`` it checks that every rank runs the same number of
    steps, mode, model (each variable's path, dtype, shape and trainability;
    the layers' classes) and optimizer (class and ``get_config()``; a learning
    rate held in a variable is state, not compared), and names the first
    difference if not; broadcasts rank 0's variables, the model's and the
    optimizer's (iterations, slots, learning rate, a loss scale: a checkpoint
    loaded on one rank alone cannot leave the replicas apart), and starts the
    engine; on ``on_train_end`` it waits for every in-flight round, so all
    replicas end with identical weights (and, with ``average_statistics``,
    identical non-trainable statistics).  State is reset at every ``fit``.

    Synchronized: every update through the model optimizer's ``apply`` or
    ``apply_gradients``, from Keras' own ``train_step`` or a custom one;
    mixed precision's ``LossScaleOptimizer`` (under a gradient-exchanging mode
    every rank skips the steps whose gradients overflowed on any rank, and the
    loss scales stay identical: :class:`tfsync.engine.tf_bridge.LossScaling`);
    ``gradient_accumulation_steps`` under ``"bsp"``, ``"psp"`` and ``"backup"``
    (each step's gradients are averaged over the workers before they are
    accumulated, which gives the same update).  Refused before the first step,
    saying why and what to do instead: a ``train_step`` that does not call
    ``apply``/``apply_gradients`` exactly once (another optimizer, or
    ``assign_sub``, would train each worker alone); gradient accumulation under
    a mode that exchanges updates (``"ssp"``, ``"dssp"``, ``"elasticbsp"``,
    ``"dcs3gd"``, ``"localsgd"``, ``"diloco"``, and ``"auto"`` with any of them),
    whose staleness (or period) counts steps that would not be updates.

    Args:
        mode: ``"bsp"`` (default), ``"ssp"``, ``"dssp"``, ``"elasticbsp"``, ``"psp"``, ``"backup"``,
            ``"dcs3gd"``, ``"localsgd"``, ``"diloco"``, ``"auto"`` or a policy object such as
            ``tfsync.SSP(staleness=3)``, ``tfsync.PSP(min_contributions=3)`` or
            ``tfsync.DiLoCo(inner_steps=8)``.  Under ``"localsgd"`` and ``"diloco"`` only every
            ``H``-th step is a contribution (an outer step: the counts count outer steps, and the
            per-batch ``tfsync_wait_s`` is the last outer step's), and the model's non-trainable
            floating-point variables are averaged with the weights at every outer step.
            ``"auto"`` (``tfsync.Auto``) classifies the
            workers' measured iteration times (first after ``window_steps`` steps, mid-epoch, or
            after ``tfsync.policies.auto.EARLY_STEPS`` under BSP when one worker is persistently
            slow; then at epoch ends) and switches to the mode chosen for the profile; each decision
            is in ``auto_decisions`` (one put off because a worker computed no step in the
            window: ``auto_deferred``), the trace
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
        cluster: the job's ranks (:mod:`tfsync.engine.cluster`); default: Horovod's.  Every
            collective of the callback and its engine goes through it; the single-process
            tests pass ranks on threads of one process.
        on_nonfinite: ``"reject"`` (default): a worker's contribution with a NaN or an
            infinity goes into no round (every replica applies the others' mean; counted as
            ``tfsync_rejected``); ``"raise"``: the job stops with
            ``tfsync.engine.NonFiniteError`` naming the rank and the step.
        elastic: a :class:`tfsync.elastic.KerasState` (default None): elastic training under
            ``tfsync.elastic.run`` and horovodrun's elastic launcher.  At every epoch end the
            callback commits the state (the model, the optimizer, the next epoch, the job's
            contributions summed over the workers); a failed collective raises at once, so
            the job resets without waiting for loss reports; at a reset the contributions in
            flight are counted ``tfsync_lost``.  ``counts`` and the logs then cover the whole
            training of this process, across resets; each reset's engine traces to
            ``trace_dir/reset<k>/``.  Refused when the mode cannot run on the membership's size
            (``BackupWorkers(backups=1)`` on one worker).  See ``docs/guide/elastic.md``.

    Logs added: per batch ``tfsync_wait_s``, ``tfsync_staleness``; per epoch
    ``tfsync_wait_fraction`` and this worker's contributions: ``tfsync_produced``
    = ``tfsync_applied`` + ``tfsync_compensated`` (applied after a delay
    compensation, DC-S3GD) + ``tfsync_dropped`` (the last epoch's counts include
    the contributions drained at its end) + ``tfsync_rejected`` (a NaN or an
    infinity: left out of its round) + ``tfsync_lost`` (in flight when an elastic job reset;
    counted in the epoch that follows), and ``tfsync_skipped`` steps (PSP,
    backup workers: steps whose round closed before this worker computed it).
    With PSP's partial pulling also ``tfsync_blocks``, ``tfsync_late_blocks``
    and ``tfsync_delayed_blocks`` (since ``fit`` began).
    Averaged over workers with ``average_epoch_logs``.

    Example:

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
        cluster=None,
        on_nonfinite="reject",
        elastic=None,
    ):
        super().__init__()
        mode = resolve_mode(mode)
        if elastic is not None:
            from tfsync.elastic import KerasState

            if not isinstance(elastic, KerasState):
                raise TypeError(
                    f"tfsync.keras.SyncCallback: elastic must be a tfsync.elastic.KerasState or None, got "
                    f"{type(elastic).__name__}; pass elastic=tfsync.elastic.KerasState(model)"
                )
            elastic._attach(self)
        self.elastic = elastic
        for flag, value in (("average_epoch_logs", average_epoch_logs), ("average_statistics", average_statistics)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"tfsync.keras.SyncCallback: {flag} must be True or False, got {value!r}; "
                    f"pass {flag}=True (the default) or {flag}=False"
                )
        self.auto = mode if isinstance(mode, Auto) else None
        self.policy = mode.initial if self.auto else mode
        self._frontend = Frontend(
            self.policy,
            stragglers=stragglers,
            trace_dir=trace_dir,
            wait_timeout_s=wait_timeout_s,
            cluster=cluster,
            on_nonfinite=on_nonfinite,
            elastic=elastic is not None,
        )
        self._earlier_counts = dict.fromkeys(COUNTS, 0)
        self._committed_counts = dict.fromkeys(COUNTS, 0)  # elastic: this worker's, at the last commit
        self._carried_totals = None  # elastic: the totals of an epoch a reset interrupted
        self._folded = None  # elastic: the last engine whose counts are in _earlier_counts
        self._hosts_check_due = False  # elastic: a commit was made, the launcher's notices not yet checked
        self.average_epoch_logs = average_epoch_logs
        self.average_statistics = average_statistics
        self._controller = None

    @property
    def engine(self):
        """The running (or last) :class:`tfsync.engine.SyncEngine`; None before ``fit``."""
        return self._frontend.engine

    @property
    def auto_decisions(self):
        """Auto mode's decisions in this ``fit`` (:class:`tfsync.policies.auto.AutoController`)."""
        return self._controller.decisions if self._controller is not None else []

    @property
    def auto_deferred(self):
        """Auto mode's decisions put off in this ``fit``, because a worker computed no step in
        the window (a straggler whose steps were all skipped): ``{"epoch", "batch",
        "ranks_without_steps"}`` each; the next one is taken at a later epoch end."""
        return self._controller.deferred if self._controller is not None else []

    # -------------------------------------------------------------------- train
    def on_train_begin(self, logs=None):
        model, frontend = self.model, self._frontend
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "tfsync.keras.SyncCallback: the model has no optimizer; call "
                "model.compile(optimizer=..., loss=...) before model.fit"
            )
        if frontend.running:  # a fit that raised left its engine running (Keras skips on_train_end)
            frontend.engine.abandon()
        if self.elastic is not None:
            self._elastic_begin(model)
        self._check_optimizer(optimizer)  # (before any collective: every rank refuses alike)
        if not optimizer.built:  # its slots exist before they are compared and broadcast
            optimizer.build(model.trainable_variables)
        steps = self.params.get("steps")
        start = {
            "steps": steps,
            "mode": (self.auto if self.auto is not None else self.policy).config(),
            **fingerprint(model.variables, optimizer, model),
        }
        configs = frontend.allgather(
            start,
            "tfsync.steps",
            "every rank's steps per epoch, mode, model variables and optimizer, gathered at the start of fit",
        )
        all_steps = [c["steps"] for c in configs]
        if len(set(all_steps)) != 1 or steps is None:
            raise ValueError(
                f"tfsync: the ranks run different or unknown numbers of steps per epoch "
                f"({all_steps}); every worker must take the same number of steps: shard the data "
                f"into equal parts (e.g. x[rank::size] with len(x) divisible by size) or pass "
                f"steps_per_epoch to model.fit"
            )
        if steps < 1:  # (every rank's is the same: checked above)
            raise ValueError(
                f"tfsync: steps per epoch is {steps!r} (Keras' params['steps']: the data holds no batch); "
                f"expected an integer >= 1: an epoch without steps synchronizes nothing. Give every worker "
                f"at least one batch (e.g. tfsync.shard(x, y, batch_size=...) on data with at least "
                f"batch_size samples per worker)"
            )
        lifecycle.check_agreement(configs, "mode, model and optimizer", FINGERPRINT_FIX)
        # every variable training reads, from rank 0, in its own dtype: the model's (trainable or
        # not) and the optimizer's (iterations, slots, learning rate, loss scale, accumulators)
        frontend.broadcast_variables(
            model.variables + list(optimizer.variables),
            "tfsync.weights",
            "rank 0's weights and optimizer state, broadcast to every rank at the start of fit",
        )
        self.variables = list(model.trainable_variables)
        self._scaling = LossScaling(optimizer) if is_loss_scaled(optimizer) else None
        self._applies = 0  # calls of the optimizer's apply in the train step being traced
        self._steps = steps
        if self.elastic is None:  # (elastic: the whole training's, across resets)
            self._earlier_counts = dict.fromkeys(COUNTS, 0)  # of the engines auto mode stopped
        self._compiled_kind = None  # what the compiled train step serves, if engines can share it
        if self.auto is not None:
            self.policy, self._segment = self.auto.initial, 0
            self._controller = AutoController(
                self.auto,
                frontend.cluster.size(),
                steps * self.params.get("epochs", 1),
                gather=lambda window: frontend.allgather(
                    window, "tfsync.auto.window", "every rank's iteration times, gathered for auto mode's decision"
                ),
            )
        self._start_engine()

    def _check_optimizer(self, optimizer):
        """Refuse, before training, an optimizer path the mode (every mode auto may run) cannot
        synchronize: gradient accumulation under a mode that exchanges updates."""
        frontend = self._frontend
        for policy in (self.auto.initial, *self.auto.modes.values()) if self.auto is not None else (self.policy,):
            check_accumulation(
                optimizer,
                policy,
                lambda p: frontend.protocol(p).reduces_gradients,
                "tfsync.keras.SyncCallback",
                "this mode exchanges the update each step made and counts its staleness bound (or "
                "corrects its delay, or its period of local steps) in steps, which would then not be "
                "updates. Use a mode that exchanges gradients ('bsp', 'psp', 'backup'), where each "
                "step's gradients are averaged before they are accumulated, or a larger batch instead "
                "of accumulating (under 'localsgd' and 'diloco': a larger batch or period)",
            )

    def _start_engine(self):
        """Start the engine of ``self.policy``; compile a train step for it unless the one
        compiled already serves it (auto mode between gradient-protocol modes)."""
        model, policy = self.model, self.policy
        if policy.pulls_partially:
            check_blockwise_optimizer(model.optimizer, policy)
        tensors = self.variables
        if self._scaling is not None:  # (the gradient protocol exchanges an overflow flag too)
            tensors = self._scaling.engine_tensors(tensors, self._frontend.protocol(policy))
        if self._frontend.protocol(policy).periodic:  # Local SGD, DiLoCo: averaged at every outer step
            tensors = [*tensors, *floating_statistics(model)]
        engine = self._frontend.start(
            tensors,
            policy=policy,
            trace_name=self._trace_name(policy),
            extra_config={"steps": self._steps, "optimizer": type(model.optimizer).__name__},
        )
        if self._keeps_step(policy):
            return
        kind = self._compiled_kind = self._step_kind(policy)
        self._wrap_optimizer(model.optimizer)
        train_step = self._applying_once(type(model).train_step.__get__(model))
        if policy.skips or kind is not None:
            # (partial pulling: the engine applies the rounds itself, block by block)
            blockwise = engine.find(PartialPull) is not None
            apply_mean = self._apply_mean if engine.protocol.reduces_gradients and not blockwise else None
            train_step = skippable_train_step(lambda: self.engine, model, train_step, apply_mean)
        model.train_step = train_step
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

    def _trace_name(self, policy):
        """Where this engine's trace goes under ``trace_dir``: auto mode's ``<segment>-<mode>``,
        under ``reset<k>`` in an elastic job (each membership's engines apart); None: there."""
        name = f"{self._segment}-{policy.name}" if self.auto is not None else None
        if self.elastic is not None:
            name = os.path.join(f"reset{self.elastic.resets}", name) if name else f"reset{self.elastic.resets}"
        return name

    def _applying_once(self, train_step):
        """``train_step``, checked when it is traced (before its first step runs): it must update
        the weights through the model optimizer's ``apply`` or ``apply_gradients`` exactly once,
        the path the callback synchronizes; any other path would train each worker alone."""

        def checked_train_step(data):
            self._applies = 0
            out = train_step(data)
            if self._applies != 1:
                self._frontend.engine.abandon()  # (fit raises: Keras calls no on_train_end)
                raise ValueError(
                    f"tfsync.keras.SyncCallback: the train step of {type(self.model).__name__} called "
                    f"model.optimizer.apply() or apply_gradients() {self._applies} times; tfsync "
                    f"synchronizes the weights through that call, once per step, so "
                    + (
                        "a step that updates them some other way (another optimizer, assign_sub) would "
                        "train each worker alone"
                        if self._applies == 0
                        else "every call after the first would exchange again"
                    )
                    + ". Compute the step's gradients of model.trainable_variables and call "
                    "self.optimizer.apply(grads, self.trainable_variables) (or apply_gradients) once"
                )
            return out

        return checked_train_step

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
        protocol = self._frontend.protocol(policy)
        return "gradients" if protocol.reduces_gradients and not protocol.corrects_gradients else None

    def _keeps_step(self, policy):
        """Whether the compiled train step serves ``policy``'s engine as it is."""
        kind = self._step_kind(policy)
        return kind is not None and kind == self._compiled_kind

    def on_epoch_begin(self, epoch, logs=None):
        if self.elastic is not None and self._hosts_check_due:
            self._check_hosts()
        self._epoch = epoch
        self._switched_totals = None  # the epoch's totals of engines auto mode stopped during it
        if self._controller is not None:
            self._controller.epoch_begin()
        if self.engine is not None:
            self.engine.reset_totals()

    def on_train_batch_end(self, batch, logs=None):
        if self.engine is None:
            return
        last = self.engine.last
        if logs is not None:
            logs["tfsync_wait_s"] = last.get("wait_s", 0.0)
            logs["tfsync_staleness"] = last.get("staleness", 0)
        if self._controller is not None:
            # (mid-epoch included: Keras looks its train function up at every step)
            due, found = self._controller.after_step(last)
            if due:
                self._auto_decide(self._epoch, batch, found)

    @property
    def counts(self):
        """This worker's contributions over the whole ``fit`` (every engine auto mode ran); with
        ``elastic=``, over this process's whole elastic training, through every reset."""
        engine = self.engine
        now = engine.counts if engine is not None and engine is not self._folded else dict.fromkeys(COUNTS, 0)
        return {k: self._earlier_counts[k] + now[k] for k in COUNTS}

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self.engine is None:
            return
        if epoch + 1 == self.params.get("epochs"):
            # drain the rounds still in flight now, so the last epoch's logs count every
            # contribution (on_train_end drains again if fit stops early)
            self._drain()
        if self._controller is not None and self._controller.due_at_epoch_end():
            # before the logs: a switch's drain applies rounds this epoch's counts include
            self._auto_decide(epoch, self._steps - 1)
        tot = self.engine.totals
        if self._switched_totals is not None:
            tot = {k: self._switched_totals[k] + tot[k] for k in tot}
        if self._carried_totals is not None:  # elastic: the interrupted epoch's, its lost included
            tot, self._carried_totals = {k: self._carried_totals[k] + tot[k] for k in tot}, None
        busy = tot["wait_s"] + tot["compute_s"]
        logs["tfsync_wait_fraction"] = tot["wait_s"] / busy if busy else 0.0
        for key in COUNTS:
            logs[f"tfsync_{key}"] = float(tot[key])
        pull = self.engine.find(PartialPull)
        for key, n in (pull.counts if pull is not None else {}).items():  # partial pulling, since fit began
            logs[f"tfsync_{key}"] = float(n)
        if self.average_epoch_logs:
            keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
            mean = self._frontend.average(
                [float(logs[k]) for k in keys], "tfsync.epoch_logs", "the epoch's logs, averaged over the ranks"
            )
            logs.update({k: float(v) for k, v in zip(keys, mean)})
        if self._controller is not None:
            logs.update(self._controller.epoch_logs())
        if self.elastic is not None:
            self._commit(epoch)

    def _auto_decide(self, epoch, batch, found=None):
        """Auto mode's decision after this step (every rank after the same one), and its switch."""
        decision, wanted = self._controller.decide(epoch, batch, found)
        if decision is None:  # put off: a worker computed no step in the window
            if self._frontend.cluster.rank() == 0:
                deferred = self._controller.deferred[-1]
                log.info(
                    "tfsync auto, epoch %d batch %d: no decision, ranks %s computed no step since the last",
                    epoch,
                    batch,
                    deferred["ranks_without_steps"],
                )
                self._trace_auto({"event": "auto_deferred", **deferred})
            return
        if wanted is not None:
            t = time.monotonic()
            decision["retraced"] = self._switch(wanted)
            decision["switch_s"] = time.monotonic() - t  # the retracing, if any, is in the next step
        if self._frontend.cluster.rank() == 0:
            log.info(
                "tfsync auto, epoch %d batch %d: %s (%s) -> %s",
                epoch,
                batch,
                decision["observed"],
                decision["reason"],
                decision["mode"],
            )
            self._trace_auto({"event": "auto", **decision})

    def _trace_auto(self, record):
        """One line of ``trace_dir/auto.jsonl`` (rank 0; nothing without ``trace_dir``)."""
        trace_dir = self._frontend.settings["trace_dir"]
        if trace_dir:
            with open(os.path.join(trace_dir, "auto.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

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
        opt = self.model.optimizer
        self._frontend.broadcast_variables(
            self.model.variables + list(opt.variables),
            "tfsync.auto.switch",
            "rank 0's weights and optimizer state, broadcast when auto mode switches modes",
        )
        self.policy = policy
        self._segment += 1
        self._start_engine()
        self._controller.started(retraced=not keep_step)  # the new engine's first step retraces
        return not keep_step

    def on_train_end(self, logs=None):
        if not self._frontend.running:
            return
        self._stop_engine()
        if self.average_statistics:  # the engine is closed: no other thread issues collectives
            average_statistics(self.model, cluster=self._frontend.cluster, wait_timeout_s=self._frontend.wait_timeout_s)

    # ------------------------------------------------------------------ elastic
    def _elastic_begin(self, model):
        """Before a ``fit`` of an elastic job (first, or after a reset): the state's model, a mode
        that works with this membership's size, the last engine's counts folded in."""
        state, size = self.elastic, self._frontend.cluster.size()
        if model is not state.model:
            raise ValueError(
                "tfsync.keras.SyncCallback: elastic= holds another model than the one being fit; build "
                "the state on the model you train: tfsync.elastic.KerasState(model)"
            )
        try:  # (every rank refuses alike, before any collective)
            (self.auto if self.auto is not None else self.policy).validate(size)
        except ValueError as exc:
            raise ValueError(
                f"tfsync.elastic: the job has {size} workers now (after {state.resets} resets) and the mode "
                f"cannot run on them: {exc}. Launch with horovodrun --min-np at least the smallest number "
                f"of workers the mode takes, or choose settings that rescale (PSP's min_contributions=None "
                f"waits for size - 1)"
            ) from exc
        self._fold_engine()
        self._hosts_check_due = False  # (the state was just synchronized: run checks nothing older)

    def _fold_engine(self):
        """Add the last engine's counts to this worker's earlier counts, once."""
        engine = self.engine
        if engine is not None and engine is not self._folded:
            for k in COUNTS:
                self._earlier_counts[k] += engine.counts[k]
            self._folded = engine

    def _commit(self, epoch):
        """Epoch end of an elastic job: the job's contributions since the last commit (summed over
        the workers), the next epoch, and the model, committed to the state (collective).  The
        launcher's notices of changed hosts are checked when the next epoch begins
        (:meth:`_check_hosts`), after every callback's epoch end."""
        state, counts = self.elastic, self.counts
        # only settled contributions: one in flight now (SSP's rounds) is counted at the commit that
        # follows its round, so the job's counts add up at every commit, whoever is lost later
        counts["produced"] = sum(counts[k] for k in SETTLED)
        delta = [float(counts[k] - self._committed_counts[k]) for k in COUNTS]
        mean = self._frontend.average(
            delta, "tfsync.elastic.counts", "every worker's contributions since the last commit, summed for the job"
        )
        size = self._frontend.cluster.size()
        for k, m in zip(COUNTS, mean, strict=True):
            state.counts[k] += int(round(float(m) * size))
        self._committed_counts = counts
        state.epoch = epoch + 1
        state.save()
        self._hosts_check_due = True

    def _check_hosts(self):
        """Whether the launcher changed the hosts since the last check (collective: rank 0's
        notices, broadcast): if so, Horovod's ``HostsUpdatedInterrupt`` (``tfsync.elastic.run``
        resets, the state just committed).  At an epoch's beginning, not in the commit at the
        previous one's end, so every callback's ``on_epoch_end`` (checkpoints, evaluations) ran."""
        self._hosts_check_due = False
        self.elastic.check_host_updates()

    def _elastic_reset(self, reason):
        """An elastic reset (``tfsync.elastic.run``, Horovod already shut down): count this worker's
        contributions in flight as lost, abandon the engine, undo its hooks on the model; the
        interrupted epoch's totals go into the next epoch's logs.  Returns how many were lost."""
        engine, lost = self.engine, 0
        if engine is not None and engine is not self._folded:
            if engine.started:
                lost = engine.lose_in_flight(reason)
                before, now = self._carried_totals, engine.totals
                self._carried_totals = now if before is None else {k: before[k] + now[k] for k in now}
            self._fold_engine()
        self._hosts_check_due = False
        self._unwrap_optimizer()
        model = getattr(self, "model", None)  # (None: the failure came before the first fit)
        if model is not None and "train_step" in vars(model):
            del model.train_step
        self._compiled_kind = None
        return lost

    # ---------------------------------------------------------------- internals
    def _stop_engine(self, keep_step=False):
        """Drain, close and unwrap the running engine (it stays in ``engine`` for its counts and
        totals); ``keep_step``: the compiled train step stays for the next engine."""
        try:
            # compensate=: the late gradients still held get one last round, applied by the optimizer
            self._frontend.stop(apply_mean=self._apply_mean)
        finally:
            if not keep_step:
                self._unwrap_optimizer()
                if "train_step" in vars(self.model):
                    del self.model.train_step
                self._compiled_kind = None
                self.model.make_train_function(force=True)

    def _drain(self):
        """Wait for every round in flight and load the final weights (identical on all ranks)."""
        self._frontend.finish(apply_mean=self._apply_mean)

    def _wrap_optimizer(self, optimizer):
        """Hook the optimizer's ``apply``, Keras 3's one entry for updates: ``apply_gradients``
        calls it, and so does a ``LossScaleOptimizer`` (whose ``apply`` is hooked, not its inner
        optimizer's: one exchange per step, :class:`~tfsync.engine.tf_bridge.LossScaling`)."""
        engine, expected = self.engine, [id(v) for v in self.variables]
        protocol = engine.protocol
        pull = engine.find(PartialPull)
        current = engine if self._compiled_kind is None else (lambda: self.engine)
        original = type(optimizer).apply.__get__(optimizer)
        scaling = self._scaling
        factor = static_loss_scale(optimizer) if scaling is None else None

        def apply(grads, trainable_variables=None):
            grads = list(grads)
            if trainable_variables is None:  # (Keras: the variables the optimizer was built with)
                trainable_variables = getattr(optimizer, "_trainable_variables", [])
            variables = list(trainable_variables)
            if [id(v) for v in variables] != expected:
                raise ValueError(
                    "tfsync: the optimizer was asked to update other variables than the "
                    "model's trainable weights at the start of fit; do not change "
                    "trainability during fit"
                )
            self._applies += 1
            if pull is not None:
                return exchange_gradients_blockwise(current, grads, lambda mean: original(list(mean), variables))
            if scaling is not None:  # (it skips a step whose gradients overflowed itself)
                to_apply = scaling.before_optimizer(protocol, current, grads)
                result = original(list(to_apply), variables)
                after_optimizer(protocol, engine, variables)
                return result
            if not guards_optimizer(protocol):  # (it applies the round's mean)
                if factor is not None:
                    return original(list(before_optimizer_unscaled(factor, protocol, current, grads)), variables)
                return original(list(before_optimizer(protocol, current, grads)), variables)
            # the optimizer runs on this worker's own gradients (DC-S3GD: corrected), and only on
            # finite ones; a correction that keeps state is kept from gradients that are not
            raw = gradients_finite(grads) if protocol.corrects_gradients and protocol.stateful_correction else None
            if factor is not None:
                to_apply = before_optimizer_unscaled(factor, protocol, current, grads, raw)
            else:
                to_apply = before_optimizer(protocol, current, grads, raw)
            applied = apply_if_finite(gradients_finite(to_apply), lambda: original(list(to_apply), variables))
            after_optimizer(protocol, engine, variables, applied)
            return None

        optimizer.apply = apply
        self._wrapped_optimizer = optimizer
        if pull is not None:
            pull.applier = OptimizerBlocks(
                optimizer, lambda pairs: original(*map(list, zip(*pairs))), self.variables, pull.groups
            )
        # a skipped step applies the round's mean without exchanging again
        if scaling is not None and protocol.reduces_gradients:
            self._apply_mean = lambda mean: original(scaling.round_for_optimizer(list(mean)), self.variables)
        elif factor is not None and protocol.reduces_gradients:  # (the round's mean is of true gradients)
            self._apply_mean = lambda mean: original([m * factor for m in mean], self.variables)
        else:
            self._apply_mean = lambda mean: original(list(mean), self.variables)

    def _unwrap_optimizer(self):
        opt = getattr(self, "_wrapped_optimizer", None)
        if opt is not None and "apply" in vars(opt):
            del opt.apply
        self._wrapped_optimizer = None
