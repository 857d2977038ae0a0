"""tfsync across two hosts (network namespaces with their own sshd and hostname: :mod:`hosts`).

Each launch is ``horovodrun`` started as host 1, ranks on both hosts over ssh,
``--network-interfaces eth1``, bounded; the harness kills whatever a launch
left on either host.
"""

import os
import subprocess
import time

import numpy as np
import pytest

from tests.parallel.launch import read_results
from tfsync.bench.hosts import kill
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
# rank 3 (on the second host) 30 ms slower a step: PSP and backup workers close without it; every
# step 50 ms of simulated device time, so that each callback run lasts past its link flap
STRAGGLER = "base=0.05,slow=3:0.03"
CALLBACK_EPOCHS = 6  # 48 steps of a callback run: the flap comes after its 8th
MARK_STEP = 8
FLAP_S = 2.0  # how long the second host's link stays down in each callback run
MARKS_S = 180  # until every rank has passed a run's marked step (the first: four TensorFlow start-ups)


@pytest.fixture(scope="module")
def every_mode(two_hosts, tmp_path_factory):
    """One launch across two hosts x two workers: every mode through the callback and the strategy;
    in each callback run, once every rank has passed its 8th step, the second host's link goes
    down for 2 s and comes back (a flap every mode must ride out)."""
    out = tmp_path_factory.mktemp("every_mode")
    script = os.path.join(WORKERS, "every_mode.py")
    argv = [script, out, "--stragglers", STRAGGLER, "--callback-epochs", CALLBACK_EPOCHS, "--mark-step", MARK_STEP]
    log_path = out / "launch.log"
    deadline = time.monotonic() + EVERY_MODE_S
    with open(log_path, "w") as log:
        proc = two_hosts.popen(1, two_hosts.horovodrun(2, argv), stdout=log, stderr=subprocess.STDOUT)
        try:
            for i in range(len(_callback_runs())):
                _wait_for_marks(out, i, proc, log_path)
                two_hosts.set_link(2, up=False)
                time.sleep(FLAP_S)
                two_hosts.set_link(2, up=True)
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"every_mode did not end within {EVERY_MODE_S} s:\n{_tail(log_path)}") from None
        finally:
            two_hosts.set_link(2, up=True)
            kill(proc)
            two_hosts.kill_all()
    results = read_results(out)
    failed = {r: k for r, res in results.items() for k, run in res["runs"].items() if run["error"]}
    errors = [results[r]["runs"][k]["error"] for r, k in failed.items()]
    assert code == 0 and not failed, (failed, errors, _tail(log_path))
    assert sorted(results) == [0, 1, 2, 3], _tail(log_path)
    return results


def _wait_for_marks(out, run, proc, log_path):
    """Until every rank has written callback run ``run``'s mark (bounded)."""
    paths = [out / f"at{run}_rank{r}.json" for r in range(4)]
    deadline = time.monotonic() + MARKS_S
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, f"every_mode ended before run {run}'s mark:\n{_tail(log_path)}"
        assert time.monotonic() < deadline, f"not every rank passed run {run}'s mark within {MARKS_S} s"
        time.sleep(0.2)


def _tail(path):
    return path.read_text()[-6000:]


def _callback_runs():
    from tfsync.policies import registry

    return [*registry.configurations(), "auto"]


def _every_mode_runs():
    names = _callback_runs()
    refused = ("auto", "psp+pull")  # SyncStrategy refuses them, saying why (tests/single)
    return [f"callback:{n}" for n in names] + [f"strategy:{n}" for n in names if n not in refused]


@pytest.mark.timeout(EVERY_MODE_S + 120)  # (the first one launches every_mode's job)
@pytest.mark.parametrize("run", _every_mode_runs())
def test_every_mode_trains_across_two_hosts_with_identical_replicas(every_mode, run):
    """Replicas identical bit for bit, the weights moved, and every contribution accounted for
    (through a 2 s link flap in each callback run)."""
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
