"""``python -m tfsync.simulate``: the real policies on simulated workers (no TensorFlow, no sleeps)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfsync import DSSP, PSP, SSP, BackupWorkers, ElasticBSP, Stragglers
from tfsync import simulate as sim
from tfsync.policies import Closing, resolve

BASE, ALLREDUCE = 0.02, 0.005


def _even(workers=4, steps=30):
    return np.full((workers, steps), BASE)


def test_no_straggler_bsp_and_ssp_take_the_times_their_rules_give():
    d = _even()
    bsp = sim.simulate(resolve("bsp"), d, ALLREDUCE, 0.0)
    assert bsp["wall_s"] == pytest.approx(30 * (BASE + ALLREDUCE))  # compute, then the allreduce, every step
    assert bsp["wait_fraction"] == pytest.approx(ALLREDUCE / (BASE + ALLREDUCE))
    ssp = sim.simulate(SSP(staleness=3), d, ALLREDUCE, 0.0)
    assert ssp["wall_s"] == pytest.approx(30 * BASE + ALLREDUCE)  # the allreduce overlaps the next step
    assert ssp["wait_fraction"] == 0.0


def test_a_straggler_sets_bsps_pace_and_the_partial_modes_go_without_it():
    d = _even()
    d[3] += 0.04
    bsp = sim.simulate(resolve("bsp"), d, ALLREDUCE, 0.0)
    assert bsp["wall_s"] == pytest.approx(30 * (3 * BASE + ALLREDUCE))
    for policy in (BackupWorkers(backups=1), PSP(push_timeout_s=0.0)):
        run = sim.simulate(policy, d, ALLREDUCE, 0.0)
        assert run["wall_s"] < 0.5 * bsp["wall_s"], (policy, run)
        assert run["skipped"] > 0 and run["dropped"] > 0, run
    elastic = sim.simulate(ElasticBSP(), d, ALLREDUCE, 0.0)
    assert elastic["wall_s"] < 0.5 * bsp["wall_s"] and elastic["skipped"] > 0, elastic


profiles = st.builds(
    Stragglers,
    base_s=st.sampled_from([0.01, 0.02]),
    slow_ranks=st.dictionaries(st.integers(0, 4), st.floats(0.0, 0.05), max_size=2),
    rare_prob=st.sampled_from([0.0, 0.05]),
    rare_s=st.just(0.3),
    jitter_s=st.sampled_from([0.0, 0.02]),
    seed=st.integers(0, 1000),
)


@settings(max_examples=40, deadline=None)
@given(profile=profiles, workers=st.integers(2, 5), control_s=st.sampled_from([0.0, 0.001]))
def test_every_contribution_is_applied_dropped_or_skipped_under_any_profile(profile, workers, control_s):
    d = sim.delays(profile, workers, 40)
    for mode in sim.MODES:
        run = sim.simulate(resolve(mode), d, ALLREDUCE, control_s)  # asserts the counts add up
        assert run["computed"] + run["skipped"] == workers * 40
        assert 0.0 <= run["wait_fraction"] < 1.0
        # a mode that skips nothing ends after its slowest worker's own computation
        assert run["skipped"] > 0 or run["wall_s"] >= d.sum(axis=1).max() - 1e-9, (mode, run)


@settings(max_examples=40, deadline=None)
@given(profile=profiles, workers=st.integers(2, 5), s=st.integers(0, 4))
def test_the_papers_equivalences_hold_in_simulated_time(profile, workers, s):
    d = sim.delays(profile, workers, 40)
    bsp = sim.simulate(resolve("bsp"), d, ALLREDUCE, 0.0)
    # DSSP(s, s) waits exactly where SSP(s) waits; ElasticBSP(R=1), PSP(c=size) and
    # backup workers with b=0 wait where BSP waits (with no control latency)
    same = [
        (sim.simulate(DSSP(low=s, high=s), d, ALLREDUCE, 0.0), sim.simulate(SSP(staleness=s), d, ALLREDUCE, 0.0)),
        (sim.simulate(ElasticBSP(lookahead=1), d, ALLREDUCE, 0.0), bsp),
        (sim.simulate(PSP(min_contributions=workers), d, ALLREDUCE, 0.0), bsp),
        (sim.simulate(BackupWorkers(backups=0), d, ALLREDUCE, 0.0), bsp),
    ]
    for run, reference in same:
        assert run["wall_s"] == pytest.approx(reference["wall_s"]), (run, reference)
        assert run["wait_fraction"] == pytest.approx(reference["wait_fraction"]), (run, reference)
        assert run["applied"] == reference["applied"] and run["dropped"] == run["skipped"] == 0


@settings(max_examples=30, deadline=None)
@given(profile=profiles, workers=st.integers(2, 5), low=st.integers(0, 3), extra=st.integers(0, 6))
def test_dssp_is_never_slower_than_ssp_at_its_lower_bound_nor_faster_than_at_its_upper(profile, workers, low, extra):
    # a grant lets a fast worker go on where SSP(low) would wait, never past SSP(high)'s bound.
    # With no control latency every time is a max-plus expression, nondecreasing in the rounds
    # waited for, and DSSP always waits for one between SSP(high)'s and SSP(low)'s: a theorem
    d = sim.delays(profile, workers, 40)
    walls = [sim.simulate(p, d, ALLREDUCE, 0.0)["wall_s"] for p in (SSP(low), DSSP(low, low + extra), SSP(low + extra))]
    assert walls[2] - 1e-9 <= walls[1] <= walls[0] + 1e-9, walls


def test_the_controllers_decisions_are_timed():
    d = sim.delays(Stragglers.parse("base=0.02,slow=3:0.02,seed=1"), 4, 60)
    for policy in (DSSP(), ElasticBSP(), PSP(), BackupWorkers()):
        run = sim.simulate(policy, d, ALLREDUCE, 0.001)
        assert run["decisions"] > 0 and 0 < run["decision_ms_median"] <= run["decision_ms_max"], run
        assert run["decision_fraction_of_iteration"] == pytest.approx(
            run["decision_ms_median"] / 1e3 / run["mean_iteration_s"]
        )


def test_the_ordering_of_the_real_four_worker_runs():
    # shape, not numbers: the bench tables of docs/benchmarks.md (4 workers, 20 ms, tfsync on Horovod) put
    # backup workers and PSP above BSP under the persistent straggler and the rare delays,
    # ElasticBSP above BSP under the heterogeneous worker, and BSP above both partial modes
    # (effective) with no slowness
    runs = {}
    for scenario in ("none", "straggler", "heterogeneous", "rare"):
        args = sim.parse_args([])
        d = sim.delays(sim.profile(scenario, 4, args), 4, 150)
        for mode in sim.MODES:
            runs[scenario, mode] = sim.simulate(sim.policy(mode, args), d)["effective_per_s"]
    for scenario in ("straggler", "rare"):
        assert runs[scenario, "backup"] > runs[scenario, "bsp"] and runs[scenario, "psp"] > runs[scenario, "bsp"]
    assert runs["heterogeneous", "elasticbsp"] > 1.3 * runs["heterogeneous", "bsp"]
    assert runs["none", "bsp"] > max(runs["none", "psp"], runs["none", "backup"])


def test_the_command_line_prints_a_table_and_writes_every_run(tmp_path):
    path = tmp_path / "sim.json"
    argv = ["--workers", "3", "--steps", "20", "--scenarios", "none", "straggler", "--json", str(path)]
    out = subprocess.run([sys.executable, "-m", "tfsync.simulate", *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tensorflow" not in out.stderr.lower()
    runs = json.loads(path.read_text())["runs"]
    assert {(r["scenario"], r["mode"]) for r in runs} == {(s, m) for s in ("none", "straggler") for m in sim.MODES}
    assert all(r["workers"] == 3 and r["steps"] == 20 for r in runs)
    assert len(out.stdout.splitlines()) == 1 + len(runs)


def test_the_simulator_never_imports_tensorflow():
    code = "import sys; import tfsync.simulate as s; s.main(['--workers', '2', '--steps', '5', '--scenarios', 'none'])"
    code += "; assert 'tensorflow' not in sys.modules and 'horovod' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--workers", "1"], "--workers must all be >= 2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--allreduce-ms", "-1"], "argument --allreduce-ms: expected a finite number >= 0, got '-1'"),
        (["--allreduce-ms", "nan"], "argument --allreduce-ms: expected a finite number >= 0, got 'nan'"),
        (["--base-s", "inf"], "argument --base-s: expected a finite number >= 0, got 'inf'"),
        (["--rare-prob", "2"], "argument --rare-prob: expected a finite number >= 0 and <= 1, got '2'"),
        (["--modes", "sgd"], "invalid choice: 'sgd'"),
    ],
)
def test_bad_arguments_say_what_was_expected(argv, message, capsys):
    with pytest.raises(SystemExit):
        sim.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_policy_that_counts_contributions_that_never_arrived_is_caught():
    class Greedy(BackupWorkers):
        def close_round(self, ready, opened_s, now_s, size):
            return Closing(tuple(range(size)) if ready else None)  # every rank, whoever is ready

    # the coordinator's own check (policies.base.decide_round) refuses the decision
    with pytest.raises(ValueError, match=r"Greedy.close_round accepted \[0, 1, 2, 3\] .*\(not ready: \["):
        sim.simulate(Greedy(), _even(), ALLREDUCE, 0.001)
