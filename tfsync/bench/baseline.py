"""Plain Horovod BSP for a Keras 3 model: the baseline tfsync is measured against.

``horovod.tensorflow.keras`` fails on Keras 3 (upstream issue 4290), so a Keras
3 user averages gradients by hand with the core op, in graph, as Horovod's
``DistributedOptimizer`` does.  That is what :func:`use_horovod_allreduce` does.
"""

import time

import keras
import numpy as np
import tensorflow as tf


def use_horovod_allreduce(model, hvd):
    """Make ``model``'s optimizer average gradients with in-graph ``hvd.grouped_allreduce``."""
    opt = model.optimizer
    original = type(opt).apply_gradients.__get__(opt)

    def apply_gradients(grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        grads = hvd.grouped_allreduce([tf.convert_to_tensor(g) for g, _ in grads_and_vars], op=hvd.Average)
        return original(zip(grads, [v for _, v in grads_and_vars]))

    opt.apply_gradients = apply_gradients
    model.make_train_function(force=True)


def broadcast_model(model, hvd):
    """Rank 0's weights on every rank (what ``BroadcastGlobalVariablesCallback`` does)."""
    for i, v in enumerate(model.variables):
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank=0, name=f"baseline.bcast.{i}"))


class SleepEachStep(keras.callbacks.Callback):
    """The baseline's simulated device time and stragglers (tfsync's engine sleeps inside the step).

    ``delays``: ``tfsync.Stragglers(...).for_rank(rank)``.
    """

    def __init__(self, delays):
        super().__init__()
        self.delays = delays

    def on_train_batch_begin(self, batch, logs=None):
        self.delays.sleep()

    def on_train_batch_end(self, batch, logs=None):
        # slow pulls: the step's round reaches this worker with its last block (as tfsync's
        # modes without partial pulling wait for it; one block per weight tensor)
        if self.delays.config.pull_prob:
            delay = float(np.max(self.delays.pull_delays_s(len(self.model.trainable_weights))))
            if delay > 0:
                time.sleep(delay)
