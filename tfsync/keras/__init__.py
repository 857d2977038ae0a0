"""Keras 3 integration: ``model.fit(..., callbacks=[tfsync.keras.SyncCallback(mode=...)])``."""

from tfsync.keras.callback import SyncCallback

__all__ = ["SyncCallback"]
