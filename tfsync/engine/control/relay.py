"""A host's relay (:class:`HostRelay`): its workers' control traffic on one link to rank 0.

Every worker of a host but rank 0's attaches to its host's relay, which runs in
the process of the host's first rank, instead of to rank 0: rank 0 then holds
one link per host, not per worker, and reads one message where the host's
workers sent several, as hierarchical allreduce reduces within a host before
it crosses the network.  The relay

* forwards its workers' items on its one link to rank 0, one message in flight
  at a time (what is queued meanwhile goes as the next message), and
  acknowledges a worker's message once rank 0 acknowledged what carried it
  (what rank 0 did not acknowledge goes again after a re-attach);
* holds its workers' ready notices until every worker of the host has sent
  its own, or for at most :data:`READY_HOLD_S`, so that a round costs rank 0
  one message per host, not one per worker (a host whose workers finish a
  step together, as data-parallel workers do, is never held);
* sends their clocks together (``["reports", {rank: clock}, {rank: waiting}]``), the newest of
  each and whether it waits for its peers, with the next message that goes to rank 0, or on their own: at once
  when none went for ``REPORT_FLUSH_S``, else at the end of that interval (so
  a waiting worker's forced report is as fresh at rank 0 as a direct one's);
* passes rank 0's answers to the worker that asked, and what rank 0 tells
  every worker (notices, closings) to each of its workers as rank 0 encoded it,
  keeping it for a worker that attaches later;
* asks rank 0 for the table once for the workers that ask meanwhile;
* tells rank 0 when a worker's own link ended without ``Leave``
  (``["ended", rank]``): on its host, only the end of the worker's process
  does that;
* re-attaches when its link to rank 0 breaks, within
  :data:`~tfsync.engine.control.transport.RECONNECT_GRACE_S`; past it, tells its
  workers so (``["host_lost"]``), closes their links and takes no new ones:
  each worker tries rank 0 itself before it reports rank 0 unreachable.

A worker's link to the relay carries the token too; a worker whose relay is
gone (the relay's process ended) re-attaches to rank 0 directly
(:class:`~tfsync.engine.control.client.ControlClient`'s ``fallback``).

Relays of relays: in a job of more than :data:`GROUP_HOSTS` relaying hosts, the
host relays of each :data:`GROUP_HOSTS` hosts attach to a *group relay* (the same
class, run by the group's first host, listening where other hosts reach it),
which relays them to rank 0 as a host relay does its workers: rank 0 holds one
link per group, and a round of 1024 workers on hosts of 8 costs it about 16
links' messages, not 128.  A host relay speaks to its group relay as a worker
does to its host relay, with what differs between the two: its items carry
many ranks (``["relay"]`` says so; its clocks come as one ``reports`` item);
a host relay's link ending is not its workers' end (its host may only have
lost the network): the group relay tells rank 0 they are ``detached``, and
rank 0 names them lost only if they do not re-attach within the grace.  A host
relay whose group relay is gone (its process ended, or it gave up on rank 0)
re-attaches to rank 0 itself (``fallback``), each attempt bounded by
:data:`~tfsync.engine.control.transport.ATTEMPT_S`, well within the grace.
"""

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time

import grpc
import grpc.aio

from tfsync.engine.control.streams import LINK_DRAIN_S, REPORTS
from tfsync.engine.control.transport import (
    ATTEMPT_S,
    CHANNEL_OPTIONS,
    LINK_METHOD,
    RECONNECT_BACKOFF_MS,
    RECONNECT_GRACE_S,
    SERVER_OPTIONS,
    TOKEN_METADATA_KEY,
    TokenGate,
    _check_token,
    _host_port,
    decode,
    encode,
    gate,
)

REPORT_FLUSH_S = 0.25  # a host's clocks go to rank 0 on their own at most this often
READY_HOLD_S = 0.002  # a ready notice waits at most this for the host's other workers' notices
RELAY_START_S = 30.0  # the relay starts (binds its port) within this
RELAY_STOP_S = 2.0  # how long HostRelay.stop waits for its server and link to end
GROUP_HOSTS = 8  # host relays per group relay, once a job has more relaying hosts than this
BROADCAST = ("notices", "closed")  # what rank 0 tells every worker: passed on as it came

log = logging.getLogger("tfsync.control")


class _Local:
    """A worker's link to the relay."""

    _ids = itertools.count(1)

    def __init__(self):
        self.id = next(_Local._ids)
        self.out = asyncio.Queue()
        self.relay = False  # a host relay's link (to a group relay), not a worker's
        self.ranks = set()
        self.received = 0  # its messages received
        self.acked = 0  # the newest of them rank 0 has acknowledged everything of
        self.task = None  # the task that serves it


class HostRelay(TokenGate):
    """The relay of one host (see the module docstring).

    Args:
        upstream: where it attaches: rank 0's service, or its group relay (``host:port``).
        token: the job's token.
        t0: the job's t0 (refusals are recorded in seconds since it).
        host: where its workers (or, for a group relay, the host relays) reach it (default the
            loopback address: a host relay's workers run on its host).
        fallback: rank 0's service, where it re-attaches when ``upstream`` (a group relay) is gone.
    """

    def __init__(self, upstream: str, token: str, t0: float, host: str = "127.0.0.1", fallback: str | None = None):
        self.upstream, self.t0 = upstream, t0
        self._addresses = [upstream] + ([fallback] if fallback else [])
        self._upstream_gone = False  # its group relay gave up on rank 0: it tries rank 0 itself
        self._token = _check_token(token).encode("ascii")
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._lock = threading.Lock()
        self.rejected, self.rejected_count = [], 0
        self._last_rejection_log, self._rejections_unlogged = float("-inf"), 0
        self._stopping = threading.Event()
        self._locals = {}  # local link id -> _Local
        self._rank_local = {}  # rank -> local link id
        self._attached = {}  # rank -> the attach item it sent (re-sent to rank 0 after a re-attach)
        self._left = set()
        self._closings = []  # every closing rank 0 sent, for a worker that attaches later
        self._notices = None  # the newest ["notices", lost, stopped]
        self._clocks = {}  # rank -> (newest clock, whether it waits for its peers) not yet sent
        self._flushed = float("-inf")  # when clocks last went to rank 0
        self._pending = []  # (items, [(local link id, its message index)]) for rank 0, not yet sent
        self._held = []  # the same, of ready notices held for the host's others (READY_HOLD_S)
        self._held_ranks = set()  # the ranks whose notice is held
        self._hold_timer = None
        self._unacked = []  # (upstream message index, items, [(local link id, its message index)])
        self._sent = 0  # messages sent on the current upstream link
        self._table_waiters = None  # (request id to rank 0, [(local link id, rank, its request id)])
        self._ids = itertools.count(1)
        self._wake = None  # set when there is something to send upstream
        self.host_lost = None
        self.reattached = 0
        self._loop = asyncio.new_event_loop()
        started = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(host, started), daemon=True, name="tfsync-relay")
        self._thread.start()
        try:
            self.address = started.result(RELAY_START_S)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"tfsync: the host's control relay did not start in {RELAY_START_S:.0f} s") from None

    # ------------------------------------------------------------------- lifecycle
    def _run(self, host, started):
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(host, started))
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            if not started.done():
                started.set_exception(exc)
            return
        self._loop.run_forever()

    async def _start(self, host, started):
        self._wake = asyncio.Event()
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers([gate(self._admits, self._serve_local, self._refuse)])
        port = self._server.add_insecure_port(_host_port(host, 0))
        if not port:
            raise RuntimeError(f"tfsync: the host's control relay could not listen on {host!r}")
        self.address = _host_port(host, port)
        await self._server.start()
        self._channel = grpc.aio.insecure_channel(self.upstream, options=CHANNEL_OPTIONS)
        self._upstream_task = asyncio.ensure_future(self._follow_upstream())
        self._flusher = asyncio.ensure_future(self._flush_reports())
        started.set_result(self.address)

    def stop(self):
        """Stop relaying (its workers have left: ``close()`` runs a barrier first)."""
        if self._stopping.is_set():
            return
        self._stopping.set()

        async def shut():
            self._upstream_task.cancel()
            self._flusher.cancel()
            await self._server.stop(grace=None)
            await self._channel.close()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(RELAY_STOP_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(RELAY_STOP_S)

    # ---------------------------------------------------------------- its workers
    async def _serve_local(self, request_iterator, context):
        if self.host_lost is not None:  # (it gave up on rank 0: its workers go there themselves)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "tfsync: this host's relay lost rank 0")
        local = _Local()
        local.task = asyncio.current_task()
        self._locals[local.id] = local
        writer = asyncio.ensure_future(_write(local.out, context))
        try:
            while not self._stopping.is_set():
                data = await context.read()
                if data is grpc.aio.EOF:
                    break
                local.received += 1
                self._from_local(local, decode(data))
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a broken link is a link's end
            pass
        finally:
            local.out.put_nowait(None)  # the writer ends once what was queued is written
            try:
                await asyncio.wait_for(writer, LINK_DRAIN_S)
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a broken link, or one past the bound
                writer.cancel()
            self._locals.pop(local.id, None)
            # a worker's link to its host's relay ends with its process; a host relay's link to
            # its group relay may only have lost the network: rank 0 gives its workers the grace
            end = "detached" if local.relay else "ended"
            for rank in local.ranks:
                if self._rank_local.get(rank) == local.id:
                    del self._rank_local[rank]
                    self._attached.pop(rank, None)
                    if rank not in self._left and not self._stopping.is_set():
                        self._forward([[end, rank]], None)

    def _from_local(self, local, items):
        forwarded, reply, ready, catch_up = [], [], [], None
        for item in items:
            kind = item[0]
            if kind == "relay":  # (a host relay attaching to this group relay)
                local.relay = True
                continue
            if kind == "reports":  # (a host relay's clocks, together)
                waiting = item[2] if len(item) > 2 else {}
                for rank, clock in item[1].items():
                    self._clock(int(rank), int(clock), waiting.get(rank, 0))
                self._clock_due()
                continue
            rank = int(item[1])
            if kind == "attach":
                local.ranks.add(rank)
                self._rank_local[rank] = local.id
                self._attached[rank] = item
                forwarded.append(["attach", rank, len(self._closings), _stops(self._notices)])
                reply.append(["attached", rank, 0])
                catch_up = int(item[2]) if catch_up is None else min(catch_up, int(item[2]))
            elif kind == "report":
                self._clock(rank, int(item[2]), item[3] if len(item) > 3 else 0)
                self._clock_due()
            elif kind == "table":
                self._ask_table(local, rank, item[2])
            elif kind == "ready":
                ready.append(item)
            else:
                if kind == "leave":
                    self._left.add(rank)
                elif kind in ("ended", "detached") and self._rank_local.get(rank) == local.id:
                    del self._rank_local[rank]  # (a host relay's worker: not re-attached after a break)
                    self._attached.pop(rank, None)
                    local.ranks.discard(rank)
                forwarded.append(item)
        if reply:
            local.out.put_nowait(encode(reply))
        if catch_up is not None:  # (once for a message: a host relay attaches its workers together)
            self._catch_up(local, catch_up)
        if ready:
            self._hold(ready, local)
        self._forward(forwarded, local if forwarded else None)
        if not forwarded and not ready and any(item[0] not in REPORTS for item in items):
            # (its table question, which the relay answers: nothing for rank 0 to acknowledge; a
            # message of reports alone needs no acknowledgement, its sender keeps nothing of it)
            local.acked = local.received
            local.out.put_nowait(encode([["acked", local.received]]))

    def _clock(self, rank, clock, waiting):
        """A worker's clock (the newest goes on) and whether it waits for its peers (its last say)."""
        self._clocks[rank] = (max(self._clocks.get(rank, (-1, 0))[0], clock), int(bool(waiting)))

    def _clock_due(self):
        """Clocks just came: they go with the next message to rank 0, or at once when none went
        for ``REPORT_FLUSH_S`` (a lone report goes at once)."""
        if time.monotonic() - self._flushed >= REPORT_FLUSH_S:
            self._send_clocks()

    def _catch_up(self, local, closings):
        """A worker attaching with the first ``closings`` closings: the notices and the closings
        after them that the relay has."""
        items = [self._notices] if self._notices is not None else []
        if closings < len(self._closings):
            items.append(["closed", closings, self._closings[closings:]])
        if items:
            local.out.put_nowait(encode(items))

    def _ask_table(self, local, rank, request):
        """One table question to rank 0 for every worker that asks while it is out."""
        if self._table_waiters is None:
            self._table_waiters = (next(self._ids), [])
            self._forward([["table", -1, self._table_waiters[0]]], None)
        self._table_waiters[1].append((local.id, rank, request))

    def _forward(self, items, local):
        """Queue ``items`` for rank 0 (``local``: the worker link they came from, acknowledged once
        rank 0 acknowledged them); what is held goes with them."""
        if not items:
            return
        self._release()
        self._pending.append((items, [] if local is None else [(local.id, local.received)]))
        self._wake.set()

    def _hold(self, items, local):
        """Hold ready notices until every worker of the host has sent one, or ``READY_HOLD_S``."""
        self._held.append((items, [(local.id, local.received)]))
        self._held_ranks.update(int(item[1]) for item in items)
        if self._held_ranks >= self._attached.keys() - self._left:
            self._release()
        elif self._hold_timer is None:
            self._hold_timer = self._loop.call_later(READY_HOLD_S, self._release)

    def _release(self):
        """Queue the held ready notices for rank 0."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self._held:
            self._pending.extend(self._held)
            self._held, self._held_ranks = [], set()
            self._wake.set()

    async def _flush_reports(self):
        """Clocks that no message took along go on their own, ``REPORT_FLUSH_S`` after the last went."""
        while True:
            await asyncio.sleep(REPORT_FLUSH_S / 4)
            if self._clocks and time.monotonic() - self._flushed >= REPORT_FLUSH_S:
                self._send_clocks()

    def _send_clocks(self):
        """Every clock not sent yet, to rank 0, in one item."""
        clocks, self._clocks = self._clocks, {}
        self._flushed = time.monotonic()
        self._pending.append(([_reports(clocks)], []))
        self._wake.set()

    # --------------------------------------------------------------- its link to rank 0
    async def _follow_upstream(self):
        """Keep one link to rank 0 (or to its group relay): re-attach within the grace when it
        breaks; past the grace, rank 0 is unreachable.  With two addresses (its group relay, then
        rank 0), an attempt that did not get through moves to the other, each attempt bounded by
        ``ATTEMPT_S``; once its group relay gave up on rank 0, it tries rank 0 itself, once."""
        deadline = None
        while not self._stopping.is_set():
            call = self._channel.stream_stream(LINK_METHOD)(metadata=self._metadata, wait_for_ready=True)
            attempt_end = deadline
            if deadline is not None and len(self._addresses) > 1:
                attempt_end = min(deadline, time.monotonic() + ATTEMPT_S)
            attached = await self._run_upstream(call, attempt_end)
            if self._stopping.is_set():
                return
            if attached or deadline is None:
                deadline = time.monotonic() + RECONNECT_GRACE_S
                log.warning("tfsync: the relay's link to %s broke; re-attaching", self.upstream)
            if self._upstream_gone:
                self._upstream_gone = False
                if len(self._addresses) > 1:  # (its group relay gave up: rank 0 itself, once)
                    self._addresses = self._addresses[1:]
                    deadline = min(deadline, time.monotonic() + ATTEMPT_S)
                else:
                    deadline = time.monotonic()
            elif len(self._addresses) > 1 and not attached:
                self._addresses.append(self._addresses.pop(0))
            if self._addresses[0] != self.upstream:
                await self._channel.close()
                self.upstream = self._addresses[0]
                self._channel = grpc.aio.insecure_channel(self.upstream, options=CHANNEL_OPTIONS)
            if time.monotonic() >= deadline:
                self.host_lost = time.time()
                log.warning("tfsync: the relay could not re-attach to rank 0 within %g s", RECONNECT_GRACE_S)
                for local in list(self._locals.values()):
                    local.out.put_nowait(encode([["host_lost"]]))
                    local.task.cancel()  # (its link ends once the notice is written)
                return
            await asyncio.sleep(RECONNECT_BACKOFF_MS[0] / 1e3)

    async def _run_upstream(self, call, deadline):
        """One link to rank 0, until it ends; whether it attached."""
        self._sent = 0
        resend = [item for _, items, _ in self._unacked for item in items]
        acks = [ack for _, _, carried in self._unacked for ack in carried]
        self._unacked = []
        attach = [["attach", rank, len(self._closings), _stops(self._notices)] for rank in self._attached]
        if self._table_waiters is not None:  # (asked on the link that broke: its answer may never come)
            resend.append(["table", -1, self._table_waiters[0]])
        self._pending.insert(0, ([["relay"], *attach, *resend], acks))
        self._wake.set()
        sender = asyncio.ensure_future(self._send_upstream(call))
        attached = False
        timer = None
        if deadline is not None:
            timer = self._loop.call_later(max(deadline - time.monotonic(), 0.0), call.cancel)
        try:
            async for data in call:
                if not attached:
                    attached = True
                    if timer is not None:
                        timer.cancel()
                    if deadline is not None:
                        self.reattached += 1
                        log.warning("tfsync: the relay re-attached to %s", self.upstream)
                self._from_upstream(data)
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        finally:
            sender.cancel()
            if timer is not None:
                timer.cancel()
        return attached

    async def _send_upstream(self, call):
        """Send what is queued for rank 0, one message at a time: what is queued while a message
        is unacknowledged goes together after its acknowledgement, so a busy host sends fewer,
        larger messages and rank 0 reads one per host per turn, not one per worker item."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending or self._unacked:
                continue
            pending, self._pending = self._pending, []
            if self._clocks:  # (the clocks ride along)
                clocks, self._clocks = self._clocks, {}
                self._flushed = time.monotonic()
                pending.append(([_reports(clocks)], []))
            items = [item for batch, _ in pending for item in batch]
            acks = [ack for _, carried in pending for ack in carried]
            self._sent += 1
            kept = [i for i in items if i[0] != "reports"]
            if kept or acks:  # (clocks alone: not resent, not acknowledged, not in the window)
                self._unacked.append((self._sent, kept, acks))
            await call.write(encode(items))

    def _from_upstream(self, data):
        """Rank 0's message: to each worker, in one message, its acknowledgements and answers and
        what rank 0 tells every worker (as rank 0 encoded it, when that is all it held)."""
        items = decode(data)
        broadcast = [item for item in items if item[0] in BROADCAST]
        replies = {}  # local link id -> items
        for item in items:
            kind = item[0]
            if kind == "host_lost":  # (its group relay could not re-attach to rank 0 within the grace)
                self._upstream_gone = True
            elif kind == "acked":
                self._acked(item[1], replies)
            elif kind == "answer":
                rank, request = int(item[1]), item[2]
                if rank == -1 and self._table_waiters is not None and request == self._table_waiters[0]:
                    waiters, self._table_waiters = self._table_waiters[1], None
                    for local_id, asker, asked in waiters:
                        replies.setdefault(local_id, []).append(["answer", asker, asked, item[3]])
                elif rank in self._rank_local:
                    replies.setdefault(self._rank_local[rank], []).append(item)
            elif kind == "accepted":  # (answers to ready notices, to each worker's link its own)
                own = {}
                for entry in item[1]:
                    local_id = self._rank_local.get(int(entry[0]))
                    if local_id is not None:
                        own.setdefault(local_id, []).append(entry)
                for local_id, entries in own.items():
                    replies.setdefault(local_id, []).append(["accepted", entries])
        shared = b""
        if broadcast:
            for item in broadcast:
                if item[0] == "notices":
                    self._notices = item
                else:
                    start, entries = item[1], item[2]
                    self._closings.extend(entries[max(len(self._closings) - start, 0) :])
            shared = data if len(broadcast) == len(items) else encode(broadcast)
        for local_id, local in self._locals.items():
            own = replies.get(local_id)
            if own:  # (its answers first, then what every worker is told, in one message)
                local.out.put_nowait(encode(own)[:-1] + b"," + shared[1:] if shared else encode(own))
            elif shared:
                local.out.put_nowait(shared)

    def _acked(self, count, replies):
        """Rank 0 acknowledged the first ``count`` messages of this link: so are the worker
        messages they carried."""
        while self._unacked and self._unacked[0][0] <= count:
            _, _, acks = self._unacked.pop(0)
            for local_id, index in acks:
                local = self._locals.get(local_id)
                if local is not None and index > local.acked:
                    local.acked = index
                    replies.setdefault(local_id, []).append(["acked", index])
        if not self._unacked and self._pending:  # (the next message may go)
            self._wake.set()


def _reports(clocks):
    """The ``reports`` item of ``{rank: (clock, waiting)}``."""
    return ["reports", {str(r): c for r, (c, _) in clocks.items()}, {str(r): w for r, (_, w) in clocks.items()}]


def _stops(notices):
    return len(notices[2]) if notices is not None else 0


async def _write(out, context):
    while True:
        data = await out.get()
        if data is None:
            return
        await context.write(data)


__all__ = ["HostRelay"]
