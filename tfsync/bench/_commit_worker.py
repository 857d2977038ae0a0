"""What an elastic commit within an epoch costs (run under horovodrun by ``python -m tfsync.bench
elastic --commit-cost``).

The training bench's MLP (:data:`tfsync.bench._training_worker.MODELS`: ``large`` is 17.9M
parameters) under BSP with ``SyncCallback(elastic=KerasState(model, commit_every_steps=N))``,
one ``fit`` of one epoch on ``tfsync.shard(..., resume=state)`` (so commits within the epoch
run), no ``tfsync.elastic.run`` needed: the commits are the callback's.  Timed on every worker,
with ``time.perf_counter``:

* ``commit_s``: each commit as a whole, as the training thread sees it: the callback's batch
  end that made it (the allreduce of the at-rest flags and counts, behind the rounds; the
  host-memory copy, ``state.save()``) plus the next batch begin's check of the launcher's
  notices (one broadcast);
* ``save_s``: ``state.save()`` alone (the copy of every model and optimizer variable);
* ``step_s``: the steps without a commit, from one batch end to the next.

Rank 0 prints the medians over the workers' records and ``overhead_fraction``, the median
commit over ``N`` median steps: the share of training time the commits take at that interval.
With ``TFSYNC_COMMIT_DIR`` set (``--commit-dir``) rank 0 also writes each commit there, on a
thread of its own: the steps above then include what that thread takes from them (the CPU,
the GIL), and the record says how many commits it wrote and their mean write time.
"""

import argparse
import statistics
import time

import keras
import numpy as np

from tfsync.bench._training_worker import MODELS, build_model


def _summary(values):
    values = sorted(values)
    if not values:
        return {"n": 0, "median": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "max": values[-1]}


def _timed(state, commits):
    """Time every commit (its save and the next step's check of the launcher's notices) and every
    step between commits, by wrapping the state's ``save`` and the commits' batch hooks (which
    the callback calls); the seconds go to the dict returned."""
    timed = {"commit_s": [], "save_s": [], "step_s": []}
    save = state.save

    def timed_save():
        t = time.perf_counter()
        save()
        timed["save_s"].append(time.perf_counter() - t)

    state.save = timed_save

    real_begin, real_end = commits.batch_begin, commits.batch_end
    clock = {"last_end": None, "pending": None}  # pending: the seconds of a commit's batch end

    def batch_begin():
        t = time.perf_counter()
        real_begin()
        if clock["pending"] is not None:  # the commit's check of the launcher's notices
            timed["commit_s"].append(clock["pending"] + time.perf_counter() - t)
            clock["pending"] = None

    def batch_end(batch):
        t = time.perf_counter()
        made = len(timed["save_s"])
        real_end(batch)
        now = time.perf_counter()
        if len(timed["save_s"]) > made:
            clock["pending"], clock["last_end"] = now - t, None  # (the next step holds the check)
            return
        if clock["last_end"] is not None:
            timed["step_s"].append(t - clock["last_end"])
        clock["last_end"] = now

    commits.batch_begin, commits.batch_end = batch_begin, batch_end  # (the callback calls these)
    return timed


def _storage(state, rank):
    """Rank 0's writes to ``TFSYNC_COMMIT_DIR`` (a thread of its own) and their mean seconds, after
    the last is flushed; zeros elsewhere or without one."""
    store = state._store
    if store is not None and rank == 0:
        state.flush_storage()
        storage = {"storage_writes": store.written, "storage_failed": store.failed}
        storage["storage_write_s"] = store.write_s / store.written if store.written else None
    else:
        storage = {"storage_writes": 0, "storage_write_s": None, "storage_failed": 0}
    return storage


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="large", choices=sorted(MODELS))
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"))
    p.add_argument("--commit-every", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    args = p.parse_args(argv)

    import horovod.tensorflow as hvd

    hvd.init()
    import tfsync
    import tfsync.elastic
    from tfsync.launch import print_result

    width, _, batch_size = MODELS[args.model]
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(0)
    model = build_model(args.model)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9) if args.optimizer == "sgd" else keras.optimizers.Adam(1e-4)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    samples = args.steps * batch_size * size
    x = np.random.default_rng(0).normal(size=(samples, width)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, size=samples)

    state = tfsync.elastic.KerasState(model, epoch=0, commit_every_steps=args.commit_every)
    sync = tfsync.keras.SyncCallback("bsp", elastic=state, average_epoch_logs=False)
    timed = _timed(state, sync.elastic)
    x_local, y_local = tfsync.shard(x, y, batch_size=batch_size, resume=state)
    model.fit(
        x_local,
        y_local,
        batch_size=batch_size,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[sync],
    )
    storage = _storage(state, rank)
    every = hvd.allgather_object(timed)
    if rank == 0:
        merged = {k: [v for t in every for v in t[k]] for k in timed}
        summary = {k: _summary(v) for k, v in merged.items()}
        commit, step = summary["commit_s"]["median"], summary["step_s"]["median"]
        print_result(
            {
                "model": args.model,
                "num_params": model.count_params(),
                "optimizer": args.optimizer,
                "copied_values": int(sum(np.prod(v.shape) for v in state._variables())),
                "workers": size,
                "commit_every_steps": args.commit_every,
                "steps": args.steps,
                "commits": summary["commit_s"]["n"] // size,
                **summary,
                "overhead_fraction": commit / (args.commit_every * step) if commit and step else None,
                # with TFSYNC_COMMIT_DIR: rank 0's writes (a thread of its own) and their mean seconds
                "commit_dir": state.commit_dir,
                **storage,
            }
        )


if __name__ == "__main__":
    main()
