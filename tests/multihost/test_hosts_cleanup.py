"""What the multi-host harness leaves when the process that made the hosts is told to stop.

No ``two_hosts`` fixture here: this module makes (and kills) its own hosts, so no other
module's may be alive while it runs (pytest runs the modules one after another)."""

import contextlib
import os
import signal
import subprocess
import sys
import time

from tfsync.bench.hosts import PREFIX

HOLDER = """
import time
from tfsync.bench.hosts import Hosts
with Hosts(2) as hosts:
    hosts.shape_link(1, "200mbit")
    print("UP", hosts._dir, flush=True)
    time.sleep(120)
"""


def _namespaces():
    return [
        ns
        for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if ns.startswith(PREFIX)
    ]


def _sshds(directory):
    out = subprocess.run(["pgrep", "-f", f"sshd -D -e -f {directory}"], capture_output=True, text=True)
    return out.stdout.split()


@contextlib.contextmanager
def _holder():
    """A process holding two hosts, once they are up: ``(process, its key directory)``; killed
    on the way out if it still runs."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # (bounded: the holder sleeps 120 s at most)
        assert line.startswith("UP "), line
        yield p, line.split()[1]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def test_a_sigterm_to_the_holder_removes_the_hosts_and_their_sshds():
    with _holder() as (p, directory):
        assert len(_namespaces()) == 3 and len(_sshds(directory)) == 2
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
    assert _namespaces() == [] and _sshds(directory) == [] and not os.path.exists(directory)


def test_what_a_sigkill_leaves_the_next_hosts_remove():
    with _holder() as (p, directory):
        p.kill()  # (no cleanup can run)
        p.wait(timeout=30)
        assert len(_namespaces()) == 3 and len(_sshds(directory)) == 2
    from tfsync.bench.hosts import Hosts

    with Hosts(2):
        deadline = time.monotonic() + 10
        while _sshds(directory) and time.monotonic() < deadline:  # (SIGKILL is delivered asynchronously)
            time.sleep(0.1)
        assert _sshds(directory) == [] and not os.path.exists(directory)
    assert _namespaces() == []
