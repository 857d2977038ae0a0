"""One benchmark worker (run under horovodrun by ``tfsync.bench.training``).

An MLP on synthetic data, in three sizes (``MODELS``).  With the small one
per-step CPU work is kept well below the simulated device time, so the sleeps
(which free the CPU) set the pace, as a GPU would, even with four workers on
two cores; the medium and large ones measure what synchronizing millions of
parameters costs.
"""

import argparse
import resource
import time

import keras
import numpy as np

from tfsync.engine.components.supersteps import Supersteps
from tfsync.launch import add_mode_arguments

# name -> (input width, hidden widths, batch size); 10 classes
MODELS = {
    "small": (32, (64, 64), 32),  # 7.0k parameters
    # the step-overhead study's sizes (docs/results/step-overhead): 256 -> w -> w -> 10, batch 16
    "21k": (256, (64, 64), 16),  # 21k
    "1.3m": (256, (1024, 1024), 16),  # 1.3M
    "medium": (256, (2048, 2048), 16),  # 4.7M
    "large": (256, (4096, 4096), 16),  # 17.9M
}


def build_model(name):
    width, hidden, _ = MODELS[name]
    layers = [keras.Input((width,))] + [keras.layers.Dense(h, activation="relu") for h in hidden]
    return keras.Sequential(layers + [keras.layers.Dense(10)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    add_mode_arguments(p, baselines=("local", "horovod"))
    p.add_argument("--stragglers", default="none")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--trace-dir", default=None, help="write the engine's trace here (tfsync modes)")
    args = p.parse_args()
    width, _, batch_size = MODELS[args.model]

    import horovod.tensorflow as hvd

    hvd.init()
    import tfsync
    from tfsync.bench.baseline import SleepEachStep, broadcast_model, ring_bytes, use_horovod_allreduce
    from tfsync.launch import mode_from_args, print_result

    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(rank)
    total = args.steps + args.warmup_steps
    x = np.random.default_rng(rank).normal(size=(total * batch_size, width)).astype("float32")
    y = np.random.default_rng(rank + 100).integers(0, 10, size=len(x))
    model = build_model(args.model)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    stragglers = tfsync.Stragglers.parse(args.stragglers)
    clock = Clock(args.warmup_steps)
    sync = None
    if args.mode in ("local", "horovod"):
        if args.mode == "local" and args.compression:
            p.error("--mode local exchanges nothing: leave --compression out")
        broadcast_model(model, hvd)
        if args.mode == "horovod":
            use_horovod_allreduce(model, hvd, compression=args.compression)
        callbacks = [SleepEachStep(stragglers.for_rank(rank)), clock]
    else:
        sync = tfsync.keras.SyncCallback(
            mode=mode_from_args(args), stragglers=stragglers, average_epoch_logs=False, trace_dir=args.trace_dir
        )
        callbacks = [sync, clock]
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    wall = hvd.allgather_object(clock.elapsed_s())
    # each rank's process CPU (user + system, every thread) per timed step, in ms
    cpu_ms = hvd.allgather_object(clock.elapsed_cpu_s() / args.steps * 1e3)
    peak_rss_mb = hvd.allgather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    wait = waits = barriers = None
    counts = {"produced": total * size, "applied": total * size, "compensated": 0, "dropped": 0, "skipped": 0}
    # bytes on the wire per training step, one worker's (the ring model: tfsync.engine.wire.counting)
    per_step = ring_bytes(model, size, args.compression) if args.mode == "horovod" else None
    if args.mode == "local":
        per_step = dict.fromkeys(ring_bytes(model, size), 0.0)
    if sync is not None:
        sent = hvd.allgather_object(dict(sync.engine.bytes))
        per_step = {k: float(np.mean([b[k] for b in sent])) / total for k in sent[0]}
        totals = sync.engine.totals
        wait = hvd.allgather_object(totals["wait_s"] / (totals["wait_s"] + totals["compute_s"]))
        every = hvd.allgather_object(dict(sync.engine.counts))
        counts = {k: sum(c[k] for c in every) for k in counts}
        # the mean wait per step and, for ElasticBSP, per barrier (and the barrier decisions'
        # time against a computed iteration's)
        # (per training step: under Local SGD and DiLoCo the engine's steps are the outer steps)
        waits = hvd.allgather_object(totals["wait_s"] / total)
        computed = max(totals["steps"] - totals["skipped"], 1)
        supersteps = sync.engine.find(Supersteps)
        b = supersteps.barriers if supersteps is not None else {"count": 0}
        barriers = hvd.allgather_object({**b, "iteration_s": totals["compute_s"] / computed} if b["count"] else None)
    samples_per_s = size * args.steps * batch_size / max(wall)
    if rank == 0:
        # samples whose gradients reached the model: the applied share of every worker's
        # contributions, each produced or skipped (one per step; Local SGD's and DiLoCo's cover H steps)
        applied_share = (counts["applied"] + counts["compensated"]) / max(counts["produced"] + counts["skipped"], 1)
        print_result(
            {
                "samples_per_s": samples_per_s,
                "effective_samples_per_s": samples_per_s * applied_share,
                **counts,
                "wall_s": max(wall),
                "ms_per_step": max(wall) / args.steps * 1e3,
                "cpu_ms_per_step": cpu_ms,
                "peak_rss_mb": max(peak_rss_mb),
                "window_unix_s": [clock.start_unix, clock.end_unix],  # rank 0's timed steps
                "num_params": model.count_params(),
                "compression": args.compression,
                **{f"{k}_per_step": v for k, v in per_step.items()},
                "wait_fraction": float(np.mean(wait)) if wait is not None else None,
                "mean_wait_per_step_s": float(np.mean(waits)) if waits is not None else None,
                **barrier_summary(barriers),
            }
        )


def barrier_summary(barriers):
    """ElasticBSP's barriers over the workers: mean wait per barrier, and the decisions' mean
    time as a fraction of a computed iteration's."""
    barriers = [b for b in barriers or () if b]
    if not barriers:
        return {}
    count = barriers[0]["count"]
    decision_s = float(np.mean([b["decision_s"] / b["count"] for b in barriers]))
    return {
        "barriers": count,
        "mean_wait_per_barrier_s": float(np.mean([b["wait_s"] / b["count"] for b in barriers])),
        "mean_decision_s": decision_s,
        "decision_per_iteration": decision_s / float(np.mean([b["iteration_s"] for b in barriers])),
    }


class Clock(keras.callbacks.Callback):
    """Wall time from the end of the warm-up steps to the end of training."""

    def __init__(self, warmup_steps):
        super().__init__()
        self.warmup_steps = warmup_steps

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.warmup_steps:
            self.start = time.perf_counter()
            self.start_cpu = time.process_time()
            self.start_unix = time.time()  # (the bench's link sampler keeps the time of day)

    def on_train_end(self, logs=None):
        self.end = time.perf_counter()
        self.end_cpu = time.process_time()
        self.end_unix = time.time()

    def elapsed_s(self):
        return self.end - self.start

    def elapsed_cpu_s(self):
        """The process's CPU time (every thread's: TensorFlow's, Horovod's, tfsync's) over the timed steps."""
        return self.end_cpu - self.start_cpu


if __name__ == "__main__":
    main()
