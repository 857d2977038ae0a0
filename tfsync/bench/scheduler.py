"""Benchmark of the ElasticBSP barrier decision: the paper's Table 4 and Fig. 10.

``python -m tfsync.bench scheduler [--json PATH] [--plot PATH] [--quick]``

Times :func:`tfsync.scheduler.zipline` (the public entry point, validation
included) for every algorithm, compiled and plain-Python reference, on the
synthetic data of Section 6.1 of Zhao et al. (iteration intervals uniform in
1000-1500 ms, start offsets uniform in 10-50 ms, fixed seed), for
n in {4, 8, 16, 100, 200, 1000, 5000} and R in {15, 150}.  A NumPy sort of
the same n * R stamps is timed in the same run as the floor.  Cells whose
single call is predicted (from the algorithm's complexity and its time at the
previous n) to exceed the time limit are skipped and shown as "—" with the
reason in a footnote, never with an invented number.
"""

import argparse
import json
import math
import platform
import statistics
import sys
import time

import numpy as np

from tfsync.launch import number
from tfsync.scheduler import EXACT_ALGORITHMS, zipline

WORKER_COUNTS = (4, 8, 16, 100, 200, 1000, 5000)
LOOKAHEADS = (15, 150)
QUICK_WORKER_COUNTS = (4, 16, 100)
SEED = 2021
FLOOR = "numpy_sort"

# Cost models used only to predict whether a call would exceed the time limit.
COST_MODEL = {
    "zipline": lambda n, R: R * n * n,
    "zipline_opt": lambda n, R: R * n * n,
    "optbs": lambda n, R: R * n * math.log2(n + 1),
    "gridscan": lambda n, R: R * R * n,
    "fullgridscan": lambda n, R: R * R * n * n,
    FLOOR: lambda n, R: R * n * math.log2(n * R + 1),
}
LABELS = {
    "optbs": "ZipLineOptBS",
    "zipline_opt": "ZipLineOpt",
    "zipline": "ZipLine",
    "gridscan": "GridScan",
    "fullgridscan": "FullGridScan",
    FLOOR: "NumPy sort (floor)",
}
TARGETS_MS = {("optbs", 1000, 15): 0.25, ("optbs", 1000, 150): 2.5}


def synthetic_end_times(n, R, seed=SEED):
    """Section 6.1: e_j^p = j * i_p + s_p, i_p ~ U(1000, 1500) ms, s_p ~ U(10, 50) ms."""
    rng = np.random.default_rng(seed)
    interval_ms = rng.uniform(1000.0, 1500.0, n)
    start_ms = rng.uniform(10.0, 50.0, n)
    return start_ms[:, None] + interval_ms[:, None] * np.arange(1, R + 1)[None, :]


def _time_call(call, repeats, min_repeat_s):
    """Median seconds per call over ``repeats`` timed batches (a batch lasts >= min_repeat_s)."""
    start = time.perf_counter()
    call()
    single = time.perf_counter() - start
    number = max(1, int(min_repeat_s / max(single, 1e-7)))
    if single > 1.0:
        repeats = 1
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            call()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples), len(samples) * number


def _entries(include_reference):
    entries = [("numpy", FLOOR)]
    entries += [("compiled", a) for a in ("optbs", "zipline_opt", "zipline", "gridscan", "fullgridscan")]
    if include_reference:
        entries += [("reference", a) for a in ("optbs", "zipline_opt", "zipline", "gridscan", "fullgridscan")]
    return entries


def run(worker_counts, lookaheads, limit_s, repeats, min_repeat_s, include_reference=True, log=print):
    records = []
    for R in lookaheads:
        last_measured = {}  # (implementation, algorithm) -> (n, seconds)
        for n in worker_counts:
            matrix = synthetic_end_times(n, R)
            flat = matrix.reshape(-1)
            for implementation, algorithm in _entries(include_reference):
                record = {
                    "algorithm": algorithm,
                    "implementation": implementation,
                    "n": n,
                    "R": R,
                    "microseconds": None,
                    "wait": None,
                    "t_sync": None,
                    "calls": 0,
                    "skipped": None,
                }
                previous = last_measured.get((implementation, algorithm))
                if previous is not None:
                    prev_n, prev_s = previous
                    model = COST_MODEL[algorithm]
                    predicted = prev_s * model(n, R) / model(prev_n, R)
                    if predicted > limit_s:
                        record["skipped"] = (
                            f"about {predicted:.0f} s per call, predicted from "
                            f"{prev_s * 1e3:.3g} ms at n={prev_n} by "
                            f"its cost model; limit {limit_s:g} s"
                        )
                        records.append(record)
                        continue
                if algorithm == FLOOR:
                    call = lambda flat=flat: np.sort(flat)
                else:
                    call = lambda: zipline(matrix, algorithm, implementation=implementation)  # noqa: B023 (called in this iteration)
                    result = call()
                    record["wait"] = float(result.wait)
                    record["t_sync"] = float(result.t_sync)
                seconds, calls = _time_call(call, repeats, min_repeat_s)
                record["microseconds"] = seconds * 1e6
                record["calls"] = calls
                last_measured[(implementation, algorithm)] = (n, seconds)
                records.append(record)
            log(f"  R={R} n={n}: done")
    return records


def _name(record):
    label = LABELS[record["algorithm"]]
    return label + (" (Python)" if record["implementation"] == "reference" else "")


def format_tables(records):
    lines = []
    footnotes = []
    for R in sorted({r["R"] for r in records}):
        subset = [r for r in records if r["R"] == R]
        ns = sorted({r["n"] for r in subset})
        names = list(dict.fromkeys(_name(r) for r in subset))
        width = max(len(x) for x in names) + 2
        lines.append(f"R = {R}: microseconds per decision (median)")
        lines.append("algorithm".ljust(width) + "".join(f"{'n=' + str(n):>12}" for n in ns))
        for name in names:
            cells = []
            for n in ns:
                record = next(r for r in subset if _name(r) == name and r["n"] == n)
                if record["microseconds"] is None:
                    footnotes.append(f"{name}, n={n}, R={R}: {record['skipped']}")
                    cells.append(f"{'—[' + str(len(footnotes)) + ']':>12}")
                else:
                    cells.append(f"{_format_us(record['microseconds']):>12}")
            lines.append(name.ljust(width) + "".join(cells))
        lines.append("")
        lines.append(
            f"R = {R}: predicted wait d_Z* in ms (exact algorithms agree: "
            f"{'yes' if _exact_agree(subset) else 'NO'})"
        )
        lines.append("algorithm".ljust(width) + "".join(f"{'n=' + str(n):>12}" for n in ns))
        for algorithm in ("optbs", "gridscan"):
            cells = []
            for n in ns:
                waits = [
                    r["wait"] for r in subset if r["algorithm"] == algorithm and r["n"] == n and r["wait"] is not None
                ]
                cells.append(f"{waits[0]:>12.2f}" if waits else f"{'—':>12}")
            lines.append(LABELS[algorithm].ljust(width) + "".join(cells))
        lines.append("")
    if footnotes:
        lines.append("— not run:")
        lines += [f"  [{i}] {text}" for i, text in enumerate(footnotes, 1)]
    return "\n".join(lines)


def _format_us(us):
    return f"{us:.1f}" if us < 1e4 else f"{us:.3g}"


def _exact_agree(records):
    by_size = {}
    for r in records:
        if r["algorithm"] in EXACT_ALGORITHMS and r["wait"] is not None:
            by_size.setdefault(r["n"], set()).add((r["wait"], r["t_sync"]))
    return all(len(v) == 1 for v in by_size.values())


def _lookup(records, implementation, algorithm, n, R):
    for r in records:
        if (r["implementation"], r["algorithm"], r["n"], r["R"]) == (implementation, algorithm, n, R):
            return r["microseconds"]
    return None


def format_targets(records):
    lines = ["Targets:"]
    for (algorithm, n, R), target_ms in TARGETS_MS.items():
        us = _lookup(records, "compiled", algorithm, n, R)
        floor = _lookup(records, "numpy", FLOOR, n, R)
        if us is None:
            continue
        verdict = "met" if us / 1e3 <= target_ms else "MISSED"
        ratio = f", {us / floor:.2f}x the NumPy sort" if floor else ""
        lines.append(
            f"  {LABELS[algorithm]} n={n} R={R}: {us / 1e3:.3f} ms " f"(target <= {target_ms} ms: {verdict}{ratio})"
        )
    us = _lookup(records, "compiled", "optbs", 1000, 15)
    reference = _lookup(records, "reference", "zipline", 1000, 15)
    if us and reference:
        verdict = "met" if reference / us >= 100 else "MISSED"
        lines.append(
            f"  ZipLineOptBS vs Python ZipLine at n=1000 R=15: {reference / us:.0f}x "
            f"faster (target >= 100x: {verdict})"
        )
    return "\n".join(lines) if len(lines) > 1 else ""


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lookaheads = sorted({r["R"] for r in records})
    figure, axes = plt.subplots(1, len(lookaheads), figsize=(6 * len(lookaheads), 4.5), squeeze=False)
    for axis, R in zip(axes[0], lookaheads):
        subset = [r for r in records if r["R"] == R and r["microseconds"] is not None]
        for name in dict.fromkeys(_name(r) for r in subset):
            points = sorted((r["n"], r["microseconds"]) for r in subset if _name(r) == name)
            implementation = next(r["implementation"] for r in subset if _name(r) == name)
            style = {"numpy": ":", "compiled": "-", "reference": "--"}[implementation]
            axis.plot(*zip(*points), style, marker="o", markersize=3, label=name)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("workers n")
        axis.set_ylabel("microseconds per decision")
        axis.set_title(f"R = {R}")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    figure.suptitle("ZipLine decision time vs number of workers (cf. Fig. 10)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tfsync.bench scheduler",
        description="Time the ElasticBSP barrier decision (ZipLine and baselines) on the "
        "paper's synthetic data (Table 4, Fig. 10).",
    )
    parser.add_argument("--json", metavar="PATH", help="write the records as JSON to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a log-log plot of time vs n to PATH")
    parser.add_argument(
        "--quick", action="store_true", help=f"n in {QUICK_WORKER_COUNTS} only, fewer repeats (a smoke run)"
    )
    parser.add_argument(
        "--limit-s",
        type=number(above=0),
        default=None,
        help="skip cells whose single call is predicted to exceed this " "(default 10, quick 0.5)",
    )
    args = parser.parse_args(argv)

    quick = args.quick
    limit_s = args.limit_s if args.limit_s is not None else (0.5 if quick else 10.0)
    started = time.perf_counter()
    records = run(
        QUICK_WORKER_COUNTS if quick else WORKER_COUNTS,
        LOOKAHEADS,
        limit_s,
        repeats=3 if quick else 7,
        min_repeat_s=0.002 if quick else 0.02,
        log=lambda msg: print(msg, file=sys.stderr),
    )
    elapsed = time.perf_counter() - started
    print(format_tables(records))
    targets = format_targets(records)
    if targets:
        print(targets)
    print(f"(seed {SEED}; whole run {elapsed:.0f} s)")
    if args.json:
        payload = {
            "benchmark": "scheduler",
            "seed": SEED,
            "quick": quick,
            "limit_s": limit_s,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "machine": platform.machine(),
            "elapsed_s": elapsed,
            "records": records,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    if args.plot:
        plot(records, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
