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
