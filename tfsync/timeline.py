"""Timeline of a tfsync trace: every worker's steps and waits on one time axis.

The engine (``tfsync/engine/engine.py``) writes one JSON-lines file per worker,
``rank<R>.jsonl``, when it is given a ``trace_dir``. This module reads such a
directory, checks it, summarizes it (compute and wait seconds, wait fraction,
staleness, the largest clock gap between workers, the bytes on the wire) and
draws it the way Fig. 4
of the ElasticBSP paper draws iteration intervals: one horizontal lane per
worker, time on the x axis, so stragglers and the waits they cause are visible
at a glance.

Command line::

    python -m tfsync.timeline TRACE_DIR -o timeline.png [--title T]
                              [--start-step A --end-step B]

Python::

    from tfsync import timeline
    trace = timeline.load_trace("traces/run1")
    print(timeline.summarize(trace)["overall"]["max_clock_gap"])
    timeline.plot_timeline(trace, "timeline.png", start_step=100, end_step=150)

It imports neither TensorFlow nor Horovod, so it runs anywhere the trace is
copied to.
"""

import argparse
import bisect
import math
import os
import sys

from tfsync._trace_files import BYTES, in_range, is_number, load_trace, select

__all__ = ["load_trace", "summarize", "plot_timeline", "format_summary", "mode_label", "main"]


# Colors: two shades of one blue alternate between consecutive steps so step
# boundaries stay visible; waits are light red with a darker hatch.
_COMPUTE_COLORS = ("#3a6ea5", "#8db4dd")
_WAIT_FACE = "#f6c3c3"
_WAIT_HATCH = "#c0392b"
_WAIT_DENSE = "#ec8c8c"


# ---------------------------------------------------------------------------- loading
def mode_label(policy) -> str:
    """``"SSP (staleness=3)"`` from a policy config ``{"mode": "ssp", "staleness": 3}``; a
    serialized optimizer in it (DiLoCo's outer one) by its class and learning rate."""

    def short(value):
        if isinstance(value, dict) and "class_name" in value:
            rate = value.get("config", {}).get("learning_rate")
            return f"{value['class_name']}(lr={rate if isinstance(rate, int | float) else 'schedule'})"
        return value

    # (no compression, the default, is not named)
    params = ", ".join(
        f"{k}={short(v)}" for k, v in policy.items() if k != "mode" and not (k == "compression" and v is None)
    )
    return policy["mode"].upper() + (f" ({params})" if params else "")


def _rank_numbers(data, steps, finish, start_step, end_step) -> dict:
    """One rank's numbers (:func:`summarize`) from its selected ``steps`` and ``finish`` event
    (``data``: the rank's whole trace)."""
    compute_s = sum(rec["t_push"] - rec["t_start"] for rec in steps)
    wait_s = sum(rec["t_end"] - rec["t_push"] for rec in steps) + (finish["wait_s"] if finish else 0.0)
    total = compute_s + wait_s
    staleness = [s for rec in steps for _, s, _ in rec["applied"]]
    whole = end_step is None  # (what came after the last step counts only for the whole run)
    final_bytes = data.get("final_bytes", {})  # (the rounds after the last step)
    return {
        "steps": len(steps),
        "compute_s": compute_s,
        "wait_s": wait_s,
        "wait_fraction": wait_s / total if total > 0 else 0.0,
        "max_staleness": max(staleness) if staleness else 0,
        "compensated": sum(rec["compensated"] for rec in steps)
        + (finish["compensated"] if finish else 0)
        + (data.get("final_compensated", 0) if whole else 0),
        "dropped": sum(rec["dropped"] for rec in steps) + (data.get("drained", 0) if whole else 0),
        "rejected": sum(in_range(step, start_step, end_step) for step in data.get("rejected", [])),
        "lost": data.get("lost", 0) if whole else 0,
        "skipped": sum(rec["skipped"] for rec in steps),
        **{k: sum(r[k] for r in steps) + (final_bytes.get(k, 0.0) if whole else 0.0) for k in BYTES},
    }


def _max_clock_gap(trace, selected):
    """``(gap, where)``: the largest clock gap between two workers at the selected steps' ends
    (:func:`summarize`; ``(None, None)`` for one worker), from every rank's push history over the
    whole trace, so gaps at the range's edges are right."""
    pushes = {
        rank: ([rec["t_push"] for rec in data["steps"]], [rec["step"] for rec in data["steps"]])
        for rank, data in trace["ranks"].items()
    }
    max_gap, max_gap_at = None, None
    for rank, (steps, _) in selected.items():
        for rec in steps:
            for peer, (push_times, push_steps) in pushes.items():
                if peer == rank:
                    continue
                index = bisect.bisect_right(push_times, rec["t_end"])
                last_pushed = push_steps[index - 1] if index else -1
                gap = rec["step"] - last_pushed
                if max_gap is None or gap > max_gap:
                    max_gap = gap
                    max_gap_at = {
                        "rank": rank,
                        "step": rec["step"] + 1,
                        "peer": peer,
                        "peer_last_pushed": last_pushed,
                        "t": rec["t_end"],
                    }
    return max_gap, max_gap_at


def summarize(trace, start_step=None, end_step=None) -> dict:
    """Per-rank and overall numbers of a trace from :func:`load_trace`.

    Args:
        trace: the result of :func:`load_trace`.
        start_step: count only steps from this one (inclusive; None: from the first).
        end_step: count only steps up to this one (inclusive; None: to the last). The
            finish event's final wait is counted only when ``end_step`` is None.

    Returns:
        ``{"mode", "policy", "size", "ranks": {rank: {...}}, "overall": {...}}``.
        Per rank: ``steps``, ``compute_s`` (sum of t_push - t_start),
        ``wait_s`` (sum of t_end - t_push, plus the final wait),
        ``wait_fraction`` (wait / (compute + wait), 0 when both are 0),
        ``max_staleness`` (largest staleness among applied contributions),
        ``dropped`` (this rank's contributions dropped; with no ``end_step``
        also those drained when training ended), ``rejected`` (its
        contributions computed for a step in the range that had a NaN or an
        infinity and went into no round), ``lost`` (with no ``end_step``: in flight
        when an elastic job reset, its ``reset`` event) and ``skipped`` (steps that computed
        nothing because their round had closed: PSP, backup workers), ``bytes_sent``,
        ``bytes_received`` and their ``uncompressed_`` twins (what its rounds put on the wire,
        :mod:`tfsync.engine.wire.counting`; with no ``end_step`` also the rounds after its last step).
        Overall: the same sums over all ranks and ``max_clock_gap``, in SSP's
        sense (a worker's clock is the number of steps it has pushed, so SSP(s)
        keeps it <= s and BSP at 0): at each step's t_end a worker moves to
        clock ``step + 1``; every other worker, having pushed through step
        ``last`` by then (t_push <= t_end, -1 if none), is at clock
        ``last + 1``; the gap is the difference, ``step - last``, maximized
        over all steps and peers (``max_clock_gap_at`` says where; None for a
        one-worker job).
    """
    selected = select(trace, start_step, end_step)
    per_rank = {
        rank: _rank_numbers(trace["ranks"][rank], steps, finish, start_step, end_step)
        for rank, (steps, finish) in selected.items()
    }
    max_gap, max_gap_at = _max_clock_gap(trace, selected)
    compute_s = sum(r["compute_s"] for r in per_rank.values())
    wait_s = sum(r["wait_s"] for r in per_rank.values())
    overall = {
        "steps": sum(r["steps"] for r in per_rank.values()),
        "compute_s": compute_s,
        "wait_s": wait_s,
        "wait_fraction": wait_s / (compute_s + wait_s) if compute_s + wait_s > 0 else 0.0,
        "max_staleness": max(r["max_staleness"] for r in per_rank.values()),
        "compensated": sum(r["compensated"] for r in per_rank.values()),
        "dropped": sum(r["dropped"] for r in per_rank.values()),
        "rejected": sum(r["rejected"] for r in per_rank.values()),
        "lost": sum(r["lost"] for r in per_rank.values()),
        "skipped": sum(r["skipped"] for r in per_rank.values()),
        **{k: sum(r[k] for r in per_rank.values()) for k in BYTES},
        "max_clock_gap": max_gap if max_gap is not None else 0,
        "max_clock_gap_at": max_gap_at,
    }
    return {
        "mode": mode_label(trace["policy"]),
        "policy": trace["policy"],
        "size": trace["size"],
        "ranks": per_rank,
        "overall": overall,
    }


def format_summary(summary) -> str:
    """The summary as a plain-text table (what the command prints)."""
    header = (
        f"{'rank':>6} {'steps':>7} {'compute_s':>11} {'wait_s':>11} {'wait %':>7} {'max stale':>9} "
        f"{'compensated':>11} {'dropped':>8} {'rejected':>8} {'lost':>6} {'skipped':>8} {'sent MB':>9} "
        f"{'recv MB':>9}"
    )
    lines = [f"mode: {summary['mode']}, {summary['size']} workers", header, "-" * len(header)]

    def row(label, r):
        return (
            f"{label:>6} {r['steps']:>7d} {r['compute_s']:>11.3f} {r['wait_s']:>11.3f} "
            f"{100 * r['wait_fraction']:>6.1f}% {r['max_staleness']:>9d} {r['compensated']:>11d} "
            f"{r['dropped']:>8d} {r['rejected']:>8d} {r['lost']:>6d} {r['skipped']:>8d} "
            f"{r['bytes_sent'] / 1e6:>9.3f} {r['bytes_received'] / 1e6:>9.3f}"
        )

    for rank, r in sorted(summary["ranks"].items()):
        lines.append(row(str(rank), r))
    lines.append("-" * len(header))
    overall = summary["overall"]
    lines.append(row("all", overall))
    at = overall["max_clock_gap_at"]
    where = (
        f" (rank {at['rank']} starting step {at['step']} at t={at['t']:.3f}s while rank {at['peer']} "
        f"had pushed through step {at['peer_last_pushed']})"
        if at
        else ""
    )
    gap = overall["max_clock_gap"]
    lines.append(f"max clock gap between ranks: {gap} step{'' if gap == 1 else 's'}{where}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plot
def plot_timeline(trace, path, title=None, start_step=None, end_step=None):
    """Draw the trace as a PNG timeline: one lane per worker, compute and wait spans.

    Args:
        trace: the result of :func:`load_trace`.
        path: output file; the format follows the extension (``.png``, also
            ``.svg``/``.pdf``), PNG when there is none.
        title: first title line (default ``"tfsync timeline: <dir>"``); the
            mode and worker count are always added.
        start_step: draw only steps from this one (inclusive; None: from the first).
        end_step: draw only steps up to this one (inclusive; None: to the last, the
            final wait included).

    Returns:
        The summary (:func:`summarize`) of the drawn range.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only, never a display
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    path = os.fspath(path)
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir):
        raise ValueError(
            f"tfsync.timeline: cannot write {path!r}: directory {out_dir!r} does not exist; "
            "create it or choose another -o path"
        )
    summary = summarize(trace, start_step, end_step)
    selected = select(trace, start_step, end_step)
    ranks = sorted(selected)
    n = len(ranks)
    fig_height = min(1.6 + 0.55 * n, 40.0)
    fig, ax = plt.subplots(figsize=(13, fig_height), dpi=110, layout="constrained")
    lane_height = 0.7
    t_lo, t_hi = math.inf, -math.inf
    n_steps_max = max(len(steps) for steps, _ in selected.values())
    label_steps = 0 < n_steps_max <= 40
    # Hatching thousands of sub-pixel spans is slow and reads as noise; dense plots use a plain, darker red.
    dense = n_steps_max > 150
    wait_face, wait_hatch = (_WAIT_DENSE, None) if dense else (_WAIT_FACE, "////")
    for lane, rank in enumerate(ranks):
        lo, hi = _draw_lane(ax, lane, *selected[rank], lane_height, (wait_face, wait_hatch), label_steps)
        t_lo, t_hi = min(t_lo, lo), max(t_hi, hi)
    marks = _mark_decisions(ax, trace, ranks, t_lo, t_hi)
    span = max(t_hi - t_lo, 1e-9)
    ax.set_xlim(t_lo - 0.01 * span, t_hi + 0.01 * span)
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlabel("time since the job's t0 (s)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    _annotate_waits(ax, ranks, summary)
    head = title if title else f"tfsync timeline: {os.path.basename(os.path.normpath(trace['dir']))}"
    shown = (
        "all steps"
        if start_step is None and end_step is None
        else f"steps {start_step if start_step is not None else 'first'}.."
        f"{end_step if end_step is not None else 'last'}"
    )
    overall = summary["overall"]
    ax.set_title(
        f"{head}\n{summary['mode']}, {trace['size']} workers, {shown}; "
        f"wait {100 * overall['wait_fraction']:.1f}% overall, max clock gap {overall['max_clock_gap']}",
        fontsize=11,
        loc="left",
    )
    handles = [
        Patch(facecolor=_COMPUTE_COLORS[0], label="compute (even step)"),
        Patch(facecolor=_COMPUTE_COLORS[1], label="compute (odd step)"),
        Patch(facecolor=wait_face, edgecolor=_WAIT_HATCH, hatch=wait_hatch, linewidth=0, label="wait for peers"),
    ]
    handles += marks
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=9)
    fmt = None if os.path.splitext(path)[1] else "png"
    fig.savefig(path, format=fmt, bbox_inches="tight")
    plt.close(fig)
    return summary


def _draw_lane(ax, lane, steps, finish, lane_height, wait_style, label_steps):
    """One worker's lane: its compute spans (two shades, alternating steps), its waits, the step
    numbers where they fit; returns the lane's ``(first, last)`` time."""
    wait_face, wait_hatch = wait_style
    y = lane - lane_height / 2
    for parity in (0, 1):
        spans = [(rec["t_start"], rec["t_push"] - rec["t_start"]) for rec in steps if rec["step"] % 2 == parity]
        if spans:
            ax.broken_barh(spans, (y, lane_height), facecolors=_COMPUTE_COLORS[parity], linewidth=0)
    waits = [(rec["t_push"], rec["t_end"] - rec["t_push"]) for rec in steps if rec["t_end"] > rec["t_push"]]
    if finish is not None and finish["wait_s"] > 0:
        waits.append((finish["t"], finish["wait_s"]))
    if waits:
        ax.broken_barh(
            waits,
            (y + 0.1 * lane_height, 0.8 * lane_height),
            facecolors=wait_face,
            edgecolors=_WAIT_HATCH,
            hatch=wait_hatch,
            linewidth=0,
        )
    t_lo, t_hi = math.inf, -math.inf
    for rec in steps:
        t_lo, t_hi = min(t_lo, rec["t_start"]), max(t_hi, rec["t_end"])
    if finish is not None:
        t_lo, t_hi = min(t_lo, finish["t"]), max(t_hi, finish["t"] + finish["wait_s"])
    if label_steps:
        for rec in steps:
            ax.text(
                (rec["t_start"] + rec["t_push"]) / 2,
                lane,
                str(rec["step"]),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if rec["step"] % 2 == 0 else "#1b3a5c",
                clip_on=True,
            )
    return t_lo, t_hi


def _annotate_waits(ax, ranks, summary):
    """Each rank's wait fraction at the right end of its lane (in red from 20 %)."""
    for lane, rank in enumerate(ranks):
        r = summary["ranks"][rank]
        ax.annotate(
            f"wait {100 * r['wait_fraction']:.1f}%",
            xy=(1.0, lane),
            xycoords=("axes fraction", "data"),
            xytext=(8, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
            color=_WAIT_HATCH if r["wait_fraction"] >= 0.2 else "#333333",
        )


def _mark_decisions(ax, trace, ranks, t_lo, t_hi):
    """ElasticBSP's barriers (when each was reached, solid; where ZipLine predicted the
    next, dotted) and DSSP's grants (a triangle on the worker's lane: the extra steps);
    the legend entries for what was drawn."""
    from matplotlib.lines import Line2D

    handles = []
    first = trace["ranks"][ranks[0]] if ranks else None
    barriers = [b for b in (first or {}).get("barriers", ()) if t_lo <= b["t"] <= t_hi]
    for b in barriers:
        ax.axvline(b["t"], color="#444444", linewidth=0.9, zorder=3)
        t_sync = b.get("predicted_t_sync_s")
        if is_number(t_sync) and t_lo <= t_sync <= t_hi:
            ax.axvline(t_sync, color="#444444", linewidth=0.9, linestyle=":", zorder=3)
    if barriers:
        handles += [
            Line2D([], [], color="#444444", linewidth=0.9, label="barrier (ElasticBSP)"),
            Line2D([], [], color="#444444", linewidth=0.9, linestyle=":", label="predicted barrier"),
        ]
    granted = False
    for lane, rank in enumerate(ranks):
        for g in trace["ranks"][rank].get("grants", ()):
            if g.get("extra") and t_lo <= g["t"] <= t_hi:
                granted = True
                ax.plot([g["t"]], [lane - 0.42], marker="v", color="#2a7d2a", markersize=6, zorder=4)
                ax.text(g["t"], lane - 0.5, f"+{g['extra']}", fontsize=7, color="#2a7d2a", ha="center", va="bottom")
    if granted:
        handles.append(Line2D([], [], color="#2a7d2a", marker="v", linestyle="", label="DSSP grant (+extra steps)"))
    return handles


# ---------------------------------------------------------------------------- command line
def _build_parser():
    parser = argparse.ArgumentParser(
        prog="python -m tfsync.timeline",
        description="Draw a tfsync trace (a directory of rank<R>.jsonl files written with trace_dir=...) "
        "as a timeline of every worker's compute and wait spans, and print a summary table.",
    )
    parser.add_argument("trace_dir", help="directory holding rank0.jsonl, rank1.jsonl, ...")
    parser.add_argument("-o", "--output", default="timeline.png", help="image to write (default: timeline.png)")
    parser.add_argument("--title", default=None, help="title of the figure (the mode is always added)")
    parser.add_argument(
        "--start-step",
        type=int,
        default=None,
        metavar="A",
        help="first step to draw and count (inclusive; default: the first)",
    )
    parser.add_argument(
        "--end-step",
        type=int,
        default=None,
        metavar="B",
        help="last step to draw and count (inclusive; default: the last, with the final wait)",
    )
    return parser


def main(argv=None) -> int:
    """Command-line entry point; returns the exit status (0 ok, 2 bad input)."""
    args = _build_parser().parse_args(argv)
    try:
        trace = load_trace(args.trace_dir)
        summary = plot_timeline(
            trace, args.output, title=args.title, start_step=args.start_step, end_step=args.end_step
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
