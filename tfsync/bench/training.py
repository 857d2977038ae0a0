"""``python -m tfsync.bench``: plain Horovod BSP vs tfsync's modes, in one run.

Each (model, mode, scenario) is one ``horovodrun`` launch of
:mod:`tfsync.bench._training_worker` on local workers.  Models (``--models``):
``small`` (7k parameters), ``21k`` and ``1.3m`` (256 -> w -> w -> 10 with w = 64 and
1024, batch 16: the step-overhead study's sizes), ``medium`` (4.7M), ``large`` (17.9M).  Mode
``local`` trains every worker alone with no synchronization at all: the
compute floor each mode's synchronization overhead per step is measured
against.  Scenarios:

* ``none``: every worker spends ``--base-s`` of simulated device time per step;
* ``straggler``: the last rank spends ``--slow-s`` more on every step;
* ``heterogeneous``: the last rank spends twice ``--base-s`` on every step (a
  slower GPU: the DSSP paper's mixed cluster);
* ``jitter``: every worker spends an extra ``uniform(0, --jitter-s)`` per step
  (transient stragglers: a different worker is slowest at each step);
* ``rare``: a step is delayed by ``--rare-s`` with probability ``--rare-prob``
  (the PSP paper's rare large delays; the defaults, 1% and 0.5 s, give about
  six events in a 4-worker run of 150 steps);
* ``rare-pull``: the PSP paper's simulation itself, on the receive side: each
  block of each round's result reaches a worker ``--pull-s`` late with
  probability ``--pull-prob`` (a block is a weight tensor, six in the small
  model; the defaults, 0.25% and 0.5 s, give about ten delayed blocks in a
  4-worker run of 160 rounds).  A mode without partial pulling waits for a
  round's last block; ``psp+pull`` (``PSP(pull_fraction=0.75)``: five of six
  blocks) goes on without it and applies it when it lands.

``effective_samples_per_s`` counts only the samples whose gradients were
applied, as they were or delay-compensated (PSP and backup workers drop some
and skip steps); ``compensated``, ``dropped`` and ``skipped`` are summed over
the workers.  ``bytes_sent_per_step`` and ``bytes_received_per_step`` (and
``uncompressed_...``: without ``compression=``) are one worker's bytes on the
wire per training step, the mean over the workers, as the engine counts them
(:mod:`tfsync.engine.wire.counting`: a ring allreduce moves ``2·(n-1)/n`` of its
bytes each way); plain Horovod's are counted the same way (its one gradient
allreduce per step, no metadata).

Each configuration is launched ``--repeats`` times, round-robin across the
modes, and its median run is reported (the machine is shared and noisy).
Prints a table with the ratios docs/benchmarks.md quotes and writes the records as
JSON with ``--json PATH``.
"""

import argparse
import json
import os
import sys

from tfsync.launch import horovodrun, integer, number
from tfsync.policies import registry
from tfsync.stragglers import Stragglers

# the worker's flags for each mode and named variant (tfsync.policies.registry), after the two
# baselines the worker runs itself: no synchronization, plain Horovod
MODE_FLAGS = {"local": ["--mode", "local"], "horovod": ["--mode", "horovod"], **registry.configurations()}
MODES = tuple(MODE_FLAGS)
# plain Horovod and the registry's per-step configurations (Local SGD's and DiLoCo's steps are not
# each a contribution: python -m tfsync.bench network compares those)
DEFAULT_MODES = ("horovod", *registry.study_configurations(every_step=True))
MODELS = ("small", "21k", "1.3m", "medium", "large")
SCENARIOS = ("none", "straggler", "heterogeneous", "jitter", "rare", "rare-pull")
DEFAULT_SCENARIOS = tuple(s for s in SCENARIOS if s != "rare-pull")  # rare-pull: opt-in (psp+pull's case)
# each mode's label in tables (its registry label; SSP's bound from --staleness, a "{s}")
MODE_LABELS = {
    "local": "no synchronization",
    "horovod": "plain Horovod BSP",
    **{m: "tfsync " + registry.label(m, staleness="{s}") for m in MODES if m not in ("local", "horovod")},
}


def scenario_spec(name, args):
    if name == "none":
        return f"base={args.base_s},seed=1"
    if name == "straggler":
        return f"base={args.base_s},slow={args.workers - 1}:{args.slow_s},seed=1"
    if name == "heterogeneous":  # a slower device: twice the base time on every step
        return f"base={args.base_s},slow={args.workers - 1}:{args.base_s},seed=1"
    if name == "jitter":
        return f"base={args.base_s},jitter={args.jitter_s},seed=1"
    if name == "rare":
        return f"base={args.base_s},rare={args.rare_prob}:{args.rare_s},seed=1"
    if name == "rare-pull":
        return f"base={args.base_s},pull={args.pull_prob}:{args.pull_s},seed=1"
    raise ValueError(name)


def add_scenario_arguments(p):
    """The delays :func:`scenario_spec` reads (the bench's and the simulator's flags), each
    refused at parse time unless finite and in range."""
    seconds, probability = number(minimum=0), number(minimum=0, maximum=1)
    p.add_argument("--base-s", type=seconds, default=0.02, help="simulated device time per step")
    p.add_argument("--slow-s", type=seconds, default=0.04, help="extra time per step of the straggler (the last rank)")
    p.add_argument("--jitter-s", type=seconds, default=0.04, help="max extra time per step in 'jitter'")
    p.add_argument("--rare-prob", type=probability, default=0.01, help="probability of a rare delay in 'rare'")
    p.add_argument("--rare-s", type=seconds, default=0.5, help="length of a rare delay in 'rare'")
    p.add_argument(
        "--pull-prob", type=probability, default=0.0025, help="probability that a round's block reaches a worker late"
    )
    p.add_argument("--pull-s", type=seconds, default=0.5, help="how late, in 'rare-pull'")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.bench", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=integer(2), default=4, help="local workers (2 or more: the modes compare them)")
    p.add_argument("--steps", type=integer(1), default=150, help="timed steps per worker (after 10 warm-up)")
    add_scenario_arguments(p)
    p.add_argument("--staleness", type=integer(0), default=3, help="SSP's bound s")
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        choices=MODES,
        help="'local' (no synchronization) is the compute floor the overhead is measured against; default: "
        "plain Horovod and the study's configurations of every mode whose every step contributes",
    )
    p.add_argument("--models", nargs="+", default=["small"], choices=MODELS)
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=list(DEFAULT_SCENARIOS),
        choices=SCENARIOS,
        help="default: all but rare-pull (slow pulls, the case of --modes psp+pull)",
    )
    p.add_argument(
        "--repeats",
        type=integer(1),
        default=3,
        help="launches per (mode, scenario), interleaved across modes; the median is reported",
    )
    p.add_argument("--json", metavar="PATH", help="write the records here")
    p.add_argument("--quick", action="store_true", help="2 workers, 20 steps: a smoke test")
    p.add_argument("--timeout-s", type=integer(1), default=600, help="bound on each launch, in seconds")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.steps, args.repeats = 2, 20, 1
    # the delays of every scenario asked for, checked here rather than in each launched worker
    for name in args.scenarios:
        try:
            Stragglers.parse(scenario_spec(name, args))
        except ValueError as exc:
            p.error(
                f"scenario {name!r}: {exc} (set by --base-s, --slow-s, --jitter-s, --rare-prob, --rare-s, "
                f"--pull-prob, --pull-s: seconds are finite and >= 0, probabilities in [0, 1])"
            )
    return args


def main(argv=None):
    args = parse_args(argv)
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_training_worker.py")
    records = []
    for model in args.models:
        for scenario in args.scenarios:
            records += run_configuration(worker, model, scenario, args)
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


def run_configuration(worker, model, scenario, args):
    spec = scenario_spec(scenario, args)
    flags = {**MODE_FLAGS, **registry.configurations(staleness=args.staleness)}  # (SSP's bound: --staleness)
    runs = {mode: [] for mode in args.modes}
    # round-robin over the modes, so a slow spell of the shared machine hits all of them
    for repeat in range(args.repeats):
        for mode in args.modes:
            result = horovodrun(
                worker,
                [
                    *flags[mode],
                    "--model",
                    model,
                    "--stragglers",
                    spec,
                    "--steps",
                    args.steps,
                ],
                workers=args.workers,
                timeout_s=args.timeout_s,
            )
            runs[mode].append(result)
            print(
                f"  {model:6s} {scenario:9s} {MODE_LABELS[mode].format(s=args.staleness):18s} "
                f"run {repeat + 1}: {result['samples_per_s']:8.0f} samples/s",
                file=sys.stderr,
                flush=True,
            )
    records = []
    for mode in args.modes:
        median = sorted(runs[mode], key=lambda r: r["samples_per_s"])[len(runs[mode]) // 2]
        records.append(
            {
                "mode": MODE_LABELS[mode].format(s=args.staleness),
                "model": model,
                "scenario": scenario,
                "stragglers": spec,
                "workers": args.workers,
                "steps": args.steps,
                **median,
                "runs_samples_per_s": [r["samples_per_s"] for r in runs[mode]],
            }
        )
    floor = next((r for r in records if r["mode"] == MODE_LABELS["local"]), None)
    horovod = next((r for r in records if r["mode"] == MODE_LABELS["horovod"]), None)
    for r in records:
        if floor is not None:
            r["sync_overhead_ms"] = r["ms_per_step"] - floor["ms_per_step"]
    for r in records:
        r["mean_cpu_ms_per_step"] = sum(r["cpu_ms_per_step"]) / len(r["cpu_ms_per_step"])
    for r in records:
        if horovod is not None:
            r["vs_horovod"] = r["samples_per_s"] / horovod["samples_per_s"]
            r["extra_cpu_ms_per_step"] = r["mean_cpu_ms_per_step"] - horovod["mean_cpu_ms_per_step"]
            if floor is not None and horovod["ms_per_step"] > floor["ms_per_step"]:
                r["overhead_vs_horovod"] = r["sync_overhead_ms"] / horovod["sync_overhead_ms"]
    return records


def format_table(records):
    lines = [
        "| model | scenario | mode | samples/s | effective samples/s | compensated | dropped | skipped | ms/step "
        "| sync overhead ms/step | CPU ms/step | wait fraction | vs plain Horovod | vs tfsync BSP | peak RSS MiB "
        "| MB sent/step |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        same = {
            x["mode"].split("(")[0]: x["samples_per_s"]
            for x in records
            if x["scenario"] == r["scenario"] and x.get("model") == r.get("model")
        }
        bsp = same.get("tfsync BSP")
        wait = "—" if r["wait_fraction"] is None else f"{r['wait_fraction']:.2f}"
        effective = r.get("effective_samples_per_s", r["samples_per_s"])
        overhead = "—" if "sync_overhead_ms" not in r else f"{r['sync_overhead_ms']:.1f}"
        vs_hvd = "—" if "vs_horovod" not in r else f"{r['vs_horovod']:.2f}×"
        vs_bsp = "—" if not bsp else f"{r['samples_per_s'] / bsp:.2f}×"
        # one worker's bytes per step (tfsync.engine.wire.counting's ring model; plain Horovod's counted alike)
        sent = "—" if r.get("bytes_sent_per_step") is None else f"{r['bytes_sent_per_step'] / 1e6:.3f}"
        lines.append(
            f"| {r.get('model', 'small')} | {r['scenario']} | {r['mode']} | {r['samples_per_s']:.0f} | "
            f"{effective:.0f} | {r.get('compensated', 0)} | {r.get('dropped', 0)} | {r.get('skipped', 0)} | "
            f"{r['ms_per_step']:.1f} | "
            f"{overhead} | {r['mean_cpu_ms_per_step']:.2f} | {wait} | {vs_hvd} | {vs_bsp} | "
            f"{r['peak_rss_mb']:.0f} | {sent} |"
        )
    lines += barrier_table(records)
    return "\n".join(lines)


def barrier_table(records):
    """ElasticBSP's barriers against BSP's steps: mean wait, and the decisions' cost."""
    rows = []
    for r in records:
        if "mean_wait_per_barrier_s" not in r:
            continue
        bsp = next(
            (
                x
                for x in records
                if x["mode"] == MODE_LABELS["bsp"]
                and x["scenario"] == r["scenario"]
                and x.get("model") == r.get("model")
            ),
            None,
        )
        bsp_wait = None if bsp is None else bsp.get("mean_wait_per_step_s")
        ratio = "—" if not bsp_wait else f"{r['mean_wait_per_barrier_s'] / bsp_wait:.2f}"
        rows.append(
            f"| {r.get('model', 'small')} | {r['scenario']} | {r['barriers']} | "
            f"{r['mean_wait_per_barrier_s'] * 1e3:.1f} | "
            f"{'—' if bsp_wait is None else f'{bsp_wait * 1e3:.1f}'} | {ratio} | "
            f"{r['mean_decision_s'] * 1e3:.3f} | {r['decision_per_iteration'] * 100:.2f}% |"
        )
    if not rows:
        return []
    return [
        "",
        "| model | scenario | ElasticBSP barriers | mean wait per barrier ms | BSP mean wait per step ms "
        "| ratio | decision ms | decision / iteration |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
