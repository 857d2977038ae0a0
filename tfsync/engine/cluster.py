"""What the engine takes from the job's ranks, behind one small interface, and how a
collective outside the rounds is bounded.

A :class:`~tfsync.engine.SyncEngine` talks to its peers through a *cluster*
object, injected as ``SyncEngine(..., cluster=...)``, as the conventions ask
of everything that talks to the outside world:

* ``rank()``, ``size()``: this worker's rank and the number of workers;
* ``allgather_object(obj, name)``: every rank's ``obj``, in rank order;
* ``broadcast_object(obj, root_rank, name)``: ``root_rank``'s ``obj`` on every rank;
* ``collective(average)``: the round collective the
  :class:`~tfsync.engine.exchange.RoundExchange` runs,
  ``collective(payload, meta, divisor=None) -> (total, meta)``;
* ``local_rank()``: this worker's index among the workers of its host;
* ``broadcast(tensor, root_rank, name)``: ``root_rank``'s tensor on every rank;
* ``broadcast_variables(variables, root_rank, name)``: set every rank's
  variables to ``root_rank``'s values, in place;
* ``average(tensors, name)``: the element-wise mean over the ranks of each
  tensor, one grouped call (the frontends' epoch logs and statistics);
* ``barrier(name)``: a function of no arguments that returns once every
  rank has called it; the engine's ``close()`` builds it on the training
  thread and runs it on the exchange thread, after every round;
* ``abort()`` (optional): make every pending and later collective of every
  rank fail at once, with an error whose message contains
  :data:`ABORTED_MESSAGE` (Horovod's).  The engine calls it from a watchdog
  thread when a round that runs on the training thread (BSP's inline round)
  outlasts the wait bound, and :func:`run_bounded` when any other collective
  does, so that wait ends as every other one does and no rank is left waiting;
* ``arrival_key(name)``, ``arrive(key)``, ``leave(key)``, ``missing(key)``
  (optional): the arrival record that lets a collective which reached its
  bound name the ranks that had not reached it.  ``arrival_key`` numbers the
  calls of each collective name (the same key on every rank: every rank calls
  its collectives in the same order); ``arrive(key)``: this rank is waiting in
  that call; ``leave(key)``: the call completed on this rank (its record is
  removed); ``missing(key) -> list[int] | None``: the ranks that have not
  arrived (``None``: unknown).  They are called from :func:`run_bounded`'s
  watchdog thread too, never use the collectives, and never raise for the
  record's sake (an unreachable record makes ``missing`` return ``None``).

The engine and the frontends (:mod:`tfsync.frontend`) call the collectives from
at most one thread at a time per rank, in the same order on every rank; nothing
else in tfsync's training path calls Horovod.  In production (``cluster=None``) it is
:class:`HorovodCluster`: the same Horovod calls, with the same names and in
the same order on every rank.  The single-process tests pass N ranks on threads
(``tests/single/fake_cluster.py``),
and a simulator can do the same.

Every collective outside the engine's rounds (the engine's start and close,
the frontends' checks and broadcasts at the start of ``fit``, the epoch logs,
auto mode's switches, the statistics at the end, the strategy's initial
values) runs through :func:`run_bounded`: Horovod's collectives block until
every rank calls them and never time out a peer that is alive but stuck
(a worker still loading its data, or hung, before or after ``fit``), so
without a bound one such rank would hang the whole job.
"""

import collections
import concurrent.futures
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from tfsync import _env, _horovod
from tfsync.engine.diagnosis import SyncTimeoutError
from tfsync.engine.protocols import tf_variable
from tfsync.engine.rounds import horovod_collective

ABORTED_MESSAGE = "has been shut down"  # in the error of a collective that abort() made fail (Horovod's words)
ARRIVE_AFTER_S = 0.5  # a collective waiting this long records this rank's arrival (at most a quarter of its bound)
QUEUED_GRACE_S = 1.0  # a collective queued behind the engine's rounds: how much past its bound the caller waits
SETTLE_S = 10.0  # after a collective failed at its bound: how long the caller waits for the watchdog's abort
ARRIVALS_SCOPE = "tfsync.arrivals"  # tfsync's scope in Horovod's rendezvous store
STORE_TIMEOUT_S = 1.0  # one HTTP call to Horovod's rendezvous store
MISSING_BUDGET_S = 5.0  # all of one missing()'s reads together
RENDEZVOUS_ADDR_ENV, RENDEZVOUS_PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"


def run_bounded(cluster, fn, *, name, purpose, timeout_s, on=None):
    """Run ``fn()``, a call of the collective ``name`` on ``cluster``, bounded by ``timeout_s``.

    ``purpose`` says in words what the collective is for (it goes in the
    errors).  ``on(fn, timeout_s)``: where ``fn`` runs, e.g. the engine's
    exchange thread (:meth:`tfsync.engine.exchange.RoundExchange.call`, after
    every queued round), raising ``TimeoutError`` if it has not returned within
    ``timeout_s``; default: this thread.

    One watchdog thread per process (:class:`_Watchdog`) watches every
    collective running.  One that has waited :data:`ARRIVE_AFTER_S` records
    this rank's arrival (``cluster.arrive``): a collective that completes
    sooner touches no record, so a model whose many variables are broadcast
    one by one costs no call to the record per variable.  One that reaches
    its bound is aborted: the watchdog asks the record which ranks have not
    arrived (``cluster.missing``; a rank that arrived less than
    :data:`ARRIVE_AFTER_S` before the bound counts as not arrived), then
    calls ``cluster.abort()``, which makes every rank's pending and later
    collectives fail at once, and this call raises
    :class:`~tfsync.engine.diagnosis.SyncTimeoutError` naming this rank, the
    collective, the bound, the ranks that had not reached it and the fix.  A
    rank whose collective failed because another rank aborted raises one too
    (:data:`ABORTED_MESSAGE`), naming the collective and, from the record, the
    ranks that had not reached it, itself included when it came too late.
    A completed call removes its record (``cluster.leave``); a failed one
    leaves it, so the ranks that fail after it can still read who had arrived.

    A cluster without ``abort()`` cannot end a pending collective: ``fn`` then
    runs on a thread of its own, which is left behind at the bound.
    """
    key = _call(cluster, "arrival_key", name, default=name)
    watch = _Watch(cluster, key, timeout_s)
    if on is None and getattr(cluster, "abort", None) is None:
        on = _on_own_thread

    def watched():
        if not _WATCHDOG.start(watch):  # the caller gave up while it was queued
            raise SyncTimeoutError(f"tfsync: the collective {name!r} was abandoned before it started")
        try:
            result = fn()
        except BaseException:
            _WATCHDOG.finish(watch, completed=False)
            raise
        _WATCHDOG.finish(watch, completed=True)
        return result

    try:
        result = watched() if on is None else on(watched, timeout_s + QUEUED_GRACE_S)
    except Exception as exc:
        error = _failed(watch, exc, name, purpose, on is not None)
        if error is None:
            raise
        raise error from exc
    if watch.state == _EXPIRED:  # it returned as its bound ran out: the abort fails every rank anyway
        watch.settled.wait(SETTLE_S)
        raise _timeout_error(watch, name, purpose)
    return result


def _failed(watch, exc, name, purpose, elsewhere):
    """The error to raise for a bounded collective that raised ``exc``; None: ``exc`` itself."""
    if elsewhere and isinstance(exc, TimeoutError) and watch.state in (_QUEUED, _RUNNING):
        # ``on`` gave up: the collective never started (queued behind a round that does not
        # finish) or the watchdog has not ended it yet; end it here
        _WATCHDOG.expire(watch)
    if watch.state == _EXPIRED:
        watch.settled.wait(SETTLE_S)
        return _timeout_error(watch, name, purpose)
    if ABORTED_MESSAGE in str(exc):
        return _aborted_error(watch, name, purpose)
    return None


def _rank_of(cluster):
    try:
        return cluster.rank()
    except Exception:  # noqa: BLE001 - only for the message
        return "?"


def _fix():
    return (
        "A worker is hung, or far slower than the others to get there (e.g. still loading its data "
        "or building its model before fit, or evaluating or saving after it); raise wait_timeout_s "
        f"(or {_env.WAIT_TIMEOUT_S.name}) if that is expected"
    )


def _who(missing, rank, waited):
    """Which ranks had not reached the collective, in words; ``waited``: this rank was waiting in it
    when the bound ran out (so it had arrived, whatever the record says)."""
    if missing is None:
        return (
            "which ranks had not reached it is unknown (no arrival record: Horovod's Gloo rendezvous "
            f"store, {RENDEZVOUS_ADDR_ENV}, is not set or not reachable)"
        )
    others = [r for r in missing if r != rank]
    if rank in missing and not waited:
        return "this rank itself reached it too late" + (
            f", and ranks {others} had not reached it either" if others else ""
        )
    if others:
        return f"ranks {others} had not reached it"
    return "every rank had reached it, but it did not complete"


def _timeout_error(watch, name, purpose):
    rank = watch.rank if watch.rank is not None else _rank_of(watch.cluster)
    if watch.started:
        where = _who(watch.missing, rank, waited=True)
    else:
        where = "it was still queued on this rank's exchange thread behind the engine's rounds, which did not finish"
    aborted = getattr(watch.cluster, "abort", None) is not None
    return SyncTimeoutError(
        f"tfsync: rank {rank} waited {watch.timeout_s:g} s for the collective {name!r} ({purpose}); "
        f"{where}. {_fix()}"
        + (". The job's collectives were aborted, so no rank waits for it any longer" if aborted else "")
    )


def _aborted_error(watch, name, purpose):
    rank = _rank_of(watch.cluster)
    missing = _call(watch.cluster, "missing", watch.key, default=None)
    return SyncTimeoutError(
        f"tfsync: the collective {name!r} ({purpose}) failed on rank {rank} because the job's "
        f"collectives were shut down: another rank's wait for peers reached its bound "
        f"({watch.timeout_s:g} s here), or a rank failed or exited (its own error says which); "
        f"{_who(missing, rank, waited=False)}. {_fix()}"
    )


def _call(cluster, method, *args, default=None):
    """``cluster.method(*args)`` for the arrival record: ``default`` if the cluster has no such
    method or it failed (the record must never fail a collective)."""
    fn = getattr(cluster, method, None)
    if fn is None:
        return default
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - best effort
        return default


def _on_own_thread(fn, timeout_s):
    """Run ``fn`` on a daemon thread; ``TimeoutError`` (the thread left behind) past ``timeout_s``."""
    future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - carried to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name="tfsync-collective", daemon=True).start()
    return future.result(timeout_s)


_QUEUED, _RUNNING, _DONE, _EXPIRED = "queued", "running", "done", "expired"


class _Watch:
    """One bounded collective call, as the watchdog sees it."""

    def __init__(self, cluster, key, timeout_s):
        now = time.monotonic()
        self.cluster, self.key, self.timeout_s = cluster, key, timeout_s
        self.deadline = now + timeout_s  # from the call, queued time included
        self.arrive_after_s = min(ARRIVE_AFTER_S, timeout_s / 4)
        self.arrive_at = None  # set when it starts
        self.state = _QUEUED  # guarded by the watchdog's lock
        self.started = False
        self.arriving = False  # guarded by the watchdog's lock
        self.arrived = False  # guarded by store_lock
        self.store_lock = threading.Lock()  # an arrival is never recorded after the call's leave
        self.rank = None  # at the bound, this rank
        self.missing = None  # at the bound, from the record
        self.settled = threading.Event()  # set once the expired call's abort was made


class _Watchdog:
    """The process's one thread that records arrivals and aborts collectives at their bound.

    It sleeps until the next arrival or bound is due (indefinitely while no
    bounded collective runs), so watching costs a lock and a notification per
    collective.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._running = set()
        self._thread = None

    def start(self, watch) -> bool:
        """``watch``'s collective starts now; False if it expired while queued (do not run it)."""
        with self._cond:
            if watch.state != _QUEUED:
                return False
            watch.state, watch.started = _RUNNING, True
            watch.arrive_at = min(time.monotonic() + watch.arrive_after_s, watch.deadline)
            self._running.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tfsync-collective-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()
        return True

    def finish(self, watch, completed):
        """``watch``'s collective returned (``completed``) or raised.  A completed one's arrival
        record is removed; a failed one's stays, for the ranks that fail after it to read."""
        with self._cond:
            if watch.state != _RUNNING:
                return
            watch.state = _DONE
            self._running.discard(watch)
        with watch.store_lock:
            if watch.arrived and completed:
                _call(watch.cluster, "leave", watch.key)

    def expire(self, watch):
        """End ``watch``'s collective at its bound: read who has not arrived, then abort (once)."""
        with self._cond:
            if watch.state not in (_QUEUED, _RUNNING):
                return
            watch.state = _EXPIRED
            self._running.discard(watch)
        try:
            watch.rank = _rank_of(watch.cluster)  # (Horovod forgets its rank once shut down)
            if watch.started:
                watch.missing = _call(watch.cluster, "missing", watch.key, default=None)
            _call(watch.cluster, "abort")
        finally:
            watch.settled.set()

    def _run(self):
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    arrivals = [w for w in self._running if not w.arriving and now >= w.arrive_at]
                    expired = [w for w in self._running if now >= w.deadline]
                    if arrivals or expired:
                        break
                    due = [w.deadline for w in self._running]
                    due += [w.arrive_at for w in self._running if not w.arriving]
                    self._cond.wait(min(due) - now if due else None)
                for w in arrivals:
                    w.arriving = True
            for w in arrivals:  # (before a bound due now: the others read this rank's record)
                with w.store_lock:
                    if w.state == _RUNNING:
                        _call(w.cluster, "arrive", w.key)
                        w.arrived = True
            for w in expired:
                self.expire(w)


_WATCHDOG = _Watchdog()


class RendezvousArrivals:
    """The arrival record in Horovod's own Gloo rendezvous key-value store.

    ``horovodrun --gloo`` runs that store (an HTTP server,
    ``horovod.runner.http.http_server.RendezvousServer``) on the launcher host
    for the whole job and tells every worker where it is
    (:data:`RENDEZVOUS_ADDR_ENV`, :data:`RENDEZVOUS_PORT_ENV`), so every rank
    can reach it without a service of tfsync's own.  A rank's arrival at a
    call is one key in tfsync's scope (:data:`ARRIVALS_SCOPE`): ``PUT`` when it
    arrives, ``DELETE`` when the call completed (the store supports deleting
    from a scope of the client's own), ``GET`` answering 404 for each rank
    not arrived.  The requests are Horovod's client's
    (``horovod.runner.http.http_client``), made here with a timeout
    (:data:`STORE_TIMEOUT_S`) and no proxy, and none raises: the record only
    serves an error message.

    Args:
        addr, port: the store's address.
        rank, size: this worker's rank and the number of workers.
    """

    def __init__(self, addr, port, rank, size):
        self.base = f"http://{addr}:{int(port)}/{ARRIVALS_SCOPE}/"
        self.rank, self.size = rank, size
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def from_env(cls, rank, size, environ=None):
        """The record of a job launched by ``horovodrun --gloo``; None without the store's address
        (e.g. under MPI).  ``rank``, ``size``: functions, called only when there is a store."""
        environ = os.environ if environ is None else environ
        addr, port = environ.get(RENDEZVOUS_ADDR_ENV, "").strip(), environ.get(RENDEZVOUS_PORT_ENV, "").strip()
        if not addr or not port.isdigit():
            return None
        return cls(addr, int(port), rank(), size())

    def _url(self, key, rank):
        return self.base + urllib.parse.quote(f"{key}@{rank}", safe="")

    def _request(self, method, url, data=None, timeout_s=None):
        request = urllib.request.Request(url, data=data, method=method)
        with self._opener.open(request, timeout=STORE_TIMEOUT_S if timeout_s is None else timeout_s) as response:
            return response.read()

    def arrive(self, key):
        try:
            self._request("PUT", self._url(key, self.rank), data=b"1")
        except Exception:  # noqa: BLE001 - best effort: the record only serves a message
            pass

    def leave(self, key):
        try:
            self._request("DELETE", self._url(key, self.rank))
        except Exception:  # noqa: BLE001 - best effort
            pass

    def missing(self, key):
        """The ranks with no arrival at ``key``; None if the store did not answer every read in time."""
        deadline = time.monotonic() + MISSING_BUDGET_S
        missing = []
        for rank in range(self.size):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                self._request("GET", self._url(key, rank), timeout_s=min(STORE_TIMEOUT_S, left))
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    return None
                missing.append(rank)
            except Exception:  # noqa: BLE001 - unreachable, timed out: unknown
                return None
        return missing


class ArrivalKeys:
    """Numbers the calls of each collective name: ``name#0``, ``name#1``, ... (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = collections.Counter()

    def next(self, name):
        with self._lock:
            n = self._calls[name]
            self._calls[name] += 1
        return f"{name}#{n}"


class HorovodCluster:
    """The ranks of a ``horovodrun`` job, over ``horovod.tensorflow``.

    Built when the engine starts; the constructor runs :func:`tfsync._horovod.horovod`'s
    checks (Horovod installed, initialized, the process launched by ``horovodrun``).
    Its arrival record is :class:`RendezvousArrivals` (none without Horovod's Gloo
    rendezvous store), its calls numbered per process (one process is one rank), so
    every instance of a process numbers them alike.
    """

    _keys = ArrivalKeys()  # per process
    _arrivals_lock = threading.Lock()
    _membership = 0  # per process: bumped when Horovod re-forms the job (elastic reset)

    def __init__(self):
        self.hvd = _horovod.horovod()
        self._arrivals = None
        self._arrivals_known = False
        self._membership_seen = HorovodCluster._membership

    @classmethod
    def forget_membership(cls):
        """Horovod re-formed the job (an elastic reset: ``hvd.shutdown(); hvd.init()``): every
        instance in this process reads its rank, size and arrival record anew, and the calls of
        each collective are numbered from zero again, as on a worker that joins at this reset
        (the members must number their calls alike)."""
        with cls._arrivals_lock:
            cls._keys = ArrivalKeys()
            cls._membership += 1

    def rank(self) -> int:
        return self.hvd.rank()

    def size(self) -> int:
        return self.hvd.size()

    def local_rank(self) -> int:
        return self.hvd.local_rank()

    def allgather_object(self, obj, name):
        return self.hvd.allgather_object(obj, name=name)

    def broadcast(self, tensor, root_rank, name):
        return self.hvd.broadcast(tensor, root_rank=root_rank, name=name)

    def broadcast_variables(self, variables, root_rank, name):
        """Horovod's ``broadcast_variables``: the broadcasts launched together in one compiled
        function, assigned in place (no copy of the model is assembled on the host)."""
        self.hvd.broadcast_variables([tf_variable(v) for v in variables], root_rank=root_rank)

    def average(self, tensors, name):
        return self.hvd.grouped_allreduce(list(tensors), op=self.hvd.Average, name=name)

    def broadcast_object(self, obj, root_rank, name):
        return self.hvd.broadcast_object(obj, root_rank=root_rank, name=name)

    def collective(self, average: bool):
        """One ``hvd.grouped_allreduce`` per round: :func:`tfsync.engine.rounds.horovod_collective`."""
        return horovod_collective(average)

    def abort(self):
        """``hvd.shutdown()``: a pending collective on this rank raises at once (Horovod's
        "has been shut down" error), and Horovod tells the other ranks, whose pending and
        later collectives fail too, at once."""
        self.hvd.shutdown()

    def barrier(self, name):
        """An ``hvd.allreduce`` of a scalar zero, to run later (Horovod is re-checked now)."""
        hvd = _horovod.horovod()
        import tensorflow as tf

        return lambda: hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name=name)

    # the arrival record (module docstring)
    def arrival_key(self, name):
        self._record()  # found now, on the caller's thread, while Horovod still knows its rank
        return self._keys.next(name)

    def _record(self):
        with self._arrivals_lock:
            if self._membership_seen != HorovodCluster._membership:
                self._arrivals, self._arrivals_known = None, False
                self._membership_seen = HorovodCluster._membership
            if not self._arrivals_known:
                self._arrivals = RendezvousArrivals.from_env(self.hvd.rank, self.hvd.size)
                self._arrivals_known = True
            return self._arrivals

    def arrive(self, key):
        record = self._record()
        if record is not None:
            record.arrive(key)

    def leave(self, key):
        record = self._record()
        if record is not None:
            record.leave(key)

    def missing(self, key):
        record = self._record()
        return None if record is None else record.missing(key)


__all__ = ["HorovodCluster", "RendezvousArrivals", "run_bounded"]
