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
  its own, or for at most :data:`~tfsync.control.outgoing.READY_HOLD_S`, so that a round costs rank 0
  one message per host, not one per worker (a host whose workers finish a
  step together, as data-parallel workers do, is never held);
* sends their clocks together (``["reports", {rank: clock}]``), the newest of
  each, with the next message that goes to rank 0, or on their own: at once
  when none went for :data:`~tfsync.control.outgoing.REPORT_FLUSH_S`, else at the end of that interval (so
  a waiting worker's forced report is as fresh at rank 0 as a direct one's);
* passes rank 0's answers to the worker that asked, and what rank 0 tells
  every worker (notices, closings) to each of its workers as rank 0 encoded it,
  keeping it for a worker that attaches later;
* asks rank 0 for the table once for the workers that ask meanwhile;
* tells rank 0 when a worker's own link ended without ``Leave``
  (``["ended", rank]``): on its host, only the end of the worker's process
  does that;
* re-attaches when its link to rank 0 breaks, within
  :data:`~tfsync.control.transport.RECONNECT_GRACE_S`; past it, tells its
  workers so (``["host_lost"]``), closes their links and takes no new ones:
  each worker tries rank 0 itself before it reports rank 0 unreachable.

A worker's link to the relay carries the token too; a worker whose relay is
gone (the relay's process ended) re-attaches to rank 0 directly
(:class:`~tfsync.control.client.ControlClient`'s ``fallback``).

Relays of relays: in a job of more than :data:`~tfsync.control.topology.GROUP_HOSTS` relaying hosts, the
host relays of each :data:`~tfsync.control.topology.GROUP_HOSTS` hosts attach to a *group relay* (the same
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
:data:`~tfsync.control.transport.ATTEMPT_S`, well within the grace.
"""

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time

import grpc
import grpc.aio

from tfsync.control import link as reliable
from tfsync.control.outgoing import REPORT_FLUSH_S, Outgoing
from tfsync.control.streams import LINK_DRAIN_S, REPORTS
from tfsync.control.transport import (
    CHANNEL_OPTIONS,
    LINK_METHOD,
    SERVER_OPTIONS,
    TOKEN_METADATA_KEY,
    TokenGate,
    _check_token,
    _host_port,
    decode,
    encode,
    gate,
)

RELAY_START_S = 30.0  # the relay starts (binds its port) within this
RELAY_STOP_S = 2.0  # how long HostRelay.stop waits for its server and link to end
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
        self._reattach = reliable.Reattach([upstream] + ([fallback] if fallback else []), retry_first=True)
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
        self._closing_log = reliable.ClosingLog()
        self._notices = None  # the newest ["notices", lost, stopped]
        self._out = None  # what goes to rank 0 next (tfsync.control.outgoing), made on the relay's loop
        # what went to rank 0 on the current link, not yet acknowledged, with the worker
        # messages each carried ((local link id, its message index): acknowledged to them in turn)
        self._window = reliable.SendWindow(unkept=("reports",))
        self._table_waiters = None  # (request id to rank 0, [(local link id, rank, its request id)])
        self._ids = itertools.count(1)
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
        self._out = Outgoing(self._loop, asyncio.Event(), lambda: self._attached.keys() - self._left)
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
                        self._out.forward([[end, rank]])

    def _from_local(self, local, items):
        forwarded, reply, ready, catch_up = [], [], [], None
        for item in items:
            kind = item[0]
            if kind == "relay":  # (a host relay attaching to this group relay)
                local.relay = True
                continue
            if kind == "reports":  # (a host relay's clocks, together)
                for rank, clock in item[1].items():
                    self._out.clock(int(rank), int(clock))
                self._out.clocks_came()
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
                self._out.clock(rank, int(item[2]))
                self._out.clocks_came()
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
            self._out.hold(ready, [(local.id, local.received)])
        self._out.forward(forwarded, [(local.id, local.received)])
        if not forwarded and not ready and any(item[0] not in REPORTS for item in items):
            # (its table question, which the relay answers: nothing for rank 0 to acknowledge; a
            # message of reports alone needs no acknowledgement, its sender keeps nothing of it)
            local.acked = local.received
            local.out.put_nowait(encode([["acked", local.received]]))

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
            self._out.forward([["table", -1, self._table_waiters[0]]])
        self._table_waiters[1].append((local.id, rank, request))

    async def _flush_reports(self):
        """Clocks that no message took along go on their own, ``REPORT_FLUSH_S`` after the last went."""
        while True:
            await asyncio.sleep(REPORT_FLUSH_S / 4)
            self._out.flush_due()

    # --------------------------------------------------------------- its link to rank 0
    async def _follow_upstream(self):
        """Keep one link to rank 0 (or to its group relay): re-attach within the grace when it
        breaks; past the grace, rank 0 is unreachable (:class:`~tfsync.control.link.Reattach`:
        with two addresses, its group relay then rank 0, each attempt bounded; once its group
        relay gave up on rank 0, rank 0 itself, once)."""
        attempt_end = None
        while not self._stopping.is_set():
            call = self._channel.stream_stream(LINK_METHOD)(metadata=self._metadata, wait_for_ready=True)
            attached = await self._run_upstream(call, attempt_end)
            if self._stopping.is_set():
                return
            if attached or self._reattach.deadline is None:
                log.warning("tfsync: the relay's link to %s broke; re-attaching", self.upstream)
            attempt = self._reattach.next(attached)
            if attempt is None:
                self.host_lost = time.time()
                log.warning("tfsync: the relay could not re-attach to rank 0 within %g s", reliable.RECONNECT_GRACE_S)
                for local in list(self._locals.values()):
                    local.out.put_nowait(encode([["host_lost"]]))
                    local.task.cancel()  # (its link ends once the notice is written)
                return
            address, attempt_end, pause = attempt
            if address != self.upstream:
                await self._channel.close()
                self.upstream = address
                self._channel = grpc.aio.insecure_channel(self.upstream, options=CHANNEL_OPTIONS)
            await asyncio.sleep(pause)

    async def _run_upstream(self, call, deadline):
        """One link to rank 0, until it ends; whether it attached."""
        resend, acks = self._window.restart()
        attach = [["attach", rank, len(self._closings), _stops(self._notices)] for rank in self._attached]
        if self._table_waiters is not None:  # (asked on the link that broke: its answer may never come)
            resend.append(["table", -1, self._table_waiters[0]])
        self._out.first([["relay"], *attach, *resend], acks)
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
                    if self._reattach.deadline is not None:
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
        out = self._out
        while True:
            await out.wake.wait()
            out.wake.clear()
            if not out.pending or self._window.waiting():
                continue
            items, acks = out.take()
            self._window.sent_message(items, acks)  # (clocks alone: not resent, not acknowledged)
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
                self._reattach.upstream_gave_up()
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
                    self._closings.extend(self._closing_log.fresh(item[1], item[2]))
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
        for local_id, index in self._window.acked(count):
            local = self._locals.get(local_id)
            if local is not None and index > local.acked:
                local.acked = index
                replies.setdefault(local_id, []).append(["acked", index])
        if not self._window.waiting() and self._out.pending:  # (the next message may go)
            self._out.wake.set()


def _stops(notices):
    return len(notices[2]) if notices is not None else 0


async def _write(out, context):
    while True:
        data = await out.get()
        if data is None:
            return
        await context.write(data)


__all__ = ["HostRelay"]
