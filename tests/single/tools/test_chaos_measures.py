"""The chaos soak's measures in one process (tfsync.bench.chaos): the time from a fault to the next
step past the stall it caused, and its command line's checks."""

import shutil
import time

import pytest

from tfsync.bench import _chaos_figures, _stacks, chaos


def _steps(times, pid=1):
    return [{"t": t, "pid": pid, "r": 0, "n": 4} for t in times]


def test_the_next_step_is_past_the_stall_the_fault_caused():
    steps = _steps([0.0, 0.1, 0.2, 0.3, 5.3, 5.4])  # (a 5 s stall from 0.3)
    assert _chaos_figures.to_next_step(steps, {"t": 0.25}, window_s=10) == pytest.approx(5.05)
    # a fault that caused no stall: the next step
    assert _chaos_figures.to_next_step(steps, {"t": 5.35}, window_s=10) == pytest.approx(0.05)
    # a stall that began past the window is not the fault's
    steady = [i / 10 for i in range(121)]  # (steps every 0.1 s to 12 s, then a stall)
    assert _chaos_figures.to_next_step(_steps([*steady, 20.0]), {"t": 0.05}, window_s=10) == pytest.approx(0.05)
    # nor one that began after the next fault's injection: that fault's
    stalled = _steps([*steady[:41], 9.0])  # (steps to 4 s, then a stall to 9 s)
    assert _chaos_figures.to_next_step(stalled, {"t": 0.05}, window_s=10) == pytest.approx(8.95)
    assert _chaos_figures.to_next_step(stalled, {"t": 0.05}, window_s=10, next_t=3.0) == pytest.approx(0.05)


def test_the_victims_own_steps_do_not_count():
    steps = sorted(_steps([0.0, 0.1, 4.0], pid=1) + _steps([0.05, 0.15, 0.2], pid=2), key=lambda s: s["t"])
    assert _chaos_figures.to_next_step(steps, {"t": 0.12, "pid": 2}, window_s=10) == pytest.approx(3.88)
    assert _chaos_figures.to_next_step(steps, {"t": 5.0}, window_s=10) is None


def test_the_stalls_go_to_the_last_fault_injected_before_they_ended():
    # stalls: 1.0-3.0 (before any fault), 4.0-6.0 (a kill at 4.5 inside it), 6.5-8.0 (the kill's
    # replacement joining), 8.2-9.5 (a cut injected at 8.0, before the stall began)
    steps = _steps([0.5, 1.0, 3.0, 3.5, 4.0, 6.0, 6.5, 8.0, 8.1, 8.2, 9.5, 9.9])
    by_kind = _chaos_figures.stalled_by_kind(steps, [(8.0, "link_cut"), (4.5, "kill")])
    assert by_kind == pytest.approx({"kill": 2.0 + 1.5, "link_cut": 1.3, "none": 2.0})
    assert _chaos_figures.stalled_by_kind(_steps([0.0, 0.5, 1.0]), [(0.2, "nan")]) == {}


def test_the_reformed_step_is_the_survivors_first_step_in_the_job_formed_after_the_fault():
    def step(t, pid, r, n=4):
        return {"t": t, "pid": pid, "r": r, "n": n}

    # pid 2 killed at 1.0; pid 1 steps once more in the old job, then at 1.8 in a job of three
    # (one reset), and a replacement joins at 9.0 (another reset)
    steps = [step(0.5, 1, 0), step(0.6, 2, 0), step(1.3, 1, 0), step(1.8, 1, 1, 3), step(9.0, 3, 2), step(9.1, 1, 2)]
    kill = {"t": 1.0, "pid": 2}
    assert _chaos_figures.to_reformed_step(steps, kill) == pytest.approx(0.8)
    assert _chaos_figures.to_next_step(steps, kill, window_s=20) == pytest.approx(8.0)  # (the join's stall)
    # a re-form after the next fault's injection is that fault's
    assert _chaos_figures.to_reformed_step(steps, kill, next_t=1.5) is None
    # no re-form after it (a NaN rejected, a flap healed): None
    assert _chaos_figures.to_reformed_step(steps, {"t": 9.05}) is None
    assert _chaos_figures.to_reformed_step(steps, {"t": 0.1}) is None  # (no step before it to compare with)


def test_the_goodput_lost_adds_up_and_goes_where_the_job_was():
    calm = 160.0  # a step of 16 samples every 0.1 s undisturbed
    times = [i / 10 for i in range(11)]  # to 1.0 at the undisturbed pace: nothing lost
    steps = [{"t": t, "pid": 1, "r": 0, "n": 4} for t in times]
    # a stall to 3.0 (a kill at 1.5), two steps of three workers 0.2 s apart, then all four,
    # the second of them 0.2 s after the first
    steps += [{"t": t, "pid": 1, "r": 1, "n": 3} for t in (3.0, 3.2, 3.4)]
    steps += [{"t": t, "pid": 1, "r": 2, "n": 4} for t in (3.5, 3.7)]
    lost = _chaos_figures.goodput_lost(
        steps, [(1.5, "kill"), (0.5, "nan")], lost_s=2.6, calm_rate=calm, samples_redone=16
    )
    assert lost == {
        "stalled_by_kind": {"kill": pytest.approx(1.9)},
        "fewer_workers_by_kind": {"kill": pytest.approx(0.2)},
        "slower_steps": pytest.approx(0.1),
        "steps_redone": pytest.approx(0.1),
        "other": pytest.approx(0.3),
    }
    parts = [*lost["stalled_by_kind"].values(), *lost["fewer_workers_by_kind"].values()]
    assert sum(parts) + lost["slower_steps"] + lost["steps_redone"] + lost["other"] == pytest.approx(2.6)


def test_the_goodput_ceiling_counts_what_each_fault_takes_by_its_definition():
    from tfsync.faults import Fault

    calm = 800.0
    # a host removed at 100 s for 20 s: two workers at 480/s in its middle bins (105-115 s), a
    # bin near a NaN at 120 s left out; a 4-s cut, a 6-s flap, a stop, a kill
    rows = [[t, calm, 4] for t in range(0, 100, 5)] + [[100, 300, 2], [105, 480, 2], [110, 480, 2], [115, 90, 2]]
    injected = [
        (100.0, Fault("host_removed", host=2, at_s=100, duration_s=20.0)),
        (121.0, Fault("nan", rank=0, at_s=121)),
        (150.0, Fault("link_cut", host=1, at_s=150, duration_s=4.0)),
        (170.0, Fault("link_flap", host=1, at_s=170, duration_s=6.0)),
        (190.0, Fault("stop", rank=1, at_s=190)),
        (210.0, Fault("kill", rank=2, at_s=210)),
    ]
    ceiling, taken = _chaos_figures.goodput_ceiling(injected, 400.0, rows, calm, wait_timeout_s=10.0)
    assert taken == {"host_removed": 8.0, "kill": 0.0, "link_cut": 4.0, "link_flap": 3.0, "nan": 0.0, "stop": 5.0}
    assert ceiling == pytest.approx(1 - 20.0 / 400.0)
    # a removal without a stretch of two workers to measure them on: no ceiling
    assert _chaos_figures.goodput_ceiling(injected[:1], 400.0, rows[:20], calm, 10.0)[0] is None


def test_the_command_line_wants_its_json_and_known_modes(capsys):
    with pytest.raises(SystemExit):
        chaos.parse_args(["--modes", "bsp"])
    assert "--json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chaos.parse_args(["--modes", "ssp", "--json", "x.json"])
    args = chaos.parse_args(["--minutes", "2", "--json", "x.json"])
    assert args.modes == ["bsp", "backup", "diloco"] and args.undisturbed_minutes == 2


def test_the_timeline_bins_the_samples_and_carries_the_size_through_a_stall():
    steps = [{"t": t, "pid": 1, "r": 0, "n": n} for t, n in [(-1.0, 4), (0.5, 4), (1.0, 4), (12.0, 2)]]
    assert _chaos_figures.timeline(steps, start=0.0, bin_s=5.0) == [[0.0, 32 / 5, 4], [5.0, 0.0, 4], [10.0, 16 / 5, 2]]


def test_a_stalled_launch_leaves_the_stacks_of_its_python_processes(tmp_path):
    # (what the launcher and the workers wait on when a soak's job stalls: py-spy, where installed)
    import subprocess
    import sys

    marker = str(tmp_path / "waiting_worker.py")
    with open(marker, "w") as f:
        f.write("import time\ndef waits_here():\n    time.sleep(60)\nwaits_here()\n")
    launch = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    worker = subprocess.Popen([sys.executable, marker])
    try:
        time.sleep(1.0)
        chaos.dump_stacks(launch.pid, str(tmp_path / "stacks.txt"), match="waiting_worker.py")
    finally:
        launch.kill(), worker.kill()
    text = (tmp_path / "stacks.txt").read_text()
    assert f"=== pid {launch.pid} (py-spy):" in text and f"=== pid {worker.pid} (py-spy):" in text
    assert "waits_here" in text  # the worker's stack, found by its command line
    if shutil.which("gdb"):  # every thread of the worker, Python's or not
        assert f"=== pid {worker.pid} (gdb):" in text and f"=== pid {launch.pid} (gdb):" not in text
        assert "Thread 1 " in text.split(f"=== pid {worker.pid} (gdb):")[1], text


def test_the_workers_hang_guards_are_stopped_while_their_stacks_are_read(tmp_path, monkeypatch):
    # (py-spy and gdb hold a worker still while they read it: its guard would end it as frozen)
    import os
    import subprocess
    import sys

    import psutil

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    marker = str(tmp_path / "guarded_worker.py")
    with open(marker, "w") as f:
        f.write(
            f"import sys, time\nsys.path.insert(0, {repo!r})\nfrom tfsync._hang_guard import HangGuard\n"
            "guard = HangGuard(0.5, 'rank 0 of 1')\nprint(guard._process.pid, flush=True)\ntime.sleep(60)\n"
        )
    worker = subprocess.Popen([sys.executable, marker], stdout=subprocess.PIPE, text=True)
    seen = {}
    dump = _stacks._dump_stacks

    def watched(*args):
        deadline = time.monotonic() + 5.0  # (a signal lands when the process is next scheduled)
        while psutil.Process(guard_pid).status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["during"] = psutil.Process(guard_pid).status()
        return dump(*args)

    monkeypatch.setattr(_stacks, "_dump_stacks", watched)
    try:
        guard_pid = int(worker.stdout.readline())
        chaos.dump_stacks(worker.pid, str(tmp_path / "stacks.txt"), match="guarded_worker.py")
        after = psutil.Process(guard_pid).status()
        time.sleep(1.0)  # (a guard that took the dump for a freeze would have ended the worker by now)
        assert worker.poll() is None, "the worker's guard ended it while its stacks were read"
    finally:
        worker.kill()
    assert seen["during"] == psutil.STATUS_STOPPED and after != psutil.STATUS_STOPPED, (seen, after)


def test_the_last_step_is_read_from_the_records_and_a_new_process_file_is_not_a_step(tmp_path):
    assert chaos.last_step_t(str(tmp_path)) is None
    with open(tmp_path / "every_step_1.jsonl", "w") as f:
        f.write('{"pid": 1, "t": 100.0, "r": 0, "n": 4}\n{"pid": 1, "t": 101.5, "r": 0, "n": 4}\n')
    with open(tmp_path / "every_step_2.jsonl", "w") as f:
        f.write('{"pid": 2, "t": 99.0, "r": 0, "n": 4}\n{"pid": 2, "t": 10')  # (a line being written)
    (tmp_path / "every_step_3.jsonl").touch()  # (a joiner's file: created now, no step yet)
    assert chaos.last_step_t(str(tmp_path)) == 101.5
