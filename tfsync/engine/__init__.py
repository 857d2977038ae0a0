"""The sync engine: rounds over Horovod allreduce, clocks, control path, waits, metrics."""

from tfsync.engine.components import StepComponent
from tfsync.engine.diagnosis import SyncTimeoutError
from tfsync.engine.engine import COUNTS, SyncEngine
from tfsync.engine.exchange import WorkerLostError
from tfsync.engine.nonfinite import NonFiniteError

__all__ = ["COUNTS", "NonFiniteError", "StepComponent", "SyncEngine", "SyncTimeoutError", "WorkerLostError"]
