"""What else rank 0 serves: the clock table, the policy's own service, a worker's leave.

Workers report their clock, throttled (``ControlClient.report``: at most one
report per ``REPORT_INTERVAL_S``; a worker waiting for a round forces one about
once a second), and a host's relay sends its workers' clocks together
(``["reports", {rank: clock}]``), so a wait that times out can say which rank
is behind from clocks at most about a second old.  A mode whose coordinator
keeps more state than closings runs it here as its service (DSSP's
synchronization controller, :mod:`tfsync.engine.components.grants`): workers tell it
(fire-and-forget) and ask it (answered at once), each message with a topic.
The table holds the clocks, when each rank was last heard
from, the lost and detached ranks and how many calls were refused.
"""


class Services:
    """The table and the policy's service (a part of
    :class:`~tfsync.control.server.ControlServer`); lock held in every handler."""

    def _report_item(self, link, item, now):
        """``["report", rank, clock]``."""
        self._clock(int(item[1]), int(item[2]), now)

    def _reports_item(self, link, item, now):
        """``["reports", {rank: clock}]``: a relay's workers' clocks, together."""
        for rank, clock in item[1].items():
            self._clock(int(rank), int(clock), now)

    def _clock(self, rank, clock, now):
        self._served["reports"] += 1
        self._clocks[rank] = max(self._clocks[rank], clock)
        self._last_seen[rank] = now

    def _tell_item(self, link, item, now):
        """``["tell", rank, topic, fields]``: a message for the policy's service (ignored when
        there is none)."""
        self._served["tells"] += 1
        if self._service is not None:
            rank, topic, fields = int(item[1]), item[2], item[3]
            self._service.tell(rank, topic, {"rank": rank, "topic": topic, **fields}, now)

    def _ask_item(self, link, item, now):
        """``["ask", rank, id, topic, fields]``: a question for the policy's service, answered at
        once (an error when this job's mode runs none)."""
        self._served["asks"] += 1
        rank, request, topic, fields = int(item[1]), item[2], item[3], item[4]
        if self._service is None:
            reply = {"error": f"tfsync: rank {rank} asked {topic!r} but this job's mode runs no service on rank 0"}
        else:
            reply = self._service.ask(rank, topic, {"rank": rank, "topic": topic, **fields}, now)
        link.reply.append(["answer", rank, request, reply])

    def _table_item(self, link, item, now):
        """``["table", rank, id]``: the clocks, when each rank was last heard from, the lost and
        detached ranks and how many calls were refused."""
        link.reply.append(["answer", int(item[1]), item[2], self._table()])

    def _table(self):
        return {
            "clocks": list(self._clocks),
            "last_seen_s": list(self._last_seen),
            "lost": list(self._lost.values()),
            # workers whose link ended without Leave, within their re-attach grace
            "detached": sorted(self._detached),
            "rejected": self.rejected_count,
        }
