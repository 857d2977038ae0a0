"""Keras 3 integration: ``model.fit(..., callbacks=[tfsync.keras.SyncCallback(mode=...)])``."""

from tfsync.keras.callback import SyncCallback
from tfsync.keras.faults import FaultInjector
from tfsync.keras.statistics import average_statistics

__all__ = ["FaultInjector", "SyncCallback", "average_statistics"]
