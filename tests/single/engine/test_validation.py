"""Configuration values refused before any work starts, each with what was wrong, what was
expected and how to fix it: none passes silently or fails late."""

import math

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, on_threads

from tfsync import _env, _horovod
from tfsync.engine import SyncEngine
from tfsync.engine.settings import EngineSettings
from tfsync.policies import resolve
from tfsync.stragglers import Stragglers

pytestmark = pytest.mark.usefixtures("engines_on_localhost")


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "0", "-3", "1e400"])
def test_a_wait_bound_from_the_environment_must_be_finite_and_positive(monkeypatch, raw):
    monkeypatch.setenv(_env.WAIT_TIMEOUT_S.name, raw)
    with pytest.raises(ValueError, match=f"TFSYNC_WAIT_TIMEOUT_S='{raw}'.*finite, positive.*pass e.g. 120"):
        _env.wait_timeout_s()


@pytest.mark.parametrize("value", [math.inf, math.nan, 0, -1.0, True, "10"])
def test_a_wait_bound_argument_must_be_a_finite_positive_number(value):
    with pytest.raises(ValueError, match="wait_timeout_s=.*finite, positive number of seconds"):
        _env.wait_timeout_s(value)


def test_a_wait_bound_may_be_any_finite_positive_number():
    assert _env.wait_timeout_s(np.float64(2.5)) == 2.5 and _env.wait_timeout_s(3) == 3.0


@pytest.mark.parametrize("raw", ["yes", "true", "2", "on"])
def test_single_process_takes_only_0_or_1(monkeypatch, raw):
    monkeypatch.setenv(_env.SINGLE_PROCESS.name, raw)
    with pytest.raises(ValueError, match=f"TFSYNC_SINGLE_PROCESS='{raw}': expected 1 .* or 0"):
        _horovod.horovod()


def _start_on_fake(size, tensors, **settings):
    cluster = FakeCluster(size, timeout_s=10.0)
    engines = [
        SyncEngine(resolve("bsp"), EngineSettings(wait_timeout_s=5.0, **settings), cluster=cluster.rank(r))
        for r in range(size)
    ]

    def run(engine):
        engine.start(tensors)
        engine.close()

    return on_threads([lambda e=e: run(e) for e in engines], 30.0)[1]


def test_a_slow_rank_the_job_does_not_have_is_refused_at_start():
    errors = _start_on_fake(2, [tf.Variable(np.zeros(3, np.float32))], stragglers=Stragglers(slow_ranks={2: 0.1}))
    for err in errors:
        assert isinstance(err, ValueError) and "slow ranks [2]" in str(err) and "2 workers" in str(err), err


def test_a_trainable_variable_that_is_not_floating_point_is_refused_at_start():
    tensors = [tf.Variable(np.zeros(3, np.float32)), tf.Variable(np.zeros(2, np.int32), name="counter")]
    errors = _start_on_fake(2, tensors)
    for err in errors:
        assert isinstance(err, TypeError) and "counter" in str(err) and "int32" in str(err), err
        assert "floating point" in str(err) and "trainable=False" in str(err)


@pytest.mark.parametrize("frontend", ["callback", "strategy"])
def test_a_frontend_given_a_setting_it_does_not_take_names_the_settings_it_takes(frontend):
    # the settings are declared once (EngineSettings); a frontend's misspelt keyword is refused
    # there, naming every setting it takes, before anything starts
    import tfsync

    build = tfsync.keras.SyncCallback if frontend == "callback" else tfsync.distribute.SyncStrategy
    with pytest.raises(TypeError, match=r"unexpected keyword argument wait_timeout; .*wait_timeout_s, on_nonfinite"):
        build("bsp", cluster=FakeCluster(1).rank(0), wait_timeout=5)


def test_the_frontends_settings_reach_the_engine_as_given():
    import tfsync

    sync = tfsync.keras.SyncCallback("bsp", cluster=FakeCluster(1).rank(0), wait_timeout_s=7, on_nonfinite="raise")
    assert sync.frontend.settings.wait_timeout_s == 7.0 and sync.frontend.settings.on_nonfinite == "raise"
    assert not sync.frontend.settings.elastic
