"""Every tool's list of modes is the registry's (auto included), and the simulator plays each
mode as its registration says: no tool keeps a list of its own (no training)."""

import argparse

import numpy as np
import pytest

from tfsync import launch, simulate
from tfsync.bench import convergence, digits, training
from tfsync.policies import BSP, DSSP, ElasticBSP, registry, resolve_mode, switching


class Every2(BSP):
    name = "every2"


class Every3(BSP):
    name = "every3"


def test_the_launcher_takes_every_registered_mode_auto_included(registered):
    registry.register("every2", Every2, "every 2")
    names = launch.mode_names()
    assert names == registry.names() and names[-1] == "auto" and "every2" in names
    parser = launch.add_mode_arguments(argparse.ArgumentParser())
    assert launch.mode_from_args(parser.parse_args(["--mode", "every2"])) == Every2()
    assert switching(launch.mode_from_args(parser.parse_args(["--mode", "auto"]))) is registry.get("auto")


def test_the_benches_and_the_example_take_their_modes_from_the_registry():
    every = registry.configurations(switching=True)
    assert digits.MODES == {digits.BASELINE: ["--plain-horovod"], **every}
    assert convergence.STUDY_MODES == ("horovod", *registry.study_configurations(switching=True))
    assert convergence.STUDY_MODES[-1] == "auto"
    per_step = [m.name for m in registry.modes() if m.every_step]
    assert training.DEFAULT_MODES[0] == "horovod" and set(per_step) <= set(training.DEFAULT_MODES)
    assert not {"localsgd", "diloco"} & set(training.DEFAULT_MODES)  # (steps that are not each a contribution)


def test_auto_is_registered_as_the_mode_that_switches():
    auto = registry.get("auto")
    assert auto.switches and auto not in registry.modes() and auto in registry.modes(switching=True)
    assert switching(resolve_mode("auto")) is auto and switching("bsp") is None
    with pytest.raises(ValueError, match="a mode of that name is registered already"):
        registry.register("auto", Every2, "auto")


def test_the_simulator_plays_each_mode_as_registered(registered):
    assert simulate.simulation(DSSP()) == "grants" and simulate.simulation(ElasticBSP()) == "supersteps"
    assert simulate.simulation(BSP()) == "rounds" and simulate.simulation(Every2()) == "rounds"  # (its parent's)
    registry.register("every2", Every2, "every 2", simulated="rounds")
    assert "every2" in [m.name for m in registry.modes() if m.simulated]
    run = simulate.simulate(Every2(), np.full((2, 4), 0.01))
    assert run["applied"] == 8 and run["mode"] == "every2"
    with pytest.raises(ValueError, match=r"simulated='sometimes'\): expected None or one of"):
        registry.register("every3", Every3, "every 3", simulated="sometimes")
