"""``python -m tfsync.bench lm``: its summary against plain Horovod, the BSP-against-Horovod
comparison, the table and plots of saved runs (``--from-json``), and its command line (no training)."""

import json
import re

import pytest

from tfsync.bench import lm

TOKENS = 1000


def run(link, method, repeat, losses, wall_s, bytes_sent):
    """A run's record as the example writes it: evaluations at equal steps of time and tokens."""
    n = len(losses)
    curve = [[wall_s * (i + 1) / n, TOKENS * (i + 1), loss] for i, loss in enumerate(losses)]
    return {
        "link": link,
        "method": method,
        "repeat": repeat,
        "mode": method,
        "val_loss": losses[-1],
        "perplexity": 2.0,
        "wall_s": wall_s,
        "ms_per_step": wall_s,
        "tokens": TOKENS * n,
        "tokens_per_s": TOKENS * n / wall_s,
        "bytes_sent": bytes_sent,
        "parameters": 3_000_000,
        "curve": curve,
        "curve_bytes_sent": [bytes_sent * (i + 1) / n for i in range(n)],
    }


RUNS = [
    run("300mbit", "horovod", 0, [3.0, 2.0, 1.50, 1.00], 400.0, 4e9),
    run("300mbit", "diloco+int8", 0, [3.0, 2.0, 1.01, 1.005], 100.0, 4e9 / 32),  # within 2 % at its 3rd point
    run("300mbit", "diloco+int4", 0, [3.0, 2.0, 1.5, 1.04], 90.0, 4e9 / 62),  # never within 3 %
    run("300mbit", "floor", 0, [3.0, 2.5, 2.2, 2.1], 80.0, 4e6),
]


def test_the_summary_compares_each_method_with_plain_horovod_at_its_link():
    rows = {r["method"]: r for r in lm.summarize(RUNS)}
    int8, int4 = rows["diloco+int8"], rows["diloco+int4"]
    assert int8["loss_vs_horovod"] == pytest.approx(1.005)
    assert int8["wall_vs_horovod"] == pytest.approx(0.25)
    assert int8["horovod_bytes_over_these"] == pytest.approx(32)
    assert int8["within_2pct_s"] == pytest.approx(75.0)
    assert int8["within_2pct_vs_horovod_wall"] == pytest.approx(75 / 400)
    assert int4["within_2pct_s"] is None and int4["within_3pct_s"] is None  # 1.04 > 1.03
    # the floor's time per step is every row's compute
    assert all(r["compute_ms_per_step"] == 80.0 for r in rows.values())
    table = lm.format_table(lm.summarize(RUNS))
    assert "| 300mbit | diloco+int8 | 1 | 1.0050 | 1.005 | 100 | 0.25× | 75 s (0.19×) |" in table
    assert "not reached" in table


def test_bsp_against_horovod_needs_two_runs_each_and_compares_means_and_spreads():
    one_each = [run("none", "horovod", 0, [2.0, 1.0], 10.0, 1.0), run("none", "bsp", 0, [2.0, 1.1], 10.0, 1.0)]
    assert lm.bsp_against_horovod(one_each) == {}
    twice = one_each + [run("none", "horovod", 1, [2.2, 1.2], 10.0, 1.0), run("none", "bsp", 1, [2.0, 1.0], 10.0, 1.0)]
    points = lm.bsp_against_horovod(twice)["none"]
    assert [p["tokens"] for p in points] == [TOKENS, 2 * TOKENS]
    assert points[1]["bsp_minus_horovod"] == pytest.approx(1.05 - 1.1)
    assert points[1]["horovod_spread"] == pytest.approx(0.2) and points[1]["bsp_spread"] == pytest.approx(0.1)


def test_from_json_merges_studies_prints_the_table_and_draws_the_plots(tmp_path, capsys):
    paths = []
    for i, link in enumerate(("none", "300mbit")):
        runs = [dict(r, link=link) for r in RUNS]
        paths.append(tmp_path / f"study{i}.json")
        paths[-1].write_text(json.dumps({"settings": {"links": [link]}, "runs": runs}))
    merged = tmp_path / "merged.json"
    lm.main(["--from-json", *map(str, paths), "--json", str(merged), "--plots", str(tmp_path / "plots")])
    assert "| none | diloco+int8 |" in capsys.readouterr().out
    study = json.loads(merged.read_text())
    assert len(study["runs"]) == 2 * len(RUNS) and set(study["settings"]["merged_from"]) == set(map(str, paths))
    for name in ("loss_vs_time.png", "loss_vs_bytes.png", "loss_vs_tokens.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 10_000, name


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--methods", "horovod", "fastest"], r"--methods: fastest unknown; choose from horovod, bsp, .*, floor$"),
        (["--links", "fast"], r"expected a link rate as tc writes it"),
        (["--epochs", "0"], r"argument --epochs: expected a whole number >= 1"),  # (the example's own check)
    ],
)
def test_a_bad_flag_stops_before_any_launch(argv, message, capsys):
    with pytest.raises(SystemExit):
        lm.parse_args(argv)
    assert re.search(message, capsys.readouterr().err.strip())
