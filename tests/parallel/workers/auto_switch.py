"""Auto mode switching between modes that need different compiled steps.

argv: out_dir.  Rank 1 is a persistent straggler for its first 20 steps (a sleep
before each), then runs at the others' pace.  Auto maps the
straggler profile to SSP(2) (an update protocol: its own compiled step) and
"none" to BSP (the gradient protocol), with short windows and confirm=1, so the
run switches BSP -> SSP at step 12 (the first decision, mid-epoch) and back
to BSP at the end of epoch 0, retracing at each switch.  Each rank writes its
decisions, counts, the epoch logs' counts and its final weights.
"""

import sys
import time

from common import init, regression_shard, write_result

hvd = init()

import keras  # noqa: E402

import tfsync  # noqa: E402

out_dir = sys.argv[1]
xl, yl = regression_shard(512)  # 32 steps of 8 per epoch on each of 2 workers
EPOCHS, SLOW_UNTIL = 3, 20  # rank 1 slow for its first 20 steps of 96


class Straggle(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.done = 0

    def on_train_batch_begin(self, batch, logs=None):
        time.sleep(0.01)  # simulated device time
        if hvd.rank() == 1 and self.done < SLOW_UNTIL:
            time.sleep(0.06)
        self.done += 1


keras.utils.set_random_seed(5)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9), loss="mse")
ssp, bsp = tfsync.SSP(staleness=2), tfsync.BSP()
modes = {"straggler": ssp, "heterogeneous": ssp, "jitter": bsp, "rare": bsp}  # none: BSP by default
auto = tfsync.Auto(modes=modes, window_steps=12, confirm=1)
sync = tfsync.keras.SyncCallback(mode=auto)
history = model.fit(xl, yl, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[sync, Straggle()])
logged = {k: sum(history.history[f"tfsync_{k}"]) for k in tfsync.engine.COUNTS}  # means over the workers
write_result(
    out_dir,
    hvd.rank(),
    {
        "decisions": sync.auto_decisions,
        "counts": sync.counts,
        "logged": logged,
        "weights": [w.tolist() for w in model.get_weights()],
    },
)
