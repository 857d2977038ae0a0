"""Tests of tfsync.scheduler: ZipLine and its variants against brute force, the
baselines, the predictor, the implementation switch and every rejected input.

Every kernel runs in both implementations (compiled Cython and plain-Python
reference); the property tests compare them with an exhaustive search over all
R^n choices (Problem 1 of the ElasticBSP paper, with Corollary 1's earliest-
barrier rule).
"""

import bisect
import dataclasses
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tfsync import scheduler
from tfsync.launch import REPO_ROOT as REPO
from tfsync.scheduler import ALGORITHMS, EXACT_ALGORITHMS, ZipLineResult, _backend, predict_end_times, zipline

IMPLEMENTATIONS = ("compiled", "reference")


def brute_force(rows):
    """Optimum over all R^n choices: smallest max - min, then earliest max.

    Workers then take their latest end time <= t_sync (the canonical choice).
    """
    best = None
    for choice in itertools.product(*rows):
        key = (max(choice) - min(choice), max(choice))
        if best is None or key < best:
            best = key
    wait, t_sync = best
    iterations = [bisect.bisect_right(list(row), t_sync) for row in rows]
    return t_sync, wait, iterations


def synthetic(n, R, seed=0):
    """Section 6.1 data: intervals uniform in 1000-1500 ms, offsets in 10-50 ms."""
    rng = np.random.default_rng(seed)
    interval = rng.uniform(1000, 1500, n)
    start = rng.uniform(10, 50, n)
    return start[:, None] + interval[:, None] * np.arange(1, R + 1)[None, :]


def as_tuple(result):
    return result.t_sync, result.wait, result.iterations.tolist()


# Small stamps on a coarse grid make ties and equal timestamps common.
small_rows = st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5).map(sorted), min_size=1, max_size=4)


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request):
    return request.param


@pytest.mark.parametrize("algorithm", EXACT_ALGORITHMS)
@pytest.mark.parametrize("implementation_name", IMPLEMENTATIONS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=small_rows, as_float=st.booleans())
def test_exact_variants_find_the_brute_force_optimum(implementation_name, algorithm, rows, as_float):
    if as_float:
        rows = [[t * 0.25 for t in row] for row in rows]  # exact binary fractions
    result = zipline(rows, algorithm, implementation=implementation_name)
    assert as_tuple(result) == brute_force(rows)
    assert type(result.t_sync) is (float if as_float else int)
    assert type(result.wait) is type(result.t_sync)


@pytest.mark.parametrize("implementation_name", IMPLEMENTATIONS)
@settings(max_examples=150, deadline=None)
@given(rows=small_rows)
def test_exact_variants_on_equal_length_arrays(implementation_name, rows):
    width = min(len(row) for row in rows)
    matrix = np.array([row[:width] for row in rows], dtype=np.int64)
    for algorithm in EXACT_ALGORITHMS:
        result = zipline(matrix, algorithm, implementation=implementation_name)
        assert as_tuple(result) == brute_force(matrix.tolist())


@pytest.mark.parametrize("implementation_name", IMPLEMENTATIONS)
@settings(max_examples=150, deadline=None)
@given(rows=small_rows)
def test_gridscan_is_never_better_and_returns_the_set_it_found(implementation_name, rows):
    optimum = brute_force(rows)
    result = zipline(rows, "gridscan", implementation=implementation_name)
    chosen = [row[k - 1] for row, k in zip(rows, result.iterations.tolist())]
    assert all(1 <= k <= len(row) for row, k in zip(rows, result.iterations.tolist()))
    assert result.t_sync == max(chosen)
    assert result.wait == max(chosen) - min(chosen)
    assert result.wait >= optimum[1]


@settings(max_examples=100, deadline=None)
@given(rows=small_rows)
def test_compiled_and_reference_gridscan_agree(rows):
    compiled = zipline(rows, "gridscan", implementation="compiled")
    reference = zipline(rows, "gridscan", implementation="reference")
    assert as_tuple(compiled) == as_tuple(reference)


def test_gridscan_misses_the_optimum_that_the_exact_variants_find():
    # The designated row (earliest first stamp) cannot anchor the optimum here.
    rows = [[0, 100], [55, 200], [60, 300]]
    assert zipline(rows, "gridscan").wait == 60
    for algorithm in EXACT_ALGORITHMS:
        assert zipline(rows, algorithm).wait == 45


@pytest.mark.parametrize("n,R,seed", [(50, 15, 1), (300, 15, 2), (1000, 40, 3), (200, 150, 4)])
def test_compiled_variants_agree_on_large_synthetic_cases(n, R, seed):
    matrix = synthetic(n, R, seed)
    results = {a: as_tuple(zipline(matrix, a, implementation="compiled")) for a in ("zipline", "zipline_opt", "optbs")}
    assert len(set(map(repr, results.values()))) == 1, results
    grid = zipline(matrix, "gridscan")
    assert grid.wait >= results["optbs"][1]


@pytest.mark.parametrize("seed", range(4))
def test_all_variants_agree_on_large_random_integer_cases(seed):
    rng = np.random.default_rng(seed)
    n, R = 60, 12
    # Random sorted rows on a coarse grid: many equal timestamps across workers.
    matrix = np.sort(rng.integers(0, 400, size=(n, R)), axis=1)
    expected = as_tuple(zipline(matrix, "optbs", implementation="compiled"))
    for implementation_name in IMPLEMENTATIONS:
        for algorithm in EXACT_ALGORITHMS:
            assert as_tuple(zipline(matrix, algorithm, implementation=implementation_name)) == expected, (
                implementation_name,
                algorithm,
            )


def test_reference_and_compiled_agree_on_a_medium_synthetic_case():
    matrix = synthetic(200, 15, seed=5)
    expected = as_tuple(zipline(matrix, "optbs"))
    for algorithm in ("zipline", "zipline_opt", "optbs"):
        assert as_tuple(zipline(matrix, algorithm, implementation="reference")) == expected


def test_ties_prefer_the_earliest_barrier(implementation):
    rows = [[0, 10, 20], [1, 11, 21]]
    for algorithm in EXACT_ALGORITHMS:
        result = zipline(rows, algorithm, implementation=implementation)
        assert as_tuple(result) == (1, 1, [1, 1])


def test_equal_timestamps_across_and_within_workers(implementation):
    for algorithm in EXACT_ALGORITHMS:
        # Every worker ends an iteration at 7: zero wait, at the earliest 7.
        result = zipline([[3, 7, 9], [7, 8], [5, 7, 7]], algorithm, implementation=implementation)
        assert as_tuple(result) == (7, 0, [2, 1, 3])
        # All stamps equal: zero wait and every iteration ends by the barrier.
        result = zipline(np.full((3, 4), 5.0), algorithm, implementation=implementation)
        assert as_tuple(result) == (5.0, 0.0, [4, 4, 4])


def test_one_worker_waits_zero_at_its_first_end_time(implementation):
    for algorithm in ALGORITHMS:
        result = zipline([[1.5, 2.5, 3.5]], algorithm, implementation=implementation)
        assert as_tuple(result) == (1.5, 0.0, [1])


def test_integer_milliseconds_and_float_seconds_give_the_same_decision(implementation):
    milliseconds = (synthetic(40, 15, seed=7)).round().astype(np.int64)
    seconds = milliseconds / 1000.0
    for algorithm in ALGORITHMS:
        in_ms = zipline(milliseconds, algorithm, implementation=implementation)
        in_s = zipline(seconds, algorithm, implementation=implementation)
        assert type(in_ms.t_sync) is int and type(in_ms.wait) is int
        assert type(in_s.t_sync) is float and type(in_s.wait) is float
        assert in_ms.iterations.tolist() == in_s.iterations.tolist()
        assert in_s.t_sync == in_ms.t_sync / 1000.0
        assert in_s.wait == pytest.approx(in_ms.wait / 1000.0, abs=1e-12)


def test_other_numeric_dtypes_are_accepted(implementation):
    rows = np.array([[1, 5, 9], [4, 6, 20]])
    expected = (5, 1, [2, 1])
    for dtype in (np.int32, np.uint16, np.int64):
        assert as_tuple(zipline(rows.astype(dtype), implementation=implementation)) == expected
    result = zipline(rows.astype(np.float32), implementation=implementation)
    assert as_tuple(result) == (5.0, 1.0, [2, 1])


def test_negative_and_signed_zero_stamps(implementation):
    rows = [[-3.0, -0.0, 4.0], [0.0, 2.0], [-1.0, 0.0]]
    for algorithm in EXACT_ALGORITHMS:
        result = zipline(rows, algorithm, implementation=implementation)
        assert (result.t_sync, result.wait) == (0.0, 0.0)
        assert result.iterations.tolist() == [2, 1, 2]


def test_result_is_frozen_and_its_iterations_read_only():
    result = zipline([[1, 2], [2, 3]])
    assert isinstance(result, ZipLineResult)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.t_sync = 0
    with pytest.raises(ValueError):
        result.iterations[0] = 5
    assert result.iterations.dtype == np.int64


def test_predict_then_decide_the_barrier_is_where_the_workers_align():
    # Three workers at 1000, 1300 and 1500 ms per iteration, all last pushed at 0:
    # 9000, 9100 and 9000 are the first end times within 100 ms of each other.
    ends = predict_end_times([[-1000, 0], [-1300, 0], [-1500, 0]], R=15)
    result = zipline(ends)
    assert as_tuple(result) == (9100, 100, [9, 7, 6]) == brute_force(ends.tolist())
    assert as_tuple(zipline(ends, "zipline", implementation="reference")) == as_tuple(result)


# ---- rejected inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timestamps,message",
    [
        ([], "no workers"),
        (np.zeros((0, 3)), "at least one worker"),
        (np.zeros((3, 0)), "at least one worker"),
        ([[1, 2], []], "worker 1"),
        (np.arange(4.0), "expected n x R"),
        (np.zeros((2, 2, 2)), "expected n x R"),
        ([[1.0, float("nan")], [1.0, 2.0]], "NaN or infinite, the first at worker 0, iteration 2"),
        (np.array([[1.0, 2.0], [np.inf, np.inf]]), "worker 1, iteration 1"),
        ([[1, 2, 3], [5, 4, 6]], "worker 1 is not sorted: iteration 2"),
        (np.array([[1.0, 3.0], [2.0, 2.0], [9.0, 8.0]]), "worker 2 is not sorted"),
        ([[1, 2], [[3, 4]]], "worker 1 has shape (1, 2)"),
        (np.array([[0, np.iinfo(np.int64).max]]) - np.array([[np.iinfo(np.int64).max, 0]]), "overflow int64"),
    ],
)
def test_bad_timestamps_are_rejected_with_the_fix(implementation, timestamps, message):
    with pytest.raises(ValueError) as error:
        zipline(timestamps, implementation=implementation)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "timestamps",
    [
        np.array([[True, False]]),
        [["a", "b"]],
        5,
        np.array([[1 + 2j]]),
    ],
)
def test_non_numeric_timestamps_are_rejected(timestamps):
    with pytest.raises(TypeError, match="expected"):
        zipline(timestamps)


@pytest.mark.parametrize("algorithm", ["ZipLine", "opt_bs", "", None, 3])
def test_unknown_algorithm_names_list_the_known_ones(algorithm):
    with pytest.raises(ValueError, match="unknown algorithm.*'optbs'"):
        zipline([[1, 2]], algorithm)


# ---- the implementation switch ---------------------------------------------------------------


def test_implementation_is_chosen_by_argument_then_env_var(monkeypatch):
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    assert scheduler.implementation_name() == "compiled"
    assert _backend.load().__name__ == "tfsync.scheduler._zipline"
    monkeypatch.setenv(_backend.ENV_VAR, "reference")
    assert scheduler.implementation_name() == "reference"
    assert _backend.load().__name__ == "tfsync.scheduler._reference"
    assert scheduler.implementation_name("compiled") == "compiled"
    monkeypatch.setenv(_backend.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="TFSYNC_SCHEDULER_IMPL='fast'.*compiled, reference"):
        zipline([[1, 2]])
    with pytest.raises(ValueError, match="implementation='cython'"):
        zipline([[1, 2]], implementation="cython")


def test_both_modules_expose_the_same_kernels():
    compiled = _backend.load("compiled")
    reference = _backend.load("reference")
    for name in ALGORITHMS:
        assert callable(getattr(compiled, name)) and callable(getattr(reference, name))


def test_a_missing_extension_is_an_error_naming_the_build_command(monkeypatch):
    monkeypatch.setitem(_backend._MODULES, "compiled", "tfsync.scheduler._not_built")
    monkeypatch.setattr(_backend, "_loaded", {})
    with pytest.raises(ImportError) as error:
        zipline([[1, 2]], implementation="compiled")
    assert "pip install --no-build-isolation -e ." in str(error.value)
    assert "make install" in str(error.value)
    # ...and never a silent fallback: the reference still has to be asked for.
    assert zipline([[1, 2]], implementation="reference").t_sync == 1


def test_the_scheduler_never_imports_tensorflow():
    code = (
        "import sys; from tfsync.scheduler import zipline, predict_end_times; "
        "zipline(predict_end_times([[0, 1], [0, 2]], R=3)); "
        "sys.exit('tensorflow' in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))


# ---- the predictor ---------------------------------------------------------------------------


def test_predictor_extends_the_latest_interval():
    ends = predict_end_times([[0, 100, 250], [10, 130]], R=3)
    assert ends.dtype == np.int64
    assert ends.tolist() == [[400, 550, 700], [250, 370, 490]]
    ends = predict_end_times(np.array([[0.0, 1.25], [0.5, 1.0]]), R=2)
    assert ends.dtype == np.float64
    assert ends.tolist() == [[2.5, 3.75], [1.5, 2.0]]


def test_predictor_mixed_integer_and_float_histories_give_floats():
    ends = predict_end_times([[0, 100], [0.0, 0.5]], R=1)
    assert ends.dtype == np.float64 and ends.tolist() == [[200.0], [1.0]]


def test_predictor_smoothing():
    history = [0, 100, 300, 400]  # intervals 100, 200, 100
    assert predict_end_times([history], R=1, smoothing=1.0).tolist() == [[500]]
    # s = 100 -> 0.5 * 200 + 0.5 * 100 = 150 -> 0.5 * 100 + 0.5 * 150 = 125
    assert predict_end_times([history], R=2, smoothing=0.5).tolist() == [[525, 650]]
    floats = predict_end_times([[0.0, 0.1, 0.3, 0.4]], R=1, smoothing=0.5)
    assert floats[0, 0] == pytest.approx(0.525)


@settings(max_examples=50, deadline=None)
@given(last=st.integers(-(10**6), 10**6), interval=st.integers(1, 10**4), R=st.integers(1, 20))
def test_predicted_rows_are_sorted_and_evenly_spaced(last, interval, R):
    ends = predict_end_times([[last - interval, last]], R=R)
    assert ends.shape == (1, R)
    assert np.all(np.diff(ends[0]) == interval) and ends[0, 0] == last + interval
    assert zipline(ends).iterations.tolist() == [1]


def test_predictor_names_every_worker_without_enough_history():
    with pytest.raises(ValueError) as error:
        predict_end_times([[0, 1], [5], None, [], [1, 2]], R=4)
    message = str(error.value)
    assert "worker(s) 1 (1 push), 2 (0 pushes), 3 (0 pushes)" in message
    assert "at least two pushes" in message


@pytest.mark.parametrize(
    "histories,message",
    [
        ([[0, 1], [2, 2]], "worker(s) 1 have push timestamps that do not strictly increase"),
        ([[0, 1], [3, 2]], "do not strictly increase"),
        ([[0.0, np.nan], [0.0, 1.0]], "worker(s) 0 have NaN or infinite"),
        ([], "no workers"),
        (np.zeros(3), "expected n x h"),
        ([[[0, 1]]], "worker 0 has shape"),
    ],
)
def test_predictor_rejects_bad_histories(histories, message):
    with pytest.raises(ValueError) as error:
        predict_end_times(histories, R=3)
    assert message in str(error.value)


@settings(max_examples=100, deadline=None)
@given(
    table=st.integers(1, 6).flatmap(
        lambda h: st.lists(
            st.lists(st.integers(-(10**6), 10**6), min_size=h, max_size=h, unique=True).map(sorted),
            min_size=1,
            max_size=8,
        )
    ),
    as_float=st.booleans(),
    smoothing=st.one_of(st.none(), st.floats(0.05, 1.0)),
)
def test_predictor_array_and_per_worker_paths_agree(table, as_float, smoothing):
    # an n x h array takes the path with no loop over workers (ElasticBSP's, 10,000 workers
    # in ms): it must predict what the per-worker path predicts and reject what it rejects
    array = np.array(table, np.float64 if as_float else np.int64)
    rows = [[float(t) if as_float else int(t) for t in r] for r in table]  # the per-worker path
    try:
        expected = predict_end_times(rows, R=4, smoothing=smoothing)
    except ValueError as error:
        with pytest.raises(ValueError, match="fewer than two push timestamps"):
            predict_end_times(array, R=4, smoothing=smoothing)
        assert "fewer than two" in str(error)
        return
    got = predict_end_times(array, R=4, smoothing=smoothing)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint64, np.int32, np.float32])
def test_predictor_rejects_decreasing_stamps_of_every_dtype(dtype):
    # np.diff of unsigned stamps wraps around (3 - 5 = 254 for uint8): compared, not subtracted
    for histories in (np.array([[5, 3], [1, 2]], dtype), [np.array([5, 3], dtype), np.array([1, 2], dtype)]):
        with pytest.raises(ValueError, match="worker\\(s\\) 0 have push timestamps that do not strictly increase"):
            predict_end_times(histories, R=2)


@pytest.mark.parametrize("R", [0, -1, 2.5, True, "15"])
def test_predictor_rejects_bad_lookahead(R):
    with pytest.raises(ValueError, match="expected a positive integer"):
        predict_end_times([[0, 1]], R=R)


@pytest.mark.parametrize("smoothing", [0.0, 1.5, -0.1, "0.5", True])
def test_predictor_rejects_bad_smoothing(smoothing):
    with pytest.raises(ValueError, match=r"expected None .* or a weight in \(0, 1\]"):
        predict_end_times([[0, 1, 2]], R=3, smoothing=smoothing)


def test_predictor_rejects_non_numeric_histories():
    with pytest.raises(TypeError, match="worker 1 has dtype"):
        predict_end_times([[0, 1], ["a", "b"]], R=3)


# ---- the benchmark ---------------------------------------------------------------------------


def test_quick_benchmark_runs_and_writes_records(tmp_path, capsys):
    import json

    from tfsync.bench import scheduler as bench

    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(path), "--limit-s", "0.2"]) == 0
    records = json.loads(path.read_text())["records"]
    assert {"algorithm", "n", "R", "microseconds", "wait"} <= set(records[0])
    measured = [r for r in records if r["microseconds"] is not None]
    assert {r["algorithm"] for r in measured} == set(ALGORITHMS) | {"numpy_sort"}
    for r in records:
        assert (r["microseconds"] is None) == (r["skipped"] is not None)
    # The exact algorithms agree on the decision in every cell.
    for n in {r["n"] for r in records}:
        for R in {r["R"] for r in records}:
            exact = {
                (r["wait"], r["t_sync"])
                for r in measured
                if r["n"] == n and r["R"] == R and r["algorithm"] in EXACT_ALGORITHMS
            }
            assert len(exact) == 1
    assert "microseconds per decision" in capsys.readouterr().out
