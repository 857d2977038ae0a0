"""``compression=`` on every mode class, and the launcher's ``--compression``: taken, described,
and a bad value refused with what was wrong, what is expected and how to fix it."""

import argparse

import pytest

import tfsync
from tfsync.launch import add_mode_arguments, check_mode_args, mode_from_args
from tfsync.policies import Policy, registry


def every_mode_class():
    return [m.cls for m in registry.modes()]


def test_every_built_in_mode_is_registered_here():
    # (so the tests below cover every mode: a new one must take compression= too)
    names = {cls.__name__ for cls in every_mode_class()}
    assert {"BSP", "SSP", "DSSP", "ElasticBSP", "PSP", "BackupWorkers", "DCS3GD", "LocalSGD", "DiLoCo"} <= names


@pytest.mark.parametrize("cls", every_mode_class(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_every_mode_takes_compression_and_says_so_in_its_config(cls, compression):
    policy = cls(compression=compression)
    assert policy.compression == compression
    assert policy.config()["compression"] == compression
    assert cls().compression is None and cls().config()["compression"] is None
    assert policy != cls()  # (the ranks compare configs: a rank that compresses differently is caught)
    assert f"compression={compression}" in registry.describe(policy)


@pytest.mark.parametrize("cls", every_mode_class(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("bad", ["int8", "FP16", "float16", 16, True])
def test_a_bad_compression_is_refused_naming_the_allowed_values(cls, bad):
    with pytest.raises(ValueError) as info:
        cls(compression=bad)
    message = str(info.value)
    assert f"{cls.__name__}(compression={bad!r})" in message  # what was wrong
    assert "None" in message and "'fp16'" in message and "'bf16'" in message  # what is expected
    assert f"tfsync.{cls.__name__}(compression='fp16')" in message  # how to fix it
    assert "quantize" not in message


def test_compression_is_a_keyword_so_positional_settings_keep_their_places():
    assert tfsync.SSP(5, compression="fp16").staleness == 5
    with pytest.raises(TypeError):
        tfsync.BSP("fp16")


def test_a_users_mode_inherits_compression():
    class Mine(Policy):
        name, payload = "mine", "gradients"

        def required_round(self, step):
            return step

    assert Mine(compression="bf16").config()["compression"] == "bf16"
    with pytest.raises(ValueError, match="Mine\\(compression='int8'\\)"):
        Mine(compression="int8")


def test_auto_gives_its_compression_to_the_modes_that_set_none():
    auto = tfsync.Auto(compression="fp16", modes={"straggler": tfsync.PSP(compression="bf16")})
    assert auto.initial.compression == "fp16"
    assert auto.modes["none"].compression == "fp16"
    assert auto.modes["jitter"].compression == "fp16"
    assert auto.modes["straggler"].compression == "bf16"  # (its own)
    assert tfsync.Auto().initial.compression is None
    with pytest.raises(ValueError, match="Auto\\(compression='int4'\\)"):
        tfsync.Auto(compression="int4")


def parse(argv):
    parser = add_mode_arguments(argparse.ArgumentParser())
    args = parser.parse_args(argv)
    return parser, args


@pytest.mark.parametrize("mode", [m.name for m in registry.modes()])
def test_the_launchers_compression_flag_reaches_every_mode(mode):
    parser, args = parse(["--mode", mode, "--compression", "fp16"])
    assert check_mode_args(parser, args).compression == "fp16"
    _, args = parse(["--mode", mode])
    assert mode_from_args(args).compression is None


def test_the_launchers_compression_flag_reaches_auto_mode():
    _, args = parse(["--mode", "auto", "--compression", "bf16"])
    assert mode_from_args(args).initial.compression == "bf16"


def test_a_bad_compression_flag_stops_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        parse(["--mode", "bsp", "--compression", "int8"])
    err = capsys.readouterr().err
    assert "--compression" in err and "'fp16'" in err and "'bf16'" in err
