"""What every rank agrees on before the first step: the configuration, t0, the control path.

Each runs once per :meth:`SyncEngine.start <tfsync.engine.SyncEngine.start>`
through the cluster's own collectives (Horovod's in production), so a job
whose ranks disagree stops with both sides named before any round runs, and
the control path's token reaches the workers over Horovod's channel, never
the control path itself.  Also here: the interpreter-exit hook that abandons
an engine still running, so a failed ``fit`` cannot leave the process hanging
on the control path's threads.
"""

import secrets
import threading
import time
import weakref

from tfsync.engine.address import choose as choose_control_address
from tfsync.engine.control import ControlServer

_running = weakref.WeakSet()  # engines started and not closed, in this process
_exit_hook_registered = False


def agree_config(cluster, config: dict) -> None:
    """Raise ``ValueError`` naming the ranks whose ``config`` differs from rank 0's, and how."""
    configs = cluster.allgather_object(config, name="tfsync.config")
    mismatched = [r for r, c in enumerate(configs) if c != configs[0]]
    if mismatched:
        diffs = {k: [c.get(k) for c in configs] for k in config if any(c.get(k) != configs[0].get(k) for c in configs)}
        raise ValueError(
            f"tfsync: ranks {mismatched} are configured differently from rank 0: "
            + "; ".join(f"{k} per rank = {v}" for k, v in diffs.items())
            + ". Every worker must run the same mode, model and straggler settings: "
            "launch the same script with the same arguments on every rank"
        )


def agree_t0(cluster) -> float:
    """Rank 0's clock, the job's t0 (every time in rounds and traces is relative to it)."""
    return cluster.broadcast_object(time.time(), root_rank=0, name="tfsync.t0")


def open_control(engine, cluster):
    """Rank 0 starts the control service; every rank learns its address and the job's token.

    Returns ``(server or None, address, token)``.  From here on the engine is
    abandoned at interpreter exit unless closed (:func:`leave_at_exit`).
    """
    server, contact = None, None
    if engine.rank == 0:
        token = secrets.token_hex(16)
        chosen = choose_control_address()
        try:
            server = ControlServer(
                engine.size, engine.t0, token, host=chosen.bind, advertise=chosen.advertise, policy=engine.policy
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (the address came from {chosen.source})") from exc
        contact = (server.address, token)
    engine._server = server
    leave_at_exit(engine)  # from here on something runs that must not outlive the process
    address, token = cluster.broadcast_object(contact, root_rank=0, name="tfsync.control_address")
    return server, address, token


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


def running(engine) -> bool:
    return engine in _running


def forget(engine) -> None:
    _running.discard(engine)


def _abandon_running():
    for engine in list(_running):
        try:
            engine.abandon()
        except Exception:  # exiting anyway: one engine's failure must not keep the others
            pass
