"""What a stalled launch waits on: every Python stack of a launch's processes (:func:`dump_stacks`),
for the chaos bench's stalled runs (:mod:`tfsync.bench.chaos`)."""

import contextlib
import os
import shutil
import subprocess

from tfsync.launch import REPO_ROOT

GUARD = os.path.join(REPO_ROOT, "tfsync", "_hang_guard.py")  # each worker's hang guard (its command line)


def dump_stacks(pid, path, match):
    """The Python stacks of process ``pid``, of its descendants (the launcher: horovodrun's driver)
    and of every process whose command line holds ``match`` (the workers, which ssh starts
    elsewhere), written to ``path`` with ``py-spy dump``: what a stalled launch waits on.  Where
    ``gdb`` is installed, the workers' threads without Python frames too (Horovod's background
    thread, which py-spy does not show).  Does nothing without py-spy; each dump is bounded (30 s).

    The hang guards of those processes are stopped while it runs: py-spy and gdb hold a worker
    still while they read it (gdb for seconds), which its guard would take for a frozen worker
    and end."""
    import psutil

    spy = shutil.which("py-spy")
    if spy is None:
        return
    try:
        launch = psutil.Process(pid)
        procs = [launch, *launch.children(recursive=True)]
    except psutil.Error:
        procs = []
    seen = {p.pid for p in procs}
    listed = [(p, " ".join(_cmdline(p))) for p in psutil.process_iter()]  # (one pass: both uses below)
    procs += [p for p, cmd in listed if p.pid not in seen and match in cmd]
    pids = {p.pid for p in procs}
    guards = [p for p, cmd in listed if GUARD in cmd and _parent(p) in pids]
    for guard in guards:
        with contextlib.suppress(psutil.Error):
            guard.suspend()
    try:
        _dump_stacks([p for p in procs if p not in guards], path, match, spy)
    finally:
        for guard in guards:
            with contextlib.suppress(psutil.Error):
                guard.resume()


def _dump_stacks(procs, path, match, spy):
    gdb = shutil.which("gdb")
    with open(path, "w") as f:
        for p in procs:
            cmd = " ".join(_cmdline(p))
            if "python" not in cmd:
                continue
            dumps = [("py-spy", [spy, "dump", "--native", "--pid", str(p.pid)])]
            if gdb is not None and match in cmd and not cmd.startswith(("/bin/sh", "ssh")):
                dumps.append(("gdb", [gdb, "-p", str(p.pid), "-batch", "-nx", "-ex", "thread apply all bt"]))
            for tool, argv in dumps:
                try:
                    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
                    text = r.stdout + r.stderr
                except subprocess.TimeoutExpired:
                    text = f"({tool} did not answer within 30 s)\n"
                f.write(f"=== pid {p.pid} ({tool}): {cmd[:300]}\n{text}\n")


def _parent(process):
    try:
        return process.ppid()
    except Exception:  # noqa: BLE001 - gone
        return None


def _cmdline(process):
    try:
        return process.cmdline()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return []


__all__ = ["dump_stacks"]
