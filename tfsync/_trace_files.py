"""A tfsync trace directory read and checked (:func:`load_trace`), for :mod:`tfsync.timeline`.

One JSON-lines file per worker, ``rank<R>.jsonl``, as the engine writes it with a
``trace_dir`` (:class:`tfsync.engine.tally.Trace`); every record is checked, and a file that
breaks the format is refused naming the file, the line, what was found and what was expected.
Imports neither TensorFlow nor Horovod.
"""

import json
import math
import os
import re

_RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")
# Times are floats written by the same process; allow rounding slack when
# checking that t_start <= t_push <= t_end and that steps do not overlap.
_TIME_SLACK_S = 1e-6
# the rounds' bytes on the wire a step record carries: tfsync.engine.tally.BYTES (not imported: it
# would import TensorFlow)
BYTES = ("bytes_sent", "bytes_received", "uncompressed_bytes_sent", "uncompressed_bytes_received")


def is_number(value):
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(path, lineno, what, expected, fix=None):
    message = f"tfsync.timeline: {path}, line {lineno}: {what}; expected {expected}"
    if fix:
        message += f" ({fix})"
    return ValueError(message)


def _require(record, key, check, expected, path, lineno):
    if key not in record:
        raise _bad(path, lineno, f"field {key!r} is missing", expected)
    if not check(record[key]):
        raise _bad(path, lineno, f"field {key!r} is {record[key]!r}", expected)
    return record[key]


def _check_start(record, path, lineno, file_rank):
    rank = _require(record, "rank", _is_int, "'rank' to be an integer", path, lineno)
    if rank != file_rank:
        raise _bad(
            path,
            lineno,
            f"the start event says rank {rank} but the file is named for rank {file_rank}",
            "a file rank<R>.jsonl to hold rank R's trace",
            "rename the file or regenerate the trace",
        )
    size = _require(record, "size", lambda v: _is_int(v) and v >= 1, "'size' to be a positive integer", path, lineno)
    if rank >= size:
        raise _bad(path, lineno, f"rank {rank} is not below the job size {size}", "0 <= rank < size")
    policy = _require(
        record,
        "policy",
        lambda v: isinstance(v, dict) and isinstance(v.get("mode"), str),
        '\'policy\' to be an object with a string \'mode\', e.g. {"mode": "ssp", "staleness": 3}',
        path,
        lineno,
    )
    return {"rank": rank, "size": size, "policy": dict(policy), "t0": record.get("t0"), "record": record}


def _check_applied(value):
    return isinstance(value, list) and all(
        isinstance(item, list) and len(item) == 3 and all(_is_int(v) for v in item) for item in value
    )


def _check_step(record, path, lineno, file_rank, previous):
    rank = _require(record, "rank", _is_int, "'rank' to be an integer", path, lineno)
    if rank != file_rank:
        raise _bad(
            path,
            lineno,
            f"a step record of rank {rank} is in rank {file_rank}'s file",
            f"every record in rank{file_rank}.jsonl to have rank {file_rank}",
        )
    step = _require(record, "step", lambda v: _is_int(v) and v >= 0, "'step' to be an integer >= 0", path, lineno)
    times = {
        key: _require(record, key, is_number, f"{key!r} to be a number of seconds since t0", path, lineno)
        for key in ("t_start", "t_push", "t_end")
    }
    if not times["t_start"] - _TIME_SLACK_S <= times["t_push"] <= times["t_end"] + _TIME_SLACK_S:
        raise _bad(
            path,
            lineno,
            f"step {step} has t_start={times['t_start']}, t_push={times['t_push']}, t_end={times['t_end']}",
            "t_start <= t_push <= t_end (compute, then wait)",
        )
    applied = _require(
        record,
        "applied",
        _check_applied,
        "'applied' to be a list of [round, staleness, contributors] integer triples",
        path,
        lineno,
    )
    for key in ("compute_s", "wait_s"):
        if key in record and not is_number(record[key]):
            raise _bad(path, lineno, f"field {key!r} is {record[key]!r}", f"{key!r} to be a number of seconds")
    if previous is not None:
        if step <= previous["step"]:
            raise _bad(
                path,
                lineno,
                f"step {step} follows step {previous['step']}",
                "steps in increasing order",
                "was the file appended to by two runs? use one directory per run",
            )
        if times["t_start"] < previous["t_end"] - _TIME_SLACK_S:
            raise _bad(
                path,
                lineno,
                f"step {step} starts at t={times['t_start']}, before step {previous['step']} ended "
                f"(t={previous['t_end']})",
                "steps that do not overlap in time",
            )
    return {
        "rank": rank,
        "step": step,
        **times,
        "applied": [tuple(item) for item in applied],
        "applied_through": record.get("applied_through"),
        "dropped": record.get("dropped", 0),
        "compensated": record.get("compensated", 0),
        "skipped": bool(record.get("skipped", False)),
        # the rounds' bytes on the wire settled in this step (tfsync.engine.wire.counting; 0 in older traces)
        **{k: float(record.get(k, 0.0)) for k in BYTES},
    }


def _check_finish(record, path, lineno, file_rank, previous):
    rank = _require(record, "rank", _is_int, "'rank' to be an integer", path, lineno)
    if rank != file_rank:
        raise _bad(
            path,
            lineno,
            f"a finish event of rank {rank} is in rank {file_rank}'s file",
            f"every record in rank{file_rank}.jsonl to have rank {file_rank}",
        )
    t = _require(record, "t", is_number, "'t' to be a number of seconds since t0", path, lineno)
    wait_s = _require(
        record, "wait_s", lambda v: is_number(v) and v >= 0, "'wait_s' to be a number of seconds >= 0", path, lineno
    )
    if previous is not None and t < previous["t_end"] - _TIME_SLACK_S:
        raise _bad(
            path,
            lineno,
            f"the finish event at t={t} is before the last step ended (t={previous['t_end']})",
            "the finish event after the last step",
        )
    return {"rank": rank, "t": t, "wait_s": wait_s, "compensated": record.get("compensated", 0)}


def _load_rank_file(path, file_rank):
    start, steps, finish, drained, final_compensated, lost = None, [], None, 0, 0, 0
    final_bytes = dict.fromkeys(BYTES, 0.0)
    rejected = []  # the steps of this rank's contributions rejected as not finite
    barriers, grants = [], []  # ElasticBSP's barrier decisions, DSSP's grant decisions
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _bad(
                    path,
                    lineno,
                    f"the line is not valid JSON ({exc.msg})",
                    "one JSON object per line",
                    "a worker killed mid-write leaves a cut last line; delete that line",
                ) from None
            if not isinstance(record, dict):
                raise _bad(path, lineno, f"the line is a JSON {type(record).__name__}", "one JSON object per line")
            event = record.get("event")
            if start is None:
                if event != "start":
                    raise _bad(
                        path,
                        lineno,
                        f"the first record is {line.strip()[:80]!r}",
                        'a first line {"event": "start", "rank": R, "size": N, "policy": {...}}',
                        "is this a tfsync trace written by the engine's trace_dir option?",
                    )
                start = _check_start(record, path, lineno, file_rank)
            elif event == "start":
                raise _bad(
                    path,
                    lineno,
                    "a second start event",
                    "one start event, on the first line",
                    "two runs wrote to the same file; use one trace directory per run",
                )
            elif finish is not None and event is None:
                raise _bad(path, lineno, "a step record after the finish event", "the finish event to be last")
            elif event == "finish":
                if finish is not None:
                    raise _bad(path, lineno, "a second finish event", "at most one finish event")
                finish = _check_finish(record, path, lineno, file_rank, steps[-1] if steps else None)
            elif event is None:
                steps.append(_check_step(record, path, lineno, file_rank, steps[-1] if steps else None))
            elif event == "drain":  # contributions dropped when training ended
                drained += int(record.get("dropped", 0))
            elif event == "final_round":  # late gradients compensated after the last step
                final_compensated += int(record.get("compensated", 0))
            elif event == "reset" and _is_int(record.get("lost")):  # in flight when an elastic job reset
                lost += record["lost"]
            elif event == "bytes":  # the rounds' bytes on the wire after the last step record
                for k in BYTES:
                    final_bytes[k] += float(record.get(k, 0.0))
            elif event == "rejected" and _is_int(record.get("step")):  # not finite (tfsync.engine.nonfinite)
                rejected.append(record["step"])
            elif event == "barrier" and is_number(record.get("t")):
                barriers.append(record)
            elif event == "grant" and is_number(record.get("t")):
                grants.append(record)
            # any other event: a newer engine's record this reader does not know; skipped on purpose
    if start is None:
        raise ValueError(
            f"tfsync.timeline: {path} is empty; expected a first line "
            '{"event": "start", ...} (the worker may have failed before training started)'
        )
    return {
        "file": path,
        "start": start["record"],
        "size": start["size"],
        "policy": start["policy"],
        "t0": start["t0"],
        "steps": steps,
        "finish": finish,
        "drained": drained,
        "final_compensated": final_compensated,
        "lost": lost,
        "rejected": rejected,
        "barriers": barriers,
        "grants": grants,
        "final_bytes": final_bytes,
    }


def load_trace(trace_dir) -> dict:
    """Read and check a trace directory written by the engine.

    Args:
        trace_dir: directory holding one ``rank<R>.jsonl`` per worker.

    Returns:
        ``{"dir", "size", "policy", "t0", "ranks"}`` where ``ranks`` maps each
        rank to ``{"file", "start", "steps", "finish"}``; ``steps`` is the list
        of step records (``rank, step, t_start, t_push, t_end, applied,
        applied_through, dropped``) in step order and ``finish`` is
        ``{"rank", "t", "wait_s"}`` or None.

    Raises:
        ValueError: the directory is missing, holds no ``rank*.jsonl``, lacks a
            rank, or a line is malformed (the message names file and line).
    """
    trace_dir = os.fspath(trace_dir)
    if not os.path.isdir(trace_dir):
        raise ValueError(
            f"tfsync.timeline: trace directory {trace_dir!r} does not exist or is not a directory; "
            "expected the directory passed as trace_dir to the engine / SyncCallback"
        )
    files = {}
    for name in os.listdir(trace_dir):
        match = _RANK_FILE.match(name)
        if match:
            files[int(match.group(1))] = os.path.join(trace_dir, name)
    if not files and os.path.exists(os.path.join(trace_dir, "auto.jsonl")):
        segments = sorted(n for n in os.listdir(trace_dir) if os.path.isdir(os.path.join(trace_dir, n)))
        raise ValueError(
            f"tfsync.timeline: {trace_dir!r} is the trace of a mode='auto' run: each mode it ran traced to "
            f"its own subdirectory ({', '.join(segments)}); draw one of them, e.g. "
            f"python -m tfsync.timeline {os.path.join(trace_dir, segments[0]) if segments else trace_dir}"
        )
    if not files:
        raise ValueError(
            f"tfsync.timeline: {trace_dir!r} holds no rank<R>.jsonl files; expected one per worker "
            "(rank0.jsonl, rank1.jsonl, ...); was training run with trace_dir set to this directory?"
        )
    ranks = {rank: _load_rank_file(files[rank], rank) for rank in sorted(files)}
    first = ranks[min(ranks)]
    for _rank, data in ranks.items():
        for key in ("size", "policy", "t0"):
            if data[key] != first[key]:
                raise ValueError(
                    f"tfsync.timeline: {data['file']} has {key}={data[key]!r} but {first['file']} has "
                    f"{key}={first[key]!r}; expected the files of one run (use one trace directory per run)"
                )
    size = first["size"]
    missing = [r for r in range(size) if r not in ranks]
    extra = [r for r in ranks if r >= size]
    if missing or extra:
        raise ValueError(
            f"tfsync.timeline: {trace_dir!r} has files for ranks {sorted(ranks)} but the job had {size} workers; "
            f"expected rank0.jsonl .. rank{size - 1}.jsonl"
            + (f" (missing: {missing}; copy every worker's file into this directory)" if missing else "")
        )
    return {"dir": trace_dir, "size": size, "policy": first["policy"], "t0": first["t0"], "ranks": ranks}


# ---------------------------------------------------------------------------- summary
def check_range(start_step, end_step):
    for name, value in (("start_step", start_step), ("end_step", end_step)):
        if value is not None and (not _is_int(value) or value < 0):
            raise ValueError(f"tfsync.timeline: {name}={value!r}; expected an integer >= 0 or None")
    if start_step is not None and end_step is not None and start_step > end_step:
        raise ValueError(
            f"tfsync.timeline: start_step={start_step} is after end_step={end_step}; "
            "expected start_step <= end_step (both inclusive)"
        )


def in_range(step, start_step, end_step):
    return (start_step is None or step >= start_step) and (end_step is None or step <= end_step)


def select(trace, start_step, end_step):
    """Per rank: the step records in [start_step, end_step] and the finish event if the range reaches the end."""
    check_range(start_step, end_step)
    selected = {}
    for rank, data in trace["ranks"].items():
        steps = [rec for rec in data["steps"] if in_range(rec["step"], start_step, end_step)]
        finish = data["finish"] if end_step is None else None
        selected[rank] = (steps, finish)
    if not any(steps for steps, _ in selected.values()):
        all_steps = [rec["step"] for data in trace["ranks"].values() for rec in data["steps"]]
        if not all_steps:
            raise ValueError(
                f"tfsync.timeline: the trace in {trace['dir']!r} has a start line but no step "
                "records for any rank; expected at least one finished step (did training fail "
                "before its first step? see the workers' logs)"
            )
        raise ValueError(
            f"tfsync.timeline: no step of any rank lies in "
            f"{start_step if start_step is not None else 'first'}.."
            f"{end_step if end_step is not None else 'last'}; the trace has steps "
            f"{min(all_steps)}..{max(all_steps)}; choose --start-step/--end-step inside that range"
        )
    return selected


__all__ = ["BYTES", "check_range", "in_range", "is_number", "load_trace", "select"]
