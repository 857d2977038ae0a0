"""A worker's end of the control path (:class:`ControlClient`).

It holds one link (:mod:`~tfsync.control.transport`) to its host's relay
or to rank 0's service, and sends on it its clock (throttled), its ready
notices, late offers, its policy's messages, and its stop
(:mod:`~tfsync.control.stop`); whatever is queued when the link is free
goes out as one message.  Rank 0 acknowledges every message; what is not
acknowledged when the link breaks goes out again on the next one, and rank 0
takes a repeated item as once (every item is idempotent), so a flap loses
nothing.  The link carries back the answers, the losses and stop notices and
the round closings, in order and each once (the worker says, when it
re-attaches, how many it has).

When the link breaks while the worker is not closing, it re-attaches within
:data:`~tfsync.control.transport.RECONNECT_GRACE_S`, to the same address
or, if that is gone (its host's relay died with its process), to rank 0's
service directly; only when no re-attach gets through within the grace, or at once
when nothing listens at any of its addresses any more (the service closed: a
refused connection, not a link down), does it report rank 0 unreachable
(``host_lost``).  A relay that could not re-attach to
rank 0 within its grace says so and closes its workers' links: each then tries
rank 0 itself once (``ATTEMPT_S``) before it reports rank 0 unreachable.  A worker on rank 0's host (rank 0
says so when it attaches) does not re-attach: only the end of rank 0's
process ends its link.
"""

import collections
import concurrent.futures
import itertools
import logging
import threading
import time

import grpc

from tfsync.control import link as reliable
from tfsync.control.client_link import LinkCall
from tfsync.control.stop import STOP_CALL_TIMEOUT_S
from tfsync.control.transport import CHANNEL_OPTIONS, TOKEN_METADATA_KEY, _check_token, decode

REPORT_INTERVAL_S = 0.25  # at most one clock report per this
CONNECT_TIMEOUT_S = 30.0  # how long a worker waits for rank 0's control service at most
CONNECT_MIN_S = 5.0  # ... and at least, where the engine's wait bound is shorter (a loaded machine's attach)
ATTACH_POLL_S = 0.5  # while the first attach waits: how often it looks whether anything listens there
CALL_TIMEOUT_S = 2.0  # how long leave and table wait for rank 0's answer
LEAVE_POLL_S = 0.05  # how often ControlClient.close looks whether its link broke while it waits
WATCHER_JOIN_S = 2.0  # how long ControlClient.close waits for its link's reader to end
READY_TIMEOUT_S = 5.0  # a ready notice's answer comes within this, or is not waited for
LATE_TIMEOUT_S = 5.0  # how long a late-contribution offer waits for the answer
ASK_TIMEOUT_S = 5.0  # how long a question to the policy's service waits for the answer

log = logging.getLogger("tfsync.control")


class ControlError(RuntimeError):
    """Rank 0 did not answer a request within its bound, or answered with an error."""


class ControlUnreachableError(TimeoutError):
    """A worker could not attach to rank 0's control service within its bound (rank 0 gone, or
    not reachable from this host); in an elastic job a reset answers it, as a lost peer."""


def connect_bound(wait_timeout_s: float) -> float:
    """How long an engine's first attach waits for rank 0's control service: the engine's wait
    bound for a peer (rank 0 is one), within [CONNECT_MIN_S, CONNECT_TIMEOUT_S].  A rank 0 that
    died after the engine's start agreed its address ends its peers' attach at the bound the job
    chose, where an elastic job's reset takes over (``ControlUnreachableError``), not 30 s later."""
    return max(CONNECT_MIN_S, min(CONNECT_TIMEOUT_S, wait_timeout_s))


def _all_refused(addresses) -> bool:
    return all(reliable.refused(a) for a in addresses)


class ControlClient:
    """A worker's end of the control path.

    Args:
        address: where it attaches: its host's relay, or rank 0's service.
        rank, token: the worker's rank and the job's token.
        connect_timeout_s: how long the first attach may take.
        on_close: called with ``(round, accepted ranks, late ranks)`` for every round closing,
            in order, on the link's reader thread.
        fallback: rank 0's service, where it re-attaches when ``address`` (a relay) is gone.
        relay_owner: the rank whose process runs the relay at ``address`` (another's): when that
            relay's port is closed (its process ended), rank 0 is told so on the re-attach.
    """

    def __init__(
        self,
        address: str,
        rank: int,
        token: str,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        on_close=None,
        fallback=None,
        relay_owner=None,
    ):
        self.address, self.rank = address, rank
        self._relay = (address, int(relay_owner)) if relay_owner is not None and fallback else None
        self._reattach_plan = reliable.Reattach([address] + ([fallback] if fallback and fallback != address else []))
        self._on_close = on_close
        self._closings = reliable.ClosingLog()
        self._metadata = ((TOKEN_METADATA_KEY, _check_token(token)),)
        self._ids = itertools.count(1)
        self._requests = {}  # request id -> Future of its answer
        self._ready_calls = collections.deque(maxlen=8)  # the newest ready notices' answers (Futures)
        self._closing = False
        self._channel_closed = False
        self.host_lost = None
        self.known_lost = []
        self.known_stopped = []
        self.reattached = 0  # how many times its link broke and it re-attached
        self._local = False  # rank 0 said this worker runs on its host (when it attached)
        self._last_table = {"clocks": [], "last_seen_s": [], "lost": []}
        self._last_report = float("-inf")
        self._attach_error = None
        self._relay_gone = False  # its relay gave up on rank 0 (it tried rank 0 itself, once)
        self._broken = False  # its link broke and no re-attach has got through yet
        self._lock = threading.Lock()  # the current link; a re-attach does not start once close() has begun
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._link = self._open(self._channel, [])
        first = threading.Event()
        self._watcher = threading.Thread(target=self._watch, args=(first,), daemon=True, name="tfsync-control-watch")
        self._watcher.start()
        self._await_first(first, connect_timeout_s)
        error = self._attach_error
        if error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED:
            self._closing = True
            self._link.queue.put(None)
            self._channel.close()
            raise PermissionError(
                f"tfsync: rank {rank}'s token was rejected by the control service at {address} "
                f"({error.details()}). Every worker must be started by the same launch "
                f"(horovodrun) so that they share rank 0's token"
            )

    def _await_first(self, first, connect_timeout_s):
        """Wait for the first attach, bounded; give up at once where nothing listens any more.

        The address was handed out once the service listened (rank 0's, or its host's relay),
        so a refused connection at every address means the service closed: rank 0 (or the
        relay's worker) exited or reset, as when a peer dies while the engines start.  A link
        that is down answers nothing (no refusal): that waits out the bound."""
        deadline = time.monotonic() + connect_timeout_s
        addresses = self._reattach_plan.addresses
        while not first.wait(min(ATTACH_POLL_S, max(deadline - time.monotonic(), 0.0))):
            gone = _all_refused(addresses)
            if gone or time.monotonic() >= deadline:
                self._closing = True
                self._link.queue.put(None)
                self._link.call.cancel()
                where = " and ".join(addresses)
                if gone:
                    raise ControlUnreachableError(
                        f"tfsync: rank {self.rank} could not reach the control service of rank 0: nothing "
                        f"listens at {where} any more (the service closed: rank 0, or the worker that "
                        f"runs this host's relay, exited or reset after it started)"
                    )
                raise ControlUnreachableError(
                    f"tfsync: rank {self.rank} could not reach the control service of rank 0 at {where} "
                    f"within {connect_timeout_s:.0f} s; check that rank 0 is running and that this "
                    f"host can reach it (or set TFSYNC_CONTROL_HOST to an address it can reach)"
                )

    # ------------------------------------------------------------------- the link
    @property
    def _stream(self):
        """The current link's call (what a test cancels to end it as a process exit would)."""
        return self._link.call

    def _open(self, channel, resend):
        """A new link on ``channel``: attach, then what the last one left unacknowledged."""
        link = LinkCall(channel, self._metadata)
        link.queue.put([["attach", self.rank, self._closings.seen, len(self.known_stopped)], *resend])
        return link

    def _send(self, item):
        with self._lock:
            self._link.queue.put([item])

    def _watch(self, first):
        """Follow the link; when it breaks, re-attach within the grace, else rank 0 is lost
        (:class:`~tfsync.control.link.Reattach` says where and until when)."""
        link, plan = self._link, self._reattach_plan
        while True:
            attached = self._read(link, first)
            self._broken = True
            if self._closing or self._local:  # (on rank 0's host only its process's end ends a link)
                break
            where = " and ".join(plan.addresses)
            attempt = plan.next(attached, gone=_all_refused)
            if attached:
                log.warning(
                    "tfsync: rank %d's control link to %s broke; re-attaching for up to %g s",
                    self.rank,
                    self.address,
                    reliable.RECONNECT_GRACE_S,
                )
            if attempt is None:
                if plan.gave_up == "gone":
                    # nothing listens at any of its addresses: the service closed (rank 0, or the
                    # relay's worker with it, reset or exited) and never reopens there, so no
                    # re-attach can get through: rank 0 is unreachable now, not after the grace
                    log.warning(
                        "tfsync: rank %d's control service is gone: nothing listens at %s any more", self.rank, where
                    )
                elif plan.gave_up == "grace":
                    log.warning(
                        "tfsync: rank %d could not re-attach to rank 0 at %s within %g s",
                        self.rank,
                        self.address,
                        reliable.RECONNECT_GRACE_S,
                    )
                break
            time.sleep(attempt[2])
            link = self._reattach(link, *attempt[:2])
            if link is None:
                break
        if not self._closing:
            self.host_lost = time.time()
        first.set()

    def _reattach(self, broken, address, deadline):
        """A new link to ``address`` resuming after what this worker has, given up at ``deadline``
        unless attached by then; None once closing."""
        notice = []  # (probed before the lock: a send from the training thread never waits on it)
        if self._relay is not None and address != self._relay[0] and reliable.refused(self._relay[0]):
            notice, self._relay = [["relay_gone", self._relay[1], self.rank]], None
        with self._lock:
            if self._closing:
                return None
            if address != self.address:
                self._channel.close()
                self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                self.address = address
            link = self._open(self._channel, notice + broken.pending())
            self._link = link
        bound = threading.Thread(
            target=self._bound_attempt, args=(link, address, deadline), daemon=True, name="tfsync-control-attempt"
        )
        bound.start()
        return link

    def _bound_attempt(self, link, address, deadline):
        """End a re-attach attempt that has not got through by ``deadline``, or sooner once nothing
        listens at ``address`` (looked at every ``ATTACH_POLL_S``: the service closed, so it never
        would): the watch then moves on, or reports rank 0 unreachable if nothing listens anywhere."""
        while not link.attached and not self._closing:
            left = deadline - time.monotonic()
            if left <= 0 or reliable.refused(address):
                link.call.cancel()
                return
            time.sleep(min(ATTACH_POLL_S, left))

    def _read(self, link, first):
        """Take one link's messages until it ends; whether it attached."""
        try:
            for data in link.call:
                for item in decode(data):
                    self._take(link, item, first)
        except grpc.RpcError as exc:
            if not first.is_set():
                self._attach_error = exc
        return link.attached

    def _take(self, link, item, first):
        kind = item[0]
        if kind == "acked":
            link.acked(item[1])
        elif kind == "attached":
            if link is not self._link or link.attached:
                return
            link.attached = True
            self._broken = False
            self._local = bool(item[2])
            if first.is_set():  # a re-attach
                self.reattached += 1
                log.warning("tfsync: rank %d re-attached to rank 0 at %s", self.rank, self.address)
            first.set()
        elif kind == "answer":
            future = self._requests.pop(item[2], None)
            if future is not None and not future.done():
                future.set_result(item[3])
        elif kind == "accepted":  # (the answers to ready notices: [rank, id, accepted] each)
            for _, request, accepted in item[1]:
                future = self._requests.pop(request, None)
                if future is not None and not future.done():
                    future.set_result({"accepted": accepted})
        elif kind == "notices":
            stops_before = len(self.known_stopped)
            self.known_lost, self.known_stopped = item[1], item[2]
            if len(self.known_stopped) > stops_before:  # confirm only after recording them: the stopper waits
                self._confirm_stops(len(self.known_stopped))
        elif kind == "closed":
            for entry in self._closings.fresh(item[1], item[2]):  # (some resent after a re-attach)
                round_, accepted, late = entry[0], entry[1], entry[2] if len(entry) > 2 else ()
                if self._on_close is not None:
                    self._on_close(int(round_), tuple(int(r) for r in accepted), tuple(int(r) for r in late))
        elif kind == "host_lost":  # (its relay could not re-attach to rank 0 within the grace)
            self._relay_gone = True
            self._reattach_plan.upstream_gave_up()

    def _confirm_stops(self, count):
        """Tell rank 0 this worker has read the first ``count`` stop notices."""
        self._send(["seen", self.rank, count])

    def _request(self, kind, *args):
        """Send a request; its answer's Future."""
        request = next(self._ids)
        future = concurrent.futures.Future()
        self._requests[request] = future
        self._send([kind, self.rank, request, *args])
        return future

    def _answer(self, future, timeout_s, what):
        try:
            reply = future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise ControlError(f"tfsync: rank 0 did not answer {what} of rank {self.rank} in {timeout_s:g} s") from None
        if "error" in reply:
            raise ControlError(reply["error"])
        return reply

    # ----------------------------------------------------------------- what it sends
    def report(self, clock: int, min_interval_s: float = REPORT_INTERVAL_S, waiting: bool = False) -> bool:
        """Report this worker's clock, at most one report per ``min_interval_s``; whether one was
        sent.  The live clocks only name the ranks behind when a wait times out (after seconds),
        so reporting every step would only cost CPU on rank 0.  ``waiting``: this worker waits
        for its peers (a wait that times out does not name a rank held up that way)."""
        now = time.monotonic()
        if now - self._last_report < min_interval_s:
            return False
        self._last_report = now
        self._send(["report", self.rank, int(clock), int(bool(waiting))])
        return True

    def ready(self, round_: int, on_accepted=None):
        """Tell the coordinator that this worker's contribution to ``round_`` is ready (async).

        ``on_accepted(round_)`` runs (on the link's reader thread) if the answer says the round
        will aggregate it for certain; no answer only skips it (the closing still comes, and a
        lost coordinator is seen on the link)."""
        future = self._request("ready", int(round_))
        self._ready_calls.append(future)
        if on_accepted is not None:
            future.add_done_callback(lambda done: done.result().get("accepted") and on_accepted(round_))

    def tell(self, topic: str, **fields):
        """Tell the policy's service on rank 0 something (:meth:`Policy.service`; async)."""
        self._send(["tell", self.rank, topic, fields])

    def ask(self, topic: str, **fields) -> dict:
        """Ask the policy's service on rank 0 (:meth:`Policy.service`); its answer.
        Blocks for at most ``ASK_TIMEOUT_S``."""
        return self._answer(self._request("ask", topic, fields), ASK_TIMEOUT_S, f"the question {topic!r}")

    def join_late(self, round_: int) -> bool:
        """Offer a late, compensated contribution to ``round_``; whether the coordinator took it
        (False: the round had closed).  Blocks for at most ``LATE_TIMEOUT_S``."""
        reply = self._answer(self._request("late", int(round_)), LATE_TIMEOUT_S, "a late offer")
        return bool(reply.get("joined"))

    def job_went_on(self) -> bool:
        """Whether the job no longer waits for this worker, as far as rank 0 has told it: a peer
        stopped (its stop notice), a rank was lost, or rank 0 is unreachable.  Read without a
        call, from what the link pushed: for a thread other than the training thread (the hang
        guard's heartbeat, while the training thread may be stuck)."""
        return bool(self.known_lost) or self.host_lost is not None or self.peer_stop_notice() is not None

    def peer_stop_notice(self):
        """The first stop notice of another rank that the link pushed (``rank``, ``kind``,
        ``message``), or None."""
        return next((n for n in self.known_stopped if int(n["rank"]) != self.rank), None)

    def announce_stop(self, kind: str, message: str, wait: bool = True, ranks=None):
        """Tell every worker (through rank 0) why this one stops, so they can say so too; waits
        (at most ``STOP_CALL_TIMEOUT_S``) until they have read it, unless ``wait`` is false (a
        worker that resets instead of exiting: its exit cannot read as a loss to them).
        ``ranks``: the ranks the reason names as at fault (None: none)."""
        if self.host_lost is None:
            answer = self._request("stop", kind, message, None if ranks is None else [int(r) for r in ranks])
            if not wait:
                return
            try:
                answer.result(STOP_CALL_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                pass

    broken = property(lambda self: self._broken, doc="Its link broke and no re-attach got through yet.")

    def table(self, timeout_s: float = CALL_TIMEOUT_S) -> dict:
        """Live clocks and lost ranks (and how many calls the server refused).

        When rank 0 (the control host) is unreachable, the losses it pushed
        before are reported, or else rank 0 itself, with the last clocks read.
        Rank 0 is unreachable when the link says so (``host_lost``: it broke
        and no re-attach got through within ``RECONNECT_GRACE_S``), not when one
        query goes unanswered: that may be a flap the link survives, or a busy
        server, and reporting rank 0 lost would stop the job.
        """
        if self.host_lost is None:
            try:
                self._last_table = self._answer(self._request("table"), timeout_s, "a table query")
                return self._last_table
            except ControlError:
                return {**self._last_table, "lost": self.known_lost}
        return {
            **self._last_table,
            "lost": self.known_lost
            or [{"rank": 0, "clock": None, "reason": "rank 0 (the control host) is unreachable"}],
        }

    def close(self, leave: bool = True):
        """Leave the control path (idempotent).

        The leave is acknowledged (bounded) before the link ends (none is sent over a
        link that broke and has not re-attached: rank 0 names such a worker on its own; none
        with ``leave=False``, for an elastic reset, where every member closes and rank 0 closes
        its service: through a host's relay, whose own link to rank 0 had ended, the answer
        never came, and the worker waited out the call's bound while its peers waited for it in
        the next rendezvous), and the link's
        reader thread is joined (bounded) before the channel closes: closing a
        gRPC Python channel while another thread is still inside one of its
        calls is the pattern of gRPC's segfault reports (grpc/grpc#16290,
        #19235), such as a worker's open link when rank 0's server goes away.
        """
        if self._channel_closed:
            return
        # (no leave over a broken link, and no wait for its answer once the link breaks: rank 0
        # could answer only after a re-attach, and in an elastic reset, where rank 0 closes its
        # service, every re-form waited CALL_TIMEOUT_S for the worker that was waiting so)
        if leave and self.host_lost is None and not self._closing and not self._broken:
            self._send(["leave", self.rank])
            left = self._request("table")  # (answered after the leave before it: the leave arrived)
            deadline = time.monotonic() + CALL_TIMEOUT_S
            while not left.done() and not self._broken and time.monotonic() < deadline:
                concurrent.futures.wait([left], timeout=LEAVE_POLL_S)
        self._closing = True
        with self._lock:  # (the watcher starts no new link once _closing is set)
            link = self._link
        link.queue.put(None)
        link.call.cancel()
        self._watcher.join(WATCHER_JOIN_S)
        self._channel_closed = True
        self._channel.close()
