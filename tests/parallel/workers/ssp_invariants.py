"""SSP under random injected delays: records what the invariants are checked on.

A linear model whose gradient is a known constant per rank makes every
update exactly predictable, so the weights a worker computes on can be
checked against "all rounds up to applied_through from everyone, plus all of
my own" (read-my-writes), and the final weights against the sum of all
updates (nothing lost).
"""

import sys

import numpy as np
from common import init, write_result

hvd = init()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfsync  # noqa: E402

out_dir, staleness = sys.argv[1], int(sys.argv[2])
rank, size = hvd.rank(), hvd.size()
LR, STEPS_PER_EPOCH, EPOCHS, BATCH = 0.01, 10, 3, 4
x = np.ones((STEPS_PER_EPOCH * BATCH, 1), "float32")
y = np.full((len(x), 1), rank + 1.0, "float32")  # scales this rank's gradient


def linear_loss(y_true, y_pred):
    return tf.reduce_mean(y_pred * y_true)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4, use_bias=False)])
model.compile(optimizer=keras.optimizers.SGD(LR), loss=linear_loss)
sync = tfsync.keras.SyncCallback(
    mode=tfsync.SSP(staleness=staleness),
    trace_dir=f"{out_dir}/trace",
    stragglers=tfsync.Stragglers(base_s=0.005, jitter_s=0.03, rare_prob=0.05, rare_s=0.2, seed=7),
)


class Probe(keras.callbacks.Callback):
    """Weights each step is computed on, with the engine's view at that moment."""

    def on_train_begin(self, logs=None):
        self.w0 = np.array(self.model.get_weights()[0], np.float64).reshape(-1)
        self.rows = []

    def on_train_batch_begin(self, batch, logs=None):
        e = sync.engine
        self.rows.append(
            {
                "step": e.step,
                "applied_through": e.applied_through,
                "w": np.asarray(self.model.get_weights()[0], np.float64).reshape(-1).tolist(),
            }
        )


probe = Probe()
callbacks = [sync, probe]
if rank == 0:
    callbacks.append(keras.callbacks.TensorBoard(log_dir=f"{out_dir}/tb", update_freq="epoch"))
history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)

# every rank's constant gradient: d/dW mean(W * k) = k / 4 per element
grads = np.array([(r + 1) / 4.0 for r in range(size)])
own = grads[rank]
errors = []
for row in probe.rows:
    c, a = row["step"], row["applied_through"]
    expected = probe.w0 - LR / size * ((a + 1) * grads.sum() + (c - 1 - a) * own)
    errors.append(float(np.max(np.abs(np.array(row["w"]) - expected))))
final = np.array(model.get_weights()[0], np.float64).reshape(-1)
total_steps = STEPS_PER_EPOCH * EPOCHS
expected_final = probe.w0 - LR / size * total_steps * grads.sum()
write_result(
    out_dir,
    rank,
    {
        "read_my_writes_max_error": max(errors),
        "steps_seen": len(probe.rows),
        "min_applied_minus_step": min(r["applied_through"] - r["step"] for r in probe.rows),
        "final_error": float(np.max(np.abs(final - expected_final))),
        "final_weights_hex": [float(v).hex() for v in final],
        "history_keys": sorted(history.history),
        "wait_fraction": history.history["tfsync_wait_fraction"],
    },
)
