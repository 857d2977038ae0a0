"""tfsync across two hosts (network namespaces with their own sshd and hostname: :mod:`hosts`).

Each launch is ``horovodrun`` started as host 1, ranks on both hosts over ssh,
``--network-interfaces eth1``, bounded; the harness kills whatever a launch
left on either host.
"""

import os

import numpy as np
import pytest

from tests.parallel.launch import read_results
from tfsync.launch import REPO_ROOT

WORKERS = os.path.join(REPO_ROOT, "tests", "multihost", "workers")
LAUNCH_S = 240  # one launch, start-up of four TensorFlow processes on two cores included


def horovodrun(hosts, per_host, script, args=(), timeout_s=LAUNCH_S, env=None):
    """``horovodrun`` as host 1 across ``hosts`` with ``per_host`` ranks each; ``(code, output)``."""
    try:
        return hosts.run(1, hosts.horovodrun(per_host, [script, *args], env=env), timeout_s)
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


EVERY_MODE_S = 600  # one launch: every mode and variant through both frontends, four ranks on two cores
STRAGGLER = "slow=3:0.03"  # rank 3 (on the second host) 30 ms slower a step: PSP and backup workers close without it


@pytest.fixture(scope="module")
def every_mode(two_hosts, tmp_path_factory):
    """One launch across two hosts x two workers: every mode through the callback and the strategy."""
    out = tmp_path_factory.mktemp("every_mode")
    script = os.path.join(WORKERS, "every_mode.py")
    code, log = horovodrun(two_hosts, 2, script, [out, "--stragglers", STRAGGLER], timeout_s=EVERY_MODE_S)
    results = read_results(out)
    failed = {r: k for r, res in results.items() for k, run in res["runs"].items() if run["error"]}
    assert code == 0 and not failed, (failed, [results[r]["runs"][k]["error"] for r, k in failed.items()], log[-6000:])
    assert sorted(results) == [0, 1, 2, 3], log[-6000:]
    return results


def _every_mode_runs():
    from tfsync.policies import registry

    names = [*registry.configurations(), "auto"]
    refused = ("auto", "psp+pull")  # SyncStrategy refuses them, saying why (tests/single)
    return [f"callback:{n}" for n in names] + [f"strategy:{n}" for n in names if n not in refused]


@pytest.mark.timeout(EVERY_MODE_S + 120)  # (the first one launches every_mode's job)
@pytest.mark.parametrize("run", _every_mode_runs())
def test_every_mode_trains_across_two_hosts_with_identical_replicas(every_mode, run):
    """Replicas identical bit for bit, the weights moved, and every contribution accounted for."""
    per_rank = [every_mode[r]["runs"][run] for r in range(4)]
    for rank, res in enumerate(per_rank):
        assert res["moved"] > 0, (rank, res["moved"])
        for a, b in zip(res["weights"], per_rank[0]["weights"]):
            np.testing.assert_array_equal(a, b, err_msg=f"rank {rank} differs from rank 0 after {run}")
        c = res["counts"]
        # (a rank every round closes without, backup workers' slow one, may skip all its steps)
        assert c["produced"] + c["skipped"] > 0, (rank, c)
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"], (rank, c)
    if run == "callback:auto":
        assert all(res["auto_decisions"] >= 1 for res in per_rank), per_rank
