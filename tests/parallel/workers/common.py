"""Helpers shared by the worker scripts (run under horovodrun)."""

import json
import os


def init():
    import horovod.tensorflow as hvd

    hvd.init()
    return hvd


def write_result(out_dir, rank, result):
    path = os.path.join(out_dir, f"result_rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


# The small regression problem the equivalence workers train (after init()).
OPTIMIZER_NAMES = ("sgd", "momentum", "adam")


def make_optimizer(name):
    import keras

    return {
        "sgd": lambda: keras.optimizers.SGD(0.05),
        "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: keras.optimizers.Adam(0.01),
    }[name]()


def regression_shard(samples):
    """This rank's equal share of a seeded linear regression problem (8 inputs, 3 outputs)."""
    import numpy as np

    import tfsync

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 3))).astype("float32")
    return tfsync.shard(x, y, batch_size=8)


def build_regression_model():
    """The same initial weights on every call (seeded)."""
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
