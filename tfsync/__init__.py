"""tfsync: relaxed synchronization for Keras 3 / TensorFlow data-parallel training on Horovod.

Public API::

    tfsync.BSP(), tfsync.SSP(staleness=3)       # modes (or their registered names, "bsp", "ssp",
    tfsync.DSSP(low=3, high=15)                  #   ...: tfsync.policies.registry.names())
    tfsync.ElasticBSP(lookahead=15)
    tfsync.PSP(), tfsync.BackupWorkers()
    tfsync.DCS3GD(compensation=tfsync.DelayCompensation(lam=0.04))
    tfsync.LocalSGD(period=8), tfsync.DiLoCo(inner_steps=8)
    tfsync.Auto()                                # picked from measured times (SyncCallback)
    tfsync.Stragglers(...)                       # simulated device time and stragglers
    tfsync.keras.SyncCallback(mode=...)          # model.fit(..., callbacks=[...])
    tfsync.distribute.SyncStrategy(mode=...)     # with strategy.scope(): ...
    tfsync.elastic.KerasState, tfsync.elastic.run # elastic training (horovodrun --min-np/--max-np)
    tfsync.faults.Schedule, tfsync.faults.Injector  # fault injection, to try it
    tfsync.shard(x, y)                           # this rank's equal share of arrays
    tfsync.shard_dataset(ds, batch_size)         # ... of a tf.data dataset (elastic: resume=state)
    tfsync.register_mode(name, PolicyClass)      # a mode of your own (tfsync.policies.registry)
"""

import importlib

from tfsync.policies import (
    BSP,
    DCS3GD,
    DSSP,
    PSP,
    SSP,
    Auto,
    BackupWorkers,
    DelayCompensation,
    DiLoCo,
    ElasticBSP,
    LocalSGD,
    Policy,
)
from tfsync.policies import register as register_mode
from tfsync.stragglers import Stragglers

__version__ = "0.1.0"

_LAZY = {"keras", "distribute", "elastic", "engine", "faults", "ops", "scheduler", "timeline"}


def __getattr__(name):
    # Submodules that import TensorFlow load on first use, so `import tfsync` stays light.
    if name in _LAZY:
        return importlib.import_module(f"tfsync.{name}")
    if name in ("shard", "shard_dataset"):
        from tfsync import _data

        return getattr(_data, name)
    raise AttributeError(f"module 'tfsync' has no attribute {name!r}")


__all__ = [
    "BSP",
    "SSP",
    "DSSP",
    "ElasticBSP",
    "PSP",
    "BackupWorkers",
    "DCS3GD",
    "DelayCompensation",
    "LocalSGD",
    "DiLoCo",
    "Auto",
    "Policy",
    "register_mode",
    "Stragglers",
    "shard",
    "shard_dataset",
    "keras",
    "distribute",
    "elastic",
    "__version__",
]
