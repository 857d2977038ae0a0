"""User cases that could end with no error but wrong replicas, run as a new user would:
2 workers, ``SyncCallback(mode=...)``, a small Keras model, a few epochs.

argv: out_dir.  Each case trains its own model, optimizer and callback, one after another;
a case that raises records its error instead of stopping the others.  Each rank writes, per
case: its final weights and optimizer variables (as lists, compared across ranks by the
test), how far the weights moved, its counts (``SyncCallback.counts``) and the epoch logs'
``tfsync_rejected`` (means over the workers).

* ``tape_apply_bsp``: a custom ``train_step`` (``tf.GradientTape``, then
  ``self.optimizer.apply(grads, self.trainable_variables)``, Keras 3's low-level path), BSP, Adam.
* ``nan_bsp``, ``nan_psp``: one batch of rank 1 holds a NaN input, SGD.
* ``adam_ahead_bsp``: rank 1's Adam applied one step on its own before ``fit`` (as after a
  checkpoint loaded on one rank only), BSP.
* ``nan_ssp_adam``: one batch of rank 1 holds a NaN input, ``SSP(staleness=1)``, Adam.
"""

import sys
import traceback

import numpy as np
from common import init, regression_shard, write_result

hvd = init()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfsync  # noqa: E402

out_dir = sys.argv[1]
rank = hvd.rank()
EPOCHS, STEPS, BATCH = 3, 4, 8
# 12 distinct batches per rank: with steps_per_epoch, Keras goes on through the data across
# epochs, so the NaN batch is seen once in the whole fit, not once per epoch
xl, yl = regression_shard(2 * EPOCHS * STEPS * BATCH)
NAN_BATCH = 5  # rank 1's 6th batch (epoch 1, step 1): after the first rounds, before the last
x_nan = xl.copy()
if rank == 1:
    x_nan[NAN_BATCH * BATCH + 2, 3] = np.nan


class TapeModel(keras.Sequential):
    """Keras 3's documented custom training step: gradients from a tape, then ``optimizer.apply``."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(y - self(x, training=True)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def build(cls=keras.Sequential):
    keras.utils.set_random_seed(1)  # the same initial weights on every rank and in every case
    return cls([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def run_case(optimizer, mode, x=xl, model_cls=keras.Sequential, before_fit=None, stragglers=None):
    model = build(model_cls)
    model.compile(optimizer=optimizer, loss="mse")
    start = [w.copy() for w in model.get_weights()]
    row = {}
    if before_fit is not None:
        row.update(before_fit(model))
    sync = tfsync.keras.SyncCallback(mode=mode, wait_timeout_s=30, stragglers=stragglers)
    history = model.fit(
        x, yl, batch_size=BATCH, epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False, verbose=0, callbacks=[sync]
    )
    weights = model.get_weights()
    row.update(
        weights=[w.tolist() for w in weights],
        optimizer_variables={v.path: np.asarray(v).tolist() for v in model.optimizer.variables},
        moved=float(max(np.max(np.abs(a - b)) for a, b in zip(weights, start))),
        counts=dict(sync.counts),
        logged_rejected=[float(v) for v in history.history["tfsync_rejected"]],
    )
    return row


def one_step_ahead(model):
    """Rank 1's optimizer takes one step on its own before fit (rank 0's is not even built)."""
    if rank == 1:
        model.optimizer.apply([tf.fill(v.shape, 0.1) for v in model.trainable_variables], model.trainable_variables)
    return {"iterations_before_fit": int(model.optimizer.iterations.numpy())}


# PSP's rounds close on one contribution (min_contributions=1) and wait up to 0.2 s for the
# other: rank 0, slower by 0.02 s a step, still joins them, so the round of rank 1's NaN batch
# aggregates rank 0's gradient alone; rank 1, ahead, never skips the step of its NaN batch (a
# skipped step computes nothing, and there would be nothing to reject)
NAN_PSP = tfsync.PSP(min_contributions=1, push_timeout_s=0.2)
RANK_0_SLOW = tfsync.Stragglers(slow_ranks={0: 0.02})

CASES = {
    "tape_apply_bsp": lambda: run_case(keras.optimizers.Adam(0.01), "bsp", model_cls=TapeModel),
    "nan_bsp": lambda: run_case(keras.optimizers.SGD(0.05), "bsp", x=x_nan),
    "nan_psp": lambda: run_case(keras.optimizers.SGD(0.05), NAN_PSP, x=x_nan, stragglers=RANK_0_SLOW),
    "adam_ahead_bsp": lambda: run_case(keras.optimizers.Adam(0.01), "bsp", before_fit=one_step_ahead),
    "nan_ssp_adam": lambda: run_case(keras.optimizers.Adam(0.01), tfsync.SSP(staleness=1), x=x_nan),
}

result = {"data_sum": float(xl.sum()), "steps": EPOCHS * STEPS}
for name, case in CASES.items():
    try:
        result[name] = {"error": None, **case()}
    except Exception as exc:  # the outcome under test: recorded, and the next case runs
        result[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
write_result(out_dir, rank, result)
