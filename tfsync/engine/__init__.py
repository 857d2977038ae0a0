"""The sync engine: rounds over Horovod allreduce, clocks, waits, counters, faults.

One room per concern, dependencies pointing down:

* the step core: :mod:`~tfsync.engine.engine` (:class:`SyncEngine`), the rounds' thread
  (:mod:`~tfsync.engine.exchange`, :mod:`~tfsync.engine.outbox`, :mod:`~tfsync.engine.entry`,
  :mod:`~tfsync.engine.rounds`), the counts (:mod:`~tfsync.engine.tally`), the checks
  (:mod:`~tfsync.engine.nonfinite`, :mod:`~tfsync.engine.diagnosis`), the settings;
* start-up: :mod:`~tfsync.engine.agreement` (what the ranks agree on) and
  :mod:`~tfsync.engine.lifecycle` (what the engine starts, owned by one object);
* the step protocols: :mod:`tfsync.engine.protocols`;
* the mode components: :mod:`tfsync.engine.components`;
* the wire: :mod:`tfsync.engine.wire` (what a round puts on the wire and how it is reduced),
  over the injected cluster (:mod:`~tfsync.engine.cluster`, :mod:`~tfsync.engine.bounded`).

The control plane it talks to is a package beside it, :mod:`tfsync.control`.

The names below load on first use, so a process that needs one room of the engine (the
control bench's simulated rank 0 runs the binding table's services) imports neither
TensorFlow nor Horovod.
"""

import importlib
import typing

_WHERE = {
    "COUNTS": "tfsync.engine.tally",
    "EngineSettings": "tfsync.engine.settings",
    "NonFiniteError": "tfsync.engine.nonfinite",
    "StepComponent": "tfsync.engine.components.base",
    "SyncEngine": "tfsync.engine.engine",
    "SyncTimeoutError": "tfsync.engine.diagnosis",
    "WorkerLostError": "tfsync.engine.rounds",
}

if typing.TYPE_CHECKING:  # (what static readers, the API reference among them, follow)
    from tfsync.engine.components.base import StepComponent
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
