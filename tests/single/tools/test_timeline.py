"""Tests of tfsync.timeline: loading and checking traces, the summary numbers,
the PNG timeline, step-range filtering, rejected inputs and the command line.

Traces are synthetic: a small deterministic model of the engine's SSP rule
(start step n+1 only once every worker has pushed step n - staleness; BSP is
staleness 0) with one known slow worker. All times are small integers, so
every expected number below is exact and derived by hand in the comments.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfsync import timeline
from tfsync.launch import REPO_ROOT as REPO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def simulate(compute_s, staleness, steps):
    """Per rank: the step records and the finish event the engine would write."""
    size = len(compute_s)
    push = [[0.0] * steps for _ in range(size)]
    end = [[0.0] * steps for _ in range(size)]
    start = [[0.0] * steps for _ in range(size)]
    for n in range(steps):
        for r in range(size):
            start[r][n] = end[r][n - 1] if n else 0.0
            push[r][n] = start[r][n] + compute_s[r]
        for r in range(size):
            needed = n - staleness  # the round every worker must have pushed before step n + 1 starts
            end[r][n] = max([push[r][n]] + ([push[q][needed] for q in range(size)] if needed >= 0 else []))
    records = {}
    for r in range(size):
        rows, applied_through = [], -1
        for n in range(steps):
            completed = -1
            while completed + 1 < steps and all(push[q][completed + 1] <= end[r][n] for q in range(size)):
                completed += 1
            applied = [[k, n - k, size] for k in range(applied_through + 1, completed + 1)]
            applied_through = max(applied_through, completed)
            rows.append(
                {
                    "rank": r,
                    "step": n,
                    "t_start": start[r][n],
                    "t_push": push[r][n],
                    "t_end": end[r][n],
                    "compute_s": push[r][n] - start[r][n],
                    "wait_s": end[r][n] - push[r][n],
                    "applied": applied,
                    "applied_through": applied_through,
                    "dropped": 0,
                }
            )
        last_round_done = max(push[q][steps - 1] for q in range(size))
        finish = {
            "event": "finish",
            "rank": r,
            "t": end[r][-1],
            "wait_s": max(0.0, last_round_done - end[r][-1]),
            "applied": [],
            "applied_through": steps - 1,
        }
        records[r] = (rows, finish)
    return records


def write_trace(directory, compute_s=(1.0, 1.0, 2.0), staleness=1, steps=10, mode="ssp", extra_events=True):
    """Write rank<R>.jsonl files like the engine does; returns the directory."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    policy = {"mode": mode, "staleness": staleness} if mode == "ssp" else {"mode": mode}
    for r, (rows, finish) in simulate(list(compute_s), staleness, steps).items():
        lines = [
            {
                "event": "start",
                "rank": r,
                "size": len(compute_s),
                "t0": 1700000000.0,
                "policy": policy,
                "num_params": 10,
                "stragglers": None,
            }
        ]
        for row in rows:
            lines.append(row)
            if extra_events and row["step"] == 4:
                lines.append({"event": "checkpoint", "rank": r, "t": row["t_end"]})  # unknown: ignored
        lines.append(finish)
        with open(os.path.join(directory, f"rank{r}.jsonl"), "w") as handle:
            handle.write("\n".join(json.dumps(line) for line in lines) + "\n\n")
    return directory


@pytest.fixture
def ssp_dir(tmp_path):
    # Ranks 0 and 1 compute 1 s per step, rank 2 (the straggler) 2 s; SSP with staleness 1.
    return write_trace(tmp_path / "ssp")


# ---------------------------------------------------------------------------- loading
def test_load_trace_reads_every_rank_and_skips_unknown_events(ssp_dir):
    trace = timeline.load_trace(ssp_dir)
    assert trace["size"] == 3
    assert trace["policy"] == {"mode": "ssp", "staleness": 1}
    assert sorted(trace["ranks"]) == [0, 1, 2]
    for rank, data in trace["ranks"].items():
        assert [rec["step"] for rec in data["steps"]] == list(range(10))
        assert data["file"].endswith(f"rank{rank}.jsonl")
    assert trace["ranks"][0]["finish"] == {"rank": 0, "t": 18.0, "wait_s": 2.0, "compensated": 0}
    assert trace["ranks"][2]["finish"] == {"rank": 2, "t": 20.0, "wait_s": 0.0, "compensated": 0}


# ---------------------------------------------------------------------------- summary
BYTES = ("bytes_sent", "bytes_received", "uncompressed_bytes_sent", "uncompressed_bytes_received")
NO_BYTES = dict.fromkeys(BYTES, 0.0)


def test_summarize_ssp_with_a_straggler(ssp_dir):
    summary = timeline.summarize(timeline.load_trace(ssp_dir))
    assert summary["mode"] == "SSP (staleness=1)"
    fast, slow = summary["ranks"][0], summary["ranks"][2]
    # Fast ranks: steps 0 and 1 never wait; from step 2 on each step waits 1 s for the straggler
    # (8 s), and the final wait for round 9 is 2 s (t = 18 -> 20): 10 s waited, 10 s computed.
    assert fast == {
        "steps": 10,
        "compute_s": 10.0,
        "wait_s": 10.0,
        "wait_fraction": 0.5,
        "max_staleness": 1,
        "compensated": 0,
        "dropped": 0,
        "rejected": 0,
        "lost": 0,
        "skipped": 0,
        **NO_BYTES,
    }
    assert summary["ranks"][1] == fast
    # The straggler never waits and always applies its own step's round.
    assert slow == {
        "steps": 10,
        "compute_s": 20.0,
        "wait_s": 0.0,
        "wait_fraction": 0.0,
        "max_staleness": 0,
        "compensated": 0,
        "dropped": 0,
        "rejected": 0,
        "lost": 0,
        "skipped": 0,
        **NO_BYTES,
    }
    overall = summary["overall"]
    assert overall["steps"] == 30
    assert overall["compute_s"] == 40.0 and overall["wait_s"] == 20.0
    assert overall["wait_fraction"] == pytest.approx(1 / 3)
    assert overall["max_staleness"] == 1
    # A fast rank starts step n + 1 when the straggler has pushed only step n - 1: gap 1 = staleness.
    # The first time: rank 0 starts step 1 at t = 1, rank 2 has pushed nothing yet (-1).
    assert overall["max_clock_gap"] == 1
    assert overall["max_clock_gap_at"] == {"rank": 0, "step": 1, "peer": 2, "peer_last_pushed": -1, "t": 1.0}


def test_summarize_bsp(tmp_path):
    # BSP: every step ends when the straggler pushes, at t = 2(n + 1); fast ranks wait 1 s per step.
    trace = timeline.load_trace(write_trace(tmp_path / "bsp", staleness=0, mode="bsp", steps=6))
    summary = timeline.summarize(trace)
    assert summary["mode"] == "BSP"
    assert [summary["ranks"][r]["wait_fraction"] for r in range(3)] == [0.5, 0.5, 0.0]
    assert [summary["ranks"][r]["wait_s"] for r in range(3)] == [6.0, 6.0, 0.0]
    assert summary["overall"]["max_clock_gap"] == 0
    assert summary["overall"]["max_staleness"] == 0


def test_summarize_balanced_workers_have_no_wait(tmp_path):
    trace = timeline.load_trace(write_trace(tmp_path / "even", compute_s=(0.5, 0.5), staleness=2, steps=8))
    summary = timeline.summarize(trace)
    for rank in (0, 1):
        assert summary["ranks"][rank]["wait_s"] == 0.0
        assert summary["ranks"][rank]["wait_fraction"] == 0.0
    # Both push step n at the same instant they start step n + 1: equal clocks.
    assert summary["overall"]["max_clock_gap"] == 0


def test_summary_shows_drops_skips_and_the_drain(tmp_path):
    # A PSP-like trace: rank 1 drops its step-1 gradient, skips step 2, and one more
    # contribution is drained when training ends; rank 0 computes every step.
    path = write_trace(tmp_path / "psp", staleness=0, mode="bsp", steps=4)
    rank1 = os.path.join(path, "rank1.jsonl")
    with open(rank1) as f:
        lines = f.read().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    steps = [r for r in records if "step" in r]
    steps[2]["dropped"], steps[2]["drops"] = 1, [[1, 2]]
    steps[2]["skipped"] = True
    records.append({"event": "drain", "rank": 1, "t": steps[-1]["t_end"], "dropped": 1})  # after finish, as written
    with open(rank1, "w") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    summary = timeline.summarize(timeline.load_trace(path))
    assert (summary["ranks"][1]["dropped"], summary["ranks"][1]["skipped"]) == (2, 1)
    assert (summary["ranks"][0]["dropped"], summary["ranks"][0]["skipped"]) == (0, 0)
    assert (summary["overall"]["dropped"], summary["overall"]["skipped"]) == (2, 1)
    # the drain happened at the end: a range that stops earlier does not count it
    assert timeline.summarize(timeline.load_trace(path), end_step=2)["ranks"][1]["dropped"] == 1
    assert " dropped rejected   lost  skipped" in timeline.format_summary(summary)


def test_summarize_step_range(ssp_dir):
    trace = timeline.load_trace(ssp_dir)
    summary = timeline.summarize(trace, start_step=2, end_step=5)
    # Steps 2..5 of a fast rank: 4 s compute, 4 s wait; the final wait is outside the range.
    assert summary["ranks"][0] == {
        "steps": 4,
        "compute_s": 4.0,
        "wait_s": 4.0,
        "wait_fraction": 0.5,
        "max_staleness": 1,
        "compensated": 0,
        "dropped": 0,
        "rejected": 0,
        "lost": 0,
        "skipped": 0,
        **NO_BYTES,
    }
    assert summary["ranks"][2]["steps"] == 4 and summary["ranks"][2]["compute_s"] == 8.0
    # Pushes before the range still count, so the gap is not inflated at its edge.
    assert timeline.summarize(trace, start_step=7)["overall"]["max_clock_gap"] == 1
    only_first = timeline.summarize(trace, end_step=0)
    assert only_first["overall"]["steps"] == 3
    assert only_first["ranks"][0]["wait_s"] == 0.0


@pytest.mark.parametrize(
    "start_step, end_step, message",
    [
        (20, 30, "no step of any rank lies in 20..30; the trace has steps 0..9"),
        (20, None, "lies in 20..last"),
        (5, 2, "start_step=5 is after end_step=2"),
        (-1, None, "expected an integer >= 0"),
    ],
)
def test_bad_step_range(ssp_dir, start_step, end_step, message):
    trace = timeline.load_trace(ssp_dir)
    with pytest.raises(ValueError, match=message):
        timeline.summarize(trace, start_step=start_step, end_step=end_step)


def test_format_summary_table(ssp_dir):
    text = timeline.format_summary(timeline.summarize(timeline.load_trace(ssp_dir)))
    assert "mode: SSP (staleness=1), 3 workers" in text
    assert " 50.0%" in text and "  0.0%" in text
    assert "max clock gap between ranks: 1 step " in text


# ---------------------------------------------------------------------------- plot
def _read_png(path):
    from matplotlib import image

    with open(path, "rb") as handle:
        assert handle.read(8) == PNG_SIGNATURE
    return image.imread(path)


def test_plot_timeline_writes_a_png(ssp_dir, tmp_path):
    out = tmp_path / "timeline.png"
    summary = timeline.plot_timeline(timeline.load_trace(ssp_dir), out, title="straggler")
    assert summary["overall"]["max_clock_gap"] == 1
    pixels = _read_png(out)
    height, width, channels = pixels.shape
    assert 600 <= width <= 3000 and 150 <= height <= 2000 and channels in (3, 4)
    colors = np.unique((pixels[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colors) > 20  # bars, hatching and text, not a blank canvas
    present = {tuple(c) for c in colors}
    for hex_color in timeline._COMPUTE_COLORS:
        rgb = tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
        assert rgb in present, f"compute color {hex_color} not drawn"


def test_plot_timeline_step_range_and_no_extension(ssp_dir, tmp_path):
    trace = timeline.load_trace(ssp_dir)
    out = tmp_path / "part"
    summary = timeline.plot_timeline(trace, out, start_step=3, end_step=4)
    assert summary["overall"]["steps"] == 6
    _read_png(out)  # no extension: still a PNG


def test_plot_timeline_one_worker(tmp_path):
    trace = timeline.load_trace(write_trace(tmp_path / "one", compute_s=(1.0,), staleness=0, mode="bsp"))
    out = tmp_path / "one.png"
    summary = timeline.plot_timeline(trace, out)
    assert summary["overall"]["max_clock_gap"] == 0 and summary["overall"]["max_clock_gap_at"] is None
    _read_png(out)


def test_plot_timeline_many_steps(tmp_path):
    # Over 150 steps per lane the waits are drawn plain (no hatch) and steps are not numbered.
    trace = timeline.load_trace(
        write_trace(tmp_path / "long", compute_s=(0.1, 0.15), staleness=2, steps=200, extra_events=False)
    )
    out = tmp_path / "long.png"
    assert timeline.plot_timeline(trace, out)["overall"]["steps"] == 400
    pixels = _read_png(out)
    red = tuple(int(timeline._WAIT_DENSE[i : i + 2], 16) for i in (1, 3, 5))
    assert red in {tuple(c) for c in (pixels[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)}


def test_plot_timeline_missing_output_directory(ssp_dir, tmp_path):
    with pytest.raises(ValueError, match="does not exist; create it"):
        timeline.plot_timeline(timeline.load_trace(ssp_dir), tmp_path / "nowhere" / "t.png")


# ---------------------------------------------------------------------------- rejected traces
def _rewrite_line(path, lineno, new_text):
    with open(path) as handle:
        lines = handle.read().split("\n")
    lines[lineno - 1] = new_text
    with open(path, "w") as handle:
        handle.write("\n".join(lines))


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist or is not a directory; expected the directory"):
        timeline.load_trace(tmp_path / "absent")


def test_directory_without_rank_files(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"holds no rank<R>\.jsonl files.*trace_dir"):
        timeline.load_trace(tmp_path)


def test_an_auto_trace_points_to_its_segments(tmp_path):
    (tmp_path / "auto.jsonl").write_text("{}\n")
    (tmp_path / "0-bsp").mkdir()
    (tmp_path / "1-backup").mkdir()
    with pytest.raises(ValueError, match=r"mode='auto' run.*\(0-bsp, 1-backup\).*0-bsp"):
        timeline.load_trace(tmp_path)


def test_malformed_json_names_file_and_line(ssp_dir):
    path = os.path.join(ssp_dir, "rank1.jsonl")
    _rewrite_line(path, 3, '{"rank": 1, "step": 1, "t_sta')
    with pytest.raises(ValueError) as info:
        timeline.load_trace(ssp_dir)
    message = str(info.value)
    assert "rank1.jsonl, line 3" in message and "not valid JSON" in message and "one JSON object per line" in message


def test_missing_field_names_it(ssp_dir):
    path = os.path.join(ssp_dir, "rank2.jsonl")
    record = {"rank": 2, "step": 0, "t_start": 0.0, "t_end": 2.0, "applied": []}
    _rewrite_line(path, 2, json.dumps(record))
    with pytest.raises(ValueError, match=r"rank2\.jsonl, line 2: field 't_push' is missing; expected 't_push' to be"):
        timeline.load_trace(ssp_dir)


@pytest.mark.parametrize(
    "lineno, record, message",
    [
        (
            2,
            {"rank": 0, "step": 0, "t_start": 1.0, "t_push": 0.5, "t_end": 2.0, "applied": []},
            "t_start <= t_push <= t_end",
        ),
        (
            2,
            {"rank": 0, "step": "zero", "t_start": 0.0, "t_push": 1.0, "t_end": 1.0, "applied": []},
            "field 'step' is 'zero'",
        ),
        (
            2,
            {"rank": 0, "step": 0, "t_start": 0.0, "t_push": 1.0, "t_end": 1.0, "applied": [[0, 1]]},
            "[round, staleness, contributors]",
        ),
        (
            2,
            {"rank": 1, "step": 0, "t_start": 0.0, "t_push": 1.0, "t_end": 1.0, "applied": []},
            "a step record of rank 1 is in rank 0's file",
        ),
        (
            3,
            {"rank": 0, "step": 0, "t_start": 1.0, "t_push": 2.0, "t_end": 2.0, "applied": []},
            "step 0 follows step 0; expected steps in increasing order",
        ),
        (
            1,
            {"rank": 0, "step": 0, "t_start": 0.0, "t_push": 1.0, "t_end": 1.0, "applied": []},
            'expected a first line {"event": "start"',
        ),
        (1, {"event": "start", "rank": 0, "size": 3, "policy": "ssp"}, "'policy' to be an object with a string 'mode'"),
        (
            1,
            {"event": "start", "rank": 0, "size": 3, "t0": 1.0, "policy": {"mode": "ssp", "staleness": 1}},
            "t0=1.0; expected the files of one run",
        ),
        (5, {"event": "start", "rank": 0, "size": 3, "policy": {"mode": "ssp"}}, "a second start event"),
        (2, [1, 2, 3], "the line is a JSON list"),
    ],
)
def test_bad_records(ssp_dir, lineno, record, message):
    _rewrite_line(os.path.join(ssp_dir, "rank0.jsonl"), lineno, json.dumps(record))
    with pytest.raises(ValueError, match=r"rank0\.jsonl") as info:
        timeline.load_trace(ssp_dir)
    assert message in str(info.value)


def test_trace_without_any_step(tmp_path):
    directory = write_trace(tmp_path / "t", steps=2)
    for r in range(3):
        path = os.path.join(directory, f"rank{r}.jsonl")
        with open(path) as handle:
            first = handle.readline()
        with open(path, "w") as handle:
            handle.write(first)
    trace = timeline.load_trace(directory)
    with pytest.raises(ValueError, match="no step records for any rank; expected at least one"):
        timeline.summarize(trace)


def test_missing_rank_file(ssp_dir):
    os.remove(os.path.join(ssp_dir, "rank1.jsonl"))
    with pytest.raises(ValueError, match=r"the job had 3 workers.*missing: \[1\]; copy every worker's file"):
        timeline.load_trace(ssp_dir)


def test_empty_rank_file(ssp_dir):
    open(os.path.join(ssp_dir, "rank2.jsonl"), "w").close()
    with pytest.raises(ValueError, match=r"rank2\.jsonl is empty; expected a first line"):
        timeline.load_trace(ssp_dir)


def test_step_after_finish(ssp_dir):
    path = os.path.join(ssp_dir, "rank0.jsonl")
    with open(path, "a") as handle:
        handle.write(
            json.dumps({"rank": 0, "step": 10, "t_start": 30.0, "t_push": 31.0, "t_end": 31.0, "applied": []}) + "\n"
        )
    with pytest.raises(ValueError, match="a step record after the finish event"):
        timeline.load_trace(ssp_dir)


def test_rank_file_without_steps_is_valid(tmp_path):
    # A worker that failed right after starting leaves only its start line.
    directory = write_trace(tmp_path / "t", steps=3)
    with open(os.path.join(directory, "rank2.jsonl")) as handle:
        first = handle.readline()
    with open(os.path.join(directory, "rank2.jsonl"), "w") as handle:
        handle.write(first)
    trace = timeline.load_trace(directory)
    summary = timeline.summarize(trace)
    assert summary["ranks"][2]["steps"] == 0 and summary["ranks"][2]["wait_fraction"] == 0.0
    # Ranks 0 and 1 move to clock 3 at the end of step 2 while rank 2 never pushed (clock 0).
    assert summary["overall"]["max_clock_gap"] == 3
    timeline.plot_timeline(trace, tmp_path / "t.png")


# ---------------------------------------------------------------------------- command line
def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), MPLBACKEND="Agg")
    return subprocess.run(
        [sys.executable, "-m", "tfsync.timeline", *map(str, args)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_writes_png_and_prints_summary(ssp_dir, tmp_path):
    out = tmp_path / "cli.png"
    result = _run_cli(ssp_dir, "-o", out, "--title", "three workers, one slow")
    assert result.returncode == 0, result.stderr
    assert "mode: SSP (staleness=1), 3 workers" in result.stdout
    assert "max clock gap between ranks: 1 step " in result.stdout
    assert f"wrote {out}" in result.stdout
    _read_png(out)


def test_cli_step_range_in_process(ssp_dir, tmp_path, capsys):
    out = tmp_path / "range.png"
    assert timeline.main([ssp_dir, "-o", str(out), "--start-step", "2", "--end-step", "5"]) == 0
    printed = capsys.readouterr().out
    assert "     0       4       4.000       4.000   50.0%" in printed
    _read_png(out)


def test_cli_reports_bad_input(tmp_path):
    result = _run_cli(tmp_path / "absent", "-o", tmp_path / "x.png")
    assert result.returncode == 2
    assert "error: tfsync.timeline:" in result.stderr and "does not exist" in result.stderr
    assert not (tmp_path / "x.png").exists()


def test_module_stays_light():
    code = (
        "import sys, tfsync.timeline; heavy = [m for m in ('tensorflow', 'horovod', 'keras') "
        "if m in sys.modules]; assert not heavy, heavy"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True, timeout=120)


def test_an_elastic_reset_counts_its_lost_contributions(tmp_path):
    """A trace that ends with an elastic job's reset event (no finish): its ``lost`` in the summary."""
    records = [
        {"event": "start", "rank": 0, "size": 1, "t0": 0.0, "policy": {"mode": "bsp"}},
        {"rank": 0, "step": 0, "t_start": 0.0, "t_push": 1.0, "t_end": 1.5, "applied": [[0, 0, 1]],
         "stamps": [[0, [0]]], "applied_through": 0, "dropped": 0, "drops": [], "compensated": 0, "skipped": False},
        {"event": "reset", "rank": 0, "t": 2.0, "step": 1, "lost": 1, "reason": "WorkerLostError: a test"},
    ]  # fmt: skip
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = timeline.summarize(timeline.load_trace(str(tmp_path)))
    assert summary["ranks"][0]["lost"] == summary["overall"]["lost"] == 1
    assert summary["ranks"][0]["steps"] == 1


def test_the_summary_adds_up_the_bytes_each_rank_put_on_the_wire(tmp_path):
    directory = write_trace(tmp_path / "bytes", staleness=0, mode="bsp", steps=4)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        for r in records:
            if "event" not in r:  # a step record: one round's bytes
                r.update(bytes_sent=10.0, bytes_received=10.0, uncompressed_bytes_sent=20.0)
        records.append({"event": "bytes", "rank": records[0]["rank"], "t": 99.0, "bytes_sent": 5.0})
        with open(path, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
    summary = timeline.summarize(timeline.load_trace(directory))
    for r in summary["ranks"].values():
        assert (r["bytes_sent"], r["bytes_received"], r["uncompressed_bytes_sent"]) == (45.0, 40.0, 80.0)
    assert summary["overall"]["bytes_sent"] == 45.0 * len(summary["ranks"])
    # a step range leaves out the rounds after the last step
    in_range = timeline.summarize(timeline.load_trace(directory), start_step=1, end_step=2)
    assert in_range["ranks"][0]["bytes_sent"] == 20.0
    assert "sent MB" in timeline.format_summary(summary)
