"""Every registered mode and variant, through the callback and through the strategy, in one launch.

``python every_mode.py OUT_DIR [--stragglers SPEC] [--callback-epochs N] [--mark-step K]``
under ``horovodrun``: for each configuration the registry lists
(:func:`tfsync.policies.registry.configurations`, so a new mode is covered without editing
this file) plus ``auto``, a fresh model from the same seed trains a few epochs of a small
regression problem through ``SyncCallback``, and, for every mode ``SyncStrategy`` takes,
through the strategy.  With ``--mark-step K``, after the ``K``-th step of the ``i``-th
callback run each rank writes ``at<i>_rank<R>.json`` (its pid, the time): the test waits
for every rank's, then disturbs the run from outside (a link flap).  Each rank writes
``result_rank<R>.json``: per run, its final weights, its counts and the error, if the run
raised (the test checks that no run did).
"""

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "parallel", "workers"))
from common import build_regression_model, init, regression_shard, write_result  # noqa: E402

hvd = init()

import keras  # noqa: E402

import tfsync  # noqa: E402
from tfsync.launch import add_mode_arguments, mode_from_args  # noqa: E402
from tfsync.policies import registry  # noqa: E402

EPOCHS = 2
SAMPLES = 256  # 64 per rank on four ranks: 8 steps an epoch at batch 8
STRATEGY_REFUSES = ("auto", "psp+pull")  # (auto switches modes, partial pulling applies block by block)

args = argparse.ArgumentParser()
args.add_argument("out_dir")
args.add_argument("--stragglers", default="")
args.add_argument("--wait-timeout-s", type=float, default=60.0)
args.add_argument("--callback-epochs", type=int, default=EPOCHS, help="(long enough for a disturbance)")
args.add_argument("--mark-step", type=int, default=0, help="0: no marks")
args = args.parse_args()
stragglers = tfsync.Stragglers.parse(args.stragglers)
xl, yl = regression_shard(SAMPLES)


def policy_of(flags):
    parser = argparse.ArgumentParser()
    add_mode_arguments(parser)
    return mode_from_args(parser.parse_args(flags))


class Mark(keras.callbacks.Callback):
    """Writes ``at<run>_rank<R>.json`` after the ``--mark-step``-th step of callback run ``run``."""

    def __init__(self, run):
        super().__init__()
        self.run, self.steps = run, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == args.mark_step:
            with open(os.path.join(args.out_dir, f"at{self.run}_rank{hvd.rank()}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "t": time.time()}, f)


def train(mode, frontend, index):
    settings = {"stragglers": stragglers, "wait_timeout_s": args.wait_timeout_s}
    if frontend == "strategy":
        strategy = tfsync.distribute.SyncStrategy(mode=mode, **settings)
        with strategy.scope():
            model = build_regression_model()
            model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(xl, yl, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0)
        engine = strategy.engine
        strategy.finish()
        return model.get_weights(), dict(engine.counts), {}
    model = build_regression_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    sync = tfsync.keras.SyncCallback(mode=mode, **settings)
    callbacks = [sync, Mark(index)] if args.mark_step else [sync]
    model.fit(xl, yl, batch_size=8, epochs=args.callback_epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model.get_weights(), dict(sync.counts), {"auto_decisions": len(sync.auto_decisions)}


runs = {name: policy_of(flags) for name, flags in registry.configurations().items()}
runs["auto"] = tfsync.Auto(window_steps=6)  # (a decision within the first epoch)
result = {"size": hvd.size(), "runs": {}}
for frontend in ("callback", "strategy"):
    for index, (name, mode) in enumerate(runs.items()):
        if frontend == "strategy" and name in STRATEGY_REFUSES:
            continue
        key = f"{frontend}:{name}"
        try:
            weights, counts, extra = train(mode, frontend, index)
            moved = float(max(np.max(np.abs(a - b)) for a, b in zip(weights, build_regression_model().get_weights())))
            result["runs"][key] = {
                "weights": [w.ravel().tolist() for w in weights],
                "counts": counts,
                "moved": moved,
                "error": None,
                **extra,
            }
        except Exception as exc:  # recorded for the test, then the job stops (the others would wait)
            result["runs"][key] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            write_result(args.out_dir, hvd.rank(), result)
            sys.exit(1)
        print(f"rank {hvd.rank()} {key} done {counts}", flush=True)
write_result(args.out_dir, hvd.rank(), result)
