"""Plain Horovod BSP for a Keras 3 model: the baseline tfsync is measured against.

``horovod.tensorflow.keras`` fails on Keras 3 (upstream issue 4290), so a Keras
3 user averages gradients by hand with the core op, in graph, as Horovod's
``DistributedOptimizer`` does.  That is what :func:`use_horovod_allreduce` does.
"""

import time

import keras
import numpy as np
import tensorflow as tf


def use_horovod_allreduce(model, hvd, compression=None):
    """Make ``model``'s optimizer average gradients with in-graph ``hvd.grouped_allreduce``;
    ``compression="fp16"``: Horovod's own ``hvd.Compression.fp16`` (Horovod has no bf16)."""
    if compression not in (None, "fp16"):
        raise ValueError(
            f"plain Horovod's compression={compression!r}: Horovod's Compression offers fp16 only; "
            f"pass compression='fp16' or None"
        )
    opt = model.optimizer
    original = type(opt).apply_gradients.__get__(opt)
    compressor = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none

    def apply_gradients(grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        grads = hvd.grouped_allreduce(
            [tf.convert_to_tensor(g) for g, _ in grads_and_vars], op=hvd.Average, compression=compressor
        )
        return original(zip(grads, [v for _, v in grads_and_vars]))

    opt.apply_gradients = apply_gradients
    model.make_train_function(force=True)


def ring_bytes(model, size, compression=None) -> dict:
    """Plain Horovod's bytes on the wire per step, counted as tfsync counts its rounds'
    (:mod:`tfsync.engine.wire.counting`): one allreduce of every trainable weight's gradient,
    ``2·(n-1)/n`` of its bytes each way, 16 bits a floating value under fp16; no metadata."""
    ring = 2.0 * (size - 1) / size if size > 1 else 0.0
    raw = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in model.trainable_variables)
    wire = sum(
        int(np.prod(v.shape)) * (2 if compression and tf.as_dtype(v.dtype).is_floating else tf.as_dtype(v.dtype).size)
        for v in model.trainable_variables
    )
    return {
        "bytes_sent": ring * wire,
        "bytes_received": ring * wire,
        "uncompressed_bytes_sent": ring * raw,
        "uncompressed_bytes_received": ring * raw,
    }


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
