"""A worker's link to rank 0 that flaps or stays down (one process, a TCP proxy, no Horovod).

:class:`TcpProxy` (threads and sockets on 127.0.0.1) stands between a
:class:`ControlClient` and the :class:`ControlServer`.  Its upstream connections
come from 127.0.0.2, so rank 0 takes that worker for one on another host: a
worker on rank 0's own host has no link that could drop, and its stream's end is
its process's (named at once).
"""

import threading
import time
import types

import pytest
from control_helpers import Closes, TcpProxy, wait_until

from tfsync.control import (
    CONNECT_ATTEMPT_MS,
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    RECONNECT_BACKOFF_MS,
    RECONNECT_GRACE_S,
    ControlClient,
    ControlServer,
)
from tfsync.control import link as link_module
from tfsync.control.client import ControlUnreachableError
from tfsync.engine.diagnosis import LOSS_SETTLE_S, Diagnosis
from tfsync.engine.rounds import WorkerLostError
from tfsync.policies import PSP

TOKEN = "c" * 32
FLAP_S = 2.0  # the outage a job must survive (docs/guide/faults.md)
# a dead link: unanswered keepalive, then the grace, plus slack for a loaded machine
STAYS_DOWN_BOUND_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1e3 + RECONNECT_GRACE_S + 2.0


@pytest.fixture
def job():
    """Rank 0's server on 127.0.0.1 under PSP(min_contributions=1, push_timeout_s=0):
    rank 0's ready notice alone closes a round, so every closing goes down every stream.
    Ranks 0 and 2 attach directly (rank 0's host), rank 1 through a :class:`TcpProxy`."""
    server = ControlServer(
        size=3, t0=time.time(), token=TOKEN, host="127.0.0.1", policy=PSP(min_contributions=1, push_timeout_s=0.0)
    )
    link = TcpProxy(server.port)
    closes = [Closes() for _ in range(3)]
    clients = []
    try:
        for rank, address in ((0, server.address), (1, link.address), (2, server.address)):
            clients.append(ControlClient(address, rank, TOKEN, connect_timeout_s=5, on_close=closes[rank]))
        yield types.SimpleNamespace(server=server, link=link, clients=clients, closes=closes)
    finally:
        link.shutdown()
        for client in clients:
            if not client._closing:
                client.close()
        server.stop()


def _close_rounds(client, rounds):
    for round_ in rounds:
        client.ready(round_)
        client._ready_calls[-1].result(timeout=5)


def _vanish(client):
    """The client's process ends without a word: its connection closes, no Leave."""
    client._closing = True
    client._stream.cancel()


@pytest.mark.parametrize("how", ["drop", "stall"])
def test_a_link_down_for_two_seconds_loses_no_worker_and_no_notice(job, how):
    # drop: every connection reset and new ones refused (rank 1 re-attaches); stall: nothing
    # passes (no keepalive may trip).  Either way nobody is lost, and the closings and the
    # stop notice made meanwhile reach rank 1 afterwards, each closing once and in order
    near, far = job.clients[0], job.clients[1]
    _close_rounds(near, range(2))
    assert job.closes[1].wait_for(2) == [(0, (0,)), (1, (0,))]
    job.link.cut(how)
    cut_at = time.monotonic()
    if how == "drop":
        assert wait_until(lambda: near.table()["detached"] == [1], FLAP_S)  # rank 0 saw the stream end
    _close_rounds(near, range(2, 4))
    # (held until every attached rank confirms it, or STOP_NOTICE_GRACE_S: off the clock)
    stop = threading.Thread(
        target=near.announce_stop, args=("SyncTimeoutError", "a notice made while rank 1's link was down")
    )
    stop.start()
    time.sleep(max(cut_at + FLAP_S - time.monotonic(), 0.0))
    job.link.restore()
    stop.join(5.0)
    assert wait_until(lambda: len(far.known_stopped) == 1, RECONNECT_GRACE_S)
    _close_rounds(near, [4])
    expected = [(r, (0,)) for r in range(5)]
    assert job.closes[1].wait_for(5) == expected
    time.sleep(0.3)  # nothing is delivered twice
    assert job.closes[1].seen == expected and job.closes[2].seen == expected
    assert far.host_lost is None and near.known_lost == [] and job.server._lost == {}
    assert near.table()["lost"] == [] and near.table()["detached"] == []
    assert far.table()["lost"] == []
    assert far.reattached == job.server.reattached[1] == (1 if how == "drop" else 0)
    assert wait_until(lambda: job.server._stops_seen.get(1) == 1, 2.0)  # it confirmed the notice


@pytest.mark.parametrize("how", ["drop", "stall"])
def test_a_link_that_stays_down_is_named_within_a_bound(job, how):
    # drop: rank 0 sees the stream end at once and waits the grace; stall: keepalive
    # notices the dead link first.  Both ends then name it: rank 0 records rank 1
    # lost (pushed to the others), rank 1 reports rank 0 unreachable
    near, far = job.clients[0], job.clients[1]
    job.link.cut(how)
    cut_at, cut_wall = time.monotonic(), time.time()
    assert wait_until(lambda: near.known_lost, STAYS_DOWN_BOUND_S + 2.0)
    named_s = time.monotonic() - cut_at
    assert RECONNECT_GRACE_S - 0.5 <= named_s <= (RECONNECT_GRACE_S + 2.0 if how == "drop" else STAYS_DOWN_BOUND_S)
    assert [d["rank"] for d in near.known_lost] == [1]
    assert "did not re-attach within" in near.known_lost[0]["reason"]
    diagnosis = Diagnosis(near, rank=0, mode_name="psp", wait_timeout_s=60, timeout_env="TFSYNC_WAIT_TIMEOUT_S")
    with pytest.raises(WorkerLostError, match=r"lost rank 1 \(its connection to rank 0 ended"):
        diagnosis.check_while_waiting(3, last_pushed=3, deadline=time.monotonic() + 60)
    assert wait_until(lambda: far.host_lost is not None, STAYS_DOWN_BOUND_S)
    assert far.host_lost - cut_wall <= STAYS_DOWN_BOUND_S
    assert far.table(timeout_s=0.5)["lost"][0]["rank"] == 0


def test_a_worker_on_rank_0s_host_is_named_at_once_and_one_on_another_after_the_grace(job):
    # a process that dies closes its connection at once; on rank 0's host nothing else can
    # end its stream, so it is named at once.  Across hosts a dropped connection looks the
    # same to rank 0 as a dead process (gRPC's server API gives no reason for a stream's
    # end): that worker is named once the grace passes without a re-attach
    near, far, local = job.clients
    start = time.monotonic()
    _vanish(local)
    assert wait_until(lambda: near.known_lost, 2.0), "a local worker's end waited for the grace"
    assert time.monotonic() - start < RECONNECT_GRACE_S / 2
    assert [(d["rank"], d["reason"]) for d in near.known_lost] == [(2, "its process or connection ended")]
    start = time.monotonic()
    _vanish(far)
    assert wait_until(lambda: len(near.known_lost) == 2, RECONNECT_GRACE_S + 2.0)
    assert time.monotonic() - start >= RECONNECT_GRACE_S - 0.5
    assert [d["rank"] for d in near.known_lost] == [2, 1]


def test_the_timing_constants_keep_their_order():
    # a 2 s outage, then a reconnection attempt at most RECONNECT_BACKOFF_MS[1] later that
    # takes at most CONNECT_ATTEMPT_MS, fits in the grace
    assert FLAP_S + (RECONNECT_BACKOFF_MS[1] + CONNECT_ATTEMPT_MS) / 1e3 < RECONNECT_GRACE_S
    # TCP's retransmission backoff (200 ms doubling: 0.2, 0.6, 1.4, 3.0 s) delivers a ping
    # caught by a 2 s outage about 3 s after the outage began: keepalive must wait longer
    assert KEEPALIVE_TIMEOUT_MS / 1e3 > 3.0
    # a survivor whose collective failed waits LOSS_SETTLE_S for the lost rank's name: a
    # worker on another host is named after the grace, so the grace must end first
    assert RECONNECT_GRACE_S + 0.5 <= LOSS_SETTLE_S


def test_a_worker_that_closes_while_its_link_is_down_sends_no_leave(job):
    # as in an elastic reset: rank 0 has closed its service, and a worker whose link broke closes
    # its client while it re-attaches; a leave could be answered only after a re-attach (it waited
    # out CALL_TIMEOUT_S), and rank 0 names the worker on its own
    far = job.clients[1]
    job.link.cut("drop")
    assert wait_until(lambda: far._broken, RECONNECT_GRACE_S)
    sent, send = [], far._send
    far._send = lambda item: (sent.append(item), send(item))
    far.close()
    assert [item for item in sent if item[0] == "leave"] == []
    assert far._channel_closed


def test_a_worker_that_closes_for_an_elastic_reset_sends_no_leave(job):
    # in an elastic reset every member closes and rank 0 closes its service: a leave's answer,
    # through a host relay whose own link to rank 0 had ended, never came, and the worker waited
    # out CALL_TIMEOUT_S while its peers waited for it in the next rendezvous
    far = job.clients[1]
    sent, send = [], far._send
    far._send = lambda item: (sent.append(item), send(item))
    far.close(leave=False)
    assert sent == [] and far._channel_closed
    far.close()  # idempotent: nothing more
    assert sent == []


@pytest.mark.parametrize("elastic", [False, True])
def test_an_elastic_worker_announces_its_stop_without_waiting_for_the_answer(job, elastic):
    # an elastic worker resets rather than exits: its exit cannot read as a loss, so it need not
    # wait until the others have read its notice; where its link went with the lost peer (its
    # host's relay, rank 0) the answer never came, and it waited STOP_CALL_TIMEOUT_S while its
    # peers waited for it in the next rendezvous.  The notice still goes out (it speeds their reset)
    near, far = job.clients[0], job.clients[1]
    job.link.cut("stall")
    waited, request = [], far._request

    def recording(*args):
        future = request(*args)
        result = future.result
        future.result = lambda timeout=None: (waited.append(args[0]), result(timeout))[1]
        return future

    far._request = recording
    diagnosis = Diagnosis(far, rank=1, mode_name="bsp", wait_timeout_s=60, timeout_env="T", elastic=elastic)
    error = WorkerLostError("tfsync: lost rank 2 (a test)")
    stopping = threading.Thread(target=diagnosis.stop, args=(error,))
    stopping.start()
    stopping.join(10.0)
    assert not stopping.is_alive()
    assert waited == ([] if elastic else ["stop"])
    job.link.restore()
    assert wait_until(lambda: [n["rank"] for n in near.known_stopped] == [1], RECONNECT_GRACE_S + 2.0)


def test_a_first_attach_where_nothing_listens_any_more_gives_up_at_once():
    # a worker gets the address once the service listens: a refusal means the service closed
    # (rank 0 killed, or reset, while the engines started), and waiting out the bound only held
    # the worker's reset while its peers waited for it in the next rendezvous
    server = ControlServer(size=2, t0=time.time(), token=TOKEN, host="127.0.0.1")
    address = server.address
    server.stop()
    with pytest.raises(ControlUnreachableError, match=r"nothing listens at 127\.0\.0\.1:\d+ any more"):
        ControlClient(address, 1, TOKEN, connect_timeout_s=60)


def test_a_link_whose_service_closed_reports_rank_0_unreachable_without_waiting_out_the_grace(monkeypatch):
    # the service closed (rank 0 reset or exited): nothing listens at the worker's address any
    # more and no re-attach can get through; with a grace of a minute, it still says so at once
    monkeypatch.setattr(link_module, "RECONNECT_GRACE_S", 60.0)
    server = ControlServer(size=2, t0=time.time(), token=TOKEN, host="127.0.0.1")
    link = TcpProxy(server.port)  # (from another address: not on rank 0's host, so it re-attaches)
    client = ControlClient(link.address, 1, TOKEN, connect_timeout_s=5)
    try:
        assert not client.job_went_on()
        link.shutdown()
        server.stop()
        assert wait_until(lambda: client.host_lost is not None, 10.0), "it waited for the grace"
        assert client.job_went_on() and client.table(timeout_s=0.5)["lost"][0]["rank"] == 0
    finally:
        client.close()


def test_a_first_attach_over_a_link_that_answers_nothing_waits_out_its_bound():
    # a link down (nothing answers, nothing refuses) may come back within the bound
    server = ControlServer(size=2, t0=time.time(), token=TOKEN, host="127.0.0.1")
    link = TcpProxy(server.port)
    try:
        link.cut("stall")
        with pytest.raises(ControlUnreachableError, match=r"within 2 s; check that rank 0 is running"):
            ControlClient(link.address, 1, TOKEN, connect_timeout_s=2)
    finally:
        link.shutdown()
        server.stop()
