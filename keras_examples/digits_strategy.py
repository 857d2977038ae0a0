"""The digits example with the tf.distribute route: ``tfsync.distribute.SyncStrategy``.

    horovodrun -np 4 -H localhost:4 --gloo python keras_examples/digits_strategy.py --mode ssp

Build and compile the model inside ``strategy.scope()`` (variables then start
from rank 0's values on every worker); ``fit`` needs no tfsync callback.
Call ``strategy.finish()`` after ``fit`` so every replica holds the same final
weights before saving.
"""

import argparse
import sys
import time

import numpy as np

from tfsync.launch import add_mode_arguments, check_mode_args, integer, number, stragglers_spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_arguments(p)
    p.add_argument("--epochs", type=integer(1), default=12)
    p.add_argument("--batch-size", type=integer(1), default=16)
    p.add_argument("--stragglers", type=stragglers_spec, default=None, help="e.g. 'base=0.02,slow=3:0.04'")
    # plain SGD: momentum compounds with staleness (asynchrony acts as extra momentum)
    p.add_argument("--lr", type=number(above=0), default=0.2)
    p.add_argument("--momentum", type=number(0, below=1), default=0.0)
    args = p.parse_args(argv)
    check_mode_args(p, args)  # a bad mode setting stops here, before any worker starts
    return args


def main(argv=None):
    args = parse_args(argv)

    from digits import build_model, init_horovod, load_data  # the callback example beside this one

    hvd = init_horovod()

    import tfsync
    from tfsync.launch import contribution_totals, describe_mode, mode_from_args, print_result

    x_local, y_local, x_test, y_test = load_data(args.batch_size)

    mode = mode_from_args(args)
    stragglers = tfsync.Stragglers.parse(args.stragglers) if args.stragglers else None
    strategy = tfsync.distribute.SyncStrategy(mode=mode, stragglers=stragglers)
    with strategy.scope():
        model = build_model(args.lr, args.momentum)
    start = time.time()
    model.fit(x_local, y_local, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    engine = strategy.engine
    strategy.finish()
    wall_s = time.time() - start
    samples = len(x_local) * args.epochs * hvd.size()
    totals = contribution_totals(hvd, engine.counts, args.batch_size, wall_s, samples=samples)
    accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
    identical = len(set(hvd.allgather_object(checksum))) == 1
    if hvd.rank() == 0:
        print_result(
            {
                "mode": describe_mode(mode),
                "final_accuracy": accuracy,
                "replicas_identical": identical,
                "samples_per_s": len(x_local) * args.epochs * hvd.size() / wall_s,
                **totals,
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
