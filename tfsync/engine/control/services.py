"""What else rank 0 serves: the clock table, the policy's own service, a worker's leave.

Workers report their clock, throttled (``ControlClient.report``: at most one
report per ``REPORT_INTERVAL_S``, one in flight; a worker waiting for a round
forces one about once a second), so a wait that times out can say which rank
is behind from clocks at most about a second old.  A mode whose coordinator
keeps more state than closings runs it here as its service (DSSP's
synchronization controller, :mod:`tfsync.engine.grants`): workers ``Tell`` it
(fire-and-forget) and ``Ask`` it (answered at once), each message with a
topic.  The table (``Table``) holds the clocks, when each rank was last heard
from, the lost and detached ranks and how many calls were refused.
"""

import time

import grpc


class Services:
    """The table and the policy's service (a part of
    :class:`~tfsync.engine.control.server.ControlServer`)."""

    def _report(self, request, context):
        rank = int(request["rank"])
        with self._lock:
            self._served["reports"] += 1
            self._clocks[rank] = max(self._clocks[rank], int(request["clock"]))
            self._last_seen[rank] = time.time() - self.t0
        return {"ok": 1}

    def _tell(self, request, context):
        """A message for the policy's service (fire-and-forget; ignored when there is none)."""
        with self._lock:
            self._served["tells"] += 1
        if self._service is not None:
            self._service.tell(int(request["rank"]), request["topic"], request, time.time() - self.t0)
        return {"ok": 1}

    def _ask(self, request, context):
        """A question for the policy's service, answered at once."""
        with self._lock:
            self._served["asks"] += 1
        if self._service is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tfsync: rank {request.get('rank')} asked {request.get('topic')!r} but this job's mode "
                f"runs no service on rank 0",
            )
        return self._service.ask(int(request["rank"]), request["topic"], request, time.time() - self.t0)

    def _leave(self, request, context):
        with self._lock:
            self._left.add(int(request["rank"]))
        return {"ok": 1}

    def _table(self, request, context):
        with self._lock:
            return {
                "clocks": list(self._clocks),
                "last_seen_s": list(self._last_seen),
                "lost": list(self._lost.values()),
                # streams that ended without Leave, within their re-attach grace
                "detached": sorted(self._detached),
                "rejected": self.rejected_count,
            }
