"""``python -m tfsync.bench faults``: what it refuses, what it draws, how it judges a run's errors.

The launches themselves run under ``tests/multihost`` (one run per scenario) and in the study
(docs/results/faults); here, its pure parts, on made-up events."""

import pytest

from tfsync.bench import faults


def _args(*options):
    return faults.parse_args([*options, "--json", "unused.json"])


@pytest.mark.parametrize(
    "options,says",
    [
        (["--scenario", "kill", "--frontend", "strategy"], "tfsync.elastic trains through the Keras callback only"),
        (["--scenario", "stop", "--frontend", "strategy", "--elastic"], "--no-elastic for a plain job"),
        (["--scenario", "cut", "--elastic"], "a cut runs as a plain job"),
        (["--scenario", "raise", "--mode", "auto"], "pick a mode"),
        (["--scenario", "kill", "--repeat", "0"], "expected a whole number >= 1"),
    ],
)
def test_bad_arguments_are_refused_saying_what_and_how_to_fix(options, says, capsys):
    with pytest.raises(SystemExit):
        _args(*options)
    assert says in capsys.readouterr().err


def test_worker_faults_run_elastic_and_a_cut_plain_unless_told():
    assert _args("--scenario", "kill").elastic and _args("--scenario", "raise").elastic
    assert not _args("--scenario", "cut").elastic
    assert not _args("--scenario", "stop", "--no-elastic").elastic
    assert not _args("--scenario", "kill", "--frontend", "strategy", "--no-elastic").elastic


def test_each_run_draws_its_own_fault_from_the_seed():
    draws = [faults.draw(7, run, "kill", 10) for run in range(40)]
    assert draws == [faults.draw(7, run, "kill", 10) for run in range(40)]  # (stated, reproducible)
    total = 10 * faults.steps_per_epoch()
    low, high = (int(f * total) for f in faults.FAULT_AT)
    assert all(low <= d["step"] <= high for d in draws), draws
    assert {d["victim"] for d in draws} == set(range(faults.WORKERS))
    assert len({d["step"] for d in draws}) > 20
    assert faults.draw(7, 0, "cut", 10)["victim"] is None


def _error(pid, t, ranks, rank=0, resets=0):
    hosts = ["tfh1", "tfh1", "tfh2", "tfh2"]
    return {"kind": "error", "pid": pid, "t": t, "type": "SyncTimeoutError", "text": "...", "ranks": ranks}, {
        "hosts": hosts,
        "rank": rank,
        "resets": resets,
    }


def _events(*specs):
    out = []
    for spec in specs:
        event, extra = _error(*spec)
        out.append({**event, **extra})
    return sorted(out, key=lambda e: e["t"])


def test_a_cut_run_judges_each_survivors_first_error_by_what_it_named():
    cut = _args("--scenario", "cut")
    taken, taken_pids = [2, 3], {12, 13}
    events = _events(
        (10, 99.0, [1, 2, 3]),  # (before the fault: not one of the fault's errors)
        (11, 108.0, [1, 2, 3], 1),  # a healthy rank named: rank 1 waits for the cut host itself
        (10, 108.5, [2, 3]),
        (11, 109.0, [2, 3], 1),  # (its second error: not its first)
        (12, 103.0, [0]),  # (on the cut host: not a survivor's)
    )
    out = faults._outcome(cut, events, 1, 100.0, taken, taken_pids)
    assert out["outcome"] == "stopped"
    first, second = out["survivor_errors"]
    assert (first["rank"], first["after_fault_s"], first["named_ranks"]) == (1, 8.0, [1, 2, 3])
    assert first["named_hosts"] == ["tfh1", "tfh2"] and first["named_healthy"] and not first["named_exactly"]
    assert out["first_error"] == first
    assert second["named_ranks"] == [2, 3] and second["named_exactly"] and not second["named_healthy"]
    # a run whose earliest error is right but whose other survivor named a healthy rank still counts
    later = faults._outcome(cut, _events((10, 109.0, [2, 3]), (11, 110.0, [1, 2, 3], 1)), 1, 100.0, taken, taken_pids)
    summary = faults.summary(cut, [{"outcome": "stopped", **out}, {"outcome": "stopped", **later}])
    assert summary["first_error_named_healthy"] == 1 and summary["runs_any_error_named_healthy"] == 2
    assert (summary["first_error_after_fault_s_median"], summary["first_error_after_fault_s_max"]) == (8.5, 9.0)


def test_an_error_that_names_nobody_is_counted_as_such():
    cut = _args("--scenario", "cut")
    out = faults._outcome(cut, _events((10, 115.4, None)), 1, 100.0, [2, 3], set())
    assert out["first_error"]["named_ranks"] == [] and not out["first_error"]["named_exactly"]
    summary = faults.summary(cut, [{"outcome": "stopped", **out}])
    assert summary["first_error_named_none"] == 1 and summary["first_error_within_bound_plus_5_s"] == 0


def test_an_elastic_run_is_recovered_only_when_the_launch_ended_well_with_results():
    kill = _args("--scenario", "kill")
    result = {"kind": "result", "pid": 10, "t": 130.0, "accuracy": 0.96, "replicas_identical": True}
    result.update(size=2, resets=1, rank=0)
    recovered = faults._outcome(kill, [result], 0, 100.0, [3], {13})
    assert recovered["outcome"] == "recovered" and recovered["final_accuracy"] == 0.96
    assert faults._outcome(kill, [result], 1, 100.0, [3], {13})["outcome"] == "lost"
    assert faults._outcome(kill, [], 0, 100.0, [3], {13})["outcome"] == "lost"
    assert faults._outcome(kill, [result], 0, None, [3], {13})["outcome"] == "no_fault"
