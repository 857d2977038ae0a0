"""Rank 0 of ``python -m tfsync.bench control``: the real control service, and what it costs.

argv: ``POLICY SIZE TOKEN STATS_PATH``.  Starts the job's control service on 127.0.0.1 for
``SIZE`` workers under ``POLICY`` (:func:`tfsync.bench.control.policy_for`), prints
``ADDRESS <host:port>``, samples this process's CPU time, threads, resident memory, the clock
reports served and the messages its links carried every ``SAMPLE_S`` and, when a line arrives
on stdin (or stdin closes), stops the service and writes the samples and the service's counters
to ``STATS_PATH`` (JSON).
No TensorFlow.
"""

import json
import sys
import threading
import time

import psutil

from tfsync.bench.control import policy_for
from tfsync.control import ControlServer
from tfsync.engine.components import bindings

SAMPLE_S = 0.25  # (each sample costs rank 0 about half a millisecond of CPU: not often)


def main(argv):
    policy_name, size, token, stats_path = argv[0], int(argv[1]), argv[2], argv[3]
    policy = policy_for(policy_name, size)
    server = ControlServer(
        size, time.time(), token, host="127.0.0.1", policy=policy, service=bindings.service(policy, size)
    )
    process = psutil.Process()
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            # (CPU from the clock, ns-precise: psutil reads 10-ms ticks, 0 over a short window)
            cpu, served, rss = time.process_time(), server.served(), process.memory_info().rss
            samples.append(
                (
                    time.time(),
                    cpu,
                    process.num_threads(),
                    rss,
                    served.get("reports", 0),
                    served.get("messages_in", 0),
                    served.get("messages_out", 0),
                )
            )
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    print(f"ADDRESS {server.address}", flush=True)
    sys.stdin.readline()
    done.set()
    sampler.join(5.0)
    stats = {"samples": samples, "served": server.served()}
    server.stop()
    with open(stats_path, "w") as f:
        json.dump(stats, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
