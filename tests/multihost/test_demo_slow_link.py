"""The demo's slow-link part: plain Horovod and the registry's answer to a slow link, one worker on
each of two simulated hosts behind a shaped link (small sizes: the demo's own takes minutes)."""

from tfsync import demo


def test_the_slow_link_runs_plain_horovod_and_the_registrys_modes_across_two_hosts(monkeypatch):
    monkeypatch.setattr(demo, "SLOW_LINK", {"rate": "200mbit", "hidden": [64], "epochs": 2, "lr": 0.2})
    rows = demo.slow_link(demo.parse_args(["--situations", "slow-link", "--target-accuracy", "0.5"]))
    # (an empty list means the hosts could not be made: this folder's tests run as root, as CI does)
    assert [r["config"] for r in rows] == demo.slow_link_modes(), rows
    for r in rows:
        assert r["scenario"] == "slow-link" and r["link"] == "200mbit" and r["workers"] == 2, r
        assert r["replicas_identical"] and len(r["curve"]) == 2, r
        assert r["time_to_accuracy_s"]["0.5"] is not None, r  # digits passes 0.5 in its first epoch
    demo.compare_with_baseline(rows, 0.5)
    assert rows[0]["speedup_vs_horovod"] == 1.0 and rows[1]["speedup_vs_horovod"] > 0
