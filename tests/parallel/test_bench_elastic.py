"""``python -m tfsync.bench elastic`` runs and its JSON adds up (no timing checked): one worker of two
killed under SSP, with rounds in flight, and a short kill loop under BSP whose victim's host comes
back (tests/parallel/test_elastic_launcher.py kills under the other modes, once each)."""

import json
import os
import sys

import pytest

from tests.parallel.launch import ROOT
from tfsync.launch import run_bounded_command

pytestmark = pytest.mark.parallel
BOUND_S = 420  # four launches on two cores, each bounded by the bench itself


@pytest.mark.timeout(BOUND_S + 60)
def test_the_elastic_study_runs_and_its_records_add_up(tmp_path):
    path = tmp_path / "elastic.json"
    cmd = [sys.executable, "-m", "tfsync.bench", "elastic", "--modes", "ssp", "--epochs", "3"]
    cmd += ["--kill-batch", "5", "--loop-minutes", "0.6", "--kill-every-s", "12", "--timeout-s", "150"]
    cmd += ["--json", str(path)]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    code, out = run_bounded_command(cmd, env, BOUND_S)
    assert code == 0, out[-6000:]
    res = json.loads(path.read_text())
    assert res["failed"] == {} and "backup" in res["refused_on_one_worker"], res
    assert "| ssp(s=3) |" in out and "kill loop" in out, out[-3000:]

    (mode,) = res["modes"]
    assert mode["mode"] == "ssp" and mode["epochs"] == 3 and mode["kill_at"] == [1, 5], mode
    (kill,) = mode["kills"]  # one worker killed, one survivor that finished every epoch after one reset
    assert kill["rank"] == 1 and kill["epoch"] == 1 and kill["size_after"] == 1, kill
    assert mode["survivors"] == 1 and mode["survivor_resets"] == 1 and mode["survivor_epochs_finished"] == 3, mode
    assert mode["reset_s"] == kill["reset_s"] > 0 and 0 <= mode["rolled_back_steps"] <= 6 + 3, mode  # (s=3 ahead)
    assert mode["counts_add_up"], mode
    counts = mode["survivor_counts"]
    assert counts["produced"] == sum(counts[k] for k in ("applied", "compensated", "dropped", "rejected", "lost"))
    assert mode["accuracy_delta_points"] == pytest.approx(100 * (mode["accuracy"] - mode["undisturbed_accuracy"]))

    loop = res["loop"]
    assert loop["mode"] == "bsp" and loop["n_kills"] == len(loop["kills"]) >= 1, loop
    assert loop["reset_s"]["n"] == loop["n_kills"], loop  # every kill followed by a survivor's step
    assert loop["resets"] >= loop["n_kills"] and loop["epochs"] >= 1 and loop["counts_add_up"], loop
    # every process that finished, the first survivor and each replacement, within a point of the same
    # job undisturbed for as many epochs
    assert loop["accuracy_min_over_finishers"] >= loop["undisturbed_accuracy"] - 0.01, loop
    # BSP: the survivor redoes batches 0-5 of the interrupted epoch (0-4 if the kill came before its step 5 ended)
    assert all(k["reset_s"] > 0 and k["rolled_back"] in (5, 6) for k in loop["kills"]), loop
