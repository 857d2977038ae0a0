"""The public extension point: a mode written in one file outside tfsync trains under the callback."""

import glob
import json
import os

import numpy as np
import pytest

from tests.parallel.launch import results_of

pytestmark = pytest.mark.parallel
WORKERS = 3


def test_a_user_defined_mode_trains_under_the_callback(tmp_path):
    results = results_of("custom_mode.py", WORKERS, tmp_path, timeout_s=240)
    assert {r["mode"] for r in results.values()} == {"lagone"}
    for r in results.values():  # every contribution applied: rounds close with every worker
        c = r["counts"]
        assert c["produced"] == c["applied"] > 0 and c["dropped"] == c["compensated"] == c["skipped"] == 0
        np.testing.assert_array_equal(r["weights"], results[0]["weights"])  # replicas identical at the end
    records = []
    for path in glob.glob(os.path.join(tmp_path, "trace", "rank*.jsonl")):
        records += [json.loads(line) for line in open(path)]
    steps = [r for r in records if "step" in r]
    assert steps and all("ahead" in r for r in steps)  # the mode's own component ran at every step
    assert max(r["ahead"] for r in steps) <= 1  # its bound: one step past the newest complete round
    starts = [r for r in records if r.get("event") == "start"]
    assert {s["policy"]["mode"] for s in starts} == {"lagone"}
