"""Rank 0's round coordinator (PSP, backup workers) in :class:`ControlServer`, over gRPC on
localhost.  Every wait is bounded, so a bug fails instead of hanging."""

import time

import pytest
from control_helpers import Closes

from tfsync.control import ControlClient, ControlServer
from tfsync.policies import BSP, PSP, SSP, BackupWorkers, Closing, DelayCompensation, Policy

TOKEN = "p" * 32
WAIT_S = 10.0  # bound of every wait in this file: far above what a passing test needs


@pytest.fixture
def coordinated():
    """``start(policy, size)`` -> (server, clients, closes); everything stopped afterwards."""
    made = []

    def start(policy, size=3, attach=None):
        server = ControlServer(size=size, t0=time.time(), token=TOKEN, policy=policy)
        made.append(server)
        closes = [Closes() for _ in range(size)]
        clients = []
        for r in range(size) if attach is None else attach:
            clients.append(ControlClient(server.address, r, TOKEN, connect_timeout_s=WAIT_S, on_close=closes[r]))
            made.append(clients[-1])
        return server, clients, closes

    yield start
    for thing in reversed(made):
        if isinstance(thing, ControlClient):
            if not thing._closing:
                thing.close()
        else:
            thing.stop()


def ready(client, round_):
    """``client.ready`` is fire-and-forget; here the notice has reached rank 0 on return."""
    client.ready(round_)
    client._ready_calls[-1].result(timeout=WAIT_S)


def _closed(server, n):
    deadline = time.monotonic() + WAIT_S
    while len(server.closed) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return server.closed


def test_psp_coordinator_closes_rounds_in_order_and_ignores_late_notices(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=2, push_timeout_s=0.0))
    ready(clients[0], 0)
    ready(clients[2], 0)
    assert _closed(server, 1) == [[0, [0, 2]]]
    ready(clients[1], 0)  # late: round 0 closed without it
    ready(clients[0], 1)
    time.sleep(0.3)  # had the late notice counted towards round 1, c = 2 would close it now
    assert server.closed == [[0, [0, 2]]]
    ready(clients[2], 1)
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 2]]]
    ready(clients[1], 2)
    ready(clients[0], 2)
    assert _closed(server, 3) == [[0, [0, 2]], [1, [0, 2]], [2, [0, 1]]]
    want = [(0, (0, 2)), (1, (0, 2)), (2, (0, 1))]
    for c in closes:  # every worker hears of every closing, once, in order
        assert c.wait_for(3) == want
    time.sleep(0.1)
    assert [c.seen for c in closes] == [want] * 3


def test_psp_coordinator_waits_for_the_push_timeout_and_takes_who_came_meanwhile(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=1, push_timeout_s=0.5))
    start = time.time()
    ready(clients[1], 0)
    ready(clients[2], 0)  # within τ1 of the first: it counts
    assert _closed(server, 1) == [[0, [1, 2]]]
    assert time.time() - start >= 0.45  # not before τ1 after the c-th contribution
    assert closes[0].wait_for(1) == [(0, (1, 2))]


@pytest.mark.parametrize("policy", [PSP(min_contributions=1, push_timeout_s=0.3), BackupWorkers(backups=0)])
def test_a_closing_that_took_every_rank_goes_down_the_streams_only_when_someone_needs_it(coordinated, policy):
    # PSP's ready ranks enter on their own (enters_when_ready): a round that took every rank
    # has nobody to move, so its closing is kept on rank 0 but not sent; backup workers'
    # ranks follow the closings (or their answers), so every closing goes out
    server, clients, closes = coordinated(policy, size=2)
    ready(clients[0], 0)
    ready(clients[1], 0)  # round 0: both
    ready(clients[0], 1)
    ready(clients[1], 1)  # round 1: both
    assert _closed(server, 2) == [[0, [0, 1]], [1, [0, 1]]]
    if policy.enters_when_ready:
        ready(clients[0], 2)  # round 2: rank 1 is late (τ1 passes); the closing moves it
        assert _closed(server, 3)[2] == [2, [0]]
        want = [(2, (0,))]
    else:
        want = [(0, (0, 1)), (1, (0, 1))]
    for c in closes:
        assert c.wait_for(len(want)) == want
    time.sleep(0.2)
    assert [c.seen for c in closes] == [want] * 2


def test_psp_coordinator_counts_an_early_notice_once_its_round_is_the_oldest_open(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=2, push_timeout_s=0.0))
    ready(clients[1], 1)  # for round 1, while round 0 is open
    ready(clients[0], 0)
    time.sleep(0.2)
    assert server.closed == []  # round 0 has one contribution, round 1's does not count
    ready(clients[2], 0)
    ready(clients[0], 1)
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 1]]]


def test_backup_coordinator_takes_the_first_arrivals(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1))
    ready(clients[2], 0)
    ready(clients[0], 0)
    assert _closed(server, 1) == [[0, [0, 2]]]
    ready(clients[1], 0)  # the backup's contribution: ignored, not kept for later rounds
    ready(clients[1], 1)
    time.sleep(0.3)
    assert server.closed == [[0, [0, 2]]]
    ready(clients[2], 1)
    ready(clients[0], 1)  # third to arrive: round 1 closed with the first two
    assert _closed(server, 2) == [[0, [0, 2]], [1, [1, 2]]]
    for c in closes:
        assert c.wait_for(2) == [(0, (0, 2)), (1, (1, 2))]


def test_a_worker_that_attaches_late_hears_every_earlier_closing_in_order(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1), attach=(0, 1))
    for r in range(3):
        ready(clients[r % 2], r)
        ready(clients[(r + 1) % 2], r)
    assert len(_closed(server, 3)) == 3
    late = ControlClient(server.address, 2, TOKEN, connect_timeout_s=WAIT_S, on_close=closes[2])
    try:
        assert closes[2].wait_for(3) == [(0, (0, 1)), (1, (0, 1)), (2, (0, 1))]
    finally:
        late.close()


@pytest.mark.parametrize("policy", [None, BSP(), SSP(staleness=1)])
def test_uncoordinated_policies_have_no_coordinator(coordinated, policy):
    server, clients, closes = coordinated(policy, size=2)
    assert not hasattr(server, "_coordinator")
    for c in clients:
        ready(c, 0)
    time.sleep(0.3)
    assert server.closed == [] and [c.seen for c in closes] == [[], []]


class _Broken(Policy):
    name, payload, coordinated = "broken", "gradients", True

    def required_round(self, step):
        return step

    def close_round(self, ready, opened_s, now_s, size):
        raise ZeroDivisionError("bad rule")


def test_a_failing_policy_stops_the_job_with_its_reason(coordinated):
    server, clients, closes = coordinated(_Broken(), size=2)
    deadline = time.monotonic() + WAIT_S
    while not clients[1].known_stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    (stopped,) = clients[1].known_stopped
    assert "_Broken.close_round failed on round 0: ZeroDivisionError: bad rule" in stopped["message"]
    assert server.closed == []


class _AcceptsTheAbsent(_Broken):
    def close_round(self, ready, opened_s, now_s, size):
        return Closing(tuple(range(size)) if ready else None)  # every rank, whoever is ready


def test_a_policy_that_accepts_a_rank_that_is_not_ready_stops_the_job(coordinated):
    # every replica would divide the round's sum by a count that includes an absent rank
    server, clients, closes = coordinated(_AcceptsTheAbsent(), size=2)
    ready(clients[0], 0)
    deadline = time.monotonic() + WAIT_S
    while not clients[1].known_stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    (stopped,) = clients[1].known_stopped
    assert "_AcceptsTheAbsent.close_round accepted [0, 1] with ranks [0] ready" in stopped["message"]
    assert "(not ready: [1])" in stopped["message"] and server.closed == []


def answer(client, round_):
    """The coordinator's answer to a ready notice: 1 if the round takes the contribution for
    certain (the worker enters at once), 0 if the worker follows the closing."""
    client.ready(round_)
    return client._ready_calls[-1].result(timeout=WAIT_S)["accepted"]


def test_psp_coordinator_tells_every_rank_ready_for_the_open_round_that_it_counts(coordinated):
    server, clients, closes = coordinated(PSP(min_contributions=2, push_timeout_s=0.0))
    assert answer(clients[1], 1) == 0  # not the oldest open round: it follows the closing
    assert answer(clients[0], 0) == 1  # open: PSP takes every rank ready when it closes
    assert answer(clients[2], 0) == 1  # the c-th: closes round 0 with it
    assert answer(clients[1], 0) == 0  # late: closed without it
    assert _closed(server, 1)[0] == [0, [0, 2]]
    assert answer(clients[0], 1) == 1  # closes round 1 with rank 1's early notice
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 1]]]


def test_backup_coordinator_tells_the_first_n_and_only_them(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1))
    assert [answer(clients[k], 0) for k in (2, 0, 1)] == [1, 1, 0]
    assert _closed(server, 1) == [[0, [0, 2]]]


class _ClosesOnTwo(_Broken):
    def close_round(self, ready, opened_s, now_s, size):
        return Closing(tuple(r for r, _ in ready)) if len(ready) >= 2 else Closing()


def test_a_policy_that_does_not_promise_to_accept_the_ready_gets_no_early_entries(coordinated):
    server, clients, closes = coordinated(_ClosesOnTwo(), size=3)
    assert answer(clients[0], 0) == 0  # open, but the policy made no promise
    assert answer(clients[1], 0) == 1  # its notice closed the round with it
    assert _closed(server, 1) == [[0, [0, 1]]]


class _BreaksItsPromise(_Broken):
    accepts_ready = True

    def close_round(self, ready, opened_s, now_s, size):
        return Closing((ready[-1][0],)) if len(ready) >= 2 else Closing()  # not the first ready rank


def test_a_policy_that_breaks_its_promise_to_accept_the_ready_stops_the_job(coordinated):
    # rank 0 entered the round's allreduce on the promise: a closing without it cannot be run
    server, clients, closes = coordinated(_BreaksItsPromise(), size=2)
    assert answer(clients[0], 0) == 1
    answer(clients[1], 0)
    deadline = time.monotonic() + WAIT_S
    while not clients[1].known_stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    (stopped,) = clients[1].known_stopped
    assert "_BreaksItsPromise.close_round accepted [1] on round 0 but ranks [0] were told" in stopped["message"]
    assert server.closed == []


def test_coordinator_takes_a_late_offer_only_into_the_open_round(coordinated):
    server, clients, closes = coordinated(BackupWorkers(backups=1, compensate=DelayCompensation()))
    ready(clients[2], 0)
    ready(clients[0], 0)
    assert _closed(server, 1) == [[0, [0, 2]]]
    assert not clients[1].join_late(0)  # round 0 is closed: refused
    assert clients[1].join_late(1) and clients[1].join_late(1)  # round 1 is open: taken (once)
    assert not clients[1].join_late(2)  # not the open round
    ready(clients[0], 1)
    time.sleep(0.2)
    assert server.closed == [[0, [0, 2]]]  # an extra: it does not count toward N = 2
    ready(clients[2], 1)
    assert _closed(server, 2) == [[0, [0, 2]], [1, [0, 2], [1]]]
    for c in closes:
        assert c.wait_for(2) == [(0, (0, 2)), (1, (0, 2), (1,))]
