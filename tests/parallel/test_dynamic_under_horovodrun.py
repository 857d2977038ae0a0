"""DSSP and ElasticBSP under horovodrun, as a user runs them (their launch scripts,
horovodrun_scripts/dssp.sh and elasticbsp.sh, on the digits example), checked from the
engines' traces: each script's run here is its test too (it must reach 0.90, replicas identical)."""

import glob
import json
import os

import pytest

from tests.parallel.launch import ROOT, result_of, run

pytestmark = pytest.mark.parallel
WORKERS = 4
LOW, HIGH = 1, 5
EPOCHS = 8


def traced(trace_dir, script, env, *args):
    """``horovodrun_scripts/<script>`` on :data:`WORKERS` workers with ``args`` and its traces, rank -> records."""
    cmd = ["bash", os.path.join(ROOT, "horovodrun_scripts", script), "--trace-dir", str(trace_dir)]
    res = result_of(run([*cmd, "--epochs", str(EPOCHS), *map(str, args)], env={"NP": str(WORKERS), **env}))
    assert res["final_accuracy"] >= 0.90 and res["replicas_identical"], res
    assert res["produced"] == res["applied"] + res["compensated"] + res["dropped"], res
    traces = {}
    for path in glob.glob(os.path.join(trace_dir, "rank*.jsonl")):
        records = [json.loads(line) for line in open(path)]
        traces[records[0]["rank"]] = records
    assert sorted(traces) == list(range(WORKERS))
    return res, traces


def behind(traces, push, needed, t):
    """The workers that had not pushed step ``needed`` by time ``t``."""
    return [] if needed < 0 else [o for o in traces if push[(o, needed)] > t + 1e-6]


def steps_of(records):
    return [r for r in records if "step" in r and "event" not in r]


@pytest.fixture(scope="module")
def dssp(tmp_path_factory):
    # jitter: a different worker is slowest at each step, so the controller has choices to make
    env = {"LOW": str(LOW), "HIGH": str(HIGH)}
    return traced(tmp_path_factory.mktemp("dssp"), "dssp.sh", env, "--stragglers", "base=0.005,jitter=0.03,seed=3")


def test_dssp_keeps_every_step_within_its_bounds(dssp):
    res, traces = dssp
    push = {(k, r["step"]): r["t_push"] for k, recs in traces.items() for r in steps_of(recs)}
    beyond_low = 0
    for k, recs in traces.items():
        by_step = {r["step"]: r for r in steps_of(recs)}
        for r in by_step.values():
            c = r["step"] + 1  # the step this worker starts at t_end
            if c not in by_step:
                continue

            high, low = (behind(traces, push, c - b - 1, r["t_end"]) for b in (HIGH, LOW))
            assert not high, (k, c, high)  # never past the upper bound
            if low:  # past the lower bound: only under a grant
                beyond_low += 1
                assert by_step[c]["granted"], (k, c, low)
    grants = [g for recs in traces.values() for g in recs if g.get("event") == "grant"]
    assert grants and all("actual_wait_s" in g for g in grants), grants[:3]
    decided = [g for g in grants if g["reason"] in ("granted", "wait")]
    assert decided and all(g["predicted_wait_s"] is not None for g in decided)
    assert all(g["extra"] <= HIGH - LOW for g in grants)
    assert any(g["extra"] > 0 for g in grants) and beyond_low > 0  # the bounds were exercised
    print(f"DSSP: {beyond_low} steps past the lower bound, {len(grants)} decisions")


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    # heterogeneous: rank 3 takes twice as long on every step
    spec = "base=0.01,slow=3:0.01,seed=1"
    return traced(tmp_path_factory.mktemp("elastic"), "elasticbsp.sh", {"LOOKAHEAD": "8"}, "--stragglers", spec)


def test_elasticbsp_every_worker_decides_the_same_barriers(elastic):
    res, traces = elastic
    decisions = [
        [
            {k: v for k, v in r.items() if k not in ("rank", "t", "decision_s")}
            for r in recs
            if r.get("event") == "barrier"
        ]
        for _, recs in sorted(traces.items())
    ]
    assert decisions[0] and all(d == decisions[0] for d in decisions)
    for d in decisions[0]:
        assert 1 <= min(d["iterations"]) and max(d["iterations"]) <= 8
        assert d["barrier"] == d["start"] + max(d["iterations"]) - 1


def test_elasticbsp_lets_the_slow_worker_skip_and_counts_it(elastic):
    res, traces = elastic
    skipped = {k: sum(r["skipped"] for r in steps_of(recs)) for k, recs in traces.items()}
    assert skipped[3] > max(skipped[0], skipped[1], skipped[2]), skipped
    assert res["skipped"] == sum(skipped.values()) and res["dropped"] == 0, res
    assert res["produced"] == res["applied"], res


def test_elasticbsp_times_every_barrier_decision(elastic):
    """Each barrier's decision is timed where it was made (what it costs against an iteration is
    the bench's figure, ``decision_per_iteration``: a time, not a test's assertion)."""
    _, traces = elastic
    for recs in traces.values():
        barriers = [r for r in recs if r.get("event") == "barrier"]
        assert barriers and all(r["decision_s"] >= 0 for r in barriers), barriers[:3]
