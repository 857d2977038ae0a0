"""A worker dies, hangs, or is configured differently: the others must stop with
an error naming it, in bounded time (results written per rank), also under BSP,
whose rounds run on the training thread.  Under PSP a
worker that dies stops the job too, and one that is merely slow (3 s, below
the 5 s wait bound) stops nobody: the others go on without it."""

import os
import sys
import time

import numpy as np
from common import init, write_result

hvd = init()
import keras  # noqa: E402

import tfsync  # noqa: E402

out_dir, scenario = sys.argv[1], sys.argv[2]
rank = hvd.rank()
VICTIM, AT_STEP = 2, 8
x = np.random.default_rng(rank).normal(size=(400, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
staleness = 3 if (scenario == "mismatch" and rank == 1) else 2
if scenario.endswith("_psp"):
    mode = tfsync.PSP()
elif "_bsp" in scenario:  # BSP runs its rounds in-graph, or on the training thread (inline) with stragglers
    mode = tfsync.BSP()
else:
    mode = tfsync.SSP(staleness=staleness)
IN_GRAPH = scenario in ("hang_bsp", "die_bsp")  # (no simulated stragglers: BSP's round in the compiled step)
stragglers = None if IN_GRAPH else tfsync.Stragglers(base_s=0.01)
sync = tfsync.keras.SyncCallback(mode=mode, wait_timeout_s=5, stragglers=stragglers)


class Fault(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if rank == VICTIM and batch == AT_STEP:
            write_result(out_dir, rank, {"fault_at": time.time()})
            if scenario.startswith("die"):
                os._exit(0)  # gone without a word (exit 0, so horovodrun does not kill the rest)
            if scenario == "slow_psp":
                time.sleep(3)  # slow, not hung: within wait_timeout_s
                return
            time.sleep(12)  # hung past wait_timeout_s
            os._exit(0)


started = time.time()
try:
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[sync, Fault()])
    outcome = {"error": None, "counts": dict(sync.engine.counts)}
except Exception as exc:  # the behaviour under test
    outcome = {"error": f"{type(exc).__name__}: {exc}", "error_at": time.time()}
outcome["elapsed_s"] = time.time() - started
outcome["in_graph"] = bool(sync.engine is not None and sync.engine.in_graph)
lost = scenario not in ("mismatch", "slow_psp") and rank == VICTIM
write_result(out_dir, 99 if lost else rank, outcome)
os._exit(0)  # skip Horovod's shutdown handshake with a peer that is gone
