"""Fixtures shared by the single-process tests."""

import pytest
import tensorflow as tf

# N ranks on threads of one process run N compiled train steps at once, each blocked in a
# tf.py_function until its peers' round arrives while the engine runs compiled functions of
# its own: more inter-op threads than the two TensorFlow gives a two-core machine (one process
# per rank under horovodrun has a pool per rank).  Before any op creates the runtime.
tf.config.threading.set_inter_op_parallelism_threads(16)


@pytest.fixture(scope="module")
def engines_on_localhost():
    """Real engines in one process: rank 0's control service on localhost, and no
    straggler settings picked up from the environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFSYNC_CONTROL_HOST", "localhost")
        mp.delenv("TFSYNC_STRAGGLERS", raising=False)
        yield


@pytest.fixture
def registered(monkeypatch):
    """A copy of the mode registry that a test may add to (the real one is left as it was)."""
    from tfsync.policies import registry

    monkeypatch.setattr(registry, "_MODES", dict(registry._MODES))
