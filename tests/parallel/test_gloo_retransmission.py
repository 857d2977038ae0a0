"""Horovod's Gloo connections cap TCP's retransmission timeout (``third_party/horovod``, hunk 14):
a collective resumes within a second of its link's return instead of at TCP's doubled timeout."""

import socket

import pytest

from tests.parallel.launch import results_of
from tfsync._horovod import TCP_RTO_MAX_MS

pytestmark = pytest.mark.parallel


def _kernel_caps():
    with socket.socket() as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, 1000)
        except OSError:
            return False
    return True


def _kernel_default_ms():
    with open("/proc/sys/net/ipv4/tcp_rto_max_ms") as f:
        return int(f.read())


@pytest.mark.skipif(not _kernel_caps(), reason="TCP_RTO_MAX_MS needs Linux 6.15 or newer")
@pytest.mark.parametrize("setting,expected", [(None, 1000), ("5000", 5000), ("0", None)])
def test_gloo_connections_cap_the_retransmission_timeout(tmp_path, monkeypatch, setting, expected):
    if setting is None:
        monkeypatch.delenv("HOROVOD_TFSYNC_TCP_RTO_MAX_MS", raising=False)
    else:
        monkeypatch.setenv("HOROVOD_TFSYNC_TCP_RTO_MAX_MS", setting)
    results = results_of("gloo_rto.py", 2, tmp_path, timeout_s=120)
    ends = [{tuple(c["local"]) for c in results[rank]["connections"]} for rank in (0, 1)]
    between = [c for c in results[0]["connections"] if tuple(c["peer"]) in ends[1]]
    assert between, results  # (Gloo's pairs: rank 0's connections to rank 1)
    assert results[0]["setting_ms"] == (expected or 0), results[0]  # (what tfsync reads it as)
    caps = {c["rto_max_ms"] for c in between}
    assert caps == {expected if expected is not None else _kernel_default_ms()}, between
