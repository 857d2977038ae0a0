"""What ``SyncCallback`` adds to Keras' logs (:func:`add_epoch_logs`).

Per epoch: ``tfsync_wait_fraction`` and what happened to this worker's
contributions (``tfsync_produced`` = ``tfsync_applied`` + ``tfsync_compensated``
+ ``tfsync_dropped`` + ``tfsync_rejected`` + ``tfsync_lost``; ``tfsync_skipped``
steps), the bytes its rounds put on the wire (``tfsync_bytes_sent``,
``tfsync_bytes_received``, and ``tfsync_uncompressed_bytes_sent`` and
``_received``: the same rounds without ``compression=``;
:mod:`tfsync.engine.wire.counting` says how they are counted), what the mode's components
add (:meth:`SyncEngine.epoch_logs <tfsync.engine.SyncEngine.epoch_logs>`: partial pulling's
block counts since ``fit`` began); then
every scalar log averaged over the workers, as Horovod's
``MetricAverageCallback`` does (``docs/guide/metrics.md``).
"""

import numpy as np

from tfsync._data import REDONE
from tfsync.engine import COUNTS
from tfsync.engine.tally import BYTES


def add_epoch_logs(logs, totals, engine, frontend, average):
    """Add the epoch's tfsync logs to ``logs`` (``totals``: the epoch's counts and seconds,
    :meth:`tfsync.keras.counts.RunCounts.epoch_totals`), then, with ``average``, set every
    scalar log to its mean over the workers (collective: every worker waits for the others'
    epoch end)."""
    busy = totals["wait_s"] + totals["compute_s"]
    logs["tfsync_wait_fraction"] = totals["wait_s"] / busy if busy else 0.0
    for key in (*COUNTS, *BYTES, *(k for k in REDONE if k in totals)):  # (redone: an elastic job's)
        logs[f"tfsync_{key}"] = float(totals[key])
    for key, n in engine.epoch_logs().items():  # (partial pulling's block counts, ...)
        logs[f"tfsync_{key}"] = float(n)
    if average:
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        mean = frontend.average(
            [float(logs[k]) for k in keys], "tfsync.epoch_logs", "the epoch's logs, averaged over the ranks"
        )
        logs.update({k: float(v) for k, v in zip(keys, mean)})


__all__ = ["add_epoch_logs"]
