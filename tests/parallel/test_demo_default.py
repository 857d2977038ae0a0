"""``python -m tfsync.demo`` without ``--all``: plain Horovod beside the modes the registry names
for a straggler, the table, a line per scenario and the plot (small sizes; the slow link's part
runs in tests/multihost/test_demo_slow_link.py)."""

import json
import os
import sys

import pytest

from tfsync.launch import REPO_ROOT, run_bounded_command
from tfsync.policies import registry

pytestmark = pytest.mark.parallel


def run(cmd, timeout_s=300):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    code, out = run_bounded_command(cmd, env, timeout_s)
    assert code == 0, f"{cmd} failed:\n{out[-6000:]}"
    return out


def test_the_demo_compares_the_registrys_straggler_modes_with_plain_horovod(tmp_path):
    plot = tmp_path / "out" / "accuracy.png"
    out = run(
        [
            *(sys.executable, "-m", "tfsync.demo", "--workers", "2", "--epochs", "3"),
            *("--stragglers", "base=0.005,slow=1:0.02", "--target-accuracy", "0.5"),
            *("--json", str(tmp_path / "demo.json"), "--plot", str(plot)),
        ]
    )
    rows = json.loads((tmp_path / "demo.json").read_text())
    assert [r["config"] for r in rows] == ["horovod", *registry.best_for("straggler")]
    assert all(r["scenario"] == "custom" and r["replicas_identical"] for r in rows), rows
    # digits' MLP passes 0.5 within its first epoch under every mode: each is timed against Horovod's
    assert rows[0]["speedup_vs_horovod"] == 1.0 and all(r["speedup_vs_horovod"] > 0 for r in rows), rows
    assert "time to 0.5 vs plain Horovod |" in out and "- custom: " in out and "plain Horovod in " in out
    header = "| scenario | mode | samples/s | effective samples/s | compensated | dropped | skipped | wait fraction |"
    assert header in out and all(f"| custom | {r['mode']} |" in out for r in rows), out[-3000:]
    assert all(r["samples_per_s"] > 0 for r in rows), rows
    assert rows[0]["wait_fraction"] is None and all(0 <= r["wait_fraction"] < 1 for r in rows[1:]), rows
    assert f"wrote {plot}" in out and plot.stat().st_size > 10_000
