"""``python -m tfsync.bench chaos`` across two simulated hosts, briefly: every fault it injects is
survived, the accounting holds after every reset, and its record has the fields the soak's
study reads (the 20-minute soak itself is docs/results/chaos)."""

import json

from tfsync.bench import chaos

FIELDS = (
    "mode",
    "faults_injected",
    "faults_survived",
    "faults_survived_by_kind",
    "resets",
    "steps_redone",
    "samples_redone",
    "goodput",
    "final_accuracy",
    "undisturbed_accuracy",
    "accounting_ok",
)


def test_a_short_soak_survives_a_kill_a_hang_and_a_nan(two_hosts, tmp_path):
    out = tmp_path / "chaos.json"
    args = chaos.parse_args(
        ["--modes", "bsp", "--minutes", "1", "--undisturbed-minutes", "0.5", "--fault-every", "12"]
        + ["--kinds", "kill", "stop", "nan", "--seed", "1", "--json", str(out)]
    )
    records = chaos.run(args, two_hosts, log=lambda line: None)
    assert json.loads(out.read_text()) == records
    (record,) = records
    assert "failed" not in record, record.get("failed")
    assert record["job_lost"] is None, record["job_lost"]
    assert all(field in record for field in FIELDS), sorted(record)
    assert record["faults_injected"] >= 2, record["faults"]
    assert record["faults_survived"] == record["faults_injected"], record
    assert sum(record["faults_survived_by_kind"].values()) == record["faults_survived"]
    assert record["resets"] >= 1 and record["accounting_ok"] and record["accounting_checks"] > 0, record
    assert record["final_accuracy"] > 0.8 and 0 < record["goodput"], record
    if record["faults_injected_by_kind"].get("stop"):
        assert record["hung_workers_ended"] >= 1, record
