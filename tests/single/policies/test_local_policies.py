"""Local SGD's and DiLoCo's settings (:mod:`tfsync.policies.local`): pure, no training."""

import argparse

import keras
import pytest

import tfsync
from tfsync import demo, launch
from tfsync.bench import convergence, network
from tfsync.policies import registry, resolve


def parsed(*argv):
    p = argparse.ArgumentParser()
    launch.add_mode_arguments(p)
    args = p.parse_args(argv)
    launch.check_mode_args(p, args)
    return launch.mode_from_args(args)


def test_the_string_names_resolve_to_the_defaults():
    assert resolve("localsgd") == tfsync.LocalSGD(period=8)
    assert resolve("diloco") == tfsync.DiLoCo(inner_steps=8)
    assert tfsync.LocalSGD().required_round(5) == tfsync.DiLoCo().sync_round(5) == 5  # an outer step waits for its own


def test_diloco_defaults_to_the_papers_outer_optimizer():
    settings = tfsync.DiLoCo().outer_optimizer_config["config"]
    assert settings == {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}
    assert registry.describe(tfsync.DiLoCo()) == "diloco(H=8, outer=SGD(lr=0.7, nesterov 0.9))"
    assert registry.describe(tfsync.LocalSGD(period=4)) == "localsgd(H=4)"


def test_a_keras_outer_optimizer_is_kept_as_plain_configuration():
    mode = tfsync.DiLoCo(inner_steps=4, outer_optimizer=keras.optimizers.Adam(0.1))
    config = mode.config()
    assert config["outer_optimizer"]["class_name"] == "Adam"
    assert "name" not in config["outer_optimizer"]["config"]  # (numbered per process)
    same = tfsync.DiLoCo(inner_steps=4, outer_optimizer=keras.optimizers.Adam(0.1))
    assert mode == same and hash(mode) == hash(same)
    assert mode != tfsync.DiLoCo(inner_steps=4)


def test_the_launcher_flags_build_the_policies():
    assert parsed("--mode", "localsgd", "--period", "3") == tfsync.LocalSGD(period=3)
    diloco = parsed("--mode", "diloco", "--inner-steps", "5", "--outer-lr", "1.0", "--outer-momentum", "0")
    assert diloco.inner_steps == 5
    assert diloco.outer_optimizer_config["config"] == {"learning_rate": 1.0, "momentum": 0.0, "nesterov": False}
    assert parsed("--mode", "diloco").outer_optimizer_config == tfsync.DiLoCo().outer_optimizer_config
    streaming = parsed("--mode", "diloco", "--overlap-steps", "2", "--mixing", "0.5")
    assert (streaming.overlap_steps, streaming.mixing) == (2, 0.5)
    assert registry.describe(streaming) == "diloco(H=8, outer=SGD(lr=0.7, nesterov 0.9), tau=2, alpha=0.5)"


def test_the_overlapped_push_waits_for_the_previous_round_only():
    assert tfsync.DiLoCo(overlap_steps=2).sync_round(5) == 4  # (its own lands overlap_steps later)
    assert tfsync.DiLoCo().sync_round(5) == 5


def test_a_flag_of_another_mode_is_refused(capsys):
    with pytest.raises(SystemExit):
        parsed("--mode", "bsp", "--period", "4")
    assert "--period" in capsys.readouterr().err


def test_the_demo_the_study_and_the_network_bench_take_the_modes():
    assert {"localsgd", "diloco"} <= set(demo.DEMO_MODES) and {"localsgd", "diloco"} <= set(convergence.STUDY_MODES)
    args = network.parse_args(["--modes", "horovod", "localsgd", "diloco", "diloco+overlap"])
    assert args.modes == ["horovod", "localsgd", "diloco", "diloco+overlap"]
    assert registry.configurations()["diloco+overlap"] == ["--mode", "diloco", "--overlap-steps", "2"]
    assert parsed(*registry.configurations()["diloco+overlap"]) == tfsync.DiLoCo(overlap_steps=2)


def test_the_timeline_labels_diloco_by_its_outer_optimizer_class_and_rate():
    from tfsync import timeline

    label = timeline.mode_label(tfsync.DiLoCo(inner_steps=4).config())
    assert label == (
        "DILOCO (inner_steps=4, outer_optimizer=SGD(lr=0.7), overlap_steps=0, mixing=0.0, quantize=None, fragments=1)"
    )


@pytest.mark.parametrize(
    "make,error",
    [
        (lambda: tfsync.DiLoCo(fragments=0), r"fragments=0\): fragments must be an int from 1 to inner_steps"),
        (lambda: tfsync.DiLoCo(inner_steps=4, fragments=5), r"fragments=5\)"),
        (
            lambda: tfsync.DiLoCo(inner_steps=8, fragments=4, overlap_steps=2),
            r"overlap_steps must be an int >= 0 and below inner_steps // fragments = 2",
        ),
    ],
)
def test_bad_fragments_are_refused_saying_what_fits(make, error):
    with pytest.raises(ValueError, match=error):
        make()


def test_fragments_describe_and_launch():
    mode = tfsync.DiLoCo(inner_steps=8, fragments=4, overlap_steps=1)
    assert registry.describe(mode) == "diloco(H=8, outer=SGD(lr=0.7, nesterov 0.9), tau=1, P=4)"
    assert mode.config()["fragments"] == 4 and mode != tfsync.DiLoCo(inner_steps=8, overlap_steps=1)
