"""The launch scripts, examples, demo and benchmark run as a user runs them (small sizes)."""

import json
import os
import sys

import pytest

from tests.parallel.launch import ROOT, result_of, run

pytestmark = pytest.mark.parallel


# The launch scripts on 2 workers for 6 epochs: each worker takes as many steps as on 4 workers for
# 12 (its shard is twice as large) at half the processes to start; four-worker jobs are
# tests/multihost's and the DSSP and ElasticBSP scripts' (tests/parallel/test_dynamic_under_horovodrun.py)
WORKERS = 2
EPOCHS = 6
SCRIPTS = (
    "bsp.sh",
    "ssp.sh",
    "strategy_bsp.sh",
    "strategy_ssp.sh",
    "strategy_dssp.sh",
    "strategy_elasticbsp.sh",
    "psp.sh",
    "psp_pull.sh",
    "backup.sh",
    "strategy_psp.sh",
    "dcs3gd.sh",
    "strategy_dcs3gd.sh",
    "auto.sh",
    "localsgd.sh",
    "diloco.sh",
)
# diloco.sh as its streaming variant (overlapped outer steps): the plain one is every_mode's
# (tests/multihost) and test_local_steps'
SCRIPT_ENV = {"diloco.sh": {"OVERLAP_STEPS": "2"}}
# backup workers on 2 workers apply one worker's gradient a round: half BSP's batch, so half its
# learning rate (the linear scaling rule); at 0.2 its last epochs swing across 0.90 (0.88-0.95)
SCRIPT_ARGS = {"backup.sh": ["--lr", "0.1"]}
_launched = {}


def launched(script):
    """``horovodrun_scripts/<script>``'s result on :data:`WORKERS` workers, launched once per session."""
    if script not in _launched:
        # 10 ms of simulated device time per step, as the other timing-sensitive tests simulate it: with
        # none, the workers on two cores are communication-bound, rounds queue behind the compute, and
        # ElasticBSP's asynchronous supersteps run several rounds stale, which costs accuracy for a
        # reason this test is not about. Partial pulling under slow pulls: about 1.6 of each worker's
        # blocks are late
        stragglers = "base=0.01,pull=0.0015:0.3" if script == "psp_pull.sh" else "base=0.01"
        script_path = os.path.join(ROOT, "horovodrun_scripts", script)
        cmd = ["bash", script_path, "--epochs", str(EPOCHS), *SCRIPT_ARGS.get(script, ())]
        env = {"NP": str(WORKERS), **SCRIPT_ENV.get(script, {})}
        _launched[script] = result_of(run([*cmd, "--stragglers", stragglers], env=env))
    return _launched[script]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_launch_script_trains_digits_to_90_percent(script):
    res = launched(script)
    assert res["final_accuracy"] >= 0.90, res
    assert res["replicas_identical"], res
    assert res["produced"] == res["applied"] + res["compensated"] + res["dropped"], res
    if "dcs3gd" in script:  # every gradient after each worker's first is corrected, none dropped
        assert res["applied"] == WORKERS and res["compensated"] == res["produced"] - WORKERS, res
        assert res["dropped"] == 0 and res["skipped"] == 0, res
    if script.startswith("backup"):  # exactly workers - 1 contributions per round
        assert res["applied"] == (res["produced"] + res["skipped"]) * (WORKERS - 1) // WORKERS, res
    if script == "diloco.sh":  # the streaming variant: every pseudo-gradient applied
        assert "tau=2" in res["mode"], res
        assert res["produced"] == res["applied"] and res["dropped"] == res["rejected"] == 0, res


def test_dcs3gd_ends_within_one_point_of_bsp():
    """DC-S3GD against BSP on the same data and seed (the two scripts' runs above)."""
    bsp, dc = launched("bsp.sh"), launched("dcs3gd.sh")
    assert abs(dc["final_accuracy"] - bsp["final_accuracy"]) <= 0.01, (dc, bsp)


def test_the_elastic_script_trains_digits_under_horovods_elastic_launcher():
    # the launch line a user runs (two workers, this machine as two hosts); the kills are
    # tests/parallel/test_elastic_launcher.py's
    res = result_of(
        run(["bash", os.path.join(ROOT, "horovodrun_scripts", "elastic.sh"), "--epochs", "8"], timeout_s=200)
    )
    assert res["final_accuracy"] >= 0.90, res
    assert res["resets"] == 0 and res["workers"] == 2 and res["replicas_identical"], res
    # the job's counts as committed at the last epoch end: every worker's, summed
    assert res["job_counts"] == {k: res[k] for k in res["job_counts"]}, res
    assert res["produced"] == res["applied"] > 0 and res["lost"] == 0, res


@pytest.mark.parametrize("mode", ["ssp", "elasticbsp"])  # elasticbsp: the skippable train step
def test_keras_cv_resnet_example_trains_under_tfsync(mode):
    # a tiny ResNet (two stacks of 8 and 16 filters), 2 workers, 3 epochs: it must learn, and the
    # replicas must end identical, BatchNormalization's moving statistics included (averaged at the
    # end of fit).  Its test accuracy after 3 epochs swings with the lagging moving statistics
    # (0.2-0.4 here), so learning is judged by the training loss.
    out = run(
        ["bash", os.path.join(ROOT, "horovodrun_scripts", "resnet.sh"), "--epochs", "3", "--filters", "8", "16"],
        env={"NP": "2", "MODE": mode},
    )
    res = result_of(out)
    assert res["mode"].startswith(mode), res
    losses = res["loss_per_epoch"]
    assert len(losses) == 3 and losses[-1] < 0.7 * losses[0], res
    assert res["replicas_identical"], res
    assert res["produced"] == res["applied"] + res["compensated"] + res["dropped"], res
    assert res["parameters"] > 10_000, res


def test_convergence_study_writes_curves_summary_and_plots(tmp_path):
    out = run(
        [
            sys.executable,
            "-m",
            "tfsync.bench",
            "convergence",
            "--quick",
            "--modes",
            "horovod",
            "ssp",
            "--scenarios",
            "jitter",
            "--target-accuracy",
            "0.5",
            "--json",
            str(tmp_path / "study.json"),
            "--plots",
            str(tmp_path / "plots"),
        ],
        timeout_s=400,
    )
    assert "[2/2] jitter" in out and "fastest to 0.5 is" in out, out[-3000:]
    study = json.loads((tmp_path / "study.json").read_text())
    assert study["settings"]["epochs"] == 3 and study["settings"]["workers"] == 2
    assert [r["study_mode"] for r in study["runs"]] == ["horovod", "ssp"]
    for r in study["runs"]:
        curve = r["curve"]
        assert len(curve) == 3, curve
        times, samples = [p[0] for p in curve], [p[1] for p in curve]
        assert times == sorted(times) and samples == [samples[0] * k for k in (1, 2, 3)], curve
        reached = r["time_to_accuracy_s"]["0.5"]  # digits' MLP passes 0.5 within the first epoch
        assert reached == next(t for t, _, acc in curve if acc >= 0.5), r
    assert [s["mode"] for s in study["summary"]] == ["horovod", "ssp"]
    assert min(s["vs_best"] for s in study["summary"]) == 1.0
    for name in ("accuracy_vs_time.png", "time_to_target.png", "final_accuracy.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000, name


def test_training_benchmark_writes_records(tmp_path):
    """The bench's launches, table and records, on a mode of each kind (plain Horovod, open rounds,
    rounds rank 0 closes with compensation); that its default list is every per-step mode is
    tests/single/policies/test_registry_lists.py's."""
    path = tmp_path / "bench.json"
    modes = ["horovod", "bsp", "backup+dc"]
    cmd = [sys.executable, "-m", "tfsync.bench", "--quick", "--scenarios", "straggler", "--modes", *modes]
    out = run([*cmd, "--json", str(path)])
    records = json.loads(path.read_text())
    assert [r["mode"] for r in records] == ["plain Horovod BSP", "tfsync BSP", "tfsync backup(b=1)+DC"]
    for r in records:
        assert {
            "mode",
            "scenario",
            "samples_per_s",
            "wait_fraction",
            "effective_samples_per_s",
            "compensated",
            "dropped",
            "skipped",
        } <= set(r) and r["samples_per_s"] > 0
        assert r["produced"] == r["applied"] + r["compensated"] + r["dropped"], r
        assert r["effective_samples_per_s"] <= r["samples_per_s"] * (1 + 1e-9), r
    assert records[0]["wait_fraction"] is None and 0 <= records[1]["wait_fraction"] < 1
    assert "| straggler | tfsync BSP |" in out
