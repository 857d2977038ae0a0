"""A worker's end of the control path (:class:`ControlClient`).

It attaches one long-lived stream to rank 0 (:mod:`~tfsync.engine.control.streams`:
what a broken stream means and how a worker re-attaches), reports its clock
(throttled), sends ready notices, late offers, and its policy's messages, and
announces its stop (:mod:`~tfsync.engine.control.stop`).  Every call carries
the job's token; while the connection is down (a flap) a call waits for it,
within its deadline, rather than fail.
"""

import collections
import logging
import threading
import time

import grpc

from tfsync.engine.control.stop import STOP_CALL_TIMEOUT_S
from tfsync.engine.control.transport import (
    CHANNEL_OPTIONS,
    RECONNECT_BACKOFF_MS,
    RECONNECT_GRACE_S,
    SERVICE,
    TOKEN_METADATA_KEY,
    _check_token,
    _decode,
    _encode,
)

REPORT_INTERVAL_S = 0.25  # at most one clock report per this, and one in flight
REPORT_TIMEOUT_S = 5.0  # deadline of one (fire-and-forget) clock report
CONNECT_TIMEOUT_S = 30.0  # how long a worker waits for rank 0's control service
CALL_TIMEOUT_S = 2.0  # deadline of Leave and Table calls
WATCHER_JOIN_S = 2.0  # how long ControlClient.close waits for its stream reader to end
READY_TIMEOUT_S = 5.0  # deadline of one (fire-and-forget) ready notice
LATE_TIMEOUT_S = 5.0  # deadline of one late-contribution offer (the worker waits for the answer)
ASK_TIMEOUT_S = 5.0  # deadline of one question to the policy's service (the worker waits for the answer)

log = logging.getLogger("tfsync.control")


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
        """Fire-and-forget clock report, at most one per ``min_interval_s`` and one in flight: the
        call's future, or None when none was sent.

        The live clocks only name the ranks behind when a wait times out (after
        seconds), so reporting every step would only cost CPU on rank 0.
        """
        now = time.monotonic()
        if now - self._last_report < min_interval_s or (self._inflight is not None and not self._inflight.done()):
            return None
        self._last_report = now
        self._inflight = self._report.future(
            {"rank": self.rank, "clock": clock}, timeout=REPORT_TIMEOUT_S, wait_for_ready=True, metadata=self._metadata
        )
        return self._inflight

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
