"""Elastic training: what a lost worker costs, per mode, and under a kill loop.

``python -m tfsync.bench elastic`` launches :mod:`tfsync.bench._elastic_worker` (the digits MLP
under :mod:`tfsync.elastic`, each step's device time simulated by a sleep) on two workers of this
machine under horovodrun's elastic launcher, the machine listed as two host names
(:func:`tfsync.launch.run_elastic_job`: Horovod blacklists the host of a worker that fails).

1. For every mode that can go on with one worker (the modes refused on one worker, backup workers
   with ``backups=1`` and auto, are listed in the JSON with the reason): an undisturbed run, then
   the same run with one worker killed (SIGKILL) mid-epoch; the survivor goes on alone.  Reported:
   the time from the kill to the survivor's next step (its batch end), the steps it redoes (its
   batches of the interrupted epoch: the state is committed at epoch ends), its contributions lost
   in flight, and its final test accuracy against the undisturbed run's.
2. A kill loop (``--loop-minutes``, 0 skips it): one worker killed every ``--kill-every-s`` while
   the job has both; ``--blacklist-cooldown-range 1 3`` lets its host back, and the launcher
   starts a new process, which joins at the next epoch.  Each kill's time to the next step, the
   time the host took to come back and the stall of the survivor while the new process joined;
   the final accuracy against an undisturbed run of as many epochs.

Every launch is bounded (``--timeout-s``; the loop's by its length plus that).  One run on a
shared machine is one sample.

``--commit-cost`` measures instead what a commit within an epoch costs
(:mod:`tfsync.bench._commit_worker`): the training bench's MLP (``--model large``: 17.9M
parameters) under BSP on ``--workers`` workers, committing every ``--commit-every`` steps
(default: ``tfsync.elastic.DEFAULT_COMMIT_EVERY_STEPS``) for ``--steps`` steps; one record with
the median commit, ``state.save()`` and step seconds and the share of training time the commits
take (``overhead_fraction``); ``--commit-dir DIR`` writes each commit there too
(``TFSYNC_COMMIT_DIR``), which the steps then pay for.

Example:

    python -m tfsync.bench elastic --loop-minutes 4 --json elastic.json
    python -m tfsync.bench elastic --commit-cost --model large --json commit_cost.json
"""

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

from tfsync.launch import integer, number, results_in, run_elastic_job, run_local_job
from tfsync.policies import registry

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_elastic_worker.py")
COMMIT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_commit_worker.py")
DEFAULT_COMMIT_EVERY_STEPS = 100  # tfsync.elastic's (not imported here: it loads Horovod and TensorFlow)
COOLDOWN_S = (1, 3)  # horovodrun --blacklist-cooldown-range: a killed worker's host comes back after 1-3 s
SETTLED = ("applied", "compensated", "dropped", "rejected", "lost")
LOOP_EPOCHS = 100000  # the kill loop stops at its deadline's epoch end, long before


def survivable_modes():
    """``(names, refused)``: the registered modes that run on one worker with their defaults, and
    ``{name: reason}`` for those whose ``validate(1)`` refuses (``auto`` included: its default modes
    take backup workers)."""
    names, refused = [], {}
    for m in registry.modes(switching=True):
        try:
            m.build().validate(1)
        except ValueError as exc:
            refused[m.name] = str(exc)
        else:
            names.append(m.name)
    return names, refused


def parse_args(argv):
    names, refused = survivable_modes()
    p = argparse.ArgumentParser(prog="python -m tfsync.bench elastic", description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=names, help=f"modes to kill a worker under (default: {names})")
    p.add_argument("--epochs", type=integer(2), default=5, help="epochs of each mode's runs")
    p.add_argument("--kill-epoch", type=integer(0), default=1, help="the epoch a worker dies in")
    p.add_argument("--kill-batch", type=integer(0), default=10, help="after this batch (of 44 an epoch)")
    p.add_argument("--victim", type=integer(0), default=1, choices=(0, 1), help="the rank that dies")
    p.add_argument("--step-delay-s", type=number(minimum=0), default=0.02, help="simulated device time a step")
    p.add_argument("--loop-minutes", type=number(minimum=0), default=4.0, help="kill loop length (0: none)")
    p.add_argument("--loop-mode", default="bsp", help="the kill loop's mode")
    p.add_argument("--kill-every-s", type=number(above=0), default=20.0, help="the kill loop's period")
    p.add_argument("--gloo-timeout-s", type=integer(1), default=10, help="HOROVOD_GLOO_TIMEOUT_SECONDS")
    p.add_argument("--timeout-s", type=number(above=0), default=300.0, help="bound of one launch")
    p.add_argument("--json", help="write the records here")
    cost = p.add_argument_group("--commit-cost: what a commit within an epoch costs, instead of the kills")
    cost.add_argument("--commit-cost", action="store_true", help="measure the commit's cost (no kill)")
    cost.add_argument("--model", default="large", choices=("small", "medium", "large"), help="the MLP (large: 17.9M)")
    cost.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="its optimizer (adam: 2 slots)")
    cost.add_argument("--commit-every", type=integer(1), default=DEFAULT_COMMIT_EVERY_STEPS, help="steps")
    cost.add_argument("--steps", type=integer(2), default=None, help="steps of the run (default: 5 commits' worth)")
    cost.add_argument("--workers", type=integer(1), default=2, help="workers of the run")
    cost.add_argument("--commit-dir", default=None, help="also write each commit there (TFSYNC_COMMIT_DIR)")
    args = p.parse_args(argv)
    if args.commit_cost:
        args.steps = args.steps or 5 * args.commit_every + 1
        if args.steps <= args.commit_every:
            p.error(f"--steps {args.steps} makes no commit within the epoch; pass more than --commit-every")
        args.refused = refused
        return args
    for mode in [*args.modes, args.loop_mode]:
        if mode in refused:
            p.error(f"mode {mode!r} cannot go on with one worker ({refused[mode]}); choose among {names}")
        if mode not in names:
            p.error(f"unknown mode {mode!r}; choose among {names}")
    if args.kill_epoch >= args.epochs:
        p.error(f"--kill-epoch {args.kill_epoch} must be below --epochs {args.epochs}: the kill is in a run's epoch")
    if args.kill_batch >= 44:
        p.error(f"--kill-batch {args.kill_batch}: an epoch has 44 batches a worker with two workers; pass 0 to 43")
    args.refused = refused
    return args


def adds_up(counts):
    """Whether every contribution produced was settled: applied, compensated, dropped, rejected or lost."""
    return counts["produced"] == sum(counts[k] for k in SETTLED)


def _launch(args, out_dir, mode, victim, epochs, timeout_s, extra=(), options=()):
    env = {
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(args.gloo_timeout_s),
        "TFSYNC_STRAGGLERS": f"base={args.step_delay_s}",
    }
    argv = [out_dir, mode, victim, args.kill_epoch, args.kill_batch, epochs, *extra]
    started = time.time()
    code, output = run_elastic_job(WORKER, 2, argv, out_dir, 1, timeout_s=timeout_s, env=env, options=options)
    wall_s = time.time() - started
    results = read_results(out_dir)
    if code != 0 or 0 not in results:
        raise RuntimeError(f"{mode} (victim {victim}) failed with exit code {code}; output tail:\n{output[-4000:]}")
    return results, wall_s


def _kills(out_dir):
    kills = []
    for path in glob.glob(os.path.join(out_dir, "killed_*.json")):
        with open(path) as f:
            kills.append(json.load(f))
    return sorted(kills, key=lambda k: k["t"])


def read_results(out_dir):
    """``{rank: record}`` of the ``result_rank<R>.json`` files the finishing workers wrote."""
    results = {}
    for path in glob.glob(os.path.join(out_dir, "result_rank*.json")):
        with open(path) as f:
            results[int(os.path.basename(path)[len("result_rank") : -len(".json")])] = json.load(f)
    return results


def jsonl_records(out_dir, pattern, key):
    """Every record of the files ``out_dir/pattern`` (JSON lines, one file per process), sorted by ``key``."""
    records = []
    for path in glob.glob(os.path.join(out_dir, pattern)):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return sorted(records, key=lambda r: r[key])


def _step_records(out_dir):
    return jsonl_records(out_dir, "steps_*.jsonl", "first_step_t")


def per_kill(out_dir, full=2):
    """Each kill's costs, from the victim's record and every process's steps after its resets:
    ``reset_s`` (kill to a survivor's next step), ``rolled_back`` (that survivor's batches of the
    interrupted epoch, redone), and where the host came back: ``back_s`` (kill to the first step
    with the job whole again) and ``join_stall_s`` (the survivor's time between its last step
    before that reset and its first after: the new process's start, waited for)."""
    records = _step_records(out_dir)
    out = []
    for kill in _kills(out_dir):
        after = [r for r in records if r["pid"] != kill["pid"] and r["first_step_t"] > kill["t"]]
        item = {"t": kill["t"], "rank": kill["rank"], "epoch": kill["epoch"], "reset_s": None, "rolled_back": None}
        if after:
            item["reset_s"] = after[0]["first_step_t"] - kill["t"]
            item["rolled_back"] = after[0]["rolled_back"]
            item["size_after"] = after[0]["size"]
        whole = [r for r in after if r["size"] == full and r["resets"] > (after[0]["resets"] if after else 0)]
        if whole:
            item["back_s"] = whole[0]["first_step_t"] - kill["t"]
            stalls = [r["first_step_t"] - r["last_step_before_t"] for r in whole if r["last_step_before_t"]]
            stalls = [s for s in stalls if s > 0][:1]
            item["join_stall_s"] = stalls[0] if stalls else None
        out.append(item)
    return out


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "max": max(values), "n": len(values)}


def mode_run(args, mode, work, log):
    """One mode: undisturbed, then a worker killed at (``--kill-epoch``, ``--kill-batch``)."""
    calm_dir, kill_dir = os.path.join(work, f"{mode}-calm"), os.path.join(work, f"{mode}-kill")
    os.makedirs(calm_dir)
    os.makedirs(kill_dir)
    calm, calm_s = _launch(args, calm_dir, mode, -1, args.epochs, args.timeout_s)
    killed, kill_s = _launch(args, kill_dir, mode, args.victim, args.epochs, args.timeout_s)
    kills = per_kill(kill_dir)
    survivor = killed[0]
    record = {
        "mode": mode,
        "label": registry.describe(registry.get(mode).build()),
        "epochs": args.epochs,
        "kill_at": [args.kill_epoch, args.kill_batch],
        "victim_rank": args.victim,
        "undisturbed_accuracy": calm[0]["accuracy"],
        "accuracy": survivor["accuracy"],
        "accuracy_delta_points": 100 * (survivor["accuracy"] - calm[0]["accuracy"]),
        "kills": kills,
        "reset_s": kills[0]["reset_s"] if kills else None,
        "rolled_back_steps": kills[0]["rolled_back"] if kills else None,
        "survivors": len(killed),
        "survivor_resets": survivor["resets"],
        "survivor_epochs_finished": survivor["state_epoch"],
        "survivor_counts": survivor["counts"],
        "job_counts": survivor["state_counts"],
        "counts_add_up": adds_up(survivor["counts"]) and adds_up(survivor["state_counts"]),
        "undisturbed_wall_s": calm_s,
        "killed_wall_s": kill_s,
    }
    log(
        f"  {record['label']:14s} accuracy {record['undisturbed_accuracy']:.4f} -> {record['accuracy']:.4f}, "
        f"kill to next step {record['reset_s'] or float('nan'):.2f} s, {record['rolled_back_steps']} steps redone"
    )
    return record


def kill_loop(args, work, log):
    """The kill loop, then an undisturbed run of as many epochs."""
    loop_dir, calm_dir = os.path.join(work, "loop"), os.path.join(work, "loop-calm")
    os.makedirs(loop_dir)
    os.makedirs(calm_dir)
    length_s = 60 * args.loop_minutes
    start = time.time()
    extra = ["--kill-every-s", args.kill_every_s, "--start-t", start, "--deadline-t", start + length_s]
    cooldown = ["--blacklist-cooldown-range", *COOLDOWN_S]
    looped, loop_s = _launch(
        args, loop_dir, args.loop_mode, args.victim, LOOP_EPOCHS, length_s + args.timeout_s, ["", "", *extra], cooldown
    )
    epochs = looped[0]["state_epoch"]
    calm, calm_s = _launch(args, calm_dir, args.loop_mode, -1, epochs, length_s + args.timeout_s)
    kills = per_kill(loop_dir)
    finishers = list(looped.values())
    record = {
        "mode": args.loop_mode,
        "minutes": args.loop_minutes,
        "kill_every_s": args.kill_every_s,
        "blacklist_cooldown_s": list(COOLDOWN_S),
        "epochs": epochs,
        "kills": kills,
        "n_kills": len(kills),
        "reset_s": summary([k["reset_s"] for k in kills]),
        "back_s": summary([k.get("back_s") for k in kills]),
        "join_stall_s": summary([k.get("join_stall_s") for k in kills]),
        "rolled_back_steps": summary([k["rolled_back"] for k in kills]),
        "resets": max(r["resets"] for r in finishers),
        "undisturbed_accuracy": calm[0]["accuracy"],
        "accuracy": looped[0]["accuracy"],
        "accuracy_min_over_finishers": min(r["accuracy"] for r in finishers),
        "accuracy_delta_points": 100 * (looped[0]["accuracy"] - calm[0]["accuracy"]),
        "job_counts": looped[0]["state_counts"],
        "counts_add_up": all(adds_up(r["counts"]) and adds_up(r["state_counts"]) for r in finishers),
        "loop_wall_s": loop_s,
        "undisturbed_wall_s": calm_s,
    }
    log(
        f"  kill loop {args.loop_mode}: {len(kills)} kills in {loop_s:.0f} s, {epochs} epochs, accuracy "
        f"{record['undisturbed_accuracy']:.4f} -> {record['accuracy']:.4f}, kill to next step median "
        f"{record['reset_s']['median']} s"
    )
    return record


def run(args, log=print):
    """The per-mode runs and the kill loop; one record (a dict) for the JSON."""
    out = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "refused")},
        "refused_on_one_worker": args.refused,
        "modes": [],
        "loop": None,
        "failed": {},
    }
    with tempfile.TemporaryDirectory(prefix="tfsync-elastic-") as work:
        for mode in args.modes:
            try:
                out["modes"].append(mode_run(args, mode, work, log))
            except (RuntimeError, TimeoutError) as exc:
                out["failed"][mode] = str(exc)[-4000:]
                log(f"  {mode}: FAILED\n{str(exc)[-2000:]}")
        if args.loop_minutes > 0:
            try:
                out["loop"] = kill_loop(args, work, log)
            except (RuntimeError, TimeoutError) as exc:
                out["failed"]["loop"] = str(exc)[-4000:]
                log(f"  kill loop: FAILED\n{str(exc)[-2000:]}")
    return out


def _f(value, fmt):
    return "—" if value is None else format(value, fmt)


def format_table(out):
    lines = [
        "| mode | accuracy undisturbed | accuracy, one killed | Δ points | kill → next step s | steps redone | "
        "lost in flight |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in out["modes"]:
        lines.append(
            f"| {r['label']} | {r['undisturbed_accuracy']:.4f} | {r['accuracy']:.4f} | "
            f"{r['accuracy_delta_points']:+.1f} | {_f(r['reset_s'], '.2f')} | {_f(r['rolled_back_steps'], 'd')} | "
            f"{r['survivor_counts']['lost']} |"
        )
    loop = out["loop"]
    if loop is not None:
        lines += [
            "",
            "| kill loop | kills | epochs | kill → next step s (median / max) | host back s (median) | "
            "join stall s (median / max) | accuracy undisturbed | accuracy | Δ points |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {loop['mode']}, {loop['minutes']:g} min, every {loop['kill_every_s']:g} s | {loop['n_kills']} | "
            f"{loop['epochs']} | {_f(loop['reset_s']['median'], '.2f')} / {_f(loop['reset_s']['max'], '.2f')} | "
            f"{_f(loop['back_s']['median'], '.1f')} | {_f(loop['join_stall_s']['median'], '.1f')} / "
            f"{_f(loop['join_stall_s']['max'], '.1f')} | {loop['undisturbed_accuracy']:.4f} | {loop['accuracy']:.4f} | "
            f"{loop['accuracy_delta_points']:+.1f} |",
        ]
    for name, why in out["failed"].items():
        lines.append(f"\nFAILED {name}: {why.splitlines()[0] if why else ''}")
    return "\n".join(lines)


def commit_cost(args, log=print):
    """One launch of :mod:`tfsync.bench._commit_worker`; its rank 0's record."""
    argv = ["--model", args.model, "--optimizer", args.optimizer, "--commit-every", args.commit_every]
    argv += ["--steps", args.steps]
    storage = f", written to {args.commit_dir}" if args.commit_dir else ""
    log(f"commit cost: {args.model} MLP, {args.workers} workers, a commit every {args.commit_every} steps{storage}")
    env = {"TFSYNC_COMMIT_DIR": args.commit_dir} if args.commit_dir else None
    code, output = run_local_job(COMMIT_WORKER, argv, workers=args.workers, timeout_s=args.timeout_s, env=env)
    results = results_in(output)
    if code != 0 or not results:
        raise RuntimeError(f"the commit-cost run failed (exit {code}); output tail:\n{output[-4000:]}")
    return results[-1]


def main(argv=None):
    args = parse_args(argv)
    if args.commit_cost:
        record = commit_cost(args, log=lambda line: print(line, file=sys.stderr, flush=True))
        print(json.dumps(record, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        return 0
    out = run(args, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
