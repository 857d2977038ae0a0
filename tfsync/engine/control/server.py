"""Rank 0's control service (:class:`ControlServer`): one gRPC server, its parts by concern.

* the transport and the token gate (:mod:`~tfsync.engine.control.transport`);
* each worker's ``Attach`` stream, with keepalive and re-attach (:mod:`~tfsync.engine.control.streams`);
* the stop handshake (:mod:`~tfsync.engine.control.stop`);
* the round coordinator of PSP and backup workers (:mod:`~tfsync.engine.control.coordinator`);
* the clock table and the policy's service (:mod:`~tfsync.engine.control.services`).

They share one lock and one condition (``_changed``: what the streams carry
changed), held briefly by each handler.
"""

import collections
import itertools
import threading
import time
from concurrent import futures

import grpc

from tfsync.engine.control.coordinator import RoundCoordinator
from tfsync.engine.control.services import Services
from tfsync.engine.control.stop import StopHandshake
from tfsync.engine.control.streams import Streams
from tfsync.engine.control.transport import (
    SERVER_OPTIONS,
    SERVICE,
    TokenGate,
    _addresses_of,
    _check_token,
    _decode,
    _encode,
    _Gate,
    _host_port,
    _pooled,
)

SERVER_STOP_WAIT_S = 2.0  # how long ControlServer.stop waits for the gRPC server to end

# Threads of rank 0's server.  Each Attach stream holds one for the whole job, so streams
# have a pool of their own (two per rank: a re-attached rank's old stream may still be
# winding down), and a refused call is answered by a pool of its own: a flood of calls
# without the token queues there, never in front of a worker's call.  (gRPC's per-method
# pools: the mechanism its own health service uses for its Watch streams.)
UNARY_SPARE_THREADS = 4  # the workers' unary calls: a thread per rank (each may hold a Stop call) plus these
STREAM_THREADS_PER_RANK = 2
REFUSAL_THREADS = 1  # a refusal reads nothing and only answers: one thread keeps pace


class ControlServer(TokenGate, Streams, StopHandshake, RoundCoordinator, Services):
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

    @property
    def closed(self):
        """``[round, [accepted ranks]]`` for every closed round so far (coordinated policies),
        with a third item, the ranks whose late compensated contribution it took, when any."""
        with self._lock:
            return [list(c) for c in self._closed]

    def served(self) -> dict:
        """What the service served so far, by kind: ``reports``, ``ready`` notices, ``closings``
        delivered (one per stream and closing), ``tells``, ``asks``, ``late`` offers."""
        with self._lock:
            return dict(self._served)

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
