"""Rank 0's control service (:class:`ControlServer`): one asyncio gRPC server, its parts by concern.

* the transport and the token gate (:mod:`~tfsync.control.transport`);
* the links, with keepalive, re-attach and what a link's end means (:mod:`~tfsync.control.streams`);
* the stop handshake (:mod:`~tfsync.control.stop`);
* the round coordinator of PSP and backup workers (:mod:`~tfsync.control.coordinator`);
* the clock table and the policy's service (:mod:`~tfsync.control.services`).

Everything runs on one event loop on a thread of its own: no thread is held per
worker or per link, so rank 0's threads do not grow with the job.  A link is a
worker's, or a host relay's carrying its host's workers
(:mod:`~tfsync.control.relay`): rank 0 reads one message and writes one
reply per message a link sends, and one message per link for what every worker
is told (a round's closing, encoded once).  A lock guards the state for the
readers on other threads (:attr:`ControlServer.closed`, :meth:`ControlServer.served`).
"""

import asyncio
import collections
import concurrent.futures
import resource
import threading
import time

import grpc
import grpc.aio

from tfsync.control.coordinator import RoundCoordinator
from tfsync.control.services import Services
from tfsync.control.stop import StopHandshake
from tfsync.control.streams import Streams
from tfsync.control.transport import SERVER_OPTIONS, TokenGate, _addresses_of, _check_token, _host_port, gate

SERVER_START_S = 30.0  # the service starts (binds its port) within this
SERVER_STOP_WAIT_S = 2.0  # how long ControlServer.stop waits for the gRPC server to end
FILES_PER_WORKER = 2  # open files the service needs per worker (a connection, with a margin), beyond FILES_SPARE
FILES_SPARE = 256


class ControlServer(TokenGate, Streams, StopHandshake, RoundCoordinator, Services):
    """Runs on rank 0: the live clock table, the set of lost ranks and, for coordinated policies,
    the rounds it closes."""

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
        (DSSP's controller, :mod:`tfsync.engine.components.bindings`), or None."""
        self.size, self.t0 = size, t0
        self._token = _check_token(token).encode("ascii")
        self._lock = threading.Lock()
        self._clocks = [-1] * size
        self._last_seen = [0.0] * size
        self._waiting = [False] * size  # each rank's last report: it waits for its peers
        self._lost, self._lost_version = {}, 0
        self._stopped, self._stopped_version = {}, 0
        self._stops_seen = {}  # attached rank -> how many stop notices its worker confirmed reading
        self._left = set()
        # a worker that connects from an address this server listens on runs on this host:
        # no network lies between them, so its own link ends only when its process does
        self._own_ips = _addresses_of(host)
        self._links = {}  # link id -> Link
        self._rank_link = {}  # attached rank -> the id of the link that carries it
        self._detached = {}  # rank whose link ended without Leave -> (link id, at_s, grace timer)
        self._owner_gone = {}  # rank whose host relay a worker found gone -> the reason it is lost
        self.reattached = collections.Counter()  # rank -> how many times it re-attached
        self._served = collections.Counter()  # what the service served, by kind (served())
        self.rejected = []  # the first REJECTIONS_KEPT refused calls: {"method", "peer", "at_s"}
        self.rejected_count = 0
        self._last_rejection_log = float("-inf")
        self._rejections_unlogged = 0
        self._stopping = threading.Event()
        self._policy = policy if policy is not None and policy.coordinated else None
        # what the mode's coordinator keeps beyond closing rounds (DSSP's controller), if anything
        self._service = service
        self._ready = {}  # open round -> [(rank, ready_s)] in arrival order
        self._ready_ranks = {}  # open round -> the ranks in _ready[round]
        self._closed = []  # [round, [accepted ranks]] (+ [late ranks] when any) in round order
        # the closings the links carry: all of them, but, for a policy whose ready ranks enter
        # on their own (enters_when_ready), not one that took every rank: each entered already
        self._closings = []
        self._enters_when_ready = self._policy is not None and self._policy.enters_when_ready
        self._late = {}  # round -> ranks whose late, compensated contribution it takes
        self._early = {}  # open round -> ranks told at their ready notice that it takes them
        self._answers_due = []  # (link, item) of the ready notices of the message being read
        self._opened_s = time.time() - t0  # when the oldest open round opened (the previous close)
        self._recheck_s = None  # when the policy asked to be asked again (a timeout), if it did
        self._recheck_timer = None
        self._policy_failed = False
        self._broadcast_due = False
        self._told = None  # (closings, lost version, stopped version) the last broadcast told every link
        self._answering = {}  # link id -> Link: links with an acknowledgement or answers to send
        self._handlers = {
            "attach": self._attach_item,
            "relay": self._relay_item,
            "ended": self._ended_item,
            "detached": self._detached_item,
            "relay_gone": self._relay_gone_item,
            "leave": self._leave_item,
            "report": self._report_item,
            "reports": self._reports_item,
            "ready": self._ready_item,
            "late": self._late_item,
            "tell": self._tell_item,
            "ask": self._ask_item,
            "table": self._table_item,
            "stop": self._stop_item,
            "seen": self._seen_item,
        }
        _ensure_open_files(size)
        self._loop = asyncio.new_event_loop()
        started = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(host, port, advertise, started), daemon=True, name="tfsync-control"
        )
        self._thread.start()
        try:
            self.port, self.address = started.result(SERVER_START_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"tfsync: rank 0's control service did not start in {SERVER_START_S:.0f} s") from None

    def _now(self):
        return time.time() - self.t0

    def _run(self, host, port, advertise, started):
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(host, port, advertise, started))
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            if not started.done():
                started.set_exception(exc)
            return
        self._loop.run_forever()

    async def _start(self, host, port, advertise, started):
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers([gate(self._admits, self._serve_link, self._refuse)])
        bind, fixed_port = _host_port(host, port), port
        try:
            port = self._server.add_insecure_port(bind)
            failure = None
        except Exception as exc:  # grpcio raises RuntimeError("Failed to bind ...") in recent versions
            port, failure = 0, exc
        if not port:
            raise RuntimeError(
                f"tfsync: rank 0 could not open its control service on host {host!r} ({bind}"
                f"{': ' + str(failure) if failure else ''}); set TFSYNC_CONTROL_HOST to an "
                f"address of this machine that the workers can reach"
                + (", and TFSYNC_CONTROL_PORT to a free port (or 0)" if fixed_port else "")
            )
        self.address = _host_port(advertise or host, port)
        await self._server.start()
        if self._policy is not None:  # a policy that cannot decide fails now
            with self._lock:
                self._decide(self._now())
        started.set_result((port, self.address))

    def served(self) -> dict:
        """What the service served so far, by kind: ``reports`` (one per worker's clock),
        ``ready`` notices, ``closings`` sent (one per link and closing), ``tells``, ``asks``,
        ``late`` offers, and the messages its links carried (``messages_in``, ``messages_out``)."""
        with self._lock:
            return dict(self._served)

    def stop(self):
        """Stop serving (every worker has left: ``close()`` runs a barrier first)."""
        if self._stopping.is_set():
            return
        self._stopping.set()

        async def shut():
            with self._lock:
                timers = [timer for _, _, timer in self._detached.values()]
            for timer in timers:
                timer.cancel()
            await self._server.stop(grace=None)

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(SERVER_STOP_WAIT_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(SERVER_STOP_WAIT_S)


def _ensure_open_files(size):
    """Raise this process's open-file limit to what ``size`` workers' connections need, as far
    as the hard limit allows; refuse a job the hard limit cannot serve, saying how to raise it."""
    need = FILES_PER_WORKER * size + FILES_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise RuntimeError(
            f"tfsync: rank 0's control service needs about {need} open files for {size} workers, and this "
            f"process may open {hard} at most (RLIMIT_NOFILE); raise the limit where the job starts "
            f"(ulimit -n {need}, or LimitNOFILE= for a systemd service)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
