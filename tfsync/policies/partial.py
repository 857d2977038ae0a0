"""Partial aggregation: rounds that close without the slowest workers.

* :class:`PSP`: partially synchronous parallel, partial pushing (*Faster Distributed
  Synchronous SGD with Weak Synchronization*, Algorithm 1, server lines 5-13): round ``t`` aggregates the
  fresh contributions that are ready once at least ``c`` are and ``τ1`` has
  passed since the ``c``-th (or once every worker's is), and the update is their
  mean, applied with the optimizer's own learning rate ``η`` (Horovod's
  averaging; torchft's "divide by the participants").  The paper's server line
  13 scales the learning rate with ``d`` instead (its linear scaling rule,
  ``d·η0`` on the mean): with ``η`` tuned for ``N`` workers, a round of
  ``d < N`` contributions takes the full step here where the paper's would
  take ``d/N`` of it.
* :class:`BackupWorkers`: synchronous SGD with ``b`` backup workers
  (*Revisiting Distributed Synchronous SGD*, Chen et al., Section 3, Algorithms 3-4):
  with ``N + b`` workers,
  round ``t`` aggregates the first ``N`` contributions stamped ``t``.

The parameter server of the papers becomes rank 0's coordinator
(:mod:`tfsync.control`): it sees every worker's "ready" notice, applies
:meth:`close_round` (a pure function of the notices and the clock) and tells
every worker which ranks round ``t`` aggregates; every worker's communication
thread then enters the round's allreduce, the accepted ranks with their
contribution and every other rank with zeros, and divides by ``d``, so every
replica applies the same mean.  PSP takes every contribution its ranks
hold when they enter the round (``enters_when_ready``): a ready rank enters
at once, without waiting for any answer, and a rank that is not ready
enters on the closing with what it holds then, so the closing names the
fewest ranks the round takes and the round's metadata the actual ones.
Backup workers take exactly the first ``N`` (``accepts_ready``): the
coordinator's answer to a ready notice tells that rank it counts, and it
enters on the answer.  Either way only the ranks not ready by the closing
wait for it.  A contribution that misses its round is
stale from then on and dropped (zeros go out in its place; counted);
the worker that produced it skips the steps whose rounds have closed and
rejoins at the current one, so a slow worker does not set the job's length.

With ``compensate=tfsync.DelayCompensation(...)`` a contribution that missed
its round is not dropped but corrected (DC-ASGD, Zheng et al. 2017) and
applied in a later round: its worker keeps it with a snapshot of the weights
it was computed on (``w_stale``); at its next computed step, its weights are
those of the round that step joins (``w_now``), so it corrects the
contribution there, ``g̃ = g + λ·g⊙g⊙(w_now − w_stale)``, offers it to that
round, and the coordinator takes it as an extra that the policy's rule does
not count.  ``d`` does not count it either: the round's sum is divided by
its number of fresh contributions, so a late one is applied on top of them
with the weight a fresh one has, as DC-ASGD applies every corrected gradient
at the full learning rate (dropping it loses that step; compensating it
restores the step).  Counted as ``compensated``.  Memory on the worker that
holds one: the snapshot and the contribution, two copies of the parameters,
plus ``v`` with ``adaptive=True`` (there, the moving average of the
squares of this worker's late gradients, the ones it corrects); a worker
holds at most one late
contribution at a time.  Those still held when training ends are corrected
against the final weights and summed over the last round's ``d`` in one
final round that every replica applies (:meth:`tfsync.engine.SyncEngine.finish`).

Partial pulling (PSP Algorithm 1, worker lines 10-15), with
``pull_fraction=b < 1``: the weights are split into ``B`` blocks (groups of
whole weight tensors) and a round's mean reaches the training thread block by
block.  The worker applies the blocks that have arrived and starts its next
step once ``⌈b·B⌉`` of the round's blocks are applied and ``pull_timeout_s``
has passed since the ``⌈b·B⌉``-th arrived, or once all are (Algorithm 1, line
15: "until timeout τ2 after b% blocks have been received or all servers have
responded", the same form as ``τ1``); it keeps its previous values of the
others and applies each late block at its first step after it lands, in round
order per block, so no block is ever replaced by an older round's
(:mod:`tfsync.engine.components.pull`).  Each block goes
through the worker's own optimizer with ``optimizer.iterations`` set to the
block's round, so once every block has landed, weights and optimizer state are
the same as if every block had come on time (identical on every replica).

On a parameter server a worker's pull of one block can be slow while the
others' are not.  On an allreduce every block of a round completes on every
rank at once, so the slowness partial pulling hides is on the receive side of
one worker: what is late is the hand-off of a block to that worker's
training thread (simulated by ``tfsync.Stragglers(pull_prob=, pull_s=)``, the
paper's rare 4 s delays), and the collectives are never held up by it.  One
grouped allreduce still carries every block of a round: Horovod would fuse
``B`` calls into one buffer anyway.
"""

import dataclasses
import math

from tfsync.policies.base import Closing, Policy
from tfsync.policies.compensation import DelayCompensation, check_compensate

# push_timeout_s=None: wait this fraction of the round's own iteration time
# (previous close to the c-th ready contribution) for more contributions.
ADAPTIVE_PUSH_TIMEOUT_FRACTION = 0.1


def _check_seconds(owner, name, value, none_means, hint):
    """``value`` is None or a finite number of seconds >= 0 (``none_means``: what None does)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{owner}({name}={value!r}): {name} must be a number of seconds >= 0 or None "
            f"({none_means}), got {type(value).__name__}; {hint}"
        )
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{owner}({name}={value}): {name} must be a finite number of seconds >= 0 or None ({none_means}); {hint}"
        )


def _check_int(owner, name, value, minimum, hint):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}({name}={value!r}): {name} must be an int >= {minimum}, got " f"{type(value).__name__}; {hint}"
        )
    if value < minimum:
        raise ValueError(f"{owner}({name}={value}): {name} must be >= {minimum}; {hint}")


@dataclasses.dataclass(frozen=True)
class PSP(Policy):
    """Partially synchronous parallel SGD, partial pushing (Chen et al., PSP Algorithm 1).

    Round ``t`` closes once ``c = min_contributions`` workers' gradients for
    it (computed on the weights after round ``t - 1``) are ready and
    ``push_timeout_s`` has passed since the ``c``-th, or once every worker's
    is.  It aggregates every gradient ready by then (``d >= c``; a gradient
    that became ready after the closing but before its worker heard of it
    counts too: its worker enters the round with what it holds) and every
    replica applies their mean through its own optimizer, so weights and
    optimizer state stay identical on every worker.  A gradient that misses
    its round is dropped and counted (``dropped``); its worker skips the steps
    whose rounds closed meanwhile (``skipped``) and computes the next open one.

    Guarantees (tested): without ``compensate``, every applied gradient was
    computed on the weights of the round before the one it joins (staleness
    0; with partial pulling, a late block's weights are older); ``d >= c``
    fresh contributions in every round; ``PSP(min_contributions=size)``
    gives BSP's weights (with partial pulling too, without slow pulls); per
    worker, produced = applied + compensated + dropped.  Partial pulling:
    each block's rounds are applied in order, every block of every round is
    applied by the end of training, and weights and optimizer state are then
    identical on every replica.

    Args:
        min_contributions: ``c``, an int in ``[1, size]``; default ``None``:
            ``size - 1`` (at least 1), i.e. one slow worker is not waited for.
            The paper used 28 of 32.
        push_timeout_s: ``τ1`` in seconds (``>= 0``); ``0`` closes at the
            ``c``-th contribution, as in the paper's experiments.  Default
            ``None``: a tenth of the round's own iteration time (from the
            previous round's close to the ``c``-th contribution), so a worker
            slower than the others by less than that still counts.
        compensate: ``None`` (default): a late gradient is dropped.  A
            :class:`tfsync.DelayCompensation`: it is corrected and applied in
            the next round its worker computes for (counted as ``compensated``).
        pull_fraction: ``b`` in ``(0, 1]``: the share of a round's parameter
            blocks a worker must have applied before its next step.  Default
            ``1.0``: every block (no partial pulling).  The paper used 0.9.
            Partial pulling needs :class:`tfsync.keras.SyncCallback` and an
            optimizer that updates each weight on its own (no
            ``global_clipnorm``, EMA, gradient accumulation or loss scaling);
            it cannot be combined with ``compensate``.
        pull_timeout_s: ``τ2`` in seconds (``>= 0``): once ``⌈b·B⌉`` blocks
            have arrived, wait up to this long for the others.  Default
            ``None``: go on at once (0, as in the paper's experiments).  A
            step never starts with fewer than ``⌈b·B⌉`` of its round's blocks.
        pull_blocks: ``B``, the number of blocks (consecutive weight tensors,
            balanced by size); at most the number of weight tensors.  Default
            ``None``: one block per weight tensor.
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.PSP(min_contributions=3))   # or mode="psp"
        tfsync.keras.SyncCallback(mode=tfsync.PSP(pull_fraction=0.75))    # partial pulling too
    """

    min_contributions: int = None
    push_timeout_s: float = None
    compensate: DelayCompensation = None
    pull_fraction: float = 1.0
    pull_timeout_s: float = None
    pull_blocks: int = None
    name = "psp"
    payload = "gradients"
    coordinated = True
    skips = True
    accepts_ready = True  # every ready rank when it closes (PSP); the first N close it at the N-th (backup)
    enters_when_ready = True  # ... and every one ready when its worker enters: no answer to wait for

    def __post_init__(self):
        super().__post_init__()
        hint = "e.g. tfsync.PSP(min_contributions=3, push_timeout_s=0.0)"
        check_compensate("PSP", self.compensate)
        if self.min_contributions is not None:
            _check_int("PSP", "min_contributions", self.min_contributions, 1, hint)
        _check_seconds("PSP", "push_timeout_s", self.push_timeout_s, "adaptive", hint)
        self._check_pull()

    def _check_pull(self):
        hint = "e.g. tfsync.PSP(pull_fraction=0.75, pull_timeout_s=None, pull_blocks=None)"
        b = self.pull_fraction
        if isinstance(b, bool) or not isinstance(b, int | float):
            raise TypeError(f"PSP(pull_fraction={b!r}): pull_fraction must be a number in (0, 1]; {hint}")
        if not 0.0 < b <= 1.0:
            raise ValueError(
                f"PSP(pull_fraction={b}): pull_fraction is the share of a round's parameter blocks a "
                f"worker waits for, a number in (0, 1] (1.0: all of them, no partial pulling); {hint}"
            )
        t = self.pull_timeout_s
        _check_seconds("PSP", "pull_timeout_s", t, "0: go on at once", hint)
        if self.pull_blocks is not None:
            _check_int("PSP", "pull_blocks", self.pull_blocks, 1, hint)
        if b == 1.0 and (t is not None or self.pull_blocks is not None):
            raise ValueError(
                f"PSP(pull_timeout_s={t}, pull_blocks={self.pull_blocks}) with pull_fraction=1.0: "
                f"these settings act only with partial pulling; set pull_fraction below 1 "
                f"(e.g. 0.75) or leave them out"
            )
        if b < 1.0 and self.compensate is not None:
            raise ValueError(
                f"PSP(pull_fraction={b}, compensate=...): partial pulling and delay compensation "
                f"cannot be combined (a late gradient's correction needs the weights it is applied "
                f"at, which a late block leaves behind); use one of them"
            )

    @property
    def pulls_partially(self) -> bool:
        """Whether a worker may start a step before every block of its round arrived."""
        return self.pull_fraction < 1.0

    def blocks_needed(self, blocks: int) -> int:
        """``⌈b·B⌉``: the blocks of a round a worker applies before its next step."""
        return max(1, min(blocks, math.ceil(self.pull_fraction * blocks - 1e-9)))

    def contributions_needed(self, size: int) -> int:
        """``c`` for ``size`` workers."""
        return self.min_contributions if self.min_contributions is not None else max(1, size - 1)

    def validate(self, size: int) -> None:
        if self.min_contributions is not None and self.min_contributions > size:
            raise ValueError(
                f"PSP(min_contributions={self.min_contributions}) with {size} workers: a round can "
                f"never gather more contributions than there are workers; use min_contributions "
                f"<= {size} (or None for size - 1 = {max(1, size - 1)})"
            )

    def required_round(self, step: int) -> int:
        return step

    def close_round(self, ready, opened_s, now_s, size) -> Closing:
        # asked on every ready notice: O(1) until c have arrived (10,000 workers' notices
        # would otherwise cost a sort each)
        c = self.contributions_needed(size)
        if len(ready) < c:
            return Closing()
        ranks = tuple(sorted(r for r, _ in ready))
        if len(ready) >= size:
            return Closing(ranks)
        t_c = sorted(t for _, t in ready)[c - 1]
        timeout = (
            self.push_timeout_s
            if self.push_timeout_s is not None
            else ADAPTIVE_PUSH_TIMEOUT_FRACTION * max(t_c - opened_s, 0.0)
        )
        if now_s >= t_c + timeout:
            return Closing(ranks)
        return Closing(None, t_c + timeout)


@dataclasses.dataclass(frozen=True)
class BackupWorkers(Policy):
    """Synchronous SGD with backup workers (Chen et al. 2016, Algorithms 3-4).

    With ``size = N + b`` workers, round ``t`` aggregates the first ``N``
    gradients computed for it (on the weights after round ``t - 1``) to reach
    rank 0's coordinator; every replica applies their mean through its own
    optimizer.  The other ``b`` are dropped and counted (``dropped``), and
    their workers skip the steps whose rounds closed meanwhile (``skipped``).

    Guarantees (tested): exactly ``N`` fresh contributions per round (plus,
    with ``compensate``, the late ones taken as extras); ``BackupWorkers(0)``
    gives BSP's weights; per worker, produced = applied + compensated +
    dropped.

    Args:
        backups: ``b``, an int in ``[0, size)``. Default 1.
        compensate: ``None`` (default): the ``b`` late gradients are dropped.
            A :class:`tfsync.DelayCompensation`: each is corrected and applied
            in the next round its worker computes for (counted as
            ``compensated``), so no worker's computation is wasted.
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.BackupWorkers(backups=1))   # or mode="backup"
    """

    backups: int = 1
    compensate: DelayCompensation = None
    name = "backup"
    payload = "gradients"
    coordinated = True
    skips = True
    accepts_ready = True  # every ready rank when it closes (PSP); the first N close it at the N-th (backup)

    def __post_init__(self):
        super().__post_init__()
        _check_int("BackupWorkers", "backups", self.backups, 0, "e.g. tfsync.BackupWorkers(backups=1)")
        check_compensate("BackupWorkers", self.compensate)

    def validate(self, size: int) -> None:
        if self.backups >= size:
            raise ValueError(
                f"BackupWorkers(backups={self.backups}) with {size} workers: at least one worker "
                f"must count in every round; use backups <= {size - 1}"
            )

    def required_round(self, step: int) -> int:
        return step

    def close_round(self, ready, opened_s, now_s, size) -> Closing:
        n = size - self.backups
        if len(ready) < n:
            return Closing()
        return Closing(tuple(sorted(r for r, _ in ready[:n])))
