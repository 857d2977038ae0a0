"""PSP and backup workers: equivalence to BSP without stragglers; accounting, skipping
and identical replicas (weights and optimizer state) with one, and with slow pulls.

argv: out_dir part, part "equivalence" (2 workers) or "straggler" (3 workers,
the last one slow).
"""

import sys

import numpy as np
from common import OPTIMIZER_NAMES, build_regression_model, init, make_optimizer, regression_shard, write_result

hvd = init()

import tfsync  # noqa: E402
from tfsync.bench.baseline import use_horovod_allreduce  # noqa: E402

out_dir, part = sys.argv[1], sys.argv[2]
xl, yl = regression_shard(384)


OPTIMIZER_STATE = {}  # name -> the optimizer's variables (iterations and slots) after training


def train(mode, opt_name, frontend="callback", name=None, **engine_args):
    """Final weights and this worker's counts (and the epoch logs, callback only)."""
    if frontend == "strategy":
        strategy = tfsync.distribute.SyncStrategy(mode=mode, **engine_args)
        with strategy.scope():
            model = build_regression_model()
            model.compile(optimizer=make_optimizer(opt_name), loss="mse")
        model.fit(xl, yl, batch_size=8, epochs=2, shuffle=False, verbose=0)
        engine = strategy.engine
        strategy.finish()
        return model.get_weights(), dict(engine.counts), {}
    model = build_regression_model()
    model.compile(optimizer=make_optimizer(opt_name), loss="mse")
    if mode == "horovod":
        use_horovod_allreduce(model, hvd)
        model.fit(xl, yl, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model.get_weights(), {}, {}
    sync = tfsync.keras.SyncCallback(mode=mode, average_epoch_logs=False, **engine_args)
    history = model.fit(xl, yl, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[sync])
    logs = {k: v for k, v in history.history.items() if k.startswith("tfsync_")}
    if name is not None:
        OPTIMIZER_STATE[name] = [np.asarray(v.numpy(), np.float64) for v in model.optimizer.variables]
    return model.get_weights(), dict(sync.engine.counts), logs


def flat(weights):
    return np.concatenate([w.ravel() for w in weights])


result = {}
if part == "equivalence":
    size = hvd.size()
    for opt_name in OPTIMIZER_NAMES:
        ref, _, _ = train("horovod", opt_name)
        start = build_regression_model().get_weights()
        row = {"moved": float(np.max(np.abs(flat(ref) - flat(start))))}
        for name, mode, frontend in (
            ("psp", tfsync.PSP(min_contributions=size), "callback"),
            ("backup", tfsync.BackupWorkers(backups=0), "callback"),
            ("psp_strategy", tfsync.PSP(min_contributions=size), "strategy"),
            # every block applied on its own, with the optimizer's step count set to its round's
            ("psp_pull", tfsync.PSP(min_contributions=size, pull_fraction=0.5), "callback"),
        ):
            w, counts, _ = train(mode, opt_name, frontend)
            row[name] = float(np.max(np.abs(flat(ref) - flat(w))))
            row[name + "_counts"] = counts
        result[opt_name] = row
else:
    slow = hvd.size() - 1
    stragglers = tfsync.Stragglers(base_s=0.01, slow_ranks={slow: 0.05})
    # slow pulls too: a block of a round reaches a worker 0.15 s late now and then
    pulls = tfsync.Stragglers(base_s=0.01, slow_ranks={slow: 0.05}, pull_prob=0.05, pull_s=0.15, seed=2)
    for name, mode, frontend, delays in (
        ("psp", tfsync.PSP(), "callback", stragglers),
        ("backup", tfsync.BackupWorkers(backups=1), "callback", stragglers),
        ("backup_strategy", tfsync.BackupWorkers(backups=1), "strategy", stragglers),
        ("bsp", "bsp", "callback", stragglers),
        ("ssp", tfsync.SSP(staleness=1), "callback", stragglers),
        ("psp_pull", tfsync.PSP(pull_fraction=0.5), "callback", pulls),
    ):
        trace_dir = f"{out_dir}/trace_{name}"
        w, counts, logs = train(mode, "adam", frontend, name=name, stragglers=delays, trace_dir=trace_dir)
        every = hvd.allgather_object(flat(w).tolist(), name=f"test.weights.{name}")
        result[name] = {
            "counts": counts,
            "logs": logs,
            "replicas_max_diff": float(max(np.max(np.abs(np.array(e) - np.array(every[0]))) for e in every)),
        }
        if name in OPTIMIZER_STATE:  # Adam's step count and moments, compared across replicas
            state = hvd.allgather_object([v.ravel().tolist() for v in OPTIMIZER_STATE[name]], name=f"test.opt.{name}")
            result[name]["optimizer_max_diff"] = float(
                max(np.max(np.abs(np.array(a) - np.array(b))) for e in state for a, b in zip(e, state[0]))
            )
            result[name]["iterations"] = float(OPTIMIZER_STATE[name][0].ravel()[0])
write_result(out_dir, hvd.rank(), result)
