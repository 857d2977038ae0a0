"""Elastic training across two simulated hosts (:mod:`tfsync.bench.hosts`), one worker on each.

``horovodrun --min-np 1 --max-np 2 --host-discovery-script`` as host 1, the discovery script
printing a hosts file; the job is ``tfsync/bench/_elastic_worker.py`` (the digits MLP under
``tfsync.elastic``).  Its rank 0 rewrites the hosts file at given epoch ends; every launch is bounded and the
harness kills what it left.  And a worker of four (two a host) killed from outside, by the
fault study's harness (``python -m tfsync.bench faults``).
"""

import os

from tests.parallel.launch import read_results
from tfsync.bench import faults
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


def test_a_worker_killed_on_the_other_host_costs_a_reset_not_the_job(two_hosts, tmp_path):
    """Elastic backup workers, two workers a host: rank 2, whose process runs its host's control
    relay, is SIGKILLed mid-training (the fault study's harness, ``python -m tfsync.bench
    faults``, once; seed 8 draws rank 2).  No survivor aborts inside Gloo (its failed
    allreduce's peer still sent it data as it negotiated the next cycle); the first error names
    exactly rank 2 and its host (its host's other worker finds the relay's port closed and tells
    rank 0 at once: after the re-attach grace, the survivors would have reset naming no rank);
    the job goes on on the other host's two workers, replicas identical."""
    args = faults.parse_args(
        ["--scenario", "kill", "--mode", "backup", "--seed", "8", "--epochs", "6", "--json", str(tmp_path / "f.json")]
    )
    record = faults.run_once(args, two_hosts, 0, str(tmp_path), log=print)
    assert record["outcome"] == "recovered", record.get("output_tail", record)
    assert record["replicas_identical"] and record["final_accuracy"] >= 0.9 and record["size"] == 2, record
    assert "EnforceNotMet" not in open(os.path.join(tmp_path, "run000", "launch.log")).read()
    error = record["first_error"]
    assert record["victim"] == 2 and error["named_ranks"] == [2], record
    assert error["named_hosts"] == [record["fault_host"]], error
