"""tf.distribute integration: ``with tfsync.distribute.SyncStrategy(mode=...).scope(): ...``."""

from tfsync.distribute.strategy import SyncStrategy

__all__ = ["SyncStrategy"]
