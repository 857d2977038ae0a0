"""``python -m tfsync.demo``: the README's main job, plain Horovod beside tfsync in a few minutes.

Trains ``keras_examples/digits.py`` (scikit-learn's digits, an MLP) with plain
Horovod and with tfsync's answer to each situation: the configurations the mode
registry names for it (``best_for`` in :mod:`tfsync.policies.registry`, from the
measured studies in ``docs/results/``).  The situations:

* ``straggler``: 4 local workers, 20 ms of simulated device time per step, rank 3
  40 ms slower on every step (a persistently slow GPU);
* ``slow-link``: two simulated hosts (network namespaces with their own sshd,
  :class:`tfsync.bench.hosts.Hosts`), one worker each, what each host sends
  limited to :data:`SLOW_LINK` ``rate``, and hidden layers wide enough that the
  exchange, not the compute, sets the pace.  It needs root, ``tc`` and sshd
  (``make install`` installs them); without them the demo says why and shows the
  straggler alone.

It prints one table (time to the target test accuracy, against plain Horovod's;
final accuracy; throughput and what happened to late gradients) and a line per
situation, and writes a PNG of test accuracy against wall time (``--plot``,
default ``build/demo/accuracy_vs_time.png`` in the checkout; its path is printed).

``--all``: the full comparison: plain Horovod, every registered mode at its
defaults and the configurations above, in three scenarios: ``straggler``;
``heterogeneous`` (rank 3 takes twice as long on every step: a slower GPU);
``jitter`` (every step of every worker takes up to 40 ms longer, at random:
noisy neighbours, network hiccups).  About 20 minutes on 2 cores.
"""

import argparse
import contextlib
import json
import os
import sys
import time

from tfsync.bench.digits import BASELINE, EXAMPLE, MODES, SCENARIOS
from tfsync.launch import REPO_ROOT, horovodrun, integer, number, stragglers_spec
from tfsync.policies import registry

ALL_SCENARIOS = ("straggler", "heterogeneous", "jitter")
SITUATIONS = ("straggler", "slow-link")
# The slow link: 2 hosts x 1 worker, hidden 2048 2048 (4.3M parameters: about 140 ms of allreduce a
# step at 1gbit against a few ms of compute), SGD at 0.1, batch 16 per worker
SLOW_LINK = {"rate": "1gbit", "hidden": [2048, 2048], "epochs": 6, "lr": 0.1}
LAUNCH_TIMEOUT_S = 900


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--all",
        action="store_true",
        help="the full comparison: every mode beside plain Horovod in three straggler scenarios (about 20 minutes)",
    )
    p.add_argument(
        "--situations",
        nargs="+",
        default=list(SITUATIONS),
        choices=SITUATIONS,
        help="(without --all) which situations to show (default: both)",
    )
    p.add_argument("--workers", type=integer(2), default=4, help="local workers (2 or more: the modes compare them)")
    p.add_argument("--epochs", type=integer(1), default=12, help="epochs of every local run")
    p.add_argument("--staleness", type=integer(0), default=3, help="SSP's bound s")
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=None,
        choices=list(SCENARIOS),
        help=f"(--all) default: {' '.join(ALL_SCENARIOS)}",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=list(MODES),
        help="the modes of the local runs (default: plain Horovod and the registry's answer to the situation; "
        "with --all, plain Horovod and every mode)",
    )
    p.add_argument(
        "--stragglers",
        type=stragglers_spec,
        default=None,
        help="run one custom local scenario with this straggler spec instead (no slow link)",
    )
    p.add_argument(
        "--target-accuracy",
        type=number(above=0, maximum=1),
        nargs="+",
        default=None,
        help="test accuracies to time (default: 0.95; with --all, 0.9 and 0.95)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument(
        "--plot",
        metavar="PATH",
        default=os.path.join(REPO_ROOT, "build", "demo", "accuracy_vs_time.png"),
        help="the PNG of test accuracy against wall time (default: %(default)s)",
    )
    args = p.parse_args(argv)
    if args.scenarios and not args.all:
        p.error("--scenarios chooses --all's scenarios; add --all, or use --situations without it")
    if args.stragglers:  # a slow rank the job does not have would simulate nothing
        from tfsync.stragglers import Stragglers

        try:
            Stragglers.parse(args.stragglers).validate(args.workers)
        except ValueError as exc:
            p.error(f"argument --stragglers: {exc}")
    elif "straggler" in ((args.scenarios or ALL_SCENARIOS) if args.all else args.situations) and args.workers < 4:
        p.error(f"--workers {args.workers}: the straggler scenario slows rank 3; use --workers 4 or more")
    args.target_accuracy = args.target_accuracy or ([0.9, 0.95] if args.all else [0.95])
    return args


def main(argv=None):
    args = parse_args(argv)
    if not os.path.exists(EXAMPLE):
        sys.exit(
            f"tfsync.demo: {EXAMPLE} not found; run the demo from a tfsync checkout "
            "(pip install -e . keeps the examples next to the package)"
        )
    flags = {**MODES, **registry.configurations(staleness=args.staleness)}  # (SSP's bound: --staleness)
    start, rows = time.time(), []
    for scenario, (spec, modes) in local_plan(args).items():
        for mode in modes:
            log(f"training digits with {mode.upper()} on {args.workers} workers ({scenario}: {spec})...")
            argv = [*flags[mode], "--epochs", args.epochs, "--stragglers", spec]
            row = horovodrun(
                EXAMPLE, [*argv, "--target-accuracy", *args.target_accuracy], args.workers, LAUNCH_TIMEOUT_S
            )
            rows.append({"scenario": scenario, "stragglers": spec, "config": mode, **row})
    if not (args.all or args.stragglers) and "slow-link" in args.situations:
        rows += slow_link(args)
    compare_with_baseline(rows, max(args.target_accuracy))
    print(format_table(rows, args))
    print(format_summary(rows, max(args.target_accuracy)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args, args.plot)
        print(f"tfsync.demo: wrote {os.path.abspath(args.plot)} (test accuracy against wall time)")
    log(f"done in {time.time() - start:.0f} s")
    return 0


def local_plan(args):
    """scenario -> (straggler spec, the configurations to run) of the local runs: plain Horovod and
    the registry's answer to a straggler (``best_for``), or with ``--all`` every mode, or ``--modes``."""
    if args.stragglers:
        scenarios = {"custom": args.stragglers}
    elif args.all:
        scenarios = {s: SCENARIOS[s] for s in args.scenarios or ALL_SCENARIOS}
    else:
        scenarios = {"straggler": SCENARIOS["straggler"]} if "straggler" in args.situations else {}
    if args.modes:
        modes = list(args.modes)
    elif args.all:
        modes = [BASELINE, *all_modes()]
    else:
        modes = [BASELINE, *registry.best_for("straggler")]
    return {scenario: (spec, modes) for scenario, spec in scenarios.items()}


def all_modes():
    """``--all``'s modes: every registered mode at its defaults, and every configuration the registry
    names as the answer to a situation the local runs show."""
    return list(dict.fromkeys([m.name for m in registry.modes()] + registry.best_for("straggler")))


def log(line):
    print(f"tfsync.demo: {line}", file=sys.stderr, flush=True)


def __getattr__(name):
    if name == "DEMO_MODES":  # (read when asked: a mode registered later is in it)
        return tuple(all_modes())
    raise AttributeError(f"module 'tfsync.demo' has no attribute {name!r}")


def slow_link(args):
    """Plain Horovod and the registry's answer to a slow link, one worker on each of two simulated
    hosts (python -m tfsync.bench network --task digits); [] with the reason printed where the
    hosts cannot be made (not root, no network namespaces, no sshd)."""
    from tfsync.bench import network
    from tfsync.bench.hosts import Hosts

    modes = slow_link_modes()
    target = max(args.target_accuracy)
    bench_args = network.parse_args(
        [
            *("--task", "digits", "--rates", SLOW_LINK["rate"], "--modes", *modes),
            *("--hidden", *map(str, SLOW_LINK["hidden"]), "--epochs", str(SLOW_LINK["epochs"])),
            *("--lr", str(SLOW_LINK["lr"]), "--target-accuracy", str(target)),
            *("--timeout-s", str(LAUNCH_TIMEOUT_S)),
        ]
    )
    with contextlib.ExitStack() as stack:
        try:
            hosts = stack.enter_context(Hosts(2))
        except (RuntimeError, OSError) as exc:
            log(
                f"the slow-link situation is left out: the two simulated hosts could not be made ({exc}). "
                "It needs root, iproute2 (ip, tc), util-linux (unshare) and openssh-server: run the demo as root "
                "after `make install`"
            )
            return []
        spec = f"2 hosts x 1 worker, {SLOW_LINK['rate']} link, hidden {' '.join(map(str, SLOW_LINK['hidden']))}"
        log(f"training digits across a slow link ({spec}) with {', '.join(m.upper() for m in modes)}...")
        records = network.run(hosts, bench_args, log=log)
    return [{"scenario": "slow-link", "stragglers": spec, "config": r["key"], **r} for r in records]


def slow_link_modes():
    """Plain Horovod and the registry's answer to a slow link (``best_for``)."""
    return [BASELINE, *registry.best_for("slow-link")]


def compare_with_baseline(rows, target):
    """Each row's time to ``target`` against plain Horovod's in the same scenario (``speedup``)."""
    for r in rows:
        base = next((b for b in rows if b["scenario"] == r["scenario"] and b["config"] == BASELINE), None)
        mine = r["time_to_accuracy_s"].get(str(target))
        theirs = None if base is None else base["time_to_accuracy_s"].get(str(target))
        r["speedup_vs_horovod"] = None if mine is None or theirs is None else theirs / mine


def format_table(rows, args):
    targets = [str(t) for t in args.target_accuracy]
    lines = [
        f"digits, {args.epochs} epochs on {args.workers} local workers"
        + (f", {SLOW_LINK['epochs']} across the slow link" if any(r["scenario"] == "slow-link" for r in rows) else "")
        + "; "
        + "; ".join(sorted({f"{r['scenario']}: {r['stragglers']}" for r in rows})),
        "| scenario | mode | samples/s | effective samples/s | compensated | dropped | skipped | wait fraction | "
        + " | ".join(f"time to {t} test accuracy" for t in targets)
        + f" | final test accuracy | replicas identical | time to {max(args.target_accuracy)} vs plain Horovod |",
        "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(targets) + "---:|---|---:|",
    ]
    for r in rows:
        reached = [_seconds(r["time_to_accuracy_s"].get(t), t in r["time_to_accuracy_s"]) for t in targets]
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {r['samples_per_s']:.0f} | "
            f"{r['effective_samples_per_s']:.0f} | {r['compensated']} | {r['dropped']} | {r['skipped']} | "
            + ("—" if r["wait_fraction"] is None else f"{r['wait_fraction']:.2f}")
            + " | "
            + " | ".join(reached)
            + f" | {r['final_accuracy']:.3f} | {r['replicas_identical']} | "
            + _against_baseline(r)
            + " |"
        )
    return "\n".join(lines)


def _against_baseline(row):
    speedup = row["speedup_vs_horovod"]
    if speedup is None:
        return "—"
    if row["config"] == BASELINE:
        return "1.00× (the reference)"
    return f"{speedup:.2f}× faster" if speedup >= 1 else f"{1 / speedup:.2f}× slower"


def _seconds(value, measured):
    if not measured:
        return "—"
    return "not reached" if value is None else f"{value:.1f} s"


def format_summary(rows, target):
    """A line per scenario: the fastest to ``target`` against plain Horovod."""
    lines = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        mine = [r for r in rows if r["scenario"] == scenario]
        base = next((r for r in mine if r["config"] == BASELINE), None)
        timed = [r for r in mine if r["config"] != BASELINE and r["time_to_accuracy_s"].get(str(target)) is not None]
        if not timed:
            lines.append(f"- {scenario}: no tfsync mode reached {target}")
            continue
        best = min(timed, key=lambda r: r["time_to_accuracy_s"][str(target)])
        line = f"- {scenario}: {best['mode']} reached {target} in {best['time_to_accuracy_s'][str(target)]:.1f} s"
        if base is not None:
            theirs = base["time_to_accuracy_s"].get(str(target))
            line += (
                f"; plain Horovod did not within {base['wall_s']:.0f} s"
                if theirs is None
                else f", plain Horovod in {theirs:.1f} s ({best['speedup_vs_horovod']:.2f}× faster)"
            )
            line += f"; final accuracy {best['final_accuracy']:.3f} against {base['final_accuracy']:.3f}"
        lines.append(line)
    return "\n".join(lines)


def plot(rows, args, path):
    """Test accuracy against wall time: a panel per scenario, a line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfsync.bench.convergence import accuracy_curves

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    colours = {m: plt.get_cmap("tab20")((2 * i) % 20 + (2 * i) // 20) for i, m in enumerate(configs)}
    labels = {r["config"]: "plain Horovod" if r["config"] == BASELINE else f"tfsync {r['mode']}" for r in rows}
    runs = [{**r, "study_mode": r["config"]} for r in rows]
    cols = min(len(scenarios), 3)
    fig, axes = plt.subplots((len(scenarios) + cols - 1) // cols, cols, figsize=(6.0 * cols, 4.2), squeeze=False)
    for ax, scenario in zip(axes.flat, scenarios):
        mine = [c for c in configs if any(r["scenario"] == scenario and r["config"] == c for r in rows)]
        accuracy_curves(ax, runs, scenario, mine, colours, labels, max(args.target_accuracy))
        spec = next(r["stragglers"] for r in rows if r["scenario"] == scenario)
        ax.set_title(f"{scenario}: {spec}", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    for ax in list(axes.flat)[len(scenarios) :]:
        ax.axis("off")
    fig.suptitle("digits: test accuracy against wall time (dotted: the target)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
