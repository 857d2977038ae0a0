"""The control path's transport: gRPC links with keepalive, their wire, and the token gate.

Everything on the control path travels on **links**: one gRPC bidirectional stream
(``/tfsync.Control/Link``) from a worker (or from its host's relay,
:mod:`~tfsync.control.relay`) to rank 0's service.  A message on a link
is a batch of items, JSON-encoded (:func:`encode`, :func:`decode`): whatever a
sender has queued goes out as one message, so a busy link sends fewer, larger
messages, and a message rank 0 sends to every link (a round's closing) is
encoded once.  Both ends ping every connection (gRPC keepalive,
:data:`KEEPALIVE_TIME_MS`, :data:`KEEPALIVE_TIMEOUT_MS`): a link that went down
without a word is noticed within seconds, while an outage of a couple of
seconds trips nothing (TCP delivers what it held once the link is back).

Only this job's workers may use the service.  Rank 0 draws a random token per
job and hands it to the workers through the launch's own collective; every
link carries it as gRPC metadata (``tfsync-token``), and the server compares it
in constant time and refuses (``PERMISSION_DENIED``) any call without it, so a
stray process, or a worker of another job on the same host, cannot attach,
report clocks, stop or read this job's table and so cannot decide this job's
rounds.  Refusals are counted (``ControlServer.rejected``, ``"rejected"`` in the
table) and logged (logger ``tfsync.control``).  The token is checked as the call
arrives (:class:`_Gate`), before its request is read, and a refusal reads
nothing: a flood of refused calls, even from clients that withhold their
request, delays no ready notice past its round.  The token is not encryption:
the traffic is plaintext gRPC on one host or the cluster network, readable by
anyone who can capture that network.  The server listens only on the address
the workers use (chosen by :mod:`tfsync.control.address`), not on every
interface.
"""

import hmac
import ipaddress
import json
import logging
import socket
import time
import urllib.parse

import grpc

SERVICE = "tfsync.Control"
LINK_METHOD = f"/{SERVICE}/Link"
TOKEN_METADATA_KEY = "tfsync-token"
REJECTION_LOG_INTERVAL_S = 1.0  # at most one logged warning about refused calls per this
REJECTIONS_KEPT = 100  # ControlServer.rejected keeps the first this many

# Links between hosts.  A flap of a few seconds must not end a job; a
# dead worker or a link that stays down must still be named within seconds.
# How long a worker on another host may take to re-attach after its stream ended without
# Leave before rank 0 records it lost, and how long a worker whose stream broke retries
# before it reports rank 0 unreachable: a 2 s outage plus a reconnection (within
# RECONNECT_BACKOFF_MS[1] of the link's return) fits with room to spare, and a dead worker is
# still named before a survivor's failed collective stops waiting for the name
# (diagnosis.LOSS_SETTLE_S, the grace + 3 s; tests/single/control/test_control_link.py checks the order)
RECONNECT_GRACE_S = 4.0
ATTEMPT_S = 1.0  # a re-attach to one of two addresses (a relay, rank 0) gives up on it after this
# Both ends ping each connection this often (gRPC has no keepalive by default: a link that
# went down silently was never noticed) ...
KEEPALIVE_TIME_MS = 1000
# ... and drop it when a ping is not answered within this: a ping caught by a 2 s outage is
# delivered by TCP's retransmission backoff (200 ms, doubling) about 3 s after the outage
# began, so a 2 s flap trips nothing, and a dead link is noticed within 5 s
KEEPALIVE_TIMEOUT_MS = 4000
# A peer that stops answering (its process stopped or gone, the link down) has its links dropped
# within this: its peers' control path stops waiting for it then (the hang guard ends a stopped
# worker at it)
SILENT_LINK_S = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000
# The server accepts pings this close together: under KEEPALIVE_TIME_MS, or gRPC answers a
# worker's keepalive with GOAWAY "too_many_pings" and drops its connection
MIN_PING_INTERVAL_MS = 500
# A worker's first and longest wait between attempts to reconnect (gRPC's defaults, 1 s
# growing to 120 s, would let a link come back seconds before the worker noticed)
RECONNECT_BACKOFF_MS = (100, 500)
# One connection attempt gives up after this, and the next starts (gRPC's default, 20 s,
# would keep an attempt whose SYN an outage swallowed pending past RECONNECT_GRACE_S)
CONNECT_ATTEMPT_MS = 1000

log = logging.getLogger("tfsync.control")


def encode(items) -> bytes:
    """One message: a list of items, each a list whose first element names its kind."""
    return json.dumps(items, separators=(",", ":")).encode()


def decode(data: bytes) -> list:
    return json.loads(data)


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


class _Gate(grpc.GenericRpcHandler):
    """Admits this job's calls to their handlers and hands every other call to a refusal.

    gRPC asks this as the call arrives, before its request is read: a call without the token
    never waits for its request (a client that withholds it would otherwise hold the call
    until its deadline), and its refusal reads nothing.
    """

    def __init__(self, admits, handlers, refusals):
        self._admits, self._handlers, self._refusals = admits, handlers, refusals

    def service(self, handler_call_details):
        handler = self._handlers.get(handler_call_details.method)
        if handler is None or self._admits(handler_call_details.invocation_metadata):
            return handler  # (None: an unknown method, which gRPC answers UNIMPLEMENTED)
        return self._refusals[handler_call_details.method]


def gate(admits, links, refuse):
    """The gate of an asyncio gRPC server whose one method is :data:`LINK_METHOD`: ``links``
    (an async ``(request_iterator, context)`` handler) for calls ``admits(metadata)`` takes,
    ``refuse(method, context)`` (async) for the others."""

    async def refusal(request_iterator, context):
        await refuse(LINK_METHOD, context)

    handler = grpc.stream_stream_rpc_method_handler(links)
    refused = grpc.stream_stream_rpc_method_handler(refusal)
    return _Gate(admits, {LINK_METHOD: handler}, {LINK_METHOD: refused})


class TokenGate:
    """The server's side of the token: admits this job's calls, records and refuses the rest
    (a part of :class:`~tfsync.control.server.ControlServer`)."""

    def _admits(self, metadata) -> bool:
        """Whether a call's metadata carries this job's token (compared in constant time)."""
        sent = _token_of(metadata)
        return sent is not None and hmac.compare_digest(sent, self._token)

    async def _refuse(self, method, context):
        """Record a call without this job's token and abort it (nothing of it is read)."""
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
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"tfsync: the token did not match this job: a process that is not one of this job's "
            f"workers, or a worker of another job, called the control service of rank 0 at "
            f"{self.address}",
        )
