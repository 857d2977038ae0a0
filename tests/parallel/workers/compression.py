"""BSP with ``compression="fp16"`` and ``"bf16"`` (callback and strategy) against plain Horovod.

Same seeds, data and optimizer as the other equivalence workers; each rank writes
its final weights (the test compares the ranks), how far they are from plain
Horovod's float32 allreduce-average, its counts and its bytes on the wire.
"""

import sys

import numpy as np
from common import build_regression_model, init, make_optimizer, regression_shard, write_result

hvd = init()

import tfsync  # noqa: E402
from tfsync.bench.baseline import use_horovod_allreduce  # noqa: E402

out_dir = sys.argv[1]
xl, yl = regression_shard(256)
EPOCHS = 2


def train(variant):
    """``variant``: ``"horovod"``, or ``"<frontend>_<compression>"``; the weights and the engine."""
    if variant.startswith("strategy"):
        strategy = tfsync.distribute.SyncStrategy(mode=tfsync.BSP(compression=variant.split("_")[1]))
        with strategy.scope():
            model = build_regression_model()
            model.compile(optimizer=make_optimizer("momentum"), loss="mse")
        model.fit(xl, yl, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0)
        engine = strategy.engine  # (finish() stops it; its counts stay)
        strategy.finish()
        return model.get_weights(), engine, {}
    model = build_regression_model()
    model.compile(optimizer=make_optimizer("momentum"), loss="mse")
    callbacks, sync = [], None
    if variant == "horovod":
        use_horovod_allreduce(model, hvd)
    else:
        sync = tfsync.keras.SyncCallback(mode=tfsync.BSP(compression=variant.split("_")[1]))
        callbacks = [sync]
    history = model.fit(xl, yl, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return model.get_weights(), None if sync is None else sync.engine, history.history


reference, _, _ = train("horovod")
start = build_regression_model().get_weights()
result = {"moved": float(max(np.max(np.abs(a - b)) for a, b in zip(reference, start)))}
for variant in ("callback_fp16", "strategy_fp16", "callback_bf16"):
    weights, engine, logs = train(variant)
    result[variant] = {
        "weights": [w.ravel().tolist() for w in weights],
        "from_horovod": float(max(np.max(np.abs(a - b)) for a, b in zip(reference, weights))),
        "counts": dict(engine.counts),
        "bytes": dict(engine.bytes),
        "steps": int(engine.step),
        "logged_bytes_sent": logs.get("tfsync_bytes_sent"),
        "params": int(sum(w.size for w in weights)),
    }
write_result(out_dir, hvd.rank(), result)
