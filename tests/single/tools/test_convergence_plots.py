"""``python -m tfsync.bench convergence --from-json``: the table and plots of a saved study,
each paper's comparison drawn where the study ran its scenario and modes (no training here)."""

import json

import pytest

from tfsync.bench import convergence


def study(scenarios, modes):
    """A saved study in the format --json writes: one run per (scenario, mode), made-up curves."""
    runs = []
    for s in scenarios:
        for k, mode in enumerate(modes):
            curve = [[1.0 + e + 0.3 * k, 64 * (e + 1), min(0.99, 0.8 + 0.05 * e)] for e in range(4)]
            reached = next((t for t, _, acc in curve if acc >= 0.9), None)
            runs.append(
                {
                    "study_mode": mode,
                    "scenario": s,
                    "repeat": 0,
                    "mode": mode,
                    "curve": curve,
                    "time_to_accuracy_s": {"0.9": reached},
                    "final_accuracy": curve[-1][2],
                    "samples_per_s": 100.0,
                    "effective_samples_per_s": 90.0,
                    "wall_s": curve[-1][0],
                }
            )
    settings = {
        "workers": 4,
        "epochs": 4,
        "repeats": 1,
        "target_accuracy": 0.9,
        "scenarios": {s: convergence.SCENARIOS[s] for s in scenarios},
        "modes": {m: convergence.MODES[m] for m in modes},
    }
    return {"settings": settings, "runs": runs}


def test_a_saved_study_is_replotted_with_each_papers_comparison(tmp_path, capsys):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study(["heterogeneous", "none"], ["bsp", "ssp", "ssp(s=15)", "dssp"])))
    assert convergence.main(["--from-json", str(path), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "| heterogeneous | dssp | 3.9 s |" in out, out  # the table, from the saved runs
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    # DSSP's and ElasticBSP's comparisons (heterogeneous; ElasticBSP itself missing, its rivals
    # present); PSP's needs the rare scenario, the backup sweep its modes
    assert written == [
        "accuracy_vs_time.png",
        "final_accuracy.png",
        "paper_dssp.png",
        "paper_elasticbsp.png",
        "time_to_target.png",
    ], written
    assert all((tmp_path / "plots" / name).stat().st_size > 10_000 for name in written)


def test_an_unreadable_study_says_what_to_pass(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{}")
    with pytest.raises(SystemExit, match="cannot read a study from it.*pass a file written by --json"):
        convergence.main(["--from-json", str(path)])
