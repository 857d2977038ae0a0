"""Rank 1 freezes (SIGSTOP) while Horovod's background threads negotiate, so rank 0's
background thread waits on a live peer; rank 0 then calls ``tfsync._horovod.interrupt_gloo()``
and ``hvd.shutdown()``, which must end on the interrupt, not at Gloo's timeout (60 s here).
Rank 0 wakes rank 1 afterwards; rank 1's own operations on rank 0 have failed meanwhile."""

import os
import signal
import sys
import time

from common import init, write_result

hvd = init()
import tensorflow as tf  # noqa: E402

from tfsync import _horovod  # noqa: E402

out_dir = sys.argv[1]
rank = hvd.rank()
pids = [int(p) for p in hvd.allgather_object(os.getpid())]
assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == 2.0  # the job formed
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)  # frozen until rank 0 wakes it
    time.sleep(1.0)
    try:
        hvd.allreduce(tf.constant(1.0), op=hvd.Sum)
        after = "allreduce worked"
    except Exception as exc:  # noqa: BLE001 - what failed is the result
        after = f"{type(exc).__name__}: {exc}"
    write_result(out_dir, rank, {"after": after[:300]})
    hvd.shutdown()
    sys.exit(0)
time.sleep(2.0)  # rank 1 is stopped; this background thread waits on it
t = time.monotonic()
interrupted = _horovod.interrupt_gloo()
hvd.shutdown()
shutdown_s = time.monotonic() - t
os.kill(pids[1], signal.SIGCONT)
write_result(out_dir, rank, {"interrupted": interrupted, "shutdown_s": shutdown_s})
