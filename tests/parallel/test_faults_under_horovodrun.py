"""Lost, hung and misconfigured workers stop the job with an error naming the rank.

Bounds (documented in docs/guide/faults.md): a worker that exits is named within a few
seconds (its control stream closes); a hung worker within ``wait_timeout_s``
(5 s here) plus a second of polling.
"""

import pytest

from tests.parallel.launch import read_results, run_workers

pytestmark = pytest.mark.parallel
SURVIVORS = [0, 1, 3]


def _run(tmp_path, scenario):
    run_workers("faults.py", 4, [tmp_path, scenario], timeout_s=150, expect_success=False)
    return read_results(tmp_path)


@pytest.mark.parametrize(
    "scenario,kind,bound_s",
    [
        ("die", "WorkerLostError", 20.0),
        ("hang", "SyncTimeoutError", 20.0),
        # BSP's round runs in the compiled step, inside Horovod's op: the watch thread must end
        # that wait at the bound too; a peer that dies fails the op, and the error names it
        ("hang_bsp", "SyncTimeoutError", 20.0),
        ("die_bsp", "WorkerLostError", 20.0),
        # with simulated stragglers BSP's round runs on the training thread (inline): its
        # watchdog must end that wait at the bound too
        ("hang_bsp_stragglers", "SyncTimeoutError", 20.0),
        ("die_psp", "WorkerLostError", 20.0),
    ],
)
def test_survivors_name_the_lost_rank(tmp_path, scenario, kind, bound_s):
    results = _run(tmp_path, scenario)
    fault_at = results[2]["fault_at"]
    for rank in SURVIVORS:
        res = results[rank]
        assert res["error"] is not None and res["error"].startswith(kind), (rank, res)
        assert "rank 2" in res["error"] or "[2]" in res["error"], res["error"]
        assert res["error_at"] - fault_at < bound_s, (rank, res["error_at"] - fault_at)
        assert res["in_graph"] == (scenario in ("hang_bsp", "die_bsp")), (rank, res)


def test_a_slow_worker_stops_nobody_under_psp(tmp_path):
    results = _run(tmp_path, "slow_psp")
    assert sorted(results) == [0, 1, 2, 3], results
    for rank, res in results.items():
        assert res["error"] is None, (rank, res)
        c = res["counts"]
        assert c["produced"] == c["applied"] + c["dropped"], (rank, c)
    assert results[2]["counts"]["skipped"] > 0, results[2]  # it caught up instead of holding the others


def test_mismatched_configuration_is_refused_before_training(tmp_path):
    results = _run(tmp_path, "mismatch")
    for rank in range(4):
        err = results[rank]["error"]
        assert err.startswith("ValueError") and "ranks [1]" in err and "staleness" in err, err


def test_an_elastic_reset_does_not_wait_out_gloos_timeout_on_a_live_peer(tmp_path):
    # (Horovod built with tfsync's patch, hunk 7: hvd.shutdown() waits for Horovod's background
    # thread, which waits on the frozen rank 1 until Gloo's timeout unless interrupted)
    code, out = run_workers(
        "gloo_interrupt.py", 2, [tmp_path], timeout_s=150, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}
    )
    results = read_results(tmp_path)
    assert results[0]["interrupted"] is not None, "this Horovod has no horovod_tfsync_interrupt: `make install`"
    assert results[0]["interrupted"] > 0, results
    assert "tfsync: interrupted for an elastic reset" in out  # Horovod's log: why its loop ended
    assert results[0]["shutdown_s"] < 30.0, results  # ended by the interrupt, not Gloo's 60 s
    assert "allreduce worked" not in results[1]["after"], results  # rank 0 is gone for rank 1


def test_a_collective_torn_by_a_killed_rank_fails_on_the_survivors_and_aborts_none(tmp_path):
    # (Horovod built with tfsync's patch, hunk 15: when rank 3 died mid-allreduce, a survivor's
    # allreduce failed while a live peer still sent it its part; the survivor went on to
    # negotiate on the same connections, and Gloo aborted it on that peer's data: exit 134)
    code, out = run_workers(
        "torn_collective.py",
        4,
        [tmp_path, 0],
        timeout_s=150,
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "20"},
        expect_success=False,
    )
    assert "EnforceNotMet" not in out and "terminate called" not in out, out[-6000:]
    assert "exit with status code 134" not in out, out[-6000:]
    results = read_results(tmp_path)
    assert 3 not in results, results  # (it was killed)
    for rank, res in results.items():  # (the launcher ends the survivors once rank 3 failed: those that wrote)
        assert res["error"] is not None and res["after"] != "allreduce worked", (rank, res)
