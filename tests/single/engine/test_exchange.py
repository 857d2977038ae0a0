"""The round exchange and the control path, in one process (no Horovod)."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfsync.control import STOP_CALL_TIMEOUT_S, STOP_NOTICE_GRACE_S, ControlClient, ControlServer
from tfsync.engine.diagnosis import Diagnosis, SyncTimeoutError
from tfsync.engine.exchange import INLINE_WATCH_S, RoundExchange
from tfsync.engine.rounds import WorkerLostError
from tfsync.engine.wire.layout import decode_meta, encode_meta

TOKEN = "t" * 32


def _doubling(payload, meta):
    """A fake two-rank allreduce where both ranks contributed the same."""
    return [p * 2 for p in payload], meta * 2


def _exchange(fn=None, rank=1, size=3):
    return RoundExchange(fn or _doubling, rank=rank, size=size, t0=100.0)


def test_an_inline_round_that_outlasts_its_bound_is_aborted_and_named():
    # BSP runs its round on the training thread; a peer whose process lives but whose training
    # thread is stuck would hold it in Horovod forever: the watchdog aborts the collective
    released, aborted, waits = threading.Event(), [], []

    def stuck(payload, meta, divisor=None):
        released.wait(30.0)
        raise RuntimeError("Horovod has been shut down")

    def abort():
        aborted.append(time.monotonic())
        released.set()

    ex = RoundExchange(stuck, rank=0, size=2, t0=0.0, abort=abort)
    ex.on_inline_wait = lambda: waits.append(time.monotonic())
    try:
        start = time.monotonic()
        ex.submit(0, [np.ones(3, np.float32)], 0.0, 0.0, inline=True, timeout_s=2.5)
        assert ex.inline_expired == 0 and len(aborted) == 1
        assert 2.5 <= aborted[0] - start < 2.5 + INLINE_WATCH_S + 1.0
        assert waits, "it reported its clock while it waited, as a polling wait does"
        with pytest.raises(RuntimeError, match="shut down"):
            ex.wait(0, timeout_s=1.0)
    finally:
        ex.close()


def test_an_inline_round_within_its_bound_is_not_aborted():
    aborted = []
    ex = RoundExchange(_doubling_any, rank=0, size=2, t0=0.0, abort=lambda: aborted.append(1))
    try:
        for r in range(3):
            ex.submit(r, [np.ones(3, np.float32)], 0.0, 0.0, inline=True, timeout_s=1.0)
        time.sleep(1.0 + 2 * INLINE_WATCH_S)  # the watchdog looked again after every bound
        assert ex.completed == 2 and aborted == [] and ex.inline_expired is None and ex.error is None
    finally:
        ex.close()


def _doubling_any(payload, meta, divisor=None):
    return _doubling(payload, meta)


def test_rounds_complete_in_order_with_metadata():
    ex = _exchange()
    for r in range(5):
        ex.submit(
            r,
            [np.full(4, r, np.float32), np.full((2, 2), -r, np.float32)],
            push_time=100.0 + r + 0.123456789,
            compute_s=0.5,
        )
    assert ex.wait(4, timeout_s=5)
    res = ex.pop(3)
    assert res.round == 3 and ex.completed == 4
    np.testing.assert_array_equal(res.total[0], np.full(4, 6.0))  # the fake allreduce doubles
    np.testing.assert_array_equal(res.total[1], np.full((2, 2), -6.0))
    np.testing.assert_array_equal(res.contribution[0], np.full(4, 3.0))  # this rank's own payload
    assert res.present.tolist() == [0.0, 2.0, 0.0]  # only this rank's row is filled
    assert res.steps[1] == 6.0
    assert res.push_times[1] / 2 == pytest.approx(103.123456789, abs=1e-9)  # float64 metadata
    ex.close()


def test_wait_times_out_and_errors_reach_the_waiter():
    gate = threading.Event()
    ex = _exchange(lambda payload, meta: (gate.wait(), (payload, meta))[1])
    ex.submit(0, [np.zeros(2, np.float32)], 0.0, 0.0)
    assert ex.wait(0, timeout_s=0.2) is False
    gate.set()
    assert ex.wait(0, timeout_s=5)
    ex.close()

    def broken(payload, meta):
        raise ConnectionResetError("peer gone")

    ex = _exchange(broken)
    ex.submit(0, [np.zeros(2, np.float32)], 0.0, 0.0)
    with pytest.raises(ConnectionResetError, match="peer gone"):
        ex.wait(0, timeout_s=5)


def test_calls_run_after_queued_rounds_on_the_same_thread():
    seen = []
    ex = _exchange(lambda payload, meta: (seen.append(("round", threading.current_thread().name)), (payload, meta))[1])
    ex.submit(0, [np.zeros(1, np.float32)], 0.0, 0.0)
    name = ex.call(lambda: threading.current_thread().name, timeout_s=5)
    assert seen == [("round", name)] and name == "tfsync-exchange"
    ex.close()


@pytest.fixture
def control():
    server = ControlServer(size=3, t0=time.time(), token=TOKEN)
    clients = [ControlClient(f"localhost:{server.port}", r, TOKEN) for r in range(3)]
    yield server, clients
    for c in clients:
        if not c._closing:
            c.close()
    server.stop()


def test_control_path_reports_clocks_quickly(control):
    server, clients = control
    clients[2].report(7, min_interval_s=0)
    deadline = time.time() + 5
    while clients[0].table()["clocks"][2] != 7 and time.time() < deadline:
        time.sleep(0.01)
    start = time.perf_counter()
    for _ in range(20):
        table = clients[0].table()
    per_query_ms = (time.perf_counter() - start) / 20 * 1e3
    print(f"control path: {per_query_ms:.2f} ms per table query")
    assert table["clocks"] == [-1, -1, 7] and table["lost"] == []


def test_a_worker_that_vanishes_is_named_to_every_other(control):
    server, clients = control
    victim = clients[1]
    victim._closing = True
    victim._stream.cancel()  # connection gone without a Leave: a crash, as seen by rank 0
    deadline = time.time() + 5
    while not clients[2].known_lost and time.time() < deadline:
        time.sleep(0.01)
    assert [d["rank"] for d in clients[2].known_lost] == [1]
    assert [d["rank"] for d in clients[0].table()["lost"]] == [1]


def test_a_worker_that_leaves_is_not_lost_and_stop_reasons_are_pushed(control):
    server, clients = control
    clients[1].close()
    clients[2].announce_stop("SyncTimeoutError", "waited too long for rank 0")
    deadline = time.time() + 5
    while not clients[0].known_stopped and time.time() < deadline:
        time.sleep(0.01)
    assert clients[0].known_stopped[0]["message"] == "waited too long for rank 0"
    assert clients[0].table()["lost"] == []


def test_a_stop_call_returns_once_every_worker_has_read_the_notice(control):
    # the stopping rank may exit as soon as Stop answers (rank 0's connections then reset and
    # can take an unread message with them): by then every other worker holds the reason
    server, clients = control
    clients[0].announce_stop("SyncTimeoutError", "rank 0 waited 5 s for round 8; ranks [2] have not pushed it")
    for client in clients[1:]:
        assert [n["rank"] for n in client.known_stopped] == [0], client.rank
    # it answered because every worker confirmed, not because the grace period ran out
    assert server._stops_seen == {0: 1, 1: 1, 2: 1}


def test_a_worker_that_never_confirms_holds_a_stop_call_only_for_the_grace_period(control, monkeypatch):
    server, clients = control
    monkeypatch.setattr(clients[1], "_confirm_stops", lambda count: None)
    start = time.monotonic()
    clients[2].announce_stop("WorkerLostError", "lost rank 1")
    held_s = time.monotonic() - start
    assert STOP_NOTICE_GRACE_S - 0.1 <= held_s < STOP_CALL_TIMEOUT_S, held_s
    assert clients[0].known_stopped and clients[1].known_stopped  # rank 1 read it, it only never said so


def test_a_rank_that_stops_for_a_peers_reason_says_so_before_it_exits(control):
    # rank 1 timed out on hung rank 2 and said so; rank 0 stops for that reason and exits.
    # Rank 0's exit must be explained to the ranks still waiting, or they report "lost
    # rank 0" instead of the hung rank (its exit races the notice of the reason)
    server, clients = control
    clients[1].announce_stop("SyncTimeoutError", "rank 1 waited 5 s for round 8; ranks [2] have not pushed it")
    diagnosis = Diagnosis(clients[0], rank=0, mode_name="ssp", wait_timeout_s=5, timeout_env="TFSYNC_WAIT_TIMEOUT_S")
    with pytest.raises(SyncTimeoutError, match=r"rank 1 stopped the job: .*ranks \[2\]"):
        diagnosis.check_while_waiting(8, last_pushed=10, deadline=time.monotonic() + 60)
    assert [n["rank"] for n in clients[2].known_stopped] == [1, 0]  # announced, and read, before raising
    clients[0]._closing = True
    clients[0]._stream.cancel()  # rank 0's exit
    deadline = time.time() + 5
    while not clients[2].known_lost and time.time() < deadline:
        time.sleep(0.01)
    waiting = Diagnosis(clients[2], rank=2, mode_name="ssp", wait_timeout_s=5, timeout_env="TFSYNC_WAIT_TIMEOUT_S")
    with pytest.raises(SyncTimeoutError, match=r"rank 1 stopped the job: .*ranks \[2\]"):
        waiting.check_while_waiting(8, last_pushed=10, deadline=time.monotonic() + 60)


def test_a_rank_that_stops_and_exits_is_reported_by_its_reason_not_as_lost(control):
    # rank 2's wait for rank 1 timed out: it tells everyone why, then its process ends.  The
    # others must name the hung rank 1 (rank 2's reason), not "lost rank 2" (the exit races the reason).
    server, clients = control
    clients[2].announce_stop("SyncTimeoutError", "rank 2 waited 5 s for round 10; ranks [1] have not pushed it")
    clients[2]._closing = True
    clients[2]._stream.cancel()
    deadline = time.time() + 5
    while not (clients[0].known_lost and clients[0].known_stopped) and time.time() < deadline:
        time.sleep(0.01)
    assert [d["rank"] for d in clients[0].known_lost] == [2]  # its connection did end
    diagnosis = Diagnosis(clients[0], rank=0, mode_name="ssp", wait_timeout_s=5, timeout_env="TFSYNC_WAIT_TIMEOUT_S")
    with pytest.raises(SyncTimeoutError, match=r"rank 2 stopped the job: .*ranks \[1\] have not pushed it"):
        diagnosis.check_while_waiting(10, last_pushed=10, deadline=time.monotonic() + 60)
    error = diagnosis.lost_error(10, RuntimeError("allreduce failed"))
    assert isinstance(error, SyncTimeoutError) and "ranks [1]" in str(error), error
    # a loss with no stop notice is still a loss
    clients[1]._closing = True
    clients[1]._stream.cancel()
    while len(clients[0].known_lost) < 2 and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(WorkerLostError, match=r"lost rank 1 \(its process or connection ended"):
        diagnosis.check_while_waiting(10, last_pushed=10, deadline=time.monotonic() + 60)


def test_unreachable_control_host_reads_as_rank_0_lost():
    server = ControlServer(size=2, t0=0.0, token=TOKEN)
    client = ControlClient(f"localhost:{server.port}", 1, TOKEN)
    server.stop()
    deadline = time.time() + 5
    while client.host_lost is None and time.time() < deadline:
        time.sleep(0.01)
    assert client.table(timeout_s=0.5)["lost"][0]["rank"] == 0
    client.close()


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 64), data=st.data())
def test_metadata_survives_a_sum_and_a_mean_exactly(size, data):
    rank = data.draw(st.integers(0, size - 1))
    step = data.draw(st.integers(0, 2**31 - 1))
    push_us = data.draw(st.integers(0, 2**47))
    compute_us = data.draw(st.integers(0, 2**40))
    late, late_step = data.draw(st.sampled_from([(0.0, 0), (1.0, step), (1.0, max(step - 3, 0))]))
    rejected = data.draw(st.sampled_from([0.0, 1.0]))
    fields = data.draw(st.sampled_from([4, 6, 7]))  # rows may leave the late and rejected fields out
    meta = np.zeros((size, fields))
    meta[rank] = (1.0, step, push_us / 1e6, compute_us / 1e6, late, late_step, rejected)[:fields]
    wire = encode_meta(meta)
    # the collective: every other rank's wire block is zeros; Horovod's mean multiplies by 1/size in float32
    mean = (wire.astype(np.float32) * np.float32(1.0 / size)).astype(np.float32)
    for received, is_mean in ((wire, False), (mean, True)):
        out = decode_meta(received, size, mean=is_mean)
        assert out[rank, 0] == 1.0 and out[rank, 1] == step
        assert round(out[rank, 2] * 1e6) == push_us and round(out[rank, 3] * 1e6) == compute_us
        assert tuple(out[rank, 4:6]) == ((late, late_step) if fields >= 6 else (0.0, 0.0))
        assert out[rank, 6] == (rejected if fields == 7 else 0.0)
        assert np.count_nonzero(np.delete(out, rank, axis=0)) == 0


def test_inline_rounds_never_overtake_queued_work():
    order, gate = [], threading.Event()

    def collective(payload, meta):
        order.append(("round", payload[0][0], threading.current_thread().name))
        return payload, meta

    ex = _exchange(collective)
    blocker = threading.Thread(target=lambda: ex.call(lambda: (gate.wait(5), order.append(("call",)))[0], 10))
    blocker.start()
    deadline = time.time() + 5
    while ex._unfinished == 0 and time.time() < deadline:
        time.sleep(0.001)
    ex.submit(0, [np.zeros(1, np.float32)], 0.0, 0.0, inline=True)  # queued behind the call
    gate.set()
    assert ex.wait(0, timeout_s=5)
    blocker.join(5)
    ex.submit(1, [np.ones(1, np.float32)], 0.0, 0.0, inline=True)  # idle: runs on this thread
    assert ex.wait(1, timeout_s=5)
    assert order == [("call",), ("round", 0.0, "tfsync-exchange"), ("round", 1.0, threading.current_thread().name)]
    ex.close()
