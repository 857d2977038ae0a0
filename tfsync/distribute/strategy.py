"""``SyncStrategy``: a ``tf.distribute.Strategy`` whose cross-process sync is tfsync's.

Locally it is a ``OneDeviceStrategy`` over this process's device (the GPU of
its local rank when there are GPUs, as Horovod's examples pin them, else the
CPU), so Keras 3 sees and uses a real strategy.  Across processes:

* variables created in its scope start from rank 0's initial values (one
  broadcast per variable at creation); before the engine starts on a Keras
  model, every rank's mode, model and optimizer are compared, and the
  model's and the optimizer's variables are broadcast from rank 0 once more
  (a checkpoint loaded on one rank since creation);
* the gradient all-reduce Keras issues inside every train step
  (``ReplicaContext.all_reduce``) becomes the engine's exchange: with the
  gradient protocol (BSP) it returns the workers' mean gradient; with the
  update protocol (SSP) the local gradient is applied as is, the variables
  the optimizer updates are observed through ``extended.update``, and after
  the step the engine pushes their share and moves them to the next step's
  weights; DC-S3GD's protocol does the same with the gradient the engine
  corrected in place of the local one (the optimizer path the mode's step
  protocol builds, :mod:`tfsync.engine.protocols.path`, at its all-reduce station);
* the engine starts when the first train step is traced;
* datasets are not distributed: with one replica per process, Keras' input
  feeds the step as it would with no strategy at all (TF's default strategy
  does the same), instead of through a distributed iterator built anew
  every epoch.

A single-device strategy never calls its ``cross_device_ops`` under Keras 3
fit, which is why the hooks sit on the replica all-reduce and the update
path instead.

With an update-protocol mode (SSP, DC-S3GD), in-flight rounds are drained and every replica
loads the identical final weights at :meth:`SyncStrategy.finish` and,
automatically, before the first evaluation or prediction step that follows
training.  Call ``finish()`` after ``fit`` before saving a model.

Under ``"localsgd"`` and ``"diloco"`` the engine sees every ``H``-th step (an
outer step); a Keras model's non-trainable floating-point statistics are
averaged with the weights at every outer step, and an evaluation or
prediction that follows training steps (validation during ``fit``) ends the
period there with an outer step (the drain above), so it sees identical
replicas.  Under the other modes, non-trainable statistics
(``BatchNormalization``'s moving mean and variance) follow each worker's
own batches, as under plain Horovod; call
``tfsync.keras.average_statistics(model)`` after ``finish()`` to set them to
their mean over the workers (``SyncCallback`` does this at the end of ``fit``).
"""

import inspect
import threading

import tensorflow as tf
from tensorflow.python.distribute import one_device_strategy

from tfsync.engine._tf import tf_variable
from tfsync.engine.settings import EngineSettings
from tfsync.frontend import FINGERPRINT_FIX, Frontend, fingerprint, once_per_step_error
from tfsync.policies import resolve


class SyncStrategy(tf.distribute.OneDeviceStrategy):
    """A tf.distribute strategy that synchronizes Horovod workers with tfsync.

    Args:
        mode: a registered mode's name (``"bsp"``, the default, ``"ssp"``, ...:
            :func:`tfsync.policies.registry.names` lists them; not ``"auto"``, which switches
            modes between epochs: ``SyncCallback`` only) or a policy such as
            ``tfsync.SSP(staleness=3)`` or ``tfsync.DiLoCo(inner_steps=8)``.
        device: local device (default: ``/gpu:<local_rank>`` if GPUs exist, else ``/cpu:0``).
        cluster: the job's ranks (:mod:`tfsync.engine.cluster`); default: Horovod's.
        **settings: the engine's settings by keyword, declared and checked by
            :class:`tfsync.engine.EngineSettings`: ``stragglers`` (simulated delays; default from
            ``TFSYNC_STRAGGLERS``), ``trace_dir`` (a JSON-lines trace per worker; default none),
            ``wait_timeout_s`` (bound on one wait for peers; default 120 s), ``on_nonfinite``
            (``"reject"``, the default: a contribution with a NaN or an infinity goes into no
            round, counted as ``rejected`` in ``engine.counts``; ``"raise"``: the job stops with
            ``tfsync.engine.NonFiniteError`` naming the rank and the step).

    Before the first train step of a Keras model runs, every rank's mode, model (each
    variable's path, dtype, shape and trainability; the layers' classes) and optimizer
    (class and ``get_config()``; a learning rate held in a variable is state, not compared)
    are compared, and a difference stops every rank naming the first one; then every
    variable of the model and of its optimizer (iterations, slots, learning rate, a loss
    scale) is set to rank 0's.  A variable created in the scope with another dtype or shape
    than rank 0's is refused when it is created.

    Synchronized: every update through the model optimizer's ``apply`` or ``apply_gradients``
    (both reach the optimizer's gradient all-reduce and ``extended.update``, the strategy's
    hooks), from Keras' own ``train_step`` or a custom one; mixed precision's
    ``LossScaleOptimizer`` (its ``apply`` is hooked under a gradient-exchanging mode and
    DC-S3GD, so every rank skips the steps whose gradients overflowed on any rank);
    ``gradient_accumulation_steps`` under BSP (the accumulated gradient is all-reduced at
    each update step).  Under a mode whose optimizer runs on each worker's own gradients
    (SSP, DSSP, ElasticBSP, DC-S3GD), a step whose gradients are not finite hands the
    optimizer zeros, so no NaN reaches its slots, and its contribution is rejected
    (``tfsync.keras.SyncCallback`` skips that optimizer step altogether).  Refused before the
    first step, saying why and what to do instead: a ``train_step`` that does not all-reduce
    its gradients through the optimizer exactly once (another optimizer, or ``assign_sub``,
    would train each worker alone); gradient accumulation under any other mode.

    Example:

        hvd.init()
        strategy = tfsync.distribute.SyncStrategy(mode="ssp")
        with strategy.scope():
            model = make_model()
            model.compile(optimizer="sgd", loss="mse")
        model.fit(*tfsync.shard(x, y, batch_size=32), batch_size=32)
        strategy.finish()
    """

    def __init__(self, mode="bsp", *, device=None, cluster=None, **settings):
        policy = resolve(mode)
        frontend = Frontend(policy, EngineSettings.of("tfsync.distribute.SyncStrategy", settings), cluster)
        # what this mode's optimizer path refuses whatever the optimizer (partial pulling), now
        frontend.optimizer_path(station="all_reduce").check_optimizer(None, "tfsync.SyncStrategy")
        local_rank = frontend.cluster.local_rank()  # (Horovod's checks, now rather than at the first step)
        if device is None:
            gpus = tf.config.list_logical_devices("GPU")
            device = gpus[local_rank % len(gpus)].name if gpus else "/cpu:0"
        # OneDeviceStrategy.__init__ would build a plain OneDeviceExtended; build ours.
        tf.distribute.Strategy.__init__(self, _SyncExtended(self, device, frontend))

    @property
    def engine(self):
        """The running :class:`tfsync.engine.SyncEngine` (None before the first train step)."""
        return self.extended._engine

    def finish(self):
        """Drain in-flight rounds, load identical final weights, stop the engine (collective)."""
        self.extended._finish()


def _per_replica(options):
    """Input options asking for per-replica input (which a one-device strategy refuses)."""
    mode = options.experimental_replication_mode if options is not None else None
    return mode is not None and mode != tf.distribute.InputReplicationMode.PER_WORKER


class _SyncExtended(one_device_strategy.OneDeviceExtended):
    def __init__(self, container_strategy, device, frontend):
        super().__init__(container_strategy, device)
        self._frontend, self._policy = frontend, frontend.policy
        self._path = self._new_path(None)  # the optimizer path, built again for a Keras model's optimizer
        self._variables = None
        self._var_count = 0
        self._local = threading.local()
        self._model = None  # the Keras model whose train step this strategy traced, if any
        self._prepared = None  # the optimizer _prepare checked (and hooked)

    def _new_path(self, optimizer):
        return self._frontend.optimizer_path(optimizer, station="all_reduce", engine=lambda: self._engine)

    # One replica per process: the dataset feeds the step as it does without a strategy (what
    # TF's default strategy does).  OneDeviceStrategy's distributed dataset builds a new
    # multi-device iterator every epoch, which can take a second on a busy host, and under BSP
    # every worker waits for the slowest at each epoch's first step.
    def _experimental_distribute_dataset(self, dataset, options):
        if _per_replica(options):
            return super()._experimental_distribute_dataset(dataset, options)  # (raises as TF does)
        return dataset

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if _per_replica(options):
            return super()._distribute_datasets_from_function(dataset_fn, options)  # (raises as TF does)
        return dataset_fn(tf.distribute.InputContext())

    @property
    def _engine(self):
        """The running engine, or None (before the first train step, after ``finish``)."""
        return self._frontend.engine if self._frontend.running else None

    # Variables start identical on every rank.
    def _create_variable(self, next_creator, **kwargs):
        initial = kwargs.get("initial_value")
        if callable(initial):
            initial = initial()
        if initial is not None and tf.executing_eagerly():
            name = f"tfsync.create.{self._var_count}"
            self._var_count += 1
            value = tf.convert_to_tensor(initial)
            cluster = self._frontend.cluster
            # (bounded; while training, on the exchange thread after the queued rounds)
            received = self._frontend.collective(
                lambda: cluster.broadcast(value, 0, name),
                name,
                "rank 0's initial value of a variable created in SyncStrategy's scope (every rank "
                "creates its variables in the same order)",
            )
            if received.dtype != value.dtype or received.shape != value.shape:
                raise ValueError(
                    f"tfsync.SyncStrategy: rank {cluster.rank()} creates its variable #{self._var_count - 1} "
                    f"({kwargs.get('name')}) as {value.dtype.name} {value.shape.as_list()}, rank 0 as "
                    f"{received.dtype.name} {received.shape.as_list()}. Every worker must create the same "
                    f"variables in the same order: {FINGERPRINT_FIX}"
                )
            kwargs["initial_value"] = received
        return super()._create_variable(next_creator, **kwargs)

    # strategy.run: one traced train, test or predict step (Keras passes its
    # bound train_step / test_step / predict_step).
    def _call_for_each_replica(self, fn, args, kwargs):
        state = self._local
        if state.__dict__.get("in_step"):  # a nested call (a LossScaleOptimizer's merge_call)
            return super()._call_for_each_replica(fn, args, kwargs)
        state.updates = []  # the variables the optimizer updated in this step (_update)
        state.applied = None  # the path's guard of this step (at_all_reduce)
        state.training = False
        state.exchanged = False
        state.reductions = 0  # gradient all-reduces (optimizer applies) in this step
        state.in_step = True
        training = getattr(fn, "__name__", "") == "train_step"
        try:
            model = self._keras_model(fn) if training else None
            if model is not None:
                self._prepare(model)
                if self._engine is None:
                    self._start_model(model)
            flush = [] if training else self._path.before_other_step()
            if training:
                self._path.before_step(model, self._ensure_started)
                fn = self._path.train_step(model, fn, getattr(self, "_apply_mean", None), after=self._after_step)
            with tf.control_dependencies(flush):
                out = super()._call_for_each_replica(fn, args, kwargs)
            if model is not None and state.reductions != 1:
                self._refuse_step(model, state.reductions)
            self._after_step()
        finally:
            state.in_step = False
        return out

    def _after_step(self):
        """Once the step's optimizer ran: the path's exchange after it (once per step)."""
        state = self._local
        if state.training and not state.exchanged:
            state.exchanged = True
            self._path.after_step(state.updates, state.applied, self._ensure_started)

    def _keras_model(self, train_step):
        """The Keras model whose bound ``train_step`` this is, or None (a custom loop's function)."""
        model = getattr(inspect.unwrap(train_step), "__self__", None)
        return model if model is not None and hasattr(model, "get_metrics_result") else None

    def _prepare(self, model):
        """Before a Keras model's train step is traced: the optimizer path for its optimizer,
        which refuses what this mode cannot synchronize at the all-reduce (gradient accumulation
        but under BSP), and hooks the optimizer's ``apply`` where the path stands there (a
        ``LossScaleOptimizer`` under a gradient exchange or DC-S3GD: it all-reduces only
        gradients it found finite, so ranks would exchange in different steps)."""
        self._model = model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None or optimizer is self._prepared:
            return
        path = self._new_path(optimizer)
        path.check_optimizer(optimizer, "tfsync.SyncStrategy")
        self._path = path
        if path.hooks_apply:
            Frontend.hook_optimizer(optimizer, self._apply_hook)
        self._apply_mean = self._mean_applier(model)
        self._prepared = optimizer

    def _apply_hook(self, original, grads, variables):
        """The optimizer's ``apply`` of a path that stands there (:meth:`_prepare`): the path's
        gradients go to it, and its own all-reduce passes them through."""
        state = self._local
        if not state.__dict__.get("in_step") or state.__dict__.get("skipping"):
            return original(grads, variables)
        state.training = True
        state.reductions += 1
        to_apply = self._path.at_apply(grads, variables, self._ensure_started)
        state.skipping = True  # the optimizer's all-reduce must not exchange the mean again
        try:
            return original(to_apply, variables)
        finally:
            state.skipping = False

    def _mean_applier(self, model):
        """How a skipped step's round mean (and a final round of late gradients) goes through
        the optimizer, without another exchange."""
        state = self._local

        def apply_mean(mean):
            state.skipping = True  # the optimizer must not exchange the mean again
            try:
                mean = self._path.mean_for_optimizer(list(mean))
                return model.optimizer.apply_gradients(zip(mean, model.trainable_variables))
            finally:
                state.skipping = False

        return apply_mean

    def _refuse_step(self, model, reductions):
        if self._engine is not None:  # (started by the step's first all-reduce; fit raises now)
            self._engine.abandon()
        did = "all-reduced gradients through model.optimizer"
        raise once_per_step_error("tfsync.SyncStrategy", model, reductions, did, "at that all-reduce")

    # ReplicaContext.all_reduce -> the optimizer's gradient all-reduce.
    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        state = self._local
        values = [v for v, _ in value_destination_pairs]
        if (
            not state.__dict__.get("in_step")
            or state.__dict__.get("skipping")
            or reduce_op != tf.distribute.ReduceOp.SUM
        ):
            return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)
        state.training = True
        state.reductions = state.__dict__.get("reductions", 0) + 1
        out, state.applied = self._path.at_all_reduce(values, self._ensure_started)
        return out

    def _update(self, var, fn, args, kwargs, group):
        state = self._local
        if state.__dict__.get("training"):
            state.updates.append(var)
        return super()._update(var, fn, args, kwargs, group)

    # ------------------------------------------------------------------ engine
    def _ensure_started(self, tensors):
        """Start the engine on ``tensors`` (the step's gradients, or the variables the path says)
        while the first train step is traced (collective); once started, a later step must
        update the same variables."""
        tensors = list(tensors)
        if self._engine is None:
            self._variables = tensors
            self._start(tensors)
        elif self._variables and all(isinstance(v, tf.Variable) or hasattr(v, "path") for v in tensors):
            if [id(tf_variable(v)) for v in tensors] != [id(tf_variable(v)) for v in self._variables]:
                raise ValueError(
                    "tfsync.SyncStrategy: a train step updated other variables than the "
                    "first one did; tfsync needs one fixed set of trainable variables"
                )

    def _start(self, tensors):
        """Start the engine (collective) on ``tensors`` and what the path exchanges beside them
        (a Keras model's statistics under Local SGD and DiLoCo, a loss scale's overflow flag).
        A custom loop's step (no Keras model: :meth:`_prepare` compared none) first compares
        every rank's mode and the exchanged tensors' dtypes and shapes."""
        with tf.init_scope():
            if self._model is None:
                self._agree(fingerprint(tensors))
            self._frontend.start(self._path.engine_tensors(tensors, self._model))
            self._path.bind(self._frontend.engine)

    def _agree(self, described):
        """Compare every rank's mode and ``described`` (:func:`tfsync.frontend.fingerprint`) with
        rank 0's (collective): a mismatch raises naming the ranks and the first difference."""
        self._frontend.agree(
            {"mode": self._policy.config(), **described},
            "tfsync.model",
            "every rank's mode, model variables and optimizer, gathered before the engine starts",
            "mode, model and optimizer",
            FINGERPRINT_FIX,
        )

    def _start_model(self, model):
        """Before the engine starts on ``model``'s train step: compare every rank's mode, model
        and optimizer, and set every variable training reads, the optimizer's included, to rank
        0's (collective).  Variables created in the strategy's scope start as rank 0's already,
        but a checkpoint loaded on one rank since would otherwise train on.  (Here, before the
        step is traced: inside the optimizer's all-reduce, which has a custom gradient,
        TensorFlow refuses functions that read variables.)"""
        optimizer = getattr(model, "optimizer", None)
        with tf.init_scope():
            if optimizer is not None and not optimizer.built:
                optimizer.build(model.trainable_variables)
            self._agree(fingerprint(model.variables, optimizer, model))
            self._frontend.broadcast_variables(
                model.variables + list(optimizer.variables if optimizer is not None else []),
                "tfsync.weights",
                "rank 0's weights and optimizer state, broadcast to every rank before the engine starts",
            )

    def _finish(self):
        if self._engine is None:
            return
        self._frontend.stop(apply_mean=getattr(self, "_apply_mean", None))
