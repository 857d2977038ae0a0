"""Averaging a model's non-trainable statistics (BatchNormalization's moving mean and variance).

tfsync, like Horovod, synchronizes what the optimizer trains.  A layer's
non-trainable state that each worker updates from its own batches, such as
``BatchNormalization``'s ``moving_mean`` and ``moving_variance``, drifts apart
between workers.  Averaging it at the end of training is timm's ``distribute_bn``
(``reduce``) in its PyTorch trainer; Horovod's answer is ``hvd.SyncBatchNormalization``,
which synchronizes every batch instead.
"""

import tensorflow as tf

from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.protocols import tf_variable


def floating_statistics(model):
    """The model's non-trainable floating-point variables (integer state such as seeds is left alone)."""
    return [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]


def average_statistics(model, name="tfsync.statistics", *, cluster=None):
    """Set every non-trainable floating-point variable of ``model`` to its mean over the workers.

    A collective: every rank calls it, with the same model, when no training step
    is running (``SyncCallback`` does it at the end of ``fit``; after ``SyncStrategy``
    training, call it after ``strategy.finish()``).  The mean is taken in float64 and
    rounded once, so a variable that is equal on every worker (a frozen layer's
    weights) keeps its exact value.  Returns the number of variables averaged.
    ``cluster``: the job's ranks (:mod:`tfsync.engine.cluster`); default: Horovod's.
    """
    cluster = HorovodCluster() if cluster is None else cluster
    variables = floating_statistics(model)
    shapes = [tuple(int(d) for d in v.shape) for v in variables]
    every = cluster.allgather_object(shapes, name=f"{name}.shapes")
    if any(s != shapes for s in every):
        raise ValueError(
            f"tfsync.keras.average_statistics: the workers' models differ in their non-trainable "
            f"variables ({len(variables)} here, shapes {shapes[:4]}...; others: "
            f"{[len(s) for s in every]} variables); every worker must build the same model"
        )
    if not variables:
        return 0
    values = [tf.cast(tf_variable(v), tf.float64) for v in variables]
    means = cluster.average(values, name)
    for v, mean in zip(variables, means):
        v.assign(tf.cast(mean, v.dtype))
    return len(variables)
