"""PSP's partial pulling on the worker: a round's mean applied block by block.

The exchange delivers a round's whole mean when its allreduce completes (on
every rank at once); what can be late is the hand-off of a block to one
worker's training thread (the receive side, simulated by
``tfsync.Stragglers(pull_prob=, pull_s=)``).  :class:`BlockPull` keeps, per
block, the queue of rounds whose mean for that block has not been applied
yet, each with the time it lands.  A block's entry is *arrived* once it and
every older entry of the same block have landed: blocks are applied in round
order, so a newer round's block never overtakes an older one (the paper's "never
replaces a block with one from an older round", for summed gradients).

:class:`PartialPull` is the engine's side (the component PSP supplies): after
a round completes it lands there (:meth:`BlockPull.land`), the step waits (:meth:`BlockPull.wait`)
until ``⌈b·B⌉`` of the awaited round's blocks have arrived and
``pull_timeout_s`` has passed since the ``⌈b·B⌉``-th did (or all have),
applies every arrived entry
(:meth:`apply_arrived`) and goes on; the rest stay queued and are applied at a
later step, when they land.  :meth:`drain` applies everything at the end.

How a block is applied is the frontend's (:attr:`BlockPull.applier`): through the
worker's optimizer, with ``optimizer.iterations`` set to the block's round,
so every replica applies the same updates per weight in the same order with
the same step count, and ends identical.
"""

import collections
import time

import numpy as np

from tfsync.engine.components.base import StepComponent

# a wait for blocks sleeps at most this long between checks (a landing time is known in
# advance, so the wait normally sleeps exactly until the next one)
POLL_S = 0.05


def partition(sizes, blocks):
    """``blocks`` groups of consecutive indices into ``sizes``, balanced by total size.

    Every group is non-empty; block ``k`` ends where the running total is
    nearest ``k/blocks`` of the whole (moved so that each block keeps at least
    one tensor).
    """
    n = len(sizes)
    if not 1 <= blocks <= n:
        raise ValueError(f"cannot split {n} weight tensors into {blocks} non-empty blocks")
    cumulative = np.cumsum(np.asarray(sizes, dtype=np.float64))
    total = cumulative[-1]
    bounds, start = [], 0
    for k in range(1, blocks):
        target = k * total / blocks
        i = int(np.searchsorted(cumulative, target, side="left"))  # first reaching it
        if i > 0 and target - cumulative[i - 1] < cumulative[min(i, n - 1)] - target:
            i -= 1  # the total just before it is nearer
        end = i + 1
        end = max(start + 1, min(end, n - (blocks - k)))
        bounds.append(end)
        start = end
    bounds.append(n)
    groups, start = [], 0
    for end in bounds:
        groups.append(list(range(start, end)))
        start = end
    return groups


class BlockPull:
    """One worker's queues of blocks not applied yet (see the module docstring).

    Args:
        groups: the blocks, each a list of indices into the round's tensors.
        need: ``⌈b·B⌉``.
        timeout_s: ``τ2``, the wait for more blocks once ``need`` arrived (``None``: 0).
        delays: ``delays(B)`` -> the seconds each block of the next round lands late.

    ``applier`` (set by the frontend before the first step) applies the blocks:
    ``applier.apply(block, round_, tensors)`` applies round ``round_``'s mean
    for the weights of ``block`` (in the block's order);
    ``applier.settle(rounds)`` ends a batch of those calls, ``rounds`` rounds
    being applied in at least one block (the optimizer's step count to
    leave); optional ``applier.apply_all(round_, tensors)`` applies every
    block of a round at once (all its tensors, in the weights' order).
    """

    def __init__(self, groups, need, timeout_s, delays):
        self.groups, self.need, self.timeout_s = groups, need, timeout_s
        self._tensors = sum(len(g) for g in groups)
        self._delays = delays
        self.applier = None
        self._queues = [collections.deque() for _ in groups]  # (round, lands_at, tensors)
        self._rounds_applied = 0  # rounds applied in at least one block (the newest + 1)
        # counted: blocks applied; of those, applied after the step that waited for their round
        self.counts = {"blocks": 0, "late_blocks": 0, "delayed_blocks": 0}
        self._late = set()  # (round, block) found missing when a step moved on

    def land(self, round_, total, now):
        """Round ``round_``'s mean: each block lands now or after its receive-side delay."""
        delays = self._delays(len(self.groups))
        for j, group in enumerate(self.groups):
            self._queues[j].append((round_, now + float(delays[j]), [total[i] for i in group]))
            self.counts["delayed_blocks"] += bool(delays[j] > 0)

    def _arrival(self, j, round_):
        """When block ``j`` of ``round_`` (landed already) has arrived: once it and every
        older entry of block ``j`` landed; ``-inf`` if it was applied already."""
        t = -np.inf
        for r, lands_at, _ in self._queues[j]:
            t = max(t, lands_at)
            if r == round_:
                return t
        return -np.inf

    def wait(self, round_, now_fn, deadline):
        """Wait until ``need`` blocks of the landed round ``round_`` have arrived and ``τ2``
        has passed since the ``need``-th did, or until all have (PSP Algorithm 1, line 15).

        Returns the seconds waited.  Raises ``TimeoutError`` past ``deadline``
        (``time.monotonic()``), which only a landing time beyond it can reach.
        """
        t_start = now_fn()
        extra = self.timeout_s or 0.0
        while True:
            now = now_fn()
            arrivals = sorted(self._arrival(j, round_) for j in range(len(self.groups)))
            if arrivals[-1] <= now:
                break  # every block
            wake = arrivals[self.need - 1]  # the need-th arrival
            if wake <= now:
                give_up = wake + extra
                if now >= give_up:
                    break
                wake = min(give_up, min(t for t in arrivals if t > now))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"blocks of round {round_} still not arrived at the wait bound")
            time.sleep(min(max(wake - now, 0.0), POLL_S, left))
        now = now_fn()
        for j in range(len(self.groups)):
            if self._arrival(j, round_) > now:
                self._late.add((round_, j))
        return now - t_start

    def apply_arrived(self, now, hand_back=None):
        """Apply every queued entry that has arrived, oldest round first.

        Rounds go in ascending order, so each block's entries go in round
        order.  A round whose every block is applied here goes through the
        applier's ``apply_all`` (one call, as a round without partial
        pulling), when it has one; if it is round ``hand_back`` (the newest
        that can arrive: the step's own), it is not applied but returned,
        whole, for the caller to apply next (the compiled train step does,
        as without partial pulling), with the optimizer's step count left at
        that round's.  Returns that list of tensors, or None.
        """
        applied, handed = 0, None
        apply_all = getattr(self.applier, "apply_all", None)
        while True:
            heads = [j for j, q in enumerate(self._queues) if q and q[0][1] <= now]
            if not heads:
                break
            r = min(self._queues[j][0][0] for j in heads)
            blocks = [j for j in heads if self._queues[j][0][0] == r]
            entries = [self._queues[j].popleft()[2] for j in blocks]
            if (apply_all is not None or r == hand_back) and len(blocks) == len(self.groups):
                full = [None] * self._tensors
                for group, tensors in zip(self.groups, entries):
                    for i, t in zip(group, tensors):
                        full[i] = t
                if r == hand_back:
                    handed = full
                else:
                    apply_all(r, full)
            else:
                for j, tensors in zip(blocks, entries):
                    self.applier.apply(j, r, tensors)
            for j in blocks:
                if (r, j) in self._late:
                    self._late.discard((r, j))
                    self.counts["late_blocks"] += 1
            applied += len(blocks)
            self.counts["blocks"] += len(blocks)
            self._rounds_applied = max(self._rounds_applied, r + 1)
        if applied:
            self.applier.settle(self._rounds_applied - (handed is not None))
        return handed

    @property
    def queued(self):
        return sum(len(q) for q in self._queues)

    def drain(self, now_fn, deadline):
        """Wait for every queued block to land and apply it (the end of training)."""
        while self.queued:
            now = now_fn()
            self.apply_arrived(now)
            if not self.queued:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.queued} blocks still not arrived at the wait bound")
            nxt = min(q[0][1] for q in self._queues if q)
            time.sleep(min(max(nxt - now, 0.0), POLL_S, left))


class PartialPull(StepComponent):
    """PSP's partial pulling in the engine's step (see the module docstring).

    A completed round's mean lands in the block queues instead of being
    applied whole; after the step's rounds the worker waits for ``⌈b·B⌉`` of
    its round's blocks and applies every block that arrived.  When the step's
    own round arrived whole it is handed back instead: the step returns
    ``[*mean, True]`` and the compiled step applies it as without partial
    pulling; otherwise ``[*zeros, False]`` (every arrived block is applied
    already).  The frontend sets the block applier (:attr:`applier`) before
    the first step.
    """

    def __init__(self, policy):
        self.policy = policy
        self._groups = None
        self.blocks = None
        self._handed = None

    def plan(self, shapes, num_params):
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        count = self.policy.pull_blocks
        if count is not None and count > len(sizes):
            raise ValueError(
                f"tfsync: PSP(pull_blocks={count}) with a model of {len(sizes)} weight tensors "
                f"({num_params} parameters): a block is a group of whole weight tensors (the "
                f"optimizer updates each on its own), so use pull_blocks <= {len(sizes)}, or None "
                f"for one block per weight tensor"
            )
        self._groups = partition(sizes, count or len(sizes))
        return self._groups

    def bind(self, engine):
        super().bind(engine)
        need = self.policy.blocks_needed(len(self._groups))
        self.blocks = BlockPull(self._groups, need, self.policy.pull_timeout_s, engine.delays.pull_delays_s)

    @property
    def groups(self) -> list:
        """The blocks, each a list of indices into the weight tensors."""
        return self.blocks.groups

    @property
    def counts(self) -> dict:
        """Blocks applied, applied after their step went on, delayed (simulated)."""
        return dict(self.blocks.counts)

    def epoch_logs(self):
        """Its block counts since the engine started (:attr:`counts`)."""
        return self.counts

    @property
    def applier(self):
        return self.blocks.applier

    @applier.setter
    def applier(self, applier):
        self.blocks.applier = applier

    def apply(self, res):
        self.blocks.land(res.round, res.total, self.engine.now())
        return True

    def rounds_applied(self, required, hand_back):
        engine = self.engine
        if 0 <= required <= engine.applied_through:
            try:
                self.blocks.wait(required, engine.now, time.monotonic() + engine.wait_timeout_s)
            except TimeoutError as exc:
                raise engine.stop(
                    RuntimeError(
                        f"tfsync: rank {engine.rank} waited {engine.wait_timeout_s:.0f} s for the blocks of round "
                        f"{required} ({exc}); a simulated pull delay (Stragglers.pull_s) longer than "
                        f"wait_timeout_s cannot end: shorten it or raise {engine.WAIT_TIMEOUT_ENV}"
                    )
                ) from exc
        self._handed = self.blocks.apply_arrived(engine.now(), hand_back=required if hand_back else None)

    def result(self, result):
        handed, self._handed = self._handed, None
        if handed is None:
            return [*self.engine.protocol.absent(), False]
        return [*handed, True]

    def end_step(self, step, wait_s, skipped):
        return {"queued_blocks": self.blocks.queued, **self.blocks.counts}

    def at_rest(self):
        return not self.blocks.queued

    def finish(self, apply_mean):
        self.blocks.drain(self.engine.now, time.monotonic() + self.engine.wait_timeout_s)
        return False
