"""The stop handshake: a worker that stops tells every other one why, before it exits.

A worker that stops (a wait timed out, a peer was lost) sends
``["stop", rank, id, kind, message]`` with its reason before it exits; rank 0
pushes the notice on every link, each worker confirms it has read it
(``["seen", rank, stops]``), and rank 0 answers the stop once all have (at
most :data:`STOP_NOTICE_GRACE_S`), so the others name the stop's cause, not the
stopping rank's vanished connection.  A link's write is no proof of reading:
gRPC finishes a send once the bytes are in the transport, and when the
stopping process ends, its connections reset, which can take unread messages
with them.
"""

import asyncio

STOP_CALL_TIMEOUT_S = 3.0  # how long a stopping worker waits for the answer (rank 0 holds it up to the grace)
STOP_NOTICE_GRACE_S = 2.0  # the stop is answered once every attached worker confirmed the notice, or after this
STOP_NOTICE_POLL_S = 0.05  # how often a held stop rechecks the confirmations


class StopHandshake:
    """The server's side (a part of :class:`~tfsync.control.server.ControlServer`)."""

    def _stop_item(self, link, item, now):
        """``["stop", rank, id, kind, message]``: record the notice (every link is told) and
        answer once every attached worker read it, or after the grace (lock held)."""
        rank, request = int(item[1]), item[2]
        if rank not in self._stopped:
            self._stopped[rank] = {"rank": rank, "kind": item[3], "message": item[4]}
            self._stopped_version += 1
        count = len(self._stopped)
        self._loop.create_task(self._answer_stop(link, rank, request, count))

    async def _answer_stop(self, link, rank, request, count):
        deadline = self._loop.time() + STOP_NOTICE_GRACE_S
        while self._loop.time() < deadline and not self._stopping.is_set():
            with self._lock:
                if all(n >= count for n in self._stops_seen.values()):
                    break
            await asyncio.sleep(STOP_NOTICE_POLL_S)
        with self._lock:
            link.reply.append(["answer", rank, request, {"ok": 1}])
            self._answering[link.id] = link
        self._broadcast_soon()

    def _seen_item(self, link, item, now):
        """``["seen", rank, stops]``: a worker has read the first ``stops`` stop notices (what a
        held stop waits for; lock held)."""
        rank = int(item[1])
        if rank in self._stops_seen:
            self._stops_seen[rank] = max(self._stops_seen[rank], int(item[2]))
