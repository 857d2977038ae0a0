"""The multi-host harness for this directory's tests (:mod:`hosts`): two simulated hosts, made once."""

import pytest

from tfsync.bench.hosts import Hosts


@pytest.fixture(scope="module")
def two_hosts():
    with Hosts(2) as hosts:
        yield hosts
