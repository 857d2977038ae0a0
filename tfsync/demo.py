"""``python -m tfsync.demo``: the README's main job.

Trains ``keras_examples/digits.py`` on 4 local workers over Gloo under BSP,
SSP (s = 3 and 15), DSSP (s in [3, 15]), ElasticBSP, PSP, backup workers
(dropping late gradients, and compensating them: backup+dc) and DC-S3GD, in
three straggler scenarios, and prints
one comparison table (samples/s, effective samples/s, i.e. those whose
gradients were applied, as they were or delay-compensated; compensated and
dropped contributions and skipped steps, wait fraction, time to target test
accuracies, final accuracy):

* ``straggler``: rank 3 is 40 ms slower on every step (a persistently slow GPU);
* ``heterogeneous``: rank 3 takes twice as long on every step (a slower GPU);
* ``jitter``: every step of every worker takes up to 40 ms longer, at random
  (transient stragglers: noisy neighbours, network hiccups).

Every worker spends 20 ms of simulated device time per step.
"""

import argparse
import json
import os
import sys

from tfsync.launch import REPO_ROOT, horovodrun, integer, number, stragglers_spec
from tfsync.policies import registry

EXAMPLE = os.path.join(REPO_ROOT, "keras_examples", "digits.py")
# mode -> the example's flags: every registered mode and named variant (tfsync.policies.registry;
# psp+dc, backup+dc: late gradients compensated instead of dropped), plus plain Horovod BSP
# (the anchor of python -m tfsync.bench convergence) and auto
MODES = {"horovod": ["--plain-horovod"], **registry.configurations(), "auto": ["--mode", "auto"]}
SCENARIOS = {
    "none": "base=0.02,seed=1",
    "straggler": "base=0.02,slow=3:0.04,seed=1",
    "heterogeneous": "base=0.02,slow=3:0.02,seed=1",
    "jitter": "base=0.02,jitter=0.04,seed=1",
    # the PSP paper's rare large delays: about 4 events per worker in a 12-epoch run of 264 steps
    "rare": "base=0.02,rare=0.015:0.5,seed=1",
    # the PSP paper's simulation itself: a block of a round's result reaches a worker 0.5 s late,
    # about 4 times per worker in a 12-epoch run (264 rounds of 4 blocks)
    "rare-pull": "base=0.02,pull=0.004:0.5,seed=1",
}
DEMO_SCENARIOS = ("straggler", "heterogeneous", "jitter")
DEMO_MODES = (
    "bsp",
    "ssp",
    "ssp(s=15)",
    "dssp",
    "elasticbsp",
    "psp",
    "backup",
    "backup+dc",
    "dcs3gd",
    "localsgd",
    "diloco",
)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tfsync.demo", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=integer(2), default=4, help="local workers (2 or more: the modes compare them)")
    p.add_argument("--epochs", type=integer(1), default=12)
    p.add_argument("--staleness", type=integer(0), default=3, help="SSP's bound s")
    p.add_argument("--scenarios", nargs="+", default=list(DEMO_SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--modes", nargs="+", default=list(DEMO_MODES), choices=list(MODES))
    p.add_argument(
        "--stragglers",
        type=stragglers_spec,
        default=None,
        help="run one custom scenario with this straggler spec instead",
    )
    p.add_argument("--target-accuracy", type=number(above=0, maximum=1), nargs="+", default=[0.9, 0.95])
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if args.stragglers:  # a slow rank the job does not have would simulate nothing
        from tfsync.stragglers import Stragglers

        try:
            Stragglers.parse(args.stragglers).validate(args.workers)
        except ValueError as exc:
            p.error(f"argument --stragglers: {exc}")
    if not os.path.exists(EXAMPLE):
        sys.exit(
            f"tfsync.demo: {EXAMPLE} not found; run the demo from a tfsync checkout "
            "(pip install -e . keeps the examples next to the package)"
        )
    scenarios = {"custom": args.stragglers} if args.stragglers else {k: SCENARIOS[k] for k in args.scenarios}
    flags = {**MODES, **registry.configurations(staleness=args.staleness)}  # (SSP's bound: --staleness)
    rows = []
    for scenario, spec in scenarios.items():
        for mode in args.modes:
            print(
                f"tfsync.demo: training digits with {mode.upper()} on {args.workers} workers "
                f"({scenario}: {spec})...",
                file=sys.stderr,
                flush=True,
            )
            row = horovodrun(
                EXAMPLE,
                [
                    *flags[mode],
                    "--epochs",
                    args.epochs,
                    "--stragglers",
                    spec,
                    "--target-accuracy",
                    *args.target_accuracy,
                ],
                workers=args.workers,
                timeout_s=900,
            )
            rows.append({"scenario": scenario, "stragglers": spec, **row})
    print(format_table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def format_table(rows, args):
    targets = list(rows[0]["time_to_accuracy_s"])
    lines = [
        f"digits, {args.workers} workers, {args.epochs} epochs; "
        + "; ".join(sorted({f"{r['scenario']}: {r['stragglers']}" for r in rows})),
        "| scenario | mode | samples/s | effective samples/s | compensated | dropped | skipped | wait fraction | "
        + " | ".join(f"time to {t} test accuracy" for t in targets)
        + " | final test accuracy | replicas identical |",
        "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(targets) + "---:|---|",
    ]
    for r in rows:
        reached = [
            "not reached" if r["time_to_accuracy_s"][t] is None else f"{r['time_to_accuracy_s'][t]:.1f} s"
            for t in targets
        ]
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {r['samples_per_s']:.0f} | "
            f"{r['effective_samples_per_s']:.0f} | {r['compensated']} | {r['dropped']} | {r['skipped']} | "
            + ("—" if r["wait_fraction"] is None else f"{r['wait_fraction']:.2f}")
            + " | "
            + " | ".join(reached)
            + f" | {r['final_accuracy']:.3f} | {r['replicas_identical']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
