"""``python -m tfsync.demo``: the README's main job.

Trains ``keras_examples/digits.py`` on 4 local workers over Gloo, one of them a
straggler, under BSP and under SSP, and prints one comparison table
(samples/s, wait fraction, time to the target test accuracy, final accuracy).
"""
import argparse
import json
import os
import sys

from tfsync.launch import REPO_ROOT, horovodrun

EXAMPLE = os.path.join(REPO_ROOT, "keras_examples", "digits.py")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tfsync.demo", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--staleness", type=int, default=3)
    p.add_argument("--stragglers", default="base=0.02,slow=3:0.04,seed=1",
                   help="straggler spec (default: 20 ms device time, rank 3 40 ms slower)")
    p.add_argument("--target-accuracy", type=float, default=0.95)
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    if not os.path.exists(EXAMPLE):
        sys.exit(f"tfsync.demo: {EXAMPLE} not found; run the demo from a tfsync checkout "
                 "(pip install -e . keeps the examples next to the package)")
    rows = []
    for mode in ("bsp", "ssp"):
        print(f"tfsync.demo: training digits with {mode.upper()} on {args.workers} workers "
              f"({args.stragglers})...", file=sys.stderr, flush=True)
        rows.append(horovodrun(EXAMPLE, [
            "--mode", mode, "--staleness", args.staleness, "--epochs", args.epochs,
            "--stragglers", args.stragglers, "--target-accuracy", args.target_accuracy],
            workers=args.workers, timeout_s=900))
    print(format_table(rows, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def format_table(rows, args):
    lines = [f"digits, {args.workers} workers, stragglers: {args.stragglers}",
             f"| mode | samples/s | wait fraction | time to {args.target_accuracy:.2f} accuracy | "
             "final test accuracy | replicas identical |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        reached = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"
        lines.append(f"| {r['mode']} | {r['samples_per_s']:.0f} | {r['wait_fraction']:.2f} | "
                     f"{reached} | {r['final_accuracy']:.3f} | {r['replicas_identical']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
