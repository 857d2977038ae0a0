"""Elastic training across two simulated hosts (:mod:`tfsync.bench.hosts`), one worker on each.

``horovodrun --min-np 1 --max-np 2 --host-discovery-script`` as host 1, the discovery script
printing a hosts file; the job is ``tfsync/bench/_elastic_worker.py`` (the digits MLP under
``tfsync.elastic``).  Its rank 0 rewrites the hosts file at given epoch ends, or a worker
kills itself mid-epoch; every launch is bounded and the harness kills what it left.
"""

import json
import os

from tests.parallel.launch import read_results
from tfsync.launch import REPO_ROOT

WORKER = os.path.join(REPO_ROOT, "tfsync", "bench", "_elastic_worker.py")
LAUNCH_S = 300  # TensorFlow start-ups on two cores, a joining worker's included
GLOO_S = 10


def _launch(hosts, out, mode, victim, epochs, changes=""):
    hosts_file = os.path.join(out, "hosts")
    with open(hosts_file, "w") as f:
        f.write("".join(f"{hosts.address(i)}:1\n" for i in (1, 2)))
    discovery = os.path.join(out, "discover_hosts.sh")
    with open(discovery, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(discovery, 0o755)
    elastic = ["--min-np", 1, "--max-np", 2, "--host-discovery-script", discovery]
    argv = [WORKER, out, mode, victim, 1, 10, epochs, hosts_file, changes]
    try:
        code, output = hosts.run(1, hosts.horovodrun(1, argv, gloo_timeout_s=GLOO_S, elastic=elastic), LAUNCH_S)
    finally:
        hosts.kill_all()
    assert code == 0, output[-8000:]
    return read_results(out), output


def _settled(counts):
    return sum(counts[k] for k in ("applied", "compensated", "dropped", "rejected", "lost"))


def test_a_host_removed_by_discovery_and_added_back(two_hosts, tmp_path):
    a, b = two_hosts.address(1), two_hosts.address(2)
    epochs = 6
    results, output = _launch(two_hosts, str(tmp_path), "bsp", -1, epochs, f"1={a}:1;3={a}:1+{b}:1")
    assert sorted(results) == [0, 1], output[-6000:]
    survivor = next(r for r in results.values() if len(r["memberships"]) == 3)
    joiner = next(r for r in results.values() if r is not survivor)
    assert [m["size"] for m in survivor["memberships"]] == [2, 1, 2], survivor
    assert survivor["epochs"] == list(range(epochs)), survivor  # nothing redone
    assert joiner["epochs"] == list(range(survivor["memberships"][2]["epoch"], epochs)), joiner
    assert survivor["checksum"] == joiner["checksum"] and survivor["accuracy"] >= 0.9, results
    assert survivor["state_counts"]["produced"] == _settled(survivor["state_counts"])


def test_a_worker_killed_on_the_other_host(two_hosts, tmp_path):
    """Rank 1 (host 2) dies mid-epoch: rank 0 resets at its failed collective and finishes alone."""
    epochs = 4
    results, output = _launch(two_hosts, str(tmp_path), "ssp", 1, epochs)
    killed = json.load(open(tmp_path / "killed.json"))
    assert sorted(results) == [0], output[-6000:]
    res = results[0]
    assert res["resets"] == 1 and res["size"] == 1 and res["state_epoch"] == epochs, res
    assert res["epochs"] == list(range(epochs)), res
    assert res["counts"]["produced"] == _settled(res["counts"]), res
    # across hosts a dead peer's connection fails at once too: no wait for the loss report
    assert res["first_step_after_reset_t"] - killed["t"] < 10.0, res
