"""Training runs that a test disturbs from outside: the worker of the multi-host fault tests.

``python fault.py OUT_DIR [--runs NAME ...] [--epochs N] [--mark-step K] [--wait-timeout-s S]``
under ``horovodrun``: for each named configuration of the registry
(:func:`tfsync.policies.registry.configurations`, default ``bsp``), in turn, a
fresh model trains the small regression problem under ``SyncCallback`` with a
simulated device time per step (so a run lasts long enough to be disturbed).
After run ``i``'s ``--mark-step``-th step each rank writes
``at<i>_rank<R>.json`` (its pid, the time): the test waits for every rank's,
then cuts a link, kills or stops a process.  At the end each surviving rank
writes ``result_rank<R>.json``: the error it stopped with (``None`` if every
run finished), when (``error_at``, wall clock), and per run its counts and
final weights.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "parallel", "workers"))
from common import build_regression_model, init, regression_shard, write_result  # noqa: E402

hvd = init()

import keras  # noqa: E402

import tfsync  # noqa: E402
from tfsync.launch import add_mode_arguments, mode_from_args  # noqa: E402
from tfsync.policies import registry  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("out_dir")
p.add_argument("--runs", nargs="+", default=["bsp"], help="registry configurations (bsp, psp+dc, ...)")
p.add_argument("--epochs", type=int, default=8)
p.add_argument("--mark-step", type=int, default=8)
p.add_argument("--step-s", type=float, default=0.05, help="simulated device time per step")
p.add_argument("--wait-timeout-s", type=float, default=10.0)
args = p.parse_args()
rank = hvd.rank()


def policy_of(name):
    parser = argparse.ArgumentParser()
    add_mode_arguments(parser)
    return mode_from_args(parser.parse_args(registry.configurations()[name]))


class Mark(keras.callbacks.Callback):
    """Writes ``at<run>_rank<R>.json`` after the ``--mark-step``-th step of the run."""

    def __init__(self, run):
        super().__init__()
        self.run, self.steps = run, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == args.mark_step:
            with open(os.path.join(args.out_dir, f"at{self.run}_rank{rank}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "t": time.time()}, f)


xl, yl = regression_shard(256)
result = {"error": None, "host": os.uname().nodename, "runs": {}}
for i, name in enumerate(args.runs):
    model = build_regression_model()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    sync = tfsync.keras.SyncCallback(
        mode=policy_of(name),
        stragglers=tfsync.Stragglers(base_s=args.step_s),
        wait_timeout_s=args.wait_timeout_s,
    )
    try:
        model.fit(xl, yl, batch_size=8, epochs=args.epochs, shuffle=False, verbose=0, callbacks=[sync, Mark(i)])
    except Exception as exc:  # the error a fault ends in, for the test to read
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["runs"][name] = {
        "counts": dict(sync.counts) if sync.engine is not None else None,
        "weights": [w.ravel().tolist() for w in model.get_weights()],
    }
    if result["error"]:
        break
result["error_at"] = time.time()
write_result(args.out_dir, rank, result)
sys.exit(1 if result["error"] else 0)
