"""Rank 0's round coordinator: closes the coordinated policies' rounds (PSP, backup workers).

A worker whose contribution to round ``r`` is in its outbox sends
``["ready", rank, id, r]``; the coordinator evaluates the policy's pure ``close_round``
on the ready notices of the oldest open round and the clock (when a notice
arrives, and at the time the policy names when a timeout is due, on the
service's event loop), and when it closes, appends ``[r, accepted ranks]`` to
the closed list, which every worker's link carries in order.  A worker whose contribution missed
its round and was delay-compensated (``compensate=``) offers it with
``["late", rank, id, r]`` for the round ``r`` it is about to compute; the coordinator
takes it if ``r`` is still open, as an extra the policy's rule does not count,
and the closing names it: ``[r, accepted, late]``.  Each worker's
communication thread enters the round's allreduce on that notice (see
:mod:`tfsync.engine.exchange`), so the decision, not any worker's local clock,
fixes what every replica applies.

A worker whose notice the round will take for certain (``Policy.accepts_ready``:
the round is the oldest open one and the policy takes every ready rank when it
closes, or the notice closed it with that rank) is told so in the answer to
its notice and enters at once; the coordinator checks at every closing that it
took each rank it told so, and stops the job if not.  Under PSP
(``Policy.enters_when_ready``) a ready worker enters without waiting for the
answer, so a closing that took every rank moves nobody: it is kept
(:attr:`ControlServer.closed <tfsync.control.server.ControlServer.closed>`)
but not sent down the streams, which then carry only the closings some rank is
still waiting for.  BSP and SSP need no coordinator: their rounds close when
every worker has contributed, which each worker's own allreduce enforces.
"""

import logging

from tfsync.policies.base import decide_round

COORDINATOR_WAKE_S = 0.5  # a timeout the policy asked for is checked at least this often

log = logging.getLogger("tfsync.control")


class RoundCoordinator:
    """Closes rounds on the policy's decision (a part of
    :class:`~tfsync.control.server.ControlServer`); runs on the server's event loop."""

    def _ready_item(self, link, item, now):
        """``["ready", rank, id, round]``: a worker's contribution to a round is in its outbox
        (coordinated policies; lock held).  Kept until the message's every item is read, then
        recorded, decided and answered together (:meth:`_answer_ready`): a relay's message
        carries its workers' notices, and they arrived together.  The answers go as one item,
        ``["accepted", [[rank, id, accepted], ...]]``, not one ``answer`` each: 1024 notices a
        round cost rank 0 their encoding."""
        self._answers_due.append((link, item))

    def _answer_ready(self, now):
        """After a message's items: record its ready notices, let the policy decide once on them
        (they may close the oldest open round), then answer each (lock held).

        A notice for a round already closed is late (that worker drops the contribution); a
        repeated notice (resent after a re-attach) counts once.  The answer's ``accepted`` is 1
        when the round will aggregate it for certain: the notice closed the round with this rank
        in it, or the round is the oldest open one and the policy accepts every ready rank when
        it closes (``Policy.accepts_ready``).  The worker then enters the round's allreduce at
        once, without waiting for the closing on its link
        (:meth:`RoundExchange.enter_accepted <tfsync.engine.exchange.RoundExchange.enter_accepted>`);
        0 means "follow the closing" (a round not yet the oldest open when the notice came, or
        one closed without it).
        """
        due, self._answers_due = self._answers_due, []
        self._served["ready"] += len(due)
        policy = self._policy
        oldest = self._closed[-1][0] + 1 if self._closed else 0  # the oldest open round, before these
        notices = [(link, int(item[1]), item[2], int(item[3])) for link, item in due]
        if policy is not None:
            ready, ready_ranks, decide = self._ready, self._ready_ranks, False
            for _, rank, _, round_ in notices:
                if round_ >= oldest:
                    ranks = ready_ranks.get(round_)
                    if ranks is None:
                        ranks = ready_ranks[round_] = set()
                        ready[round_] = []
                    if rank not in ranks:
                        ranks.add(rank)
                        ready[round_].append((rank, now))
                        decide = decide or round_ == oldest
            if decide:
                self._decide(now)
        closed = len(self._closed) > oldest  # (rounds close in order from 0)
        took = set(self._closed[oldest][1]) if closed else ()
        early = policy is not None and not self._policy_failed and not closed and policy.accepts_ready
        told = self._early.setdefault(oldest, set()) if early else None
        answers = []
        for _, rank, request, round_ in notices:
            accepted = 0
            if round_ == oldest and policy is not None and not self._policy_failed:
                if closed:
                    accepted = int(rank in took)
                elif early:  # (its notice is in ``ready``)
                    told.add(rank)
                    accepted = 1
            answers.append([rank, request, accepted])
        due[0][0].reply.append(["accepted", answers])  # (a message's notices came on one link)

    def _late_item(self, link, item, now):
        """``["late", rank, id, round]``: a worker offers a delay-compensated contribution to the
        round it is about to compute (its weights are that round's): taken if the round is still
        open (lock held)."""
        rank, request, round_ = int(item[1]), item[2], int(item[3])
        self._served["late"] += 1
        next_open = self._closed[-1][0] + 1 if self._closed else 0
        joined = 0
        if self._policy is not None and round_ == next_open:
            late = self._late.setdefault(round_, [])
            if rank not in late:
                late.append(rank)
            joined = 1
        link.reply.append(["answer", rank, request, {"joined": joined}])

    def _decide(self, now):
        """Apply the policy to the oldest open round (lock held); closes what it can and keeps the
        time the policy asked to be asked again, for the loop's timer."""
        round_ = self._closed[-1][0] + 1 if self._closed else 0
        if self._policy_failed:
            return
        try:
            decision = decide_round(self._policy, self._ready.get(round_, ()), self._opened_s, now, self.size)
        except Exception as exc:  # a policy bug must stop the job, not hang it
            log.exception("tfsync: the coordinator's policy failed")
            self._fail_policy(f"failed on round {round_}: {type(exc).__name__}: {exc}")
            return
        if decision.accepted is None:
            if decision.recheck_s != self._recheck_s:
                self._recheck_s = decision.recheck_s
                self._schedule_recheck()
            return
        entry = [round_, [int(r) for r in decision.accepted]]
        early = self._early.pop(round_, set())
        if not early <= set(entry[1]):  # those ranks entered its allreduce already: the job cannot go on
            self._fail_policy(
                f"accepted {entry[1]} on round {round_} but ranks {sorted(early)} were told at their ready notice that "
                f"it would take them (a policy with accepts_ready = True must accept every ready rank)",
            )
            return
        late = self._late.pop(round_, None)
        if late:  # extras: a policy's rule counts only the fresh contributions
            entry.append(sorted(late))
        self._closed.append(entry)
        self._ready.pop(round_, None)
        self._ready_ranks.pop(round_, None)
        self._opened_s, self._recheck_s = now, None
        if not (self._enters_when_ready and len(entry) == 2 and len(entry[1]) == self.size):
            self._closings.append(entry)
        # the next round may be decidable already (its notices came early)
        self._decide(now)

    def _fail_policy(self, what):
        """Stop the job: the policy's decision is unusable (lock held); ``what`` it did."""
        self._policy_failed = True
        if 0 not in self._stopped:
            self._stopped[0] = {
                "rank": 0,
                "kind": "RuntimeError",
                "message": f"the coordinator's {type(self._policy).__name__}.close_round {what}",
            }
            self._stopped_version += 1

    def _schedule_recheck(self):
        """Ask the policy again at the time it named (a timeout), or within ``COORDINATOR_WAKE_S``."""
        if self._recheck_timer is not None:
            self._recheck_timer.cancel()
        if self._recheck_s is None:
            self._recheck_timer = None
            return
        delay = min(COORDINATOR_WAKE_S, max(self._recheck_s - (self._now()), 0.0))
        self._recheck_timer = self._loop.call_later(delay, self._recheck)

    def _recheck(self):
        self._recheck_timer = None
        with self._lock:
            if self._stopping.is_set() or self._policy_failed:
                return
            if self._recheck_s is not None and self._now() >= self._recheck_s:
                self._decide(self._now())
            else:
                self._schedule_recheck()
        self._broadcast_soon()

    @property
    def closed(self):
        """``[round, [accepted ranks]]`` for every closed round so far (coordinated policies),
        with a third item, the ranks whose late compensated contribution it took, when any."""
        with self._lock:
            return [list(c) for c in self._closed]
