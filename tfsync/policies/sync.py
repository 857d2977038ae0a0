"""BSP and SSP: a fixed number of rounds a worker may have outstanding (none for BSP, ``staleness``
for SSP), a rule every worker applies alone (re-exported by :mod:`tfsync.policies`)."""

import dataclasses

from tfsync.policies.base import Policy


@dataclasses.dataclass(frozen=True)
class BSP(Policy):
    """Bulk-synchronous parallel: every step applies the average of all workers'
    gradients of that step, as ``hvd.allreduce(grad, op=hvd.Average)`` would.

    Args:
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.BSP())   # or mode="bsp"
    """

    name = "bsp"
    payload = "gradients"
    every_round_whole = True

    def required_round(self, step: int) -> int:
        return step


@dataclasses.dataclass(frozen=True)
class SSP(Policy):
    """Stale synchronous parallel (Ho et al. 2013) on allreduce.

    Each worker applies its own update at once (read-my-writes) and hands it to
    the communication thread, which sums the workers' updates of step ``r`` in
    round ``r`` while the worker computes on.  Before computing step ``c`` a
    worker waits until round ``c - staleness - 1`` is complete and applies every
    complete round.  Guarantees (tested from recorded traces):

    * the fastest and slowest workers' clocks never differ by more than
      ``staleness``;
    * at clock ``c`` a worker has applied every worker's updates from clocks
      ``<= c - staleness - 1`` and all of its own;
    * ``SSP(0)`` waits exactly where BSP waits;
    * when training ends every replica holds bit-identical weights.

    Args:
        staleness: the bound ``s`` (int, ``>= 0``). Default 3.
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.SSP(staleness=3))   # or mode="ssp"
    """

    staleness: int = 3
    name = "ssp"
    payload = "updates"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int):
            raise TypeError(
                f"SSP(staleness={self.staleness!r}): staleness must be an int >= 0 "
                f"(the number of steps the fastest worker may run ahead), "
                f"got {type(self.staleness).__name__}; e.g. tfsync.SSP(staleness=3)"
            )
        if self.staleness < 0:
            raise ValueError(
                f"SSP(staleness={self.staleness}): staleness must be >= 0 "
                f"(0 behaves as BSP); e.g. tfsync.SSP(staleness=3)"
            )

    def required_round(self, step: int) -> int:
        return step - self.staleness - 1
