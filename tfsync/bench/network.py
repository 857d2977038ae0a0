"""Training across a slow link: two simulated hosts, the link between them rate-limited.

``python -m tfsync.bench network`` runs the training benchmark's worker
(:mod:`tfsync.bench._training_worker`: an MLP on synthetic data, real compute,
no simulated device time) on two hosts of :class:`tfsync.bench.hosts.Hosts`
(network namespaces on one bridge, ``horovodrun -H`` over ssh, as on a
cluster), with what each host sends limited by a token bucket to each rate in
``--rates``.  Every mode's step time is reported beside two references
measured in the same launch series: the compute floor (``local``: every worker
trains alone, nothing crosses the link) and plain Horovod's allreduce.  With a
step's compute ``C`` and plain Horovod's ``H``, the communication a step costs
is about ``H - C``; a mode that overlaps it with computation can at best take
``max(C, H - C)`` a step.

``--task digits`` trains ``keras_examples/digits.py`` instead, with hidden
layers of ``--hidden`` widths (default 4096 4096: 17M parameters, so that the
link, not the 1797 images, sets the pace), for ``--epochs`` epochs under each
mode and plain Horovod (``horovod``), and reports the final test accuracy
and the wall time to ``--target-accuracy`` against plain Horovod's: what a
mode that exchanges less often (Local SGD, DiLoCo) costs in accuracy for the
time it saves.

Needs root (the hosts are network namespaces, each with its own sshd) and
``tc``.  One run on a shared machine is one sample: compare ratios within a
run.

Example:

    python -m tfsync.bench network --rates 20gbit 3gbit --models large \\
        --modes local horovod bsp ssp dcs3gd psp localsgd diloco --json network.json
    python -m tfsync.bench network --task digits --rates 3gbit --modes horovod diloco --json digits.json

``--inner-steps H`` and ``--overlap-steps T`` set DiLoCo's period and overlap for
every DiLoCo mode (a variant's own flags win): e.g. ``--inner-steps 16
--overlap-steps 3 --modes diloco diloco+fragments`` compares the whole model's
overlapped round with four paced fragments (:mod:`tfsync.engine.wire.pacing`) by
``link_peak_bytes_per_100ms``.

``--compression none fp16`` runs every mode but ``local`` once per listed wire
format (``compression=``; plain Horovod's fp16 is its own
``hvd.Compression.fp16``, and Horovod has no bf16, so ``horovod`` skips bf16),
each labelled with it (``tfsync BSP+fp16``), against the plain-Horovod
float32 reference; every record carries the bytes one worker sends and
receives per step (``bytes_sent_per_step``, ...; the ring model of
:mod:`tfsync.engine.wire.counting`, plain Horovod's counted the same way).
"""

import argparse
import json
import os
import re
import sys

from tfsync.bench import digits
from tfsync.bench.hosts import Hosts
from tfsync.bench.training import MODE_FLAGS, MODE_LABELS, MODELS, MODES
from tfsync.launch import integer, number, results_in
from tfsync.policies import registry

DEFAULT_MODES = ("local", "horovod", "bsp", "ssp", "dcs3gd", "psp")
DIGITS_MODES = tuple(digits.MODES)  # (``horovod``: keras_examples/digits.py --plain-horovod)
DEFAULT_DIGITS_MODES = ("horovod", "localsgd", "diloco")
_RATE = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit)$")


LINK_SAMPLE_S = 0.1  # how often the link's bytes are read: the peak is per this period


def rate(raw):
    """An argparse ``type``: a ``tc`` rate such as ``1gbit`` or ``500mbit``."""
    if not _RATE.match(raw) or float(re.sub(r"[a-z]+$", "", raw)) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a link rate as tc writes it (a number > 0 and bit, kbit, mbit or gbit), got {raw!r}; "
            f"e.g. 1gbit or 500mbit"
        )
    return raw


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.bench network", description=__doc__.splitlines()[0])
    p.add_argument(
        "--rates",
        type=rate,
        nargs="+",
        default=["20gbit", "3gbit"],
        help="what each host may send (default: where plain Horovod's allreduce costs about one and about four "
        "times the large model's compute on this project's machine)",
    )
    p.add_argument(
        "--task",
        choices=("steps", "digits"),
        default="steps",
        help="steps: ms per step of the training benchmark's MLP on synthetic data (--models); digits: "
        "keras_examples/digits.py to an epoch budget, final accuracy and time to --target-accuracy",
    )
    p.add_argument("--models", nargs="+", default=["medium", "large"], choices=MODELS, help="(--task steps)")
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help=f"--task steps: of {', '.join(MODES)} (default: {' '.join(DEFAULT_MODES)}); --task digits: of "
        f"{', '.join(DIGITS_MODES)} (default: {' '.join(DEFAULT_DIGITS_MODES)})",
    )
    p.add_argument(
        "--hidden", type=integer(1), nargs="+", default=[4096, 4096], help="(--task digits) hidden layers' widths"
    )
    p.add_argument("--epochs", type=integer(1), default=10, help="(--task digits) epoch budget")
    p.add_argument(
        "--lr", type=number(above=0), default=0.1, help="(--task digits) the SGD rate (DiLoCo: the inner one)"
    )
    p.add_argument(
        "--target-accuracy", type=number(above=0, maximum=1), default=0.95, help="(--task digits) test accuracy"
    )
    p.add_argument(
        "--compression",
        nargs="+",
        default=["none"],
        choices=("none", "fp16", "bf16"),
        help="run every mode but local once per wire format listed (default: none, the payload's own dtype); "
        "plain Horovod runs uncompressed always (the reference) and with its own fp16 if listed (it has no bf16)",
    )
    p.add_argument("--per-host", type=integer(1), default=1, help="workers on each of the two hosts")
    p.add_argument("--staleness", type=integer(0), default=3, help="SSP's bound s")
    p.add_argument("--inner-steps", type=integer(1), help="DiLoCo's H for every DiLoCo mode (default: 8)")
    p.add_argument(
        "--overlap-steps",
        type=integer(0),
        help="DiLoCo's tau for every DiLoCo mode that sets none of its own (default: 0)",
    )
    p.add_argument("--steps", type=integer(1), default=30, help="timed steps per worker (after 10 warm-up)")
    p.add_argument("--repeats", type=integer(1), default=1, help="launches per (rate, model, mode); median reported")
    p.add_argument("--timeout-s", type=number(above=0), default=600.0, help="bound of one launch")
    p.add_argument("--json", help="write every record here")
    args = p.parse_args(argv)
    known, default = (DIGITS_MODES, DEFAULT_DIGITS_MODES) if args.task == "digits" else (MODES, DEFAULT_MODES)
    unknown = [m for m in args.modes or () if m not in known]
    if unknown:
        p.error(f"--task {args.task} runs the modes {', '.join(known)}; got {', '.join(unknown)}")
    args.modes = list(args.modes or default)
    args.compression = list(dict.fromkeys(args.compression))
    return args


def variants(modes, compressions):
    """``(key, mode, compression)`` for every mode and wire format asked for: ``local`` once, uncompressed;
    ``horovod`` uncompressed always (the reference every record is compared with) and without bf16
    (Horovod's Compression has none); a compressed run's key ``mode+fp16``."""
    out, seen = [], set()
    for mode in modes:
        for c in ("none", *compressions) if mode in ("local", "horovod") else compressions:
            if (mode == "local" and c != "none") or (mode == "horovod" and c == "bf16") or (mode, c) in seen:
                continue
            seen.add((mode, c))
            out.append((mode if c == "none" else f"{mode}+{c}", mode, None if c == "none" else c))
    return out


def run(hosts, args, log=print):
    """Every (rate, model, mode) on ``hosts`` (two :class:`Hosts`); the records, one per combination."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_training_worker.py")
    records = []
    for link in args.rates:
        for i in range(1, hosts.n + 1):
            hosts.shape_link(i, link)
        try:
            if args.task == "digits":
                records += _digits(hosts, link, args, log)
                continue
            for model in args.models:
                records += _configuration(hosts, worker, link, model, args, log)
        finally:
            for i in range(1, hosts.n + 1):
                hosts.shape_link(i, None)
    return records


def _launch(hosts, argv, args, what):
    """One bounded ``horovodrun`` of ``argv`` from host 1 across the hosts; the worker's result,
    with what host 1 sent over the link during its timed steps (``window_unix_s``, when the
    worker reports it): ``link_bytes_per_step`` and ``link_peak_bytes_per_100ms``."""
    with hosts.sample_sent(1, LINK_SAMPLE_S) as link:
        code, out = hosts.run(1, hosts.horovodrun(args.per_host, argv), timeout_s=args.timeout_s)
    results = results_in(out)
    hosts.kill_all()  # (what ssh started on the other host, should the launch have left it)
    if code != 0 or not results:
        raise RuntimeError(f"{what} failed (exit {code}); output tail:\n{out[-4000:]}")
    result = results[-1]
    if "window_unix_s" in result:
        sent = link.within(*result["window_unix_s"])
        steps = float(args.steps)
        result["link_bytes_per_step"] = None if sent["bytes"] is None else sent["bytes"] / steps
        result["link_peak_bytes_per_100ms"] = sent["peak_bytes_per_period"]
    return result


def _median(runs, key):
    """The median run by ``key`` (the upper one of an even count)."""
    return sorted(runs, key=lambda r: r[key])[len(runs) // 2]


def _settings(args) -> dict:
    """The mode options the bench sets (by field): SSP's bound, DiLoCo's H and tau where given."""
    given = {"inner_steps": args.inner_steps, "overlap_steps": args.overlap_steps}
    return {"staleness": args.staleness, **{k: v for k, v in given.items() if v is not None}}


def _label(mode, flags, settings) -> str:
    """``mode``'s table label with the bench's settings (a DiLoCo tau given by ``--overlap-steps``
    to a mode whose label has none: added)."""
    if mode in ("local", "horovod"):
        return MODE_LABELS[mode]
    label = "tfsync " + registry.label(mode, **settings)
    tau = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--overlap-steps"]
    if tau and tau[-1] != "0" and "tau=" not in label:
        label = f"{label[:-1]}, tau={tau[-1]})"
    return label


def _configuration(hosts, worker, link, model, args, log):
    settings = _settings(args)
    flags = {**MODE_FLAGS, **registry.configurations(**settings)}
    runs_of = variants(args.modes, args.compression)
    labels = {key: _label(mode, flags[mode], settings) + (f"+{c}" if c else "") for key, mode, c in runs_of}
    runs = {key: [] for key, _, _ in runs_of}
    for repeat in range(args.repeats):
        for key, mode, c in runs_of:  # round-robin, so a slow spell of the machine hits every mode
            argv = [worker, *flags[mode], "--model", model, "--stragglers", "base=0.0", "--steps", args.steps]
            argv += ["--compression", c] if c else []
            runs[key].append(_launch(hosts, argv, args, f"{labels[key]} on {model} at {link}"))
            ms = runs[key][-1]["ms_per_step"]
            log(f"  {link:>8s} {model:6s} {labels[key]:20s} run {repeat + 1}: {ms:8.1f} ms/step")
    records = []
    for mode, _, _ in runs_of:
        median = _median(runs[mode], "ms_per_step")
        records.append(
            {
                "link": link,
                "model": model,
                "mode": labels[mode],
                "key": mode,
                "hosts": hosts.n,
                "workers": hosts.n * args.per_host,
                "steps": args.steps,
                **median,
                "runs_ms_per_step": [r["ms_per_step"] for r in runs[mode]],
            }
        )
    floor = next((r for r in records if r["key"] == "local"), None)
    horovod = next((r for r in records if r["key"] == "horovod"), None)
    for r in records:
        if floor is not None:
            r["compute_floor_ms"] = floor["ms_per_step"]
        if horovod is not None:
            r["vs_horovod"] = horovod["ms_per_step"] / r["ms_per_step"]  # step rate against plain Horovod's
        if floor is not None and horovod is not None:
            communication = max(horovod["ms_per_step"] - floor["ms_per_step"], 0.0)
            r["overlap_limit_ms"] = max(floor["ms_per_step"], communication)
    return records


def _digits(hosts, link, args, log):
    """keras_examples/digits.py under every mode at one link rate; records with the time to the
    target and the final accuracy against plain Horovod's (when it ran)."""
    # (plain Horovod in the digits example has no compression of its own: it runs float32 only)
    runs_of = [(k, m, c) for k, m, c in variants(args.modes, args.compression) if not (m == "horovod" and c)]
    runs = {key: [] for key, _, _ in runs_of}
    target = str(args.target_accuracy)  # (the key of the result's time_to_accuracy_s)
    diloco = {k: v for k, v in _settings(args).items() if k != "staleness"}  # (the example's own SSP bound)
    flags = {**digits.MODES, **(registry.configurations(**diloco) if diloco else {})}
    for repeat in range(args.repeats):
        for key, mode, c in runs_of:
            argv = [
                digits.EXAMPLE,
                *flags[mode],
                *("--hidden", *args.hidden, "--epochs", args.epochs, "--lr", args.lr),
                *("--target-accuracy", args.target_accuracy, "--stragglers", "base=0.0"),
                *(("--compression", c) if c else ()),
            ]
            mode = key
            result = _launch(hosts, argv, args, f"{mode} (digits) at {link}")
            runs[mode].append(result)
            reached = result["time_to_accuracy_s"][target]
            log(
                f"  {link:>8s} digits {mode:16s} run {repeat + 1}: final accuracy {result['final_accuracy']:.4f}, "
                f"{args.target_accuracy} after {'—' if reached is None else f'{reached:.1f} s'}, "
                f"{result['wall_s']:.1f} s in all"
            )
    records = []
    for mode, _, _ in runs_of:
        median = _median(runs[mode], "wall_s")
        records.append(
            {
                "task": "digits",
                "link": link,
                "key": mode,
                "hosts": hosts.n,
                "epochs": args.epochs,
                "hidden": args.hidden,
                "target_accuracy": args.target_accuracy,
                "target_s": median["time_to_accuracy_s"][target],
                **median,
                "runs": [
                    {k: r[k] for k in ("wall_s", "final_accuracy", "time_to_accuracy_s", "curve")} for r in runs[mode]
                ],
            }
        )
    horovod = next((r for r in records if r["key"] == "horovod"), None)
    for r in records:
        if horovod is not None:
            r["accuracy_vs_horovod"] = r["final_accuracy"] - horovod["final_accuracy"]
            if r["target_s"] is not None and horovod["target_s"] is not None:
                r["target_time_vs_horovod"] = r["target_s"] / horovod["target_s"]
    return records


def format_digits_table(records):
    lines = [
        "| link | mode | final accuracy | vs plain Horovod | time to target s | vs plain Horovod | wall s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        d, ratio, reached = r.get("accuracy_vs_horovod"), r.get("target_time_vs_horovod"), r["target_s"]
        lines.append(
            f"| {r['link']} | {r['mode']} | {r['final_accuracy']:.4f} | "
            f"{'—' if d is None else f'{d * 100:+.1f} points'} | "
            f"{'not reached' if reached is None else f'{reached:.1f}'} | "
            f"{'—' if ratio is None else f'{ratio:.2f}×'} | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def format_table(records):
    lines = [
        "| link | model | mode | ms/step | samples/s | effective samples/s | compute floor ms | "
        "overlap limit ms | step rate vs plain Horovod | MB sent/step (counted) | link MB/step | "
        "link peak MB/100 ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def mb(value):
        return "—" if value is None else f"{value / 1e6:.2f}"

    for r in records:
        floor, limit, ratio = r.get("compute_floor_ms"), r.get("overlap_limit_ms"), r.get("vs_horovod")
        sent = r.get("bytes_sent_per_step")
        lines.append(
            f"| {r['link']} | {r['model']} | {r['mode']} | {r['ms_per_step']:.1f} | {r['samples_per_s']:.0f} | "
            f"{r['effective_samples_per_s']:.0f} | {'—' if floor is None else f'{floor:.1f}'} | "
            f"{'—' if limit is None else f'{limit:.1f}'} | "
            f"{'—' if ratio is None else f'{ratio:.2f}×'} | {mb(sent)} | {mb(r.get('link_bytes_per_step'))} | "
            f"{mb(r.get('link_peak_bytes_per_100ms'))} |"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    with Hosts(2) as hosts:
        records = run(hosts, args, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_digits_table(records) if args.task == "digits" else format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
