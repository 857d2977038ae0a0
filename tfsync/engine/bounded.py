"""Every collective outside the engine's rounds, bounded: :func:`run_bounded`.

Every collective outside the engine's rounds (the engine's start and close,
the frontends' checks and broadcasts at the start of ``fit``, the epoch logs,
auto mode's switches, the statistics at the end, the strategy's initial
values) runs through :func:`run_bounded`: Horovod's collectives block until
every rank calls them and never time out a peer that is alive but stuck
(a worker still loading its data, or hung, before or after ``fit``), so
without a bound one such rank would hang the whole job.  Past the bound one
watchdog thread (for every collective of the process) aborts the cluster's
collectives (``cluster.abort()``), so every rank's wait ends alike, and the
error names the collective, what it was for and, from the cluster's arrival
record (:mod:`tfsync.engine.cluster`), the ranks that had not reached it.
"""

import concurrent.futures
import threading
import time

from tfsync import _env
from tfsync.engine.diagnosis import ABORTED_MESSAGE, SyncTimeoutError
from tfsync.engine.rounds import WorkerLostError

ARRIVE_AFTER_S = 0.5  # a collective waiting this long records this rank's arrival (at most a quarter of its bound)
QUEUED_GRACE_S = 1.0  # a collective queued behind the engine's rounds: how much past its bound the caller waits
SETTLE_S = 10.0  # after a collective failed at its bound: how long the caller waits for the watchdog's abort


def run_bounded(cluster, fn, *, name, purpose, timeout_s, on=None):
    """Run ``fn()``, a call of the collective ``name`` on ``cluster``, bounded by ``timeout_s``.

    ``purpose`` says in words what the collective is for (it goes in the
    errors).  ``on(fn, timeout_s)``: where ``fn`` runs, e.g. the engine's
    exchange thread (:meth:`tfsync.engine.SyncEngine.call`, after every queued
    round), raising ``TimeoutError`` if it has not returned within
    ``timeout_s``, or its own diagnosis of the wait (a ``SyncTimeoutError`` or
    ``WorkerLostError``, raised as it is: a collective still queued then never
    starts); default: this thread.

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
    if elsewhere and isinstance(exc, SyncTimeoutError | WorkerLostError):
        # ``on`` diagnosed the wait itself (the engine's watch: a lost peer, a round ahead past its
        # bound): that error names the ranks; a collective still queued is never to start
        _WATCHDOG.abandon(watch)
        return None
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
            "store, HOROVOD_GLOO_RENDEZVOUS_ADDR, is not set or not reachable)"
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
        + (". The job's collectives were aborted, so no rank waits for it any longer" if aborted else ""),
        ranks=[r for r in watch.missing if r != rank] if watch.started and watch.missing is not None else None,
    )


def _aborted_error(watch, name, purpose):
    rank = _rank_of(watch.cluster)
    missing = _call(watch.cluster, "missing", watch.key, default=None)
    return SyncTimeoutError(
        f"tfsync: the collective {name!r} ({purpose}) failed on rank {rank} because the job's "
        f"collectives were shut down: another rank's wait for peers reached its bound "
        f"({watch.timeout_s:g} s here), or a rank failed or exited (its own error says which); "
        f"{_who(missing, rank, waited=False)}. {_fix()}",
        ranks=missing,
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

    def abandon(self, watch):
        """The caller gave up on ``watch``'s collective for a reason of its own: one still queued
        never starts (a running one is left to end or reach its bound)."""
        with self._cond:
            if watch.state == _QUEUED:
                watch.state = _DONE

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


__all__ = ["ABORTED_MESSAGE", "run_bounded"]
