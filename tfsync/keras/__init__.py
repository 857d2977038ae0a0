"""Keras 3 integration: ``model.fit(..., callbacks=[tfsync.keras.SyncCallback(mode=...)])``."""

from tfsync.faults.injector import FaultInjector
from tfsync.keras.callback import SyncCallback
from tfsync.keras.statistics import average_statistics

__all__ = ["FaultInjector", "SyncCallback", "average_statistics"]
