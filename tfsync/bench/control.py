"""Rank 0's control service under N simulated workers: rounds per second, latency, its cost.

``python -m tfsync.bench control --workers N [N ...] --policy backup|psp|dssp [--reports-hz H]
[--rounds R] [--ranks-per-host K] [--relays auto|hosts|off] [--simulate hosts|links] --json FILE
[--plot PNG]``

For each N: the real control service (:mod:`tfsync.bench._control_rank0`, its own process, as
rank 0's is in a job) and N simulated workers deployed as a job's are, hosts of ``K`` ranks
(default 8), each host its own process (:mod:`tfsync.bench._control_host`).  Every worker
attaches with the job's token, as a job's do (``--relays auto``, the default: the workers of
each host but the first, rank 0's, through their host's relay, and past 8 such hosts the relays
of each 8 through their group's relay; ``hosts``: the host relays only; ``off``: each worker its
own link to rank 0), and runs ``R`` rounds of its policy's control traffic, while its host reports every
worker's clock ``H`` times a second (default 4, what a waiting worker does):

* ``backup``: backup workers with ``b = 0`` (every round closes when every worker's ``Ready``
  came, and its closing goes to every worker);
* ``psp``: PSP with ``c = N - 1`` and no timeout, the last rank a straggler that sends its
  notice once the round closed (every round closes at the other ``N - 1`` notices, its closing
  goes to every worker, the straggler's notice comes late and is dropped; the latency counts
  from the last of the ``N - 1``);
* ``dssp``: DSSP's controller: a ``pushed`` notice per worker per step, a ``grant`` question
  every 4th.

``--simulate links`` leaves the workers and relays out and sends rank 0 only what its links
would carry (:mod:`tfsync.bench._control_links`: a group relay's link, every ready notice of its
ranks in one message a round, their clocks every 0.25 s): one process of a few coroutines, so
rank 0, not a thousand simulated workers on two cores, sets the pace, and its CPU per round is
the cost of a round rather than of a slow simulation's seconds (``backup`` and ``psp``).

One record per N, in a JSON list: ``workers``, ``policy``, ``rounds_per_s`` (rounds completed
per second after ``--warmup`` rounds; dssp: steps per worker per second), ``latency_p50_ms``
and ``latency_p99_ms`` (from a round's last ``Ready`` to every worker having its closing;
dssp: a grant question's round trip), ``reports_per_s`` (clock reports rank 0 served per
second) and ``reports_offered_per_s``, ``rank0_cpu_ms_per_round``, ``rank0_cpu_percent``,
``rank0_messages_in_per_round`` and ``rank0_messages_out_per_round`` (what its links carried),
``rank0_threads`` (the most rank 0's process held), ``rank0_rss_mb``, ``clients_cpu_percent``
(the simulated hosts' CPU, of one core: on a small machine they compete with rank 0), and what
the service served.  The machine is shared: one run is one sample.

Example:

    python -m tfsync.bench control --workers 8 32 128 256 512 1024 --policy backup --json control.json
"""

import argparse
import json
import math
import os
import secrets
import select
import subprocess
import sys
import tempfile
import time

import numpy as np

from tfsync.launch import integer, number

# the modes whose control path is on the step's path, each with the settings the benchmark runs it
# with on ``size`` workers (module docstring), built through the registry
SETTINGS = {
    "backup": lambda size: {"backups": 0},
    "psp": lambda size: {"min_contributions": max(1, size - 1), "push_timeout_s": 0.0},
    "dssp": lambda size: {},
}
POLICIES = tuple(SETTINGS)
START_TIMEOUT_S = 60.0  # rank 0's service prints its address within this
LAUNCH_MARGIN_S = 600.0  # the hosts' whole run is bounded by this plus a second a round
ATTACH_TIMEOUT_S = 600.0  # every simulated host has attached its workers within this (a thousand on 2 cores)


def policy_for(name, size):
    """The policy the benchmark runs as ``name`` on ``size`` workers (module docstring)."""
    from tfsync.policies import registry

    if name not in SETTINGS:
        raise ValueError(f"--policy {name!r}: expected one of {', '.join(POLICIES)}")
    return registry.get(name).build(**SETTINGS[name](size))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.bench control", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=integer(2), nargs="+", required=True, help="simulated workers, one record each")
    p.add_argument("--policy", choices=POLICIES, required=True)
    p.add_argument("--reports-hz", type=number(0.0), default=4.0, help="clock reports per worker per second (0: none)")
    p.add_argument("--rounds", type=integer(2), default=None, help="rounds per run (default: by N, about 20 s)")
    p.add_argument("--warmup", type=integer(1), default=5, help="rounds left out of the figures")
    p.add_argument("--ranks-per-host", type=integer(1), default=8, help="simulated workers per host process")
    p.add_argument("--relays", choices=("auto", "hosts", "off"), default="auto", help="as TFSYNC_CONTROL_RELAYS")
    p.add_argument(
        "--simulate",
        choices=("hosts", "links"),
        default="hosts",
        help="hosts: every worker and relay (a process per host); links: only what rank 0's links send it",
    )
    p.add_argument("--json", required=True, help="write the records here")
    p.add_argument("--plot", metavar="PNG", help="also plot rank 0's CPU per round and the rounds per second here")
    args = p.parse_args(argv)
    if args.simulate == "links" and args.policy == "dssp":
        p.error("--simulate links runs the rounds of backup and psp; run dssp with --simulate hosts")
    if args.rounds is not None and args.rounds <= args.warmup:
        p.error(f"--rounds {args.rounds} must exceed --warmup {args.warmup}: the figures need measured rounds")
    return args


def default_rounds(workers, simulate="hosts"):
    """Rounds enough for a figure and few enough for a slow service: about 20 s at the rate this
    machine simulates hosts at, some seconds at the rate rank 0 closes rounds for links."""
    if simulate == "links":
        return max(200, min(4000, int(400000 / workers)))
    return max(20, min(400, int(4000 / workers)))


def run_one(workers, args, log):
    """One N: start rank 0, the hosts, wait for them, stop rank 0; the record."""
    rounds = args.rounds or default_rounds(workers, args.simulate)
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="tfsync-control-") as tmp:
        stats_path = os.path.join(tmp, "rank0.json")
        rank0 = subprocess.Popen(
            [sys.executable, "-m", "tfsync.bench._control_rank0", args.policy, str(workers), token, stats_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            address = _address_of(rank0)
            start = _start_links if args.simulate == "links" else _start_hosts
            hosts = start(address, token, workers, rounds, args, tmp)
            _start_rounds(hosts)
            deadline = time.monotonic() + LAUNCH_MARGIN_S + rounds
            _expect(hosts, "DONE", deadline, "finish its rounds")  # (then they stop their relays)
            for proc, _ in hosts:
                proc.stdin.write("exit\n")
                proc.stdin.flush()
            for proc, _ in hosts:
                proc.wait(max(1.0, deadline - time.monotonic()))
            rank0.stdin.write("stop\n")
            rank0.stdin.flush()
            rank0.wait(30)
        finally:
            for proc in [rank0, *(p for p, _ in locals().get("hosts", []))]:
                if proc.poll() is None:
                    proc.kill()
        outputs = []
        for proc, path in hosts:
            if not os.path.exists(path):
                raise RuntimeError(f"a simulated host exited with {proc.returncode} and wrote no results ({path})")
            with open(path) as f:
                outputs.append(json.load(f))
        errors = [e for out in outputs for e in out["errors"]]
        if errors:
            raise RuntimeError(f"{len(errors)} simulated workers failed, e.g. {errors[:3]}")
        with open(stats_path) as f:
            stats = json.load(f)
    record = summarize(workers, rounds, args, outputs, stats)
    log(
        f"{workers:>6} workers {args.policy:7s} {record['rounds_per_s']:8.1f} rounds/s  latency p50/p99 "
        f"{record['latency_p50_ms']:7.1f} / {record['latency_p99_ms']:7.1f} ms  rank 0: "
        f"{record['rank0_cpu_ms_per_round']:8.2f} ms CPU a round, {record['rank0_threads']} threads, "
        f"{record['rank0_rss_mb']:.0f} MB; reports {record['reports_per_s']:.0f}/s of "
        f"{record['reports_offered_per_s']:.0f}"
    )
    return record


def _address_of(rank0):
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = rank0.stdout.readline()
        if line.startswith("ADDRESS "):
            return line.split(None, 1)[1].strip()
        if not line and rank0.poll() is not None:
            break
    raise RuntimeError(f"rank 0's control service did not start within {START_TIMEOUT_S:.0f} s")


def _start_hosts(address, token, workers, rounds, args, tmp):
    """Start the simulated hosts, relayed as a job's would be (:func:`tfsync.control.topology.relays`):
    a group's first host before the others, which attach to its group relay."""
    from tfsync.control import topology

    per_host = args.ranks_per_host
    firsts = list(range(0, workers, per_host))
    names = [f"host{first // per_host}" for first in range(workers)]
    leaders, groups = topology.relays(names, args.relays)
    heads = {first: None for first in firsts if groups.get(first) == first}  # first rank -> its group relay

    def start(h, first, relay):
        count = min(per_host, workers - first)
        path = os.path.join(tmp, f"host{h}.json")
        argv = [address, token, args.policy, workers, first, count, rounds, args.reports_hz, relay, path]
        cmd = [sys.executable, "-m", "tfsync.bench._control_host", *map(str, argv)]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True), path

    hosts = {}
    for h, first in enumerate(firsts):
        if first in heads:
            hosts[h] = start(h, first, "group")
            heads[first] = _group_address_of(hosts[h][0])
    for h, first in enumerate(firsts):
        if h in hosts:
            continue
        if first in groups:
            relay = f"via:{heads[groups[first]]}"
        else:
            # (a relay where a rank of the host has one; on host 0, rank 0 attaches directly)
            relay = int(any(rank in leaders for rank in range(first, min(first + per_host, workers))))
        hosts[h] = start(h, first, relay)
    return [hosts[h] for h in range(len(firsts))]


def rank0_links(workers, per_host, relays):
    """The ranks each of rank 0's links carries in a job of ``workers`` on hosts of ``per_host``
    relayed as ``relays`` (``TFSYNC_CONTROL_RELAYS``) says: a worker's own link, a host relay's
    or a group relay's."""
    from tfsync.control import topology

    names = [f"host{rank // per_host}" for rank in range(workers)]
    leaders, groups = topology.relays(names, relays)
    links = {}
    for rank in range(workers):
        lead = leaders.get(rank)
        links.setdefault(("rank", rank) if lead is None else ("relay", groups.get(lead, lead)), []).append(rank)
    return list(links.values())


def _start_links(address, token, workers, rounds, args, tmp):
    """``--simulate links``: one process sends what rank 0's links would (:mod:`_control_links`)."""
    path = os.path.join(tmp, "links.json")
    spec = json.dumps(rank0_links(workers, args.ranks_per_host, args.relays))
    cmd = [sys.executable, "-m", "tfsync.bench._control_links", address, token, args.policy, str(rounds)]
    cmd += [str(args.reports_hz), spec, path]
    return [(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True), path)]


def _group_address_of(proc):
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("GROUP "):
        raise RuntimeError(
            f"a simulated host did not start its group relay within {START_TIMEOUT_S:.0f} s "
            f"(exit status {proc.poll()}, said {line!r})"
        )
    return line.split(None, 1)[1].strip()


def _start_rounds(hosts):
    """Wait until every host has attached its workers, then let them all start (the rounds measure
    the service, not a thousand workers' start-up on a small machine)."""
    _expect(hosts, "ATTACHED", time.monotonic() + ATTACH_TIMEOUT_S, "attach its workers")
    for proc, _ in hosts:
        proc.stdin.write("go\n")
        proc.stdin.flush()


def _expect(hosts, word, deadline, what):
    """Every host says ``word`` by ``deadline`` (monotonic), or the run fails saying which did not."""
    for proc, _ in hosts:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if line.strip() != word:
            raise RuntimeError(f"a simulated host did not {what} in time (exit status {proc.poll()}, said {line!r})")


def summarize(workers, rounds, args, outputs, stats):
    """The record of one N from the hosts' outputs and rank 0's samples."""
    warm = args.warmup
    known = np.array([rec["known"] for out in outputs for rec in out["records"].values()])  # [worker, round]
    start_s, end_s = float(known[:, warm - 1].max()), float(known[:, -1].max())
    window_s = max(end_s - start_s, 1e-9)
    if args.policy == "dssp":
        steps = sum(int(((k > start_s) & (k <= end_s)).sum()) for k in known)
        rounds_per_s = steps / workers / window_s
        latencies = [
            s for out in outputs for rec in out["records"].values() for step, s in rec["asks_s"] if step >= warm
        ]
        measured_rounds = rounds_per_s * window_s
    else:
        sent = np.array([rec["sent"] for out in outputs for rec in out["records"].values()])
        ranks = [int(rank) for out in outputs for rank in out["records"]]
        counted = [i for i, rank in enumerate(ranks) if not (args.policy == "psp" and rank == workers - 1)]
        latencies = list(known[:, warm:].max(axis=0) - sent[counted, warm:].max(axis=0))
        measured_rounds = rounds - warm
        rounds_per_s = measured_rounds / window_s
    samples = np.array(stats["samples"])  # (time, cpu_s, threads, rss, reports, messages in, out so far)
    inside = samples[(samples[:, 0] >= start_s) & (samples[:, 0] <= end_s)]
    cpu_s = _at(samples, end_s) - _at(samples, start_s)
    reports = _at(samples, end_s, column=4) - _at(samples, start_s, column=4)
    clients_cpu_s = sum(_at(np.array(out["cpu_at"]), end_s) - _at(np.array(out["cpu_at"]), start_s) for out in outputs)
    served = stats["served"]
    return {
        "workers": workers,
        "policy": args.policy,
        "rounds": rounds,
        "warmup": warm,
        "rounds_per_s": rounds_per_s,
        "latency_p50_ms": 1e3 * float(np.percentile(latencies, 50)),
        "latency_p99_ms": 1e3 * float(np.percentile(latencies, 99)),
        "reports_per_s": reports / window_s,
        "reports_offered_per_s": args.reports_hz * workers,
        "rank0_cpu_ms_per_round": 1e3 * cpu_s / max(measured_rounds, 1e-9),
        "rank0_cpu_percent": 100.0 * cpu_s / window_s,
        "rank0_messages_in_per_round": (_at(samples, end_s, 5) - _at(samples, start_s, 5)) / max(measured_rounds, 1e-9),
        "rank0_messages_out_per_round": (_at(samples, end_s, 6) - _at(samples, start_s, 6))
        / max(measured_rounds, 1e-9),
        "rank0_threads": int(samples[:, 2].max()),
        "rank0_rss_mb": float((inside if len(inside) else samples)[:, 3].max()) / 2**20,
        "clients_cpu_percent": 100.0 * clients_cpu_s / window_s,
        "hosts": math.ceil(workers / args.ranks_per_host),
        "ranks_per_host": args.ranks_per_host,
        "relays": args.relays,
        "simulate": args.simulate,
        "rank0_links": len(rank0_links(workers, args.ranks_per_host, args.relays)),
        "reports_hz": args.reports_hz,
        "window_s": window_s,
        "served": served,
    }


def _at(samples, t, column=1):
    """A cumulative figure of ``samples`` (rows ``(time, cpu_s, ...)``; ``column``: which) at time
    ``t``, interpolated."""
    return float(np.interp(t, samples[:, 0], samples[:, column]))


def format_table(records):
    head = (
        "| workers | policy | rounds/s | latency p50 / p99 ms | rank 0 CPU ms/round | rank 0 CPU % | threads "
        "| RSS MB | reports/s (of) |"
    )
    rows = [head, "|" + "---|" * 9]
    for r in records:
        rows.append(
            f"| {r['workers']} | {r['policy']} | {r['rounds_per_s']:.1f} | {r['latency_p50_ms']:.1f} / "
            f"{r['latency_p99_ms']:.1f} | {r['rank0_cpu_ms_per_round']:.2f} | {r['rank0_cpu_percent']:.0f} | "
            f"{r['rank0_threads']} | {r['rank0_rss_mb']:.0f} | {r['reports_per_s']:.0f} "
            f"({r['reports_offered_per_s']:.0f}) |"
        )
    return "\n".join(rows)


def plot(runs, path):
    """Rank 0's CPU per round and the rounds per second against the number of workers, log-log,
    a line per run (``runs``: label -> records, as :func:`main` writes them), to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cpu, rate) = plt.subplots(1, 2, figsize=(10, 4))
    for label, records in runs.items():
        workers = [r["workers"] for r in records]
        cpu.plot(workers, [r["rank0_cpu_ms_per_round"] for r in records], "o-", label=label)
        rate.plot(workers, [r["rounds_per_s"] for r in records], "o-", label=label)
    for axis, title in ((cpu, "rank 0's CPU per round (ms)"), (rate, "rounds per second")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("workers")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    cpu.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    records = []
    for workers in args.workers:
        records.append(run_one(workers, args, lambda line: print(line, flush=True)))
        with open(args.json, "w") as f:  # (after every N: a long sweep keeps what it measured)
            json.dump(records, f, indent=1)
    print(format_table(records))
    if args.plot:
        plot({f"{args.policy}, relays {args.relays}": records}, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
