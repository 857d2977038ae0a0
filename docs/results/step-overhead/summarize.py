"""The step-overhead study's tables from the bench's records (``python -m tfsync.bench --json``).

    python docs/results/step-overhead/summarize.py docs/results/step-overhead/*.json

Per model: each mode's step time, plain Horovod's step over it (for Local SGD and DiLoCo also
their step over their ideal, the no-synchronization step plus one plain-Horovod all-reduce every ``H`` steps,
both from the same run), and its CPU per step beyond plain Horovod's; then where a step's time
goes: the compiled compute (no synchronization), the collective (plain Horovod's step beyond
it) and tfsync's own (the mode's step beyond plain Horovod's).
"""

import json
import sys

PERIOD = 8  # the registry's Local SGD and DiLoCo configurations: H = 8
PERIODIC = ("tfsync LocalSGD", "tfsync DiLoCo")


def rows(paths):
    out = {}
    for path in paths:
        for r in json.load(open(path)):
            out.setdefault(r["model"], {})[r["mode"]] = r
    return out


def table(records):
    lines = [
        "| model | mode | ms/step | vs plain Horovod | step over the ideal (H=8) | CPU ms/step | extra CPU ms/step |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model, modes in records.items():
        local = modes.get("no synchronization")
        horovod = modes.get("plain Horovod BSP")
        for name, r in modes.items():
            ms = r["ms_per_step"]
            vs_hvd = f"{horovod['ms_per_step'] / ms:.2f}×" if horovod else "—"
            ideal = "—"
            if local and horovod and name.startswith(PERIODIC):
                allreduce = horovod["ms_per_step"] - local["ms_per_step"]
                ideal_ms = local["ms_per_step"] + allreduce / PERIOD
                ideal = f"{ms / ideal_ms:.2f}× ({ideal_ms:.2f} ms)"
            extra = r.get("extra_cpu_ms_per_step")
            extra = f"{extra:+.2f}" if extra is not None and name.startswith("tfsync") else "—"
            lines.append(
                f"| {model} | {name} | {ms:.2f} | {vs_hvd} | {ideal} | {r['mean_cpu_ms_per_step']:.2f} | {extra} |"
            )
    return "\n".join(lines)


def where(records):
    lines = [
        "| model | mode | compiled compute ms | the collective ms | tfsync's own ms |",
        "|---|---|---:|---:|---:|",
    ]
    for model, modes in records.items():
        local, horovod = modes.get("no synchronization"), modes.get("plain Horovod BSP")
        if not (local and horovod):
            continue
        compute = local["ms_per_step"]
        collective = horovod["ms_per_step"] - compute
        for name, r in modes.items():
            if name in ("no synchronization", "plain Horovod BSP") or name.startswith(PERIODIC):
                continue
            own = r["ms_per_step"] - horovod["ms_per_step"]
            lines.append(f"| {model} | {name} | {compute:.2f} | {collective:.2f} | {own:+.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    records = rows(sys.argv[1:])
    print(table(records))
    print()
    print(where(records))
