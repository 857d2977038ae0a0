"""Fixtures shared by the single-process tests."""

import pytest


@pytest.fixture(scope="module")
def engines_on_localhost():
    """Real engines in one process: rank 0's control service on localhost, and no
    straggler settings picked up from the environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFSYNC_CONTROL_HOST", "localhost")
        mp.delenv("TFSYNC_STRAGGLERS", raising=False)
        yield
