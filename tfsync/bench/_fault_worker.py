"""The digits example as a user runs it, with what a fault harness reads: ``python -m tfsync.bench faults``.

``python _fault_worker.py OUT_DIR --frontend callback|strategy [--elastic] [--epochs E]
[--raise-rank R --raise-step S] [mode flags]`` under ``horovodrun``: the digits MLP of
``keras_examples/digits.py`` (its data, its model, its shard per worker; with ``--elastic``
under ``tfsync.elastic`` as that example's ``--elastic`` runs it: one ``fit``, re-entered after
every reset on the new membership's shard; ``--frontend strategy``: under
``tfsync.distribute.SyncStrategy`` as ``keras_examples/digits_strategy.py`` runs it), each step's
device time simulated by ``TFSYNC_STRAGGLERS``.  ``--raise-rank R --raise-step S``: the worker of
rank ``R`` raises :class:`tfsync.faults.InjectedFault` in the step that begins at optimizer
iteration ``S`` (:class:`tfsync.faults.Injector`, recorded once under ``OUT_DIR/ledger``).

What it writes for the harness (every file under ``OUT_DIR``, one writer each):

* ``mark_rank<R>.json`` after its first step (``R``: its rank at launch): its pid, host, rank,
  when: which process to kill or stop, and on which host each rank runs;
* ``step_rank<R>``: the optimizer's iteration after each step (rewritten: the harness polls it
  to inject a fault at a drawn step);
* ``events_<pid>.jsonl``: each error ``fit`` raised on this process (``t``, its type, its text,
  the ranks it names, ``ranks`` as the error carries them, the hosts of the membership it was
  raised in), and, once it finished, its ``result`` (the final test accuracy, whether every
  replica holds the same weights, the job's size, the resets).
"""

import argparse
import json
import os
import socket
import sys
import time

from tfsync.launch import REPO_ROOT, add_mode_arguments, check_mode_args, integer, mode_from_args

sys.path.insert(0, os.path.join(REPO_ROOT, "keras_examples"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--frontend", choices=("callback", "strategy"), default="callback")
    p.add_argument("--elastic", action="store_true")
    p.add_argument("--epochs", type=integer(1), default=10)
    p.add_argument("--batch-size", type=integer(1), default=16)
    p.add_argument("--raise-rank", type=int, default=None)
    p.add_argument("--raise-step", type=integer(0), default=None)
    p.add_argument("--seed", type=integer(0), default=0)
    add_mode_arguments(p)
    args = p.parse_args(argv)
    check_mode_args(p, args)
    return args


class Events:
    """This process's ``events_<pid>.jsonl`` (appended, flushed per record)."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, f"events_{os.getpid()}.jsonl")

    def write(self, record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def main(argv=None):
    args = parse_args(argv)
    from digits import build_model, init_horovod, load_data  # the example's own pieces

    hvd = init_horovod()
    import keras
    import numpy as np

    import tfsync

    first_rank, events = hvd.rank(), Events(args.out_dir)

    class Progress(keras.callbacks.Callback):
        """``mark_rank<R>.json`` after the first step, ``step_rank<R>`` after every step."""

        marked = False

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            path = os.path.join(args.out_dir, f"step_rank{first_rank}")
            with open(path + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(path + ".tmp", path)
            if not Progress.marked:
                Progress.marked = True
                mark = {"pid": os.getpid(), "host": socket.gethostname(), "rank": first_rank, "t": time.time()}
                path = os.path.join(args.out_dir, f"mark_rank{first_rank}.json")
                with open(path + ".tmp", "w") as f:
                    json.dump(mark, f)
                os.replace(path + ".tmp", path)

    keras.utils.set_random_seed(args.seed)
    mode = mode_from_args(args)
    callbacks = [Progress()]
    if args.raise_rank is not None:
        schedule = tfsync.faults.Schedule([tfsync.faults.Fault("raise", rank=args.raise_rank, step=args.raise_step)])
        callbacks.append(tfsync.faults.Injector(schedule, ledger_dir=os.path.join(args.out_dir, "ledger")))
    state = strategy = None
    if args.frontend == "strategy":
        strategy = tfsync.distribute.SyncStrategy(mode=mode)
        with strategy.scope():
            model = build_model(0.2, 0.0)
        synchronizer = strategy
    else:
        model = build_model(0.2, 0.0)
        if args.elastic:
            import tfsync.elastic

            state = tfsync.elastic.KerasState(model, epoch=0)
        synchronizer = tfsync.keras.SyncCallback(mode=mode, elastic=state)
        callbacks.insert(0, synchronizer)

    def train(state=None):
        x_local, y_local, _, _ = load_data(args.batch_size)  # (this membership's shard)
        try:
            model.fit(
                x_local,
                y_local,
                batch_size=args.batch_size,
                epochs=args.epochs,
                initial_epoch=0 if state is None else state.epoch,
                shuffle=True,
                verbose=0,
                callbacks=callbacks,
            )
            if strategy is not None:
                strategy.finish()
        except Exception as exc:
            engine = synchronizer.engine
            events.write(
                {
                    "kind": "error",
                    "t": time.time(),
                    "pid": os.getpid(),
                    "type": type(exc).__name__,
                    "text": str(exc),
                    "ranks": getattr(exc, "ranks", None),
                    "hosts": getattr(engine, "hosts", None),  # (the membership it was raised in)
                    "rank": getattr(engine, "rank", None),
                    "resets": getattr(state, "resets", 0),
                }
            )
            raise

    if args.elastic:
        tfsync.elastic.run(train)(state)
    else:
        train()
    _, _, x_test, y_test = load_data(args.batch_size)
    accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
    identical = len(set(hvd.allgather_object(checksum, name="tfsync.bench.faults.checksum"))) == 1
    events.write(
        {
            "kind": "result",
            "t": time.time(),
            "pid": os.getpid(),
            "rank": hvd.rank(),
            "size": hvd.size(),
            "accuracy": accuracy,
            "replicas_identical": identical,
            "resets": getattr(state, "resets", 0),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
