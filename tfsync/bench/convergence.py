"""``python -m tfsync.bench convergence``: which mode when, from accuracy against wall time.

Trains ``keras_examples/digits.py`` (scikit-learn's offline digits, a 64-64-10
MLP, 20 ms of simulated device time per step) to a fixed epoch budget under
every mode and straggler scenario, and records the test accuracy after every
epoch against wall time and samples.  Plain Horovod BSP (``horovod``,
in-graph ``hvd.grouped_allreduce``) is the anchor.  Scenarios (``tfsync.demo``'s
specs): ``none``; ``straggler`` (rank 3 +40 ms per step, persistent);
``heterogeneous`` (rank 3 takes twice the base time, a slower GPU); ``jitter``
(every step +uniform(0, 40 ms)); ``rare`` (a step is delayed 0.5 s with
probability 1.5%); ``rare-pull`` (a block of a round's result reaches a
worker 0.5 s late with probability 0.4%: the PSP paper's slow pulls).

Each (scenario, mode) runs ``--repeats`` times, interleaved (repeat, then
scenario, then mode) so that a slow spell of the shared machine hits every
mode; the medians are reported and the plots show every run.  A progress
line per run goes to stderr.  Writes:

* ``--json PATH``: the settings, every run (with its accuracy curve) and the
  per-(scenario, mode) summary;
* ``--plots DIR``: ``accuracy_vs_time.png`` (a panel per scenario, a line per
  run, a colour per mode), ``time_to_target.png`` (grouped bars: the median
  time to ``--target-accuracy``, whiskers from the fastest to the slowest run;
  a run that never reached it is drawn at the epoch budget's end, hatched),
  ``final_accuracy.png`` (grouped bars with the spread), and one
  ``paper_<name>.png`` per paper of :data:`PAPERS` whose scenario and modes the
  study ran (that paper's comparison: accuracy against time, time to target).

``--from-json PATH`` prints the table and draws the plots of an earlier
study's JSON without training anything.

The backup-workers trade-off is its own run (``--modes bsp "backup(b=0)"
backup "backup(b=2)" "backup(b=3)" --scenarios straggler none``): ``backup``
is b = 1, and b backups of 4 workers aggregate the first 4 - b gradients.

The time to the target is measured from the start of ``fit`` on rank 0, with
rank 0's evaluations after each epoch subtracted; accuracy is sampled once
per epoch, so it is coarse (about 1.5 s under BSP).
"""

import argparse
import json
import os
import sys
import time
from statistics import median

from tfsync.bench.digits import EXAMPLE, MODES, SCENARIOS
from tfsync.launch import horovodrun
from tfsync.policies import registry

# plain Horovod (the anchor), every registered mode and variant the study runs by default
# (tfsync.policies.registry.study_configurations), and auto mode
STUDY_MODES = ("horovod", *registry.study_configurations(switching=True))

# Each paper's comparison, reproduced in shape from the study's runs: (name, title, scenario,
# modes, how many of them the study must have run for the comparison to mean something)
PAPERS = (
    ("psp", "PSP (Table 1): rare delays, BSP against partial pushing", "rare", ("bsp", "psp", "psp+dc"), 2),
    (
        "psp_pull",
        "PSP (Table 1): rare slow pulls, BSP against partial pushing and partial pushing + pulling",
        "rare-pull",
        ("bsp", "psp", "psp+pull"),
        2,
    ),
    (
        "dssp",
        "DSSP (Table I): heterogeneous workers, BSP, SSP at both bounds, DSSP",
        "heterogeneous",
        ("bsp", "ssp", "ssp(s=15)", "dssp"),
        2,
    ),
    (
        "elasticbsp",
        "ElasticBSP: heterogeneous workers, against BSP, SSP and DSSP",
        "heterogeneous",
        ("bsp", "ssp", "ssp(s=15)", "dssp", "elasticbsp"),
        2,
    ),
    (
        "backup",
        "Backup workers (Section 3.1): b backups of 4 workers, a persistent straggler",
        "straggler",
        ("bsp", "backup(b=0)", "backup", "backup(b=2)", "backup(b=3)"),
        4,  # a sweep: BSP and b = 1 alone are no trade-off
    ),
)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.bench convergence", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=12, help="the epoch budget of every run")
    p.add_argument("--repeats", type=int, default=3, help="runs per (scenario, mode); the median is reported")
    p.add_argument("--modes", nargs="+", default=list(STUDY_MODES), choices=list(MODES))
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=[s for s in SCENARIOS if s != "rare-pull"],
        choices=list(SCENARIOS),
        help="default: all but rare-pull (slow pulls, the case of --modes psp+pull)",
    )
    p.add_argument("--target-accuracy", type=float, default=0.95, help="the accuracy the time is measured to")
    p.add_argument("--json", metavar="PATH", help="write the settings, runs and summary here")
    p.add_argument("--plots", metavar="DIR", help="write the PNG plots here")
    p.add_argument("--quick", action="store_true", help="2 workers, 3 epochs, 1 repeat: a smoke test")
    p.add_argument("--timeout-s", type=int, default=600, help="bound on each launch")
    p.add_argument("--from-json", metavar="PATH", help="table and plots of an earlier study's JSON; no training")
    args = p.parse_args(argv)
    if args.from_json:
        return _settings_from(args)
    if args.quick:
        args.workers, args.epochs, args.repeats = 2, 3, 1
    if args.workers < 2:
        p.error(f"--workers {args.workers}: a synchronization study needs at least 2 workers")
    if args.repeats < 1 or args.epochs < 1:
        p.error(f"--repeats {args.repeats} and --epochs {args.epochs} must be at least 1")
    if not 0.0 < args.target_accuracy <= 1.0:
        p.error(f"--target-accuracy {args.target_accuracy} is a test accuracy in (0, 1], e.g. 0.95")
    if args.workers < 4 and any(SCENARIOS[s].count("slow=3") for s in args.scenarios):
        p.error(
            f"--workers {args.workers}: the straggler and heterogeneous scenarios slow rank 3; "
            f"use --workers 4 or more, or --scenarios none jitter rare"
        )
    return args


def _settings_from(args):
    """``args`` with the settings of the study in ``args.from_json`` (its runs in ``args.runs``)."""
    try:
        with open(args.from_json) as f:
            data = json.load(f)
        saved, runs = data["settings"], data["runs"]
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(
            f"tfsync.bench convergence: --from-json {args.from_json}: cannot read a study from it ({exc}); "
            "pass a file written by --json"
        )
    for key in ("workers", "epochs", "repeats", "target_accuracy"):
        setattr(args, key, saved[key])
    args.scenarios, args.modes, args.runs = list(saved["scenarios"]), list(saved["modes"]), runs
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        runs = args.runs
    else:
        if not os.path.exists(EXAMPLE):
            sys.exit(f"tfsync.bench convergence: {EXAMPLE} not found; run it from a tfsync checkout")
        runs = run_study(args)
    summary = summarize(runs, args)
    print(format_table(summary, args))
    if args.json and not args.from_json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings(args), "runs": runs, "summary": summary}, f, indent=1)
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        for path in plot(runs, summary, args):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def settings(args):
    return {
        "workers": args.workers,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "target_accuracy": args.target_accuracy,
        "scenarios": {s: SCENARIOS[s] for s in args.scenarios},
        "modes": {m: MODES[m] for m in args.modes},
    }


def run_study(args):
    total = args.repeats * len(args.scenarios) * len(args.modes)
    start, runs, k = time.time(), [], 0
    for repeat in range(args.repeats):
        for scenario in args.scenarios:
            for mode in args.modes:
                k += 1
                result = horovodrun(
                    EXAMPLE,
                    [
                        *MODES[mode],
                        "--epochs",
                        args.epochs,
                        "--stragglers",
                        SCENARIOS[scenario],
                        "--target-accuracy",
                        args.target_accuracy,
                    ],
                    workers=args.workers,
                    timeout_s=args.timeout_s,
                )
                reached = result["time_to_accuracy_s"][str(args.target_accuracy)]
                runs.append({"study_mode": mode, "scenario": scenario, "repeat": repeat, **result})
                print(
                    f"[{k}/{total}] {scenario:13s} {mode:10s} run {repeat + 1} of {args.repeats}: "
                    f"final {result['final_accuracy']:.3f}, "
                    f"{args.target_accuracy} {'not reached' if reached is None else f'in {reached:.1f} s'}, "
                    f"{time.time() - start:.0f} s elapsed"
                    + "".join(
                        f"; epoch {d['epoch']}: {d['profile']} -> {d['mode']}"
                        for i, d in enumerate(result.get("auto_decisions", ()))
                        if i == 0 or d["switched"]
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    return runs


def summarize(runs, args):
    """Per (scenario, mode): medians and spreads; a run that missed the target counts as infinitely slow."""
    key = str(args.target_accuracy)
    summary = []
    for scenario in args.scenarios:
        rows = []
        for mode in args.modes:
            mine = [r for r in runs if r["scenario"] == scenario and r["study_mode"] == mode]
            times = [r["time_to_accuracy_s"][key] for r in mine]
            ranked = [float("inf") if t is None else t for t in times]
            middle = median(ranked)
            rows.append(
                {
                    "scenario": scenario,
                    "mode": mode,
                    "label": mine[0]["mode"],
                    "runs": len(mine),
                    "time_to_target_s": None if middle == float("inf") else middle,
                    "time_to_target_runs_s": times,
                    "reached": sum(t is not None for t in times),
                    "final_accuracy": median([r["final_accuracy"] for r in mine]),
                    "final_accuracy_runs": [r["final_accuracy"] for r in mine],
                    "samples_per_s": median([r["samples_per_s"] for r in mine]),
                    "effective_samples_per_s": median([r["effective_samples_per_s"] for r in mine]),
                    "wall_s": median([r["wall_s"] for r in mine]),
                }
            )
        reached = [r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None]
        best = min(reached) if reached else None
        anchor = next((r["time_to_target_s"] for r in rows if r["mode"] == "horovod"), None)
        for r in rows:
            t = r["time_to_target_s"]
            r["vs_best"] = None if t is None or best is None else t / best
            r["speedup_vs_horovod"] = None if t is None or anchor is None else anchor / t
        summary += rows
    return summary


def format_table(summary, args):
    target = args.target_accuracy
    lines = [
        f"digits, {args.workers} workers, {args.epochs} epochs, {args.repeats} runs each (medians; "
        f"a run that missed {target} counts as slowest)",
        f"| scenario | mode | time to {target} (median) | runs: time to {target} | vs plain Horovod "
        "| vs the scenario's best | final accuracy (median) | samples/s | effective samples/s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        t = r["time_to_target_s"]
        spread = ", ".join("—" if x is None else f"{x:.1f}" for x in r["time_to_target_runs_s"])
        vs_hvd = "—" if r["speedup_vs_horovod"] is None else f"{r['speedup_vs_horovod']:.2f}×"
        vs_best = "—" if r["vs_best"] is None else f"{r['vs_best']:.2f}"
        lines.append(
            f"| {r['scenario']} | {r['label']} | {'not reached' if t is None else f'{t:.1f} s'} | {spread} | "
            f"{vs_hvd} | {vs_best} | {r['final_accuracy']:.3f} | {r['samples_per_s']:.0f} | "
            f"{r['effective_samples_per_s']:.0f} |"
        )
    lines.append("")
    for scenario in args.scenarios:
        rows = [r for r in summary if r["scenario"] == scenario and r["time_to_target_s"] is not None]
        if rows:
            best = min(rows, key=lambda r: r["time_to_target_s"])
            lines.append(f"- {scenario}: fastest to {target} is {best['label']} ({best['time_to_target_s']:.1f} s)")
        else:
            lines.append(f"- {scenario}: no mode reached {target}")
    return "\n".join(lines)


def plot(runs, summary, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # ten distinct hues first (tab20's dark shades), then the light ones
    colours = {m: plt.get_cmap("tab20")((2 * i) % 20 + (2 * i) // 20) for i, m in enumerate(args.modes)}
    label = {r["mode"]: r["label"] for r in summary}
    paths = []

    # accuracy against wall time: a panel per scenario, every run
    n = len(args.scenarios)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, scenario in zip(axes.flat, args.scenarios):
        accuracy_curves(ax, runs, scenario, args.modes, colours, label, args.target_accuracy)
        ax.set_title(f"{scenario}: {SCENARIOS[scenario]}", fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8)
    fig.suptitle(f"digits, {args.workers} workers, {args.epochs} epochs; {args.repeats} run(s) per mode, one line each")
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    paths.append(_save(fig, args.plots, "accuracy_vs_time.png"))

    # time to the target, and final accuracy: grouped bars with the runs' spread
    for name, field, runs_field, ylabel in (
        ("time_to_target.png", "time_to_target_s", "time_to_target_runs_s", f"time to {args.target_accuracy} (s)"),
        ("final_accuracy.png", "final_accuracy", "final_accuracy_runs", "final test accuracy"),
    ):
        fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(args.scenarios) * len(args.modes) * 0.35), 4.2))
        width = 0.8 / len(args.modes)
        ceiling = max((r["wall_s"] for r in summary), default=1.0)
        for j, mode in enumerate(args.modes):
            for i, scenario in enumerate(args.scenarios):
                row = next(x for x in summary if x["scenario"] == scenario and x["mode"] == mode)
                x, name_it = i - 0.4 + width * (j + 0.5), label[mode] if i == 0 else None
                _spread_bar(ax, x, width, row, field, runs_field, ceiling, colours[mode], name_it)
        ax.set_xticks(range(len(args.scenarios)))
        ax.set_xticklabels(args.scenarios)
        ax.set_ylabel(ylabel)
        if field == "final_accuracy":
            ax.set_ylim(0.8, 1.0)
        ax.legend(fontsize=7, ncol=4)
        ax.set_title(
            f"median of {args.repeats} run(s), whiskers: fastest to slowest"
            + ("; hatched: not reached within the budget" if field == "time_to_target_s" else "")
        )
        fig.tight_layout()
        paths.append(_save(fig, args.plots, name))

    # each paper's comparison, where the study ran its scenario and at least two of its modes
    for name, title, scenario, modes, needed in PAPERS:
        modes = [m for m in modes if m in args.modes]
        if scenario not in args.scenarios or len(modes) < needed:
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
        ceiling = max(r["wall_s"] for r in summary if r["scenario"] == scenario)
        accuracy_curves(left, runs, scenario, modes, colours, label, args.target_accuracy)
        for j, mode in enumerate(modes):
            row = next(x for x in summary if x["scenario"] == scenario and x["mode"] == mode)
            _spread_bar(right, j, 0.7, row, "time_to_target_s", "time_to_target_runs_s", ceiling, colours[mode])
        left.legend(fontsize=8)
        right.set_xticks(range(len(modes)))
        right.set_xticklabels([label[m] for m in modes], rotation=20, fontsize=8)
        right.set_ylabel(f"time to {args.target_accuracy} (s)")
        fig.suptitle(f"{title}\n{scenario}: {SCENARIOS[scenario]}; median of {args.repeats} run(s)", fontsize=9)
        fig.tight_layout()
        paths.append(_save(fig, args.plots, f"paper_{name}.png"))
    return paths


def accuracy_curves(ax, runs, scenario, modes, colours, label, target):
    """Accuracy against wall time in ``scenario``: a line per run, a colour per mode."""
    for mode in modes:
        for i, r in enumerate(x for x in runs if x["scenario"] == scenario and x["study_mode"] == mode):
            t, acc = [p[0] for p in r["curve"]], [p[2] for p in r["curve"]]
            ax.plot(t, acc, color=colours[mode], lw=1.2, alpha=0.8, label=label[mode] if i == 0 else None)
    ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set_ylim(0.5, 1.0)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("test accuracy")


def _spread_bar(ax, x, width, row, field, runs_field, ceiling, colour, label=None):
    """``row[field]`` (the median) as a bar with whiskers from the fastest to the slowest run;
    a median or run that missed the target stands at ``ceiling``, the bar hatched."""
    values = [ceiling if v is None else v for v in row[runs_field]]
    middle = ceiling if row[field] is None else row[field]
    yerr = [[middle - min(values)], [max(values) - middle]]
    bar = ax.bar(x, middle, width, color=colour, label=label, yerr=yerr, capsize=2)[0]
    if row[field] is None:
        bar.set_hatch("//")
        bar.set_alpha(0.4)


def _save(fig, directory, name):
    import matplotlib.pyplot as plt

    path = os.path.join(directory, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
