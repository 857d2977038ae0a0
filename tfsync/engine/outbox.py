"""Coordinated rounds (PSP, backup workers): the outbox and the rounds rank 0 closes.

Coordinated rounds (PSP, backup workers) are not entered on a worker's own
push but on rank 0's decision (:mod:`tfsync.control`).  The training
thread :meth:`RoundExchange.push`-es its contribution, stamped with the round
whose weights it was computed on, into a one-slot outbox and tells the
coordinator; the control stream hands every "round ``r`` closed, accepting
ranks A" notice to :meth:`RoundExchange.close_round`, and the communication
thread enters round ``r``'s allreduce with what the outbox holds: the
contribution if this rank is in A, zeros otherwise.  Every rank's thread can
always enter, whatever its training thread is doing, so a round needs no
slow worker's compute.  Before that, the outbox's stamp is checked: a
contribution stamped older than ``r`` missed its round, is dropped (zeros go
in its place) and counted; a fresh one that arrived after its round closed (backup workers)
waits, and is stale at the next round.

A rank whose contribution the round will take for certain does not wait for
the closing.  PSP (:attr:`Policy.enters_when_ready`, passed on here)
takes every fresh contribution its ranks hold when they enter the
round, so a rank enters as soon as its contribution is ready, without
asking anyone, and a rank that is not ready enters on the closing with
what it holds by then: its contribution if it became ready meanwhile,
zeros otherwise.  The round's metadata, identical on every rank, says which
ranks it took (the closing's, or more), and the closing, when it reaches a
rank that entered on its own, is checked to name no rank the round did not
take.  Backup workers take exactly the first ``N``, so there the
coordinator says so in its answer to the ready notice
(:attr:`Policy.accepts_ready`), the rank enters on that answer
(:meth:`RoundExchange.enter_accepted`), and the closing must name exactly
the ranks the round took.  Either way only the ranks that are not ready
when the round closes wait for the closing on their stream.  A rank that
enters early cannot know ``d`` when it enters, so every rank asks Horovod
for the sum post-scaled by the previous round's ``d`` (the same on every
rank) and rescales it when the round's own ``d``, read from its metadata,
differs: every replica receives the same sum of exactly the contributions
the round took, over ``d``.  So a coordinated round costs about what an
open one does: no round trip before entering, no closing sent for a round
that took every rank, no division after every round.

With delay compensation (``keep_stale``) a contribution that missed its
round is not dropped here: the engine withdraws it (:meth:`RoundExchange.withdraw`),
corrects it and puts it up for a later round (:meth:`RoundExchange.set_late`);
when the coordinator's closing names this rank as late, its row carries that
contribution (added to a fresh one, if accepted too) and its ``late`` field.
``d`` counts the fresh contributions only: a late one is applied on top of
them with the weight a fresh one has (``1/d``), as DC-ASGD applies every
corrected gradient at the full learning rate, instead of diluting the fresh
ones' mean: a late contribution that is dropped loses its step, one that is
compensated restores it (docs/choosing.md compares the two).
:meth:`RoundExchange.final_round` takes the ones still held when training
ends, with the same weight.
"""

import numpy as np

from tfsync.engine.wire.layout import META_COLUMNS, REJECTED


class CoordinatedOutbox:
    """The coordinated rounds' part of :class:`~tfsync.engine.exchange.RoundExchange`: this
    worker's one-slot outbox, the closings and acceptances that make it enter a round, and
    the late contributions delay compensation puts up (its state lives in the exchange)."""

    def push(self, stamp: int, payload: list, push_time: float, compute_s: float, rejected: bool = False):
        """Coordinated rounds: put this worker's contribution to round ``stamp`` in the outbox.

        A contribution still waiting there is older, so its round has closed
        without it: it is dropped and counted (a rejected one is discarded).
        ``rejected``: the contribution was not finite; a round that takes it gets
        zeros and a row that says so.
        """
        with self._cond:
            if self._outbox is not None:
                self._drop_locked(self._outbox[0], stamp)
            self._outbox = (stamp, None if rejected else list(payload), push_time, compute_s, rejected)

    def close_round(self, round_: int, accepted: tuple, late: tuple = ()):
        """The coordinator closed ``round_`` accepting ``accepted`` (and the late, compensated
        contributions of ``late``): enter its collective (in order).

        The collective runs on the communication thread, never on the caller
        (the control stream's reader): a reader blocked in an allreduce with a
        dead peer could not deliver the loss notice that names it.
        """
        with self._cond:
            self._closed_through = max(self._closed_through, round_)
            self._cond.notify_all()
        self._put(("close", round_, tuple(accepted), tuple(late)))

    def enter_accepted(self, round_: int):
        """The coordinator answered this rank's ready notice: ``round_`` will aggregate its
        contribution.  Enter the round's allreduce now, without waiting for the closing on
        the stream (which, when it comes, is checked against what the round aggregated).

        Every other rank enters on its own acceptance or on the closing, so the
        collective starts as soon as the last of them does; its divisor comes
        from the round's metadata, which every rank receives identically.
        """
        self._put(("enter", round_))

    def drain_outbox(self) -> int:
        """At the end of training: drop a contribution no round can take any more; how many."""
        with self._cond:
            if self._outbox is None:
                return 0
            rejected = self._outbox[4]
            self._drop_locked(self._outbox[0], self._closed_through + 1)
            return 0 if rejected else 1

    def withdraw(self, stamp: int):
        """Take the contribution stamped ``stamp`` back out of the outbox (it missed its round);
        ``None`` if the outbox holds no such contribution."""
        with self._cond:
            if self._outbox is None or self._outbox[0] != stamp:
                return None
            payload, self._outbox = self._outbox[1], None
            return payload  # (None for a rejected contribution: nothing to hold)

    def drop(self, stamp: int, round_: int):
        """Record a withdrawn contribution as dropped (no round will take it)."""
        with self._cond:
            self._drops.append((stamp, round_))

    def set_late(self, round_: int, stamp: int, payload: list):
        """Put a delay-compensated contribution computed for ``stamp`` up for round ``round_``."""
        with self._cond:
            self._late = (round_, stamp, list(payload))

    def clear_late(self):
        """The coordinator refused the late contribution (its round had closed)."""
        with self._cond:
            self._late = None

    def final_round(self, round_: int, late, holders: list, absent: list, timeout_s: float) -> list:
        """One more round after the last step, for the late contributions still held.

        ``late``: ``(stamp, compensated payload)`` of this rank, or ``None``;
        ``holders``: every rank that has one (each rank learned it from the same
        allgather), so every rank enters.  Each weighs what it would have in a
        round: the sum is divided by the last round's ``d`` (its number of fresh
        contributions, the same on every rank).  Returns that quotient
        (collective; on the communication thread, bounded).
        """
        meta = np.zeros((self.size, META_COLUMNS), np.float64)
        payload = absent
        if late is not None:
            meta[self.rank, 4:6] = (1.0, late[0])
            payload = late[1]

        def run():
            total, out = self._collective(payload, meta, divisor=self._last_d)
            took = sorted(np.flatnonzero(np.asarray(out, np.float64).reshape(self.size, META_COLUMNS)[:, 4]).tolist())
            if took != sorted(holders):
                raise RuntimeError(
                    f"tfsync: the final round should take the late contributions of ranks "
                    f"{sorted(holders)} but ranks {took} sent one; the workers disagree"
                )
            return list(total)

        return self.call(run, timeout_s)

    def take_drops(self) -> list:
        """``(stamp, round)`` of every contribution dropped since the last call."""
        with self._cond:
            drops, self._drops = self._drops, []
            return drops

    def _drop_locked(self, stamp, round_):
        """The outbox's contribution will go into no round: dropped (a rejected one was counted
        when it was rejected, and is only discarded)."""
        rejected = self._outbox is not None and self._outbox[4]
        self._outbox = None
        if not rejected:
            self._drops.append((stamp, round_))

    def _run_accepted_round(self, round_) -> bool:
        """Enter ``round_`` early (:meth:`enter_accepted`) unless its closing came first."""
        with self._cond:
            if self._entered_through >= round_:
                return True
            item = self._outbox
            late = self._late
        try:
            if item is None or item[0] != round_:
                raise RuntimeError(
                    f"tfsync: rank {self.rank} was told that round {round_} takes its contribution "
                    f"but its outbox holds {'none' if item is None else 'one to round ' + str(item[0])}"
                )
            # a late contribution the coordinator took for this round (Late answered before this
            # step was computed) rides along, as on the closing
            late_ranks = (self.rank,) if late is not None and late[0] == round_ else ()
        except BaseException as exc:
            return self._fail(exc)
        return self._run_closed_round(round_, (self.rank,), late_ranks, early=True)

    def _run_closed_round(self, round_, accepted, late=(), early=False) -> bool:
        """A coordinated round: enter with the outbox (if accepted), plus the late contribution
        (if taken), or zeros; divide by ``d``, the number of contributions.

        ``early``: entered on the ready notice's answer, ``accepted``/``late``
        being this rank's own part only.  A closing for a round entered early
        enters nothing: it is checked against what the round aggregated.
        """
        with self._cond:
            entered = self._entered_through >= round_
            if not entered:
                self._entered_through = round_
            got = self._entered_early.pop(round_, None) if entered and not early else None
        if entered:
            if got is not None and not self._agrees(got, accepted, late):
                return self._fail(
                    RuntimeError(
                        f"tfsync: round {round_} aggregated ranks {list(got[0])} and the late contributions "
                        f"of {list(got[1])} but the coordinator's closing names ranks {sorted(accepted)} and "
                        f"late {sorted(late)}; the workers disagree about the round"
                    )
                )
            return True
        mine = self.rank in accepted
        with self._cond:
            item = self._outbox
        meta = np.zeros((self.size, META_COLUMNS), np.float64)
        payload = None
        try:
            if item is not None:
                stamp, contribution, push_time, compute_s, rejected = item
                if stamp > round_:
                    raise RuntimeError(
                        f"tfsync: rank {self.rank} enters round {round_} with a contribution to the "
                        f"later round {stamp} in its outbox; rounds are entered in order"
                    )
                if stamp < round_:  # it missed its round: zeros (the absent payload) go out instead
                    with self._cond:
                        if self._outbox is item and not (self._keep_stale and not rejected):
                            self._drop_locked(stamp, round_)
                elif mine or self._enters_when_ready:  # (ready since the closing)
                    payload = contribution  # (None if rejected: zeros go out, and its row says so)
                    meta[self.rank, :4] = (0.0 if rejected else 1.0, stamp, push_time, compute_s)
                    meta[self.rank, REJECTED] = 1.0 if rejected else 0.0
                    with self._cond:
                        self._outbox = None
            if mine and meta[self.rank, 0] != 1.0 and meta[self.rank, REJECTED] != 1.0:
                raise RuntimeError(
                    f"tfsync: rank {self.rank} was accepted for round {round_} "
                    f"but has no contribution to it in its outbox"
                )
            if self.rank in late:
                with self._cond:
                    taken, self._late = self._late, None
                if taken is None or taken[0] != round_:
                    raise RuntimeError(
                        f"tfsync: the coordinator took a late contribution of rank {self.rank} into "
                        f"round {round_} but none is waiting for that round"
                    )
                _, late_stamp, late_payload = taken
                meta[self.rank, 4:6] = (1.0, late_stamp)
                # a fresh contribution in the same round: one row, both summed
                payload = late_payload if payload is None else [a + b for a, b in zip(payload, late_payload)]
            if payload is None:
                if callable(self._absent):  # built on first use
                    self._absent = self._absent()
                payload = self._absent
        except BaseException as exc:
            return self._fail(exc)
        return self._run_round(
            (round_, payload, meta), accepted=None if early else accepted, late=late, coordinated=True
        )

    def _agrees(self, took, accepted, late) -> bool:
        """Whether a round that aggregated ``took`` (ranks, late ranks) matches its closing: the
        same ranks, or, with ``enters_when_ready``, at least them (those ready by the time they
        entered); the late ones exactly (each was taken by the coordinator's answer)."""
        ranks = tuple(sorted(accepted))
        if tuple(took[1]) != tuple(sorted(late)):
            return False
        return set(ranks) <= set(took[0]) if self._enters_when_ready else tuple(took[0]) == ranks
