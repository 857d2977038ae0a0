"""What the Keras callback and the ``tf.distribute`` strategy share around the engine.

Both frontends take a mode and the engine's settings, check them when they are
built (before any training), start one engine per training run on the
model's trainable variables, hook the optimizer's path
(:func:`tfsync.engine.tf_bridge.before_optimizer` and
:func:`~tfsync.engine.tf_bridge.after_optimizer`), drain the rounds in flight
when training ends and close the engine.  :class:`Frontend` does that once for
both, and is their only way to the other workers: every collective goes
through its cluster (:mod:`tfsync.engine.cluster`; Horovod in production,
in-process ranks in the single-process tests), in the same order on every rank,
and each is bounded by the wait bound (:func:`tfsync.engine.cluster.run_bounded`),
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

from tfsync.engine import SyncEngine, lifecycle, nonfinite, protocols
from tfsync.engine.cluster import HorovodCluster, run_bounded


class Frontend:
    """One frontend's engine and cluster.

    Args:
        policy: the resolved mode (a policy object; auto mode's frontend passes each mode it runs
            to :meth:`start`).
        stragglers, trace_dir, wait_timeout_s: the engine's settings, checked now
            (:func:`tfsync.engine.lifecycle.settings`).
        on_nonfinite: ``"reject"`` (default) or ``"raise"``: what the engine does with a
            contribution that has a NaN or an infinity (:mod:`tfsync.engine.nonfinite`), checked now.
        elastic: the engines run under ``tfsync.elastic.run`` (default False; see
            :class:`tfsync.engine.SyncEngine`).
        cluster: the job's ranks; default ``None``: Horovod's
            (:class:`~tfsync.engine.cluster.HorovodCluster`, built at first use, which checks
            that Horovod is initialized and the process was launched by ``horovodrun``).
    """

    def __init__(
        self,
        policy,
        *,
        stragglers=None,
        trace_dir=None,
        wait_timeout_s=None,
        cluster=None,
        on_nonfinite="reject",
        elastic=False,
    ):
        self.policy = policy
        self.settings = lifecycle.settings(stragglers=stragglers, trace_dir=trace_dir, wait_timeout_s=wait_timeout_s)
        self.settings["on_nonfinite"] = nonfinite.check_option(on_nonfinite)
        self.settings["elastic"] = bool(elastic)
        self._cluster = cluster
        self.engine = None

    @property
    def cluster(self):
        if self._cluster is None:
            self._cluster = HorovodCluster()
        return self._cluster

    @property
    def wait_timeout_s(self) -> float:
        return self.settings["wait_timeout_s"]

    def protocol(self, policy=None):
        """The step protocol (class) of ``policy`` (default: this frontend's)."""
        return protocols.for_policy(self.policy if policy is None else policy)

    def start(self, variables, *, policy=None, trace_name=None, extra_config=None):
        """Start an engine for ``policy`` (default: this frontend's) on ``variables`` (collective);
        its trace goes to ``trace_dir/trace_name`` when both are set.  Returns the engine."""
        settings = dict(self.settings)
        if trace_name and settings["trace_dir"]:
            settings["trace_dir"] = os.path.join(settings["trace_dir"], trace_name)
        engine = SyncEngine(self.policy if policy is None else policy, cluster=self.cluster, **settings)
        self.engine = engine
        engine.start(variables, extra_config=extra_config)
        return engine

    @property
    def running(self) -> bool:
        return self.engine is not None and self.engine.started

    def collective(self, fn, name, purpose):
        """Run ``fn``, the collective ``name`` on :attr:`cluster` (``purpose``: what it is for, in
        words, for its errors), in the job's order of collectives: on the engine's exchange
        thread after every queued round while an engine runs, here otherwise; bounded by the
        wait bound either way (:func:`tfsync.engine.cluster.run_bounded`)."""
        on = self.engine.exchange.call if self.running else None
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
        (:func:`tfsync.engine.lifecycle.check_agreement`); ``what`` the configs hold and how
        to ``fix`` a difference, in words.  Returns every rank's config."""
        configs = self.allgather(config, name, purpose)
        lifecycle.check_agreement(configs, what, fix)
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


def floating_statistics(model):
    """The model's non-trainable floating-point variables (integer state such as seeds is left
    alone): ``BatchNormalization``'s moving statistics, which Local SGD and DiLoCo average with
    the weights at every outer step, and ``average_statistics`` at the end of training."""
    return [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]


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
