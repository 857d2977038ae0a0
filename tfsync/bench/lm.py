"""``python -m tfsync.bench lm``: a language model's validation loss against wall time and bytes.

Trains ``keras_examples/text_lm.py`` (a byte-level decoder-only transformer on the
interpreter's standard library) with two workers to the same token budget under plain
Horovod and each method of ``--methods``, on the links of ``--links``:

* ``none``: one host, both workers on this machine (Horovod over the loopback);
* a ``tc`` rate (``300mbit``, ``1gbit``): two simulated hosts, one worker each, what each
  host sends limited to that rate (:class:`tfsync.bench.hosts.Hosts`, as
  ``python -m tfsync.bench network`` runs; needs root).

The methods are ``horovod`` (plain Horovod, the anchor), the registry's modes and named
variants (``bsp``, ``localsgd``, ``diloco``, ``diloco+int8``, ``diloco+int4``,
``diloco+fragments``, ``diloco+overlap``, ...: :func:`tfsync.policies.registry.configurations`,
with ``--inner-steps`` as Local SGD's and DiLoCo's H) and ``floor``: every worker trains
alone and the replicas are averaged once, at the end (Local SGD with H = the run's steps),
whose time per step is the compute a step costs where nothing crosses the link.  Every
method trains the example with the same flags (the options this command does not know go
to the example: ``--epochs 6 --steps-per-epoch 50``), so the same tokens, model, data and
inner optimizer; run ``r`` of every method uses ``--seed r``.  ``--repeats N`` runs the
methods of ``--repeat-methods`` (default: all) N times, interleaved (repeat, then method),
so that a slow spell of the shared machine hits every method.

Per (link, method) the summary has the median run's final validation loss, wall time,
bytes this worker sent and tokens/s, against plain Horovod's at that link: the loss ratio,
the wall-time ratio, Horovod's bytes over the method's, and when the method's validation
loss first came within 2 % and 3 % of plain Horovod's final one (at an evaluation: the
curve is sampled after every epoch), as a share of Horovod's wall time.  Writes:

* ``--json PATH``: the settings, every run (the example's record with its curve) and the summary;
* ``--plots DIR``: ``loss_vs_time.png``, ``loss_vs_bytes.png`` and ``loss_vs_tokens.png``
  (a panel per link, a line per run, a colour per method).

``--from-json A.json B.json ...`` merges earlier runs (one file per link, say, each written
while holding the machine) and prints the table and draws the plots without training.

Example:

    python -m tfsync.bench lm --links none 300mbit 1gbit --json lm.json --plots plots/
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from tfsync.bench.convergence import _save
from tfsync.bench.network import rate
from tfsync.launch import REPO_ROOT, horovodrun, integer, number, results_in
from tfsync.policies import registry

EXAMPLE = os.path.join(REPO_ROOT, "keras_examples", "text_lm.py")
BASELINE = "horovod"
FLOOR = "floor"
DEFAULT_METHODS = (BASELINE, "bsp", "localsgd", "diloco", "diloco+int8", "diloco+int4", "diloco+fragments")
DEFAULT_METHODS += ("diloco+overlap", FLOOR)
ONE_HOST = "none"
TOLERANCES = (0.02, 0.03)  # "within 2 % (3 %) of plain Horovod's final validation loss"
LINK_SAMPLE_S = 1.0


def configurations(inner_steps):
    """Every method's flags for the example: plain Horovod, every registered mode and variant
    (Local SGD's and DiLoCo's H = ``inner_steps``); the floor's flags need the run's steps."""
    return {BASELINE: ["--plain-horovod"], **registry.configurations(period=inner_steps, inner_steps=inner_steps)}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.bench lm", description=__doc__.splitlines()[0])
    p.add_argument(
        "--links",
        type=lambda raw: raw if raw == ONE_HOST else rate(raw),
        nargs="+",
        default=[ONE_HOST],
        help="'none': both workers on this host; a tc rate (300mbit, 1gbit): two simulated hosts, one worker each, "
        "the link shaped to it (default: none)",
    )
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help="(default: %(default)s)")
    p.add_argument("--inner-steps", type=integer(1), default=8, help="Local SGD's and DiLoCo's H (default 8)")
    p.add_argument("--repeats", type=integer(1), default=1, help="runs of each method in --repeat-methods")
    p.add_argument("--repeat-methods", nargs="+", default=None, help="the methods --repeats applies to (default: all)")
    p.add_argument("--timeout-s", type=number(above=0), default=1800.0, help="bound of one launch (default 1800)")
    p.add_argument("--json", help="write the settings, every run and the summary here")
    p.add_argument("--plots", help="write the plots into this directory")
    p.add_argument("--from-json", nargs="+", default=None, help="merge these studies' runs instead of training")
    args, example = p.parse_known_args(argv)
    known = [*configurations(args.inner_steps), FLOOR]
    unknown = [m for m in args.methods + (args.repeat_methods or []) if m not in known]
    if unknown:
        p.error(f"--methods: {', '.join(unknown)} unknown; choose from {', '.join(known)}")
    args.example = example
    if args.from_json is None:
        args.example_args = _example_args(example)  # a bad example flag stops here, before any launch
    return args


def _example_args(flags):
    """The example's parsed command line for ``flags`` (it exits with its usage line on a bad one)."""
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    try:
        import text_lm
    finally:
        sys.path.pop(0)
    return text_lm.parse_args(flags)


def method_flags(method, args):
    if method == FLOOR:  # one average, after the last step: nothing crosses the link before it
        steps = args.example_args.epochs * args.example_args.steps_per_epoch
        return ["--mode", "localsgd", "--period", str(steps)]
    return configurations(args.inner_steps)[method]


def run_study(args, log):
    """Every (link, repeat, method); the runs, each the example's record with ``link``,
    ``method`` and ``repeat``."""
    repeated = set(args.repeat_methods or args.methods)
    plan = [(r, m) for r in range(args.repeats) for m in args.methods if r == 0 or m in repeated]
    shaped = [link for link in args.links if link != ONE_HOST]
    runs, start = [], time.time()
    with contextlib.ExitStack() as stack:
        if shaped:
            from tfsync.bench.hosts import Hosts

            hosts = stack.enter_context(Hosts(2))
        for link in args.links:
            if shaped:
                for i in (1, 2):
                    hosts.shape_link(i, None if link == ONE_HOST else link)
            for k, (repeat, method) in enumerate(plan, start=1):
                argv = [*method_flags(method, args), *args.example, "--seed", str(repeat)]
                if link == ONE_HOST:
                    result = horovodrun(EXAMPLE, argv, workers=2, timeout_s=args.timeout_s)
                else:
                    result = _across(hosts, argv, args.timeout_s, f"{method} at {link}")
                runs.append({"link": link, "method": method, "repeat": repeat, **result})
                log(
                    f"[{link} {k}/{len(plan)}] {method:18s} run {repeat + 1}: val loss {result['val_loss']:.4f}, "
                    f"{result['wall_s']:.1f} s, {result['bytes_sent'] / 1e6:.1f} MB sent, "
                    f"{time.time() - start:.0f} s elapsed"
                )
    return runs


def _across(hosts, argv, timeout_s, what):
    """One launch from host 1 across the two hosts, one worker each; its record, with what host 1
    put on the link during the whole launch (``link_bytes_sent``: start-up and the control path
    included)."""
    with hosts.sample_sent(1, LINK_SAMPLE_S) as link:
        code, out = hosts.run(1, hosts.horovodrun(1, [EXAMPLE, *argv]), timeout_s=timeout_s)
    hosts.kill_all()  # (what ssh started on host 2, should the launch have left it)
    found = results_in(out)
    if code != 0 or not found:
        raise RuntimeError(f"{what} failed (exit {code}); output tail:\n{out[-4000:]}")
    samples = link.samples
    return {**found[-1], "link_bytes_sent": samples[-1][1] - samples[0][1] if len(samples) > 1 else None}


def reached_s(curve, target):
    """The wall time of the first evaluation whose validation loss is at most ``target`` (None: never)."""
    return next((t for t, _, loss in curve if loss <= target), None)


def summarize(runs):
    """One row per (link, method), from the median run by final validation loss, against plain
    Horovod's median at the same link."""
    rows = []
    for link in dict.fromkeys(r["link"] for r in runs):
        at_link = [r for r in runs if r["link"] == link]
        for method in dict.fromkeys(r["method"] for r in at_link):
            mine = sorted((r for r in at_link if r["method"] == method), key=lambda r: r["val_loss"])
            median = mine[len(mine) // 2]
            rows.append(
                {
                    "link": link,
                    "method": method,
                    "label": median["mode"],
                    "runs": len(mine),
                    "val_loss": median["val_loss"],
                    "val_loss_runs": [r["val_loss"] for r in mine],
                    "perplexity": median["perplexity"],
                    "wall_s": statistics.median(r["wall_s"] for r in mine),
                    "ms_per_step": statistics.median(r["ms_per_step"] for r in mine),
                    "tokens": median["tokens"],
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                    "bytes_sent": median["bytes_sent"],
                    "link_bytes_sent": median.get("link_bytes_sent"),
                    "parameters": median["parameters"],
                }
            )
        anchor = next((x for x in rows if x["link"] == link and x["method"] == BASELINE), None)
        floor = next((x for x in rows if x["link"] == link and x["method"] == FLOOR), None)
        for row in (x for x in rows if x["link"] == link):
            if floor is not None:
                row["compute_ms_per_step"] = floor["ms_per_step"]
            if anchor is None:
                continue
            row["loss_vs_horovod"] = row["val_loss"] / anchor["val_loss"]
            row["wall_vs_horovod"] = row["wall_s"] / anchor["wall_s"]
            row["horovod_bytes_over_these"] = anchor["bytes_sent"] / row["bytes_sent"] if row["bytes_sent"] else None
            for tol in TOLERANCES:
                key = f"within_{round(tol * 100)}pct"
                target = anchor["val_loss"] * (1 + tol)
                mine = [r for r in runs if r["link"] == link and r["method"] == row["method"]]
                times = [reached_s(r["curve"], target) for r in mine]
                # (the median over the runs; None where a run never came within it)
                row[f"{key}_s"] = None if None in times else statistics.median(times)
                row[f"{key}_vs_horovod_wall"] = None if None in times else row[f"{key}_s"] / anchor["wall_s"]
    return rows


def bsp_against_horovod(runs):
    """Per link where both ran at least twice: at every evaluation, the mean of BSP's runs minus
    the mean of plain Horovod's, and each one's spread over its runs (max - min)."""
    out = {}
    for link in dict.fromkeys(r["link"] for r in runs):
        horovod, bsp = ([r for r in runs if r["link"] == link and r["method"] == m] for m in (BASELINE, "bsp"))
        if len(horovod) < 2 or len(bsp) < 2:
            continue
        out[link] = []
        for i, point in enumerate(horovod[0]["curve"]):
            h, b = ([r["curve"][i][2] for r in runs_of] for runs_of in (horovod, bsp))
            out[link].append(
                {
                    "tokens": point[1],
                    "bsp_minus_horovod": statistics.mean(b) - statistics.mean(h),
                    "horovod_spread": max(h) - min(h),
                    "bsp_spread": max(b) - min(b),
                }
            )
    return out


def format_table(rows):
    lines = [
        "| link | method | runs | val loss | vs Horovod | wall s | vs Horovod | within 2 % at | within 3 % at | "
        "MB sent / worker | Horovod's bytes ÷ these | ms/step | tokens/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(v, fmt="{:.3f}"):
        return "—" if v is None else fmt.format(v)

    def reached(row, tol):
        s, share = row.get(f"within_{tol}pct_s"), row.get(f"within_{tol}pct_vs_horovod_wall")
        return "not reached" if s is None else f"{s:.0f} s ({share:.2f}×)"

    for r in rows:
        lines.append(
            f"| {r['link']} | {r['method']} | {r['runs']} | {r['val_loss']:.4f} | {ratio(r.get('loss_vs_horovod'))} | "
            f"{r['wall_s']:.0f} | {ratio(r.get('wall_vs_horovod'), '{:.2f}×')} | {reached(r, 2)} | {reached(r, 3)} | "
            f"{r['bytes_sent'] / 1e6:.1f} | {ratio(r.get('horovod_bytes_over_these'), '{:.1f}')} | "
            f"{r['ms_per_step']:.0f} | {r['tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def plot(runs, rows, directory):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in runs))
    colours = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(m for m in methods if m != FLOOR)}
    colours[FLOOR] = "grey"
    names = {BASELINE: "plain Horovod", FLOOR: "floor (one average, at the end)"}
    label = {r["method"]: names.get(r["method"], r["method"]) for r in rows}
    links = list(dict.fromkeys(r["link"] for r in runs))
    parameters = runs[0]["parameters"]
    paths = []
    for name, x_of, xlabel, log_x in (
        ("loss_vs_time.png", lambda r: [p[0] for p in r["curve"]], "wall time (s)", False),
        ("loss_vs_bytes.png", lambda r: [b / 1e6 for b in r["curve_bytes_sent"]], "MB this worker sent", True),
        ("loss_vs_tokens.png", lambda r: [p[1] / 1e6 for p in r["curve"]], "tokens (millions, both workers)", False),
    ):
        fig, axes = plt.subplots(1, len(links), figsize=(max(5.6 * len(links), 8.0), 4.6), squeeze=False)
        for ax, link in zip(axes.flat, links):
            anchor = next((x for x in rows if x["link"] == link and x["method"] == BASELINE), None)
            for method in methods:
                if method == FLOOR and log_x:  # (it sends nothing before its one average: no point on a log axis)
                    continue
                mine = [r for r in runs if r["link"] == link and r["method"] == method]
                for i, r in enumerate(mine):
                    ax.plot(
                        x_of(r),
                        [p[2] for p in r["curve"]],
                        color=colours[method],
                        ls="--" if method == FLOOR else "-",
                        lw=1.2,
                        alpha=0.8,
                        marker=".",
                        ms=3,
                        label=label[method] if i == 0 else None,
                    )
            if anchor is not None:
                ax.axhline(anchor["val_loss"] * 1.02, color="grey", ls=":", lw=1, label="plain Horovod's final + 2 %")
            if log_x:
                ax.set_xscale("log")
            ax.set_title("one host" if link == ONE_HOST else f"two hosts, {link}", fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("validation loss (nats per byte)")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8)
        fig.suptitle(f"byte-level transformer ({parameters / 1e6:.1f}M parameters), 2 workers; one line per run")
        fig.tight_layout(rect=(0, 0.14, 1, 0.95))
        paths.append(_save(fig, directory, name))
    return paths


def settings(args):
    ex = args.example_args
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip() or None,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "links": args.links,
        "methods": {m: method_flags(m, args) for m in args.methods},
        "inner_steps": args.inner_steps,
        "repeats": args.repeats,
        "repeat_methods": args.repeat_methods or args.methods,
        "example_flags": args.example,
        "example": {k: v for k, v in vars(ex).items() if k in EXAMPLE_SETTINGS},
    }


EXAMPLE_SETTINGS = ("corpus", "epochs", "steps_per_epoch", "batch_size", "context", "layers", "width", "heads")
EXAMPLE_SETTINGS += ("lr", "warmup_steps", "weight_decay", "val_fraction", "val_sequences")


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        studies = []
        for path in args.from_json:
            with open(path) as f:
                studies.append(json.load(f))
        runs = [r for s in studies for r in s["runs"]]
        about = {"merged_from": {p: s["settings"] for p, s in zip(args.from_json, studies)}}
    else:
        runs = run_study(args, log=lambda line: print(line, file=sys.stderr, flush=True))
        about = settings(args)
    rows = summarize(runs)
    noise = bsp_against_horovod(runs)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": about, "runs": runs, "summary": rows, "bsp_against_horovod": noise}, f, indent=1)
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        for path in plot(runs, rows, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
