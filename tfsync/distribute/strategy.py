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
  corrected in place of the local one (the same hooks as the Keras callback's:
  :func:`tfsync.engine.tf_bridge.before_optimizer` and ``after_optimizer``);
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

from tfsync.engine.protocols import tf_variable
from tfsync.engine.tf_bridge import (
    LossScaling,
    after_optimizer,
    before_optimizer,
    check_accumulation,
    finish_in_graph,
    gradients_finite,
    guards_optimizer,
    is_loss_scaled,
    skippable_train_step,
    static_loss_scale,
)
from tfsync.frontend import FINGERPRINT_FIX, Frontend, fingerprint, floating_statistics
from tfsync.policies import resolve


class SyncStrategy(tf.distribute.OneDeviceStrategy):
    """A tf.distribute strategy that synchronizes Horovod workers with tfsync.

    Args:
        mode: ``"bsp"`` (default), ``"ssp"``, ``"psp"``, ``"backup"``, ``"dcs3gd"``,
            ``"localsgd"``, ``"diloco"`` or a policy such as ``tfsync.SSP(staleness=3)`` or
            ``tfsync.DiLoCo(inner_steps=8)``.
        stragglers: ``tfsync.Stragglers`` (default: from ``TFSYNC_STRAGGLERS``).
        trace_dir: JSON-lines trace directory (default: none).
        wait_timeout_s: bound on one wait for peers (default 120 s).
        device: local device (default: ``/gpu:<local_rank>`` if GPUs exist, else ``/cpu:0``).
        cluster: the job's ranks (:mod:`tfsync.engine.cluster`); default: Horovod's.
        on_nonfinite: ``"reject"`` (default): a worker's contribution with a NaN or an infinity
            goes into no round (counted as ``rejected`` in ``engine.counts``); ``"raise"``: the
            job stops with ``tfsync.engine.NonFiniteError`` naming the rank and the step.

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

    def __init__(
        self,
        mode="bsp",
        *,
        stragglers=None,
        trace_dir=None,
        wait_timeout_s=None,
        device=None,
        cluster=None,
        on_nonfinite="reject",
    ):
        policy = resolve(mode)
        if policy.pulls_partially:
            raise ValueError(
                f"SyncStrategy(mode=PSP(pull_fraction={policy.pull_fraction})): partial pulling applies "
                f"each round block by block through the optimizer, which only tfsync.keras.SyncCallback "
                f"drives (the strategy's optimizer applies every weight at once); use SyncCallback "
                f"with model.fit, or pull_fraction=1.0 here"
            )
        frontend = Frontend(
            policy,
            stragglers=stragglers,
            trace_dir=trace_dir,
            wait_timeout_s=wait_timeout_s,
            cluster=cluster,
            on_nonfinite=on_nonfinite,
        )
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
        protocol = self._protocol = frontend.protocol()
        self._reduces_gradients = protocol.reduces_gradients
        self._starts_from_variables = protocol.corrects_gradients or self._policy.compensate is not None
        self._variables = None
        self._var_count = 0
        self._local = threading.local()
        self._model = None  # the Keras model whose train step this strategy traced, if any
        self._prepared = None  # the optimizer _prepare checked (and hooked)
        self._scaling = None  # LossScaling of a hooked LossScaleOptimizer (_hook_loss_scaling)

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
        if not state.__dict__.get("in_step"):
            state.updates = []
            state.applied = None  # an update protocol's gradients' finiteness (_batch_reduce_to)
            state.training = False
            state.exchanged = False
            state.reductions = 0  # gradient all-reduces (optimizer applies) in this step
            state.in_step = True
            step_kind = getattr(fn, "__name__", "")
            try:
                model = self._keras_model(fn) if step_kind == "train_step" else None
                if model is not None:
                    self._prepare(model)
                    if self._engine is None:
                        self._start_model(model)
                flush = [] if step_kind == "train_step" else self._flush_before_non_training_step()
                if step_kind == "train_step" and self._engine is None and self._starts_from_variables:
                    # gradients are corrected against the weights: start from the model's
                    # variables, before the step (and its branches) are traced
                    self._variables = list(self._model_of(fn).trainable_variables)
                    self._start(self._engine_tensors(self._variables))
                if step_kind == "train_step" and self._policy.skips:
                    fn = self._skippable(fn)
                with tf.control_dependencies(flush):
                    out = super()._call_for_each_replica(fn, args, kwargs)
                if model is not None and state.reductions != 1:
                    self._refuse_step(model, state.reductions)
                if state.training and not self._reduces_gradients and not state.__dict__.get("exchanged"):
                    self._ensure_started(state.updates)
                    after_optimizer(self._protocol, self._engine, self._variables, state.applied)
            finally:
                state.in_step = False
            return out
        # a nested call (a LossScaleOptimizer's merge_call): the step's state stays
        return super()._call_for_each_replica(fn, args, kwargs)

    def _keras_model(self, train_step):
        """The Keras model whose bound ``train_step`` this is, or None (a custom loop's function)."""
        model = getattr(inspect.unwrap(train_step), "__self__", None)
        return model if model is not None and hasattr(model, "get_metrics_result") else None

    def _prepare(self, model):
        """Before a Keras model's train step is traced: refuse an optimizer path this mode cannot
        synchronize (gradient accumulation but under BSP), and hook a ``LossScaleOptimizer``
        under a gradient protocol or DC-S3GD (:meth:`_hook_loss_scaling`)."""
        self._model = model
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None or optimizer is self._prepared:
            return
        check_accumulation(
            optimizer,
            self._policy,
            lambda p: self._reduces_gradients and not p.skips,
            "tfsync.SyncStrategy",
            "Keras' optimizer all-reduces the accumulated gradients only at those steps, which BSP's "
            "rounds follow, but a mode that skips steps or exchanges updates counts every step. Use "
            "mode='bsp', or tfsync.keras.SyncCallback, which synchronizes accumulation under 'bsp', "
            "'psp' and 'backup'",
        )
        if is_loss_scaled(optimizer) and (self._reduces_gradients or self._protocol.corrects_gradients):
            self._hook_loss_scaling(optimizer)
        self._prepared = optimizer

    def _hook_loss_scaling(self, optimizer):
        """Exchange before a ``LossScaleOptimizer`` decides whether to skip the step.

        Its ``apply`` checks this worker's gradients for overflow and all-reduces them only
        when they are finite, so ranks that decide differently would exchange in different
        steps, and it all-reduces them unscaled only then.  Under a gradient protocol its
        ``apply`` is hooked instead: the round's mean and the ranks' overflow flag
        (:class:`~tfsync.engine.tf_bridge.LossScaling`) go to it, and its own all-reduce
        passes them through, so every rank decides alike; under DC-S3GD the same hook
        corrects the unscaled gradient.  (Update protocols need no hook: a skipped step
        pushes no update.)
        """
        original = type(optimizer).apply.__get__(optimizer)
        scaling = self._scaling = LossScaling(optimizer)
        state = self._local

        def apply(grads, trainable_variables=None):
            if not state.__dict__.get("in_step") or state.__dict__.get("skipping"):
                return original(grads, trainable_variables)
            grads = list(grads)
            variables = list(trainable_variables if trainable_variables is not None else optimizer._trainable_variables)
            state.training = True
            state.reductions += 1
            if self._engine is None:
                self._start(self._engine_tensors(variables))
            to_apply = scaling.before_optimizer(self._protocol, self._engine, grads)
            state.skipping = True  # the optimizer's all-reduce must not exchange the mean again
            try:
                return original(to_apply, variables)
            finally:
                state.skipping = False

        optimizer.apply = apply

    def _engine_tensors(self, tensors):
        """What the engine exchanges for ``tensors``: with a hooked ``LossScaleOptimizer``, the
        overflow flag too."""
        return self._scaling.engine_tensors(tensors, self._protocol) if self._scaling is not None else list(tensors)

    def _refuse_step(self, model, reductions):
        if self._engine is not None:  # (started by the step's first all-reduce; fit raises now)
            self._engine.abandon()
        raise ValueError(
            f"tfsync.SyncStrategy: the train step of {type(model).__name__} all-reduced gradients "
            f"through model.optimizer {reductions} times; tfsync synchronizes the weights at that "
            f"all-reduce, once per step, so "
            + (
                "a step that updates them some other way (another optimizer, assign_sub) would train "
                "each worker alone"
                if reductions == 0
                else "every call after the first would exchange again"
            )
            + ". Compute the step's gradients of model.trainable_variables and call "
            "self.optimizer.apply(grads, self.trainable_variables) (or apply_gradients) once"
        )

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
        if self._reduces_gradients and self._engine is None:
            self._start(values)
        # (an update protocol's engine starts after the step, on the variables it updated)
        if not guards_optimizer(self._protocol) or (self._prepared is not None and is_loss_scaled(self._prepared)):
            # (a LossScaleOptimizer all-reduces only gradients it found finite)
            return before_optimizer(self._protocol, self._engine, values)
        # the optimizer runs on this worker's own gradients (DC-S3GD: corrected): ones that are not
        # finite must not reach its slots; it applies zeros instead, and the engine rejects the
        # contribution; a correction that keeps state is kept from gradients that are not finite
        values = [tf.convert_to_tensor(v) for v in values]
        stateful = self._protocol.corrects_gradients and self._engine.protocol.stateful_correction
        raw = gradients_finite(values) if stateful else None
        to_apply = before_optimizer(self._protocol, self._engine, values, raw)
        finite = state.applied = gradients_finite(to_apply)
        return tf.cond(
            tf.reduce_all(finite),
            lambda: [tf.identity(v) for v in to_apply],
            lambda: [tf.zeros_like(v) for v in to_apply],
        )

    def _update(self, var, fn, args, kwargs, group):
        state = self._local
        if state.__dict__.get("training") and not self._reduces_gradients:
            state.updates.append(var)
        return super()._update(var, fn, args, kwargs, group)

    def _model_of(self, train_step):
        # strategy.run hands over Keras' bound method behind autograph's functools wrapper
        model = getattr(inspect.unwrap(train_step), "__self__", None)
        if model is None or not hasattr(model, "get_metrics_result"):
            raise ValueError(
                f"tfsync.SyncStrategy(mode={self._policy.name!r}) reaches the model through "
                f"Keras' Model.train_step (to skip a slow worker's steps, or to start from the "
                f"model's weights); got {train_step!r}. Train with model.fit"
            )
        return model

    def _skippable(self, train_step):
        """Keras' bound ``train_step``, skipped when its round closed without this worker."""
        model = self._model_of(train_step)
        state = self._local

        def apply_mean(mean):
            if self._scaling is not None:  # (the round's overflow flag decides the optimizer's skip)
                mean = self._scaling.round_for_optimizer(list(mean))
            elif static_loss_scale(model.optimizer) is not None:  # (the optimizer divides the true mean)
                mean = [m * tf.cast(static_loss_scale(model.optimizer), m.dtype) for m in mean]
            state.skipping = True  # the optimizer must not exchange the mean again
            try:
                return model.optimizer.apply_gradients(zip(mean, model.trainable_variables))
            finally:
                state.skipping = False

        if not self._reduces_gradients:  # ElasticBSP: the update is pushed in the branch that computes

            def train_and_exchange(data):
                out = train_step(data)
                if state.training:
                    self._ensure_started(state.updates)
                    after_optimizer(self._protocol, self._engine, self._variables, state.applied)
                    state.exchanged = True
                return out

            return skippable_train_step(lambda: self._engine, model, train_and_exchange, None)

        self._apply_mean = apply_mean  # also for the final round of late gradients (finish)

        return skippable_train_step(lambda: self._engine, model, train_step, apply_mean)

    # ------------------------------------------------------------------ engine
    def _start(self, tensors):
        """Start the engine while the first train step is traced (collective).  A custom
        loop's step (no Keras model: :meth:`_prepare` compared none) first compares every
        rank's mode and the exchanged tensors' dtypes and shapes."""
        with tf.init_scope():
            if self._model is None:
                self._agree(fingerprint(tensors))
            elif self._protocol.periodic:  # Local SGD, DiLoCo: averaged with the weights at every outer step
                tensors = [*tensors, *floating_statistics(self._model)]
            self._frontend.start(tensors)

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

    def _ensure_started(self, variables):
        if self._engine is None:
            self._variables = list(variables)
            self._start(self._variables)
        elif [id(tf_variable(v)) for v in variables] != [id(tf_variable(v)) for v in self._variables]:
            raise ValueError(
                "tfsync.SyncStrategy: a train step updated other variables than the "
                "first one did; tfsync needs one fixed set of trainable variables"
            )

    def _flush_before_non_training_step(self):
        if self._reduces_gradients or self._engine is None:
            return []
        return [finish_in_graph(self._engine)]

    def _finish(self):
        if self._engine is None:
            return
        self._frontend.stop(apply_mean=getattr(self, "_apply_mean", None))
