"""The control path accepts only this job's workers (one process, no Horovod)."""

import logging
import threading
import time

import grpc
import pytest

from tfsync.control import READY_TIMEOUT_S, ControlClient, ControlServer
from tfsync.control import transport as control_transport
from tfsync.control.transport import LINK_METHOD, decode, encode
from tfsync.policies import PSP

TOKEN = "a" * 32


@pytest.fixture
def server():
    server = ControlServer(size=3, t0=time.time(), token=TOKEN)
    yield server
    server.stop()


@pytest.fixture
def raw(server):
    """A plain gRPC channel to the server: ``call(items, metadata)`` sends one message on a link
    carrying whatever metadata a test gives, and returns rank 0's reply to it."""
    channel = grpc.insecure_channel(server.address)
    grpc.channel_ready_future(channel).result(timeout=5)

    def call(items, metadata=None):
        link = channel.stream_stream(LINK_METHOD)(iter([encode(items)]), timeout=5, metadata=metadata)
        return decode(next(link))

    yield call
    channel.close()


def _answer(reply):
    """The payload of the one answer in ``reply``."""
    (answer,) = [item for item in reply if item[0] == "answer"]
    return answer[3]


def _wait_until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_client_with_the_right_token_works(server):
    client = ControlClient(server.address, 1, TOKEN, connect_timeout_s=5)
    try:
        client.report(4, min_interval_s=0)
        assert _wait_until(lambda: client.table()["clocks"][1] == 4)
        table = client.table()
        assert table["lost"] == [] and table["rejected"] == 0
        assert server.rejected == [] and server.rejected_count == 0
    finally:
        client.close()


def test_a_client_with_a_wrong_token_is_refused_quickly(server):
    start = time.monotonic()
    with pytest.raises(PermissionError, match="token was rejected by the control service at") as info:
        ControlClient(server.address, 1, "b" * 32, connect_timeout_s=10)
    assert time.monotonic() - start < 3
    assert server.address in str(info.value) and "horovodrun" in str(info.value)
    assert server.rejected_count == 1 and server.rejected[0]["method"] == LINK_METHOD
    # nothing of the refused Attach was applied: rank 1 is neither attached nor lost
    good = ControlClient(server.address, 0, TOKEN, connect_timeout_s=5)
    try:
        table = good.table()
        assert table["lost"] == [] and table["last_seen_s"][1] == 0
    finally:
        good.close()


def test_a_raw_call_with_a_wrong_token_is_refused_and_not_applied(server, raw, caplog):
    before = _answer(raw([["table", 0, 1]], metadata=[("tfsync-token", TOKEN)]))
    with caplog.at_level(logging.WARNING, logger="tfsync.control"):
        with pytest.raises(grpc.RpcError) as info:
            raw([["report", 2, 9]], metadata=[("tfsync-token", "wrong")])
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "did not match this job" in info.value.details()
    assert server.address in info.value.details()
    after = _answer(raw([["table", 0, 1]], metadata=[("tfsync-token", TOKEN)]))
    assert after["clocks"] == before["clocks"] == [-1, -1, -1]
    assert after["last_seen_s"] == before["last_seen_s"]
    assert after["rejected"] == 1
    assert server.rejected_count == 1
    assert server.rejected[0]["method"] == LINK_METHOD and server.rejected[0]["peer"]
    assert [r.name for r in caplog.records] == ["tfsync.control"]


def test_calls_without_a_token_are_refused(server, raw):
    for items in [
        [["report", 1, 3]],
        [["leave", 1]],
        [["stop", 1, 1, "x", "stray"]],
        [["table", 1, 1]],
    ]:
        with pytest.raises(grpc.RpcError) as info:
            raw(items)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, items
    table = _answer(raw([["table", 0, 1]], metadata=[("tfsync-token", TOKEN)]))
    assert table["clocks"] == [-1, -1, -1] and table["rejected"] == 4
    assert server._stopped == {} and server._left == set()
    assert [r["method"] for r in server.rejected] == [LINK_METHOD] * 4


def test_refusals_are_bounded_and_their_warnings_rate_limited(server, raw, caplog, monkeypatch):
    monkeypatch.setattr(control_transport, "REJECTIONS_KEPT", 3)
    with caplog.at_level(logging.WARNING, logger="tfsync.control"):
        for _ in range(5):
            with pytest.raises(grpc.RpcError):
                raw([["table", 0, 1]], metadata=[("tfsync-token", "wrong")])
    assert server.rejected_count == 5 and len(server.rejected) == 3
    assert len(caplog.records) == 1  # five refusals well within a second: one line


def test_the_server_listens_on_the_given_host():
    server = ControlServer(size=1, t0=0.0, token=TOKEN, host="127.0.0.1")
    try:
        assert server.address == f"127.0.0.1:{server.port}" and server.port > 0
        client = ControlClient(server.address, 0, TOKEN, connect_timeout_s=5)
        client.close()
    finally:
        server.stop()


def test_a_host_that_is_not_this_machine_says_what_to_set():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine
    with pytest.raises(RuntimeError, match="TFSYNC_CONTROL_HOST") as info:
        ControlServer(size=1, t0=0.0, token=TOKEN, host="192.0.2.1")
    assert "192.0.2.1" in str(info.value)


@pytest.mark.parametrize("token", ["", None, b"bytes-token", 123, " padded "])
def test_the_token_must_be_a_non_empty_str(token):
    with pytest.raises(ValueError, match="non-empty str"):
        ControlServer(size=1, t0=0.0, token=token)


def test_close_ends_the_stream_reader_before_the_channel_and_is_idempotent(server, monkeypatch):
    client = ControlClient(server.address, 1, TOKEN, connect_timeout_s=5)
    reader_alive_at_channel_close = []
    channel_close = client._channel.close

    def recording_close():
        reader_alive_at_channel_close.append(client._watcher.is_alive())
        channel_close()

    monkeypatch.setattr(client._channel, "close", recording_close)
    client.close()
    client.close()  # a second close (engine.close's cleanup path) does nothing
    assert reader_alive_at_channel_close == [False]
    assert client.host_lost is None  # leaving is not losing the host
    assert _wait_until(lambda: 1 in server._left)


FLOOD_HELD_CALLS = 8  # per kind of call a worker makes: held links from a stray client
FLOOD_QUICK_CALLS = 200
FLOOD_HOLD_S = 8.0  # the longest a held stray call lasts (its deadline): past READY_TIMEOUT_S


def test_a_flood_of_refused_calls_delays_no_ready_notice():
    # a stray process on the host floods rank 0's control service with calls
    # that carry no token, some of them holding their request back as long as the server lets
    # them (a slow client).  Each worker's Ready notice must still be answered, well before the
    # held calls end, and every round of a PSP run must take every rank (a notice held past
    # push_timeout_s would close the round without that rank: its contribution dropped for
    # lateness).  The timeout leaves a busy machine seconds: held back, a notice would wait for
    # the flood's FLOOD_HOLD_S
    size, rounds, push_timeout_s = 3, 4, 3.0
    server = ControlServer(
        size=size,
        t0=time.time(),
        token=TOKEN,
        host="127.0.0.1",
        policy=PSP(min_contributions=2, push_timeout_s=push_timeout_s),
    )
    clients, held = [], []
    stray = grpc.insecure_channel(server.address)
    release = threading.Event()

    def withheld_request():  # sends nothing until the test ends (bounded)
        release.wait(FLOOD_HOLD_S)
        yield from ()

    try:
        clients = [ControlClient(server.address, r, TOKEN, connect_timeout_s=5) for r in range(size)]
        link = stray.stream_stream(LINK_METHOD)
        held = [link(withheld_request(), timeout=FLOOD_HOLD_S) for _ in range(3 * FLOOD_HELD_CALLS)]
        quick_calls = [
            link(iter([encode([["report", 1, 99]])]), timeout=FLOOD_HOLD_S) for _ in range(FLOOD_QUICK_CALLS)
        ]
        time.sleep(0.5)  # the flood reaches the server
        answered_s = []
        for round_ in range(rounds):
            start = time.monotonic()
            for client in clients:
                client.ready(round_)
            for call in [client._ready_calls[-1] for client in clients]:
                call.result(timeout=READY_TIMEOUT_S + 1)  # raises TimeoutError if held back
            answered_s.append(time.monotonic() - start)
        assert server.closed == [[r, list(range(size))] for r in range(rounds)]
        assert max(answered_s) < push_timeout_s, answered_s
        for call in quick_calls:
            with pytest.raises(grpc.RpcError) as info:
                next(call)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert server.rejected_count >= FLOOD_QUICK_CALLS + len(held)
        assert server._clocks[1] == -1  # nothing of the flood was applied
    finally:
        release.set()
        for call in held:
            call.cancel()
        for client in clients:
            client.close()
        stray.close()
        server.stop()
