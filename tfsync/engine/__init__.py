"""The sync engine: rounds over Horovod allreduce, clocks, control path, waits, metrics."""

from tfsync.engine.components import StepComponent
from tfsync.engine.diagnosis import SyncTimeoutError
from tfsync.engine.engine import COUNTS, SyncEngine
from tfsync.engine.nonfinite import NonFiniteError
from tfsync.engine.rounds import WorkerLostError
from tfsync.engine.settings import EngineSettings

__all__ = [
    "COUNTS",
    "EngineSettings",
    "NonFiniteError",
    "StepComponent",
    "SyncEngine",
    "SyncTimeoutError",
    "WorkerLostError",
]
