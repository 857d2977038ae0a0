"""``python -m tfsync.bench control`` at a small size: it runs, and its records say what they must."""

import json
import subprocess
import sys

import pytest

from tfsync.launch import REPO_ROOT

FIELDS = (
    "workers",
    "policy",
    "rounds_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "reports_per_s",
    "rank0_cpu_ms_per_round",
    "rank0_threads",
    "rank0_cpu_percent",
    "rank0_rss_mb",
)
BENCH_TIMEOUT_S = 300


@pytest.mark.parametrize(("policy", "relays"), [("backup", "auto"), ("psp", "off"), ("dssp", "auto")])
def test_the_control_benchmark_writes_a_record_per_size(tmp_path, policy, relays):
    out = tmp_path / "control.json"
    cmd = [sys.executable, "-m", "tfsync.bench", "control", "--workers", "4", "16", "--policy", policy]
    cmd += ["--rounds", "20", "--relays", relays, "--json", str(out), "--plot", str(tmp_path / "control.png")]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [r["workers"] for r in records] == [4, 16] and {r["policy"] for r in records} == {policy}
    for r in records:
        assert all(k in r for k in FIELDS), sorted(r)
        assert r["rounds_per_s"] > 0 and 0 <= r["latency_p50_ms"] <= r["latency_p99_ms"]
        assert r["rank0_threads"] >= 1 and r["rank0_rss_mb"] > 0 and r["rank0_cpu_ms_per_round"] > 0
        assert r["hosts"] == -(-r["workers"] // 8) and r["relays"] == relays
        # every worker's every round reached rank 0 (dssp: its steps' notices)
        served = r["served"]
        if policy == "dssp":
            assert served["tells"] == r["workers"] * r["rounds"], served
        else:
            assert served["ready"] == r["workers"] * r["rounds"], served
    assert "| workers | policy |" in proc.stdout
    assert (tmp_path / "control.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("simulate", ["hosts", "links"])
def test_the_control_benchmark_deploys_group_relays_as_a_large_job_does(tmp_path, simulate):
    # ten hosts of 3: rank 0's, then nine relaying hosts, eight of them behind a group relay; rank
    # 0's links: its own, its host's relay, the group relay and the ninth host's relay
    out = tmp_path / "control.json"
    cmd = [sys.executable, "-m", "tfsync.bench", "control", "--workers", "30", "--ranks-per-host", "3"]
    cmd += ["--policy", "backup", "--rounds", "20", "--simulate", simulate, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = json.loads(out.read_text())
    assert record["rank0_links"] == 4 and record["simulate"] == simulate
    assert record["served"]["ready"] == 30 * 20, record["served"]
    assert record["rounds_per_s"] > 0 and record["rank0_cpu_ms_per_round"] > 0


def test_links_are_not_simulated_for_dssp(tmp_path):
    cmd = [sys.executable, "-m", "tfsync.bench", "control", "--workers", "8", "--policy", "dssp"]
    cmd += ["--simulate", "links", "--json", str(tmp_path / "c.json")]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 2 and "--simulate links runs the rounds of backup and psp" in proc.stderr
