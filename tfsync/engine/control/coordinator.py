"""Rank 0's round coordinator: closes the coordinated policies' rounds (PSP, backup workers).

A worker whose contribution to round ``r`` is in its outbox sends
``Ready(rank, r)``; the coordinator evaluates the policy's pure ``close_round``
on the ready notices of the oldest open round and the clock (in the ``Ready``
handler when a notice arrives, on its own thread when a timeout is due), and
when it closes, appends ``[r, accepted ranks]`` to the closed list, which every
worker's ``Attach`` stream carries in order.  A worker whose contribution missed
its round and was delay-compensated (``compensate=``) offers it with
``Late(rank, r)`` for the round ``r`` it is about to compute; the coordinator
takes it if ``r`` is still open, as an extra the policy's rule does not count,
and the closing names it: ``[r, accepted, late]``.  Each worker's
communication thread enters the round's allreduce on that notice (see
:mod:`tfsync.engine.exchange`), so the decision, not any worker's local clock,
fixes what every replica applies.

A worker whose notice the round will take for certain (``Policy.accepts_ready``:
the round is the oldest open one and the policy takes every ready rank when it
closes, or the notice closed it with that rank) is told so in the answer to
``Ready`` and enters at once; the coordinator checks at every closing that it
took each rank it told so, and stops the job if not.  Under PSP
(``Policy.enters_when_ready``) a ready worker enters without waiting for the
answer, so a closing that took every rank moves nobody: it is kept
(:attr:`ControlServer.closed <tfsync.engine.control.server.ControlServer.closed>`)
but not sent down the streams, which then carry only the closings some rank is
still waiting for.  BSP and SSP need no coordinator: their rounds close when
every worker has contributed, which each worker's own allreduce enforces.
"""

import logging
import time

from tfsync.policies.base import decide_round

COORDINATOR_WAKE_S = 0.5  # the coordinator rechecks shutdown at least this often

log = logging.getLogger("tfsync.control")


class RoundCoordinator:
    """Closes rounds on the policy's decision (a part of
    :class:`~tfsync.engine.control.server.ControlServer`)."""

    def _ready_notice(self, request, context):
        """A worker's contribution to a round is in its outbox (coordinated policies).

        The answer's ``accepted`` is 1 when the round will aggregate it for
        certain: the notice closed the round with this rank in it, or the
        round is the oldest open one and the policy accepts every ready rank
        when it closes (``Policy.accepts_ready``).  The worker then enters the
        round's allreduce at once, without waiting for the closing on its
        stream (:meth:`RoundExchange.enter_accepted`); 0 means "follow the
        closing" (a round not yet the oldest open, or one closed without it).
        """
        rank, round_ = int(request["rank"]), int(request["round"])
        accepted = 0
        with self._lock:
            self._served["ready"] += 1
            next_open = self._closed[-1][0] + 1 if self._closed else 0
            # a notice for a round already closed is late: that worker drops the contribution
            ready = self._ready.setdefault(round_, []) if self._policy is not None and round_ >= next_open else None
            # a repeated notice (a retried call) must not count twice toward "all ready"
            if ready is not None and all(r != rank for r, _ in ready):
                ready.append((rank, time.time() - self.t0))
                if round_ == next_open:  # decide here: one thread hand-off less than the coordinator
                    self._decide_locked(time.time() - self.t0)
                # no notify_all otherwise: the streams care only about closings (and losses)
            if round_ == next_open and self._policy is not None and not self._policy_failed:
                if round_ < len(self._closed):  # this notice closed it (rounds close in order from 0)
                    accepted = int(rank in self._closed[round_][1])
                elif self._policy.accepts_ready:  # (its notice is in ``ready`` now)
                    self._early.setdefault(round_, set()).add(rank)
                    accepted = 1
        return {"ok": 1, "accepted": accepted}

    def _late_notice(self, request, context):
        """A worker offers a delay-compensated contribution to the round it is about to compute
        (its weights are that round's): taken if the round is still open."""
        rank, round_ = int(request["rank"]), int(request["round"])
        with self._lock:
            self._served["late"] += 1
            next_open = self._closed[-1][0] + 1 if self._closed else 0
            if self._policy is None or round_ != next_open:
                return {"joined": 0}
            late = self._late.setdefault(round_, [])
            if rank not in late:
                late.append(rank)
        return {"joined": 1}

    def _decide_locked(self, now):
        """Apply the policy to the oldest open round (lock held); the recheck time, or None.

        Runs in the ``Ready`` handler when a notice arrives and in the
        coordinator thread when a timeout is due.
        """
        round_ = self._closed[-1][0] + 1 if self._closed else 0
        if self._policy_failed:
            return None
        try:
            decision = decide_round(self._policy, tuple(self._ready.get(round_, ())), self._opened_s, now, self.size)
        except Exception as exc:  # a policy bug must stop the job, not hang it
            log.exception("tfsync: the coordinator's policy failed")
            self._fail_policy(f"failed on round {round_}: {type(exc).__name__}: {exc}")
            return None
        if decision.accepted is None:
            if decision.recheck_s != self._recheck_s:
                self._recheck_s = decision.recheck_s
                self._coordinator_wake.notify()
            return decision.recheck_s
        entry = [round_, [int(r) for r in decision.accepted]]
        early = self._early.pop(round_, set())
        if not early <= set(entry[1]):  # those ranks entered its allreduce already: the job cannot go on
            self._fail_policy(
                f"accepted {entry[1]} on round {round_} but ranks {sorted(early)} were told at their ready notice that "
                f"it would take them (a policy with accepts_ready = True must accept every ready rank)",
            )
            return None
        late = self._late.pop(round_, None)
        if late:  # extras: a policy's rule counts only the fresh contributions
            entry.append(sorted(late))
        self._closed.append(entry)
        self._ready.pop(round_, None)
        self._opened_s, self._recheck_s = now, None
        if not (self._enters_when_ready and len(entry) == 2 and len(entry[1]) == self.size):
            self._closings.append(entry)
            self._changed.notify_all()
        # the next round may be decidable already (its notices came early)
        return self._decide_locked(now)

    def _fail_policy(self, what):
        """Stop the job: the policy's decision is unusable (lock held); ``what`` it did."""
        self._policy_failed = True
        self._stopped.setdefault(
            0,
            {
                "rank": 0,
                "kind": "RuntimeError",
                "message": f"the coordinator's {type(self._policy).__name__}.close_round {what}",
            },
        )
        self._changed.notify_all()

    def _coordinate(self):
        """Close rounds whose rule needs the clock (a timeout) rather than a new notice."""
        with self._lock:
            self._decide_locked(time.time() - self.t0)  # a policy that cannot decide fails now
            while not self._stopping.is_set() and not self._policy_failed:
                now = time.time() - self.t0
                recheck = self._recheck_s
                if recheck is not None and now >= recheck:
                    recheck = self._decide_locked(now)
                wait = COORDINATOR_WAKE_S if recheck is None else min(COORDINATOR_WAKE_S, max(recheck - now, 0.0))
                self._coordinator_wake.wait(wait)

    @property
    def closed(self):
        """``[round, [accepted ranks]]`` for every closed round so far (coordinated policies),
        with a third item, the ranks whose late compensated contribution it took, when any."""
        with self._lock:
            return [list(c) for c in self._closed]
