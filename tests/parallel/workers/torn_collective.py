"""A collective torn mid-way on one rank: the survivors' collectives fail, and no process aborts.

``python torn_collective.py OUT_DIR {kill,interrupt} SEED`` under ``horovodrun -np 4``: every rank
allreduces a 16 MB tensor over and over (Horovod's Gloo ring: each rank sends to the next and
receives from the one before); after a delay drawn from ``SEED``, rank 3 ends its part in the
middle of one: ``interrupt`` puts every connection of its own in error
(:func:`tfsync._horovod.interrupt_gloo`, as a connection reset would; the process lives on
and reports), ``kill`` SIGKILLs it.  Its neighbours' allreduce fails at once, while rank 1,
whose neighbours are alive, is still sending rank 2 its part.  Each rank that lives writes
``result_rank<R>.json``: the error its collective ended with, and the error of one more
allreduce (which must fail too: the job's collectives are broken).

What this guards against: Horovod went on to negotiate its next cycle on the same Gloo
connections after a collective failed on one rank, with an allreduce on the slot the data
allreduce used; rank 1's data then met rank 2's 8-byte negotiation receive and Gloo aborted
rank 2 (``op.preamble.length <= op.nbytes``, exit 134), where it should have failed the
collective (``third_party/horovod``, the patch's hunk 15).
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

from tfsync import _horovod  # noqa: E402

out_dir, how, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = hvd.rank()
big = tf.ones([4 * 1024 * 1024])
assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == hvd.size()  # the job formed
hvd.allreduce(big, op=hvd.Sum, name="warm")


def tear():
    time.sleep(random.Random(seed).uniform(0.05, 0.4))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    _horovod.interrupt_gloo()


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
