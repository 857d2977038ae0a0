"""A hung worker of an elastic job is ended, so that the launcher re-forms the job without it.

Horovod's elastic launcher re-forms a job when a worker's process *exits*: every member of the
last rendezvous must record itself (ready, failed or done) before the launcher assigns new
ranks.  A worker that hangs (stopped by SIGSTOP, a frozen VM, a deadlock, a GPU stuck in a
kernel) records nothing, so the survivors, which gave up on it within the wait bound, would
wait in the launcher for ever.  Neither the survivors (other hosts) nor the hung process itself
(frozen) can end it; a process beside it can.

:class:`HangGuard` starts that process, this file run as a script (Python's standard library
only: it starts in tens of milliseconds and holds a few MB), as a child of the worker.  The
worker's heartbeat thread writes to the guard's standard input every :data:`HEARTBEAT_S`; the
guard ends the worker (SIGKILL) when

* nothing arrives for ``hang_timeout_s``: the whole process is frozen (its threads stopped),
* nothing arrives for ``stopped_s`` and the kernel says the process is stopped by a signal
  (SIGSTOP: state ``T`` in ``/proc/<pid>/stat``): it is certainly not running, so it is ended
  once its peers no longer wait for it (under ``hang_timeout_s="auto"``: when their control
  links drop its silent ones, or at the wait bound if sooner), while a missing heartbeat alone
  could be a long call that holds the GIL and gets the whole hang timeout, or
* the heartbeat says the worker's main thread has been in one phase of :data:`PHASES` past its
  bound: one training step for more than twice ``hang_timeout_s`` (:data:`STEP_FACTOR`: the main
  thread is stuck while the others still run); a fit's first step, where Keras traces the
  model, or the restart after a reset (the state's sync and the fit's start, up to its first
  step) for more than :data:`FIRST_STEP_FACTOR` times ``hang_timeout_s`` (a trace takes
  seconds to minutes; a worker stuck in one would hold every peer in the launcher's next
  rendezvous), or
* the main thread has been in a step or a fit's first step for more than ``hang_timeout_s``
  and its control path said, :data:`LEFT_S` before, that the job no longer waits for it (a
  peer stopped or was lost: the ``went_on`` check given to :meth:`HangGuard.begin`): a healthy
  worker's wait reads that within a second and leaves the step for a reset, so one still in it
  is stuck (a deadlock, a kernel that never returns), and it is ended when its peers have just
  given up on it rather than a hang timeout or more later.

``hang_timeout_s`` is longer than a step's waits on peers (the wait bound, whose every wait in a
step is bounded: the collectives run on the engine's exchange thread), so by the time the guard
ends a frozen worker, its peers have given up on it.  A step lasts its own compute plus such a
wait plus the notice of a stop (up to 2 s), so the bound on one step is twice as long: a healthy
worker waiting on a hung peer gets its own bounded error first and is never ended.  The
launcher then sees the exit, blacklists the host (for its cooldown,
``--blacklist-cooldown-range``) and re-forms the job from the survivors.  The guard writes why
to the worker's standard error (horovodrun prefixes it with the rank), so the job's log says
which worker was ended and after how long; with ``TFSYNC_HANG_STACKS=1`` it writes the worker's
stacks there first (``py-spy dump``, bounded by :data:`STACKS_TIMEOUT_S`): where a worker hung,
and, once, the stacks of a worker still in a long-bounded phase past twice the hang timeout
(which its peers no longer wait for), without ending it: where a slow restart or trace spends
its time.
The guard ends itself when the worker's end closes the pipe.
"""

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

HEARTBEAT_S = 0.25  # the worker's heartbeat period
HANG_MARGIN_S = 2.0  # hang_timeout_s "auto": the wait bound plus this
# a step may take its own compute plus a wait on peers up to the bound plus the stop notice: one
# in a step this many times the hang timeout is stuck (a frozen process: the hang timeout itself)
STEP_FACTOR = 2.0
# a worker whose job went on without it (a peer's stop or loss) leaves its step within about a
# second (its wait reads the notice once a second): one still in it this long after is stuck
LEFT_S = 2.0
# a fit's first step traces the model (seconds to minutes): bounded at this many hang timeouts
FIRST_STEP_FACTOR = 10.0
# what the main thread may be in (HangGuard.begin), each phase's bound in hang timeouts and its name
PHASES = {
    "step": (STEP_FACTOR, "one training step"),
    "first": (FIRST_STEP_FACTOR, "a fit's first training step (where Keras traces the model)"),
    "restart": (
        FIRST_STEP_FACTOR,
        "its restart after a reset (the state's sync and the fit's start, up to its first step)",
    ),
}
STACKS_TIMEOUT_S = 10.0  # the most a stack dump may delay the end of a hung worker


class HangGuard:
    """The worker's side: starts the guard process and keeps it fed (see the module docstring).

    Args:
        hang_timeout_s: how long the process may be frozen, or its main thread in one step,
            before the guard ends it.
        label: who this worker is, for the guard's message (:meth:`label` updates it).
        stopped_s: how long the process may be stopped by a signal (SIGSTOP) before the guard
            ends it: when its peers no longer wait for it; at most ``hang_timeout_s`` (None:
            ``hang_timeout_s``).
    """

    def __init__(self, hang_timeout_s: float, label: str = "", stopped_s: float | None = None):
        self.hang_timeout_s = float(hang_timeout_s)
        # (a stopped process: ended at this, never later than a frozen one)
        self.stopped_s = self.hang_timeout_s if stopped_s is None else min(float(stopped_s), self.hang_timeout_s)
        self._label = label
        self._began = None  # when the phase under way began (monotonic), None between phases
        self._phase = "step"  # which (a key of PHASES)
        self._told_slow = False  # the guard was told this phase is slow (its stacks written)
        self._watch = [None, None]  # the step's went_on check, and when it first said so (monotonic)
        self._lock = threading.Lock()
        from tfsync import _env  # (here: the guard process itself imports nothing of tfsync)

        self._stacks = _env.hang_stacks()
        stacks = "stacks" if self._stacks else "-"
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-I",
                os.path.abspath(__file__),
                str(os.getpid()),
                repr(self.hang_timeout_s),
                stacks,
                repr(self.stopped_s),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        # never block on the pipe (a guard that is itself stopped would fill it): a line that does
        # not fit is dropped, the next heartbeat follows
        os.set_blocking(self._process.stdin.fileno(), False)
        self._send(f"label {label}")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tfsync-hang-guard", daemon=True)
        self._thread.start()

    def label(self, text: str):
        """Who this worker is now (its rank and size change at a reset)."""
        self._send(f"label {text}")

    def begin(self, phase: str = "step", went_on=None):
        """The main thread enters ``phase`` (a key of :data:`PHASES`: ``"step"``, a training step;
        ``"first"``, a fit's first; ``"restart"``, after a reset until the first step): from now,
        staying in it past its bound ends the process.

        ``went_on``: for a ``"step"`` or a ``"first"``, a check the heartbeat thread calls (it
        must not block): True once the job no longer waits for this worker
        (``Engine.job_went_on``); the phase is then bounded at ``hang_timeout_s`` from its begin
        and :data:`LEFT_S` from the first True (a first step's trace past the hang timeout
        included: its peers are resetting without it, and ending it costs its restart, not the
        job)."""
        if phase not in PHASES:
            raise ValueError(f"HangGuard.begin: phase {phase!r}; expected one of {sorted(PHASES)}")
        self._phase, self._told_slow = phase, False
        self._watch = [went_on if phase != "restart" else None, None]
        self._began = time.monotonic()

    def idle(self):
        """No phase under way (between steps, in a reset's re-form, after training)."""
        self._began = None

    def stop(self):
        """End the guard (the worker goes on unguarded)."""
        self._stopped.set()
        self._thread.join(timeout=2 * HEARTBEAT_S + 1)
        try:
            self._process.stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()

    def _send(self, line: str):
        with self._lock:
            try:
                os.write(self._process.stdin.fileno(), line.encode("utf-8", "replace") + b"\n")
            except (BlockingIOError, BrokenPipeError, OSError, ValueError):  # full, or the guard has gone
                pass

    def _beat(self):
        while not self._stopped.wait(HEARTBEAT_S):
            began, phase, watch = self._began, self._phase, self._watch
            now = time.monotonic()
            seconds = 0.0 if began is None else now - began
            factor = PHASES[phase][0]
            left = None if began is None else self._left(watch, now)
            if seconds > factor * self.hang_timeout_s:
                self._send(f"hung {seconds:.1f} {phase}")
            elif left is not None and seconds > self.hang_timeout_s and left >= LEFT_S:
                self._send(f"left {seconds:.1f} {left:.1f} {phase}")
            elif self._stacks and not self._told_slow and seconds > STEP_FACTOR * self.hang_timeout_s:
                self._told_slow = True  # (a long-bounded phase past a step's bound: its stacks, once)
                self._send(f"slow {seconds:.1f} {phase}")
            else:
                self._send(".")

    @staticmethod
    def _left(watch, now):
        """Seconds since the step's ``went_on`` check first said the job went on (None: not yet,
        or no check); a check that fails counts as not yet (the heartbeat must go on)."""
        went_on, since = watch
        if went_on is None or since is not None:
            return None if since is None else now - since
        try:
            gone = bool(went_on())
        except Exception:  # noqa: BLE001 - the engine may be closing under the check
            gone = False
        if gone:
            watch[1] = now
            return 0.0
        return None


def _guard(parent: int, hang_timeout_s: float, stacks: bool, stopped_s: float):
    """The guard process: read heartbeats until the worker hangs (end it) or ends (return);
    ``stopped_s`` <= ``hang_timeout_s`` (:class:`HangGuard` bounds it)."""
    fd = sys.stdin.fileno()
    label, pending, last = "", b"", time.monotonic()
    while True:
        now = time.monotonic()
        until = last + hang_timeout_s
        if stopped_s < hang_timeout_s:  # (silent past stopped_s: look at its state every heartbeat)
            until = min(until, max(last + stopped_s, now + HEARTBEAT_S))
        ready, _, _ = select.select([fd], [], [], max(0.0, until - now))
        if not ready:
            silent = time.monotonic() - last
            if silent >= hang_timeout_s:
                why = f"it was frozen: no heartbeat for {hang_timeout_s:.1f} s"
                return _end(parent, label, why, _past(hang_timeout_s), stacks, frozen=True)
            if silent >= stopped_s and _stopped(parent):
                why = f"it was stopped by a signal (SIGSTOP): no heartbeat for {silent:.1f} s"
                bound = f"past the {stopped_s:.1f} s after which its peers no longer wait for it"
                return _end(parent, label, why, bound, stacks, frozen=True)
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return  # the worker ended (its pipe closed)
        last = time.monotonic()
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            if line.startswith("label "):
                label = line[len("label ") :]
            elif line.startswith("hung "):
                seconds, phase = line[len("hung ") :].split()
                why = f"its main thread was in {PHASES[phase][1]} for {seconds} s"
                return _end(parent, label, why, _past(hang_timeout_s), stacks)
            elif line.startswith("left "):
                seconds, left, phase = line[len("left ") :].split()
                why = (
                    f"its main thread was in {PHASES[phase][1]} for {seconds} s, still {left} s after its "
                    f"control path said that the job no longer waits for it (a peer stopped or was lost)"
                )
                return _end(parent, label, why, _past(hang_timeout_s), stacks)
            elif line.startswith("slow ") and stacks:
                seconds, phase = line[len("slow ") :].split()
                bound = PHASES[phase][0] * hang_timeout_s
                where = f"{_who(parent, label)}, in {PHASES[phase][1]} for {seconds} s (ended at {bound:.0f} s)"
                _write_stacks(parent, where)


def _who(parent: int, label: str) -> str:
    return f"{label} (pid {parent}, host {os.uname().nodename})" if label else f"pid {parent}"


def _stopped(pid: int) -> bool:
    """Whether the kernel says process ``pid`` is stopped by a signal (Linux: state ``T`` in
    ``/proc/<pid>/stat``; a debugger's tracing stop, ``t``, is not; elsewhere: never)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"T"  # (the name may hold ")")


def _past(hang_timeout_s: float) -> str:
    longer = "longer than its peers wait for it: they have given up on it"
    return f"past its hang timeout ({hang_timeout_s:.1f} s, {longer})"


def _end(parent: int, label: str, why: str, bound: str, stacks: bool = False, frozen: bool = False):
    """End the worker, saying ``why`` it hung and past which ``bound``."""
    who = _who(parent, label)
    if stacks:
        _write_stacks(parent, f"{who} before it is ended", frozen)
    sys.stderr.write(
        f"tfsync.elastic: hang guard: ended {who}: {why}, {bound}. The launcher re-forms the job without it and "
        f"blacklists its host for the cooldown; set KerasState(hang_timeout_s=...) if steps legitimately take "
        f"longer\n"
    )
    sys.stderr.flush()
    try:
        os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _write_stacks(parent: int, who: str, frozen: bool = False):
    """The hung (or slow) worker's stacks on standard error (``TFSYNC_HANG_STACKS=1``).

    A frozen process (SIGSTOP) is read without suspending it (``--nonblocking``, its Python
    stacks only): py-spy cannot attach to a stopped process to read native frames."""
    spy = shutil.which("py-spy")
    if spy is None:
        text = "py-spy is not installed (pip install py-spy)"
    else:
        how = ["--nonblocking"] if frozen else ["--native"]
        try:
            out = subprocess.run(
                [spy, "dump", *how, "--pid", str(parent)],
                capture_output=True,
                text=True,
                timeout=STACKS_TIMEOUT_S,
            )
            text = (out.stdout + out.stderr).rstrip()
        except subprocess.TimeoutExpired:
            text = f"py-spy did not answer within {STACKS_TIMEOUT_S:.0f} s"
    sys.stderr.write(f"tfsync.elastic: hang guard: the stacks of {who}:\n{text}\n")
    sys.stderr.flush()


if __name__ == "__main__":
    _guard(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "stacks", float(sys.argv[4]))
