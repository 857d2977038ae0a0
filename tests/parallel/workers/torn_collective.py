"""A collective torn mid-way on one rank: the survivors' collectives fail, and no process aborts.

``python torn_collective.py OUT_DIR SEED`` under ``horovodrun -np 4``: every rank allreduces a
16 MB tensor over and over (Horovod's Gloo ring: each rank sends to the next and receives from
the one before); after a delay drawn from ``SEED``, rank 3 SIGKILLs itself in the middle of
one.  Its neighbours' allreduce fails at once, while a rank whose neighbours are alive is still
sending its part.  Each survivor writes ``result_rank<R>.json`` (if the launcher, which ends a
job whose process failed, has not ended it first): the error its collective ended with, and
the error of one more allreduce (which must fail too: the job's collectives are broken).

What this guards against: Horovod went on to negotiate its next cycle on the same Gloo
connections after a collective failed on one rank, with an allreduce on the slot the data
allreduce used; a live peer's data then met the 8-byte negotiation receive and Gloo aborted
a survivor (``op.preamble.length <= op.nbytes. 1048576 vs 8``, exit 134, in every run of two
before the fix), where it should have failed the collective (``third_party/horovod``, the
patch's hunk 15).
"""

import os
import random
import signal
import sys
import threading
import time

from common import init, write_result

hvd = init()
import tensorflow as tf  # noqa: E402

out_dir, seed = sys.argv[1], int(sys.argv[2])
rank = hvd.rank()
big = tf.ones([4 * 1024 * 1024])
assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == hvd.size()  # the job formed
hvd.allreduce(big, op=hvd.Sum, name="warm")


def tear():
    time.sleep(random.Random(seed).uniform(0.05, 0.4))
    os.kill(os.getpid(), signal.SIGKILL)


if rank == 3:
    threading.Thread(target=tear, daemon=True).start()
error, t = None, time.time()
try:
    for i in range(200):
        hvd.allreduce(big, op=hvd.Sum, name=f"big{i}")
except Exception as exc:  # noqa: BLE001 - how it failed is the result
    error = f"{type(exc).__name__}: {exc}"[:400]
try:
    hvd.allreduce(tf.constant(1.0), op=hvd.Sum, name="after")
    after = "allreduce worked"
except Exception as exc:  # noqa: BLE001
    after = f"{type(exc).__name__}: {exc}"[:400]
write_result(out_dir, rank, {"error": error, "after": after, "failed_after_s": time.time() - t})
