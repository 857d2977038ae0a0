"""Auto mode under horovodrun (the digits example): it classifies the slowness it measures,
switches where every replica is identical, and loses no contribution across the switch."""

import json
import os

import pytest

from tests.parallel.launch import digits, read_results, run_workers
from tfsync.policies.auto import EARLY_STEPS, STRAGGLER_RATIO

pytestmark = pytest.mark.parallel


def auto(trace_dir, stragglers, epochs):
    return digits(
        "digits.py", "--mode", "auto", "--epochs", epochs, "--stragglers", stragglers, "--trace-dir", trace_dir
    )


def test_a_persistent_straggler_is_recognised_and_its_mode_run(tmp_path):
    # rank 3 +80 ms on 20 ms: its median step is about 4.5x the others' (the bench's +40 ms gives
    # 2.75x here, close enough to the 2.5x threshold that CPU contention can blur it)
    res = auto(tmp_path, "base=0.02,slow=3:0.08,seed=1", epochs=8)
    decisions = res["auto_decisions"]
    first = decisions[0]
    assert first["profile"] == "straggler" and first["running"] == "bsp" and first["switched"], decisions
    assert first["mode"] == "backup(b=1)+dc(lambda=0.04)", first
    # decided early, from BSP's rounds (every rank's time in each, no gather), after the first 4
    # measured steps (batch 0 is not measured), then at the ends of epochs 0 to 6 (epoch 0's end
    # is 17 steps after the first decision; 22 steps an epoch; none after the last), each taken
    # or, where the straggler computed no step in the window (backup workers skipped them all),
    # put off and said so; BSP and backup workers share the compiled step: the switch did not retrace
    assert first["early"] and first["steps"] == EARLY_STEPS and "each of the first 4" in first["reason"], first
    deferred = res["auto_deferred"]
    assert all(d["ranks_without_steps"] == [3] for d in deferred), deferred
    ends = sorted([(d["epoch"], d["batch"]) for d in decisions[1:]] + [(d["epoch"], d["batch"]) for d in deferred])
    assert decisions[0]["epoch"] == 0 and decisions[0]["batch"] == 4
    assert ends == [(e, 21) for e in range(7)] and len(deferred) <= 2, (decisions, deferred)
    assert not any(d["early"] for d in decisions[1:]), decisions
    assert first["retraced"] is False and first["switch_s"] > 0, first
    assert first["slowest_ratio"] >= STRAGGLER_RATIO and "worker 3" in first["reason"], first
    # the slowness stays persistent under backup workers: no switch back.  (Rank 3 computes few
    # steps there, so its measured ratio may fall under 2.5 in a window: heterogeneous, same mode.)
    later = decisions[1:]
    assert all(d["mode"] == "backup(b=1)+dc(lambda=0.04)" and not d["switched"] for d in later), decisions
    assert all(d["observed"] in ("straggler", "heterogeneous") for d in later), decisions
    assert res["replicas_identical"], res
    # every contribution of both engines is accounted for, and the straggler's steps were skipped
    assert res["produced"] == res["applied"] + res["compensated"] + res["dropped"], res
    # the epoch logs count both engines, across the mid-epoch switch
    assert res["counts_from_epoch_logs"] == {k: res[k] for k in res["counts_from_epoch_logs"]}, res
    assert res["skipped"] > 0 and res["compensated"] > 0, res  # the straggler's late gradients, corrected
    assert res["final_accuracy"] >= 0.9, res
    # the trace: one directory per engine, the decisions beside them
    assert sorted(os.listdir(tmp_path)) == ["0-bsp", "1-backup", "auto.jsonl"], os.listdir(tmp_path)
    events = [json.loads(line) for line in open(tmp_path / "auto.jsonl")]
    assert [e for e in events if e["event"] == "auto_deferred"] == [{"event": "auto_deferred", **d} for d in deferred]
    events = [e for e in events if e["event"] == "auto"]
    assert [e["mode"] for e in events] == [d["mode"] for d in decisions]
    for segment in ("0-bsp", "1-backup"):
        assert sorted(os.listdir(tmp_path / segment)) == [f"rank{r}.jsonl" for r in range(4)]


def test_no_slowness_keeps_bsp(tmp_path):
    # 100 ms of simulated compute a step: the scheduling noise of four TensorFlow processes on two
    # cores (milliseconds to tens of ms) stays well under the jitter threshold (a spread of 0.4x
    # the median step), which it reaches on steps of tens of ms
    res = auto(tmp_path, "base=0.1,seed=1", epochs=4)
    decisions = res["auto_decisions"]
    assert decisions and all(d["profile"] == "none" and not d["switched"] for d in decisions), decisions
    assert all(d["mode"] == "bsp" for d in decisions), decisions
    # nothing early: the first decision after the full window (16 steps), mid-epoch
    assert (decisions[0]["epoch"], decisions[0]["batch"]) == (0, 15) and not decisions[0]["early"], decisions
    assert sorted(os.listdir(tmp_path)) == ["0-bsp", "auto.jsonl"]
    assert res["replicas_identical"] and res["dropped"] == 0 and res["skipped"] == 0, res


def test_switches_between_modes_with_different_steps_retrace_and_lose_nothing(tmp_path):
    # BSP -> SSP(2) while rank 1 straggles, back to BSP once it stops (workers/auto_switch.py)
    run_workers("auto_switch.py", 2, [tmp_path], timeout_s=240)
    res = read_results(tmp_path)
    decisions = res[0]["decisions"]
    same = ("epoch", "batch", "observed", "profile", "mode", "switched")  # (waits are per rank)
    assert [[d[k] for k in same] for d in decisions] == [[d[k] for k in same] for d in res[1]["decisions"]]
    switches = [d for d in decisions if d["switched"]]
    assert [(d["running"], d["mode"]) for d in switches] == [("bsp", "ssp(s=2)"), ("ssp(s=2)", "bsp")], decisions
    assert all(d["retraced"] for d in switches), switches  # a gradient and an update protocol: two steps
    assert switches[0]["profile"] == "straggler" and switches[1]["profile"] in ("none", "jitter", "rare"), switches
    # identical replicas after both switches, every contribution of the three engines accounted for
    assert res[0]["weights"] == res[1]["weights"]
    total = {k: res[0]["counts"][k] + res[1]["counts"][k] for k in res[0]["counts"]}
    for r in (0, 1):
        c = res[r]["counts"]
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] > 0, (r, c)
    assert {k: round(v * 2) for k, v in res[0]["logged"].items()} == total, (res[0]["logged"], total)
