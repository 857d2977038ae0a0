"""Averaging a model's non-trainable statistics (BatchNormalization's moving mean and variance).

tfsync, like Horovod, synchronizes what the optimizer trains.  A layer's
non-trainable state that each worker updates from its own batches, such as
``BatchNormalization``'s ``moving_mean`` and ``moving_variance``, drifts apart
between workers.  Averaging it at the end of training is timm's ``distribute_bn``
(``reduce``) in its PyTorch trainer; Horovod's answer is ``hvd.SyncBatchNormalization``,
which synchronizes every batch instead.
"""

import tensorflow as tf

from tfsync import _env
from tfsync.engine.bounded import run_bounded
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.protocols import floating_statistics, tf_variable


def average_statistics(model, name="tfsync.statistics", *, cluster=None, wait_timeout_s=None):
    """Set every non-trainable floating-point variable of ``model`` to its mean over the workers.

    A collective: every rank calls it, with the same model, when no training step
    is running (``SyncCallback`` does it at the end of ``fit``; after ``SyncStrategy``
    training, call it after ``strategy.finish()``).  The mean is taken in float64 and
    rounded once, so a variable that is equal on every worker (a frozen layer's
    weights) keeps its exact value.  Returns the number of variables averaged.
    ``cluster``: the job's ranks (:mod:`tfsync.engine.cluster`); default: Horovod's.
    ``wait_timeout_s``: the bound on each of its two collectives (default 120 s, or
    ``TFSYNC_WAIT_TIMEOUT_S``; :func:`tfsync.engine.bounded.run_bounded`): a worker that does
    not come stops every worker with an error naming it.
    """
    cluster = HorovodCluster() if cluster is None else cluster
    timeout_s = _env.wait_timeout_s(wait_timeout_s)
    variables = floating_statistics(model)
    shapes = [tuple(int(d) for d in v.shape) for v in variables]
    every = run_bounded(
        cluster,
        lambda: cluster.allgather_object(shapes, name=f"{name}.shapes"),
        name=f"{name}.shapes",
        purpose="the shapes of every rank's non-trainable statistics, gathered to check the models match",
        timeout_s=timeout_s,
    )
    if any(s != shapes for s in every):
        raise ValueError(
            f"tfsync.keras.average_statistics: the workers' models differ in their non-trainable "
            f"variables ({len(variables)} here, shapes {shapes[:4]}...; others: "
            f"{[len(s) for s in every]} variables); every worker must build the same model"
        )
    if not variables:
        return 0
    values = [tf.cast(tf_variable(v), tf.float64) for v in variables]
    means = run_bounded(
        cluster,
        lambda: cluster.average(values, name),
        name=name,
        purpose="the mean over the ranks of the model's non-trainable statistics (e.g. BatchNormalization's)",
        timeout_s=timeout_s,
    )
    for v, mean in zip(variables, means):
        v.assign(tf.cast(mean, v.dtype))
    return len(variables)
