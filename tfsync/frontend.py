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
that names the collective and the ranks that had not reached it.
"""

import os

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
        cluster: the job's ranks; default ``None``: Horovod's
            (:class:`~tfsync.engine.cluster.HorovodCluster`, built at first use, which checks
            that Horovod is initialized and the process was launched by ``horovodrun``).
    """

    def __init__(
        self, policy, *, stragglers=None, trace_dir=None, wait_timeout_s=None, cluster=None, on_nonfinite="reject"
    ):
        self.policy = policy
        self.settings = lifecycle.settings(stragglers=stragglers, trace_dir=trace_dir, wait_timeout_s=wait_timeout_s)
        self.settings["on_nonfinite"] = nonfinite.check_option(on_nonfinite)
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
