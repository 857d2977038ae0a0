"""Relays of relays: host relays attach to a group relay, which holds one link to rank 0 for them
(one process, no Horovod).

Rank 0's service on 127.0.0.1; rank 0 attaches to it directly; ranks 1-2 and 3-4 are two hosts,
each with its :class:`HostRelay` (in ranks 1's and 3's processes), both attached to a group relay
(in rank 1's process, as the group's first host runs it) whose own link to rank 0 passes a
:class:`TcpProxy` (another host's link, which can flap); rank 0 is each host relay's fallback.
"""

import time
import types

import pytest
from control_helpers import Closes, TcpProxy, rounds, vanish, wait_until

from tfsync.control import RECONNECT_GRACE_S, ControlClient, ControlServer
from tfsync.control.outgoing import REPORT_FLUSH_S
from tfsync.control.relay import HostRelay
from tfsync.control.topology import GROUP_HOSTS, relay_groups, relay_leaders
from tfsync.control.transport import ATTEMPT_S
from tfsync.engine import lifecycle
from tfsync.engine.components import bindings
from tfsync.policies import BackupWorkers

TOKEN = "g" * 32
SIZE = 5
HOSTS = {1: (1, 2), 3: (3, 4)}  # a host relay's rank -> its host's ranks


@pytest.fixture
def job():
    policy = BackupWorkers(backups=0)
    server = ControlServer(
        SIZE, time.time(), TOKEN, host="127.0.0.1", policy=policy, service=bindings.service(policy, SIZE)
    )
    proxy = TcpProxy(server.port)
    group = HostRelay(proxy.address, TOKEN, server.t0)
    relays = {lead: HostRelay(group.address, TOKEN, server.t0, fallback=server.address) for lead in HOSTS}
    closes = [Closes() for _ in range(SIZE)]
    clients = [ControlClient(server.address, 0, TOKEN, connect_timeout_s=5, on_close=closes[0])]
    for lead, ranks in HOSTS.items():
        for rank in ranks:
            clients.append(
                ControlClient(
                    relays[lead].address,
                    rank,
                    TOKEN,
                    connect_timeout_s=5,
                    on_close=closes[rank],
                    fallback=server.address,
                )
            )
    made = types.SimpleNamespace(server=server, proxy=proxy, group=group, relays=relays, clients=clients, closes=closes)
    yield made
    for client in clients:
        if not client._closing:
            client.close()
    for relay in [*relays.values(), group]:
        relay.stop()
    proxy.shutdown()
    server.stop()


def test_the_relays_of_each_eight_hosts_share_a_group_relay_past_eight_hosts():
    hosts = [f"h{rank // 2}" for rank in range(2 * (2 * GROUP_HOSTS + 2))]  # rank 0's host and 17 others
    leaders = relay_leaders(hosts)
    groups = relay_groups(leaders)
    heads = sorted(set(groups.values()))
    assert heads == [2, 2 + 2 * GROUP_HOSTS]  # hosts 1-8, then 9-16; host 17 alone goes to rank 0
    assert all(groups[lead] == 2 for lead in range(2, 2 + 2 * GROUP_HOSTS, 2))
    assert 2 + 4 * GROUP_HOSTS not in groups
    assert relay_groups(relay_leaders(hosts[: 2 * (GROUP_HOSTS + 1)])) == {}  # eight relaying hosts: no groups
    # rank 0's host's other ranks through a relay of their own (rank 1's), once the job is this large
    assert relay_leaders(["a", "a", "a", "b", "b"], home=True) == {1: 1, 2: 1, 3: 3, 4: 3}
    assert relay_leaders(["a", "a", "a", "b", "b"]) == {3: 3, 4: 3}


def test_the_hosts_of_a_group_reach_rank_0_on_one_link(job):
    rounds(job.clients, range(4))
    expected = [(r, tuple(range(SIZE))) for r in range(4)]
    for closes in job.closes:
        assert closes.wait_for(4) == expected
    assert len(job.server._links) == 2  # rank 0's own and the group relay's
    assert job.server.served()["ready"] == SIZE * 4 and job.server.served()["closings"] == 2 * 4
    for rank, client in enumerate(job.clients):
        client.report(20 + rank, min_interval_s=0)
    # clocks go up both relays together, each within its flush interval
    assert wait_until(lambda: job.server._clocks == [20 + r for r in range(SIZE)], 10 * REPORT_FLUSH_S + 2.0)
    assert job.clients[4].table()["clocks"] == [20 + r for r in range(SIZE)]  # (asked through both relays)


def test_a_worker_that_ends_behind_a_group_relay_is_named_at_once(job):
    rounds(job.clients, range(1))
    start = time.monotonic()
    vanish(job.clients[4])
    assert wait_until(lambda: job.clients[0].known_lost, RECONNECT_GRACE_S / 2)
    assert time.monotonic() - start < RECONNECT_GRACE_S / 2  # its host relay saw its process end
    assert [(d["rank"], d["reason"]) for d in job.clients[0].known_lost] == [(4, "its process or connection ended")]


def test_when_the_group_relays_process_ends_its_hosts_relays_go_to_rank_0_and_nothing_is_lost(job):
    rounds(job.clients, range(2))
    start = time.monotonic()
    job.group.stop()
    # each host relay tries its group relay once more (ATTEMPT_S), then rank 0, within the grace
    assert wait_until(lambda: all(r.upstream == job.server.address and r.reattached for r in job.relays.values()), 4.0)
    assert time.monotonic() - start < ATTEMPT_S + 2.0
    rounds(job.clients, range(2, 4))
    expected = [(r, tuple(range(SIZE))) for r in range(4)]
    for closes in job.closes:
        assert closes.wait_for(4) == expected
    time.sleep(RECONNECT_GRACE_S + 0.5)  # past the grace: nobody was lost, nothing came twice
    assert job.server._lost == {} and all(c.host_lost is None for c in job.clients)
    assert all(closes.seen == expected for closes in job.closes)


def test_a_host_whose_relays_link_to_the_group_relay_ends_is_named_after_the_grace(job):
    # host 3's relay and workers end together (the host went away): across hosts, rank 0 cannot
    # tell that from a flap, so its ranks are named lost once the grace passes, not at once
    rounds(job.clients, range(1))
    for client in job.clients[3:]:
        client._closing = True  # (they go with their host: no leave, no re-attach)
    start = time.monotonic()
    job.relays[3].stop()
    assert wait_until(lambda: len(job.clients[0].known_lost) == 2, RECONNECT_GRACE_S + 3.0)
    assert time.monotonic() - start >= RECONNECT_GRACE_S - 0.5
    lost = job.clients[0].known_lost
    assert sorted(d["rank"] for d in lost) == [3, 4]
    assert all("did not re-attach within" in d["reason"] for d in lost)
    assert job.clients[1].table()["lost"] == lost  # (the group's other host is told too)


def test_a_group_relays_link_down_for_two_seconds_loses_nothing(job):
    rounds(job.clients, range(2))
    job.proxy.cut("drop")
    time.sleep(2.0)
    job.proxy.restore()
    rounds(job.clients, range(2, 4))
    expected = [(r, tuple(range(SIZE))) for r in range(4)]
    for closes in job.closes:
        assert closes.wait_for(4) == expected
    time.sleep(0.3)
    assert all(closes.seen == expected for closes in job.closes)
    assert job.server._lost == {} and job.group.reattached == 1


class _Engine:
    """What :func:`tfsync.engine.lifecycle.open_control` reads of an engine and sets on it."""

    def __init__(self, rank, hosts):
        self.rank, self.size, self.hosts = rank, len(hosts), hosts
        self.t0, self.wait_timeout_s = time.time(), 20.0
        self.policy = BackupWorkers(backups=0)
        self.life = lifecycle.Life(self)


def test_a_large_jobs_ranks_start_group_relays_and_attach_through_them(monkeypatch):
    # rank 0's host and 9 hosts of 2: hosts 1 to 8 form a group (its relay in rank 2's process),
    # host 9 is left alone and its relay attaches to rank 0; rank 0's host's other rank attaches
    # directly (a relay needs several)
    from fake_cluster import FakeCluster, on_threads

    from tfsync.control.address import ControlAddress

    monkeypatch.setenv("TFSYNC_CONTROL_HOST", "127.0.0.1")
    monkeypatch.setattr(lifecycle, "choose_relay_address", lambda: ControlAddress("127.0.0.1", "127.0.0.1", "test"))
    monkeypatch.setattr(lifecycle, "leave_at_exit", lambda engine: None)
    hosts = ["h0", "h0"] + [f"h{rank // 2}" for rank in range(2, 20)]
    cluster = FakeCluster(len(hosts))
    engines = [_Engine(rank, hosts) for rank in range(len(hosts))]
    results, errors = on_threads(
        [lambda e=e: lifecycle.open_control(e, cluster.rank(e.rank)) for e in engines], timeout_s=60
    )
    clients = []
    try:
        assert errors == [None] * len(hosts), errors
        server = engines[0].life.server
        group = engines[2].life.relays[1]
        # rank 2 runs its host's relay and the group's; each other host's first rank its host's
        assert [len(e.life.relays) for e in engines] == [0, 0, 2] + [int(r % 2 == 0) for r in range(3, 20)]
        assert engines[2].life.relays[0].upstream == group.address  # (host 1's own relay, behind the group's)
        assert all(engines[r].life.relays[0].upstream == group.address for r in range(4, 18, 2))
        assert engines[18].life.relays[0].upstream == server.address  # (host 9: no group of its own)
        for rank, (address, fallback, token) in enumerate(results):
            leader = rank - rank % 2
            assert address == (server.address if rank < 2 else engines[leader].life.relays[0].address)
            assert fallback == (None if rank < 2 else server.address)
            clients.append(ControlClient(address, rank, token, connect_timeout_s=10, fallback=fallback))
        rounds(clients, range(2))
        assert server.closed == [[r, list(range(len(hosts)))] for r in range(2)]
        assert len(server._links) == 4  # ranks 0 and 1, the group relay, host 9's relay
    finally:
        for client in clients:
            client.close()
        for engine in engines:
            engine.life.release()
