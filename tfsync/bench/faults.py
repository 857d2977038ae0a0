"""Every fault, every time: a short two-host job, run N times with one fault at a random step.

``python -m tfsync.bench faults --scenario kill|cut|stop|raise --frontend callback|strategy
--mode M --repeat N --json FILE [--seed K] [--epochs E] [--wait-timeout-s S] [--elastic |
--no-elastic] [--work-dir DIR]``

Two simulated hosts (:mod:`tfsync.bench.hosts`), two workers each, run the digits example
(``keras_examples/digits.py``'s data and model, through :mod:`tfsync.bench._fault_worker`: the
Keras callback, elastic as the example's ``--elastic`` runs it, or ``SyncStrategy`` as
``keras_examples/digits_strategy.py`` runs it) in mode ``M`` with a wait bound of ``S`` seconds
(``TFSYNC_WAIT_TIMEOUT_S``, default 8), ``--repeat`` times.  Each run draws, from ``--seed`` and
its index (``random.Random(f"{seed}:{run}")``, stated in its record), the step of the job at
which its fault comes (uniform over 10-60 % of the job's steps) and, for a worker's fault, the
victim (any of the four ranks).  At that step:

* ``kill``: the harness SIGKILLs the victim's process (a lost process);
* ``stop``: the harness SIGSTOPs it for good (a hung machine: under ``tfsync.elastic`` its hang
  guard ends it once its peers have dropped it);
* ``raise``: the victim's training step raises (:class:`tfsync.faults.Injector`: the program's
  own error, which ends its process);
* ``cut``: the harness takes the second host's link down for good (the job cannot go on across
  it: it stops, and the survivors' first error must name the cut host's ranks).

``kill``, ``stop`` and ``raise`` run elastic by default (``horovodrun --min-np 2 --max-np 4
--host-discovery-script``, each host listed as one name with two slots, as a user lists them:
Horovod blacklists the failed worker's host, and the job goes on with the other host's two
workers); ``cut`` runs as a plain job (``-H``).  ``--no-elastic`` runs a worker's fault as a
plain job too (it stops).  ``--frontend strategy`` runs only plain jobs: ``tfsync.elastic``
trains through the callback alone.

One record per run: the fault (kind, step, victim, host, when), ``outcome`` (``recovered``: an
elastic job that finished; ``lost``: one that did not; ``stopped``: a plain job that ended with
errors; ``finished``: a plain job that ended without one), the first error a survivor (a worker
the fault did not take: for a cut, one on the first host) raised after the fault: its text, its
type, ``after_fault_s``, the ranks and hosts it named (``named_ranks``, ``named_hosts``: its
``ranks`` in the membership it was raised in), ``named_exactly`` (the ranks the fault took, no
more, no less), ``named_healthy`` (a rank the fault did not take), and each survivor's first
error; for a job that finished, the final test accuracy (the lowest over the finishing
workers), whether every replica holds the same weights, the job's size and resets; the wall
time, and the launcher's exit code and output tail when it failed.  The summary counts them.
``--work-dir`` keeps every run's files (the launcher's log, the workers' events).  Every launch
is bounded (``--timeout-s``).  One run on a shared machine is one sample.

Example:

    python -m tfsync.bench faults --scenario kill --mode backup --repeat 30 --json kill-backup.json
"""

import argparse
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from tfsync.launch import REPO_ROOT, integer, mode_names, number

WORKER = os.path.join(REPO_ROOT, "tfsync", "bench", "_fault_worker.py")
SCENARIOS = ("kill", "cut", "stop", "raise")
ELASTIC_BY_DEFAULT = ("kill", "stop", "raise")
PER_HOST, HOSTS = 2, 2
WORKERS = PER_HOST * HOSTS
TRAIN_SAMPLES = 1437  # digits' training split (keras_examples/digits.py: 20 % held out for the test)
FAULT_AT = (0.1, 0.6)  # the fault's step, as a fraction of the job's steps (drawn uniformly)
CUT_HOST = 2  # the host a cut takes off (the launcher runs on host 1)
START_S = 240.0  # from the launch to every worker's first step (four TensorFlow start-ups on two cores)
POLL_S = 0.02  # how often the harness reads the workers' steps while it waits for the fault's
# a plain job: how long after the fault the survivors have to raise, past the wait bound (and
# how long the launch then has to end once the links are up)
PLAIN_END_S = 30.0
LOG_TAIL = 6000  # the launcher's output kept in a record that failed


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.bench faults", description=__doc__.splitlines()[0])
    p.add_argument("--scenario", required=True, choices=SCENARIOS, help="the fault each run gets")
    p.add_argument("--frontend", default="callback", choices=("callback", "strategy"), help="how the job trains")
    p.add_argument("--mode", default="bsp", choices=mode_names(), help="the mode (its defaults)")
    p.add_argument("--repeat", type=integer(1), default=1, help="runs")
    p.add_argument("--json", required=True, help="write the runs' records and the summary here")
    p.add_argument("--seed", type=integer(0), default=0, help="draws each run's fault step and victim")
    p.add_argument("--epochs", type=integer(2), default=10, help="epochs of each run")
    p.add_argument("--wait-timeout-s", type=number(above=0), default=8.0, help="the workers' wait bound")
    p.add_argument("--step-delay-s", type=number(minimum=0), default=0.02, help="simulated device time a step")
    p.add_argument("--gloo-timeout-s", type=integer(1), default=30, help="HOROVOD_GLOO_TIMEOUT_SECONDS")
    p.add_argument("--timeout-s", type=number(above=0), default=300.0, help="bound of one run's launch")
    p.add_argument(
        "--elastic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train under tfsync.elastic with horovodrun's elastic launcher (default: for kill, stop and raise)",
    )
    p.add_argument("--work-dir", default=None, help="keep every run's files here (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.elastic is None:
        args.elastic = args.scenario in ELASTIC_BY_DEFAULT
    if args.elastic and args.frontend == "strategy":
        p.error(
            f"--frontend strategy with --scenario {args.scenario}, which runs an elastic job: tfsync.elastic "
            "trains through the Keras callback only "
            "(SyncStrategy cannot re-form a job: it starts its engine inside the train step Keras keeps; "
            "docs/guide/elastic.md, Limits); pass --frontend callback, or --no-elastic for a plain job "
            "that stops with an error"
        )
    if args.elastic and args.scenario == "cut":
        p.error(
            "--scenario cut with --elastic: the cut host stays cut off, and its workers with it (the "
            "launcher's ssh sessions to them too), so an elastic job cannot re-form without them cleanly; "
            "a cut runs as a plain job, whose first error must name the cut host: leave out --elastic"
        )
    if args.mode != "auto":
        from tfsync.policies import registry

        need = PER_HOST if args.elastic else WORKERS  # (an elastic job goes on with one host's workers)
        try:
            registry.get(args.mode).build().validate(need)
        except ValueError as exc:
            p.error(f"--mode {args.mode} cannot run on {need} workers ({exc}); choose another mode")
    elif args.elastic:
        p.error("--mode auto with an elastic job: its default modes take backup workers, which need 4; pick a mode")
    return args


def steps_per_epoch(batch=16):
    """Each worker's steps an epoch: equal whole batches of the training split (``tfsync.shard``)."""
    return TRAIN_SAMPLES // (WORKERS * batch)


def draw(seed, run, scenario, epochs):
    """Run ``run``'s fault: ``{"seed", "step", "victim"}`` (``victim``: a rank, or None for a cut)."""
    rng = random.Random(f"{seed}:{run}")
    total = epochs * steps_per_epoch()
    step = max(1, int(rng.uniform(*FAULT_AT) * total))
    victim = None if scenario == "cut" else rng.randrange(WORKERS)
    return {"seed": f"{seed}:{run}", "step": step, "victim": victim}


class Launch:
    """One run's job on the hosts: the launch, the workers' marks, steps and events."""

    def __init__(self, args, hosts, out, fault):
        self.args, self.hosts, self.out, self.fault = args, hosts, out, fault
        argv = [WORKER, out, "--frontend", args.frontend, "--epochs", args.epochs, "--mode", args.mode]
        if args.elastic:
            argv.append("--elastic")
        if args.scenario == "raise":
            argv += ["--raise-rank", fault["victim"], "--raise-step", fault["step"]]
        env = {
            "TFSYNC_WAIT_TIMEOUT_S": args.wait_timeout_s,
            "TFSYNC_STRAGGLERS": f"base={args.step_delay_s}",
            # the harness's own modules for the workers and the launcher (Horovod included)
            "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p),
        }
        elastic = None
        if args.elastic:
            hosts_file, discovery = os.path.join(out, "hosts"), os.path.join(out, "discover_hosts.sh")
            with open(hosts_file, "w") as f:
                f.write("".join(f"{hosts.address(i)}:{PER_HOST}\n" for i in range(1, HOSTS + 1)))
            with open(discovery, "w") as f:
                f.write(f"#!/bin/sh\ncat {hosts_file}\n")
            os.chmod(discovery, 0o755)
            elastic = ["--min-np", PER_HOST, "--max-np", WORKERS, "--host-discovery-script", discovery]
        cmd = hosts.horovodrun(PER_HOST, argv, env=env, gloo_timeout_s=args.gloo_timeout_s, elastic=elastic)
        self.log_path = os.path.join(out, "launch.log")
        self._log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.proc = hosts.popen(1, cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def left_s(self):
        return self.args.timeout_s - (time.monotonic() - self.started)

    def running(self):
        return self.proc.poll() is None

    def marks(self):
        """Every worker's mark once all four have one (bounded), else None (the job ended, or
        ran out of time)."""
        deadline = time.monotonic() + min(START_S, self.left_s())
        while time.monotonic() < deadline and self.running():
            paths = [os.path.join(self.out, f"mark_rank{r}.json") for r in range(WORKERS)]
            if all(os.path.exists(p) for p in paths):
                return [json.load(open(p)) for p in paths]
            time.sleep(0.1)
        return None

    def step(self):
        """The furthest step any worker reported."""
        steps = []
        for path in glob.glob(os.path.join(self.out, "step_rank*")):
            with contextlib.suppress(OSError, ValueError):
                steps.append(int(open(path).read()))
        return max(steps, default=-1)

    def reach(self, step):
        """Wait (bounded) until a worker has reached ``step``; whether one did."""
        while self.running() and self.left_s() > 0:
            if self.step() >= step:
                return True
            time.sleep(POLL_S)
        return False

    def wait(self, timeout_s):
        """The launch's exit code, or None if it did not end within ``timeout_s``."""
        try:
            return self.proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def events(self):
        out = []
        for path in glob.glob(os.path.join(self.out, "events_*.jsonl")):
            with open(path) as f:
                out += [json.loads(line) for line in f if line.strip()]
        return sorted(out, key=lambda e: e["t"])

    def output_tail(self):
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-LOG_TAIL:]

    def close(self):
        from tfsync.bench.hosts import kill

        kill(self.proc)
        self._log.close()


def inject(args, hosts, launch, fault, marks):
    """The fault, once a worker has reached its step: when it came (``time.time()``), or None if
    the job ended first.  A raise is the victim's own (its ledger record says when)."""
    if args.scenario == "raise":
        ledger = os.path.join(launch.out, "ledger", "fault_0.json")
        while launch.running() and launch.left_s() > 0 and not os.path.exists(ledger):
            time.sleep(POLL_S)
        with contextlib.suppress(OSError, ValueError):
            return json.load(open(ledger))["t"]
        return None
    if not launch.reach(fault["step"]):
        return None
    t = time.time()  # (before it: no error it causes can be earlier)
    if args.scenario == "cut":
        hosts.set_link(CUT_HOST, False)
    else:
        os.kill(marks[fault["victim"]]["pid"], signal.SIGKILL if args.scenario == "kill" else signal.SIGSTOP)
    return t


def run_once(args, hosts, run, work, log):
    """One run: launch, the fault at its drawn step, the end; its record."""
    fault = draw(args.seed, run, args.scenario, args.epochs)
    out = os.path.join(work, f"run{run:03d}")
    os.makedirs(out)
    hosts.kill_all()
    record = {"run": run, "scenario": args.scenario, "mode": args.mode, "frontend": args.frontend}
    record.update(elastic=args.elastic, fault_seed=fault["seed"], fault_step=fault["step"])
    launch = Launch(args, hosts, out, fault)
    started = time.time()
    try:
        marks = launch.marks()
        if marks is None:
            code = launch.wait(1.0)
            record.update(outcome="failed_to_start", exit_code=code, output_tail=launch.output_tail())
            return record
        host_of = {m["rank"]: m["host"] for m in marks}
        fault_host = hosts.name(CUT_HOST) if args.scenario == "cut" else host_of[fault["victim"]]
        if args.scenario == "cut":  # (every rank on the cut host)
            taken = sorted(r for r, h in host_of.items() if h == fault_host)
        else:
            taken = [fault["victim"]]
        record.update(victim=fault["victim"], fault_host=fault_host, taken_ranks=taken, hosts=host_of)
        fault_t = inject(args, hosts, launch, fault, marks)
        record["fault_t"] = fault_t
        taken_pids = {m["pid"] for m in marks if m["rank"] in taken}
        if args.elastic:
            code = launch.wait(launch.left_s())
        else:
            code = _end_plain(args, hosts, launch, fault_t, {m["pid"] for m in marks} - taken_pids)
        record["exit_code"] = code
        record.update(_outcome(args, launch.events(), code, fault_t, taken, taken_pids))
        if record["outcome"] in ("lost", "failed_to_start") or code is None:
            record["output_tail"] = launch.output_tail()
    finally:
        for i in range(1, HOSTS + 1):
            hosts.set_link(i, True)
        launch.close()
        hosts.kill_all()
        record["wall_s"] = round(time.time() - started, 1)
    log(_line(record))
    return record


def _end_plain(args, hosts, launch, fault_t, survivors):
    """A plain job's end: every survivor's error (or result) within the wait bound and
    ``PLAIN_END_S`` of the fault, then the links up (a launcher cut off from a host cannot end
    its ssh sessions there) and a stopped victim resumed, then the launch's exit (bounded)."""
    deadline = time.monotonic() + (args.wait_timeout_s + PLAIN_END_S if fault_t is not None else launch.left_s())
    while time.monotonic() < min(deadline, launch.started + args.timeout_s) and launch.running():
        if survivors <= {e["pid"] for e in launch.events()}:
            break
        time.sleep(0.2)
    for i in range(1, HOSTS + 1):
        hosts.set_link(i, True)
    return launch.wait(min(PLAIN_END_S, max(launch.left_s(), 1.0)))


def _outcome(args, events, code, fault_t, taken, taken_pids):
    """What a run's events say: its outcome, the survivors' first errors, its results."""
    errors = [e for e in events if e["kind"] == "error" and e["pid"] not in taken_pids]
    if fault_t is not None:
        errors = [e for e in errors if e["t"] >= fault_t]
    firsts = {}
    for e in errors:
        firsts.setdefault(e["pid"], e)
    results = [e for e in events if e["kind"] == "result"]
    out = {"survivor_errors": [_named(e, fault_t, taken) for e in firsts.values()]}
    out["first_error"] = out["survivor_errors"][0] if out["survivor_errors"] else None
    if args.elastic:
        out["outcome"] = "recovered" if code == 0 and results else "lost"
    else:
        out["outcome"] = "finished" if code == 0 and not errors else "stopped"
    if results:
        out.update(
            final_accuracy=min(r["accuracy"] for r in results),
            replicas_identical=all(r["replicas_identical"] for r in results),
            size=max(r["size"] for r in results),
            resets=max(r["resets"] for r in results),
            finishers=len(results),
        )
    if fault_t is None:
        out["outcome"] = "no_fault"  # (the job ended, or ran out of time, before the fault's step)
    return out


def _named(error, fault_t, taken):
    """One survivor's error as recorded: what it named against what the fault took."""
    ranks, hosts = error.get("ranks"), error.get("hosts")
    first_membership = error.get("resets", 0) == 0  # (ranks and hosts as the fault found them)
    named = sorted(ranks) if ranks else []
    named_hosts = sorted({hosts[r] for r in named if hosts and 0 <= r < len(hosts)})
    return {
        "rank": error.get("rank"),
        "type": error["type"],
        "text": error["text"][:2000],
        "after_fault_s": None if fault_t is None else round(error["t"] - fault_t, 2),
        "named_ranks": named,
        "named_hosts": named_hosts,
        "named_exactly": first_membership and named == sorted(taken),
        "named_healthy": first_membership and bool(set(named) - set(taken)),
    }


def summary(args, runs):
    """The runs counted: outcomes, accuracy, replicas, the first errors' latency and naming."""
    outcomes = {}
    for r in runs:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    finished = [r for r in runs if "final_accuracy" in r]
    firsts = [r["first_error"] for r in runs if r.get("first_error")]
    latencies = [f["after_fault_s"] for f in firsts if f["after_fault_s"] is not None]
    return {
        "runs": len(runs),
        "outcomes": outcomes,
        "lost": outcomes.get("lost", 0) + outcomes.get("failed_to_start", 0),
        "accuracy_min": min((r["final_accuracy"] for r in finished), default=None),
        "replicas_identical_every_run": all(r["replicas_identical"] for r in finished) if finished else None,
        "first_errors": len(firsts),
        "first_error_after_fault_s_median": statistics.median(latencies) if latencies else None,
        "first_error_after_fault_s_max": max(latencies, default=None),
        "first_error_within_bound_plus_5_s": sum(t <= args.wait_timeout_s + 5.0 for t in latencies),
        "first_error_named_exactly": sum(f["named_exactly"] for f in firsts),
        "first_error_named_healthy": sum(f["named_healthy"] for f in firsts),
        # (any survivor's first error, not only the earliest)
        "runs_any_error_named_healthy": sum(
            any(e["named_healthy"] for e in r.get("survivor_errors", [])) for r in runs
        ),
        "first_error_named_none": sum(not f["named_ranks"] for f in firsts),
    }


def _line(record):
    first = record.get("first_error") or {}
    parts = [f"run {record['run']}: {record['outcome']}", f"fault at step {record['fault_step']}"]
    if record.get("victim") is not None:
        parts.append(f"victim rank {record['victim']} on {record.get('fault_host')}")
    if first:
        parts.append(
            f"first error {first['after_fault_s']} s after, naming {first['named_ranks']} {first['named_hosts']}"
            + (" HEALTHY" if first["named_healthy"] else "")
        )
    if "final_accuracy" in record:
        parts.append(f"accuracy {record['final_accuracy']:.4f}, identical {record['replicas_identical']}")
    return "  " + "; ".join(parts)


def run(args, log=print, argv=()):
    """``args.repeat`` runs on two simulated hosts made for them; ``{"settings", "command",
    "runs", "summary"}`` (``argv``: the command's arguments, for the record)."""
    from tfsync.bench.hosts import Hosts

    settings = {k: v for k, v in vars(args).items() if k != "json"}
    out = {"settings": settings, "command": "python -m tfsync.bench faults " + " ".join(argv), "runs": []}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):  # (the code the runs ran)
        out["commit"] = subprocess.check_output(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"], text=True).strip()
    work = args.work_dir or tempfile.mkdtemp(prefix="tfsync-faults-")
    os.makedirs(work, exist_ok=True)
    try:
        with Hosts(HOSTS) as hosts:
            for i in range(args.repeat):
                out["runs"].append(run_once(args, hosts, i, work, log))
                out["summary"] = summary(args, out["runs"])
                if args.json:  # (after every run: a long study keeps what it has)
                    _write(args.json, out)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _write(path, out):
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None):
    argv = list(sys.argv[2:] if argv is None else argv)
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    elastic = "elastic" if args.elastic else "plain"
    log(
        f"faults: {args.scenario} under {args.mode} ({args.frontend}, {elastic} job), {args.repeat} runs, "
        f"wait bound {args.wait_timeout_s:g} s, seed {args.seed}"
    )
    out = run(args, log=log, argv=argv)
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
