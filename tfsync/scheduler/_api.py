"""``zipline()``: the ElasticBSP barrier decision (Zhao et al., Sections 4.1-4.2 and 5).

The single entry point the ElasticBSP mode calls at every barrier.  It
validates and normalizes the predicted end times, hands them to the chosen
kernels (:mod:`._backend`), and returns a :class:`ZipLineResult`.
"""

import dataclasses

import numpy as np

from . import _backend

ALGORITHMS = ("zipline", "zipline_opt", "optbs", "gridscan", "fullgridscan")
# Exact algorithms return the optimum of Problem 1; gridscan is the paper's heuristic.
EXACT_ALGORITHMS = ("zipline", "zipline_opt", "optbs", "fullgridscan")
_MAX_STAMPS = 2**31 - 1  # the kernels index the merged timeline with int32


@dataclasses.dataclass(frozen=True, eq=False)
class ZipLineResult:
    """Where to put the next barrier, and what it costs.

    Attributes:
        t_sync: ``max(Z*)``, the predicted time of the barrier: the end of the
            last chosen iteration.  Same type as the input stamps (``int`` for
            integer input, ``float`` for floating-point input).
        iterations: read-only ``int64`` array, one entry per worker: the
            1-based index ``i`` of the chosen end time ``e_i^p`` in the
            worker's row, as in the paper (``e_1^p`` is the end of the next
            iteration).  It is the number of further iterations the worker
            runs before the barrier.
        wait: ``d_Z* = max(Z*) - min(Z*)``, the predicted wait of the first
            worker to arrive; same type as ``t_sync``.
    """

    t_sync: object
    iterations: np.ndarray
    wait: object


def zipline(timestamps, algorithm="optbs", *, implementation=None):
    """Choose the barrier that minimizes the workers' wait (ElasticBSP, Problem 1).

    From each worker's predicted iteration end times pick one, so that the
    spread ``max - min`` of the picks (the wait) is smallest; among equally
    small spreads, the earliest barrier (Corollary 1).  Each worker is then
    assigned its latest end time at or before the barrier: this never adds
    wait and makes the answer unique.

    Args:
        timestamps: predicted end times, one row per worker (``e_1^p ... e_R^p``),
            either an ``n x R`` array or a sequence of ``n`` one-dimensional
            rows whose lengths may differ.  Integer stamps (e.g. milliseconds)
            or floating-point stamps (e.g. seconds); finite; each row
            non-decreasing (rows that are not are rejected, not sorted: an
            unsorted row means the predictor or the caller mixed up
            iterations).
        algorithm: ``"optbs"`` (default, ZipLineOptBS), ``"zipline_opt"``,
            ``"zipline"``, ``"fullgridscan"`` (all exact) or ``"gridscan"``
            (the paper's heuristic baseline: its answer may wait longer).
        implementation: ``"compiled"`` or ``"reference"``; ``None`` reads
            ``TFSYNC_SCHEDULER_IMPL`` (default ``compiled``).

    Returns:
        A :class:`ZipLineResult`.  With one worker the wait is zero and its
        first end time is chosen.

    Example:
        >>> result = zipline([[10, 20, 30], [14, 29, 44]])
        >>> result.t_sync, result.iterations.tolist(), result.wait
        (30, [3, 2], 1)
    """
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(
            f"zipline: unknown algorithm {algorithm!r}; expected one of "
            f"{', '.join(map(repr, ALGORITHMS))} ('optbs', ZipLineOptBS, is the default "
            "and the fastest)"
        )
    kernels = _backend.load(implementation)
    values, offsets = _as_rows(timestamps)
    t_sync, wait, iterations = getattr(kernels, algorithm)(values, offsets)
    iterations.flags.writeable = False
    return ZipLineResult(t_sync=t_sync, iterations=iterations, wait=wait)


def _stamp_dtype(array, where):
    kind = array.dtype.kind
    if kind == "f":
        return np.float64
    if kind in "iu":
        return np.int64
    raise TypeError(
        f"zipline: {where} has dtype {array.dtype}; expected integer stamps (e.g. "
        "milliseconds) or floating-point stamps (e.g. seconds); convert with "
        "np.asarray(timestamps, dtype=np.float64)"
    )


def _as_rows(timestamps):
    """Validate ``timestamps`` and flatten it to (values, offsets), the kernels' CSR layout."""
    if isinstance(timestamps, np.ndarray) and timestamps.dtype != object:
        if timestamps.ndim != 2:
            raise ValueError(
                f"zipline: timestamps has shape {timestamps.shape}; expected n x R (one row "
                "of predicted end times per worker); for a single worker pass [row]"
            )
        dtype = _stamp_dtype(timestamps, "timestamps")
        n, width = timestamps.shape
        if n == 0 or width == 0:
            raise ValueError(
                f"zipline: timestamps has shape {timestamps.shape}; expected at least one "
                "worker with at least one predicted end time"
            )
        rows = [timestamps]
        values = np.ascontiguousarray(timestamps, dtype=dtype).reshape(-1)
        offsets = np.arange(0, n * width + 1, width, dtype=np.int64)
    else:
        try:
            rows = [np.asarray(row) for row in timestamps]
        except TypeError:
            raise TypeError(
                f"zipline: timestamps is a {type(timestamps).__name__}; expected an n x R "
                "array or a sequence of one-dimensional rows (one per worker)"
            ) from None
        if not rows:
            raise ValueError("zipline: no workers; expected at least one row of predicted end times")
        for p, row in enumerate(rows):
            if row.ndim != 1 or row.size == 0:
                raise ValueError(
                    f"zipline: the row of worker {p} has shape {row.shape}; expected a "
                    "non-empty one-dimensional row of predicted end times"
                )
        dtypes = {_stamp_dtype(row, f"the row of worker {p}") for p, row in enumerate(rows)}
        dtype = np.float64 if np.float64 in dtypes else np.int64
        values = np.concatenate(rows).astype(dtype, copy=False)
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([row.size for row in rows], out=offsets[1:])
    if values.size > _MAX_STAMPS:
        raise ValueError(
            f"zipline: {values.size} stamps; at most {_MAX_STAMPS} are supported; "
            "predict fewer iterations per worker (smaller R)"
        )
    if dtype is np.int64:
        _check_integer_range(rows, values)
    else:
        _check_finite(values, offsets)
    _check_sorted(values, offsets)
    return values, offsets


def _locate(offsets, flat_index):
    worker = int(np.searchsorted(offsets, flat_index, side="right")) - 1
    return worker, int(flat_index - offsets[worker])


def _check_finite(values, offsets):
    finite = np.isfinite(values)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        worker, index = _locate(offsets, bad[0])
        raise ValueError(
            f"zipline: {bad.size} predicted end time(s) are NaN or infinite, the first at "
            f"worker {worker}, iteration {index + 1} ({values[bad[0]]}); expected finite "
            "stamps; a worker without a usable history must be left out of the decision "
            "(predict_end_times reports such workers)"
        )


def _check_integer_range(rows, values):
    # Unsigned inputs above int64 and spreads that overflow int64 subtraction.
    for row in rows:
        if row.dtype.kind == "u" and row.size and row.max() > np.iinfo(np.int64).max:
            raise ValueError(
                "zipline: an unsigned stamp exceeds the int64 range; expected stamps "
                "below 2**63; shift them to a recent epoch"
            )
    if int(values.max()) - int(values.min()) > np.iinfo(np.int64).max:
        raise ValueError(
            "zipline: the stamps span more than 2**63 - 1 units, so their differences "
            "overflow int64; shift them to a common recent epoch"
        )


def _check_sorted(values, offsets):
    descending = values[1:] < values[:-1]
    descending[offsets[1:-1] - 1] = False  # the step from one row to the next is not an order
    if descending.any():
        first = int(np.flatnonzero(descending)[0]) + 1
        worker, index = _locate(offsets, first)
        raise ValueError(
            f"zipline: the row of worker {worker} is not sorted: iteration {index + 1} ends "
            f"at {values[first]}, before iteration {index} ({values[first - 1]}); expected "
            "non-decreasing end times of successive iterations (they are not sorted for "
            "you, since a disordered row usually means mixed-up iterations); if the order "
            "carries no meaning, sort each row first (np.sort(timestamps, axis=1))"
        )
