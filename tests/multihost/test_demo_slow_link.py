"""The demo's slow-link part: plain Horovod and the registry's answer to a slow link, one worker on
each of two simulated hosts behind a shaped link (small sizes: the demo's own takes minutes),
through the network bench's digits task (``python -m tfsync.bench network --task digits``)."""

import pytest

from tfsync import demo
from tfsync.bench import network

LINK = "200mbit"
HIDDEN = 32


def test_the_slow_link_runs_plain_horovod_and_the_registrys_modes_across_two_hosts(monkeypatch):
    monkeypatch.setattr(demo, "SLOW_LINK", {"rate": LINK, "hidden": [HIDDEN], "epochs": 2, "lr": 0.2})
    rows = demo.slow_link(demo.parse_args(["--situations", "slow-link", "--target-accuracy", "0.5"]))
    # (an empty list means the hosts could not be made: this folder's tests run as root, as CI does)
    assert [r["config"] for r in rows] == demo.slow_link_modes(), rows
    horovod = rows[0]
    assert horovod["mode"] == "horovod" and len(rows) >= 2, rows
    for r in rows:
        assert r["scenario"] == "slow-link" and r["link"] == LINK and r["workers"] == 2 and r["epochs"] == 2, r
        assert r["hidden"] == [HIDDEN] and r["parameters"] == 64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10, r
        assert r["replicas_identical"] and len(r["curve"]) == 2 and 0 < r["final_accuracy"] <= 1, r
        assert r["time_to_accuracy_s"]["0.5"] is not None, r  # digits passes 0.5 in its first epoch
        assert r["accuracy_vs_horovod"] == pytest.approx(r["final_accuracy"] - horovod["final_accuracy"]), r
        if r is not horovod:  # (nothing dropped, rejected or lost here)
            assert r["produced"] == r["applied"], r
            assert r["target_time_vs_horovod"] == pytest.approx(r["target_s"] / horovod["target_s"]), r
    demo.compare_with_baseline(rows, 0.5)
    assert rows[0]["speedup_vs_horovod"] == 1.0 and rows[1]["speedup_vs_horovod"] > 0
    table = network.format_digits_table(rows)
    assert table.count(f"| {LINK} |") == len(rows) and f"| {rows[1]['mode'].split('(')[0]}" in table, table
