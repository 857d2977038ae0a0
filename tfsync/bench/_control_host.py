"""One simulated host of ``python -m tfsync.bench control``: its workers' control traffic.

argv: ``ADDRESS TOKEN POLICY SIZE FIRST_RANK RANKS ROUNDS REPORTS_HZ RELAY OUT_PATH``.  The
host's ``RANKS`` workers (ranks ``FIRST_RANK`` on) each attach with the job's token, as a real
worker's engine does: through the host's relay (``RELAY`` 1: :class:`HostRelay` in this
process, as it runs in the host's first worker), or to rank 0's service at ``ADDRESS``; then
they run ``ROUNDS`` rounds of their policy's control traffic, each on a thread of this process:

* ``backup``, ``psp``: ``Ready(rank, r)``, then wait (bounded) until the closing of round ``r``
  reaches its stream; the next round right after (no computation: the service sets the pace);
* ``dssp``: per step, ``tell("pushed")``, and every ``ASK_EVERY`` steps ``ask("grant")``, timed.

Meanwhile one thread reports every worker's clock ``REPORTS_HZ`` times a second.  Writes to
``OUT_PATH`` (JSON): per worker, when it sent each round's notice and when its closing reached
it (or its asks' round trips); the reports sent; this process's CPU seconds at the end of every
round of its first worker.  No TensorFlow.
"""

import json
import sys
import threading
import time

import psutil

from tfsync.engine.control import ControlClient
from tfsync.engine.control.relay import HostRelay

ROUND_TIMEOUT_S = 60.0  # one round's closing must come within this, or the host gives up (and says so)
CONNECT_TIMEOUT_S = 120.0  # a thousand workers attach at once on a loaded machine
ASK_EVERY = 4  # dssp: a worker asks for a grant every this many steps (at its lower bound)


class Worker:
    """One simulated worker: its control client and when each round's closing reached it."""

    def __init__(self, address, token, rank, fallback):
        self.rank = rank
        self.closed = {}  # round -> time its closing arrived
        self._cond = threading.Condition()
        self.client = ControlClient(
            address, rank, token, connect_timeout_s=CONNECT_TIMEOUT_S, on_close=self._on_close, fallback=fallback
        )

    def _on_close(self, round_, accepted, late=()):
        with self._cond:
            self.closed[round_] = time.time()
            self._cond.notify_all()

    def wait_closed(self, round_):
        with self._cond:
            if not self._cond.wait_for(lambda: round_ in self.closed, ROUND_TIMEOUT_S):
                raise TimeoutError(
                    f"rank {self.rank}: round {round_}'s closing did not come within {ROUND_TIMEOUT_S} s"
                )
            return self.closed[round_]


def main(argv):
    address, token, policy = argv[0], argv[1], argv[2]  # (argv[3], the job's size: rank 0's business)
    first, count, rounds, reports_hz = int(argv[4]), int(argv[5]), int(argv[6]), float(argv[7])
    relay, out_path = HostRelay(address, token, time.time()) if argv[8] == "1" else None, argv[9]
    process = psutil.Process()
    here = relay.address if relay is not None else address
    workers = [Worker(here, token, first + k, address) for k in range(count)]
    records = {w.rank: {"sent": [], "known": [], "asks_s": []} for w in workers}
    cpu_at = []  # (time, this process's CPU seconds) at each round end of its first worker
    errors = []
    stop = threading.Event()
    reports = {"sent": 0}
    lock = threading.Lock()

    def report():
        clock = 0
        while not stop.wait(1.0 / reports_hz):
            clock += 1
            for w in workers:
                if w.client.report(clock, min_interval_s=0.0):
                    with lock:
                        reports["sent"] += 1

    def run(worker):
        rec = records[worker.rank]
        try:
            for r in range(rounds):
                if policy == "dssp":
                    worker.client.tell("pushed", step=r)
                    if r % ASK_EVERY == 0:
                        t = time.time()
                        worker.client.ask("grant", step=r, room=1)
                        rec["asks_s"].append((r, time.time() - t))
                    rec["known"].append(time.time())
                else:
                    rec["sent"].append(time.time())
                    worker.client.ready(r)
                    rec["known"].append(worker.wait_closed(r))
                if worker is workers[0]:
                    cpu = process.cpu_times()
                    cpu_at.append((time.time(), cpu.user + cpu.system))
        except Exception as exc:  # noqa: BLE001 - written to the output, the harness reports it
            errors.append(f"rank {worker.rank}: {type(exc).__name__}: {exc}")

    reporter = threading.Thread(target=report, daemon=True) if reports_hz > 0 else None
    if reporter is not None:
        reporter.start()
    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    for w in workers:
        w.client.close()
    if relay is not None:
        relay.stop()
    with open(out_path, "w") as f:
        json.dump({"records": records, "cpu_at": cpu_at, "reports": reports, "errors": errors}, f)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
