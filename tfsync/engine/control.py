"""Control path: which workers are alive and where their clocks are, served by rank 0.

gRPC (shipped with TensorFlow) carries it; messages are protobuf ``Struct``s,
so no wire format is written here.  Each worker holds one long-lived
``Attach`` stream: when a worker process dies its stream closes at once and
rank 0 records the rank as lost; when rank 0 dies, every worker's stream
breaks.  Workers also report their clock after every push (asynchronously, at
most one report in flight), so a wait that times out can say which rank is
behind.  Answers take well under a millisecond on one host (measured by
``tests/parallel/test_faults.py``' launch, printed in its log).

Gating itself does not go through here: every worker evaluates the same pure
policy on the clock table replicated by the rounds (see ``exchange.py``).
"""
import threading
import time
from concurrent import futures

import grpc
from google.protobuf import json_format, struct_pb2

SERVICE = "tfsync.Control"


def _encode(message: dict) -> bytes:
    s = struct_pb2.Struct()
    s.update(message)
    return s.SerializeToString()


def _decode(data: bytes) -> dict:
    s = struct_pb2.Struct()
    s.ParseFromString(data)
    return json_format.MessageToDict(s)


class ControlServer:
    """Runs on rank 0: the live clock table and the set of lost ranks."""

    def __init__(self, size: int, t0: float):
        self.size, self.t0 = size, t0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._clocks = [-1] * size
        self._last_seen = [0.0] * size
        self._lost = {}
        self._stopped = {}
        self._stops_sent = {}  # attached rank -> how many stop notices its stream has carried
        self._left = set()
        self._stopping = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=size + 4))
        unary = lambda fn: grpc.unary_unary_rpc_method_handler(  # noqa: E731
            fn, request_deserializer=_decode, response_serializer=_encode)
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Attach": grpc.unary_stream_rpc_method_handler(
                self._attach, request_deserializer=_decode, response_serializer=_encode),
            "Report": unary(self._report),
            "Leave": unary(self._leave),
            "Stop": unary(self._stop),
            "Table": unary(self._table),
        })])
        self.port = self._server.add_insecure_port("[::]:0")
        self._server.start()

    def _attach(self, request, context):
        rank = int(request["rank"])
        ended = threading.Event()

        def on_end():
            with self._lock:
                if rank not in self._left and not self._stopping.is_set():
                    self._lost.setdefault(rank, {
                        "rank": rank, "clock": self._clocks[rank],
                        "at_s": time.time() - self.t0, "reason": "its process or connection ended"})
                self._stops_sent.pop(rank, None)
                ended.set()
                self._changed.notify_all()

        context.add_callback(on_end)
        with self._lock:
            self._last_seen[rank] = time.time() - self.t0
            self._stops_sent[rank] = 0
        yield {"attached": rank}
        # Push every loss to every worker at once: if rank 0 goes down right after
        # (it stops too), the others still know whom they lost first.
        told = (0, 0)
        while True:
            with self._lock:
                while ((len(self._lost), len(self._stopped)) == told and not ended.is_set()
                       and not self._stopping.is_set()):
                    self._changed.wait(0.5)
                if ended.is_set() or self._stopping.is_set():
                    return
                told = (len(self._lost), len(self._stopped))
                message = {"lost": list(self._lost.values()), "stopped": list(self._stopped.values())}
            yield message  # resumes once gRPC has written it
            with self._lock:
                if rank in self._stops_sent:
                    self._stops_sent[rank] = told[1]
                self._changed.notify_all()

    def _report(self, request, context):
        rank = int(request["rank"])
        with self._lock:
            self._clocks[rank] = max(self._clocks[rank], int(request["clock"]))
            self._last_seen[rank] = time.time() - self.t0
        return {"ok": 1}

    def _leave(self, request, context):
        with self._lock:
            self._left.add(int(request["rank"]))
        return {"ok": 1}

    def _stop(self, request, context):
        # Answer only once every attached worker's stream has carried the notice (or
        # after 2 s): the stopping rank may exit right after, and if it is rank 0 the
        # others must already know why, not just that rank 0 vanished.
        deadline = time.monotonic() + 2.0
        with self._lock:
            self._stopped.setdefault(int(request["rank"]), dict(request))
            self._changed.notify_all()
            count = len(self._stopped)
            while (any(n < count for n in self._stops_sent.values())
                   and time.monotonic() < deadline and not self._stopping.is_set()):
                self._changed.wait(0.05)
        return {"ok": 1}

    def _table(self, request, context):
        with self._lock:
            return {"clocks": list(self._clocks), "last_seen_s": list(self._last_seen),
                    "lost": list(self._lost.values())}

    def stop(self):
        self._stopping.set()
        with self._lock:
            self._changed.notify_all()
        # every rank has left (close() runs a barrier first): no grace period needed
        self._server.stop(grace=None).wait(2.0)


class ControlClient:
    """A worker's end of the control path."""

    def __init__(self, address: str, rank: int, connect_timeout_s: float = 30.0):
        self.address, self.rank = address, rank
        self._channel = grpc.insecure_channel(address)
        method = lambda name: self._channel.unary_unary(  # noqa: E731
            f"/{SERVICE}/{name}", request_serializer=_encode, response_deserializer=_decode)
        self._report, self._leave, self._table = method("Report"), method("Leave"), method("Table")
        self._stop = method("Stop")
        self._closing = False
        self.host_lost = None
        self.known_lost = []
        self.known_stopped = []
        self._last_table = {"clocks": [], "last_seen_s": [], "lost": []}
        self._inflight = None
        self._last_report = float("-inf")
        attach = self._channel.unary_stream(
            f"/{SERVICE}/Attach", request_serializer=_encode, response_deserializer=_decode)
        self._stream = attach({"rank": rank}, wait_for_ready=True, timeout=None)
        first = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(first,), daemon=True,
                                         name="tfsync-control-watch")
        self._watcher.start()
        if not first.wait(connect_timeout_s):
            raise TimeoutError(
                f"tfsync: rank {rank} could not reach the control service of rank 0 at {address} "
                f"within {connect_timeout_s:.0f} s; check that rank 0 is running and that this "
                f"host can reach it (or set TFSYNC_CONTROL_HOST to an address it can reach)")

    def _watch(self, first):
        try:
            for message in self._stream:
                if "lost" in message:
                    self.known_lost = message["lost"]
                    self.known_stopped = message["stopped"]
                first.set()
        except grpc.RpcError:
            pass
        if not self._closing:
            self.host_lost = time.time()
        first.set()

    def report(self, clock: int, min_interval_s: float = 0.25):
        """Fire-and-forget clock report, at most one per ``min_interval_s`` and one in flight.

        The live clocks only name the ranks behind when a wait times out (after
        seconds), so reporting every step would only cost CPU on rank 0.
        """
        now = time.monotonic()
        if now - self._last_report < min_interval_s or (
                self._inflight is not None and not self._inflight.done()):
            return
        self._last_report = now
        self._inflight = self._report.future({"rank": self.rank, "clock": clock}, timeout=5.0)

    def announce_stop(self, kind: str, message: str):
        """Tell every worker (through rank 0) why this one stops, so they can say so too."""
        if self.host_lost is None:
            try:
                self._stop({"rank": self.rank, "kind": kind, "message": message}, timeout=3.0)
            except grpc.RpcError:
                pass

    def table(self, timeout_s: float = 2.0) -> dict:
        """Live clocks and lost ranks.

        When rank 0 (the control host) is unreachable, the losses it pushed
        before are reported, or else rank 0 itself, with the last clocks read.
        """
        if self.host_lost is None:
            try:
                self._last_table = self._table({}, timeout=timeout_s)
                return self._last_table
            except grpc.RpcError:
                pass
        return {**self._last_table, "lost": self.known_lost or [
            {"rank": 0, "clock": None, "reason": "rank 0 (the control host) is unreachable"}]}

    def close(self):
        self._closing = True
        try:
            self._leave({"rank": self.rank}, timeout=2.0)
        except grpc.RpcError:
            pass
        self._stream.cancel()
        self._channel.close()
