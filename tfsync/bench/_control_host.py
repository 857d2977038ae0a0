"""One simulated host of ``python -m tfsync.bench control``: its workers' control traffic.

argv: ``ADDRESS TOKEN POLICY SIZE FIRST_RANK RANKS ROUNDS REPORTS_HZ RELAY OUT_PATH``.  The
host's ``RANKS`` workers (ranks ``FIRST_RANK`` on) each open a link with the job's token and
attach, as a real worker's control client does: through the host's relay (the real
:class:`HostRelay` in this process, as it runs in the host's first worker; ``RELAY`` 1: the relay
attaches to rank 0's service at ``ADDRESS``; ``group``: this host also runs its group's relay,
attached to ``ADDRESS``, prints ``GROUP host:port`` and its host relay attaches there;
``via:host:port``: the relay attaches to that group relay, rank 0 its fallback), or to rank 0's
service (``RELAY`` 0; rank 0 itself always does).  The host prints ``ATTACHED`` and waits for a
line on stdin (every host attached: the harness's start); then its workers run ``ROUNDS`` rounds
of their policy's control traffic:

* ``backup``, ``psp``: ``["ready", rank, id, r]``, then wait (bounded) until the closing of round
  ``r`` reaches its link; the next round right after (no computation: the service sets the pace);
  under ``psp`` the last rank is the straggler: it sends its notice once the closing came (the
  round closed without it: its notice is late, and dropped);
* ``dssp``: per step, ``["tell", rank, "pushed", ...]``, and every ``ASK_EVERY`` steps
  ``["ask", rank, id, "grant", ...]``, timed.

Meanwhile the host reports every worker's clock ``REPORTS_HZ`` times a second, and at the end
every worker leaves.  The workers speak the link's wire (:mod:`tfsync.control.transport`)
as coroutines on one event loop, each with its own channel, not as
:class:`~tfsync.control.client.ControlClient` threads: in a job each worker's client runs
in its own process on its own host, and a thousand clients of threads would saturate this
process's machine long before rank 0 (what is measured).  Writes to ``OUT_PATH`` (JSON): per
worker, when it sent each round's notice and when its closing reached it (or its asks' round
trips); the reports sent; this process's CPU seconds at the end of every round of its first
worker.  No TensorFlow.
"""

import asyncio
import itertools
import json
import sys
import time

import grpc
import grpc.aio

from tfsync.control.relay import HostRelay
from tfsync.control.transport import CHANNEL_OPTIONS, LINK_METHOD, TOKEN_METADATA_KEY, decode, encode

ROUND_TIMEOUT_S = 60.0  # one round's closing must come within this, or the host gives up (and says so)
CONNECT_TIMEOUT_S = 300.0  # a thousand workers attach at once on a loaded machine
ASK_EVERY = 4  # dssp: a worker asks for a grant every this many steps (at its lower bound)


class Stream:
    """A simulated link to rank 0 (or to a relay): its call, one write at a time, and when each
    round's closing reached it; attached once rank 0 said so of every rank it carries.
    Subclasses say what they send to attach, and may read more (:meth:`_take`)."""

    def __init__(self, address, token, name, ranks):
        self.name = name  # (for errors)
        self._unattached = set(ranks)  # the ranks it attaches that rank 0 has not said attached
        self.closed = {}  # round -> time its closing arrived
        self._changed = asyncio.Condition()
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._call = self._channel.stream_stream(LINK_METHOD)(
            metadata=((TOKEN_METADATA_KEY, token),), wait_for_ready=True
        )
        self._reader = None
        self._writing = asyncio.Lock()  # (one write at a time on a call: its rounds and its host's reports)

    async def attach(self, *items):
        attached = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read(attached))
        await self.send(*items)
        await asyncio.wait_for(attached, CONNECT_TIMEOUT_S)

    async def _read(self, attached):
        async for data in self._call:
            closed = False
            for item in decode(data):
                if item[0] == "closed":
                    now = time.time()
                    for entry in item[2]:
                        self.closed.setdefault(int(entry[0]), now)
                    closed = True
                else:
                    self._take(item, attached)
            if closed:
                async with self._changed:
                    self._changed.notify_all()

    def _take(self, item, attached):
        """An item other than a closing: the link has attached once every rank it carries has."""
        if item[0] == "attached" and not attached.done():
            self._unattached.discard(int(item[1]))
            if not self._unattached:
                attached.set_result(True)

    async def send(self, *items):
        async with self._writing:
            await self._call.write(encode(list(items)))

    async def wait_closed(self, round_):
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: round_ in self.closed), ROUND_TIMEOUT_S)
            except TimeoutError:
                raise TimeoutError(
                    f"{self.name}: round {round_}'s closing did not come within {ROUND_TIMEOUT_S} s"
                ) from None
        return self.closed[round_]


class Worker(Stream):
    """One simulated worker: its link, its open requests, when each round's closing reached it."""

    def __init__(self, address, token, rank):
        super().__init__(address, token, f"rank {rank}", [rank])
        self.rank = rank
        self._answers = {}  # request id -> Future
        self._ids = itertools.count(1)

    async def attach(self):
        await super().attach(["attach", self.rank, 0, 0])

    def _take(self, item, attached):
        super()._take(item, attached)
        if item[0] == "answer":
            future = self._answers.pop(item[2], None)
            if future is not None and not future.done():
                future.set_result(item[3])

    async def request(self, kind, *args):
        """Send a request; its answer (bounded)."""
        request = next(self._ids)
        future = self._answers[request] = asyncio.get_running_loop().create_future()
        await self.send([kind, self.rank, request, *args])
        return await asyncio.wait_for(future, ROUND_TIMEOUT_S)

    async def ready(self, round_):
        request = next(self._ids)
        await self.send(["ready", self.rank, request, round_])

    async def leave(self):
        await self.send(["leave", self.rank])
        await self.request("table")  # (answered after the leave: it arrived, which is what counts)
        async with self._writing:
            if not self._call.done():
                try:
                    await self._call.done_writing()
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    pass  # (the link ended meanwhile: the leave was answered)
        self._reader.cancel()
        await self._channel.close()


async def run_host(address, token, policy, size, first, count, rounds, reports_hz, relay, records, cpu_at, errors):
    here = relay.address if relay is not None else address
    # (rank 0 attaches to its own service, its host's other ranks through their relay)
    workers = [Worker(address if first + k == 0 else here, token, first + k) for k in range(count)]
    await asyncio.gather(*(w.attach() for w in workers))
    loop = asyncio.get_running_loop()
    print("ATTACHED", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    reports = {"sent": 0}
    done = asyncio.Event()

    async def report():
        clock = 0
        while not done.is_set():
            await asyncio.sleep(1.0 / reports_hz)
            clock += 1
            for w in workers:
                await w.send(["report", w.rank, clock])
                reports["sent"] += 1

    async def run(worker):
        rec = records[worker.rank]
        try:
            for r in range(rounds):
                if policy == "dssp":
                    await worker.send(["tell", worker.rank, "pushed", {"step": r}])
                    if r % ASK_EVERY == 0:
                        t = time.time()
                        await worker.request("ask", "grant", {"step": r, "room": 1})
                        rec["asks_s"].append((r, time.time() - t))
                    rec["known"].append(time.time())
                elif policy == "psp" and worker.rank == size - 1:  # (the straggler: its notice comes late)
                    rec["known"].append(await worker.wait_closed(r))
                    rec["sent"].append(time.time())
                    await worker.ready(r)
                else:
                    rec["sent"].append(time.time())
                    await worker.ready(r)
                    rec["known"].append(await worker.wait_closed(r))
                if worker is workers[0]:
                    cpu_at.append((time.time(), time.process_time()))  # (ns-precise; not 10-ms ticks)
        except Exception as exc:  # noqa: BLE001 - written to the output, the harness reports it
            errors.append(f"rank {worker.rank}: {type(exc).__name__}: {exc}")

    reporter = asyncio.ensure_future(report()) if reports_hz > 0 else None
    await asyncio.gather(*(run(w) for w in workers))
    done.set()
    if reporter is not None:
        await reporter  # (not cancelled: a write cancelled midway cancels its worker's call)
    for w in workers:
        try:
            await w.leave()
        except Exception as exc:  # noqa: BLE001 - written to the output, the harness reports it
            errors.append(f"rank {w.rank} leaving: {type(exc).__name__}: {exc}")
    return reports


def main(argv):
    address, token, policy, size = argv[0], argv[1], argv[2], int(argv[3])
    first, count, rounds, reports_hz = int(argv[4]), int(argv[5]), int(argv[6]), float(argv[7])
    out_path, relays = argv[9], []
    if argv[8] == "group":  # (started first: the group's other hosts attach to it)
        relays.append(HostRelay(address, token, time.time()))
        print("GROUP", relays[0].address, flush=True)
        relays.insert(0, HostRelay(relays[0].address, token, time.time(), fallback=address))
    elif argv[8].startswith("via:"):
        relays.append(HostRelay(argv[8][4:], token, time.time(), fallback=address))
    elif argv[8] == "1":
        relays.append(HostRelay(address, token, time.time()))
    relay = relays[0] if relays else None
    records = {first + k: {"sent": [], "known": [], "asks_s": []} for k in range(count)}
    cpu_at, errors = [], []  # (time, this process's CPU seconds) at each round end of its first worker
    reports = asyncio.run(
        run_host(address, token, policy, size, first, count, rounds, reports_hz, relay, records, cpu_at, errors)
    )
    # (a job's workers close together, after a barrier: a group relay outlives its group's workers)
    print("DONE", flush=True)
    sys.stdin.readline()
    for r in relays:  # (the host relay before its group relay)
        r.stop()
    with open(out_path, "w") as f:
        json.dump({"records": records, "cpu_at": cpu_at, "reports": reports, "errors": errors}, f)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
