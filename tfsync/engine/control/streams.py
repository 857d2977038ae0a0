"""Each worker's ``Attach`` stream on rank 0: losses, stop notices and round closings, in order.

Each worker holds one long-lived ``Attach`` stream, which carries rank 0's
notices to it and tells each end whether the other is still there.  What a
stream's end means depends on where the worker runs.  On rank 0's host (it
connected from an address rank 0 listens on) nothing but the end of its
process can end its stream: rank 0 records the rank lost at once, and the
worker, when its stream breaks, reports rank 0 unreachable at once
(``host_lost``).  Across hosts a dropped connection and a dead process look the
same to rank 0 (gRPC's server tells a handler that its call ended, not why),
so a stream that ends without ``Leave`` leaves its rank detached
(``"detached"`` in the table), and rank 0 records it lost only if it has not
re-attached within :data:`~tfsync.engine.control.transport.RECONNECT_GRACE_S`.
The worker, when its stream breaks while it is not closing, re-attaches with
the same rank and token, saying how many closings and stop notices it already
has; the new stream resumes after them, so none is delivered twice or
skipped, and the losses and stop notices come again whole.  A dead worker on
another host is thus named after the grace, a link that stays down after the
keepalive bound and the grace; a flap that heals within the grace costs
nothing.
"""

import logging
import threading
import time

from tfsync.engine.control.transport import RECONNECT_GRACE_S, _peer_ip

STREAM_WAKE_S = 0.5  # an Attach stream's condition wait: rechecks end/shutdown this often

log = logging.getLogger("tfsync.control")


class Streams:
    """The server's streams (a part of :class:`~tfsync.engine.control.server.ControlServer`)."""

    def _attach(self, request, context):
        """A worker's stream: losses, stop notices and round closings, in order.

        ``request``: ``rank``, and on a re-attach how many closings and stop notices
        the worker already has (``closings``, ``stops``): the stream resumes there.
        """
        rank = int(request["rank"])
        local = _peer_ip(context.peer()) in self._own_ips
        with self._lock:
            stream = next(self._stream_ids)
            # a stream this one replaces (its worker gave up on it before this end noticed) sees this and ends
            replaced = self._streams.get(rank)
            self._streams[rank] = stream
            detached = self._detached.pop(rank, None)
            if detached is not None:
                detached[2].cancel()
            if detached is not None or replaced is not None:
                self.reattached[rank] += 1
            self._last_seen[rank] = time.time() - self.t0
            self._stops_seen[rank] = int(request.get("stops", 0))
            told_closings = min(int(request.get("closings", 0)), len(self._closings))
            self._changed.notify_all()
        if detached is not None:
            log.warning(
                "tfsync: rank %d re-attached to the control path %.1f s after its stream ended",
                rank,
                time.time() - self.t0 - detached[1],
            )

        def on_end():
            with self._lock:
                if self._streams.get(rank) != stream:  # replaced by a re-attach: nothing ended
                    return
                del self._streams[rank]
                self._stops_seen.pop(rank, None)
                self._changed.notify_all()
                if rank in self._left or self._stopping.is_set():
                    return
                if local:  # nothing between it and this host could have dropped: its process ended
                    self._record_lost(rank, time.time() - self.t0, "its process or connection ended")
                    return
                timer = threading.Timer(RECONNECT_GRACE_S, self._grace_over, args=(rank, stream))
                timer.daemon = True
                self._detached[rank] = (stream, time.time() - self.t0, timer)
                timer.start()

        if not context.add_callback(on_end):  # the call ended already (gRPC then never calls it)
            on_end()
        yield {"attached": rank, "local": int(local)}
        # Push every loss to every worker at once: if rank 0 goes down right after
        # (it stops too), the others still know whom they lost first.
        # Round closings go out in order, each once, in the same stream (and, after a
        # re-attach, from the first one the worker does not have).
        told = (0, 0, told_closings)
        while True:
            with self._lock:
                while (
                    (len(self._lost), len(self._stopped), len(self._closings)) == told
                    and self._streams.get(rank) == stream
                    and not self._stopping.is_set()
                ):
                    self._changed.wait(STREAM_WAKE_S)
                if self._streams.get(rank) != stream or self._stopping.is_set():
                    return
                closed = self._closings[told[2] :]
                self._served["closings"] += len(closed)
                told = (len(self._lost), len(self._stopped), len(self._closings))
                message = {"lost": list(self._lost.values()), "stopped": list(self._stopped.values()), "closed": closed}
            yield message

    def _record_lost(self, rank, at_s, reason):
        """Record ``rank`` lost (lock held); every stream pushes it."""
        self._lost.setdefault(rank, {"rank": rank, "clock": self._clocks[rank], "at_s": at_s, "reason": reason})
        self._changed.notify_all()

    def _grace_over(self, rank, stream):
        """A worker on another host did not re-attach within the grace: it is lost."""
        with self._lock:
            detached = self._detached.get(rank)
            if detached is None or detached[0] != stream or self._stopping.is_set():
                return
            del self._detached[rank]
            if rank not in self._left:
                self._record_lost(
                    rank,
                    detached[1],
                    f"its connection to rank 0 ended and it did not re-attach within {RECONNECT_GRACE_S:g} s: "
                    f"its process ended or stopped answering, or the link between its host and rank 0's stayed down",
                )
