"""The sync engine: rounds over Horovod allreduce, clocks, control path, waits, metrics.

The names below load on first use, so a process that only needs the control path
(:mod:`tfsync.control`: a simulated worker of ``python -m tfsync.bench control``)
imports neither TensorFlow nor Horovod.
"""

import importlib
import typing

_WHERE = {
    "COUNTS": "tfsync.engine.tally",
    "EngineSettings": "tfsync.engine.settings",
    "NonFiniteError": "tfsync.engine.nonfinite",
    "StepComponent": "tfsync.engine.components",
    "SyncEngine": "tfsync.engine.engine",
    "SyncTimeoutError": "tfsync.engine.diagnosis",
    "WorkerLostError": "tfsync.engine.rounds",
}

if typing.TYPE_CHECKING:  # (what static readers, the API reference among them, follow)
    from tfsync.engine.components import StepComponent
    from tfsync.engine.diagnosis import SyncTimeoutError
    from tfsync.engine.engine import SyncEngine
    from tfsync.engine.nonfinite import NonFiniteError
    from tfsync.engine.rounds import WorkerLostError
    from tfsync.engine.settings import EngineSettings
    from tfsync.engine.tally import COUNTS


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tfsync.engine' has no attribute {name!r}")


__all__ = [
    "COUNTS",
    "EngineSettings",
    "NonFiniteError",
    "StepComponent",
    "SyncEngine",
    "SyncTimeoutError",
    "WorkerLostError",
]
