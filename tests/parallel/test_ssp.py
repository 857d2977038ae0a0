"""SSP invariants, checked from recorded traces under random injected delays."""

import glob
import json
import os

import pytest

from tests.parallel.launch import read_results, run_workers

pytestmark = pytest.mark.parallel
STALENESS = 2
WORKERS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ssp")
    run_workers("ssp_invariants.py", WORKERS, [out, STALENESS], timeout_s=240)
    traces = {}
    for path in glob.glob(os.path.join(out, "trace", "rank*.jsonl")):
        records = [json.loads(line) for line in open(path)]
        traces[records[0]["rank"]] = [r for r in records if "step" in r]
    return out, read_results(out), traces


def test_clock_gap_never_exceeds_staleness(run):
    _, _, traces = run
    assert sorted(traces) == list(range(WORKERS))
    push_time = {(rank, r["step"]): r["t_push"] for rank, recs in traces.items() for r in recs}
    checked = 0
    for rank, recs in traces.items():
        for r in recs:
            nxt = r["step"] + 1  # the step this worker starts at t_end
            needed = nxt - STALENESS - 1
            if needed < 0:
                continue
            for other in traces:
                # the other worker must have pushed step `needed` before this one went on
                assert push_time[(other, needed)] <= r["t_end"] + 1e-6, (rank, other, r)
                checked += 1
    assert checked > 100


def test_gap_bound_is_reached_under_delays(run):
    # the delays must actually make workers drift apart, or the test above proves nothing
    _, _, traces = run
    applied_lag = max(r["step"] - r["applied_through"] for recs in traces.values() for r in recs)
    assert applied_lag == STALENESS


def test_timeline_reads_the_engine_trace_and_sees_the_bound(run):
    from tfsync import timeline

    out, _, _ = run
    summary = timeline.summarize(timeline.load_trace(os.path.join(out, "trace")))
    assert summary["overall"]["max_clock_gap"] == STALENESS, summary["overall"]
    assert summary["overall"]["max_staleness"] <= STALENESS


def test_each_step_sees_old_rounds_of_all_and_all_of_its_own(run):
    _, results, _ = run
    for rank, res in results.items():
        assert res["steps_seen"] == 30
        assert res["min_applied_minus_step"] >= -STALENESS - 1, res
        assert res["read_my_writes_max_error"] < 1e-5, (rank, res)


def test_every_update_applied_and_replicas_identical(run):
    _, results, traces = run
    assert all(res["final_error"] < 1e-5 for res in results.values()), results
    assert len({tuple(res["final_weights_hex"]) for res in results.values()}) == 1
    applied = {rank: sum(n for r in recs for _, _, n in r["applied"]) for rank, recs in traces.items()}
    # during training a worker applies all but its last in-flight rounds (finished at train end)
    assert all(a >= (30 - STALENESS - 1) * WORKERS for a in applied.values()), applied


def test_metrics_reach_keras_logs_and_tensorboard(run):
    out, results, _ = run
    for res in results.values():
        assert {"tfsync_wait_fraction", "tfsync_applied", "tfsync_dropped"} <= set(res["history_keys"])
        assert all(0.0 <= w < 1.0 for w in res["wait_fraction"])
    import tensorflow as tf

    tags = set()
    for path in glob.glob(os.path.join(out, "tb", "**", "events.out.tfevents.*"), recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert "epoch_tfsync_wait_fraction" in tags, sorted(tags)
