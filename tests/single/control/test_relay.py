"""A host's relay carries its workers' control traffic on one link to rank 0 (one process, no Horovod).

Rank 0's service on 127.0.0.1; rank 0 attaches to it directly (its host), ranks 1 to 3 through
a :class:`HostRelay`, whose own link to rank 0 passes a :class:`TcpProxy` (its connections come
from 127.0.0.2: another host, whose link can flap).  Rank 1 stands for the relay's worker: the
relay runs in its process.
"""

import threading
import time
import types

import pytest
from control_helpers import Closes, TcpProxy, rounds, vanish, wait_until

from tfsync.control import (
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    RECONNECT_GRACE_S,
    ControlClient,
    ControlServer,
)
from tfsync.control import outgoing as outgoing_module
from tfsync.control.outgoing import REPORT_FLUSH_S
from tfsync.control.relay import HostRelay
from tfsync.control.topology import relay_leaders
from tfsync.engine.components import bindings
from tfsync.policies import DSSP, BackupWorkers

TOKEN = "r" * 32
SIZE = 4
STAYS_DOWN_BOUND_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1e3 + RECONNECT_GRACE_S + 2.0


def _job(policy=None):
    policy = policy or BackupWorkers(backups=0)
    server = ControlServer(
        SIZE, time.time(), TOKEN, host="127.0.0.1", policy=policy, service=bindings.service(policy, SIZE)
    )
    proxy = TcpProxy(server.port)
    relay = HostRelay(proxy.address, TOKEN, server.t0)
    closes = [Closes() for _ in range(SIZE)]
    clients = [ControlClient(server.address, 0, TOKEN, connect_timeout_s=5, on_close=closes[0])]
    for rank in range(1, SIZE):
        clients.append(
            ControlClient(
                relay.address,
                rank,
                TOKEN,
                connect_timeout_s=5,
                on_close=closes[rank],
                fallback=server.address,
                relay_owner=None if rank == 1 else 1,
            )
        )
    return types.SimpleNamespace(server=server, proxy=proxy, relay=relay, clients=clients, closes=closes)


@pytest.fixture
def job():
    made = _job()
    yield made
    _end(made)


def _end(job):
    for client in job.clients:
        if not client._closing:
            client.close()
    job.relay.stop()
    job.proxy.shutdown()
    job.server.stop()


def test_the_ranks_that_attach_through_a_relay_are_the_other_hosts_with_several():
    assert relay_leaders(["a", "a", "b", "b", "b", "c", "d", "d"]) == {2: 2, 3: 2, 4: 2, 6: 6, 7: 6}
    assert relay_leaders(["a"] * 4) == {}  # one host, rank 0's: every rank attaches directly


def test_the_workers_of_a_host_reach_rank_0_on_one_link(job):
    rounds(job.clients, range(5))
    expected = [(r, (0, 1, 2, 3)) for r in range(5)]
    for closes in job.closes:
        assert closes.wait_for(5) == expected
    assert job.server.closed == [[r, [0, 1, 2, 3]] for r in range(5)]
    assert len(job.server._links) == 2  # rank 0's own and the relay's
    served = job.server.served()
    # every notice reached rank 0; each closing went down each of the two links once
    assert served["ready"] == 4 * 5 and served["closings"] == 2 * 5
    assert all(not c._local for c in job.clients[1:]) and job.clients[0]._local
    for rank, client in enumerate(job.clients):
        client.report(10 + rank, min_interval_s=0)
    # the relay sends its workers' clocks together, within its flush interval
    assert wait_until(lambda: job.server._clocks == [10, 11, 12, 13], 5 * REPORT_FLUSH_S + 2.0)
    assert job.clients[2].table()["clocks"] == [10, 11, 12, 13]


def test_a_hosts_ready_notices_reach_rank_0_in_one_message(monkeypatch):
    monkeypatch.setattr(outgoing_module, "READY_HOLD_S", 30.0)  # (held until the host's last notice)
    made = _job()
    try:
        rounds(made.clients, [0])  # (every link attached and used)
        before = made.server.served()
        for client in made.clients[:3]:  # rank 0 (direct) and two of the relay's three
            client.ready(1)
        made.clients[0]._ready_calls[-1].result(timeout=5)
        time.sleep(0.3)
        assert made.server.served()["ready"] == before["ready"] + 1  # the relay holds ranks 1 and 2
        made.clients[3].ready(1)
        assert made.closes[3].wait_for(2) == [(0, (0, 1, 2, 3)), (1, (0, 1, 2, 3))]
        after = made.server.served()
        assert after["ready"] == before["ready"] + 4
        assert after["messages_in"] == before["messages_in"] + 2  # rank 0's notice, and the host's three in one
    finally:
        _end(made)


def test_a_held_ready_notice_goes_after_the_hold_without_the_hosts_last_worker(monkeypatch):
    monkeypatch.setattr(outgoing_module, "READY_HOLD_S", 1.0)
    made = _job(BackupWorkers(backups=1))
    try:
        start = time.monotonic()
        for client in made.clients[:3]:
            client.ready(0)
        # rank 3 never sends: the round closes with the others once the hold is over
        assert made.closes[0].wait_for(1) == [(0, (0, 1, 2))]
        assert time.monotonic() - start >= 1.0
    finally:
        _end(made)


def test_a_worker_that_ends_on_the_relays_host_is_named_at_once(job):
    start = time.monotonic()
    vanish(job.clients[2])
    assert wait_until(lambda: job.clients[0].known_lost, RECONNECT_GRACE_S / 2)
    assert time.monotonic() - start < RECONNECT_GRACE_S / 2  # its host's relay saw its process end
    assert [(d["rank"], d["reason"]) for d in job.clients[0].known_lost] == [(2, "its process or connection ended")]
    assert wait_until(lambda: [d["rank"] for d in job.clients[3].known_lost] == [2], 2.0)


def test_when_the_relays_process_ends_its_workers_re_attach_to_rank_0_and_name_it_alone_lost(job):
    rounds(job.clients, range(2))
    job.relay.stop()  # rank 1's process ends: its relay and its own link with it
    vanish(job.clients[1])
    assert wait_until(lambda: job.clients[2].reattached and job.clients[3].reattached, RECONNECT_GRACE_S)
    assert job.clients[2].address == job.clients[3].address == job.server.address
    # its workers found the relay's port closed on their host and said so: rank 1 is named for
    # that, not when the grace a link across hosts gets has passed (a cut link's: below)
    assert wait_until(lambda: job.clients[0].known_lost, RECONNECT_GRACE_S + 2.0)
    assert [d["rank"] for d in job.clients[0].known_lost] == [1]
    assert "the host relay it ran stopped listening" in job.clients[0].known_lost[0]["reason"]
    survivors = [job.clients[0], job.clients[2], job.clients[3]]
    job.server._policy = BackupWorkers(backups=1)  # (three live ranks of four: the rounds close without rank 1)
    rounds(survivors, range(2, 4))
    for rank in (0, 2, 3):
        assert [c[0] for c in job.closes[rank].wait_for(4)] == [0, 1, 2, 3]
    assert job.clients[2].host_lost is None and job.clients[3].host_lost is None


@pytest.mark.parametrize("how", ["drop", "stall"])
def test_a_relays_link_down_for_two_seconds_loses_nothing(job, how):
    rounds(job.clients, range(2))
    job.proxy.cut(how)
    # what rank 0 tells every worker while the relay's link is down (its workers' notices
    # reach rank 0 once it is back: the rounds close then)
    stop = threading.Thread(target=job.clients[0].announce_stop, args=("SyncTimeoutError", "made while it was down"))
    stop.start()
    time.sleep(2.0)
    job.proxy.restore()
    stop.join(5.0)
    rounds(job.clients, range(2, 4))
    expected = [(r, (0, 1, 2, 3)) for r in range(4)]
    for closes in job.closes:
        assert closes.wait_for(4) == expected
    time.sleep(0.3)  # nothing is delivered twice
    assert all(closes.seen == expected for closes in job.closes)
    assert all(len(c.known_stopped) == 1 for c in job.clients)
    assert job.server._lost == {} and all(c.host_lost is None for c in job.clients)
    assert job.relay.reattached == (1 if how == "drop" else 0)


def test_a_host_whose_link_to_rank_0_stays_down_is_named_after_the_grace(job):
    # the relay's link to rank 0 stays down: rank 0 names every worker of its host lost once
    # the grace passes without a re-attach, as it would each worker's own link; the relay gives
    # up then too, and tells its workers (each then tries rank 0 itself, once)
    rounds(job.clients, range(1))
    cut = time.monotonic()
    job.proxy.cut("drop")
    assert wait_until(lambda: len(job.clients[0].known_lost) == 3, RECONNECT_GRACE_S + 2.0)
    assert time.monotonic() - cut >= RECONNECT_GRACE_S - 0.5
    assert sorted(d["rank"] for d in job.clients[0].known_lost) == [1, 2, 3]
    assert all("did not re-attach within" in d["reason"] for d in job.clients[0].known_lost)
    assert wait_until(lambda: job.relay.host_lost is not None, 2.0)
    assert wait_until(lambda: all(c._relay_gone for c in job.clients[1:]), 2.0)


def test_a_worker_that_reaches_rank_0_neither_way_reports_it_unreachable():
    # its host cut off from rank 0's: the relay's link and the worker's own way to rank 0
    made = _job()
    direct = TcpProxy(made.server.port)
    far = ControlClient(made.relay.address, 3, TOKEN, connect_timeout_s=5, fallback=direct.address)
    try:
        made.clients[3].close()
        made.clients[3] = far
        cut_wall = time.time()
        made.proxy.cut("drop")
        direct.cut("drop")
        assert wait_until(lambda: far.host_lost is not None, STAYS_DOWN_BOUND_S + 2.0)
        assert far.host_lost - cut_wall <= STAYS_DOWN_BOUND_S + 2.0
        assert far.table(timeout_s=0.5)["lost"][0]["rank"] == 0
    finally:
        direct.shutdown()
        _end(made)


def test_a_stop_is_answered_once_the_workers_behind_the_relay_read_it(job):
    start = time.monotonic()
    job.clients[3].announce_stop("SyncTimeoutError", "rank 3 waited 5 s for round 8")
    assert time.monotonic() - start < 1.5  # every worker confirmed: no grace waited out
    assert all(
        c.known_stopped == [{"rank": 3, "kind": "SyncTimeoutError", "message": "rank 3 waited 5 s for round 8"}]
        for c in job.clients
    )


def test_the_policys_service_answers_the_workers_behind_the_relay():
    made = _job(DSSP(low=1, high=3))
    try:
        for rank, client in enumerate(made.clients):
            client.tell("pushed", step=rank)
        reply = made.clients[2].ask("grant", step=5, room=2)
        assert "extra" in reply and reply["counts"][2] == 6, reply
        assert made.server.served()["tells"] == 4 and made.server.served()["asks"] == 1
    finally:
        _end(made)
