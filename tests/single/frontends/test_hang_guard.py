"""The hang guard (tfsync._hang_guard) on plain processes: a frozen worker and one stuck in a step are
ended saying why (sooner once its job went on without it), a worker that steps on is left alone,
and the guard ends with its worker.  Its place in an elastic job (the launcher re-forms without
the hung worker) is tests/parallel/test_elastic_launcher.py's."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import tfsync.elastic as elastic
from tfsync._hang_guard import FIRST_STEP_FACTOR, HANG_MARGIN_S, LEFT_S, STEP_FACTOR, HangGuard

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BOUND_S = 60  # every process here ends in seconds; this bounds a broken guard


def _worker(body, timeout_s=1.0, env=None, stopped_s=None):
    """A process that starts a guard (timeout ``timeout_s``, ``stopped_s``), prints its guard's pid,
    then runs ``body`` (``env``: variables set for it)."""
    code = textwrap.dedent(
        f"""
        import os, signal, sys, time
        sys.path.insert(0, {REPO!r})
        from tfsync._hang_guard import HangGuard
        guard = HangGuard({timeout_s}, "rank 1 of 4", stopped_s={stopped_s})
        print(guard._process.pid, flush=True)
        """
    ) + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _finish(process):
    try:
        out, err = process.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the worker was not ended within {BOUND_S} s: {err[-2000:]}")
    return process.returncode, out, err


def _gone(pid, within_s=10.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # (a zombie of ours: reap it)
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def test_a_frozen_worker_is_ended_saying_why():
    code, out, err = _finish(_worker("os.kill(os.getpid(), signal.SIGSTOP)\nprint('woke', flush=True)\n"))
    assert code == -signal.SIGKILL, (code, err)
    assert "woke" not in out  # ended while stopped: it never ran again
    assert "hang guard: ended rank 1 of 4 (pid" in err and "frozen: no heartbeat for 1.0 s" in err, err
    assert _gone(int(out.split()[0]))


def test_a_worker_stopped_by_a_signal_is_ended_when_its_peers_stop_waiting_not_at_the_hang_timeout():
    code, out, err = _finish(_worker("os.kill(os.getpid(), signal.SIGSTOP)\n", timeout_s=30.0, stopped_s=0.5))
    assert code == -signal.SIGKILL, (code, err)
    assert "it was stopped by a signal (SIGSTOP): no heartbeat for" in err, err
    assert "past the 0.5 s after which its peers no longer wait for it" in err and "frozen" not in err, err


def test_a_silent_heartbeat_of_a_running_worker_gets_the_whole_hang_timeout():
    # (its heartbeat thread ended, the process runs on: maybe a long call holding the GIL, not a stop)
    body = "guard._stopped.set()\nguard._thread.join()\ntime.sleep(30)\n"
    code, out, err = _finish(_worker(body, timeout_s=1.0, stopped_s=0.2))
    assert code == -signal.SIGKILL, (code, err)
    assert "it was frozen: no heartbeat for 1.0 s" in err and "SIGSTOP" not in err, err


def test_with_tfsync_hang_stacks_the_guard_writes_where_the_worker_hung_before_it_ends_it():
    body = "def stuck_here():\n    guard.begin()\n    time.sleep(30)\nstuck_here()\n"
    code, out, err = _finish(_worker(body, env={"TFSYNC_HANG_STACKS": "1"}))
    assert code == -signal.SIGKILL, (code, err)
    assert "hang guard: the stacks of rank 1 of 4 (pid" in err, err
    if shutil.which("py-spy"):
        assert "stuck_here" in err and "tfsync-hang-guard" in err, err  # the main thread and the heartbeat's
    else:
        assert "py-spy is not installed" in err, err
    assert err.index("the stacks of") < err.index("hang guard: ended"), err


def test_with_tfsync_hang_stacks_a_frozen_workers_stacks_are_read_too():
    # (py-spy cannot attach to a stopped process: the guard reads it without suspending it)
    body = "def frozen_here():\n    os.kill(os.getpid(), signal.SIGSTOP)\nfrozen_here()\n"
    code, out, err = _finish(_worker(body, env={"TFSYNC_HANG_STACKS": "1"}))
    assert code == -signal.SIGKILL, (code, err)
    assert "frozen: no heartbeat" in err and "hang guard: the stacks of rank 1 of 4 (pid" in err, err
    if shutil.which("py-spy"):
        assert "frozen_here" in err and "Failed to suspend" not in err, err
    else:
        assert "py-spy is not installed" in err, err


def test_a_bad_tfsync_hang_stacks_is_refused_saying_what_it_takes():
    code, out, err = _finish(_worker("pass\n", env={"TFSYNC_HANG_STACKS": "yes"}))
    assert code != 0 and "TFSYNC_HANG_STACKS='yes': expected 1" in err, (code, err)


def test_a_worker_stuck_in_one_step_is_ended_saying_why():
    body = "guard.begin()\ntime.sleep(30)\n"  # (its heartbeat thread runs on: only the step is stuck)
    t = time.monotonic()
    code, out, err = _finish(_worker(body))
    assert code == -signal.SIGKILL, (code, err)
    assert "its main thread was in one training step for" in err, err
    assert time.monotonic() - t >= STEP_FACTOR * 1.0  # (a step may take twice the hang timeout)


def test_a_worker_stuck_in_a_step_its_job_went_on_without_is_ended_at_the_hang_timeout_not_later():
    # (its peers gave up on it 0.5 s into the step: a healthy worker would have left the step
    # LEFT_S later; this one is ended at the hang timeout, 2 s, not at STEP_FACTOR times it)
    body = "t0 = time.monotonic()\nguard.begin('step', lambda: time.monotonic() - t0 > 0.5)\ntime.sleep(30)\n"
    code, out, err = _finish(_worker(body, timeout_s=2.0))
    assert code == -signal.SIGKILL, (code, err)
    said = "after its control path said that the job no longer waits for it (a peer stopped or was lost)"
    assert "its main thread was in one training step for" in err and said in err, err
    assert "past its hang timeout (2.0 s" in err, err
    # a fit's first step too (past the hang timeout its trace is no longer waited for either)
    body = "guard.begin('first', lambda: True)\ntime.sleep(30)\n"
    code, out, err = _finish(_worker(body, timeout_s=1.0))
    assert code == -signal.SIGKILL and said in err, (code, err)
    assert "its main thread was in a fit's first training step (where Keras traces the model) for" in err, err


def test_a_worker_that_leaves_its_step_when_its_job_went_on_is_left_alone_and_a_failing_check_changes_nothing():
    body = f"""
    guard.begin("step", lambda: True)
    time.sleep(1.5)  # past the hang timeout, within LEFT_S of the check's first True: a healthy reset
    guard.idle()
    guard.begin("step", lambda: 1 / 0)  # (a check that raises: the heartbeat goes on)
    time.sleep(1.5)
    guard.idle()
    guard.begin("restart", lambda: True)  # (a restart: no engine yet, not bounded by a check)
    time.sleep({LEFT_S} + 1.5)
    guard.idle()
    print("done", flush=True)
    """
    code, out, err = _finish(_worker(body))
    assert code == 0 and out.split()[-1] == "done", (code, err)
    assert "hang guard" not in err


def test_a_fits_first_step_gets_a_longer_bound_but_one_all_the_same():
    # (the trace: past twice the timeout it goes on, past FIRST_STEP_FACTOR times it is ended)
    body = """
    guard.begin("first")
    time.sleep(1.0)  # past twice the hang timeout (0.6 s), within ten times it
    guard.idle()
    print('traced', flush=True)
    guard.begin("first")
    time.sleep(30)
    """
    t = time.monotonic()
    code, out, err = _finish(_worker(body, timeout_s=0.3))
    assert code == -signal.SIGKILL and "traced" in out, (code, out, err)
    assert "its main thread was in a fit's first training step (where Keras traces the model) for" in err, err
    assert time.monotonic() - t >= FIRST_STEP_FACTOR * 0.3


def test_a_restart_that_never_reaches_its_first_step_is_bounded_too_and_its_stacks_written_once_when_slow():
    # (after a reset: the sync and the fit's start; past twice the timeout the guard writes its
    # stacks once, with TFSYNC_HANG_STACKS, and lets it go on; past FIRST_STEP_FACTOR times it ends it)
    body = """
    def restarting_here():
        guard.begin("restart")
        time.sleep(30)
    restarting_here()
    """
    t = time.monotonic()
    code, out, err = _finish(_worker(body, timeout_s=0.3, env={"TFSYNC_HANG_STACKS": "1"}))
    assert code == -signal.SIGKILL, (code, err)
    assert time.monotonic() - t >= FIRST_STEP_FACTOR * 0.3
    restart = "its restart after a reset (the state's sync and the fit's start, up to its first step)"
    assert f"its main thread was in {restart} for" in err, err
    slow = err.index("hang guard: the stacks of rank 1 of 4 (pid")
    assert f", in {restart} for" in err[slow : slow + 400] and "(ended at 3 s):" in err[slow : slow + 400], err
    assert err.count("hang guard: the stacks of") == 2 and err.index("before it is ended") > slow, err
    if shutil.which("py-spy"):
        assert "restarting_here" in err[slow : err.index("before it is ended")], err


def test_an_unknown_phase_is_refused():
    guard = HangGuard(5.0)
    try:
        with pytest.raises(ValueError, match=r"phase 'trace'; expected one of \['first', 'restart', 'step'\]"):
            guard.begin("trace")
    finally:
        guard.stop()


def test_a_worker_that_steps_on_is_left_alone_and_its_guard_ends_with_it():
    body = """
    for _ in range(30):  # 3 s of 0.1 s steps, three times the bound
        guard.begin()
        time.sleep(0.1)
        guard.idle()
    guard.begin()
    time.sleep(1.5)  # one step past the hang timeout, within twice it
    guard.idle()
    for _ in range(3):
        guard.begin()
        time.sleep(0.1)
        guard.idle()
    time.sleep(2.0)  # idle past the bound: no step under way, the heartbeat goes on
    print("done", flush=True)
    """
    code, out, err = _finish(_worker(body))
    assert code == 0 and out.split()[-1] == "done", (code, err)
    assert "hang guard" not in err
    assert _gone(int(out.split()[0]))  # the pipe closed with the worker: the guard ended


def test_a_stopped_guard_leaves_the_worker_unguarded():
    body = "guard.stop()\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    process = _worker(body)
    guard_pid = int(process.stdout.readline())
    assert _gone(guard_pid)
    time.sleep(1.5)  # past the bound: nothing ends the stopped worker
    assert process.poll() is None
    process.send_signal(signal.SIGCONT)
    code, _, err = _finish(process)
    assert code == 0 and "hang guard" not in err, err


def _state(**kw):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    return elastic.KerasState(model, **kw)


def test_the_auto_timeout_outlasts_a_steps_wait_on_peers():
    assert elastic.hang_timeout(_state(wait_timeout_s=10)) == 10 + HANG_MARGIN_S  # (no callback: the state's)
    state = _state(wait_timeout_s=100)
    import tfsync

    tfsync.keras.SyncCallback("bsp", elastic=state, wait_timeout_s=40)  # (the bound of the step's waits)
    assert elastic.hang_timeout(state) == 40 + HANG_MARGIN_S
    assert elastic.hang_timeout(_state(hang_timeout_s=7)) == 7.0
    assert elastic.hang_timeout(_state(hang_timeout_s=None)) is None
    # a worker stopped by a signal: under "auto" ended once its peers' links drop it (or at a
    # shorter wait bound), at the given seconds else
    from tfsync.control.transport import SILENT_LINK_S

    assert SILENT_LINK_S < 40 and elastic.stopped_timeout(state) == SILENT_LINK_S
    assert elastic.stopped_timeout(_state(wait_timeout_s=2)) == 2
    assert elastic.stopped_timeout(_state(hang_timeout_s=7)) == 7.0
    assert elastic.stopped_timeout(_state(hang_timeout_s=None)) is None


@pytest.mark.parametrize("bad", [0, -1, "soon", True, float("inf")])
def test_a_bad_hang_timeout_is_refused_saying_what_is_expected(bad):
    with pytest.raises(ValueError, match=r'hang_timeout_s must be "auto", a positive number of seconds or None'):
        _state(hang_timeout_s=bad)
