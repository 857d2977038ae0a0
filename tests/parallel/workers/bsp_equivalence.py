"""BSP (callback and strategy) and SSP(0) against plain Horovod allreduce-average.

Same seeds, data and optimizer; weights after the same steps must match.
"""

import sys

import numpy as np
from common import OPTIMIZER_NAMES, build_regression_model, init, make_optimizer, regression_shard, write_result

hvd = init()

import tfsync  # noqa: E402
from tfsync.bench.baseline import use_horovod_allreduce  # noqa: E402

out_dir = sys.argv[1]
xl, yl = regression_shard(256)


def train(variant, opt_name):
    if variant == "strategy":
        strategy = tfsync.distribute.SyncStrategy(mode="bsp")
        with strategy.scope():
            model = build_regression_model()
            model.compile(optimizer=make_optimizer(opt_name), loss="mse")
        model.fit(xl, yl, batch_size=8, epochs=2, shuffle=False, verbose=0)
        strategy.finish()
        return model.get_weights()
    model = build_regression_model()
    model.compile(optimizer=make_optimizer(opt_name), loss="mse")
    callbacks = []
    if variant == "horovod":
        use_horovod_allreduce(model, hvd)
    else:
        mode = {"bsp": "bsp", "ssp0": tfsync.SSP(staleness=0)}[variant]
        callbacks = [tfsync.keras.SyncCallback(mode=mode)]
    model.fit(xl, yl, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    if variant == "bsp":  # the callback's BSP round ran in the compiled step, every step counted there
        engine = callbacks[0].engine
        in_graph[opt_name] = engine.in_graph and engine.counts["applied"] == engine.counts["produced"] > 0
    return model.get_weights()


result, in_graph = {}, {}
for opt_name in OPTIMIZER_NAMES:
    ref = train("horovod", opt_name)
    start = build_regression_model().get_weights()
    result[opt_name] = {"moved": float(max(np.max(np.abs(a - b)) for a, b in zip(ref, start)))}
    for variant in ("bsp", "strategy", "ssp0"):
        w = train(variant, opt_name)
        result[opt_name][variant] = float(max(np.max(np.abs(a - b)) for a, b in zip(ref, w)))
    result[opt_name]["in_graph"] = in_graph[opt_name]
write_result(out_dir, hvd.rank(), result)
