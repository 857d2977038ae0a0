"""An engine's life: what every rank agrees on before the first step, and how it ends.

Each runs once per :meth:`SyncEngine.start <tfsync.engine.SyncEngine.start>`
through the cluster's own collectives (Horovod's in production), each bounded
by the engine's wait bound (:func:`tfsync.engine.cluster.run_bounded`: a rank
that does not come stops every rank with an error naming it), so a job
whose ranks disagree stops with both sides named before any round runs, and
the control path's token reaches the workers over Horovod's channel, never
the control path itself (its settings are checked earlier still, by
:func:`settings`, when a frontend is built).  An engine ends with :func:`close` (collective) or,
when the interpreter exits with it still running, :func:`abandon` (local),
so a failed ``fit`` cannot leave the process hanging on the control path's
threads.
"""

import os
import secrets
import socket
import threading
import time
import weakref

from tfsync import _env
from tfsync.engine.address import choose as choose_control_address
from tfsync.engine.cluster import run_bounded
from tfsync.engine.control import ControlServer
from tfsync.stragglers import Stragglers

ABANDON_JOIN_S = 2.0  # at exit, how long an unclosed engine waits for its communication thread

_running = weakref.WeakSet()  # engines started and not closed, in this process
_exit_hook_registered = False


def settings(*, stragglers=None, trace_dir=None, wait_timeout_s=None) -> dict:
    """The engine's settings, checked and with their defaults filled in (from the environment):
    what the frontends validate when they are built, before any training starts."""
    if stragglers is None:
        stragglers = Stragglers.from_env()
    if not isinstance(stragglers, Stragglers):
        raise TypeError(f"stragglers must be a tfsync.Stragglers, got {type(stragglers).__name__}")
    if trace_dir is not None and not isinstance(trace_dir, str | os.PathLike):
        raise TypeError(f"trace_dir must be a directory path or None, got {type(trace_dir).__name__}")
    return {"stragglers": stragglers, "trace_dir": trace_dir, "wait_timeout_s": _env.wait_timeout_s(wait_timeout_s)}


def check_trainable(tensors) -> None:
    """Refuse a trainable variable that is not floating point, before any collective: rounds
    average the workers' contributions, which only floating-point weights have."""
    import tensorflow as tf

    for i, t in enumerate(tensors):
        dtype = tf.as_dtype(t.dtype)
        if not dtype.is_floating:
            name = getattr(t, "path", None) or getattr(t, "name", None) or f"#{i}"
            raise TypeError(
                f"tfsync: trainable variable {name} has dtype {dtype.name}; every trainable variable "
                f"must be floating point (tfsync averages them across workers). Create it with "
                f"trainable=False, or with a float dtype"
            )


def agree_config(cluster, config: dict, timeout_s: float) -> list:
    """Raise ``ValueError`` naming the ranks whose ``config`` differs from rank 0's, and how
    (collective, bounded by ``timeout_s``).  Returns every rank's host name, in rank order
    (gathered with the configs: the errors name the host of a rank at fault)."""
    gathered = run_bounded(
        cluster,
        lambda: cluster.allgather_object((config, socket.gethostname()), name="tfsync.config"),
        name="tfsync.config",
        purpose="every rank's mode, model and straggler settings, gathered when the engine starts to check they match",
        timeout_s=timeout_s,
    )
    configs, hosts = [c for c, _ in gathered], [h for _, h in gathered]
    mismatched = [r for r, c in enumerate(configs) if c != configs[0]]
    if mismatched:
        diffs = {k: [c.get(k) for c in configs] for k in config if any(c.get(k) != configs[0].get(k) for c in configs)}
        raise ValueError(
            f"tfsync: ranks {mismatched} are configured differently from rank 0: "
            + "; ".join(f"{k} per rank = {v}" for k, v in diffs.items())
            + ". Every worker must run the same mode, model and straggler settings: "
            "launch the same script with the same arguments on every rank"
        )
    return hosts


def agree_t0(cluster, timeout_s: float) -> float:
    """Rank 0's clock, the job's t0 (every time in rounds and traces is relative to it; collective,
    bounded by ``timeout_s``)."""
    now = time.time()
    return run_bounded(
        cluster,
        lambda: cluster.broadcast_object(now, root_rank=0, name="tfsync.t0"),
        name="tfsync.t0",
        purpose="rank 0's clock, the job's t0, broadcast when the engine starts",
        timeout_s=timeout_s,
    )


def open_control(engine, cluster):
    """Rank 0 starts the control service; every rank learns its address and the job's token.

    Returns ``(address, token)`` (collective, bounded by the engine's wait bound); rank
    0's server is ``engine._server`` (set before anything can fail, so :func:`abandon`
    stops it).  From here on the engine is abandoned at interpreter exit unless closed
    (:func:`leave_at_exit`).
    """
    server, contact = None, None
    if engine.rank == 0:
        token = secrets.token_hex(16)
        chosen = choose_control_address()
        try:
            server = ControlServer(
                engine.size,
                engine.t0,
                token,
                host=chosen.bind,
                advertise=chosen.advertise,
                port=chosen.port,
                policy=engine.policy,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (the address came from {chosen.source})") from exc
        contact = (server.address, token)
    engine._server = server
    leave_at_exit(engine)  # from here on something runs that must not outlive the process
    return run_bounded(
        cluster,
        lambda: cluster.broadcast_object(contact, root_rank=0, name="tfsync.control_address"),
        name="tfsync.control_address",
        purpose="the address and token of rank 0's control service, broadcast when the engine starts",
        timeout_s=engine.wait_timeout_s,
    )


def leave_at_exit(engine):
    """Abandon ``engine`` at interpreter exit if it is still running then.

    The hook goes in ``threading``'s exit list, which runs before Python joins
    the non-daemon threads, the gRPC server's handler pool among them (an
    ``atexit`` function runs after that join, too late).  It is registered
    after the server exists, so it runs before ``concurrent.futures`` joins
    that pool.
    """
    global _exit_hook_registered
    _running.add(engine)
    if not _exit_hook_registered:
        threading._register_atexit(_abandon_running)
        _exit_hook_registered = True


def close(engine):
    """Leave the control path and stop the threads (collective: every rank calls it)."""
    if not engine.started:
        return
    engine.started = False
    _running.discard(engine)
    # Two barriers on the exchange thread, after every round, each bounded: every
    # rank is done with the control path before any leaves it, and every rank has
    # left it (its stream ended, its channel closed) before rank 0 stops the server,
    # so no server goes away under a worker's open stream.  A barrier that failed (a rank
    # did not come within the bound) ends the job: everything is released all the same,
    # or rank 0's server's threads would keep the process alive.
    try:
        _barrier(
            engine,
            "tfsync.close",
            "the barrier every rank reaches, its rounds done, before any leaves the control path",
        )
        engine.control.close()
        _barrier(
            engine,
            "tfsync.left",
            "the barrier every rank reaches once it left the control path, before rank 0 stops it",
        )
    finally:
        try:
            engine.exchange.close()
            engine.control.close()
        finally:
            _release(engine)


def _barrier(engine, name, purpose):
    """The cluster's barrier ``name`` on the exchange thread, after every round, bounded."""
    run_bounded(
        engine.cluster,
        engine.cluster.barrier(name),
        name=name,
        purpose=purpose,
        timeout_s=engine.wait_timeout_s,
        on=engine.exchange.call,
    )


def abandon(engine):
    """Leave without :func:`close`'s handshake with the other ranks (local, bounded).

    For an engine still running when the interpreter exits: ``fit`` raised
    (Keras calls no ``on_train_end`` then), or a ``SyncStrategy`` was never
    finished.  Its control path's gRPC handler threads would otherwise keep
    the process alive forever.  The replicas' weights may differ; nothing is
    drained.  Also for a start that failed after rank 0's control server came up.
    """
    if engine not in _running:
        return
    engine.started = False
    _running.discard(engine)
    parts = engine.__dict__  # what a failed start got to build
    try:
        if "exchange" in parts:
            engine.exchange.close(timeout_s=ABANDON_JOIN_S)
    finally:
        if "control" in parts:
            engine.control.close()
        _release(engine)


def _release(engine):
    if engine._server is not None:
        engine._server.stop()
    engine._trace.close()


def _abandon_running():
    for engine in list(_running):
        try:
            engine.abandon()
        except Exception:  # exiting anyway: one engine's failure must not keep the others
            pass
