"""What every worker receives for a completed round (:class:`RoundResult`), and the error a
lost peer raises (:class:`WorkerLostError`).

The round's payload and its metadata travel as :mod:`tfsync.engine.wire` lays them out and
reduces them; the exchange (:mod:`tfsync.engine.exchange`) decodes the metadata into the
per-rank arrays here.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass
class RoundResult:
    """What every worker receives for a completed round."""

    round: int
    total: list  # the collective's result, one tensor per payload tensor
    present: np.ndarray  # [size] 1.0 where that rank contributed
    steps: np.ndarray  # [size] step each rank stamped its contribution with
    push_times: np.ndarray  # [size] seconds since the job's t0
    compute_s: np.ndarray  # [size]
    contribution: list = None  # this worker's own payload for the round
    accepted: tuple = None  # coordinated rounds: the ranks whose contribution it aggregated
    late: np.ndarray = None  # [size] 1.0 where that rank added a late, delay-compensated contribution
    late_steps: np.ndarray = None  # [size] the step that late contribution was computed for
    rejected: np.ndarray = None  # [size] 1.0 where that rank's contribution was rejected (not finite): zeros
    # open rounds whose sum is checked: ("own", tensors) when this rank's contribution was found not
    # finite after the sum was, ("sum", tensors) when finite contributions' sum overflowed; else None
    rejected_after_sum: tuple = None

    @property
    def contributors(self) -> int:
        late = 0.0 if self.late is None else float(self.late.sum())
        return int(round(float(self.present.sum()) + late))


class WorkerLostError(RuntimeError):
    """A peer stopped: raised on every surviving worker, naming the lost rank(s)."""


__all__ = ["RoundResult", "WorkerLostError"]
