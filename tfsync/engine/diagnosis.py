"""Why a wait for peers ended badly: lost ranks, peers that stopped, ranks behind.

Kept apart from the engine, as Horovod keeps its stall diagnosis in its own
``StallInspector``: the engine waits, and asks this module what to raise when
the collective fails or the wait outlasts its bound.  Everything it knows
comes from the control path (:mod:`tfsync.control`): the losses and
stop notices rank 0 pushes to every worker, and rank 0's clock table.
"""

import time

from tfsync.control import RECONNECT_GRACE_S
from tfsync.engine.rounds import WorkerLostError

TABLE_TIMEOUT_S = 1.0  # one clock-table query while diagnosing
# after a failed collective, how long to wait for the loss notice: rank 0 names a worker on
# another host lost only after its reconnect grace, so wait that and a few seconds more
LOSS_SETTLE_S = RECONNECT_GRACE_S + 3.0
# elastic training resets at once, but first waits this long at most for the loss notice, so that
# its error (the reset's reason) names the lost rank: a process that ended is reported within
# milliseconds when its link ends on its own host (rank 0's, or its host relay's); none comes
# in that time for a link that ends between hosts (a relay's own process), named only after
# its re-attach grace (RECONNECT_GRACE_S)
ELASTIC_SETTLE_S = 1.0
LOSS_POLL_S = 0.2  # how often to look for it meanwhile
# A host that goes away takes every rank on it, whose losses are told apart by the spread of
# their keepalives and re-attach graces: after the first, wait this long for the others on its
# host, so the error names them all (only when the job spans hosts)
HOST_SETTLE_S = 3.0
# A rank heard from this recently is alive and answering: a waiting one reports its clock about
# once a second (check_while_waiting), a stepping one at most every REPORT_INTERVAL_S
FRESH_S = 3.0


ABORTED_MESSAGE = "has been shut down"  # in the error of a collective that abort() made fail (Horovod's words)


class SyncTimeoutError(RuntimeError):
    """A wait exceeded its bound; the message names the ranks that are behind.

    ``ranks``: the ranks it names as holding the wait up, sorted (None or ``[]``: it names
    none), as its message does."""

    def __init__(self, message, ranks=None):
        super().__init__(message)
        self.ranks = None if ranks is None else sorted({int(r) for r in ranks})


class Diagnosis:
    """One worker's fault diagnosis over its control client."""

    @classmethod
    def of(cls, engine, timeout_env):
        """The diagnosis of a started engine's waits (its control client, rank, hosts, bound)."""
        args = (engine.control, engine.rank, engine.policy.name, engine.wait_timeout_s, timeout_env)
        return cls(*args, hosts=engine.hosts, elastic=engine.elastic)

    def __init__(self, control, rank, mode_name, wait_timeout_s, timeout_env, hosts=None, elastic=False):
        self.control, self.rank, self.mode_name = control, rank, mode_name
        self.wait_timeout_s, self.timeout_env = wait_timeout_s, timeout_env
        self.hosts = hosts  # each rank's host name, in rank order (None: not known)
        # elastic training (tfsync.elastic): every survivor resets at its own failed collective, so
        # the error is raised with what is known within ELASTIC_SETTLE_S, without waiting out
        # rank 0's loss notices (LOSS_SETTLE_S, HOST_SETTLE_S) or for the peers to read its stop
        # notice
        self.elastic = elastic

    def on_hosts(self, ranks) -> str:
        """`` on host tfh2`` / `` on hosts tfh1, tfh2``: where ``ranks`` run, when known and
        when the job spans several hosts (on one host it says nothing new)."""
        if not self.hosts or len(set(self.hosts)) < 2 or not ranks:
            return ""
        names = sorted({self.hosts[r] for r in ranks if 0 <= r < len(self.hosts)})
        return f" on host{'s' if len(names) > 1 else ''} {', '.join(names)}" if names else ""

    def check_while_waiting(self, round_, last_pushed, deadline, what=None):
        """Called about once a second while waiting for ``round_``: raise if the job must stop.

        ``deadline`` None: only a loss or a peer's stop ends the wait (a collective that runs,
        whose bound is its own); ``what``: what waits, in words, when it is not the round itself
        (a collective queued behind it)."""
        # make sure rank 0's clock table shows this rank's last push, and that it waits for its
        # peers, so a timeout names only the ranks really behind
        self.control.report(last_pushed, min_interval_s=0.0, waiting=True)
        lost = self.unexplained(
            self.control.known_lost or self.control.table(timeout_s=TABLE_TIMEOUT_S).get("lost", [])
        )
        # checked after the table query: a peer that stopped (rank 0 included)
        # told everyone why before it went, and that beats "rank 0 is unreachable"
        # and "lost rank k" for that peer.  Stopping for a peer's reason is
        # announced too: unannounced, this rank's exit would read as a loss to
        # the ranks still waiting, and they would report it instead of the root cause
        peer_stop = self.peer_stop()
        if peer_stop is not None and not lost:
            raise self.stop(peer_stop)
        if lost:
            raise self.stop(self.lost_error(round_, None, lost, what))
        if deadline is not None and time.monotonic() >= deadline:
            raise self.stop(self.timeout_error(round_, what))

    def watch_call(self, engine, ahead, since, what):
        """A collective (``what``) queued on ``engine``'s exchange behind round ``ahead``, which has run
        since ``since`` (None: none), waits: it ends at once, with the error naming the ranks at
        fault, when the control path reports a lost rank or a peer's stop, when a round ahead of it
        failed, or when the round it is queued behind has run for the wait bound (so an epoch's end
        or a commit does not out-wait the round whose bound names the ranks)."""
        error = engine.exchange.error
        if error is not None:  # a round ahead of it failed (the exchange thread ended)
            raise self.stop(self.lost_error(ahead, error, what=what)) from error
        deadline = None if ahead is None or since is None else since + self.wait_timeout_s
        self.check_while_waiting(ahead, engine.last_pushed, deadline, what)

    def explained(self, call, what):
        """``call()``, a collective (``what``, in words) on the exchange thread; where Horovod's
        shutdown ended it (:data:`ABORTED_MESSAGE`) and rank 0's control service reports a lost
        rank, the error naming that rank, instead of the collective's own from its arrival
        record (which names every rank not yet recorded as arrived, the healthy ones included,
        when a peer's process ended as they were about to arrive)."""
        try:
            return call()
        except (SyncTimeoutError, WorkerLostError):
            raise
        except Exception as exc:
            lost = self._reported_lost() if ABORTED_MESSAGE in str(exc) else None
            if not lost:  # (a peer's abort at its own bound: the collective's own error says who)
                raise
            raise self.stop(self.lost_error(None, exc, lost=lost, what=what)) from exc

    def _reported_lost(self):
        """The losses rank 0's control service reports now (one table query); none while this
        worker's link to it is down: the link's own inference, rank 0 unreachable, is all there
        is then, and a rank 0 that closed its service after its own error looks the same."""
        if self.control.broken or self.control.host_lost is not None:
            return []
        lost = self.control.known_lost or self.control.table(timeout_s=TABLE_TIMEOUT_S).get("lost", [])
        return self.unexplained(lost)

    def timeout_error(self, round_, what=None):
        """The error for a wait for ``round_`` that reached its bound (a peer's stop, if one came);
        ``what``: what waited, when not the round itself."""
        peer_stop = self.peer_stop()
        if peer_stop is not None:
            return peer_stop
        held_by, ranks = self.behind(round_)
        waited = f"round {round_}" if what is None else f"{what}, queued behind round {round_}"
        return SyncTimeoutError(
            f"tfsync: rank {self.rank} waited {self.wait_timeout_s:.0f} s for {waited} "
            f"(mode {self.mode_name}); {held_by}. A worker is hung or far "
            f"slower than the others; raise wait_timeout_s (or {self.timeout_env}) if that "
            f"is expected",
            ranks=ranks,
        )

    def behind(self, round_):
        """Which ranks hold ``round_`` up, from rank 0's (or the last known) clock table:
        ``(in words, ranks)``.

        Those whose link to rank 0 is down (detached, within their re-attach grace), and those
        that have not pushed the round, less those that wait for their peers themselves and were
        heard from within ``FRESH_S`` (each is held up by the others: a rank that waits for an
        earlier round, as DSSP's and SSP's may, is no cause).  When that leaves none, the ranks
        not heard from within ``FRESH_S`` (a stopped process, a cut link: a round every rank
        pushed cannot complete without them); when it still leaves none, the ranks behind."""
        table = self.control.table(timeout_s=TABLE_TIMEOUT_S)
        clocks = [int(c) for c in table.get("clocks") or []]
        if not clocks:
            return (
                f"rank 0's control service{self.on_hosts([0])} did not answer, so no clock table says "
                f"which rank is behind",
                [0],
            )
        now, seen, waiting = table.get("now_s"), table.get("last_seen_s") or [], table.get("waiting") or []
        silent = {r: now - seen[r] for r in range(len(clocks)) if r != self.rank and now is not None and r < len(seen)}
        silent = {r: s for r, s in silent.items() if s > FRESH_S}
        behind = [r for r, c in enumerate(clocks) if c < round_]
        held = [r for r in behind if r not in silent and r < len(waiting) and waiting[r]]
        detached = [int(r) for r in table.get("detached") or [] if int(r) != self.rank]
        culprits = sorted(set(detached) | {r for r in behind if r not in held})
        steps = f"last pushed step per rank: {clocks}"
        if culprits:
            why = (
                f"ranks {culprits}{self.on_hosts(culprits)} have not pushed it"
                if set(culprits) <= set(behind)
                else (f"ranks {culprits}{self.on_hosts(culprits)} have not pushed it or their link to rank 0 is down")
            )
            if held:
                why += f" (ranks {held} have not either, but wait for their peers themselves)"
            return f"{why} ({steps})", culprits
        if silent:
            quiet = sorted(silent)
            return (
                f"ranks {quiet}{self.on_hosts(quiet)} have not been heard from for {min(silent.values()):.0f} s or "
                f"more (their process stopped or their host's link is down), and every other rank had pushed it "
                f"or waits for its peers ({steps})",
                quiet,
            )
        if behind:
            return (
                f"ranks {behind}{self.on_hosts(behind)} have not pushed it, and each waits for its peers ({steps})",
                behind,
            )
        return f"every rank had pushed it ({steps})", []

    def stop(self, error):
        """Tell every worker why this one stops; returns ``error`` to raise.

        Elastic: without waiting for them to read it.  The notice speeds their reset, but this
        worker resets rather than exits, and where its link went with the lost peer (its host's
        relay, or rank 0) the answer never came: it waited ``STOP_CALL_TIMEOUT_S`` (3 s) while the
        others waited for it in the next rendezvous, at every loss of rank 0 or of a relay."""
        self.control.announce_stop(
            type(error).__name__, str(error), wait=not self.elastic, ranks=getattr(error, "ranks", None)
        )
        return error

    def unexplained(self, lost):
        """The losses not explained by the lost rank's own stop notice.

        A rank that stops (a wait timed out, a peer was lost) tells every
        worker why and then exits, so its connection ends too: that is not a
        loss of its own, and naming it would hide the rank that caused the
        stop (e.g. the hung one its timeout names).
        """
        stopped = {int(n["rank"]) for n in self.control.known_stopped}
        return [d for d in lost if int(d["rank"]) not in stopped]

    def peer_stop(self):
        """The error another rank stopped with, if one did (pushed by the control path)."""
        notice = self.control.peer_stop_notice()
        if notice is None:
            return None
        cls = SyncTimeoutError if notice.get("kind") == "SyncTimeoutError" else WorkerLostError
        return cls(
            f"tfsync: rank {int(notice['rank'])} stopped the job: {notice['message']}", ranks=notice.get("ranks")
        )

    def _with_their_hosts(self, lost):
        """``lost``, and the other ranks on the lost ranks' hosts once lost too, waited for up to
        ``HOST_SETTLE_S`` (a job on one host, hosts unknown, or rank 0 lost, whose control service
        reports the losses: ``lost`` as it is)."""
        if self.elastic or not self.hosts or len(set(self.hosts)) < 2 or any(int(d["rank"]) == 0 for d in lost):
            return lost
        gone = {self.hosts[int(d["rank"])] for d in lost}
        on_them = {r for r, h in enumerate(self.hosts) if h in gone and r != self.rank}
        deadline = time.monotonic() + HOST_SETTLE_S
        while on_them - {int(d["rank"]) for d in lost} and time.monotonic() < deadline:
            time.sleep(LOSS_POLL_S)
            lost = self.unexplained(self.control.known_lost) or lost
        return lost

    def lost_error(self, round_, exc, lost=None, what=None):
        """The error for a failed collective (``exc``) or reported losses (``lost``); elastic: as
        soon as a loss is known, or after ``ELASTIC_SETTLE_S`` naming none.  ``round_``: the
        round waited for (None: none); ``what``: what waited, in words, when not the round."""
        deadline = time.monotonic() + (ELASTIC_SETTLE_S if self.elastic else LOSS_SETTLE_S)
        while not self.unexplained(self.control.known_lost) and time.monotonic() < deadline:
            lost = self.unexplained(lost or self.control.table(timeout_s=TABLE_TIMEOUT_S).get("lost", []))
            if lost or self.peer_stop() is not None:
                break
            time.sleep(LOSS_POLL_S)
        lost = self.unexplained(self.control.known_lost) or lost
        if lost:
            lost = self._with_their_hosts(lost)
        peer_stop = self.peer_stop()
        if peer_stop is not None and not lost:
            return peer_stop
        if lost:
            names = ", ".join(
                f"rank {int(d['rank'])}{self.on_hosts([int(d['rank'])])} ({d['reason']}"
                + (f", last pushed step {int(d['clock'])}" if d.get("clock") is not None else "")
                + ")"
                for d in lost
            )
            waited = f"round {round_}" if what is None else what
            return WorkerLostError(
                f"tfsync: lost {names} while rank {self.rank} waited for {waited}; "
                + (
                    "resetting (elastic training)"
                    if self.elastic
                    else (f"{self.behind(round_)[0]}. " if round_ is not None else "")
                    + "Stopping this worker too; restart the job (from a checkpoint, if you keep one)"
                ),
                ranks=[int(d["rank"]) for d in lost],
            )
        failed = f"the collective for round {round_}" if what is None else what
        return WorkerLostError(
            f"tfsync: {failed} failed on rank {self.rank} ({exc}); no peer was reported lost by the control path",
            ranks=[],
        )
