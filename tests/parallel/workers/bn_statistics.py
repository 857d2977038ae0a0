"""Non-trainable statistics (BatchNormalization) averaged at the end of fit.

(Not named statistics.py: this directory is first on the workers' sys.path, and that name
would shadow the standard library's statistics module, which tfsync imports.)

argv: out_dir.  Each rank trains a model with a BatchNormalization layer and a
frozen Dense layer on its own shard (different batches, so different moving
statistics) and records, per case: the statistics before and after the
average, whether the frozen kernel kept its initial value bit for bit, and every
weight (trainable and not) at the end.
"""

import sys

import numpy as np
from common import init, regression_shard, write_result

hvd = init()

import keras  # noqa: E402

import tfsync  # noqa: E402

out_dir = sys.argv[1]
xl, yl = regression_shard(256)
xl = xl * (1.0 + hvd.rank())  # each worker sees a differently scaled input: distinct statistics


def build():
    keras.utils.set_random_seed(3)
    frozen = keras.layers.Dense(8, trainable=False)
    model = keras.Sequential([keras.Input((8,)), frozen, keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model, frozen


class Before(keras.callbacks.Callback):
    """Listed before SyncCallback: its on_train_end sees the statistics before the average."""

    def on_train_end(self, logs=None):
        self.statistics = [np.asarray(v).tolist() for v in tfsync.keras.statistics.floating_statistics(self.model)]


def train(case):
    if case == "strategy":
        strategy = tfsync.distribute.SyncStrategy(mode="bsp")
        with strategy.scope():
            model, frozen = build()
        initial = np.asarray(frozen.kernel).copy()
        model.fit(xl, yl, batch_size=8, epochs=1, shuffle=False, verbose=0)
        strategy.finish()
        before = [np.asarray(v).tolist() for v in tfsync.keras.statistics.floating_statistics(model)]
        averaged = tfsync.keras.average_statistics(model)
    else:
        mode, average = case.split("/")
        model, frozen = build()
        initial = np.asarray(frozen.kernel).copy()
        capture = Before()
        sync = tfsync.keras.SyncCallback(mode=mode, average_statistics=average == "average")
        model.fit(xl, yl, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[capture, sync])
        before, averaged = capture.statistics, None
    after = [np.asarray(v).tolist() for v in tfsync.keras.statistics.floating_statistics(model)]
    return {
        "before": before,
        "after": after,
        "averaged": averaged,
        "frozen_kept": bool(np.array_equal(np.asarray(frozen.kernel), initial)),
        "weights": [w.tolist() for w in model.get_weights()],
    }


result = {case: train(case) for case in ("bsp/average", "ssp/average", "bsp/keep", "strategy")}
write_result(out_dir, hvd.rank(), result)
