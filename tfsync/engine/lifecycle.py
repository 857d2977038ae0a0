"""An engine's life: what every rank agrees on before the first step, and how it ends.

Each runs once per :meth:`SyncEngine.start <tfsync.engine.SyncEngine.start>`
through the cluster's own collectives (Horovod's in production), each bounded
by the engine's wait bound (:func:`tfsync.engine.bounded.run_bounded`: a rank
that does not come stops every rank with an error naming it), so a job
whose ranks disagree stops with both sides named before any round runs, and
the control path's token reaches the workers over Horovod's channel, never
the control path itself (its settings are checked earlier still, by
:class:`~tfsync.engine.settings.EngineSettings`, when a frontend is built).  An engine ends
with :func:`close` (collective) or,
when the interpreter exits with it still running, :func:`abandon` (local),
so a failed ``fit`` cannot leave the process hanging on the control path's
threads.
"""

import logging
import secrets
import socket
import threading
import time
import weakref

from tfsync import _env
from tfsync.control import ControlServer, topology
from tfsync.control.address import choose as choose_control_address
from tfsync.control.address import choose_relay as choose_relay_address
from tfsync.control.relay import HostRelay
from tfsync.engine.components import bindings
from tfsync.engine.bounded import run_bounded

log = logging.getLogger("tfsync.control")

ABANDON_JOIN_S = 2.0  # at exit, how long an unclosed engine waits for its communication thread

_running = weakref.WeakSet()  # engines started and not closed, in this process
_exit_hook_registered = False


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
    """Raise ``ValueError`` naming the ranks whose ``config`` differs from rank 0's, and the first
    difference (collective, bounded by ``timeout_s``; :func:`check_agreement`).  Returns every
    rank's host name, in rank order (gathered with the configs: the errors name the host of a
    rank at fault)."""
    gathered = run_bounded(
        cluster,
        lambda: cluster.allgather_object((config, socket.gethostname()), name="tfsync.config"),
        name="tfsync.config",
        purpose="every rank's mode, model and straggler settings, gathered when the engine starts to check they match",
        timeout_s=timeout_s,
    )
    check_agreement([c for c, _ in gathered], "mode, model and straggler settings")
    return [h for _, h in gathered]


def check_agreement(
    configs: list, what: str, fix: str = "launch the same script with the same arguments on every rank"
):
    """Raise ``ValueError`` if any rank's config (``configs``, in rank order, plain data) differs
    from rank 0's: the error names those ranks and, for the first of them, only the first
    difference (``rank 1: variable dense_1/kernel dtype float16, rank 0 float32``), not the
    whole config, which may list every variable of a model.  ``what``: what the configs hold, in
    words; ``fix``: how to make them agree."""
    mismatched = [r for r, c in enumerate(configs) if c != configs[0]]
    if mismatched:
        r = mismatched[0]
        raise ValueError(
            f"tfsync: ranks {mismatched} are configured differently from rank 0 "
            f"(rank {r}: {first_difference(configs[r], configs[0])}). Every worker must run the same "
            f"{what}: {fix}"
        )


def first_difference(mine, rank0, where: str = "") -> str:
    """The first place where ``mine`` differs from rank 0's ``rank0`` (nested dicts and lists of
    plain data), in words: ``policy staleness 3, rank 0 2``.  A list's items that are dicts with
    a ``path`` (a model's variables) are named by it: ``variable dense/kernel dtype ...``."""
    if isinstance(mine, dict) and isinstance(rank0, dict):
        for key in [*mine, *(k for k in rank0 if k not in mine)]:
            at = f"{where} {key}".strip()
            if key not in rank0:
                return f"{at} {_short(mine[key])}, rank 0 has none"
            if key not in mine:
                return f"{at} missing, rank 0 {_short(rank0[key])}"
            if mine[key] != rank0[key]:
                return first_difference(mine[key], rank0[key], at)
    if isinstance(mine, list | tuple) and isinstance(rank0, list | tuple):
        for i, (a, b) in enumerate(zip(mine, rank0)):
            if a != b:
                return first_difference(a, b, _item(where, i, a, b))
        if len(mine) != len(rank0):
            extra = mine[len(rank0)] if len(mine) > len(rank0) else rank0[len(mine)]
            named = _item(where, min(len(mine), len(rank0)), extra, extra)
            return f"{where} {len(mine)} entries, rank 0 {len(rank0)} (the first unmatched: {named})".strip()
    return f"{where} {_short(mine)}, rank 0 {_short(rank0)}".strip()


def _item(where, i, a, b):
    """The name of item ``i`` of a list at ``where``: a variable by its path when both have it."""
    if isinstance(a, dict) and isinstance(b, dict) and a.get("path") and a.get("path") == b.get("path"):
        return f"variable {a['path']}"
    if isinstance(a, dict) and "path" in a:
        return f"variable #{i}"
    return f"{where}[{i}]"


def _short(value, limit=80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    """Rank 0 starts the control service; every rank learns its address and the job's token;
    the first rank of each host but rank 0's with several ranks starts the host's relay
    (:mod:`tfsync.control.relay`; ``TFSYNC_CONTROL_RELAYS``), and its host's ranks learn
    its address; past :data:`~tfsync.control.topology.GROUP_HOSTS` relaying hosts, the first of each group of
    them also starts the group's relay, which the group's host relays attach to
    (:func:`tfsync.control.topology.relays`),
    and rank 0's host's other ranks attach through a relay too (in rank 1's process).

    Returns ``(address, fallback, token)``: where this rank attaches (its host's relay, or rank
    0's service) and where it re-attaches if that is gone (collective, bounded by the engine's
    wait bound); rank 0's server is ``engine._server`` and the relays ``engine._relays`` (set before
    anything can fail, so :func:`abandon` stops them).  From here on the engine is abandoned at
    interpreter exit unless closed (:func:`leave_at_exit`).
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
                service=bindings.service(engine.policy, engine.size),
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} (the address came from {chosen.source})") from exc
        contact = (server.address, token)
    engine._server = server
    leave_at_exit(engine)  # from here on something runs that must not outlive the process
    address, token = run_bounded(
        cluster,
        lambda: cluster.broadcast_object(contact, root_rank=0, name="tfsync.control_address"),
        name="tfsync.control_address",
        purpose="the address and token of rank 0's control service, broadcast when the engine starts",
        timeout_s=engine.wait_timeout_s,
    )
    leaders, groups = topology.relays(engine.hosts, _env.control_relays())
    if not leaders:
        return address, None, token
    upstream, fallback = address, None
    if groups:
        group = None
        if groups.get(engine.rank) == engine.rank:
            group = _group_relay(address, token, engine.t0)
            if group is not None:
                engine._relays.append(group)
        heads = _gather_address(engine, cluster, group, "tfsync.group_relays", "the control group relays")
        if engine.rank in groups and heads[groups[engine.rank]] is not None:
            upstream, fallback = heads[groups[engine.rank]], address
    relay = None
    if leaders.get(engine.rank) == engine.rank:
        relay = HostRelay(upstream, token, engine.t0, fallback=fallback)
        engine._relays.insert(0, relay)  # (stopped before its group relay)
    relays = _gather_address(engine, cluster, relay, "tfsync.relays", "the hosts' control relays")
    leader = leaders.get(engine.rank)
    return (relays[leader], address, token) if leader is not None else (address, None, token)


def _gather_address(engine, cluster, relay, name, what):
    """Every rank's ``relay``'s address (None where it runs none), gathered (collective, bounded
    by the engine's wait bound)."""
    return run_bounded(
        cluster,
        lambda: cluster.allgather_object(relay.address if relay else None, name=name),
        name=name,
        purpose=f"the addresses of {what}, gathered when the engine starts",
        timeout_s=engine.wait_timeout_s,
    )


def _group_relay(address, token, t0):
    """A group relay (:mod:`tfsync.control.relay`) listening where the other hosts reach
    this one (as rank 0's service would, :func:`tfsync.control.address.choose_relay`); None, with a
    warning, where this host has no such address or it cannot listen there: its group's host
    relays then attach to rank 0 themselves."""
    try:
        return HostRelay(address, token, t0, host=choose_relay_address().bind)
    except RuntimeError as exc:
        log.warning("tfsync: no control group relay on this host (its group's relays go to rank 0): %s", exc)
        return None


def open_exchange(engine, cluster, protocol_cls):
    """The engine's :class:`~tfsync.engine.exchange.RoundExchange` over the round collective its
    protocol chooses, each call's bytes counted; sets the engine's ``compression``, ``wire_bytes``
    and ``wire_format`` (:mod:`tfsync.engine.compression`)."""
    from tfsync.engine.compression import counted, wire_settings
    from tfsync.engine.exchange import RoundExchange

    policy = engine.policy
    options = {**protocol_cls.exchange_options(), **engine.entry.exchange_options()}
    for c in engine.components:
        options.update(c.exchange_options())
    # the rounds' wire type, the range a contribution must keep to, every round's bytes
    engine.compression, engine.wire_bytes, engine.wire_format = wire_settings(policy, engine.size)
    collective = protocol_cls.collective(cluster, policy, options["averages"], engine.compression)
    abort = getattr(cluster, "abort", None)
    exchange = RoundExchange(
        counted(collective, engine.wire_bytes), engine.rank, engine.size, engine.t0, abort=abort, **options
    )

    def round_bytes(payload):  # (a paced round's pieces are cut from its bytes on the wire)
        return engine.wire_bytes.per_call([t.shape for t in payload], [t.dtype for t in payload])["bytes_sent"]

    exchange.wire_bytes = round_bytes
    if engine.wire_format is not None:  # (BSP's checked sum: a redone round checks the range too)
        exchange.in_range = engine.wire_format.in_range
    return exchange


def rest_steps(policy):
    """How often every worker of ``policy``'s engine is sure to be at rest
    (:meth:`SyncEngine.at_rest <tfsync.engine.SyncEngine.at_rest>`): every that many steps (1:
    after every step), or None (no step is sure to be)."""
    from tfsync.engine import protocols

    protocol = protocols.for_policy(policy)
    period = protocol.rest_steps(policy)
    if period is None or not all(c.rests for c in [*protocol.components(policy), *bindings.components(policy)]):
        return None
    return period


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
    """The cluster's barrier ``name`` on the exchange thread, after every round, bounded.

    A rank can finish its steps before a peer's stop notice reaches it (a coordinated round
    closed without the peer, which then stopped); the barrier then fails for want of that
    peer, and the peer's reason, if it announced one, is the error, not the barrier's."""
    try:
        run_bounded(
            engine.cluster,
            engine.cluster.barrier(name),
            name=name,
            purpose=purpose,
            timeout_s=engine.wait_timeout_s,
            on=engine.exchange.call,
        )
    except Exception as exc:
        diagnosis = getattr(engine, "_diagnosis", None)
        stop = diagnosis.peer_stop() if diagnosis is not None else None
        if stop is not None:
            raise stop from exc
        raise


def abandon(engine, leave=True):
    """Leave without :func:`close`'s handshake with the other ranks (local, bounded).

    For an engine still running when the interpreter exits: ``fit`` raised
    (Keras calls no ``on_train_end`` then), or a ``SyncStrategy`` was never
    finished.  Its control path's gRPC handler threads would otherwise keep
    the process alive forever.  The replicas' weights may differ; nothing is
    drained.  Also for a start that failed after rank 0's control server came up.

    ``leave``: tell rank 0 this worker left (bounded); ``False`` in an elastic reset, where
    every member abandons its engine and rank 0 its service (:meth:`ControlClient.close`).
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
            engine.control.close(leave=leave)
        _release(engine)


def _release(engine):
    try:
        for relay in engine._relays:  # (a host relay before its group relay)
            relay.stop()
    finally:
        if engine._server is not None:
            engine._server.stop()
        engine._trace.close()


def abandon_all():
    """Abandon every engine of this process that is still running (local, bounded, no leave):
    before an elastic reset re-forms Horovod (:mod:`tfsync.elastic`)."""
    _abandon_running(leave=False)


def _abandon_running(leave=True):
    for engine in list(_running):
        try:
            engine.abandon(leave=leave)
        except Exception:  # exiting anyway: one engine's failure must not keep the others
            pass
