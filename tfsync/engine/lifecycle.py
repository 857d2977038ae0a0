"""An engine's life: what it starts and how that ends, owned by one object (:class:`Life`).

Starting an engine starts things that must not outlive it: rank 0's control service, the
hosts' relays (:mod:`tfsync.control`), the exchange's threads, the worker's control link, the
trace file.  Each is recorded in the engine's :class:`Life` as it starts (before anything
after it can fail), and one object stops them all: :meth:`Life.close` (collective: every
rank's rounds done and every rank off the control path before rank 0's service stops) or,
when the interpreter exits with the engine still running, :meth:`Life.abandon` (local,
bounded), so a failed ``fit`` cannot leave the process hanging on the control path's threads.
The control path's token reaches the workers over Horovod's channel (:func:`open_control`),
never over the control path itself.  What the ranks agree on before all that is
:mod:`tfsync.engine.agreement`'s.
"""

import logging
import secrets
import sys
import threading
import weakref

import numpy as np

from tfsync import _env
from tfsync.control import ControlClient, ControlServer, topology
from tfsync.control.address import choose as choose_control_address
from tfsync.control.address import choose_relay as choose_relay_address
from tfsync.control.client import connect_bound
from tfsync.control.relay import HostRelay
from tfsync.engine import agreement, protocols
from tfsync.engine.bounded import run_bounded
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.components import bindings
from tfsync.engine.entry import CoordinatedRounds, OpenRounds
from tfsync.engine.nonfinite import NonFinite
from tfsync.engine.protocols import in_graph
from tfsync.engine.tally import Trace

log = logging.getLogger("tfsync.control")

ABANDON_JOIN_S = 2.0  # at exit, how long an unclosed engine waits for its communication thread

_running = weakref.WeakSet()  # what engines of this process started and did not close (Life)
_exit_hook_registered = False


class Life:
    """What one engine started, each recorded as it starts, stopped together.

    ``server`` (rank 0's control service), ``relays`` (this process's host and group relays, a
    host relay before its group relay), ``exchange`` (the rounds' threads), ``control`` (this
    worker's link) and ``trace`` (its trace file): None (or empty) until started.
    """

    def __init__(self, engine):
        self.engine = engine
        self.server, self.relays = None, []
        self.relay_owner = None  # the rank whose process runs this worker's host relay, when another's
        self.exchange = self.control = None
        self.trace = Trace(None, None)

    @property
    def running(self) -> bool:
        """Whether something started and was not stopped yet."""
        return self in _running

    def close(self):
        """Leave the control path and stop the threads (collective: every rank calls it).

        Two barriers on the exchange thread, after every round, each bounded: every rank is
        done with the control path before any leaves it, and every rank has left it (its
        stream ended, its channel closed) before rank 0 stops the server, so no server goes
        away under a worker's open stream.  A barrier that failed (a rank did not come within
        the bound) ends the job: everything is released all the same, or rank 0's server's
        threads would keep the process alive."""
        _running.discard(self)
        try:
            self._barrier(
                "tfsync.close",
                "the barrier every rank reaches, its rounds done, before any leaves the control path",
            )
            self.control.close()
            self._barrier(
                "tfsync.left",
                "the barrier every rank reaches once it left the control path, before rank 0 stops it",
                watched=False,  # (the control path it would be watched on is closed)
            )
        finally:
            try:
                self.exchange.close()
                self.control.close()
            finally:
                self.release()

    def _barrier(self, name, purpose, watched=True):
        """The cluster's barrier ``name`` on the exchange thread, after every round, bounded;
        ``watched``: its wait watched on the control path as a round's is (:meth:`SyncEngine.call
        <tfsync.engine.SyncEngine.call>`).

        A rank can finish its steps before a peer's stop notice reaches it (a coordinated round
        closed without the peer, which then stopped); the barrier then fails for want of that
        peer, and the peer's reason, if it announced one, is the error, not the barrier's."""
        engine = self.engine
        try:
            run_bounded(
                engine.cluster,
                engine.cluster.barrier(name),
                name=name,
                purpose=purpose,
                timeout_s=engine.wait_timeout_s,
                on=(lambda fn, timeout_s: engine.call(fn, timeout_s, f"the collective {name!r} ({purpose})"))
                if watched
                else self.exchange.call,
            )
        except Exception as exc:
            diagnosis = getattr(engine, "_diagnosis", None)
            stop = diagnosis.peer_stop() if diagnosis is not None else None
            if stop is not None:
                raise stop from exc
            raise

    def abandon(self, leave=True):
        """Stop what started without :meth:`close`'s handshake with the other ranks (local,
        bounded): for an engine still running when the interpreter exits (``fit`` raised, and
        Keras calls no ``on_train_end`` then; a ``SyncStrategy`` never finished), whose control
        path's gRPC handler threads would otherwise keep the process alive forever, and for a
        start that failed after rank 0's control server came up.  The replicas' weights may
        differ; nothing is drained.

        ``leave``: tell rank 0 this worker left (bounded); ``False`` in an elastic reset, where
        every member abandons its engine and rank 0 its service (:meth:`ControlClient.close
        <tfsync.control.client.ControlClient.close>`)."""
        if self not in _running:
            return
        _running.discard(self)
        try:
            if self.exchange is not None:
                self.exchange.close(timeout_s=ABANDON_JOIN_S)
        finally:
            if self.control is not None:
                self.control.close(leave=leave)
            self.release()

    def release(self):
        """Stop the relays and rank 0's service, close the trace."""
        try:
            for relay in self.relays:  # (a host relay before its group relay)
                relay.stop()
        finally:
            if self.server is not None:
                self.server.stop()
            self.trace.close()


def start(engine, tensors, extra_config=None) -> dict:
    """What :meth:`SyncEngine.start <tfsync.engine.SyncEngine.start>` does before its first step:
    decide once (the step protocol the policy names, the round entry, the components), check the
    model against the mode and the ranks against each other (:mod:`tfsync.engine.agreement`),
    agree on t0, then open the control path (:func:`open_control`), the wire and the exchange
    (:func:`open_exchange`), the protocol and this worker's link (:func:`attach`), each recorded
    in ``engine.life``.  Returns the configuration the ranks agreed on."""
    engine.cluster = cluster = engine._cluster if engine._cluster is not None else HorovodCluster()
    if not tensors:
        raise ValueError("tfsync: the model has no trainable weights to synchronize")
    engine.rank, engine.size = cluster.rank(), cluster.size()
    policy = engine.policy
    policy.validate(engine.size)
    engine.stragglers.validate(engine.size)
    agreement.check_trainable(tensors)
    protocol_cls = protocols.for_policy(policy)
    engine.entry = (CoordinatedRounds if policy.coordinated else OpenRounds)(engine)
    engine.shapes = [[int(d) for d in t.shape] for t in tensors]
    engine.num_params = int(sum(np.prod(s, dtype=np.int64) for s in engine.shapes))
    engine.nonfinite = NonFinite(engine.on_nonfinite)
    engine.components = [*protocol_cls.components(policy), *bindings.components(policy), engine.nonfinite]
    for c in engine.components:  # the model against the mode's settings, before any collective
        c.plan(engine.shapes, engine.num_params)
    config = {
        "policy": policy.config(),
        "num_params": engine.num_params,
        "weights": engine.shapes,
        "stragglers": engine.stragglers.spec(),
        "on_nonfinite": engine.on_nonfinite,
        # BSP's round in-graph, or the engine's (and why): the ranks must run the same collectives
        "step_path": in_graph.step_path(engine, protocol_cls, tensors),
        **(extra_config or {}),
    }
    engine.hosts = agreement.agree_config(cluster, config, engine.wait_timeout_s)
    engine.in_graph = config["step_path"] == in_graph.IN_GRAPH and len(set(engine.hosts)) == 1
    engine.t0 = agreement.agree_t0(cluster, engine.wait_timeout_s)
    address, fallback, token = open_control(engine, cluster)  # (rank 0's service, the relays)
    # the exchange first: a frontend may route the protocol's variable creation
    # (SyncStrategy broadcasts initial values) through it
    engine.exchange = open_exchange(engine, cluster, protocol_cls)  # (and engine.wire, opened once)
    engine.protocol = protocol_cls(tensors, engine.size, policy)
    engine.protocol.bind(engine)
    engine.control = attach(engine, address, fallback, token)
    return config


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
    wait bound); rank 0's server and the relays are recorded in ``engine.life`` as each
    starts, so :meth:`Life.abandon` stops them whatever fails after.  From here on the engine
    is abandoned at interpreter exit unless closed (:func:`leave_at_exit`).
    """
    life, contact = engine.life, None
    if engine.rank == 0:
        token = secrets.token_hex(16)
        chosen = choose_control_address()
        try:
            life.server = ControlServer(
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
        contact = (life.server.address, token)
    leave_at_exit(life)  # from here on something runs that must not outlive the process
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
                life.relays.append(group)
        heads = _gather_address(engine, cluster, group, "tfsync.group_relays", "the control group relays")
        if engine.rank in groups and heads[groups[engine.rank]] is not None:
            upstream, fallback = heads[groups[engine.rank]], address
    relay = None
    if leaders.get(engine.rank) == engine.rank:
        relay = HostRelay(upstream, token, engine.t0, fallback=fallback)
        life.relays.insert(0, relay)  # (stopped before its group relay)
    relays = _gather_address(engine, cluster, relay, "tfsync.relays", "the hosts' control relays")
    leader = leaders.get(engine.rank)
    life.relay_owner = leader if leader != engine.rank else None
    return (relays[leader], address, token) if leader is not None else (address, None, token)


def attach(engine, address, fallback, token):
    """This worker's :class:`~tfsync.control.client.ControlClient`, attached to ``address`` (its
    host's relay, or rank 0's service; ``fallback``: rank 0's, where it re-attaches if the relay is
    gone), its closings handed to the engine's round entry; recorded in ``engine.life``.  The first
    attach waits for the engine's wait bound at most (:func:`~tfsync.control.client.connect_bound`)."""
    engine.life.control = ControlClient(
        address,
        engine.rank,
        token,
        connect_timeout_s=connect_bound(engine.wait_timeout_s),
        on_close=engine.entry.on_close(),
        fallback=fallback,
        relay_owner=engine.life.relay_owner,
    )
    return engine.life.control


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
    """The engine's :class:`~tfsync.engine.exchange.RoundExchange` over the wire its protocol's
    round asks for (:func:`tfsync.engine.wire.open_wire`, opened once: ``engine.wire``), each
    call's bytes counted; recorded in ``engine.life``."""
    from tfsync.engine.exchange import RoundExchange
    from tfsync.engine.wire import open_wire

    options = engine.entry.exchange_options()
    for c in engine.components:
        options.update(c.exchange_options())
    round_ = protocol_cls.round(engine.policy)
    engine.wire = wire = open_wire(engine.policy, cluster, engine.size, round_)
    abort = getattr(cluster, "abort", None)
    exchange = RoundExchange(
        wire.collective, engine.rank, engine.size, engine.t0, abort=abort, averages=round_.averages, **options
    )
    exchange.wire_bytes = wire.round_bytes  # (a paced round's pieces are cut from its bytes on the wire)
    if wire.format is not None:  # (BSP's checked sum: a redone round checks the range too)
        exchange.in_range = wire.format.in_range
    engine.life.exchange = exchange
    return exchange


def rest_steps(policy):
    """How often every worker of ``policy``'s engine is sure to be at rest
    (:meth:`SyncEngine.at_rest <tfsync.engine.SyncEngine.at_rest>`): every that many steps (1:
    after every step), or None (no step is sure to be)."""
    protocol = protocols.for_policy(policy)
    period = protocol.rest_steps(policy)
    if period is None or not all(c.rests for c in [*protocol.components(policy), *bindings.components(policy)]):
        return None
    return period


def leave_at_exit(life):
    """Abandon what ``life`` holds at interpreter exit if it is still running then.

    The hook goes in ``threading``'s exit list (a private hook of the standard library, the only
    one early enough), which runs before Python joins the non-daemon threads, the gRPC server's
    handler pool among them (an ``atexit`` function runs after that join, too late).  It is
    registered after the server exists, so it runs before ``concurrent.futures`` joins that pool.
    """
    global _exit_hook_registered
    _running.add(life)
    if not _exit_hook_registered:
        threading._register_atexit(_at_exit)
        _exit_hook_registered = True


def abandon_all():
    """Abandon every engine of this process that is still running (local, bounded, no leave):
    before an elastic reset re-forms Horovod (:mod:`tfsync.elastic`)."""
    _abandon_running(leave=False)


def _at_exit():
    """Every engine still running when the interpreter exits: its peers are told why (a stop
    notice naming this rank), then it is abandoned (:func:`leave_at_exit`)."""
    for life in list(_running):
        try:
            _announce_exit(life)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    _abandon_running(leave=True)


def _announce_exit(life):
    """Tell the peers of ``life``'s engine (a stop notice, bounded) that this worker exits with
    its engine running, and why: the error its program ended on (``sys.last_value``, set by
    Python's report of an uncaught exception), when it ended on one.  Otherwise its exit reads
    to the peers waiting for its rounds as a worker that left, or a collective that failed with
    no loss reported, and their errors name no rank (a step that raised: the program's own
    error)."""
    if life.control is None:
        return
    error = getattr(sys, "last_value", None)
    why = (
        f"{type(error).__name__}: {error}"
        if error is not None
        else "its program ended without finishing training (fit raised, or a SyncStrategy was never finished)"
    )
    message = f"tfsync: rank {life.engine.rank} exited with its engine running: {why}"
    life.control.announce_stop("WorkerLostError", message[:2000], ranks=[life.engine.rank])


def _abandon_running(leave=True):
    for life in list(_running):
        try:
            life.engine.abandon(leave=leave)
        except Exception:  # exiting anyway: one engine's failure must not keep the others
            pass
