"""BSP (callback and strategy) and SSP(0) against plain Horovod allreduce-average.

Same seeds, data and optimizer; weights after the same steps must match.
"""

import sys

import numpy as np
from common import init, write_result

hvd = init()
import keras  # noqa: E402

import tfsync  # noqa: E402
from tfsync.bench.baseline import use_horovod_allreduce  # noqa: E402

out_dir = sys.argv[1]
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 3))).astype("float32")
xl, yl = tfsync.shard(x, y, batch_size=8)

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def build():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def train(variant, opt_name):
    if variant == "strategy":
        strategy = tfsync.distribute.SyncStrategy(mode="bsp")
        with strategy.scope():
            model = build()
            model.compile(optimizer=OPTIMIZERS[opt_name](), loss="mse")
        model.fit(xl, yl, batch_size=8, epochs=2, shuffle=False, verbose=0)
        strategy.finish()
        return model.get_weights()
    model = build()
    model.compile(optimizer=OPTIMIZERS[opt_name](), loss="mse")
    callbacks = []
    if variant == "horovod":
        use_horovod_allreduce(model, hvd)
    else:
        mode = {"bsp": "bsp", "ssp0": tfsync.SSP(staleness=0)}[variant]
        callbacks = [tfsync.keras.SyncCallback(mode=mode)]
    model.fit(xl, yl, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return model.get_weights()


result = {}
for opt_name in OPTIMIZERS:
    ref = train("horovod", opt_name)
    start = build().get_weights()
    result[opt_name] = {"moved": float(max(np.max(np.abs(a - b)) for a, b in zip(ref, start)))}
    for variant in ("bsp", "strategy", "ssp0"):
        w = train(variant, opt_name)
        result[opt_name][variant] = float(max(np.max(np.abs(a - b)) for a, b in zip(ref, w)))
write_result(out_dir, hvd.rank(), result)
