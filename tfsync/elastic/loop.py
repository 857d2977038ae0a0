"""Elastic training's run loop (:func:`run`): a failure a reset answers re-forms Horovod, restores
the last commit and calls the training function again (:mod:`tfsync.elastic` says what each
step does and why).
"""

import functools
import gc
import logging
import os
import re
import threading
import time

from horovod.common.elastic import State, notification_manager  # (checked by tfsync.elastic, imported first)
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from tfsync import _horovod
from tfsync._hang_guard import FIRST_STEP_FACTOR, HANG_MARGIN_S, STEP_FACTOR, HangGuard
from tfsync.control.client import ControlUnreachableError
from tfsync.control.transport import SILENT_LINK_S
from tfsync.elastic.state import KerasState, refuse_strategy
from tfsync.engine import lifecycle
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.diagnosis import SyncTimeoutError
from tfsync.engine.rounds import WorkerLostError

log = logging.getLogger("tfsync.elastic")

ELASTIC_ENV = "HOROVOD_ELASTIC"  # set to 1 by horovodrun for an elastic launch (--min-np/--max-np/discovery)
# a TensorFlow op error from a Horovod collective or its Gloo transport (not a user's own error)
HOROVOD_OP_ERROR = re.compile(r"horovod|gloo", re.IGNORECASE)
# Tries of hvd.init() per reset, REFORM_PAUSE_S apart. A re-form's rendezvous fails when a
# member is lost while the contexts form (killed, cut off): every other member's init then
# fails at Horovod's Gloo timeout, and on the next try the launcher (which has recorded the
# loss) hands out the membership without it; the rendezvous server out of reach for a moment
# (a link cut) fails a try within about 2 s. Three tries cover a second loss during the retry.
REFORM_ATTEMPTS = 3
REFORM_PAUSE_S = 2.0


class ElasticResetError(RuntimeError):
    """Horovod could not re-form the job after a failure (the launcher stopped it: too many
    resets, or fewer workers than ``--min-np``); the message says what failed."""


def hang_timeout(state) -> float | None:
    """The seconds after which ``state``'s hang guard ends a frozen or stuck worker (None: no
    guard): ``state.hang_timeout_s``, or for ``"auto"`` the longest wait of a step on peers (the
    wait bound of each callback committing the state; the state's own without one) plus
    :data:`~tfsync._hang_guard.HANG_MARGIN_S`."""
    if state.hang_timeout_s != "auto":
        return state.hang_timeout_s
    return _wait_bound(state) + HANG_MARGIN_S


def stopped_timeout(state) -> float | None:
    """The seconds after which ``state``'s hang guard ends a worker stopped by a signal (SIGSTOP;
    None: no guard): under ``hang_timeout_s="auto"``, once its peers have dropped it: its control
    links' keepalive drops them after :data:`~tfsync.control.transport.SILENT_LINK_S`
    (5 s), or the wait bound if shorter.  Such a process is certainly not running (the hang
    timeout's margin is for a silent heartbeat that may be a long call holding Python's lock),
    and ending it lets the launcher, which waits for its exit, re-form the job at once.  Given
    seconds: the hang timeout."""
    if state.hang_timeout_s != "auto":
        return state.hang_timeout_s
    return min(_wait_bound(state), SILENT_LINK_S)


def _wait_bound(state) -> float:
    """The longest wait of a step on peers: the wait bound of each callback committing ``state``
    (the state's own without one)."""
    waits = [commits.frontend.wait_timeout_s for commits in state.committers] or [state.wait_timeout_s]
    return max(waits)


def is_reset_error(exc) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a failure a reset answers: a lost
    peer, a wait past its bound, rank 0's control service out of reach when the engine starts, a
    failed Horovod collective (its TensorFlow op error names Horovod or Gloo), or Horovod's
    ``HorovodInternalError``.  Any other error is the program's own: it ends the worker it
    happens on (:func:`run` raises it as it is); under an elastic launch the others reset
    without that worker."""
    import tensorflow as tf

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, HorovodInternalError | WorkerLostError | SyncTimeoutError | ControlUnreachableError):
            return True
        if isinstance(exc, tf.errors.OpError) and HOROVOD_OP_ERROR.search(exc.message or ""):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run(func):
    """Run ``func(state, *args, **kwargs)`` through failures and membership changes (a decorator).

    ``state`` (the first argument) is a :class:`KerasState` (or another Horovod ``State``); it is
    synchronized from rank 0 before the first call.  When ``func`` raises a failure a reset
    answers (:func:`is_reset_error`) or Horovod's ``HostsUpdatedInterrupt`` (the launcher added
    or dropped a host; raised by ``state.commit()``), every member resets:

    1. Horovod is shut down (``hvd.shutdown()``: every collective still pending fails); after
       a failure its Gloo waits on peers are ended first (:func:`tfsync._horovod.interrupt_gloo`),
       so that no member waits out Gloo's timeout on a peer that is resetting too;
    2. each :class:`tfsync.keras.SyncCallback` committing ``state`` (its registered committer) counts this worker's
       contributions in flight as ``lost`` and abandons its engine (no handshake: the peers
       are resetting too), in the trace as an ``event: reset`` record;
    3. Horovod is re-formed (``hvd.init()``) by its elastic launcher: the surviving and the
       added workers, numbered anew; a rendezvous that loses a member while it forms is
       tried again (up to :data:`REFORM_ATTEMPTS` times), without that member;
    4. ``state`` is restored from its last commit and ``state.resets`` counted, then synchronized
       from the new rank 0 (a joining worker gets the whole state), and ``func`` is called again.

    Any other error is raised as it is.  A state whose model trains under
    :class:`tfsync.distribute.SyncStrategy` (``func`` called in the strategy's scope) is refused
    before the sync, as :class:`KerasState` refuses one built under it.  Without an elastic
    launch (``horovodrun`` without ``--min-np``/``--max-np``/``--host-discovery-script``: no
    ``HOROVOD_ELASTIC=1``) Horovod cannot re-form the job: ``func`` runs once after the sync,
    and a failure stops the job as it would without this wrapper.  Returns what ``func`` returns.
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(
                f"tfsync.elastic.run: the first argument of {func.__name__} must be the elastic state "
                f"(tfsync.elastic.KerasState), got {type(state).__name__}; call {func.__name__}(state, ...)"
            )
        if isinstance(state, KerasState):  # (called in a SyncStrategy's scope: refused before the sync)
            refuse_strategy(state.model, f"tfsync.elastic.run ({func.__name__})")
        hvd = _horovod.horovod()
        if os.environ.get(ELASTIC_ENV) != "1":
            try:
                state.sync()
                return func(state, *args, **kwargs)
            finally:
                if isinstance(state, KerasState):
                    state.flush_storage()
        notification_manager.init()
        notification_manager.register_listener(state)
        guard = _start_guard(hvd, state)
        try:
            while True:
                try:
                    state.sync()
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    reason = "the launcher " + ("dropped a host" if exc.skip_sync else "changed the hosts")
                    failed = False
                except Exception as exc:
                    if not is_reset_error(exc):
                        raise
                    reason = f"{type(exc).__name__}: {exc}"
                    failed = True
                finally:
                    if guard is not None:
                        guard.idle()  # (a failed step never ended)
                _reset(hvd, state, reason, failed)
                if guard is not None:
                    guard.label(f"rank {hvd.rank()} of {hvd.size()}")
                    guard.begin("restart")  # (the sync and the fit's start, bounded up to its first step)
        finally:
            notification_manager.remove_listener(state)
            if guard is not None:
                state.hang_guard = None
                guard.stop()
            if isinstance(state, KerasState):
                state.flush_storage()

    return wrapper


def _start_guard(hvd, state):
    """The process's :class:`~tfsync._hang_guard.HangGuard` for ``state`` (None without one)."""
    if not isinstance(state, KerasState):
        return None
    timeout_s = hang_timeout(state)
    if timeout_s is None:
        return None
    stopped_s = stopped_timeout(state)
    state.hang_guard = HangGuard(timeout_s, f"rank {hvd.rank()} of {hvd.size()}", stopped_s=stopped_s)
    log.info(
        "tfsync.elastic: a hang guard ends this worker if it is frozen for %.1f s (stopped by a signal: %.1f s), "
        "or in one step for %.1f s (%.1f s once the job went on without it; a fit's first step, the model's trace, "
        "or the restart after a reset up to it: %.1f s)",
        timeout_s,
        stopped_s,
        STEP_FACTOR * timeout_s,
        timeout_s,
        FIRST_STEP_FACTOR * timeout_s,
    )
    return state.hang_guard


def _reset(hvd, state, reason, failed):
    """Abandon the engines (their in-flight contributions counted lost), re-form Horovod, restore
    the last commit.  The caller then synchronizes the state from the new rank 0.

    After a failure (``failed``) Horovod's Gloo waits on peers are ended first: a member may
    wait on a live peer that is resetting too, and ``hvd.shutdown()`` waits for it.  After the
    launcher's notice of new hosts every member is healthy and at the same commit, and Horovod
    shuts down cleanly on its own."""
    t = time.monotonic()
    old = f"rank {_rank_or(hvd)} of {_size_or(hvd)}"
    interrupted = _horovod.interrupt_gloo() if failed else 0  # (waits on peers end now, not at Gloo's timeout)
    try:
        hvd.shutdown()  # first: fails every collective still pending, so the engines end at once
    except Exception:  # noqa: BLE001 - already shut down (an abort) is fine
        pass
    shut_down_s = time.monotonic() - t
    lost = 0
    for commits in getattr(state, "committers", ()):
        lost += commits.reset(reason)
    lifecycle.abandon_all()  # any other engine of this process (a SyncStrategy's)
    HorovodCluster.forget_membership()
    _collect_abandoned()
    resets = getattr(state, "resets", 0) + 1
    parts = {"engines ended": time.monotonic()}  # (each part's end, for the log line below)
    if isinstance(state, KerasState):  # (the last commit on storage before the job re-forms, or ends here)
        state.flush_storage()
    parts["commit stored"] = time.monotonic()
    _reform(hvd, resets, reason)
    parts["Horovod re-formed"] = time.monotonic()
    state.restore()
    parts["state restored"] = time.monotonic()
    ends = [t + shut_down_s, *parts.values()]
    split = ", ".join(f"{name} in {end - start:.2f} s" for name, start, end in zip(parts, ends, ends[1:]))
    if isinstance(state, KerasState):  # (in the commit too: sync() broadcasts rank 0's commit)
        state._saved_state["resets"] = state.resets = resets
    state.on_reset()
    log.warning(
        "tfsync.elastic: reset %d (%s): was %s, now rank %d of %d; %d contributions of this worker were "
        "lost in flight; re-formed in %.2f s (Horovod shut down in %.2f s, %s Gloo connections "
        "interrupted; then %s); training goes on from epoch %s",
        resets,
        reason.splitlines()[0][:300],
        old,
        hvd.rank(),
        hvd.size(),
        lost,
        time.monotonic() - t,
        shut_down_s,
        "no" if interrupted is None else interrupted,
        split,
        getattr(state, "epoch", "?"),
    )


def _collect_abandoned():
    """Collect the interrupted fit's garbage on a daemon thread of its own.

    A fit that a failure interrupted leaves its objects, its ``tf.data`` iterators among them,
    in reference cycles (the exception's frames), which Python collects at some later
    allocation on whichever thread makes it.  In the chaos soak that was the restarted fit's
    trace, where an iterator's destructor then waited 24 s to minutes for the iterator's
    autotuning thread (``RootDataset::Iterator``'s model thread, which sometimes sleeps out its
    period, doubling from 10 ms to 60 s, though the iterator cancelled it; plain Keras shows it
    too, at epoch ends: docs/guide/elastic.md, "Epoch ends"): the restarted worker made no step, and
    its peers gave up on it.  Collected here, such a wait holds only this thread (TensorFlow
    waits without Python's lock: the worker's other threads ran on meanwhile), while the worker
    re-forms and trains."""
    threading.Thread(target=gc.collect, name="tfsync-reset-gc", daemon=True).start()


def _reform(hvd, resets, reason):
    """``hvd.init()``, tried up to :data:`REFORM_ATTEMPTS` times with a shutdown between tries.

    A failed try is a rendezvous that lost a member while it formed (with the Horovod that
    ``make install`` builds, the failure is an error of ``hvd.init()``; Horovod as released
    aborts the process instead); the launcher, which saw the member go, re-forms without it on
    the next try.  A worker whose host the launcher removed does not try again (it would count
    as ready in the launcher's next round): :class:`ElasticResetError` at once, as after the
    last try, saying what failed."""
    for attempt in range(1, REFORM_ATTEMPTS + 1):
        try:
            hvd.init()
            return
        except Exception as exc:
            why = _horovod.init_error() or f"{type(exc).__name__}: {exc}"
            if _horovod.REMOVED in why:
                raise ElasticResetError(
                    f"tfsync.elastic: the launcher removed this worker's host from the job (Horovod: "
                    f"{why}), so this worker ends; the others go on without it. The failure that "
                    f"started this reset was: {reason}"
                ) from exc
            if attempt == REFORM_ATTEMPTS:
                raise ElasticResetError(
                    f"tfsync.elastic: Horovod could not re-form the job for reset {resets} in "
                    f"{REFORM_ATTEMPTS} tries (the last: {why}). horovodrun stops an elastic job when "
                    f"its resets exceed --reset-limit or fewer workers than --min-np remain; its output "
                    f"says which. The failure that started this reset was: {reason}"
                ) from exc
            log.warning(
                "tfsync.elastic: reset %d: Horovod could not re-form the job (try %d of %d: %s); "
                "trying again in %.0f s: the launcher re-forms without a member lost meanwhile",
                resets,
                attempt,
                REFORM_ATTEMPTS,
                why,
                REFORM_PAUSE_S,
            )
            try:
                hvd.shutdown()
            except Exception:  # noqa: BLE001 - nothing left running is fine
                pass
            time.sleep(REFORM_PAUSE_S)


def _rank_or(hvd):
    try:
        return hvd.rank()
    except Exception:  # noqa: BLE001 - for the log only
        return "?"


def _size_or(hvd):
    try:
        return hvd.size()
    except Exception:  # noqa: BLE001 - for the log only
        return "?"


__all__ = ["ELASTIC_ENV", "ElasticResetError", "hang_timeout", "is_reset_error", "run", "stopped_timeout"]
