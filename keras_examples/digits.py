"""Digits classifier (scikit-learn's offline ``load_digits``) trained with tfsync.

One process per worker, as Horovod's examples do::

    horovodrun -np 4 -H localhost:4 --gloo python keras_examples/digits.py --mode ssp --staleness 3 \
        --stragglers "base=0.02,slow=3:0.04"

``--mode`` is ``bsp``, ``ssp`` (``--staleness``), ``dssp`` (``--low``, ``--high``),
``elasticbsp`` (``--lookahead``, ``--zipline``), ``psp`` (``--min-contributions``,
``--push-timeout-s``), ``backup`` (``--backups``) or ``dcs3gd`` (``--dc-lambda``,
``--dc-adaptive``).

Each worker pins one GPU by local rank when GPUs are present, trains on its
equal shard of the training set and, on rank 0, prints a JSON summary line
(``TFSYNC_RESULT {...}``) with samples/s, wait fraction, time to the target
test accuracy and the final test accuracy.
"""

import argparse
import sys
import time

import keras  # importing TensorFlow does not touch the GPUs: pinning below still works
import numpy as np

from tfsync.launch import add_mode_arguments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_arguments(p)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    # plain SGD: momentum compounds with staleness (asynchrony acts as extra
    # momentum), and 0.9 makes SSP's accuracy swing from run to run
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument(
        "--target-accuracy",
        type=float,
        nargs="+",
        default=[0.9, 0.95],
        help="record the wall time at which the test accuracy first reaches each",
    )
    p.add_argument(
        "--stragglers", default=None, help="straggler spec, e.g. 'base=0.02,slow=3:0.04' (default: $TFSYNC_STRAGGLERS)"
    )
    p.add_argument("--trace-dir", default=None, help="write a JSON-lines trace per worker here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", type=int, default=0)
    return p.parse_args(argv)


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


def build_model(lr, momentum):
    """A compiled 64-64-10 MLP (build it inside ``strategy.scope()`` for SyncStrategy)."""
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(lr, momentum=momentum),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def main(argv=None):
    args = parse_args(argv)
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:  # one GPU per process, as in Horovod's examples
        tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
        tf.config.experimental.set_memory_growth(gpus[hvd.local_rank()], True)
    import tfsync
    from tfsync.launch import contribution_totals, describe_mode, mode_from_args, print_result

    keras.utils.set_random_seed(args.seed)
    x_local, y_local, x_test, y_test = load_data(args.batch_size)
    model = build_model(args.lr, args.momentum)

    mode = mode_from_args(args)
    stragglers = tfsync.Stragglers.parse(args.stragglers) if args.stragglers is not None else None
    sync = tfsync.keras.SyncCallback(mode=mode, stragglers=stragglers, trace_dir=args.trace_dir)
    progress = TargetAccuracy(x_test, y_test, args.target_accuracy)
    start = time.time()
    history = model.fit(
        x_local,
        y_local,
        batch_size=args.batch_size,
        epochs=args.epochs,
        shuffle=True,
        verbose=args.verbose if hvd.rank() == 0 else 0,
        callbacks=[sync, progress],
    )
    wall_s = time.time() - start
    final_acc = float(model.evaluate(x_test, y_test, verbose=0)[1])
    samples = len(x_local) * args.epochs * hvd.size()
    wait = float(np.mean(history.history["tfsync_wait_fraction"]))
    result = {
        "mode": describe_mode(mode),
        "workers": hvd.size(),
        "samples_per_s": samples / wall_s,
        "wall_s": wall_s,
        **contribution_totals(hvd, sync.engine.counts, args.batch_size, wall_s),
        "wait_fraction": wait,
        "time_to_accuracy_s": {str(t): progress.reached_s[t] for t in args.target_accuracy},
        "final_accuracy": final_acc,
    }
    # every replica must hold the same weights: compare a checksum across ranks
    checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
    checksums = hvd.allgather_object(checksum)
    result["replicas_identical"] = len(set(checksums)) == 1
    if hvd.rank() == 0:
        print_result(result)
    return 0


class TargetAccuracy(keras.callbacks.Callback):
    """Records the wall time at which the test accuracy first reaches each target."""

    def __init__(self, x_test, y_test, targets):
        super().__init__()
        self.x_test, self.y_test, self.targets = x_test, y_test, targets

    def on_train_begin(self, logs=None):
        self.start = time.time()
        self.reached_s = {t: None for t in self.targets}

    def on_epoch_end(self, epoch, logs=None):
        if None in self.reached_s.values():
            pred = np.argmax(self.model.predict_on_batch(self.x_test), axis=1)
            accuracy = np.mean(pred == self.y_test)
            for t in self.targets:
                if self.reached_s[t] is None and accuracy >= t:
                    self.reached_s[t] = time.time() - self.start


if __name__ == "__main__":
    sys.exit(main())
