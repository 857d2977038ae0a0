"""Policies are pure functions of clocks: checked without Horovod or TensorFlow."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tfsync
from tfsync.policies import BSP, PSP, SSP, BackupWorkers, resolve


def test_strings_resolve_to_policies():
    assert resolve("bsp") == BSP()
    assert resolve(" SSP ") == SSP(staleness=3)
    policy = SSP(staleness=5)
    assert resolve(policy) is policy
    assert resolve("psp") == PSP() and resolve("Backup") == BackupWorkers(backups=1)
    partial = PSP(min_contributions=2, push_timeout_s=0.0)
    assert resolve(partial) is partial


@pytest.mark.parametrize("bad", ["asp", "", None, 3, "backups", "psp1"])
def test_unknown_mode_names_the_accepted_values(bad):
    with pytest.raises(
        ValueError,
        match=r"unknown synchronization mode .*'bsp', 'ssp', 'dssp', 'elasticbsp', 'psp', "
        r"'backup'.*tfsync.SSP\(staleness=3\)",
    ):
        resolve(bad)


@pytest.mark.parametrize("cls", [PSP, BackupWorkers])
def test_partial_policy_class_instead_of_instance_says_how_to_fix(cls):
    with pytest.raises(TypeError, match=rf"pass an instance, e.g. mode=tfsync.{cls.__name__}\(\)"):
        resolve(cls)


def test_policy_class_instead_of_instance_says_how_to_fix():
    with pytest.raises(TypeError, match=r"pass an instance, e.g. mode=tfsync.SSP\(\)"):
        resolve(SSP)


def test_negative_staleness_is_refused():
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        SSP(staleness=-1)


@pytest.mark.parametrize("bad", [1.5, "3", True])
def test_non_integer_staleness_is_refused(bad):
    with pytest.raises(TypeError, match="staleness must be an int"):
        SSP(staleness=bad)


def test_policies_are_immutable_and_describe_themselves():
    policy = SSP(staleness=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.staleness = 4
    assert policy.config() == {"mode": "ssp", "staleness": 2, "compression": None}
    assert BSP().config() == {"mode": "bsp", "compression": None}
    assert (BSP().payload, SSP().payload) == ("gradients", "updates")


@given(st.integers(0, 10_000))
def test_bsp_waits_for_the_round_of_the_step_itself(step):
    assert BSP().required_round(step) == step


@given(st.integers(0, 10_000), st.integers(0, 50))
def test_ssp_gate_bounds_the_clock_gap(step, staleness):
    # before computing `step` a worker needs round step-s-1, i.e. every worker
    # has pushed step-s-1 and so is at clock >= step-s: the gap is at most s.
    need = SSP(staleness=staleness).required_round(step)
    assert step - (need + 1) == staleness


def test_ssp0_gates_where_bsp_does():
    # SSP(0) needs round c-1 before computing c; BSP needs round c-1 applied
    # before computing c too (it applies round c-1 at the end of step c-1).
    for step in range(5):
        assert SSP(staleness=0).required_round(step + 1) == BSP().required_round(step)


def test_public_api_exports():
    assert tfsync.SSP is SSP and tfsync.BSP is BSP
    assert tfsync.PSP is PSP and tfsync.BackupWorkers is BackupWorkers
    assert callable(tfsync.Stragglers.parse)
