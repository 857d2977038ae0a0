"""Every collective outside the rounds has a bound: one rank that does not come stops every rank.

Horovod's collectives block until every rank calls them.  tfsync runs each of
its own (the engine's start and close, the callback's start-of-fit checks and
broadcasts, the epoch logs, auto mode's switch, the statistics at the end, the
strategy's initial values) through :func:`tfsync.engine.bounded.run_bounded`.
Here, on the in-process ranks of :mod:`fake_cluster`, one rank stalls before
one of them (its thread waits until the collective was aborted, then goes on,
as a worker that was far too slow does), and every other rank must raise
``SyncTimeoutError`` at the bound, naming the collective and the stalled rank,
while the stalled rank's own call fails at once saying it came too late.  The
fake's own timeout is longer than the bound, so it is the bound that fires.

The arrival record that names the stalled rank is, in production, Horovod's
Gloo rendezvous store: :class:`tfsync.engine.cluster.RendezvousArrivals` is
tested against a real ``RendezvousServer`` on localhost.
"""

import dataclasses
import os
import socket
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, assert_no_errors, on_threads

import tfsync
from tfsync import _horovod
from tfsync.engine import SyncEngine, SyncTimeoutError, agreement, lifecycle
from tfsync.engine import cluster as cluster_module
from tfsync.engine.bounded import run_bounded
from tfsync.engine.cluster import ARRIVALS_SCOPE, HorovodCluster, RendezvousArrivals
from tfsync.engine.rounds import WorkerLostError
from tfsync.engine.settings import EngineSettings
from tfsync.frontend import Frontend
from tfsync.policies import SSP, resolve
from tfsync.policies.auto import PROFILES
from tfsync.stragglers import Stragglers

# real engines on localhost, without stragglers from the environment (conftest.py)
pytestmark = pytest.mark.usefixtures("engines_on_localhost")

BOUND_S = 1.5  # the wait bound at the collective under test
MARGIN_S = 1.5  # how much later than the bound the abort may come (the watchdog, a busy machine)
FAKE_TIMEOUT_S = 60.0  # the fake's own bound on one collective: far above BOUND_S
STALL_CAP_S = 30.0  # a stalled rank goes on after the abort, or after this at the latest
JOIN_S = 120.0  # one deadline for a job's threads
WIDTH = 4


def stall_until_aborted(fake):
    """A rank far too slow: back only once another rank's bound aborted the job's collectives."""
    deadline = time.monotonic() + STALL_CAP_S
    while fake.aborted_at is None and time.monotonic() < deadline:
        time.sleep(0.02)


def failing_at(fns):
    """Run ``fns`` on threads; per rank ``(error, time.monotonic() when it was raised)``."""

    def timed(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - returned to the test
                return exc, time.monotonic()
            return None, time.monotonic()

        return run

    results, errors = on_threads([timed(fn) for fn in fns], JOIN_S)
    assert_no_errors(errors)
    return results


def check_stopped(fake, results, name, stalled):
    """Every rank but ``stalled`` raised SyncTimeoutError at the bound naming ``name`` and
    ``stalled``; ``stalled``'s own call failed at once, saying it came too late."""
    entered = [t for rank, n, t in fake.entered if n == name and rank != stalled]
    assert entered, f"no rank reached {name!r}: {fake.entered[-5:]}"
    assert fake.aborted_at is not None, "nobody aborted"
    waited = fake.aborted_at - min(entered)
    assert BOUND_S - 0.2 <= waited <= BOUND_S + MARGIN_S, waited
    for rank, (error, at) in enumerate(results):
        assert isinstance(error, SyncTimeoutError), (rank, error)
        message = str(error)
        assert repr(name) in message and "wait_timeout_s" in message, message
        if rank == stalled:
            assert f"failed on rank {rank}" in message and "this rank itself reached it too late" in message, message
        else:
            assert f"rank {rank}" in message and f"ranks [{stalled}] had not reached it" in message, message
            assert at - fake.aborted_at <= MARGIN_S, (rank, at - fake.aborted_at)


# ------------------------------------------------------------------ the engine's start and close


@pytest.mark.parametrize(
    "module,step,name",
    [
        (agreement, "agree_config", "tfsync.config"),
        (agreement, "agree_t0", "tfsync.t0"),
        (lifecycle, "open_control", "tfsync.control_address"),
    ],
)
def test_an_engine_start_stops_every_rank_naming_the_rank_that_did_not_come(monkeypatch, module, step, name):
    fake = FakeCluster(3, timeout_s=FAKE_TIMEOUT_S)
    original = getattr(module, step)

    def stalling(*args):
        cluster = args[1] if step == "open_control" else args[0]
        if cluster.rank() == 2:
            stall_until_aborted(fake)
        return original(*args)

    monkeypatch.setattr(module, step, stalling)
    engines = [
        SyncEngine(
            resolve("bsp"), EngineSettings(stragglers=Stragglers(), wait_timeout_s=BOUND_S), cluster=fake.rank(r)
        )
        for r in range(3)
    ]
    try:
        results = failing_at([lambda e=e: e.start([tf.zeros([WIDTH])]) for e in engines])
        check_stopped(fake, results, name, stalled=2)
        assert not any(e.started for e in engines)
    finally:
        for e in engines:
            e.abandon()  # (rank 0's control server, when it got that far)


def test_an_engine_close_stops_every_rank_naming_the_rank_that_did_not_come():
    fake = FakeCluster(3, timeout_s=FAKE_TIMEOUT_S)
    engines = [
        SyncEngine(
            resolve("bsp"), EngineSettings(stragglers=Stragglers(), wait_timeout_s=BOUND_S), cluster=fake.rank(r)
        )
        for r in range(3)
    ]
    _, errors = on_threads([lambda e=e: e.start([tf.zeros([WIDTH])]) for e in engines], JOIN_S)
    assert_no_errors(errors)

    def close(rank):
        if rank == 2:
            stall_until_aborted(fake)
        engines[rank].close()

    try:
        results = failing_at([lambda r=r: close(r) for r in range(3)])
        check_stopped(fake, results, "tfsync.close", stalled=2)
    finally:
        for e in engines:
            e.abandon()


# ---------------------------------------------------------------------------- SyncCallback


SIZE = 2
BATCH, STEPS, EPOCHS = 4, 4, 2
CALLBACK_WAIT_S = 30.0  # the callback's wait bound while it trains; lowered to BOUND_S at the site


def data(rank):
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(BATCH * STEPS, 3)).astype(np.float32)
    return x, x @ np.array([[1.0], [-2.0], [0.5]], np.float32)


def fit_stalling(fake, mode, site, stalled=1, **kwargs):
    """Every rank fits; at the collective ``site`` (``(frontend method, name)``, or ``"statistics"``)
    the wait bound drops to BOUND_S and rank ``stalled`` does not come until it was aborted."""
    syncs = {}

    def fit(rank):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        sync = syncs[rank] = tfsync.keras.SyncCallback(
            mode, cluster=fake.rank(rank), wait_timeout_s=CALLBACK_WAIT_S, **kwargs
        )
        if site != "statistics":
            method, name = site
            frontend = sync.frontend
            original = getattr(frontend, method)

            def stalling(values, at, purpose):
                if at == name:
                    assert frontend.wait_timeout_s == CALLBACK_WAIT_S
                    frontend.settings = dataclasses.replace(frontend.settings, wait_timeout_s=BOUND_S)
                    if rank == stalled:
                        stall_until_aborted(fake)
                return original(values, at, purpose)

            setattr(frontend, method, stalling)
        x, y = data(rank)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[sync])

    try:
        return failing_at([lambda r=r: fit(r) for r in range(SIZE)])
    finally:
        for sync in syncs.values():
            if sync.engine is not None:
                sync.engine.abandon()


@pytest.mark.parametrize(
    "site",
    [
        ("allgather", "tfsync.steps"),
        ("broadcast_variables", "tfsync.weights"),
        # while the engine runs: on its exchange thread
        ("average", "tfsync.epoch_logs"),
    ],
    ids=lambda site: site[1],
)
def test_fit_stops_every_rank_naming_the_rank_that_did_not_come(site):
    fake = FakeCluster(SIZE, timeout_s=FAKE_TIMEOUT_S)
    results = fit_stalling(fake, "bsp", site)
    check_stopped(fake, results, site[1], stalled=1)


def test_auto_modes_switch_stops_every_rank_naming_the_rank_that_did_not_come():
    # every profile maps to SSP: the first decision switches from BSP, between two engines
    auto = tfsync.Auto(modes=dict.fromkeys(PROFILES, SSP(staleness=1)), window_steps=2, confirm=1)
    fake = FakeCluster(SIZE, timeout_s=FAKE_TIMEOUT_S)
    results = fit_stalling(fake, auto, ("broadcast_variables", "tfsync.auto.switch"))
    check_stopped(fake, results, "tfsync.auto.switch", stalled=1)


def test_the_statistics_at_the_end_of_fit_stop_every_rank_naming_the_rank_that_did_not_come(monkeypatch):
    fake = FakeCluster(SIZE, timeout_s=FAKE_TIMEOUT_S)
    original = tfsync.keras.callback.average_statistics

    def stalling(model, *, cluster, wait_timeout_s):
        assert wait_timeout_s == CALLBACK_WAIT_S  # the callback's bound reaches it
        if cluster.rank() == 1:
            stall_until_aborted(fake)
        return original(model, cluster=cluster, wait_timeout_s=BOUND_S)

    monkeypatch.setattr(tfsync.keras.callback, "average_statistics", stalling)
    results = fit_stalling(fake, "bsp", "statistics")
    check_stopped(fake, results, "tfsync.statistics.shapes", stalled=1)


# ---------------------------------------------------------------------------- SyncStrategy


def test_a_variable_created_in_a_strategys_scope_stops_at_the_bound_naming_the_rank_that_did_not_come():
    fake = FakeCluster(2, timeout_s=FAKE_TIMEOUT_S)
    strategy = tfsync.distribute.SyncStrategy("bsp", wait_timeout_s=BOUND_S, cluster=fake.rank(0))

    def create():
        with strategy.scope():
            tf.Variable(tf.zeros([WIDTH]))

    results = failing_at([create])  # rank 1 never creates its variables
    error, _ = results[0]
    assert isinstance(error, SyncTimeoutError), error
    assert "'tfsync.create.0'" in str(error) and "ranks [1] had not reached it" in str(error), error
    assert BOUND_S - 0.2 <= fake.aborted_at - fake.entered[0][2] <= BOUND_S + MARGIN_S


# ------------------------------------------------------------- the arrival record, run_bounded


def test_a_collective_queued_behind_a_stalled_round_ends_at_the_rounds_bound_naming_its_rank():
    """An epoch's end (or a commit) of a rank that runs ahead (SSP) queues its collective behind a
    round that rank 2, hung, never entered.  That round's bound ends the wait, naming rank 2:
    before, the collective out-waited the round by its own bound and named no rank (it had not
    started, so no rank had reached it)."""
    fake = FakeCluster(3, timeout_s=FAKE_TIMEOUT_S)
    frontends = [
        Frontend(
            SSP(staleness=3), EngineSettings(stragglers=Stragglers(), wait_timeout_s=BOUND_S), cluster=fake.rank(r)
        )
        for r in range(3)
    ]
    weights = [tf.Variable(tf.zeros([WIDTH])) for _ in range(3)]
    _, errors = on_threads([lambda r=r: frontends[r].start([weights[r]]) for r in range(3)], JOIN_S)
    assert_no_errors(errors)
    pushed, done = {}, threading.Semaphore(0)

    def run(rank):
        frontend = frontends[rank]
        if rank == 2:  # hung: it never pushes round 0, until the others stopped
            for _ in range(2):
                done.acquire(timeout=JOIN_S)
            return
        try:
            frontend.engine.begin_step()
            weights[rank].assign_add(tf.ones([WIDTH]))  # (SSP pushes the optimizer's update)
            frontend.engine.sync_step([])  # round 0 queued; SSP(3) does not wait for it
            pushed[rank] = time.monotonic()
            time.sleep(BOUND_S)  # the epoch ends a while after the round began
            frontend.average([1.0], "tfsync.epoch_logs", "the epoch's logs, averaged over the ranks")
        finally:
            done.release()

    try:
        results = failing_at([lambda r=r: run(r) for r in range(3)])
    finally:
        for f in frontends:
            f.engine.abandon()
    for rank in (0, 1):
        error, at = results[rank]
        assert isinstance(error, SyncTimeoutError), (rank, error)
        message = str(error)
        assert "'tfsync.epoch_logs'" in message and "queued behind round 0" in message, message
        assert "ranks [2] have not pushed it" in message and error.ranks == [2], message
        # the round's bound, not the collective's own (called BOUND_S after the push)
        assert at - pushed[rank] <= BOUND_S + MARGIN_S, (rank, at - pushed[rank])


def test_a_collective_that_horovods_shutdown_ends_after_a_loss_names_the_lost_rank():
    """Rank 1's process ends as the others average an epoch's logs: Horovod shuts down and the
    collective fails on each survivor before most of them had been recorded as arrived.  The
    error names the rank rank 0's control service reports lost, not every rank the arrival
    record lacks (the healthy ones included)."""
    fake = FakeCluster(2, timeout_s=FAKE_TIMEOUT_S)
    frontends = [
        Frontend(tfsync.BSP(), EngineSettings(stragglers=Stragglers(), wait_timeout_s=BOUND_S), cluster=fake.rank(r))
        for r in range(2)
    ]
    weights = [tf.Variable(tf.zeros([WIDTH])) for _ in range(2)]
    _, errors = on_threads([lambda r=r: frontends[r].start([weights[r]]) for r in range(2)], JOIN_S)
    assert_no_errors(errors)
    frontend = frontends[0]
    lost = {"rank": 1, "clock": 4, "at_s": 1.0, "reason": "its process or connection ended"}

    def shut_down(values, name):
        frontend.engine.control.known_lost = [lost]  # (what rank 0's control service pushed)
        raise RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks")

    frontend.cluster.average = shut_down
    try:
        with pytest.raises(WorkerLostError) as caught:
            frontend.average([1.0], "tfsync.epoch_logs", "the epoch's logs, averaged over the ranks")
    finally:
        for f in frontends:
            f.engine.abandon()
    message = str(caught.value)
    assert caught.value.ranks == [1] and "lost rank 1" in message, message
    assert "its process or connection ended" in message and "'tfsync.epoch_logs'" in message, message


def test_a_collective_that_completes_in_time_leaves_no_record_and_returns_its_value():
    fake = FakeCluster(2, timeout_s=FAKE_TIMEOUT_S)

    def call(rank):
        cluster = fake.rank(rank)
        if rank == 1:
            time.sleep(0.6)  # past ARRIVE_AFTER_S for rank 0: its arrival is recorded, then removed
        return [
            run_bounded(
                cluster, lambda: cluster.allgather_object(rank, name="x"), name="x", purpose="a test", timeout_s=5.0
            )
            for _ in range(2)
        ]

    results, errors = on_threads([lambda r=r: call(r) for r in range(2)], JOIN_S)
    assert_no_errors(errors)
    assert results == [[[0, 1], [0, 1]]] * 2
    assert fake.arrivals == {} and fake.aborted_at is None


def test_a_collective_that_fails_on_its_own_raises_its_own_error():
    fake = FakeCluster(2, timeout_s=0.3)  # the fake's bound, under the wait bound
    cluster = fake.rank(0)
    with pytest.raises(TimeoutError, match=r"for ranks \[1\]"):
        run_bounded(cluster, lambda: cluster.allgather_object(0, name="x"), name="x", purpose="a test", timeout_s=5.0)
    assert fake.aborted_at is None


@pytest.fixture
def store():
    """Horovod's rendezvous store, as ``horovodrun --gloo`` runs it on the launcher host."""
    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer()
    port = server.start()
    yield server, port
    server.stop()


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_rendezvous_store_records_who_arrived_and_forgets_who_left(store, monkeypatch):
    # a record that is not written in time is skipped silently (it only serves a message): give
    # each request time enough on a busy machine, where the 1 s default once lost an arrival
    monkeypatch.setattr(cluster_module, "STORE_TIMEOUT_S", 10.0)
    monkeypatch.setattr(cluster_module, "MISSING_BUDGET_S", 30.0)
    server, port = store
    ranks = [RendezvousArrivals("127.0.0.1", port, r, 3) for r in range(3)]
    for r in (0, 2):
        ranks[r].arrive("tfsync.steps#0")
    assert [ranks[r].missing("tfsync.steps#0") for r in range(3)] == [[1]] * 3
    assert ranks[0].missing("tfsync.steps#1") == [0, 1, 2]  # another call of the same name
    ranks[1].arrive("tfsync.steps#0")
    assert ranks[0].missing("tfsync.steps#0") == []
    for r in range(3):
        ranks[r].leave("tfsync.steps#0")
    assert ranks[0].missing("tfsync.steps#0") == [0, 1, 2]
    assert ARRIVALS_SCOPE not in server._httpd.cache  # nothing left behind


def test_an_unreachable_or_absent_store_is_unknown_and_never_fails():
    record = RendezvousArrivals("127.0.0.1", closed_port(), 0, 2)
    start = time.monotonic()
    record.arrive("x#0")
    record.leave("x#0")
    assert record.missing("x#0") is None
    assert time.monotonic() - start < 5.0
    assert RendezvousArrivals.from_env(lambda: 0, lambda: 2, environ={}) is None  # e.g. under MPI
    found = RendezvousArrivals.from_env(
        lambda: 1, lambda: 2, environ={"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "9"}
    )
    assert found.base == f"http://10.0.0.1:9/{ARRIVALS_SCOPE}/" and (found.rank, found.size) == (1, 2)


class StuckHorovod:
    """``horovod.tensorflow`` as rank 0 of 2 sees it while rank 1 never comes: a collective
    returns only once ``shutdown()`` makes it fail, with Horovod's words."""

    def __init__(self):
        self.shut_down = threading.Event()

    def rank(self):
        return 0

    def size(self):
        return 2

    def allgather_object(self, obj, name=None):
        assert self.shut_down.wait(30.0)
        raise RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks")

    def shutdown(self):
        self.shut_down.set()


def test_the_horovod_cluster_names_the_missing_rank_from_horovods_store(store, monkeypatch):
    server, port = store
    hvd = StuckHorovod()
    monkeypatch.setattr(_horovod, "horovod", lambda: hvd)
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", str(port))
    cluster = HorovodCluster()
    start = time.monotonic()
    with pytest.raises(SyncTimeoutError) as caught:
        run_bounded(
            cluster,
            lambda: cluster.allgather_object(0, name="tfsync.steps"),
            name="tfsync.steps",
            purpose="the number of steps per epoch of every rank, gathered at the start of fit",
            timeout_s=BOUND_S,
        )
    assert BOUND_S - 0.2 <= time.monotonic() - start <= BOUND_S + MARGIN_S
    assert hvd.shut_down.is_set()  # aborted: every rank's pending collective fails at once
    message = str(caught.value)
    assert "rank 0 waited 1.5 s for the collective 'tfsync.steps'" in message, message
    assert "ranks [1] had not reached it" in message and "TFSYNC_WAIT_TIMEOUT_S" in message, message
    # a failed call's arrival stays (a rank failing later still reads who had arrived)
    assert len(server._httpd.cache[ARRIVALS_SCOPE]) == 1


def test_without_a_store_the_horovod_cluster_says_who_is_missing_is_unknown(monkeypatch):
    hvd = StuckHorovod()
    monkeypatch.setattr(_horovod, "horovod", lambda: hvd)
    for var in ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in os.environ
    cluster = HorovodCluster()
    with pytest.raises(SyncTimeoutError, match="which ranks had not reached it is unknown"):
        run_bounded(cluster, lambda: cluster.allgather_object(0, name="x"), name="x", purpose="a test", timeout_s=0.5)
