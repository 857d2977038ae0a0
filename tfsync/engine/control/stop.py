"""The stop handshake: a worker that stops tells every other one why, before it exits.

A worker that stops (a wait timed out, a peer was lost) calls ``Stop`` with its
reason before it exits; rank 0 pushes the notice on every stream, each worker
confirms it has read it (``Seen``), and ``Stop`` answers once all have (at
most :data:`STOP_NOTICE_GRACE_S`), so the others name the stop's cause, not the
stopping rank's vanished connection.
"""

import time

STOP_CALL_TIMEOUT_S = 3.0  # deadline of a Stop call (the server holds it up to STOP_NOTICE_GRACE_S)
STOP_NOTICE_GRACE_S = 2.0  # Stop answers once every attached worker confirmed the notice, or after this
STOP_NOTICE_POLL_S = 0.05  # how often a held Stop call rechecks the confirmations


class StopHandshake:
    """The server's side (a part of :class:`~tfsync.engine.control.server.ControlServer`)."""

    def _stop(self, request, context):
        # Answer only once every attached worker has confirmed reading the notice (Seen),
        # or after STOP_NOTICE_GRACE_S: the stopping rank may exit right after, and if it
        # is rank 0 the others must already know why, not just that rank 0 vanished.
        # A stream's write is no proof: gRPC finishes a send once the bytes are in the
        # transport, and when rank 0's process ends its connections reset, which can
        # take unread messages with them (the others would report "lost rank 0" instead of its reason).
        deadline = time.monotonic() + STOP_NOTICE_GRACE_S
        with self._lock:
            self._stopped.setdefault(int(request["rank"]), dict(request))
            self._changed.notify_all()
            count = len(self._stopped)
            while (
                any(n < count for n in self._stops_seen.values())
                and time.monotonic() < deadline
                and not self._stopping.is_set()
            ):
                self._changed.wait(STOP_NOTICE_POLL_S)
        return {"ok": 1}

    def _seen(self, request, context):
        """A worker has read the first ``stops`` stop notices (what a held Stop call waits for)."""
        rank = int(request["rank"])
        with self._lock:
            if rank in self._stops_seen:
                self._stops_seen[rank] = max(self._stops_seen[rank], int(request["stops"]))
                self._changed.notify_all()
        return {"ok": 1}
