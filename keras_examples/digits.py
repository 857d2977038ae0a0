"""Digits classifier (scikit-learn's offline ``load_digits``) trained with tfsync.

One process per worker, as Horovod's examples do::

    horovodrun -np 4 -H localhost:4 --gloo python keras_examples/digits.py --mode ssp --staleness 3 \
        --stragglers "base=0.02,slow=3:0.04"

``--mode`` takes every registered mode with its own flags (``--help`` lists them, as
:func:`tfsync.launch.add_mode_arguments` takes them from :mod:`tfsync.policies.registry`),
``auto`` included (picked from the measured iteration times, first after 16 steps, then at
epoch ends: ``tfsync.Auto``).

Each worker pins one GPU by local rank when GPUs are present, trains on its
equal shard of the training set and, on rank 0, prints a JSON summary line
(``TFSYNC_RESULT {...}``) with samples/s, wait fraction, time to the target
test accuracy, the test accuracy after every epoch (``curve``: elapsed s,
samples, accuracy) and the final test accuracy.  ``--plain-horovod`` trains
the same job with plain Horovod instead, the anchor of ``python -m tfsync.bench
convergence``.  ``--elastic`` trains under ``tfsync.elastic`` (launch it with
horovodrun's elastic options: ``horovodrun_scripts/elastic.sh``): when a worker
dies or the discovery script changes the hosts, the others go on from the
last epoch end, each on its shard of the new membership.
"""

import argparse
import sys
import time

import keras  # importing TensorFlow does not touch the GPUs: pinning below still works
import numpy as np

from tfsync.launch import add_mode_arguments, check_mode_args, integer, number, stragglers_spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_arguments(p)
    p.add_argument("--epochs", type=integer(1), default=12)
    p.add_argument("--batch-size", type=integer(1), default=16, help="per worker")
    p.add_argument(
        "--hidden",
        type=integer(1),
        nargs="+",
        default=[64],
        help="the hidden layers' widths (default: one of 64); wider layers make the gradients, and so each "
        "exchange, larger (e.g. --hidden 4096 4096: 17M parameters, for training across a slow link)",
    )
    # plain SGD: momentum compounds with staleness (asynchrony acts as extra
    # momentum), and 0.9 makes SSP's accuracy swing from run to run
    p.add_argument("--lr", type=number(above=0), default=0.2)
    p.add_argument("--momentum", type=number(0, below=1), default=0.0)
    p.add_argument(
        "--target-accuracy",
        type=number(above=0, maximum=1),
        nargs="+",
        default=[0.9, 0.95],
        help="record the wall time at which the test accuracy first reaches each",
    )
    p.add_argument(
        "--stragglers",
        type=stragglers_spec,
        default=None,
        help="straggler spec, e.g. 'base=0.02,slow=3:0.04' (default: $TFSYNC_STRAGGLERS)",
    )
    p.add_argument("--trace-dir", default=None, help="write a JSON-lines trace per worker here")
    p.add_argument(
        "--plain-horovod",
        action="store_true",
        help="train with plain Horovod BSP (in-graph hvd.grouped_allreduce) instead of tfsync: the "
        "anchor tfsync's modes are compared with (--mode is then ignored; --stragglers still applies)",
    )
    p.add_argument(
        "--elastic",
        action="store_true",
        help="elastic training (tfsync.elastic): the job goes on from the last epoch end when a worker dies or "
        "the hosts change; launch with horovodrun --min-np/--max-np/--host-discovery-script "
        "(horovodrun_scripts/elastic.sh)",
    )
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--verbose", type=int, default=0, choices=(0, 1, 2), help="Keras' fit verbosity (rank 0)")
    args = p.parse_args(argv)
    check_mode_args(p, args)  # a bad mode setting stops here, before any worker starts
    if args.elastic and args.plain_horovod:
        p.error("--elastic trains with tfsync's SyncCallback; leave out --plain-horovod (or --elastic)")
    return args


def load_data(batch_size):
    """This rank's equal shard of digits' training split, and the whole test split (offline)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import tfsync

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_local, y_local = tfsync.shard(x_train, y_train, batch_size=batch_size)
    return x_local, y_local, x_test, y_test


def build_model(lr, momentum, hidden=(64,)):
    """A compiled MLP, 64 inputs, ReLU layers of the ``hidden`` widths, 10 classes (build it inside
    ``strategy.scope()`` for SyncStrategy)."""
    model = keras.Sequential(
        [
            keras.Input((64,)),
            *(keras.layers.Dense(width, activation="relu") for width in hidden),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(lr, momentum=momentum),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def init_horovod():
    """``hvd.init()``, and one GPU per process (its local rank's) when there are GPUs, as in
    Horovod's examples; returns ``horovod.tensorflow``."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
        tf.config.experimental.set_memory_growth(gpus[hvd.local_rank()], True)
    return hvd


def main(argv=None):
    args = parse_args(argv)
    hvd = init_horovod()
    import tfsync
    from tfsync.launch import contribution_totals, describe_mode, mode_from_args, print_result

    keras.utils.set_random_seed(args.seed)
    x_local, y_local, x_test, y_test = load_data(args.batch_size)
    model = build_model(args.lr, args.momentum, args.hidden)

    stragglers = tfsync.Stragglers.parse(args.stragglers) if args.stragglers is not None else None
    samples_per_epoch = len(x_local) * hvd.size()
    progress = TargetAccuracy(x_test, y_test, args.target_accuracy, samples_per_epoch)
    if args.plain_horovod:
        from tfsync.bench.baseline import SleepEachStep, broadcast_model, use_horovod_allreduce

        broadcast_model(model, hvd)
        use_horovod_allreduce(model, hvd)
        delays = (stragglers or tfsync.Stragglers.from_env()).for_rank(hvd.rank())
        callbacks, label = [SleepEachStep(delays), progress], "horovod"
    else:
        mode = mode_from_args(args)
        state = None
        if args.elastic:
            import tfsync.elastic

            # the model, its optimizer, the epoch and the job's counts, committed at every epoch end
            state = tfsync.elastic.KerasState(model, epoch=0)
        sync = tfsync.keras.SyncCallback(mode=mode, stragglers=stragglers, trace_dir=args.trace_dir, elastic=state)
        callbacks, label = [sync, progress], describe_mode(mode)

    def train(state=None):
        nonlocal x_local, y_local, samples_per_epoch
        if state is not None:  # (re-entered after every reset: this membership's shard, from the commit)
            x_local, y_local, _, _ = load_data(args.batch_size)
            samples_per_epoch = progress.samples_per_epoch = len(x_local) * hvd.size()
        return model.fit(
            x_local,
            y_local,
            batch_size=args.batch_size,
            epochs=args.epochs,
            initial_epoch=0 if state is None else state.epoch,
            shuffle=True,
            verbose=args.verbose if hvd.rank() == 0 else 0,
            callbacks=callbacks,
        )

    start = time.time()
    history = tfsync.elastic.run(train)(state) if args.elastic else train()
    wall_s = time.time() - start
    final_acc = float(model.evaluate(x_test, y_test, verbose=0)[1])
    samples = samples_per_epoch * args.epochs
    if args.plain_horovod:
        steps = samples // args.batch_size  # the shards hold whole batches
        totals = dict.fromkeys(("compensated", "dropped", "skipped"), 0)
        totals.update(produced=steps, applied=steps, effective_samples_per_s=samples / wall_s)
        wait = None
    else:
        totals = contribution_totals(hvd, sync.counts, args.batch_size, wall_s, samples=samples)
        wait = float(np.mean(history.history["tfsync_wait_fraction"]))
    result = {
        "mode": label,
        "workers": hvd.size(),
        "samples_per_s": samples / wall_s,
        "wall_s": wall_s,
        **totals,
        "wait_fraction": wait,
        "time_to_accuracy_s": {str(t): progress.reached_s[t] for t in args.target_accuracy},
        "curve": progress.curve,
        "final_accuracy": final_acc,
        "parameters": model.count_params(),
    }
    if args.elastic:  # the resets, and the job's contributions as committed at the last epoch end
        result.update(resets=state.resets, job_counts=state.counts)
    if not args.plain_horovod and sync.auto is not None:  # which mode auto ran when, and why
        result["auto_decisions"] = sync.auto_decisions
        result["auto_deferred"] = sync.auto_deferred
        # the epoch logs' counts (worker means), summed over the epochs: they must add up to the
        # totals across every switch, mid-epoch ones included
        logged = {k: sum(history.history[f"tfsync_{k}"]) * hvd.size() for k in tfsync.engine.COUNTS}
        result["counts_from_epoch_logs"] = {k: round(v) for k, v in logged.items()}
    # every replica must hold the same weights: compare a checksum across ranks
    checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
    checksums = hvd.allgather_object(checksum)
    result["replicas_identical"] = len(set(checksums)) == 1
    if hvd.rank() == 0:
        print_result(result)
    return 0


class TargetAccuracy(keras.callbacks.Callback):
    """The test accuracy after every epoch (``curve``: ``[elapsed_s, samples, accuracy]``, samples
    over all workers), and the wall time at which it first reaches each target."""

    def __init__(self, x_test, y_test, targets, samples_per_epoch):
        super().__init__()
        self.x_test, self.y_test, self.targets = x_test, y_test, targets
        self.samples_per_epoch = samples_per_epoch

    def on_train_begin(self, logs=None):
        if getattr(self, "start", None) is not None:  # an elastic job's fit after a reset: one curve
            return
        self.start = time.time()
        self.reached_s = {t: None for t in self.targets}
        self.curve = []
        self.evaluating_s = 0.0  # rank 0's evaluations are not training time

    def on_epoch_end(self, epoch, logs=None):
        now = time.time()
        elapsed_s = now - self.start - self.evaluating_s
        pred = np.argmax(self.model.predict_on_batch(self.x_test), axis=1)
        accuracy = float(np.mean(pred == self.y_test))
        self.evaluating_s += time.time() - now
        self.curve.append([elapsed_s, (epoch + 1) * self.samples_per_epoch, accuracy])
        for t in self.targets:
            if self.reached_s[t] is None and accuracy >= t:
                self.reached_s[t] = elapsed_s


if __name__ == "__main__":
    sys.exit(main())
