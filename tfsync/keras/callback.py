"""``SyncCallback``: tfsync's synchronization for an ordinary compiled Keras 3 model.

Written against Keras 3's public hooks (Horovod's Keras layer does not work on
Keras 3, upstream issue 4290).  One job: check that every rank starts alike,
start the engine, and install the optimizer path the mode's step protocol
builds (:mod:`tfsync.engine.protocols.path`) on the model optimizer's ``apply``
(Keras 3's one entry for updates) for ``fit``, retracing the train function so
the exchange runs inside the compiled step (once per model: a later ``fit`` reuses
it, :mod:`tfsync.keras.compiled_step`).  Auto mode's switches
(:mod:`tfsync.keras.auto`) and elastic commits (:mod:`tfsync.keras.commits`)
are collaborators, reaching the callback through
:meth:`SyncCallback.switch_mode` and :meth:`SyncCallback.abandon_engine`; the
fit's input iterators are dropped off the training thread
(:mod:`tfsync.keras.fit_data`).
"""

import keras

from tfsync.engine.settings import EngineSettings
from tfsync.frontend import Frontend, check_start
from tfsync.keras.auto import AutoSwitching
from tfsync.keras.commits import ElasticCommits
from tfsync.keras.compiled_step import KeptStep
from tfsync.keras.counts import RunCounts
from tfsync.keras.fit_data import FitData
from tfsync.keras.logs import add_epoch_logs
from tfsync.keras.statistics import average_statistics
from tfsync.policies import resolve_mode, switching


class SyncCallback(keras.callbacks.Callback):
    """Synchronize data-parallel training across Horovod workers.

    Put it first in ``callbacks``: later ones (``TensorBoard``, ``EarlyStopping``) see its metrics.

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

    Synchronized: every update through the model optimizer's ``apply`` or ``apply_gradients`` (a
    custom ``train_step`` too), mixed precision's ``LossScaleOptimizer`` and, where the rounds carry
    gradients or pseudo-gradients, gradient accumulation; anything else is refused before the first
    step, saying why (``docs/guide/callback.md``, "What it synchronizes").

    Args:
        mode: a registered mode's name (``"bsp"``, the default, ``"ssp"``, ...:
            :func:`tfsync.policies.registry.names` lists them, ``"auto"`` included) or a policy
            object such as ``tfsync.SSP(staleness=3)``, ``tfsync.PSP(min_contributions=3)`` or
            ``tfsync.DiLoCo(inner_steps=8)``.  Under ``"localsgd"`` and ``"diloco"`` only every
            ``H``-th step is a contribution (an outer step: the counts count outer steps, and the
            per-batch ``tfsync_wait_s`` is the last outer step's), and the model's non-trainable
            floating-point variables are averaged with the weights at every outer step.
            ``"auto"`` (:class:`tfsync.Auto`) switches between modes from the measured iteration
            times (:class:`tfsync.keras.auto.AutoSwitching`): its decisions are in
            ``auto_decisions`` and ``auto_deferred``, ``trace_dir/auto.jsonl`` and the epoch logs.
        average_epoch_logs: average the epoch logs over workers, as Horovod's
            ``MetricAverageCallback`` does (default True).  This waits for every
            worker to finish the epoch.
        average_statistics: at the end of ``fit``, set the model's non-trainable floating-point
            variables (``BatchNormalization``'s moving mean and variance) to their mean over the
            workers, so every replica ends identical (default True;
            :func:`tfsync.keras.average_statistics`); during training each worker's follow its
            own batches, as under plain Horovod.
        cluster: the job's ranks (:mod:`tfsync.engine.cluster`; default: Horovod's), through
            which every collective of the callback and its engine goes.
        elastic: a :class:`tfsync.elastic.KerasState` (default None): elastic training under
            ``tfsync.elastic.run``, committed at epoch ends and as ``commit_every_steps`` says;
            a reset counts ``tfsync_lost``, ``tfsync_steps_redone``, ``tfsync_samples_redone``
            (:class:`tfsync.keras.commits.ElasticCommits`, ``docs/guide/elastic.md``).
        **settings: the engine's settings by keyword, declared and checked by
            :class:`tfsync.engine.EngineSettings`: ``stragglers`` (simulated delays; default from
            ``TFSYNC_STRAGGLERS``, off if unset), ``trace_dir`` (a JSON-lines trace per worker;
            default none), ``wait_timeout_s`` (bound on one wait for peers; default 120 s),
            ``on_nonfinite`` (``"reject"``, the default: a contribution with a NaN or an infinity
            goes into no round, counted as ``tfsync_rejected``; ``"raise"``: the job stops with
            ``tfsync.engine.NonFiniteError`` naming the rank and the step).

    Logs added: per batch ``tfsync_wait_s``, ``tfsync_staleness``; per epoch ``tfsync_wait_fraction``
    and what happened to this worker's contributions (``tfsync_produced`` = ``tfsync_applied`` +
    ``tfsync_compensated`` + ``tfsync_dropped`` + ``tfsync_rejected`` + ``tfsync_lost``;
    ``tfsync_skipped`` steps), averaged with ``average_epoch_logs`` (``docs/guide/metrics.md``).

    Example:

        hvd.init()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()],
                  callbacks=[tfsync.keras.SyncCallback(mode=tfsync.SSP(staleness=3))])
    """

    def __init__(
        self, mode="bsp", *, average_epoch_logs=True, average_statistics=True, cluster=None, elastic=None, **settings
    ):
        super().__init__()
        mode = resolve_mode(mode)
        for flag, value in (("average_epoch_logs", average_epoch_logs), ("average_statistics", average_statistics)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"tfsync.keras.SyncCallback: {flag} must be True or False, got {value!r}; "
                    f"pass {flag}=True (the default) or {flag}=False"
                )
        self.mode = mode
        self.auto = AutoSwitching(mode, self) if switching(mode) is not None else None
        self.policy = mode.initial if self.auto else mode
        settings = EngineSettings.of("tfsync.keras.SyncCallback", settings, elastic=elastic is not None)
        self.frontend = Frontend(self.policy, settings, cluster)
        self.elastic = ElasticCommits(elastic, self) if elastic is not None else None
        self.average_epoch_logs = average_epoch_logs
        self.average_statistics = average_statistics
        self.run_counts = RunCounts()
        self._fit_data = FitData()  # the fit's input iterators, dropped off the training thread
        self._path = None  # the optimizer path the compiled train step was built on
        self._optimizer = None  # the optimizer whose apply is hooked
        self._kept_step = KeptStep()  # the compiled train step, kept from one fit for the next

    @property
    def engine(self):
        """The running (or last) :class:`tfsync.engine.SyncEngine`; None before ``fit``."""
        return self.frontend.engine

    @property
    def counts(self):
        """This worker's contributions over the whole ``fit`` (every engine auto mode ran); with
        ``elastic=``, over its whole elastic training, with what its resets redid."""
        return self.run_counts.counts(self.engine, redone=self.elastic is not None)

    @property
    def auto_decisions(self):
        """Auto mode's decisions in this ``fit`` (:class:`tfsync.policies.auto.AutoController`)."""
        return self.auto.decisions if self.auto is not None else []

    @property
    def auto_deferred(self):
        """Auto mode's decisions put off (a worker computed no step): ``{"epoch", "batch", "ranks_without_steps"}``."""
        return self.auto.deferred if self.auto is not None else []

    # -------------------------------------------------------------------- train
    def on_train_begin(self, logs=None):
        model, frontend = self.model, self.frontend
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "tfsync.keras.SyncCallback: the model has no optimizer; call "
                "model.compile(optimizer=..., loss=...) before model.fit"
            )
        if frontend.running:  # a fit that raised left its engine running (Keras skips on_train_end)
            frontend.engine.abandon()
        policies = self.auto.modes if self.auto is not None else (self.policy,)
        if self.elastic is not None:
            self.elastic.begin(model, self.mode, self.params, policies)
            self.run_counts.fold(self.engine, epoch_totals=False)
        else:
            self.run_counts.restart()
        for policy in policies:  # (before any collective: every rank refuses alike)
            frontend.optimizer_path(optimizer, policy=policy).check_optimizer(optimizer, "tfsync.keras.SyncCallback")
        self._steps = check_start(frontend, self.params.get("steps"), self.mode, model)
        self._epoch = 0
        if self.auto is not None:
            self.policy = self.auto.begin(self._steps, self.params.get("epochs", 1))
        self._path = None
        self._start_engine()

    def _start_engine(self):
        """Start the engine of ``self.policy``; compile a train step for it unless the one compiled
        already serves it (auto mode between gradient-protocol modes) or the last fit's does
        (:mod:`tfsync.keras.compiled_step`)."""
        model, optimizer = self.model, self.model.optimizer
        keeps = self._path is not None and self._path.serves(self.policy)
        kept = None if keeps else self._kept_step.take(model, self.policy, shared=self.auto is not None)
        if keeps:
            path = self._path
        elif kept is not None:
            path = kept[0]
        else:
            path = self.frontend.optimizer_path(optimizer, policy=self.policy, shared=self.auto is not None)
        path.check_optimizer(optimizer, "tfsync.keras.SyncCallback")
        trace_name = self.auto.trace_name(self.policy) if self.auto is not None else None
        trace_name = self.elastic.trace_name(trace_name) if self.elastic is not None else trace_name
        self.frontend.start(
            path.engine_tensors(model.trainable_variables, model),
            policy=self.policy,
            trace_name=trace_name,
            extra_config={"steps": self._steps, "optimizer": type(optimizer).__name__},
        )
        path.bind(self.frontend.engine)
        if keeps:
            return
        self._path, self._optimizer = path, optimizer
        compiled = kept[1] if kept is not None else None
        self._apply_mean = self.frontend.install(model, path, "tfsync.keras.SyncCallback", compiled=compiled)
        self._kept_step.installed(model, path, optimizer, model.train_function)
        model.train_function = self._fit_data.watching(model.train_function)

    def on_epoch_begin(self, epoch, logs=None):
        if self.elastic is not None:
            self.elastic.epoch_begin()
        self._epoch = epoch
        if self.auto is not None:
            self.auto.epoch_begin()
        if self.engine is not None:
            self.engine.reset_totals()

    def on_train_batch_begin(self, batch, logs=None):
        if self.elastic is not None:
            self.elastic.batch_begin()

    def on_train_batch_end(self, batch, logs=None):
        if self.engine is None:
            return
        last = self.engine.last
        if logs is not None:
            logs["tfsync_wait_s"] = last.get("wait_s", 0.0)
            logs["tfsync_staleness"] = last.get("staleness", 0)
        if self.auto is not None:
            self.auto.batch_end(self._epoch, batch, last)
        if self.elastic is not None:
            self.elastic.batch_end(batch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or self.engine is None:
            return
        if epoch + 1 == self.params.get("epochs"):
            # drain the rounds still in flight now, so the last epoch's logs count every
            # contribution (on_train_end drains again if fit stops early)
            self.frontend.finish(apply_mean=self._apply_mean)
        if self.auto is not None:
            self.auto.epoch_end(epoch, self._steps - 1)
        totals = self.run_counts.epoch_totals(self.engine, redone=self.elastic is not None)
        add_epoch_logs(logs, totals, self.engine, self.frontend, self.average_epoch_logs)
        if self.auto is not None:
            logs.update(self.auto.epoch_logs())
        if self.elastic is not None:
            self.elastic.epoch_end(epoch, self.run_counts.since_commit(self.engine))

    def on_train_end(self, logs=None):
        self._fit_data.release()  # (dropped off this thread once fit has returned: tfsync.keras.fit_data)
        if not self.frontend.running:
            return
        self._stop_engine()
        if self.average_statistics:  # the engine is closed: no other thread issues collectives
            average_statistics(self.model, cluster=self.frontend.cluster, wait_timeout_s=self.frontend.wait_timeout_s)

    # ---------------------------------------------------- the collaborators' seam
    def switch_mode(self, policy) -> bool:
        """Drain the running mode (identical weights on every replica), give every replica rank 0's
        weights and optimizer state, and start ``policy``'s engine (collective; auto mode's
        switch).  Returns whether the train step was compiled again."""
        keeps = self._path is not None and self._path.serves(policy)
        self._stop_engine(keep_step=keeps)
        self.run_counts.fold(self.engine)
        model = self.model
        self.frontend.broadcast_variables(
            model.variables + list(model.optimizer.variables),
            "tfsync.auto.switch",
            "rank 0's weights and optimizer state, broadcast when auto mode switches modes",
        )
        self.policy = policy
        self._start_engine()
        return not keeps

    def abandon_engine(self, reason: str) -> int:
        """End the running engine unfinished (an elastic reset, Horovod already shut down): count
        this worker's contributions in flight as lost, fold its counts into the run's, undo the
        hooks on the model.  Returns how many were lost."""
        engine, lost = self.engine, 0
        if engine is not None and engine.started:
            lost = engine.lose_in_flight(reason)
        self.run_counts.fold(engine)
        self._unhook()
        self._fit_data.release()
        return lost

    # ---------------------------------------------------------------- internals
    def _stop_engine(self, keep_step=False):
        """Drain, close and unhook the running engine (it stays in ``engine`` for its counts and
        totals); ``keep_step``: the compiled train step stays for the next engine."""
        try:
            # compensate=: the late gradients still held get one last round, applied by the optimizer
            self.frontend.stop(apply_mean=self._apply_mean)
        finally:
            if not keep_step:
                self._unhook(plain_step=True)

    def _unhook(self, plain_step=False):
        """Take the hooks off the model (``plain_step``: and give it Keras' own train function
        again, for a fit without the callback); the compiled step is kept for the next fit."""
        model = getattr(self, "model", None)  # (None: a reset before fit)
        Frontend.uninstall(model, self._optimizer)
        if model is not None and plain_step:
            model.make_train_function(force=True)
        if model is not None:
            self._kept_step.keep(model)
        self._optimizer, self._path = None, None
