"""User cases that could end with no error but replicas apart or NaN: every one ends with
finite replicas identical on both workers, the weights moved, and a NaN batch's contribution
rejected and counted.  One ``horovodrun -np 2`` launch
(``workers/user_cases.py``) runs every case; the tests read its results."""

import math

import pytest

from tests.parallel.launch import results_of

pytestmark = pytest.mark.parallel

CASES = ["tape_apply_bsp", "nan_bsp", "nan_psp", "adam_ahead_bsp", "nan_ssp_adam"]
NAN_CASES = ["nan_bsp", "nan_psp", "nan_ssp_adam"]
# modes whose every replica applies the same rounds through its own optimizer: the optimizer
# state is identical too (under SSP each worker's optimizer runs on its own gradients)
SAME_OPTIMIZER_STATE = ["tape_apply_bsp", "nan_bsp", "nan_psp", "adam_ahead_bsp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    res = results_of("user_cases.py", 2, tmp_path_factory.mktemp("user_cases"), timeout_s=240)
    assert res[0]["data_sum"] != res[1]["data_sum"], "both ranks train on the same data: equal replicas prove nothing"
    return res


def _case(results, case):
    for rank, res in results.items():
        assert res[case]["error"] is None, f"rank {rank}, case {case}:\n{res[case]['error']}"
    return results[0][case], results[1][case]


def _all_finite(values):
    if isinstance(values, list):
        return all(_all_finite(v) for v in values)
    return math.isfinite(values)


@pytest.mark.parametrize("case", CASES)
def test_replicas_end_finite_and_identical_and_the_weights_moved(results, case):
    r0, r1 = _case(results, case)
    for rank, row in enumerate((r0, r1)):
        assert row["moved"] > 1e-3, f"rank {rank}: training did not move the weights, the comparison is void"
        assert _all_finite(row["weights"]), (rank, case)
        assert _all_finite(list(row["optimizer_variables"].values())), (rank, case)
    assert r0["weights"] == r1["weights"], f"{case}: the replicas' weights differ"


@pytest.mark.parametrize("case", SAME_OPTIMIZER_STATE)
def test_replicas_end_with_identical_optimizer_state(results, case):
    r0, r1 = _case(results, case)
    assert r0["optimizer_variables"].keys() == r1["optimizer_variables"].keys()
    differ = [k for k in r0["optimizer_variables"] if r0["optimizer_variables"][k] != r1["optimizer_variables"][k]]
    assert not differ, f"{case}: optimizer variables differ between the replicas: {differ}"


@pytest.mark.parametrize("case", CASES)
def test_every_contribution_is_accounted_for(results, case):
    for rank, row in enumerate(_case(results, case)):
        c = row["counts"]
        assert c["produced"] == c["applied"] + c["compensated"] + c["dropped"] + c["rejected"], (rank, case, c)
        assert c["produced"] > 0, (rank, case, c)


def test_a_custom_train_step_calling_optimizer_apply_is_synchronized(results):
    # the callback hooks optimizer.apply, which a tape-based train_step calls directly: BSP
    # rounds ran (nothing rejected, every step applied), so the ranks' different shards met
    for rank, row in enumerate(_case(results, "tape_apply_bsp")):
        c = row["counts"]
        assert c["applied"] == c["produced"] == results[rank]["steps"], (rank, c)


@pytest.mark.parametrize("case", NAN_CASES)
def test_a_nan_batch_on_rank_1_is_rejected_once_and_counted(results, case):
    r0, r1 = _case(results, case)
    assert r0["counts"]["rejected"] == 0, r0["counts"]
    # exactly one: under SSP the optimizer step of the NaN batch is skipped, so no NaN reaches
    # rank 1's Adam moments and its later updates are finite (not rejected too)
    assert r1["counts"]["rejected"] == 1, r1["counts"]
    assert r1["counts"]["produced"] == results[1]["steps"] - r1["counts"]["skipped"], r1["counts"]
    for row in (r0, r1):  # the epoch logs: per epoch, the mean over the 2 workers
        assert sum(row["logged_rejected"]) * 2 == 1, row["logged_rejected"]


def test_optimizer_state_ahead_on_one_rank_is_replaced_by_rank_0s(results):
    r0, r1 = _case(results, "adam_ahead_bsp")
    assert (r0["iterations_before_fit"], r1["iterations_before_fit"]) == (0, 1), "the ranks did not start apart"
    for rank, row in enumerate((r0, r1)):
        # rank 0's state (no step taken) broadcast at the start, then one step per BSP round
        iterations = [v for k, v in row["optimizer_variables"].items() if k.endswith("iteration")]
        assert iterations == [results[rank]["steps"]], (rank, row["optimizer_variables"].keys(), iterations)
