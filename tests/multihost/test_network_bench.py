"""The network-bound benchmark (python -m tfsync.bench network) runs on two hosts whose link it
shapes, and reports each mode against the compute floor and plain Horovod (its digits task, plain
Horovod against DiLoCo across the link: tests/multihost/test_demo_slow_link.py, which runs it as
the demo does)."""

import subprocess
import sys

import pytest

from tfsync.bench import network

LINK = "200mbit"


def test_every_mode_is_measured_on_the_shaped_link_and_the_link_is_restored(two_hosts):
    argv = ["--rates", LINK, "--models", "small", "--modes", "local", "horovod", "bsp", "--steps", "3"]
    args = network.parse_args([*argv, "--timeout-s", "240"])
    shaped = []

    def log(line):  # called after each launch, while the link is still shaped
        shaped.append(two_hosts.run(2, ["tc", "qdisc", "show", "dev", "eth1"], timeout_s=20)[1])

    records = network.run(two_hosts, args, log=log)
    assert [r["key"] for r in records] == ["local", "horovod", "bsp"]
    for r in records:
        assert r["link"] == LINK and r["workers"] == 2 and r["ms_per_step"] > 0, r
        assert r["compute_floor_ms"] == records[0]["ms_per_step"], r
        assert r["vs_horovod"] > 0 and r["overlap_limit_ms"] >= r["compute_floor_ms"], r
        assert r["produced"] == r["applied"] + r["compensated"] + r["dropped"] + r.get("rejected", 0), r
    assert len(shaped) == 3 and all("tbf" in s and "rate 200Mbit" in s for s in shaped), shaped
    after = two_hosts.run(2, ["tc", "qdisc", "show", "dev", "eth1"], timeout_s=20)[1]
    assert "tbf" not in after, after
    assert "| 200mbit | small | tfsync BSP |" in network.format_table(records)


@pytest.mark.parametrize("raw", ["1gb", "fast", "0mbit", "2.5"])
def test_a_rate_tc_does_not_take_is_refused_when_parsed(raw):
    out = subprocess.run(
        [sys.executable, "-m", "tfsync.bench", "network", "--rates", raw],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert "argument --rates: expected a link rate as tc writes it" in out.stderr and "e.g. 1gbit" in out.stderr


def test_each_task_takes_its_own_modes():
    assert network.parse_args([]).modes == list(network.DEFAULT_MODES)
    assert network.parse_args(["--task", "digits"]).modes == list(network.DEFAULT_DIGITS_MODES)
    out = subprocess.run(
        [sys.executable, "-m", "tfsync.bench", "network", "--task", "digits", "--modes", "local", "diloco"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert "--task digits runs the modes horovod, " in out.stderr and "got local" in out.stderr, out.stderr


def test_compression_runs_each_mode_once_per_wire_format_against_uncompressed_plain_horovod():
    args = network.parse_args(["--modes", "local", "horovod", "bsp", "diloco", "--compression", "fp16", "bf16"])
    runs = network.variants(args.modes, args.compression)
    assert [key for key, _, _ in runs] == [
        "local",
        "horovod",  # (the reference: uncompressed always)
        "horovod+fp16",  # (Horovod's own Compression.fp16; it has no bf16)
        "bsp+fp16",
        "bsp+bf16",
        "diloco+fp16",
        "diloco+bf16",
    ]
    assert network.parse_args([]).compression == ["none"]


def test_diloco_period_and_overlap_reach_every_diloco_mode_and_its_label():
    args = network.parse_args(["--inner-steps", "16", "--overlap-steps", "3", "--modes", "diloco", "diloco+overlap"])
    settings = network._settings(args)
    flags = network.registry.configurations(**settings)
    assert flags["diloco+fragments"][-4:] == ["--overlap-steps", "3", "--fragments", "4"]
    assert "--inner-steps" in flags["diloco"] and "16" in flags["diloco"]
    assert "--staleness" not in flags["diloco"] and "--inner-steps" not in flags["ssp"]
    assert network._label("diloco+fragments", flags["diloco+fragments"], settings) == "tfsync DiLoCo(H=16, P=4, tau=3)"
    # a variant's own overlap wins, and its label says it
    assert network._label("diloco+overlap", flags["diloco+overlap"], settings) == "tfsync DiLoCo(H=16, tau=2)"
    plain = network._settings(network.parse_args(["--modes", "diloco"]))
    assert network._label("diloco", network.registry.configurations(**plain)["diloco"], plain) == "tfsync DiLoCo(H=8)"


def test_the_link_peak_is_per_sampling_period_even_when_a_sample_came_late():
    from tfsync.bench.hosts import LinkSampler

    sampler = LinkSampler(None, 1, 0.1)
    # 1 MB in the first 100 ms, 3 MB over a 300-ms interval (a late sample), 2 MB in 100 ms
    sampler.samples = [(10.0, 0), (10.1, 1_000_000), (10.4, 4_000_000), (10.5, 6_000_000)]
    assert sampler.within(10.0, 10.5) == {"bytes": 6_000_000, "peak_bytes_per_period": 2_000_000}
    assert sampler.within(10.0, 10.4)["peak_bytes_per_period"] == 1_000_000
