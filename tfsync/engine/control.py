"""Control path: which workers are alive and where their clocks are, served by rank 0.

gRPC (shipped with TensorFlow) carries it; messages are protobuf ``Struct``s,
so no wire format is written here.  Each worker holds one long-lived
``Attach`` stream, which carries rank 0's notices to it and tells each end
whether the other is still there (see "Links between hosts" below).  Workers
also report their clock, throttled: ``ControlClient.report``
sends at most one report per ``REPORT_INTERVAL_S`` (0.25 s) and has at most
one in flight, and a worker waiting for a round forces one report (of its
last pushed step) about once a second, so a wait that times out can say which
rank is behind from clocks at most about a second old.

Only this job's workers may use the service.  Rank 0 draws a random token per
job and hands it to the workers through the launch's own collective; every
call carries it as gRPC metadata (``tfsync-token``), and the server compares it
in constant time and refuses (``PERMISSION_DENIED``) any call without it, so a
stray process, or a worker of another job on the same host, cannot attach,
report clocks, stop or read this job's table and so cannot decide this job's
rounds.  Refusals are counted (``ControlServer.rejected``, ``"rejected"`` in
the table) and logged (logger ``tfsync.control``).  The token is checked as
the call arrives, on gRPC's polling thread, before its request is read or any
handler thread taken, and a refusal is answered by a thread of its own; the
``Attach`` streams, each holding a thread for the whole job, have their own
pool too.  So the workers' calls keep their threads: a flood of refused calls,
even from clients that withhold their request as long as the server would
wait for it, queues only behind other refusals and delays no ``Ready`` notice
past its round.  The token is not
encryption: the traffic is plaintext gRPC on one host or the cluster network,
readable by anyone who can capture that network.  The server listens only on
the address the workers use (chosen by :mod:`tfsync.engine.address`:
``TFSYNC_CONTROL_HOST``, else Horovod's Gloo interface, else the host name's
address), not on every interface.

Rounds of the coordinated policies (PSP, backup workers: rounds that close
without the slow workers) are decided here.  A worker whose contribution to
round ``r`` is in its outbox sends ``Ready(rank, r)``; rank 0's coordinator
thread evaluates the policy's pure ``close_round`` on the ready notices of
the oldest open round and the clock, and when it closes, appends
``[r, accepted ranks]`` to the closed list, which every worker's ``Attach``
stream carries in order.  A mode whose coordinator keeps more state runs it
here as the policy's service (:meth:`Policy.service`): workers ``Tell`` it
(fire-and-forget) and ``Ask`` it (answered at once), each message with a
topic (DSSP's synchronization controller, :mod:`tfsync.engine.grants`:
``pushed`` and ``grant``).  A worker whose contribution missed its round and
was delay-compensated (``compensate=``) offers it with ``Late(rank, r)`` for
the round ``r`` it is about to compute; the coordinator takes it if ``r`` is
still open, as an extra the policy's rule does not count, and the closing
names it: ``[r, accepted, late]``.  Each worker's communication thread enters the
round's allreduce on that notice (see ``exchange.py``), so the decision, not
any worker's local clock, fixes what every replica applies.  A worker whose
notice the round will take for certain (``Policy.accepts_ready``: the round
is the oldest open one and the policy takes every ready rank when it
closes, or the notice closed it with that rank) is told so in the answer
to ``Ready`` and enters at once; the coordinator checks at every closing
that it took each rank it told so, and stops the job if not.  Under PSP
(``Policy.enters_when_ready``) a ready worker enters without waiting for
the answer, so a closing that took every rank moves nobody: it is kept
here (:attr:`ControlServer.closed`) but not sent down the streams, which
then carry only the closings some rank is still waiting for.  BSP and SSP
need no coordinator: their rounds close when every worker has contributed,
which each worker's own allreduce enforces.

Links between hosts.  Both ends ping every connection (gRPC keepalive,
``KEEPALIVE_TIME_MS``, ``KEEPALIVE_TIMEOUT_MS``): a link that went down
without a word is noticed within seconds, while an outage of a couple of
seconds trips nothing (TCP delivers what it held once the link is back).  What
a stream's end means depends on where the worker runs.  On rank 0's host (it
connected from an address rank 0 listens on) nothing but the end of its
process can end its stream: rank 0 records the rank lost at once, and the
worker, when its stream breaks, reports rank 0 unreachable at once
(``host_lost``).  Across hosts a dropped connection and a dead process look
the same to rank 0 (gRPC's server tells a handler that its call ended, not
why), so a stream that ends without ``Leave`` leaves its rank detached
(``"detached"`` in the table), and rank 0 records it lost only if it has not
re-attached within ``RECONNECT_GRACE_S``.  The worker, when its stream breaks
while it is not closing, re-attaches with the same rank and token, saying how
many closings and stop notices it already has; the new stream resumes after
them, so none is delivered twice or skipped, and the losses and stop notices
come again whole.  Only when no re-attach gets through within the grace does
it report rank 0 unreachable.  A dead worker on another host is thus named
after the grace, a link that stays down after the keepalive bound and the
grace; a flap that heals within the grace costs nothing.  Meanwhile the
workers' other calls wait for the connection (within their deadlines) rather
than fail, and a table query that goes unanswered does not read as rank 0
lost: only the stream decides that.

A worker that stops (a wait timed out, a peer was lost) calls ``Stop`` with
its reason before it exits; rank 0 pushes the notice on every stream, each
worker confirms it has read it (``Seen``), and ``Stop`` answers once all have
(at most ``STOP_NOTICE_GRACE_S``), so the others name the stop's cause, not
the stopping rank's vanished connection.
"""

import collections
import hmac
import ipaddress
import itertools
import logging
import socket
import threading
import time
import urllib.parse
from concurrent import futures

import grpc
from google.protobuf import json_format, struct_pb2

from tfsync.policies.base import decide_round

SERVICE = "tfsync.Control"
TOKEN_METADATA_KEY = "tfsync-token"

# Timing of the control path (seconds).
REPORT_INTERVAL_S = 0.25  # at most one clock report per this, and one in flight
REPORT_TIMEOUT_S = 5.0  # deadline of one (fire-and-forget) clock report
CONNECT_TIMEOUT_S = 30.0  # how long a worker waits for rank 0's control service
CALL_TIMEOUT_S = 2.0  # deadline of Leave and Table calls
STOP_CALL_TIMEOUT_S = 3.0  # deadline of a Stop call (the server holds it up to STOP_NOTICE_GRACE_S)
STOP_NOTICE_GRACE_S = 2.0  # Stop answers once every attached worker confirmed the notice, or after this
STOP_NOTICE_POLL_S = 0.05  # how often a held Stop call rechecks the confirmations
STREAM_WAKE_S = 0.5  # an Attach stream's condition wait: rechecks end/shutdown this often
SERVER_STOP_WAIT_S = 2.0  # how long ControlServer.stop waits for the gRPC server to end
WATCHER_JOIN_S = 2.0  # how long ControlClient.close waits for its stream reader to end
REJECTION_LOG_INTERVAL_S = 1.0  # at most one logged warning about refused calls per this
REJECTIONS_KEPT = 100  # ControlServer.rejected keeps the first this many
READY_TIMEOUT_S = 5.0  # deadline of one (fire-and-forget) ready notice
LATE_TIMEOUT_S = 5.0  # deadline of one late-contribution offer (the worker waits for the answer)
ASK_TIMEOUT_S = 5.0  # deadline of one question to the policy's service (the worker waits for the answer)
COORDINATOR_WAKE_S = 0.5  # the coordinator rechecks shutdown at least this often

# Links between hosts.  A flap of a few seconds must not end a job; a
# dead worker or a link that stays down must still be named within seconds.
# How long a worker on another host may take to re-attach after its stream ended without
# Leave before rank 0 records it lost, and how long a worker whose stream broke retries
# before it reports rank 0 unreachable: a 2 s outage plus a reconnection (within
# RECONNECT_BACKOFF_MS[1] of the link's return) fits with room to spare, and a dead worker is
# still named before a survivor's failed collective stops waiting for the name
# (diagnosis.LOSS_SETTLE_S, the grace + 3 s; tests/single/test_control_link.py checks the order)
RECONNECT_GRACE_S = 4.0
# Both ends ping each connection this often (gRPC has no keepalive by default: a link that
# went down silently was never noticed) ...
KEEPALIVE_TIME_MS = 1000
# ... and drop it when a ping is not answered within this: a ping caught by a 2 s outage is
# delivered by TCP's retransmission backoff (200 ms, doubling) about 3 s after the outage
# began, so a 2 s flap trips nothing, and a dead link is noticed within 5 s
KEEPALIVE_TIMEOUT_MS = 4000
# The server accepts pings this close together: under KEEPALIVE_TIME_MS, or gRPC answers a
# worker's keepalive with GOAWAY "too_many_pings" and drops its connection
MIN_PING_INTERVAL_MS = 500
# A worker's first and longest wait between attempts to reconnect (gRPC's defaults, 1 s
# growing to 120 s, would let a link come back seconds before the worker noticed)
RECONNECT_BACKOFF_MS = (100, 500)
# One connection attempt gives up after this, and the next starts (gRPC's default, 20 s,
# would keep an attempt whose SYN an outage swallowed pending past RECONNECT_GRACE_S)
CONNECT_ATTEMPT_MS = 1000

# Threads of rank 0's server.  Each Attach stream holds one for the whole job, so streams
# have a pool of their own (two per rank: a re-attached rank's old stream may still be
# winding down), and a refused call is answered by a pool of its own: a flood of calls
# without the token queues there, never in front of a worker's call.  (gRPC's per-method
# pools: the mechanism its own health service uses for its Watch streams.)
UNARY_SPARE_THREADS = 4  # the workers' unary calls: a thread per rank (each may hold a Stop call) plus these
STREAM_THREADS_PER_RANK = 2
REFUSAL_THREADS = 1  # a refusal reads nothing and only answers: one thread keeps pace

log = logging.getLogger("tfsync.control")


def _encode(message: dict) -> bytes:
    s = struct_pb2.Struct()
    s.update(message)
    return s.SerializeToString()


def _decode(data: bytes) -> dict:
    s = struct_pb2.Struct()
    s.ParseFromString(data)
    return json_format.MessageToDict(s)


def _check_token(token) -> str:
    if (
        not isinstance(token, str)
        or not token
        or not token.isascii()
        or not token.isprintable()
        or token != token.strip()
    ):
        raise ValueError(
            f"tfsync: the control token must be a non-empty str of printable ASCII without "
            f"surrounding whitespace (rank 0 draws it with secrets.token_hex(16)); got {token!r} "
            f"of type {type(token).__name__}"
        )
    return token


def _host_port(host: str, port) -> str:
    if ":" in host and not host.startswith("["):  # an IPv6 literal
        host = f"[{host}]"
    return f"{host}:{port}"


# gRPC channel arguments of both ends (see the timing constants above for why each value)
_KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # the bound gRPC 1.85 applies to a keepalive ping's answer (60 s unless set; with
    # keepalive_timeout_ms alone a stalled link was still open after 12 s)
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # keepalive pings need no data between them
)
SERVER_OPTIONS = _KEEPALIVE_OPTIONS + (
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),  # never drop a worker's connection for its pings
    # gRPC binds with SO_REUSEPORT by default: a second job's rank 0 on the same fixed port
    # (TFSYNC_CONTROL_PORT) would then share it, splitting the workers between two services
    ("grpc.so_reuseport", 0),
)
CHANNEL_OPTIONS = _KEEPALIVE_OPTIONS + (
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),  # (gRPC's name for the connect timeout)
)


def _addresses_of(host: str) -> frozenset:
    """The IP addresses a server bound to ``host`` listens on (empty if it resolves to none).

    A worker on the server's host connects from one of them (the kernel takes the
    destination's own address as the source); for a loopback name both 127.0.0.1
    and ::1 (gRPC binds both for ``localhost``; a connection to another 127.x
    address comes from 127.0.0.1).  A misjudged peer is safe either way: a local
    one taken for remote is named after the grace, a remote one taken for local
    is named at once, as before the grace existed.
    """
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return frozenset()
    ips = {ip for ip in (_ip(info[4][0]) for info in infos) if ip is not None}
    if any(ip.is_loopback for ip in ips):
        ips |= {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    return frozenset(ips)


def _ip(text):
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


def _peer_ip(peer: str):
    """The IP address of a gRPC peer (``ipv4:10.0.0.2:5000``, ``ipv6:[::1]:5000``), or None."""
    kind, _, rest = urllib.parse.unquote(peer or "").partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    return _ip(rest.rpartition(":")[0].strip("[]"))


def _token_of(metadata):
    """The token a call carries (bytes), or None."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    return None


def _pooled(behavior, pool):
    """``behavior`` run by ``pool`` instead of the server's default pool (gRPC's per-method pools)."""
    behavior.experimental_thread_pool = pool
    return behavior


class _Gate(grpc.GenericRpcHandler):
    """Admits this job's calls to their handlers and hands every other call to a refusal.

    gRPC asks this on its polling thread, before the call's request is read or any pool
    thread taken: a call without the token never waits in a pool for its request (a
    client that withholds it once held a worker thread until its deadline), and its
    refusal reads nothing and runs on the refusal pool.
    """

    def __init__(self, admits, handlers, refusals):
        self._admits, self._handlers, self._refusals = admits, handlers, refusals

    def service(self, handler_call_details):
        handler = self._handlers.get(handler_call_details.method)
        if handler is None or self._admits(handler_call_details.invocation_metadata):
            return handler  # (None: an unknown method, which gRPC answers UNIMPLEMENTED)
        return self._refusals[handler_call_details.method]


class ControlServer:
    """Runs on rank 0: the live clock table and the set of lost ranks."""

    def __init__(
        self,
        size: int,
        t0: float,
        token: str,
        host: str = "localhost",
        policy=None,
        advertise=None,
        port: int = 0,
        service=None,
    ):
        """Binds ``host`` (one address or name, not every interface); ``address`` is
        ``advertise:port`` (default ``host``), what the workers dial.  ``policy``: a coordinated
        policy closes rounds here; ``service``: what the mode's coordinator keeps beyond that
        (DSSP's controller, :mod:`tfsync.engine.bindings`), or None."""
        self.size, self.t0 = size, t0
        self._token = _check_token(token).encode("ascii")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._clocks = [-1] * size
        self._last_seen = [0.0] * size
        self._lost = {}
        self._stopped = {}
        self._stops_seen = {}  # attached rank -> how many stop notices its worker confirmed reading
        self._left = set()
        # a worker that connects from an address this server listens on runs on this host:
        # no network lies between them, so its stream ends only when its process does
        self._own_ips = _addresses_of(host)
        self._streams = {}  # attached rank -> the id of its current Attach stream
        self._stream_ids = itertools.count(1)
        self._detached = {}  # rank whose stream ended without Leave -> (stream id, at_s, grace timer)
        self.reattached = collections.Counter()  # rank -> how many times it re-attached
        self.rejected = []  # the first REJECTIONS_KEPT refused calls: {"method", "peer", "at_s"}
        self.rejected_count = 0
        self._last_rejection_log = float("-inf")
        self._rejections_unlogged = 0
        self._stopping = threading.Event()
        self._policy = policy if policy is not None and policy.coordinated else None
        # what the mode's coordinator keeps beyond closing rounds (DSSP's controller), if anything
        self._service = service
        self._ready = {}  # open round -> [(rank, ready_s)] in arrival order
        self._closed = []  # [round, [accepted ranks]] (+ [late ranks] when any) in round order
        # the closings the streams carry: all of them, but, for a policy whose ready ranks enter
        # on their own (enters_when_ready), not one that took every rank: each entered already
        self._closings = []
        self._enters_when_ready = self._policy is not None and self._policy.enters_when_ready
        self._late = {}  # round -> ranks whose late, compensated contribution it takes
        self._early = {}  # open round -> ranks told at their ready notice that it takes them
        self._opened_s = time.time() - t0  # when the oldest open round opened (the previous close)
        self._recheck_s = None  # when the policy asked to be asked again (a timeout), if it did
        self._policy_failed = False
        self._coordinator_wake = threading.Condition(self._lock)  # a new recheck time, or stopping
        self._pools = [
            futures.ThreadPoolExecutor(size + UNARY_SPARE_THREADS, thread_name_prefix="tfsync-control"),
            futures.ThreadPoolExecutor(STREAM_THREADS_PER_RANK * size, thread_name_prefix="tfsync-control-stream"),
            futures.ThreadPoolExecutor(REFUSAL_THREADS, thread_name_prefix="tfsync-control-refusal"),
        ]
        unary_pool, stream_pool, refusal_pool = self._pools
        self._server = grpc.server(unary_pool, options=SERVER_OPTIONS)
        unary = lambda fn: grpc.unary_unary_rpc_method_handler(  # noqa: E731
            fn, request_deserializer=_decode, response_serializer=_encode
        )
        handlers = {
            "Attach": grpc.unary_stream_rpc_method_handler(
                _pooled(lambda request, context: self._attach(request, context), stream_pool),
                request_deserializer=_decode,
                response_serializer=_encode,
            ),
            "Report": unary(self._report),
            "Ready": unary(self._ready_notice),
            "Late": unary(self._late_notice),
            "Tell": unary(self._tell),
            "Ask": unary(self._ask),
            "Leave": unary(self._leave),
            "Stop": unary(self._stop),
            "Seen": unary(self._seen),
            "Table": unary(self._table),
        }
        # a refusal takes its request as a stream it never reads: answering it waits for nothing
        refusals = {
            name: grpc.stream_unary_rpc_method_handler(
                _pooled(lambda requests, context, name=name: self._refuse(name, context), refusal_pool)
            )
            for name in handlers
        }
        self._server.add_generic_rpc_handlers(
            [
                _Gate(
                    self._admits,
                    {f"/{SERVICE}/{name}": h for name, h in handlers.items()},
                    {f"/{SERVICE}/{name}": h for name, h in refusals.items()},
                )
            ]
        )
        bind, fixed_port = _host_port(host, port), port
        try:
            port = self._server.add_insecure_port(bind)
            failure = None
        except Exception as exc:  # grpcio raises RuntimeError("Failed to bind ...") in recent versions
            port, failure = 0, exc
        if not port:
            self._server.stop(None)
            self._shut_pools()
            raise RuntimeError(
                f"tfsync: rank 0 could not open its control service on host {host!r} ({bind}"
                f"{': ' + str(failure) if failure else ''}); set TFSYNC_CONTROL_HOST to an "
                f"address of this machine that the workers can reach"
                + (", and TFSYNC_CONTROL_PORT to a free port (or 0)" if fixed_port else "")
            )
        self.port = port
        self.address = _host_port(advertise or host, port)
        self._server.start()
        if self._policy is not None:
            self._coordinator = threading.Thread(target=self._coordinate, daemon=True, name="tfsync-coordinator")
            self._coordinator.start()

    # -- access control -------------------------------------------------------------

    def _admits(self, metadata) -> bool:
        """Whether a call's metadata carries this job's token (compared in constant time)."""
        sent = _token_of(metadata)
        return sent is not None and hmac.compare_digest(sent, self._token)

    def _refuse(self, method, context):
        """Record a call without this job's token and abort it (on the refusal pool)."""
        sent = _token_of(context.invocation_metadata())
        peer = context.peer()
        now = time.monotonic()
        with self._lock:
            self.rejected_count += 1
            if len(self.rejected) < REJECTIONS_KEPT:
                self.rejected.append({"method": method, "peer": peer, "at_s": time.time() - self.t0})
            self._rejections_unlogged += 1
            say = now - self._last_rejection_log >= REJECTION_LOG_INTERVAL_S
            if say:
                self._last_rejection_log = now
                count, self._rejections_unlogged = self._rejections_unlogged, 0
        if say:
            log.warning(
                "tfsync: refused %s from %s: %s (%d refused call(s) since the last warning, %d in all)",
                method,
                peer,
                "its token did not match this job's" if sent is not None else "it carried no token",
                count,
                self.rejected_count,
            )
        context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"tfsync: the token did not match this job: a process that is not one of this job's "
            f"workers, or a worker of another job, called the control service of rank 0 at "
            f"{self.address}",
        )

    # -- service ----------------------------------------------------------------------

    def _attach(self, request, context):
        """A worker's stream: losses, stop notices and round closings, in order.

        ``request``: ``rank``, and on a re-attach how many closings and stop notices
        the worker already has (``closings``, ``stops``): the stream resumes there.
        """
        rank = int(request["rank"])
        local = _peer_ip(context.peer()) in self._own_ips
        with self._lock:
            stream = next(self._stream_ids)
            # a stream this one replaces (its worker gave up on it before this end noticed) sees this and ends
            replaced = self._streams.get(rank)
            self._streams[rank] = stream
            detached = self._detached.pop(rank, None)
            if detached is not None:
                detached[2].cancel()
            if detached is not None or replaced is not None:
                self.reattached[rank] += 1
            self._last_seen[rank] = time.time() - self.t0
            self._stops_seen[rank] = int(request.get("stops", 0))
            told_closings = min(int(request.get("closings", 0)), len(self._closings))
            self._changed.notify_all()
        if detached is not None:
            log.warning(
                "tfsync: rank %d re-attached to the control path %.1f s after its stream ended",
                rank,
                time.time() - self.t0 - detached[1],
            )

        def on_end():
            with self._lock:
                if self._streams.get(rank) != stream:  # replaced by a re-attach: nothing ended
                    return
                del self._streams[rank]
                self._stops_seen.pop(rank, None)
                self._changed.notify_all()
                if rank in self._left or self._stopping.is_set():
                    return
                if local:  # nothing between it and this host could have dropped: its process ended
                    self._record_lost(rank, time.time() - self.t0, "its process or connection ended")
                    return
                timer = threading.Timer(RECONNECT_GRACE_S, self._grace_over, args=(rank, stream))
                timer.daemon = True
                self._detached[rank] = (stream, time.time() - self.t0, timer)
                timer.start()

        if not context.add_callback(on_end):  # the call ended already (gRPC then never calls it)
            on_end()
        yield {"attached": rank, "local": int(local)}
        # Push every loss to every worker at once: if rank 0 goes down right after
        # (it stops too), the others still know whom they lost first.
        # Round closings go out in order, each once, in the same stream (and, after a
        # re-attach, from the first one the worker does not have).
        told = (0, 0, told_closings)
        while True:
            with self._lock:
                while (
                    (len(self._lost), len(self._stopped), len(self._closings)) == told
                    and self._streams.get(rank) == stream
                    and not self._stopping.is_set()
                ):
                    self._changed.wait(STREAM_WAKE_S)
                if self._streams.get(rank) != stream or self._stopping.is_set():
                    return
                closed = self._closings[told[2] :]
                told = (len(self._lost), len(self._stopped), len(self._closings))
                message = {"lost": list(self._lost.values()), "stopped": list(self._stopped.values()), "closed": closed}
            yield message

    def _record_lost(self, rank, at_s, reason):
        """Record ``rank`` lost (lock held); every stream pushes it."""
        self._lost.setdefault(rank, {"rank": rank, "clock": self._clocks[rank], "at_s": at_s, "reason": reason})
        self._changed.notify_all()

    def _grace_over(self, rank, stream):
        """A worker on another host did not re-attach within the grace: it is lost."""
        with self._lock:
            detached = self._detached.get(rank)
            if detached is None or detached[0] != stream or self._stopping.is_set():
                return
            del self._detached[rank]
            if rank not in self._left:
                self._record_lost(
                    rank,
                    detached[1],
                    f"its connection to rank 0 ended and it did not re-attach within {RECONNECT_GRACE_S:g} s: "
                    f"its process ended or stopped answering, or the link between its host and rank 0's stayed down",
                )

    def _report(self, request, context):
        rank = int(request["rank"])
        with self._lock:
            self._clocks[rank] = max(self._clocks[rank], int(request["clock"]))
            self._last_seen[rank] = time.time() - self.t0
        return {"ok": 1}

    def _ready_notice(self, request, context):
        """A worker's contribution to a round is in its outbox (coordinated policies).

        The answer's ``accepted`` is 1 when the round will aggregate it for
        certain: the notice closed the round with this rank in it, or the
        round is the oldest open one and the policy accepts every ready rank
        when it closes (``Policy.accepts_ready``).  The worker then enters the
        round's allreduce at once, without waiting for the closing on its
        stream (:meth:`RoundExchange.enter_accepted`); 0 means "follow the
        closing" (a round not yet the oldest open, or one closed without it).
        """
        rank, round_ = int(request["rank"]), int(request["round"])
        accepted = 0
        with self._lock:
            next_open = self._closed[-1][0] + 1 if self._closed else 0
            # a notice for a round already closed is late: that worker drops the contribution
            ready = self._ready.setdefault(round_, []) if self._policy is not None and round_ >= next_open else None
            # a repeated notice (a retried call) must not count twice toward "all ready"
            if ready is not None and all(r != rank for r, _ in ready):
                ready.append((rank, time.time() - self.t0))
                if round_ == next_open:  # decide here: one thread hand-off less than the coordinator
                    self._decide_locked(time.time() - self.t0)
                # no notify_all otherwise: the streams care only about closings (and losses)
            if round_ == next_open and self._policy is not None and not self._policy_failed:
                if round_ < len(self._closed):  # this notice closed it (rounds close in order from 0)
                    accepted = int(rank in self._closed[round_][1])
                elif self._policy.accepts_ready:  # (its notice is in ``ready`` now)
                    self._early.setdefault(round_, set()).add(rank)
                    accepted = 1
        return {"ok": 1, "accepted": accepted}

    def _late_notice(self, request, context):
        """A worker offers a delay-compensated contribution to the round it is about to compute
        (its weights are that round's): taken if the round is still open."""
        rank, round_ = int(request["rank"]), int(request["round"])
        with self._lock:
            next_open = self._closed[-1][0] + 1 if self._closed else 0
            if self._policy is None or round_ != next_open:
                return {"joined": 0}
            late = self._late.setdefault(round_, [])
            if rank not in late:
                late.append(rank)
        return {"joined": 1}

    def _tell(self, request, context):
        """A message for the policy's service (fire-and-forget; ignored when there is none)."""
        if self._service is not None:
            self._service.tell(int(request["rank"]), request["topic"], request, time.time() - self.t0)
        return {"ok": 1}

    def _ask(self, request, context):
        """A question for the policy's service, answered at once."""
        if self._service is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tfsync: rank {request.get('rank')} asked {request.get('topic')!r} but this job's mode "
                f"runs no service on rank 0",
            )
        return self._service.ask(int(request["rank"]), request["topic"], request, time.time() - self.t0)

    def _decide_locked(self, now):
        """Apply the policy to the oldest open round (lock held); the recheck time, or None.

        Runs in the ``Ready`` handler when a notice arrives and in the
        coordinator thread when a timeout is due.
        """
        round_ = self._closed[-1][0] + 1 if self._closed else 0
        if self._policy_failed:
            return None
        try:
            decision = decide_round(self._policy, tuple(self._ready.get(round_, ())), self._opened_s, now, self.size)
        except Exception as exc:  # a policy bug must stop the job, not hang it
            log.exception("tfsync: the coordinator's policy failed")
            self._fail_policy(f"failed on round {round_}: {type(exc).__name__}: {exc}")
            return None
        if decision.accepted is None:
            if decision.recheck_s != self._recheck_s:
                self._recheck_s = decision.recheck_s
                self._coordinator_wake.notify()
            return decision.recheck_s
        entry = [round_, [int(r) for r in decision.accepted]]
        early = self._early.pop(round_, set())
        if not early <= set(entry[1]):  # those ranks entered its allreduce already: the job cannot go on
            self._fail_policy(
                f"accepted {entry[1]} on round {round_} but ranks {sorted(early)} were told at their ready notice that "
                f"it would take them (a policy with accepts_ready = True must accept every ready rank)",
            )
            return None
        late = self._late.pop(round_, None)
        if late:  # extras: a policy's rule counts only the fresh contributions
            entry.append(sorted(late))
        self._closed.append(entry)
        self._ready.pop(round_, None)
        self._opened_s, self._recheck_s = now, None
        if not (self._enters_when_ready and len(entry) == 2 and len(entry[1]) == self.size):
            self._closings.append(entry)
            self._changed.notify_all()
        # the next round may be decidable already (its notices came early)
        return self._decide_locked(now)

    def _fail_policy(self, what):
        """Stop the job: the policy's decision is unusable (lock held); ``what`` it did."""
        self._policy_failed = True
        self._stopped.setdefault(
            0,
            {
                "rank": 0,
                "kind": "RuntimeError",
                "message": f"the coordinator's {type(self._policy).__name__}.close_round {what}",
            },
        )
        self._changed.notify_all()

    def _coordinate(self):
        """Close rounds whose rule needs the clock (a timeout) rather than a new notice."""
        with self._lock:
            self._decide_locked(time.time() - self.t0)  # a policy that cannot decide fails now
            while not self._stopping.is_set() and not self._policy_failed:
                now = time.time() - self.t0
                recheck = self._recheck_s
                if recheck is not None and now >= recheck:
                    recheck = self._decide_locked(now)
                wait = COORDINATOR_WAKE_S if recheck is None else min(COORDINATOR_WAKE_S, max(recheck - now, 0.0))
                self._coordinator_wake.wait(wait)

    @property
    def closed(self):
        """``[round, [accepted ranks]]`` for every closed round so far (coordinated policies),
        with a third item, the ranks whose late compensated contribution it took, when any."""
        with self._lock:
            return [list(c) for c in self._closed]

    def _leave(self, request, context):
        with self._lock:
            self._left.add(int(request["rank"]))
        return {"ok": 1}

    def _stop(self, request, context):
        # Answer only once every attached worker has confirmed reading the notice (Seen),
        # or after STOP_NOTICE_GRACE_S: the stopping rank may exit right after, and if it
        # is rank 0 the others must already know why, not just that rank 0 vanished.
        # A stream's write is no proof: gRPC finishes a send once the bytes are in the
        # transport, and when rank 0's process ends its connections reset, which can
        # take unread messages with them (the others would report "lost rank 0" instead of its reason).
        deadline = time.monotonic() + STOP_NOTICE_GRACE_S
        with self._lock:
            self._stopped.setdefault(int(request["rank"]), dict(request))
            self._changed.notify_all()
            count = len(self._stopped)
            while (
                any(n < count for n in self._stops_seen.values())
                and time.monotonic() < deadline
                and not self._stopping.is_set()
            ):
                self._changed.wait(STOP_NOTICE_POLL_S)
        return {"ok": 1}

    def _seen(self, request, context):
        """A worker has read the first ``stops`` stop notices (what a held Stop call waits for)."""
        rank = int(request["rank"])
        with self._lock:
            if rank in self._stops_seen:
                self._stops_seen[rank] = max(self._stops_seen[rank], int(request["stops"]))
                self._changed.notify_all()
        return {"ok": 1}

    def _table(self, request, context):
        with self._lock:
            return {
                "clocks": list(self._clocks),
                "last_seen_s": list(self._last_seen),
                "lost": list(self._lost.values()),
                # streams that ended without Leave, within their re-attach grace
                "detached": sorted(self._detached),
                "rejected": self.rejected_count,
            }

    def stop(self):
        self._stopping.set()
        with self._lock:
            self._changed.notify_all()
            self._coordinator_wake.notify_all()
            timers = [timer for _, _, timer in self._detached.values()]
        for timer in timers:
            timer.cancel()
        # every rank has left (close() runs a barrier first): no grace period needed
        self._server.stop(grace=None).wait(SERVER_STOP_WAIT_S)
        self._shut_pools()

    def _shut_pools(self):
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)


class ControlClient:
    """A worker's end of the control path."""

    def __init__(
        self, address: str, rank: int, token: str, connect_timeout_s: float = CONNECT_TIMEOUT_S, on_close=None
    ):
        self.address, self.rank = address, rank
        self._on_close = on_close
        self._closes_seen = 0
        # fire-and-forget calls in flight: gRPC cancels a call whose future is collected
        self._ready_calls = collections.deque(maxlen=4)
        self._seen_calls = collections.deque(maxlen=8)
        self._metadata = ((TOKEN_METADATA_KEY, _check_token(token)),)
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        method = lambda name: self._channel.unary_unary(  # noqa: E731
            f"/{SERVICE}/{name}", request_serializer=_encode, response_deserializer=_decode
        )
        self._report, self._leave, self._table = method("Report"), method("Leave"), method("Table")
        self._ready, self._late = method("Ready"), method("Late")
        self._tell, self._ask = method("Tell"), method("Ask")
        self._stop, self._seen = method("Stop"), method("Seen")
        self._closing = False
        self._channel_closed = False
        self.host_lost = None
        self.known_lost = []
        self.known_stopped = []
        self.reattached = 0  # how many times its stream broke and it re-attached
        self._local = False  # rank 0 said this worker runs on its host (from the stream's first message)
        self._last_table = {"clocks": [], "last_seen_s": [], "lost": []}
        self._inflight = None
        self._last_report = float("-inf")
        self._attach_error = None
        self._attach = self._channel.unary_stream(
            f"/{SERVICE}/Attach", request_serializer=_encode, response_deserializer=_decode
        )
        self._stream_lock = threading.Lock()  # a re-attach does not start once close() has begun
        self._stream = self._attach({"rank": rank}, wait_for_ready=True, timeout=None, metadata=self._metadata)
        first = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(first,), daemon=True, name="tfsync-control-watch")
        self._watcher.start()
        if not first.wait(connect_timeout_s):
            raise TimeoutError(
                f"tfsync: rank {rank} could not reach the control service of rank 0 at {address} "
                f"within {connect_timeout_s:.0f} s; check that rank 0 is running and that this "
                f"host can reach it (or set TFSYNC_CONTROL_HOST to an address it can reach)"
            )
        error = self._attach_error
        if error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED:
            self._closing = True
            self._channel.close()
            raise PermissionError(
                f"tfsync: rank {rank}'s token was rejected by the control service at {address} "
                f"({error.details()}). Every worker must be started by the same launch "
                f"(horovodrun) so that they share rank 0's token"
            )

    def _watch(self, first):
        """Follow the stream; when it breaks, re-attach within the grace, else rank 0 is lost."""
        stream, confirmed, give_up, deadline = self._stream, None, None, None
        while True:
            attached = self._read(stream, first, confirmed)
            if give_up is not None:
                give_up.cancel()
            if self._closing or self._local:  # (on rank 0's host only its process's end ends a stream)
                break
            if attached:  # the grace runs from the end of a stream that worked
                deadline = time.monotonic() + RECONNECT_GRACE_S
                log.warning(
                    "tfsync: rank %d's control stream to rank 0 at %s broke; re-attaching for up to %g s",
                    self.rank,
                    self.address,
                    RECONNECT_GRACE_S,
                )
            elif deadline is None:  # its first attach failed: nothing to come back to
                break
            else:  # an attempt that did not get through: not at once again
                time.sleep(RECONNECT_BACKOFF_MS[0] / 1e3)
            if time.monotonic() >= deadline:
                log.warning(
                    "tfsync: rank %d could not re-attach to rank 0 at %s within %g s",
                    self.rank,
                    self.address,
                    RECONNECT_GRACE_S,
                )
                break
            started = self._reattach(deadline)
            if started is None:
                break
            stream, confirmed, give_up = started
        if not self._closing:
            self.host_lost = time.time()
        first.set()

    def _reattach(self, deadline):
        """Start a new stream (same rank and token) that resumes after what this worker has,
        cancelled at ``deadline`` unless attached by then; None once closing."""
        with self._stream_lock:
            if self._closing:
                return None
            stream = self._attach(
                {"rank": self.rank, "closings": self._closes_seen, "stops": len(self.known_stopped)},
                wait_for_ready=True,
                timeout=None,
                metadata=self._metadata,
            )
            self._stream = stream
        confirmed = threading.Event()
        give_up = threading.Timer(max(deadline - time.monotonic(), 0.0), lambda: confirmed.is_set() or stream.cancel())
        give_up.daemon = True
        give_up.start()
        return stream, confirmed, give_up

    def _read(self, stream, first, confirmed=None):
        """Take one stream's messages until it ends; whether it attached (its first message came)."""
        attached = False
        try:
            for message in stream:
                if "attached" in message:
                    attached = True
                    self._local = bool(message.get("local"))
                    if confirmed is not None:  # a re-attach
                        confirmed.set()
                        self.reattached += 1
                        log.warning("tfsync: rank %d re-attached to rank 0 at %s", self.rank, self.address)
                if "lost" in message:
                    stops_before = len(self.known_stopped)
                    self.known_lost = message["lost"]
                    self.known_stopped = message["stopped"]
                    if len(self.known_stopped) > stops_before:
                        # confirm only after recording them: the stopping rank waits for this
                        self._seen_calls.append(
                            self._seen.future(
                                {"rank": self.rank, "stops": len(self.known_stopped)},
                                timeout=STOP_CALL_TIMEOUT_S,
                                wait_for_ready=True,
                                metadata=self._metadata,
                            )
                        )
                for entry in message.get("closed", ()):
                    round_, accepted, late = entry[0], entry[1], entry[2] if len(entry) > 2 else ()
                    if self._on_close is not None:
                        self._on_close(int(round_), tuple(int(r) for r in accepted), tuple(int(r) for r in late))
                    self._closes_seen += 1
                first.set()
        except grpc.RpcError as exc:
            if not first.is_set():
                self._attach_error = exc
        return attached

    def report(self, clock: int, min_interval_s: float = REPORT_INTERVAL_S):
        """Fire-and-forget clock report, at most one per ``min_interval_s`` and one in flight.

        The live clocks only name the ranks behind when a wait times out (after
        seconds), so reporting every step would only cost CPU on rank 0.
        """
        now = time.monotonic()
        if now - self._last_report < min_interval_s or (self._inflight is not None and not self._inflight.done()):
            return
        self._last_report = now
        self._inflight = self._report.future(
            {"rank": self.rank, "clock": clock}, timeout=REPORT_TIMEOUT_S, wait_for_ready=True, metadata=self._metadata
        )

    def ready(self, round_: int, on_accepted=None):
        """Tell the coordinator that this worker's contribution to ``round_`` is ready (async).

        ``on_accepted(round_)`` runs (on a gRPC thread) if the answer says the
        round will aggregate it for certain; a failed call only skips it (the
        closing on the stream still comes, and a lost coordinator is seen there).
        While the connection is down (a flap) the notice waits for it, within its deadline.
        """
        call = self._ready.future(
            {"rank": self.rank, "round": round_}, timeout=READY_TIMEOUT_S, wait_for_ready=True, metadata=self._metadata
        )
        self._ready_calls.append(call)
        if on_accepted is not None:

            def answered(done):
                if not done.cancelled() and done.exception() is None and done.result().get("accepted"):
                    on_accepted(round_)

            call.add_done_callback(answered)

    def tell(self, topic: str, **fields):
        """Tell the policy's service on rank 0 something (:meth:`Policy.service`; async)."""
        self._ready_calls.append(
            self._tell.future(
                {"rank": self.rank, "topic": topic, **fields},
                timeout=READY_TIMEOUT_S,
                wait_for_ready=True,
                metadata=self._metadata,
            )
        )

    def ask(self, topic: str, **fields) -> dict:
        """Ask the policy's service on rank 0 (:meth:`Policy.service`); its answer.
        Blocks for at most ``ASK_TIMEOUT_S``."""
        return self._ask(
            {"rank": self.rank, "topic": topic, **fields},
            timeout=ASK_TIMEOUT_S,
            wait_for_ready=True,
            metadata=self._metadata,
        )

    def join_late(self, round_: int) -> bool:
        """Offer a late, compensated contribution to ``round_``; whether the coordinator took it
        (False: the round had closed).  Blocks for at most ``LATE_TIMEOUT_S``."""
        reply = self._late(
            {"rank": self.rank, "round": round_}, timeout=LATE_TIMEOUT_S, wait_for_ready=True, metadata=self._metadata
        )
        return bool(reply.get("joined"))

    def announce_stop(self, kind: str, message: str):
        """Tell every worker (through rank 0) why this one stops, so they can say so too."""
        if self.host_lost is None:
            try:
                self._stop(
                    {"rank": self.rank, "kind": kind, "message": message},
                    timeout=STOP_CALL_TIMEOUT_S,
                    metadata=self._metadata,
                )
            except grpc.RpcError:
                pass

    def table(self, timeout_s: float = CALL_TIMEOUT_S) -> dict:
        """Live clocks and lost ranks (and how many calls the server refused).

        When rank 0 (the control host) is unreachable, the losses it pushed
        before are reported, or else rank 0 itself, with the last clocks read.
        Rank 0 is unreachable when the stream says so (``host_lost``: it broke
        and no re-attach got through within ``RECONNECT_GRACE_S``), not when one
        query goes unanswered: that may be a flap the stream survives, or a busy
        server, and reporting rank 0 lost would stop the job.
        """
        if self.host_lost is None:
            try:
                self._last_table = self._table({}, timeout=timeout_s, wait_for_ready=True, metadata=self._metadata)
                return self._last_table
            except grpc.RpcError:
                return {**self._last_table, "lost": self.known_lost}
        return {
            **self._last_table,
            "lost": self.known_lost
            or [{"rank": 0, "clock": None, "reason": "rank 0 (the control host) is unreachable"}],
        }

    def close(self):
        """Leave the control path (idempotent).

        The stream's reader thread is joined (bounded) before the channel
        closes: closing a gRPC Python channel while another thread is still
        inside one of its calls is the pattern of gRPC's segfault reports
        (grpc/grpc#16290, #19235), such as a worker's open stream when rank 0's
        server goes away.
        """
        if self._channel_closed:
            return
        self._closing = True
        try:
            self._leave({"rank": self.rank}, timeout=CALL_TIMEOUT_S, metadata=self._metadata)
        except grpc.RpcError:
            pass
        with self._stream_lock:  # (the watcher starts no new stream once _closing is set)
            stream = self._stream
        stream.cancel()
        self._watcher.join(WATCHER_JOIN_S)
        self._channel_closed = True
        self._channel.close()
