"""Rank 0's links: who is attached where, what each has been told, and what a link's end means.

A link (:class:`Link`) carries one worker, or the workers of one host through
its relay (:mod:`~tfsync.control.relay`).  A worker attaches on it with
``["attach", rank, closings, stops]``, saying how many closings and stop
notices it already has; the link then carries, in order and each once, what
rank 0 tells every worker (:meth:`Streams._broadcast`): the losses and stop
notices (whole, when they change) and the round closings (from the first the
link does not have).  Links that are at the same point get the same encoded
message, so a closing costs one encoding a round, not one per worker, and a
link's acknowledgement and answers ride in the same message: rank 0 writes to
a link at most once per turn of its event loop, however many messages it read.

What a link's end means depends on where its worker runs.  On rank 0's host (it
connected from an address rank 0 listens on) nothing but the end of its
process can end a worker's own link: rank 0 records the rank lost at once.  A
relay tells rank 0 the same of a worker whose local link ended
(``["ended", rank]``).  Across hosts a dropped connection and a dead process
look the same to rank 0, so a link that ends without ``Leave`` leaves its
workers detached (``"detached"`` in the table), and rank 0 records a worker lost
only if it has not re-attached within
:data:`~tfsync.control.transport.RECONNECT_GRACE_S`: its link flapped
and came back (a worker or a relay re-attaches with the same rank and token,
and resumes after what it has, so nothing is delivered twice or skipped), or
its relay died and it attached to rank 0 directly.  A flap that heals within
the grace costs nothing.  A group relay tells rank 0 the same of the workers of a
host relay whose link to it ended (``["detached", rank]``).
"""

import asyncio
import itertools
import logging
import time

import grpc.aio

from tfsync.control.transport import RECONNECT_GRACE_S, _peer_ip, decode, encode

REPORTS = ("report", "reports")  # a message of only these needs no acknowledgement of its own
LINK_DRAIN_S = 1.0  # a link that ends writes what it was told before the call ends, within this

log = logging.getLogger("tfsync.control")


class Link:
    """One gRPC stream into rank 0's service and what it has been told."""

    _ids = itertools.count(1)

    def __init__(self, local: bool, peer: str):
        self.id = next(Link._ids)
        self.local, self.peer = local, peer
        self.ranks = set()
        self.out = asyncio.Queue()  # encoded messages, written in order by the link's writer
        self.cursor = None  # (closings sent, lost version, stopped version), set at the first attach
        self.received = 0  # messages received: what the next message to it acknowledges
        self.acked = 0  # the messages it has been told were received
        self.reply = []  # answers for it, sent with the next broadcast
        self.relay = False  # a host's relay (it said so): its workers' own links end at the relay

    def send(self, data: bytes):
        self.out.put_nowait(data)


class Streams:
    """The server's links (a part of :class:`~tfsync.control.server.ControlServer`);
    everything here runs on the server's event loop."""

    async def _serve_link(self, request_iterator, context):
        """One link: read and handle its messages until it ends; its writer task sends what the
        link is told meanwhile."""
        peer = context.peer()
        link = Link(_peer_ip(peer) in self._own_ips, peer)
        self._links[link.id] = link
        writer = asyncio.ensure_future(self._write_link(link, context))
        try:
            while not self._stopping.is_set():
                data = await context.read()
                if data is grpc.aio.EOF:
                    break
                link.received += 1
                self._on_message(link, decode(data))
        except (asyncio.CancelledError, Exception) as exc:  # noqa: BLE001 - a broken link is a link's end
            if not isinstance(exc, asyncio.CancelledError):
                log.debug("tfsync: link %d from %s ended: %s", link.id, peer, exc)
        finally:
            link.send(None)  # the writer ends once what was queued is written: the call ends after it
            try:
                await asyncio.wait_for(writer, LINK_DRAIN_S)
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a broken link, or one past the bound
                writer.cancel()
            self._links.pop(link.id, None)
            self._link_ended(link)

    async def _write_link(self, link, context):
        while True:
            data = await link.out.get()
            if data is None:
                return
            await context.write(data)

    def _on_message(self, link, items):
        """Handle one message's items; its acknowledgement and answers go with this turn's
        broadcast (:meth:`_broadcast`), in one message to the link."""
        now = time.time() - self.t0
        with self._lock:
            self._served["messages_in"] += 1
            if any(item[0] not in REPORTS for item in items):  # (clocks alone: acknowledged with the next reply)
                self._answering[link.id] = link
            try:
                for item in items:
                    handle = self._handlers.get(item[0])
                    if handle is None:
                        raise ValueError(f"tfsync: a link sent an item of unknown kind {item[0]!r}")
                    handle(link, item, now)
            finally:
                if self._answers_due:  # (its ready notices: decided once, answered)
                    self._answer_ready(now)
        self._broadcast_soon()

    # ------------------------------------------------------------------ attach and end
    def _attach_item(self, link, item, now):
        """``["attach", rank, closings, stops]``: ``rank`` is on ``link`` now, having the first
        ``closings`` closings and ``stops`` stop notices (lock held)."""
        rank, closings, stops = int(item[1]), int(item[2]), int(item[3])
        prior = self._rank_link.get(rank)
        if prior is not None and prior != link.id and prior in self._links:
            self._links[prior].ranks.discard(rank)  # (a link its worker gave up on before this end noticed)
        self._rank_link[rank] = link.id
        link.ranks.add(rank)
        detached = self._detached.pop(rank, None)
        if detached is not None:
            detached[2].cancel()
            log.warning(
                "tfsync: rank %d re-attached to the control path %.1f s after its link ended", rank, now - detached[1]
            )
        if detached is not None or prior is not None:
            self.reattached[rank] += 1
        self._last_seen[rank] = now
        self._stops_seen[rank] = stops
        if link.cursor is None:
            link.cursor = (min(closings, len(self._closings)), -1, -1)
        link.reply.append(["attached", rank, int(link.local and not link.relay)])

    def _relay_item(self, link, item, now):
        """``["relay"]``: the link is a host's relay's."""
        link.relay = True

    def _ended_item(self, link, item, now):
        """``["ended", rank]`` from a relay: the rank's own link to it ended without ``Leave``;
        on its host, only the end of its process does that (lock held)."""
        rank = int(item[1])
        if self._rank_link.get(rank) == link.id:
            del self._rank_link[rank]
            link.ranks.discard(rank)
            self._stops_seen.pop(rank, None)
            if rank not in self._left and not self._stopping.is_set():
                self._record_lost(rank, now, "its process or connection ended")

    def _detached_item(self, link, item, now):
        """``["detached", rank]`` from a group relay: the link of the rank's host relay to it ended
        without ``Leave``; as a link across hosts that ends, the rank has the grace to re-attach
        (lock held)."""
        rank = int(item[1])
        if self._rank_link.get(rank) == link.id:
            link.ranks.discard(rank)
            self._detach(rank, link, now)

    def _relay_gone_item(self, link, item, now):
        """``["relay_gone", owner, rank]``: ``rank`` re-attached to rank 0 because nothing listens
        any more where its host's relay listened, on its own host; the relay runs in ``owner``'s
        process, which ended then (a relay stops only with its engine, which says ``leave``
        first).  ``owner`` is lost now, not after the grace a cut link gets (lock held)."""
        owner, rank = int(item[1]), int(item[2])
        if owner in self._left or owner in self._lost or self._stopping.is_set():
            return
        self._owner_gone[owner] = (
            f"its process ended: the host relay it ran stopped listening "
            f"(rank {rank} found its port closed on their host)"
        )
        detached = self._detached.pop(owner, None)
        if detached is not None:
            detached[2].cancel()
            self._record_lost(owner, now, self._owner_gone[owner])
        # (still on the relay's link: that link's end, which rank 0 has not seen yet, records it)

    def _leave_item(self, link, item, now):
        self._left.add(int(item[1]))

    def _link_ended(self, link):
        """A link ended: its workers are lost (a worker's own link on rank 0's host) or detached
        until they re-attach within the grace."""
        now = time.time() - self.t0
        with self._lock:
            own = link.local and not link.relay
            for rank in sorted(link.ranks):
                if self._rank_link.get(rank) != link.id:  # re-attached elsewhere meanwhile
                    continue
                if own:  # nothing between it and this host could have dropped: its process ended
                    del self._rank_link[rank]
                    self._stops_seen.pop(rank, None)
                    if rank not in self._left and not self._stopping.is_set():
                        self._record_lost(rank, now, "its process or connection ended")
                    continue
                self._detach(rank, link, now)
        self._broadcast_soon()

    def _detach(self, rank, link, now):
        """``rank``'s way to rank 0 through ``link`` ended: lost unless it re-attaches within the
        grace (lock held)."""
        del self._rank_link[rank]
        self._stops_seen.pop(rank, None)
        if rank in self._left or self._stopping.is_set():
            return
        if rank in self._owner_gone:  # (its relay's process, its own, ended: no re-attach can come)
            self._record_lost(rank, now, self._owner_gone[rank])
            return
        timer = self._loop.call_later(RECONNECT_GRACE_S, self._grace_over, rank, link.id)
        self._detached[rank] = (link.id, now, timer)

    def _record_lost(self, rank, at_s, reason):
        """Record ``rank`` lost (lock held); every link is told."""
        if rank not in self._lost:
            self._lost[rank] = {"rank": rank, "clock": self._clocks[rank], "at_s": at_s, "reason": reason}
            self._lost_version += 1

    def _grace_over(self, rank, link_id):
        """A worker on another host did not re-attach within the grace: it is lost."""
        with self._lock:
            detached = self._detached.get(rank)
            if detached is None or detached[0] != link_id or self._stopping.is_set():
                return
            del self._detached[rank]
            if rank not in self._left:
                self._record_lost(
                    rank,
                    detached[1],
                    f"its connection to rank 0 ended and it did not re-attach within {RECONNECT_GRACE_S:g} s: "
                    f"its process ended or stopped answering, or the link between its host and rank 0's stayed down",
                )
        self._broadcast_soon()

    # ----------------------------------------------------------------------- broadcast
    def _broadcast_soon(self):
        """Tell every link what changed, once this turn of the loop is done (one message for all
        the changes a turn made)."""
        if not self._broadcast_due:
            self._broadcast_due = True
            self._loop.call_soon(self._broadcast)

    def _broadcast(self):
        """Send each link, in one message, its acknowledgement and answers and what it has not
        been told: the losses and stop notices when they changed, and the closings from its
        cursor.  Links at the same point share one encoding of the latter, so a turn costs one
        write per link that has news, however many messages it handled."""
        self._broadcast_due = False
        with self._lock:
            now = (len(self._closings), self._lost_version, self._stopped_version)
            # every link when there is news for all, else only those with answers (a turn that
            # closed nothing costs the links it read, not every link)
            links = self._links.values() if now != self._told else list(self._answering.values())
            self._told, self._answering = now, {}
            messages = {}
            for link in links:
                told = link.cursor is None or link.cursor == now
                if told and not link.reply and link.received == link.acked:
                    continue
                data = b""
                if not told:
                    data = messages.get(link.cursor)
                    if data is None:
                        closings, lost, stopped = link.cursor
                        items = []
                        if lost < now[1] or stopped < now[2]:
                            items.append(["notices", list(self._lost.values()), list(self._stopped.values())])
                        if closings < now[0]:
                            items.append(["closed", closings, self._closings[closings:]])
                        data = messages[link.cursor] = encode(items)
                    self._served["closings"] += now[0] - link.cursor[0]
                    link.cursor = now
                if link.received > link.acked or link.reply:
                    own = encode([["acked", link.received], *link.reply])
                    link.acked, link.reply = link.received, []
                    data = own[:-1] + b"," + data[1:] if data else own  # (two JSON lists joined)
                link.send(data)
                self._served["messages_out"] += 1
