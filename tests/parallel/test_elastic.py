"""Elastic training (tfsync.elastic) under horovodrun's elastic launcher, on one host.

Two workers on two host names of this machine (Horovod blacklists the host of a worker that
fails); the digits MLP for EPOCHS epochs.  A worker kills itself (SIGKILL) at a given
(epoch, batch); the survivor resets, goes on alone from the last commit (the last epoch
end) and finishes every epoch.
"""

import json
import os

import pytest

from tests.parallel.launch import read_results, run_elastic_workers

pytestmark = pytest.mark.parallel
EPOCHS = 5
KILL_AT = (1, 10)  # (epoch, batch): mid-epoch, so the reset rolls back 10 steps
RESET_BOUND_S = 10.0  # from the kill to the survivor's next step (measured well under 1 s here)


def _launch(tmp_path, mode, victim, *, reset_limit=None, expect_success=True):
    out = tmp_path / f"{mode}-{victim}"
    out.mkdir()
    args = [out, mode, victim, *KILL_AT, EPOCHS]
    code, output = run_elastic_workers("elastic.py", 2, args, str(out), min_np=1, reset_limit=reset_limit)
    if expect_success:
        assert code == 0, output[-8000:]
    killed = None
    if (out / "killed.json").exists():
        killed = json.loads((out / "killed.json").read_text())
    return code, output, read_results(str(out)), killed


def _check_counts(counts):
    settled = sum(counts[k] for k in ("applied", "compensated", "dropped", "rejected", "lost"))
    assert counts["produced"] == settled, counts


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The same job with nobody killed: its final accuracy is the target."""
    _, _, results, killed = _launch(tmp_path_factory.mktemp("undisturbed"), "bsp", -1)
    assert killed is None and sorted(results) == [0, 1], results
    for res in results.values():
        assert res["resets"] == 0 and res["epochs"] == list(range(EPOCHS)), res
        assert res["counts"]["lost"] == 0, res
        _check_counts(res["counts"])
    assert results[0]["checksum"] == results[1]["checksum"]
    return results[0]["accuracy"]


@pytest.mark.parametrize(
    "mode,victim",
    [
        ("bsp", 1),
        # the process that is rank 0 (PSP's coordinator, the control service) dies: the other
        # becomes rank 0 of the re-formed job
        ("psp", 0),
        ("ssp", 0),  # rounds in flight when it dies: the survivor counts them lost
    ],
)
def test_a_killed_worker_costs_no_epoch_and_no_accuracy(tmp_path, undisturbed, mode, victim):
    _, _, results, killed = _launch(tmp_path, mode, victim)
    assert killed is not None and killed["rank"] == victim, killed
    assert sorted(results) == [0], results  # one survivor, rank 0 of the re-formed job
    res = results[0]
    assert res["pid"] != killed["pid"]
    assert res["resets"] == 1 and res["size"] == 1, res
    assert res["memberships"] == [
        {"rank": 1 - victim, "size": 2, "epoch": 0},
        {"rank": 0, "size": 1, "epoch": KILL_AT[0]},  # from the last commit: epoch KILL_AT[0]'s start
    ], res
    # every epoch finished: the interrupted one again, from its start
    assert res["epochs"] == list(range(KILL_AT[0])) + list(range(KILL_AT[0], EPOCHS)), res
    assert res["state_epoch"] == EPOCHS
    assert res["accuracy"] >= undisturbed - 0.01, (res["accuracy"], undisturbed)
    # this worker's contributions add up, lost ones included; the job's as committed too
    _check_counts(res["counts"])
    _check_counts(res["state_counts"])
    if mode == "bsp":  # its round was under way when the peer died
        assert res["counts"]["lost"] == 1, res["counts"]
    assert res["first_step_after_reset_t"] - killed["t"] < RESET_BOUND_S, res
    traces = tmp_path / f"{mode}-{victim}" / "trace"
    trace = [json.loads(line) for line in open(traces / "reset0" / f"rank{1 - victim}.jsonl")]
    resets = [r for r in trace if r.get("event") == "reset"]
    assert len(resets) == 1 and resets[0]["lost"] == res["counts"]["lost"], resets
    assert os.path.exists(traces / "reset1" / "rank0.jsonl")  # the re-formed job's engine traces apart


def test_backup_workers_refuse_to_go_on_alone(tmp_path):
    """BackupWorkers(backups=1) cannot close a round with one worker: the survivor says so."""
    code, output, results, killed = _launch(tmp_path, "backup", 1, expect_success=False)
    assert killed is not None and code != 0 and not results
    assert "tfsync.elastic: the job has 1 workers now" in output and "--min-np" in output, output[-4000:]


def test_exceeding_the_reset_limit_fails_saying_so(tmp_path):
    code, output, results, killed = _launch(tmp_path, "bsp", 1, reset_limit=0, expect_success=False)
    assert killed is not None and code != 0 and not results
    assert "number of resets during elastic job exceeded limit: 0" in output, output[-4000:]
