"""What ``python -m tfsync.demo`` runs, read from the mode registry, and what it reports (no training)."""

import pytest

from tfsync import demo
from tfsync.policies import BSP, registry


class Every2(BSP):
    name = "every2"


def test_the_demo_shows_plain_horovod_beside_what_the_registry_names_for_each_situation(registered):
    before = demo.local_plan(demo.parse_args([]))["straggler"][1]
    variants = {"every2+": registry.Variant((), "every 2+")}
    registry.register("every2", Every2, "every 2", variants=variants, best_for={"straggler": "every2+"})
    spec, modes = demo.local_plan(demo.parse_args([]))["straggler"]
    assert spec == demo.SCENARIOS["straggler"]
    assert modes == [*before, "every2+"] and modes[0] == demo.BASELINE
    assert len(before) >= 2  # plain Horovod and at least one of tfsync's modes
    assert "every2+" not in demo.slow_link_modes() and demo.slow_link_modes()[0] == demo.BASELINE
    assert len(demo.slow_link_modes()) >= 2


def test_all_runs_every_registered_mode_in_three_scenarios(registered):
    registry.register("every2", Every2, "every 2")
    plan = demo.local_plan(demo.parse_args(["--all"]))
    assert list(plan) == list(demo.ALL_SCENARIOS)
    modes = plan["straggler"][1]
    assert modes[0] == demo.BASELINE and set(modes[1:]) >= {m.name for m in registry.modes()}
    # (and the registry's answer to a straggler, last: the table's one configuration beside the defaults)
    assert modes[-1] == registry.best_for("straggler")[-1] and len(modes) == len(set(modes))
    assert all(plan[s][1] == modes for s in plan)
    assert "every2" in demo.DEMO_MODES
    assert demo.parse_args(["--all"]).target_accuracy == [0.9, 0.95]


def test_a_situation_must_name_the_mode_or_one_of_its_variants(registered):
    with pytest.raises(ValueError, match="'every3' is neither the mode nor one of its variants"):
        registry.register("every2", Every2, "every 2", best_for={"straggler": "every3"})


def test_scenarios_without_all_and_too_few_workers_are_refused_before_any_run(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--scenarios", "jitter"])
    assert "add --all" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--workers", "2"])
    assert "slows rank 3" in capsys.readouterr().err
    assert demo.parse_args(["--workers", "2", "--situations", "slow-link"]).workers == 2


def _row(scenario, config, reached, final=0.96):
    return {
        "scenario": scenario,
        "stragglers": "base=0.02",
        "config": config,
        "mode": config,
        "samples_per_s": 1000.0,
        "effective_samples_per_s": 900.0,
        "compensated": 0,
        "dropped": 3,
        "skipped": 0,
        "wait_fraction": 0.1,
        "time_to_accuracy_s": {"0.95": reached},
        "curve": [[1.0, 100, 0.9], [2.0, 200, 0.96]],
        "final_accuracy": final,
        "replicas_identical": True,
        "wall_s": 30.0,
    }


def test_the_summary_compares_each_situations_fastest_mode_with_plain_horovod(tmp_path):
    rows = [
        _row("straggler", "horovod", 18.0),
        _row("straggler", "psp", 12.0),
        _row("straggler", "backup", 9.0),
        _row("slow-link", "horovod", None, final=0.94),
        _row("slow-link", "diloco", 15.0),
    ]
    demo.compare_with_baseline(rows, 0.95)
    assert [r["speedup_vs_horovod"] for r in rows] == [1.0, 1.5, 2.0, None, None]
    summary = demo.format_summary(rows, 0.95).splitlines()
    assert summary[0].startswith("- straggler: backup reached 0.95 in 9.0 s, plain Horovod in 18.0 s (2.00× faster)")
    assert summary[1].startswith("- slow-link: diloco reached 0.95 in 15.0 s; plain Horovod did not within 30 s")
    table = demo.format_table(rows, demo.parse_args([]))
    assert "| straggler | backup | 1000 | 900 | 0 | 3 | 0 | 0.10 | 9.0 s | 0.960 | True | 2.00× faster |" in table
    path = tmp_path / "plot" / "accuracy.png"
    demo.plot(rows, demo.parse_args([]), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
