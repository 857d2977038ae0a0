"""A chaos soak: elastic training across two simulated hosts through a fault every 10-20 s.

``python -m tfsync.bench chaos [--modes ...] [--minutes M] [--fault-every S] [--seed K] --json FILE``

Two simulated hosts (:mod:`tfsync.bench.hosts`) with two workers each run the digits MLP
(:mod:`tfsync.bench._elastic_worker`: ``tfsync.elastic``, commits every ``--commit-every``
steps, one ``fit`` per epoch resumed at the committed sample, each step's device time simulated
by a sleep) under ``horovodrun``'s elastic launcher (``--min-np 2 --max-np 4``, a discovery
script printing a hosts file, ``--blacklist-cooldown-range 1 3`` so that a failed host comes
back), the state committed to storage too (``TFSYNC_COMMIT_DIR``: the run's directory).  For each mode:

1. an undisturbed run (``--undisturbed-minutes``): its rate of useful samples and its accuracy;
2. the soak: ``--minutes`` of training through a :class:`tfsync.faults.Schedule` drawn from
   ``--seed``: a fault every ``--fault-every`` S seconds on average (uniform over 2S/3 to 4S/3:
   10-20 s at the default 15), the kinds in shuffled turns (``--kinds``; default the seven of
   :data:`SOAK_KINDS`: SIGKILL, SIGSTOP for good (a hung worker, ended by its hang guard), an
   exception raised in the training step, a NaN loss, a link cut for 3-8 s, a link flapping
   every second for 4-8 s, a host dropped by discovery for 15-25 s; ``--kinds hang`` adds or
   soaks a step's thread blocked for good, a deadlock), on a random rank or host.  The workers inject
   theirs (:class:`tfsync.faults.Injector`); the harness the hosts' (:class:`tfsync.faults.HostFaults`).

Each mode's record: ``mode``, ``faults_injected``, ``faults_survived`` (the job applied a step
after the fault and finished), ``faults_survived_by_kind``, ``resets``, ``steps_redone``,
``samples_redone`` (the job's, over every worker), ``goodput`` (useful samples per second of
the soak over the undisturbed run's; useful: the epochs finished times the epoch's samples),
``final_accuracy``, ``undisturbed_accuracy`` and ``accounting_ok`` (produced = applied +
compensated + dropped + rejected + lost, for every worker's counts and the job's, after every
reset and at the end); and what the rest of the time went to: ``to_next_step_s`` per kind
(from the fault to the next step of the workers it did not take, past the stall it caused if
it caused one: one that began before the next fault), ``to_reformed_step_s`` per kind (from
the fault to their first step in a job re-formed after it, the survivors' own recovery,
:func:`to_reformed_step`), ``stalled_s`` (no step anywhere for a second or more) and
``stalled_s_by_kind`` (those seconds by the kind of the last fault injected before each stall
ended: its own stall and its consequences, a replacement's join or a host's return),
``reduced_s`` (fewer than four workers), the guard's ends of hung workers, the schedule;
``goodput_ceiling`` and ``ceiling_taken_s_by_kind``: the goodput the schedule's faults leave
if nothing but the faults themselves took time (a removed host's workers gone, a cut link's
rounds stopped, a stopped worker told from a flap; :func:`goodput_ceiling`), so that the
distance to it is the implementation's; ``goodput_lost_s``: the goodput lost, in seconds, split
into stalls, steps with fewer workers (each by fault kind), slower steps with all of them, and
steps redone (:func:`goodput_lost`).
``--work-dir`` keeps every run's files (logs, step records, the fault ledger); ``--reanalyze
WORK_DIR`` rebuilds the records from them (same options) without running; ``--plot`` draws each
mode's rate, size and faults over the soak.  One run on a shared machine is one sample; never
run it beside other work.

Example:

    python -m tfsync.bench chaos --modes bsp backup diloco --minutes 20 --json chaos.json
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from tfsync.bench._chaos_figures import (
    BATCH,
    FULL,
    PER_HOST,
    fault_outcomes,
    goodput_ceiling,
    goodput_lost,
    stalled_by_kind,
    timeline,
)
from tfsync.bench._stacks import dump_stacks
from tfsync.bench.elastic import adds_up, jsonl_records, read_results, summary
from tfsync.faults import KINDS, HostFaults, Ledger, Schedule
from tfsync.launch import REPO_ROOT, integer, number

WORKER = os.path.join(REPO_ROOT, "tfsync", "bench", "_elastic_worker.py")
MODES = ("bsp", "backup", "diloco")
TRAIN_SAMPLES = 1437  # the digits training split (_elastic_worker)
STARTUP_S = 45.0  # from the launch to the first fault: four TensorFlow start-ups on two cores
COOLDOWN_S = (1, 3)  # horovodrun --blacklist-cooldown-range: a failed host is back after 1-3 s
# Gloo's bound (Horovod's default): a joining worker's start-up (ssh, TensorFlow's import), which
# the others wait for in the rendezvous, should fit, or the rendezvous fails and every member
# tries its re-form again (Horovod as released aborts them all instead); a reset ends the waits
# on live peers it bounds (the patched Horovod's interrupt)
GLOO_TIMEOUT_S = 30
# the soak's kinds by default: every kind but "hang" (a deadlock: --kinds adds it), in KINDS' order,
# so a seed draws the schedule it drew before "hang" was a kind
SOAK_KINDS = tuple(k for k in KINDS if k != "hang")
STALL_LIMIT_S = 150.0  # no step anywhere for this long: the job is lost (ended, recorded as such)
LOOP_EPOCHS = 100000  # the run stops at the first epoch end after its deadline, long before


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.bench chaos", description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="modes to soak (default: all)")
    p.add_argument("--minutes", type=number(above=0), default=20.0, help="the soak's length per mode")
    p.add_argument("--fault-every", type=number(above=0), default=15.0, help="mean seconds between faults")
    p.add_argument("--seed", type=integer(0), default=0, help="the schedule's seed")
    p.add_argument("--json", required=True, help="write the records (a JSON list, one per mode) here")
    kinds = f"fault kinds (default: {' '.join(SOAK_KINDS)})"
    p.add_argument("--kinds", nargs="+", default=list(SOAK_KINDS), choices=KINDS, help=kinds)
    p.add_argument("--undisturbed-minutes", type=number(above=0), default=None, help="default: min(minutes, 4)")
    p.add_argument("--commit-every", type=integer(1), default=10, help="steps between commits")
    p.add_argument("--wait-timeout-s", type=number(above=0), default=10.0, help="the workers' wait bound")
    p.add_argument("--step-delay-s", type=number(minimum=0), default=0.05, help="simulated device time a step")
    p.add_argument("--work-dir", default=None, help="keep every run's files here (default: a temporary directory)")
    p.add_argument("--reanalyze", metavar="WORK_DIR", help="run nothing: the records from a kept --work-dir's files")
    p.add_argument("--plot", metavar="PNG", help="also plot each mode's rate, size and faults over the soak here")
    p.add_argument("--repeat", type=integer(1), default=4, help="the digits training split this many times an epoch")
    args = p.parse_args(argv)
    if args.undisturbed_minutes is None:
        args.undisturbed_minutes = min(args.minutes, 4.0)
    return args


class SimulatedHosts:
    """What :class:`tfsync.faults.HostFaults` acts on: the simulated hosts' links, and the hosts
    file the launcher's discovery script prints, which lists each worker of a host under a name
    of its own (the host's address and its alias): Horovod's launcher blacklists the name of a
    worker that fails, and would otherwise take out the whole host, and end the job when every
    host that had workers is out at once (with two hosts, the second fault on the other host
    while the first is still cooling down)."""

    def __init__(self, hosts, hosts_file):
        self.hosts, self.hosts_file = hosts, hosts_file
        self.listed = set(range(1, hosts.n + 1))
        self.write()

    def write(self):
        names = [(self.hosts.address(i), self.hosts.alias(i))[:PER_HOST] for i in sorted(self.listed)]
        lines = "".join(f"{name}:1\n" for pair in names for name in pair)
        with open(self.hosts_file + ".tmp", "w") as f:
            f.write(lines)
        os.replace(self.hosts_file + ".tmp", self.hosts_file)

    def set_link(self, host, up):
        self.hosts.set_link(host, up)

    def list_host(self, host, listed):
        (self.listed.add if listed else self.listed.discard)(host)
        self.write()


def _launch(args, hosts, out, mode, minutes, schedule=None):
    """One elastic job of ``mode`` for ``minutes`` of training (and ``schedule``'s faults);
    returns ``(exit_code, output_path, wall_s)``."""
    os.makedirs(out)
    hosts_file = os.path.join(out, "hosts")
    actuator = SimulatedHosts(hosts, hosts_file)
    discovery = os.path.join(out, "discover_hosts.sh")
    with open(discovery, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(discovery, 0o755)
    launch_t = time.time()
    deadline = launch_t + STARTUP_S + 60 * minutes
    argv = [WORKER, out, mode, -1, "", 0, LOOP_EPOCHS, hosts_file, ""]
    argv += ["--commit-every", args.commit_every, "--wait-timeout-s", args.wait_timeout_s]
    argv += ["--repeat", args.repeat, "--step-log", "--deadline-t", deadline]
    if schedule is not None:
        schedule.start_t = launch_t + STARTUP_S
        path = os.path.join(out, "faults.json")
        with open(path, "w") as f:
            f.write(schedule.to_json())
        argv += ["--faults", path]
    elastic = ["--min-np", PER_HOST, "--max-np", FULL, "--host-discovery-script", discovery]
    elastic += ["--blacklist-cooldown-range", *COOLDOWN_S]
    elastic += ["--log-level", "INFO"]  # (the launcher's decisions in the log: who recorded, who is out)
    # (a worker its hang guard ends leaves its stacks in the log: where it hung)
    env = {"TFSYNC_STRAGGLERS": f"base={args.step_delay_s}", "TFSYNC_HANG_STACKS": "1"}
    # (commits on storage, the simulated hosts' shared disk: a job whose live workers were all on
    # hosts that discovery removed restarts from there instead of stopping)
    env["TFSYNC_COMMIT_DIR"] = os.path.join(out, "commits")
    cmd = hosts.horovodrun(PER_HOST, argv, env=env, gloo_timeout_s=GLOO_TIMEOUT_S, elastic=elastic)
    output = os.path.join(out, "output.log")
    bound_s = STARTUP_S + 60 * minutes + 600  # the last epoch, a re-forming job's, and the ends
    hosts.kill_all()
    with open(output, "w") as log:
        process = hosts.popen(1, cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            if schedule is not None:
                with HostFaults(schedule, actuator, ledger_dir=os.path.join(out, "faults")) as injector:
                    code = _wait(process, bound_s, out)
                if injector.error is not None:
                    raise RuntimeError(f"the host faults failed: {injector.error!r}")
            else:
                code = _wait(process, bound_s, out)
        finally:
            for i in range(1, hosts.n + 1):
                hosts.set_link(i, True)
            hosts.kill_all()
    return code, output, time.time() - launch_t


def _wait(process, bound_s, out):
    """The launch's exit code; past ``bound_s``, or once the job took no step for
    :data:`STALL_LIMIT_S` after its first, the launch is ended (124) and ``out/stalled.json`` says
    since when (a job lost to its faults: no worker left to go on, the launcher waiting)."""
    from tfsync.bench.hosts import kill

    deadline = time.time() + bound_s
    while time.time() < deadline:
        try:
            return process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        last = last_step_t(out)
        if last is not None and time.time() - last > STALL_LIMIT_S:
            with open(os.path.join(out, "stalled.json"), "w") as f:
                json.dump({"last_step_t": last, "limit_s": STALL_LIMIT_S}, f)
            dump_stacks(process.pid, os.path.join(out, "stalled_stacks.txt"), match=WORKER)
            break
    kill(process)
    return 124


def last_step_t(out):
    """When the job in ``out`` last took a step: the latest ``t`` of the workers' step files (the
    last record of each), None before the first.  Read from the records, not the files' times:
    a process that starts (a joiner) creates its file before it takes a step."""
    last = None
    for path in glob.glob(os.path.join(out, "every_step_*.jsonl")):
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            for line in reversed(f.read().splitlines()):
                try:
                    t = float(json.loads(line)["t"])
                except (ValueError, KeyError, TypeError):
                    continue  # (a line cut by the 4 KB window, or one being written)
                last = t if last is None else max(last, t)
                break
    return last


def _steps(out):
    return jsonl_records(out, "every_step_*.jsonl", "t")


def job_record(out, code, steps):
    """What one run's files say: every finisher's result, rank 0's, the first step's and the end's
    times, and the epochs the job finished."""
    results = read_results(out)
    if code != 0 or 0 not in results:
        with open(os.path.join(out, "output.log"), errors="replace") as f:
            tail = f.read()[-6000:]
        raise RuntimeError(f"the job in {out} failed (exit {code}, results of ranks {sorted(results)}):\n{tail}")
    lead = results[0]
    start = steps[0]["t"] if steps else None
    end = max(r["end_t"] for r in results.values())
    return results, lead, start, end, lead["state_epoch"]


def mode_run(args, hosts, mode, work, log):
    """One mode: the undisturbed run, the soak, and their record (:func:`analyze`)."""
    calm_out, soak_out = os.path.join(work, f"{mode}-calm"), os.path.join(work, f"{mode}-soak")
    log(f"{mode}: undisturbed run, {args.undisturbed_minutes:g} min")
    code, _, _ = _launch(args, hosts, calm_out, mode, args.undisturbed_minutes)
    job_record(calm_out, code, _steps(calm_out))  # (it failed: say so before the soak)
    low, high = 2 * args.fault_every / 3, 4 * args.fault_every / 3
    schedule = Schedule.random(
        args.seed, args.minutes - high / 60, every_s=(low, high), kinds=args.kinds, ranks=FULL, hosts=(1, 2)
    )
    log(f"{mode}: soak, {args.minutes:g} min, {len(schedule.faults)} faults scheduled")
    code, _, soak_wall = _launch(args, hosts, soak_out, mode, args.minutes, schedule)
    with open(os.path.join(soak_out, "exit.json"), "w") as f:
        json.dump({"code": code, "launch_s": soak_wall}, f)
    record = analyze(args, mode, work)
    if record["job_lost"] is not None:
        log(f"{mode}: the job was LOST ({record['job_lost']['why']}) after {record['faults_survived']} faults survived")
        return record
    ceiling = record["goodput_ceiling"]
    log(
        f"{mode}: {record['faults_survived']}/{record['faults_injected']} faults survived, {record['resets']} resets, "
        f"goodput {record['goodput']:.2f}"
        + (f" (the faults alone leave {ceiling:.2f})" if ceiling is not None else "")
        + f", accuracy {record['final_accuracy']:.4f} (undisturbed "
        f"{record['undisturbed_accuracy']:.4f}), accounting {'ok' if record['accounting_ok'] else 'BROKEN'}"
    )
    return record


def analyze(args, mode, work):
    """``mode``'s record from the files its two runs left under ``work`` (see the module docstring)."""
    calm_out, soak_out = os.path.join(work, f"{mode}-calm"), os.path.join(work, f"{mode}-soak")
    calm_steps = _steps(calm_out)
    _, calm, calm_start, calm_end, calm_epochs = job_record(calm_out, 0, calm_steps)
    calm_rate = calm_epochs * TRAIN_SAMPLES * args.repeat / (calm_end - calm_start)
    with open(os.path.join(soak_out, "faults.json")) as f:
        schedule = Schedule.from_json(f.read())
    exit_path = os.path.join(soak_out, "exit.json")
    launched = json.load(open(exit_path)) if os.path.exists(exit_path) else {"code": 0, "launch_s": None}
    steps = _steps(soak_out)
    try:
        results, lead, start, end, epochs = job_record(soak_out, launched["code"], steps)
        lost, rate = None, epochs * TRAIN_SAMPLES * args.repeat / (end - start)
    except RuntimeError as exc:  # the job was lost to its faults: what it survived until then
        results, lead, epochs, rate = {}, None, None, None
        stalled = os.path.join(soak_out, "stalled.json")
        why = f"no step for {STALL_LIMIT_S:.0f} s" if os.path.exists(stalled) else f"exit {launched['code']}"
        lost = {"why": why, "last_step_s": steps[-1]["t"] - schedule.start_t if steps else None}
        lost["output_tail"] = str(exc)[-4000:]
        start, end = (steps[0]["t"], steps[-1]["t"]) if steps else (None, None)
    faults = Ledger(os.path.join(soak_out, "faults")).records()
    hang_timeout_s = args.wait_timeout_s + 2.0
    injected, survived, next_step, reformed = fault_outcomes(steps, faults, schedule, hang_timeout_s + 5, lost)
    pairs = [(b["t"] - a["t"], a["n"]) for a, b in zip(steps, steps[1:], strict=False)]
    kinds_at = [(r["t"], schedule.faults[i].kind) for i, r in faults.items()]
    stalls = stalled_by_kind(steps, kinds_at)
    rows = timeline(steps, schedule.start_t)
    job = lead["state_counts"] if lead else None
    ceiling, taken, lost_by = None, None, None
    if steps and lost is None:
        injected_at_s = [(r["t"] - schedule.start_t, schedule.faults[i]) for i, r in faults.items()]
        ceiling, taken = goodput_ceiling(injected_at_s, end - start, rows, calm_rate, args.wait_timeout_s)
        lost_s = (end - start) * (1 - rate / calm_rate)
        lost_by = goodput_lost(steps, kinds_at, lost_s, calm_rate, job["samples_redone"])
    checks = [c for r in results.values() for pair in r["counts_after_resets"] for c in pair]
    checks += [c for r in results.values() for c in (r["counts"], r["state_counts"])]
    with open(os.path.join(soak_out, "output.log"), errors="replace") as f:
        text = f.read()
    return {
        "mode": mode,
        "minutes": args.minutes,
        "fault_every_s": args.fault_every,
        "seed": args.seed,
        "faults_scheduled": len(schedule.faults),  # (one due after the job's last step is never injected)
        "faults_injected": sum(injected.values()),
        "faults_survived": sum(survived.values()),
        "faults_survived_by_kind": dict(sorted(survived.items())),
        "faults_injected_by_kind": dict(sorted(injected.items())),
        "job_lost": lost,
        "resets": max((r["resets"] for r in results.values()), default=None),
        "steps_redone": job and job["steps_redone"],
        "samples_redone": job and job["samples_redone"],
        "goodput": rate and rate / calm_rate,
        "goodput_ceiling": ceiling,
        "ceiling_taken_s_by_kind": taken,
        "final_accuracy": lead and lead["accuracy"],
        "undisturbed_accuracy": calm["accuracy"],
        "accounting_ok": bool(checks) and all(adds_up(c) for c in checks),
        "accounting_checks": len(checks),
        "to_next_step_s": {k: summary(v) for k, v in sorted(next_step.items())},
        "to_reformed_step_s": {k: summary(v) for k, v in sorted(reformed.items()) if any(x is not None for x in v)},
        "goodput_lost_s": lost_by,
        "useful_samples_per_s": rate,
        "undisturbed_useful_samples_per_s": calm_rate,
        "epochs": epochs,
        "undisturbed_epochs": calm_epochs,
        "soak_s": end - start if steps else None,
        "launch_s": launched["launch_s"],
        "stalled_s": sum(stalls.values()),
        "stalled_s_by_kind": stalls,
        "reduced_s": sum(gap for gap, size in pairs if size < FULL),
        "samples_trained": BATCH * len(steps),  # (every worker's steps, redone ones included)
        "hung_workers_ended": text.count("hang guard: ended"),
        "job_counts": job,
        "finishers": len(results),
        "commit_every_steps": args.commit_every,
        "wait_timeout_s": args.wait_timeout_s,
        "hang_timeout_s": hang_timeout_s,
        "step_delay_s": args.step_delay_s,
        "schedule": json.loads(schedule.to_json()),
        "faults": {str(k): v for k, v in sorted(faults.items())},
        "timeline": rows,
        "undisturbed_timeline": timeline(calm_steps, calm_start),
    }


def plot(records, path):
    """Per mode, the job's useful rate over the soak (samples per second in bins) against the
    undisturbed run's, the workers in the job, and each fault, marked by kind; to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "failed" not in r and r["timeline"]]
    fig, axes = plt.subplots(len(records), 1, figsize=(12, 3.2 * len(records)), squeeze=False)
    colors = dict(zip(KINDS, plt.get_cmap("tab10").colors, strict=False))
    for axis, r in zip(axes[:, 0], records, strict=True):
        t = [row[0] / 60 for row in r["timeline"]]
        axis.plot(t, [row[1] for row in r["timeline"]], lw=0.8, color="black", label="samples trained/s")
        axis.axhline(r["undisturbed_useful_samples_per_s"], ls="--", color="grey", lw=0.8, label="undisturbed")
        size = axis.twinx()
        size.step(t, [row[2] for row in r["timeline"]], where="post", color="tab:blue", alpha=0.4, lw=0.8)
        size.set_ylim(0, FULL + 0.5)
        size.set_ylabel("workers")
        seen = set()
        for index, fault in r["faults"].items():
            kind = r["schedule"]["faults"][int(index)]["kind"]
            at = (fault["t"] - r["schedule"]["start_t"]) / 60
            axis.axvline(at, color=colors[kind], lw=1.2, alpha=0.8, label=None if kind in seen else kind)
            seen.add(kind)
        outcome = (
            f"goodput {r['goodput']:.2f}, accuracy {r['final_accuracy']:.3f} "
            f"(undisturbed {r['undisturbed_accuracy']:.3f})"
            if r["job_lost"] is None
            else f"the job was LOST ({r['job_lost']['why']})"
        )
        axis.set_title(
            f"{r['mode']}: {r['faults_survived']}/{r['faults_injected']} faults survived, {outcome}", fontsize=9
        )
        axis.set_xlabel("minutes since the first fault could come")
        axis.set_ylabel("samples/s")
        axis.legend(fontsize=7, ncol=5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args, hosts, log=print):
    """Every mode of ``args`` on ``hosts`` (a :class:`tfsync.bench.hosts.Hosts` of two); the
    records, written to ``args.json`` after each mode (a long soak keeps what it measured)."""
    records = []
    with tempfile.TemporaryDirectory(prefix="tfsync-chaos-") as temporary:
        work = args.work_dir or temporary
        for mode in args.modes:
            try:
                records.append(mode_run(args, hosts, mode, work, log))
            except RuntimeError as exc:
                records.append({"mode": mode, "failed": str(exc)[-6000:]})
                log(f"{mode}: FAILED\n{str(exc)[-3000:]}")
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    return records


def main(argv=None):
    args = parse_args(argv)
    if args.reanalyze:
        records = [analyze(args, mode, args.reanalyze) for mode in args.modes]
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    else:
        from tfsync.bench.hosts import Hosts

        with Hosts(2) as hosts:
            records = run(args, hosts, log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.plot:
        plot(records, args.plot)
    return 1 if any("failed" in r or r.get("job_lost") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
