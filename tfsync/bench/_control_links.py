"""Rank 0's links of ``python -m tfsync.bench control --simulate links``: what its relays send it.

argv: ``ADDRESS TOKEN POLICY ROUNDS REPORTS_HZ LINKS OUT_PATH``; ``LINKS`` is a JSON list, one
entry per link of rank 0's (its own worker's, its host's relay's, each group or host relay's),
each the list of the ranks it carries.  Each link attaches its ranks as a relay does (``["relay"]``
and an ``attach`` per rank, in one message), prints ``ATTACHED`` once all have, waits for a line
on stdin, then runs ``ROUNDS`` rounds: every rank's ``ready`` in one message (what a relay sends
when its workers' notices come within its hold, as data-parallel workers' do), then waits
(bounded) for the round's closing (under ``psp`` the last rank is the straggler: its notice goes
once the round closed without it, late); meanwhile every rank's clock goes up ``REPORTS_HZ`` times a
second, in one ``reports`` item per link every
:data:`~tfsync.control.outgoing.REPORT_FLUSH_S` (as a relay batches them).  The links are
coroutines of this one process: rank 0 sees a large job's traffic, while the simulation costs a
few links' messages a round, not a thousand workers' (``--simulate hosts``), so rank 0, not the
simulation, sets the pace.  Writes ``OUT_PATH`` as :mod:`tfsync.bench._control_host` does (per
rank: when its notice went and its closing came, as its link's).  No TensorFlow.
"""

import asyncio
import json
import sys
import time

from tfsync.bench._control_host import ROUND_TIMEOUT_S, Stream
from tfsync.control.outgoing import REPORT_FLUSH_S


class Link(Stream):
    """One of rank 0's links, carrying ``ranks``."""

    def __init__(self, address, token, ranks):
        super().__init__(address, token, f"the link of ranks {ranks[0]}-{ranks[-1]}", ranks)
        self.ranks = ranks
        self._ids = 0

    async def attach(self):
        await super().attach(["relay"], *(["attach", rank, 0, 0] for rank in self.ranks))

    async def ready(self, round_, ranks):
        self._ids += 1
        await self.send(*(["ready", rank, self._ids, round_] for rank in ranks))

    async def leave(self):
        await self.send(*(["leave", rank] for rank in self.ranks))
        async with self._writing:
            await self._call.done_writing()
        await asyncio.wait_for(self._reader, ROUND_TIMEOUT_S)
        await self._channel.close()


async def run_links(address, token, policy, rounds, reports_hz, spec, records, cpu_at, errors):
    links = [Link(address, token, ranks) for ranks in spec]
    await asyncio.gather(*(link.attach() for link in links))
    print("ATTACHED", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    reports = {"sent": 0}
    done = asyncio.Event()

    async def report(link):
        clock, loop = 0, asyncio.get_running_loop()
        due = loop.time()
        while not done.is_set():
            due += REPORT_FLUSH_S  # (on a fixed schedule: a slow write does not drift the rate)
            await asyncio.sleep(max(0.0, due - loop.time()))
            clock += max(1, round(reports_hz * REPORT_FLUSH_S))  # (the newest of the clocks since the last)
            await link.send(["reports", {str(rank): clock for rank in link.ranks}])
            reports["sent"] += len(link.ranks) * reports_hz * REPORT_FLUSH_S

    size = max(rank for ranks in spec for rank in ranks) + 1
    straggler = size - 1 if policy == "psp" else None  # (its notice comes once the round closed)

    async def run(link):
        prompt = [rank for rank in link.ranks if rank != straggler]
        try:
            for r in range(rounds):
                sent = time.time()
                await link.ready(r, prompt)
                known = await link.wait_closed(r)
                for rank in prompt:
                    records[rank]["sent"].append(sent)
                    records[rank]["known"].append(known)
                if len(prompt) < len(link.ranks):
                    records[straggler]["known"].append(known)
                    records[straggler]["sent"].append(time.time())
                    await link.ready(r, [straggler])
                if link is links[0]:
                    cpu_at.append((time.time(), time.process_time()))  # (ns-precise; not 10-ms ticks)
        except Exception as exc:  # noqa: BLE001 - written to the output, the harness reports it
            errors.append(f"link of ranks {link.ranks[0]}-{link.ranks[-1]}: {type(exc).__name__}: {exc}")

    reporters = [asyncio.ensure_future(report(link)) for link in links] if reports_hz > 0 else []
    await asyncio.gather(*(run(link) for link in links))
    done.set()
    await asyncio.gather(*reporters)  # (not cancelled: a write cancelled midway cancels its call)
    for link in links:
        try:
            await link.leave()
        except Exception as exc:  # noqa: BLE001 - written to the output, the harness reports it
            errors.append(f"link of ranks {link.ranks[0]}-{link.ranks[-1]} leaving: {type(exc).__name__}: {exc}")
    return reports


def main(argv):
    address, token, policy = argv[0], argv[1], argv[2]
    rounds, reports_hz, spec, out_path = int(argv[3]), float(argv[4]), json.loads(argv[5]), argv[6]
    records = {rank: {"sent": [], "known": [], "asks_s": []} for ranks in spec for rank in ranks}
    cpu_at, errors = [], []
    reports = asyncio.run(run_links(address, token, policy, rounds, reports_hz, spec, records, cpu_at, errors))
    print("DONE", flush=True)
    sys.stdin.readline()
    with open(out_path, "w") as f:
        json.dump({"records": records, "cpu_at": cpu_at, "reports": reports, "errors": errors}, f)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
