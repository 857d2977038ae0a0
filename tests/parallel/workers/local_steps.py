"""Local SGD and DiLoCo under horovodrun: Horovod's collectives, the real launch.

argv: out_dir.  Each rank trains the seeded regression model (with a BatchNormalization
layer, its input scaled per rank so the statistics differ) on its own shard, per case, and
records every outer step's weights (statistics included), one inner step's, the final
weights and its counts.
"""

import hashlib
import sys

from common import init, regression_shard, write_result

hvd = init()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfsync  # noqa: E402

out_dir = sys.argv[1]
xl, yl = regression_shard(256)  # 16 steps of 8 per rank
xl = xl * (1.0 + hvd.rank())
PERIOD = 4


def build(optimizer):
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    return model


class Record(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append([w.tolist() for w in self.model.get_weights()])


CASES = {
    "localsgd": (lambda: tfsync.LocalSGD(period=PERIOD), lambda: keras.optimizers.Adam(0.01), "callback"),
    "diloco": (lambda: tfsync.DiLoCo(inner_steps=PERIOD), lambda: keras.optimizers.Adam(0.01), "callback"),
    "diloco-sgd1": (
        lambda: tfsync.DiLoCo(inner_steps=PERIOD, outer_optimizer=keras.optimizers.SGD(1.0)),
        lambda: keras.optimizers.Adam(0.01),
        "callback",
    ),
    "localsgd1": (lambda: tfsync.LocalSGD(period=1), lambda: keras.optimizers.SGD(0.05), "callback"),
    "bsp": (lambda: "bsp", lambda: keras.optimizers.SGD(0.05), "callback"),
    "diloco-overlap": (
        lambda: tfsync.DiLoCo(inner_steps=PERIOD, overlap_steps=2),
        lambda: keras.optimizers.Adam(0.01),
        "callback",
    ),
    "diloco/strategy": (lambda: tfsync.DiLoCo(inner_steps=PERIOD), lambda: keras.optimizers.Adam(0.01), "strategy"),
    # quantized outer rounds: Horovod's alltoall and allgather of the packed codes
    "localsgd-int8": (
        lambda: tfsync.LocalSGD(period=PERIOD, quantize="int8"),
        lambda: keras.optimizers.Adam(0.01),
        "callback",
    ),
    "diloco-fragments": (
        lambda: tfsync.DiLoCo(inner_steps=PERIOD, fragments=2, overlap_steps=1),
        lambda: keras.optimizers.Adam(0.01),
        "callback",
    ),
    "diloco-int4/strategy": (
        lambda: tfsync.DiLoCo(inner_steps=PERIOD, quantize="int4"),
        lambda: keras.optimizers.Adam(0.01),
        "strategy",
    ),
}


def train(case):
    mode, optimizer, frontend = CASES[case]
    record = Record()
    if frontend == "strategy":
        strategy = tfsync.distribute.SyncStrategy(mode=mode(), wait_timeout_s=60)
        with strategy.scope():
            model = build(optimizer())
        model.fit(xl, yl, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[record])
        engine = strategy.engine
        strategy.finish()
        counts = engine.counts
    else:
        model = build(optimizer())
        # (statistics averaged at the end, the default: BSP's then equal LocalSGD(period=1)'s, whose
        # moving averages are averaged every step: the mean of linear recurrences)
        sync = tfsync.keras.SyncCallback(mode=mode(), wait_timeout_s=60)
        model.fit(xl, yl, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[sync, record])
        counts = sync.counts
    return {
        "outer": [record.steps[k] for k in range(PERIOD - 1, len(record.steps), PERIOD)],
        "inner": record.steps[PERIOD - 2],
        "steps": len(record.steps),
        "weights": [w.tolist() for w in model.get_weights()],
        "counts": counts,
        "iterations": int(model.optimizer.iterations.numpy()),
    }


def train_paced():
    """DiLoCo(H=4, P=2, overlap 1, int8) on a model wide enough (8.4M parameters) that each
    fragment's round goes in pieces (tfsync.engine.wire.pacing): the final weights' digest, the
    counts and the most pieces a round went in (a spy on the exchange's paced_round)."""
    from tfsync.engine import exchange
    from tfsync.engine.wire import pacing

    pieces, paced_round = [], exchange.paced_round

    def spy(collective, payload, meta, spread_s, pause, size, wire_bytes, **kwargs):
        values = sum(int(np.prod(t.shape)) for t in payload)
        pieces.append(len(pacing.piece_bounds(values, wire_bytes, size)))
        return paced_round(collective, payload, meta, spread_s, pause, size, wire_bytes, **kwargs)

    exchange.paced_round = spy
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(2048, activation="tanh"),
            keras.layers.Dense(2048, activation="tanh"),
            keras.layers.Dense(2048, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    mode = tfsync.DiLoCo(inner_steps=PERIOD, fragments=2, overlap_steps=1, quantize="int8")
    sync = tfsync.keras.SyncCallback(mode=mode, wait_timeout_s=60)
    model.fit(xl, yl, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[sync])
    exchange.paced_round = paced_round
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    return {
        "digest": hashlib.sha256(weights.tobytes()).hexdigest(),
        "finite": bool(np.isfinite(weights).all()),
        "counts": sync.counts,
        "pieces": max(pieces, default=0),
    }


write_result(out_dir, hvd.rank(), {**{case: train(case) for case in CASES}, "diloco-paced-int8": train_paced()})
