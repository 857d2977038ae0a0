"""The sync engine: rounds over Horovod allreduce, clocks, control path, waits, metrics."""
from tfsync.engine.engine import SyncEngine, SyncTimeoutError
from tfsync.engine.exchange import WorkerLostError

__all__ = ["SyncEngine", "SyncTimeoutError", "WorkerLostError"]
