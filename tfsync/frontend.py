"""What the Keras callback and the ``tf.distribute`` strategy share around the engine.

Both frontends take a mode and the engine's settings, check them when they are
built (before any training), start one engine per training run on the
model's trainable variables, install the optimizer path the mode's step
protocol builds (:meth:`Frontend.optimizer_path`, :meth:`Frontend.hook_optimizer`;
:mod:`tfsync.engine.protocols.path`), drain the rounds in flight when training
ends and close the engine.  :class:`Frontend` does that once for
both, and is their only way to the other workers: every collective goes
through its cluster (:mod:`tfsync.engine.cluster`; Horovod in production,
in-process ranks in the single-process tests), in the same order on every rank,
and each is bounded by the wait bound (:func:`tfsync.engine.bounded.run_bounded`),
engine running or not: a rank that does not come stops every rank with an error
that names the collective and the ranks that had not reached it.  Before rank
0's variables are broadcast, each frontend compares every rank's mode, model
and optimizer (:func:`fingerprint`, :meth:`Frontend.agree`): a broadcast
needs the same variables on every rank, and a rank that built another model
must not train on silently.
"""

import numbers
import os

import keras
import numpy as np
import tensorflow as tf

from tfsync.engine import SyncEngine, agreement, protocols
from tfsync.engine.bounded import run_bounded
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.settings import EngineSettings


class Frontend:
    """One frontend's engine and cluster.

    Args:
        policy: the resolved mode (a policy object; auto mode's frontend passes each mode it runs
            to :meth:`start`).
        settings: the engines' :class:`~tfsync.engine.settings.EngineSettings`, checked when they
            were built (:meth:`EngineSettings.of <tfsync.engine.settings.EngineSettings.of>`: a
            frontend's keyword arguments).
        cluster: the job's ranks; default ``None``: Horovod's
            (:class:`~tfsync.engine.cluster.HorovodCluster`, built at first use, which checks
            that Horovod is initialized and the process was launched by ``horovodrun``).
    """

    def __init__(self, policy, settings: EngineSettings, cluster=None):
        self.policy, self.settings = policy, settings
        self._cluster = cluster
        self.engine = None

    @property
    def cluster(self):
        if self._cluster is None:
            self._cluster = HorovodCluster()
        return self._cluster

    @property
    def wait_timeout_s(self) -> float:
        return self.settings.wait_timeout_s

    def optimizer_path(self, optimizer=None, *, policy=None, station="apply", shared=False, engine=None):
        """The optimizer path of ``policy``'s step protocol (default: this frontend's mode), built
        once (:mod:`tfsync.engine.protocols.path`): what ``optimizer``'s update becomes.
        ``engine``: a callable returning the engine its hooks call (default: this frontend's
        running engine, looked up at every step)."""
        engine = engine if engine is not None else (lambda: self.engine if self.running else None)
        return protocols.optimizer_path(
            self.policy if policy is None else policy, engine, optimizer, station=station, shared=shared
        )

    @staticmethod
    def hook_optimizer(optimizer, hook):
        """Replace ``optimizer.apply`` (Keras 3's one entry for updates: ``apply_gradients`` calls
        it, and so does a ``LossScaleOptimizer``) with ``hook(original, grads, variables)``,
        ``original`` being its own ``apply``; :meth:`unhook_optimizer` undoes it."""
        original = type(optimizer).apply.__get__(optimizer)

        def apply(grads, trainable_variables=None):
            if trainable_variables is None:  # (Keras: the variables the optimizer was built with)
                trainable_variables = getattr(optimizer, "_trainable_variables", [])
            return hook(original, list(grads), list(trainable_variables))

        optimizer.apply = apply
        return original

    @staticmethod
    def unhook_optimizer(optimizer):
        if optimizer is not None and "apply" in vars(optimizer):
            del optimizer.apply

    def install(self, model, path, who, compiled=None):
        """Install ``path`` at the optimizer's ``apply`` of a Keras ``model`` and around its train
        step, then compile the train step (the callback's station), or install ``compiled``, a
        train function this frontend compiled on ``path`` for ``model`` before (a later trace of
        it, for inputs of another shape, goes through the hooks installed here).  The step is
        checked when it is traced, before it runs: it must update the weights through that
        ``apply`` exactly once, on the model's trainable variables, or ``who`` refuses it (another
        path would train each worker alone).  Returns how a round's mean goes through the
        optimizer without an exchange
        (:meth:`OptimizerPath.apply_mean <tfsync.engine.protocols.path.OptimizerPath.apply_mean>`)."""
        variables = list(model.trainable_variables)
        expected, applies = [id(v) for v in variables], [0]

        def hook(original, grads, updated):
            if [id(v) for v in updated] != expected:
                raise ValueError(
                    "tfsync: the optimizer was asked to update other variables than the model's trainable "
                    "weights at the start of fit; do not change trainability during fit"
                )
            applies[0] += 1
            return path.apply(original, grads, updated)

        original = self.hook_optimizer(model.optimizer, hook)
        path.install(model.optimizer, original, variables)
        apply_mean = path.apply_mean(original, variables)
        train_step = type(model).train_step.__get__(model)

        def checked_train_step(data):
            applies[0] = 0
            out = train_step(data)
            if applies[0] != 1:
                self.engine.abandon()  # (fit raises: Keras calls no on_train_end)
                did = "called model.optimizer.apply() or apply_gradients()"
                raise once_per_step_error(who, model, applies[0], did, "through that call")
            return out

        model.train_step = path.train_step(model, checked_train_step, apply_mean)
        if compiled is None:
            model.make_train_function(force=True)
            compiled = reraising(model.train_function, lambda: self.engine)
        model.train_function = compiled
        return apply_mean

    @classmethod
    def uninstall(cls, model, optimizer):
        """Undo :meth:`install` (``model`` may be None: nothing was installed on a model)."""
        cls.unhook_optimizer(optimizer)
        if model is not None and "train_step" in vars(model):
            del model.train_step

    def start(self, variables, *, policy=None, trace_name=None, extra_config=None):
        """Start an engine for ``policy`` (default: this frontend's) on ``variables`` (collective);
        its trace goes to ``trace_dir/trace_name`` when both are set.  Returns the engine."""
        settings = self.settings
        if trace_name and settings.trace_dir:
            settings = settings.with_trace_dir(os.path.join(settings.trace_dir, trace_name))
        engine = SyncEngine(self.policy if policy is None else policy, settings, cluster=self.cluster)
        self.engine = engine
        engine.start(variables, extra_config=extra_config)
        return engine

    @property
    def running(self) -> bool:
        return self.engine is not None and self.engine.started

    def collective(self, fn, name, purpose):
        """Run ``fn``, the collective ``name`` on :attr:`cluster` (``purpose``: what it is for, in
        words, for its errors), in the job's order of collectives: on the engine's exchange
        thread after every queued round while an engine runs (watched as a round's wait is:
        :meth:`SyncEngine.call <tfsync.engine.SyncEngine.call>`), here otherwise; bounded by
        the wait bound either way (:func:`tfsync.engine.bounded.run_bounded`)."""
        on = None
        if self.running:
            engine, what = self.engine, f"the collective {name!r} ({purpose})"
            on = lambda fn_, timeout_s: engine.call(fn_, timeout_s, what)  # noqa: E731
        return run_bounded(self.cluster, fn, name=name, purpose=purpose, timeout_s=self.wait_timeout_s, on=on)

    def allgather(self, obj, name, purpose):
        """Every rank's ``obj``, in rank order (collective)."""
        return self.collective(lambda: self.cluster.allgather_object(obj, name=name), name, purpose)

    def average(self, values, name, purpose):
        """The mean over the ranks of a list of floats (collective), as float64."""
        values = tf.constant(np.asarray(values, np.float64))
        return self.collective(lambda: self.cluster.average([values], name)[0].numpy(), name, purpose)

    def agree(self, config, name, purpose, what, fix):
        """Check that every rank's ``config`` (plain data) is rank 0's (collective): raise
        ``ValueError`` naming the ranks that differ and the first difference
        (:func:`tfsync.engine.agreement.check_agreement`); ``what`` the configs hold and how
        to ``fix`` a difference, in words.  Returns every rank's config."""
        configs = self.allgather(config, name, purpose)
        agreement.check_agreement(configs, what, fix)
        return configs

    def broadcast_variables(self, variables, name, purpose):
        """Set ``variables`` to rank 0's values on every rank, in place (collective)."""
        return self.collective(lambda: self.cluster.broadcast_variables(list(variables), 0, name), name, purpose)

    def finish(self, apply_mean=None):
        """Wait for every round in flight and apply it: identical weights on every rank
        (collective; :meth:`tfsync.engine.SyncEngine.finish`)."""
        self.engine.finish(apply_mean=apply_mean)

    def stop(self, apply_mean=None, drain=True):
        """Drain (unless ``drain=False``) and close the running engine (collective); it stays in
        :attr:`engine` for its counts and totals."""
        try:
            if drain:
                self.finish(apply_mean)
        finally:
            self.engine.close()


def check_start(frontend, steps, mode, model) -> int:
    """Before the engine starts on a Keras ``model`` (collective): every rank runs the same
    number of ``steps`` per epoch (Keras' ``params["steps"]``), ``mode`` (a policy, or
    ``tfsync.Auto``), model and optimizer (:func:`fingerprint`), and then holds rank 0's
    variables, the model's and the optimizer's (iterations, slots, learning rate, a loss scale:
    a checkpoint loaded on one rank alone cannot leave the replicas apart).  Returns ``steps``."""
    optimizer = model.optimizer
    if not optimizer.built:  # its slots exist before they are compared and broadcast
        optimizer.build(model.trainable_variables)
    start = {"steps": steps, "mode": mode.config(), **fingerprint(model.variables, optimizer, model)}
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
    agreement.check_agreement(configs, "mode, model and optimizer", FINGERPRINT_FIX)
    frontend.broadcast_variables(
        model.variables + list(optimizer.variables),
        "tfsync.weights",
        "rank 0's weights and optimizer state, broadcast to every rank at the start of fit",
    )
    return steps


def once_per_step_error(who, model, count, did, at):
    """The error for a train step that updated the weights through the hooked optimizer ``count``
    times (``did``: what it did that often, ``at``: where tfsync synchronizes), not once."""
    return ValueError(
        f"{who}: the train step of {type(model).__name__} {did} {count} times; tfsync synchronizes the "
        f"weights {at}, once per step, so "
        + (
            "a step that updates them some other way (another optimizer, assign_sub) would train each " "worker alone"
            if count == 0
            else "every call after the first would exchange again"
        )
        + ". Compute the step's gradients of model.trainable_variables and call "
        "self.optimizer.apply(grads, self.trainable_variables) (or apply_gradients) once"
    )


def reraising(train_function, engine):
    """``train_function``, raising the engine's own error (``engine()``'s) where a tfsync error
    surfaced through the graph as a TensorFlow op error."""

    def train_function_reraising(iterator):
        try:
            return train_function(iterator)
        except tf.errors.OpError as exc:
            running = engine()
            if running is not None and running.error is not None:
                raise running.error from exc
            graph = None if running is None else running.graph
            if graph is not None and graph.active and graph.engine is running:  # an in-graph round failed
                raise graph.error(running, exc) from exc
            raise

    return train_function_reraising


# What a frontend's start check compares across ranks (Frontend.agree), before rank 0's
# variables are broadcast over every rank's: a broadcast needs the same variables everywhere,
# and a rank that builds another model or optimizer must not train silently on rank 0's weights.
FINGERPRINT_FIX = (
    "launch the same script with the same arguments on every rank, building the same model and "
    "optimizer in the same order (Keras numbers the layers it names per process)"
)


def fingerprint(variables, optimizer=None, model=None) -> dict:
    """What every rank must have in common to train one model, as plain data: each variable's
    path, dtype, shape and trainability, in order (a path holds its layers' names); the
    classes of ``model``'s layers, in order (which catches layers without variables, such as
    ``Dropout``, and layers of another kind with variables of the same shapes); and the
    optimizer's class and configuration (:func:`optimizer_fingerprint`).  A layer's own
    arguments (an activation, an initializer's seed) are not compared."""
    described = {
        "variables": [
            {
                "path": _path(v),
                "dtype": tf.as_dtype(v.dtype).name,
                "shape": [int(d) if d is not None else None for d in v.shape],
                "trainable": getattr(v, "trainable", None),
            }
            for v in variables
        ]
    }
    if model is not None:
        flatten = getattr(model, "_flatten_layers", None)  # (every nested layer; Keras' own walk)
        layers = list(flatten(include_self=False)) if flatten is not None else list(model.layers)
        described["layers"] = [f"{type(layer).__module__}.{type(layer).__qualname__}" for layer in layers]
    if optimizer is not None:
        described["optimizer"] = optimizer_fingerprint(optimizer)
    return described


def _path(variable):
    """A variable's name in its model (Keras' ``path``, a ``tf.Variable``'s ``name``); None for
    a tensor (a custom loop's gradients: only their dtypes and shapes are compared)."""
    if isinstance(variable, keras.Variable):
        return variable.path
    return variable.name if isinstance(variable, tf.Variable) else None


def optimizer_fingerprint(optimizer) -> dict:
    """An optimizer's class and ``get_config()``, strict but comparable across processes.

    Left out: ``name`` (Keras numbers unnamed optimizers per process) and a learning rate
    held in a variable, which is state like the slots (broadcast with the optimizer's
    variables; callbacks such as ``ReduceLROnPlateau`` change it); a learning-rate schedule is
    configuration and stays.  A ``LossScaleOptimizer``'s inner optimizer is described the same
    way.  Values that are not plain data are described by their type, never by ``repr`` (which
    may hold a memory address)."""
    cls = type(optimizer)
    try:
        config = dict(optimizer.get_config())
    except (NotImplementedError, TypeError, ValueError):
        # a custom optimizer without get_config, or with settings Keras cannot serialize (its
        # get_config raises then): there is no configuration to compare, only the class; the
        # optimizer's variables still come from rank 0
        config = {}
    config.pop("name", None)
    if isinstance(getattr(optimizer, "_learning_rate", None), tf.Variable | keras.Variable):
        config.pop("learning_rate", None)
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        config["inner_optimizer"] = optimizer_fingerprint(inner)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "config": _plain(config)}


def _plain(value):
    """``value`` as plain data (what an allgather can pickle and ``==`` compare across processes)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, numbers.Number):
        return value.item() if isinstance(value, np.generic) else value
    return f"<{type(value).__module__}.{type(value).__qualname__}>"
