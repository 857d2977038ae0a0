"""tfsync across two hosts (network namespaces with their own sshd and hostname: :mod:`hosts`).

Each launch is ``horovodrun`` started as host 1, ranks on both hosts over ssh,
``--network-interfaces eth1``, bounded; the harness kills whatever a launch
left on either host.
"""

import os
import sys

import pytest

from tfsync.launch import REPO_ROOT

WORKERS = os.path.join(REPO_ROOT, "tests", "multihost", "workers")
LAUNCH_S = 240  # one launch, start-up of four TensorFlow processes on two cores included


def horovodrun(hosts, per_host, script, args=(), timeout_s=LAUNCH_S, env=None):
    """``horovodrun`` as host 1 across ``hosts`` with ``per_host`` ranks each; ``(code, output)``."""
    slots = ",".join(f"{hosts.address(i)}:{per_host}" for i in range(1, hosts.n + 1))
    argv = [
        "env",
        f"PYTHONPATH={REPO_ROOT}",
        "TF_CPP_MIN_LOG_LEVEL=2",
        "PYTHONUNBUFFERED=1",
        "HOROVOD_GLOO_TIMEOUT_SECONDS=60",
        *[f"{k}={v}" for k, v in (env or {}).items()],
        "horovodrun",
        "-np",
        str(per_host * hosts.n),
        "-H",
        slots,
        "--gloo",
        "--network-interfaces",
        "eth1",
        "--ssh-identity-file",
        hosts.key,
        sys.executable,
        script,
        *map(str, args),
    ]
    try:
        return hosts.run(1, argv, timeout_s)
    finally:
        hosts.kill_all()  # what the launch left on any host (remote ranks, ssh sessions)


def test_plain_horovod_allreduces_across_two_hosts(two_hosts):
    code, out = horovodrun(two_hosts, 1, os.path.join(WORKERS, "hello.py"))
    assert code == 0, out[-4000:]
    lines = sorted(line for line in out.splitlines() if "hello rank=" in line)
    assert len(lines) == 2, out[-4000:]
    assert "host=tfh1" in out and "host=tfh2" in out and all("sum=1" in line for line in lines), lines


@pytest.mark.parametrize("mode", ["bsp", "psp"])
def test_the_callback_trains_across_two_hosts_whose_names_only_they_resolve(two_hosts, mode):
    example = os.path.join(REPO_ROOT, "keras_examples", "digits.py")
    code, out = horovodrun(two_hosts, 1, example, ["--mode", mode, "--epochs", "1"])
    assert code == 0, out[-6000:]
