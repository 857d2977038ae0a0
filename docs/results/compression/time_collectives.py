"""Horovod's collectives alone across the network bench's shaped link: what a compressed round's
alltoall and all-gather cost against an allreduce (the compression study's 1 Gbit/s question).

    python docs/results/compression/time_collectives.py 1gbit

Two simulated hosts (tfsync.bench.hosts, root), one worker each, the large MLP's 17.9M values:
an allreduce of them in float32 and in float16, and the alltoall and the all-gather of a
compressed round (each rank's share in 16-bit words).  Prints rank 0's mean ms of 6 calls each
after one warm-up, as JSON.
"""

import json
import os
import sys
import time

VALUES = 17_900_000


def worker():
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    size, length = hvd.size(), -(-VALUES // hvd.size())
    f32 = tf.random.normal([VALUES])
    f16 = tf.cast(f32, tf.float16)
    rows = tf.bitcast(tf.reshape(tf.pad(f16, [[0, size * length - VALUES]]), [size, length]), tf.uint16)

    def timed(name, call, calls=6):
        call()
        hvd.allreduce(tf.constant(0.0), name=f"sync.{name}")
        t = time.perf_counter()
        for _ in range(calls):
            call()
        return name, (time.perf_counter() - t) / calls * 1000

    ms = dict(
        [
            timed("allreduce_float32", lambda: hvd.allreduce(f32, op=hvd.Sum, name="f32")),
            timed("allreduce_float16", lambda: hvd.allreduce(f16, op=hvd.Sum, name="f16")),
            timed("alltoall_16bit", lambda: hvd.alltoall(rows, name="scatter")),
            timed("allgather_16bit", lambda: hvd.allgather(rows[:1], name="gather")),
        ]
    )
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(ms), flush=True)


def main(rate):
    from tfsync.bench.hosts import Hosts

    with Hosts(2) as hosts:
        for i in (1, 2):
            hosts.shape_link(i, rate)
        code, out = hosts.run(1, hosts.horovodrun(1, [os.path.abspath(__file__), "--worker"]), timeout_s=400)
    lines = [line.split("RESULT ", 1)[1] for line in out.splitlines() if "RESULT " in line]
    if code != 0 or not lines:
        sys.exit(f"the launch failed ({code}):\n{out[-3000:]}")
    print(json.dumps({"rate": rate, "values": VALUES, "ms": json.loads(lines[0])}, indent=1))


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main(sys.argv[1] if len(sys.argv) > 1 else "1gbit")
