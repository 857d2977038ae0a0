"""Predict each worker's next R iteration end times (ElasticBSP, Section 4).

The server learns a worker's iteration interval from the timestamps of its
push requests (Section 2.1): after the monitoring phase (at least two pushes
per worker, Fig. 5) it assumes the interval stays stable for the next R
iterations, so the k-th future end time is ``t_last + k * interval``.  The
paper uses the latest interval; ``smoothing`` optionally replaces it with an
exponentially smoothed one to damp a single noisy interval.
"""

import numbers

import numpy as np


def predict_end_times(push_timestamps, R, smoothing=None):
    """Each worker's next ``R`` iteration end times from its push timestamps.

    Args:
        push_timestamps: one history per worker (a sequence indexed by worker,
            or an ``n x h`` array): the times of its push requests, oldest
            first, strictly increasing.  Integer (e.g. milliseconds) or
            floating-point (e.g. seconds) stamps.  ``None`` or an empty
            history means the worker has not pushed yet.
        R: how many future iterations to predict (the lookahead), ``R >= 1``.
        smoothing: ``None`` (default, the paper): the interval is the latest
            one, ``t[-1] - t[-2]``.  A float ``alpha`` in ``(0, 1]``: the
            exponentially smoothed interval ``s <- alpha * interval + (1 -
            alpha) * s`` over the whole history, started at its first
            interval (``alpha = 1`` is the paper's rule).

    Returns:
        An ``n x R`` array for :func:`tfsync.scheduler.zipline`: row ``p`` is
        ``t_last + k * interval`` for ``k = 1 .. R``.  ``int64`` when every
        history is integer (smoothed intervals are rounded to the nearest
        unit), otherwise ``float64``.

    Raises:
        ValueError: naming every worker whose history is missing, shorter than
            two pushes, not finite or not strictly increasing: such a worker's
            next iterations are not guessed.

    Example:
        >>> predict_end_times([[0, 100], [5, 125]], R=3).tolist()
        [[200, 300, 400], [245, 365, 485]]
    """
    if isinstance(R, bool) or not isinstance(R, numbers.Integral) or R < 1:
        raise ValueError(
            f"predict_end_times: R={R!r}; expected a positive integer (the number "
            "of future iterations to predict, e.g. 15)"
        )
    if smoothing is not None:
        if isinstance(smoothing, bool) or not isinstance(smoothing, numbers.Real) or not 0.0 < float(smoothing) <= 1.0:
            raise ValueError(
                f"predict_end_times: smoothing={smoothing!r}; expected None (latest "
                "interval, as in the paper) or a weight in (0, 1]"
            )
    table = _valid_table(push_timestamps)
    if table is not None:  # every worker's history in one array: no loop over workers
        integer = table.dtype.kind in "iu"
        table = table.astype(np.int64 if integer else np.float64, copy=False)
        last = table[:, -1]
        if smoothing is None:
            interval = table[:, -1] - table[:, -2]
        else:
            interval = _smoothed_intervals(table, float(smoothing))
    else:
        histories = _histories(push_timestamps)
        _check_histories(histories)
        integer = all(h.dtype.kind in "iu" for h in histories)
        last = np.array([h[-1] for h in histories], dtype=np.int64 if integer else np.float64)
        if smoothing is None:
            interval = np.array([h[-1] - h[-2] for h in histories], dtype=last.dtype)
        else:
            interval = np.concatenate([_smoothed_intervals(h[None, :], float(smoothing)) for h in histories])
    if smoothing is not None and integer:
        interval = np.rint(interval)
    steps = np.arange(1, int(R) + 1)
    predicted = last[:, None] + interval[:, None] * steps[None, :]
    return predicted.astype(last.dtype, copy=False)


def _smoothed_intervals(table, alpha):
    """Each row's exponentially smoothed interval (rows of equal length, oldest first)."""
    intervals = np.diff(table.astype(np.float64), axis=1)
    smoothed = intervals[:, 0]
    for column in intervals.T[1:]:
        smoothed = alpha * column + (1.0 - alpha) * smoothed
    return smoothed


def _valid_table(push_timestamps):
    """``push_timestamps`` itself when it is an ``n x h`` numeric array (``n >= 1``, ``h >= 2``)
    of finite, strictly increasing rows; else ``None``, and the per-worker path checks it
    and names every worker that is wrong."""
    if not (
        isinstance(push_timestamps, np.ndarray)
        and push_timestamps.ndim == 2
        and push_timestamps.dtype.kind in "iuf"
        and push_timestamps.shape[0] >= 1
        and push_timestamps.shape[1] >= 2
    ):
        return None
    if push_timestamps.dtype.kind == "f" and not np.isfinite(push_timestamps).all():
        return None
    if not (push_timestamps[:, 1:] > push_timestamps[:, :-1]).all():  # np.diff wraps unsigned stamps
        return None
    return push_timestamps


def _histories(push_timestamps):
    if isinstance(push_timestamps, np.ndarray) and push_timestamps.dtype != object:
        if push_timestamps.ndim != 2:
            raise ValueError(
                f"predict_end_times: push_timestamps has shape {push_timestamps.shape}; "
                "expected n x h (one row of push timestamps per worker) or a sequence of rows"
            )
        rows = list(push_timestamps)
    else:
        try:
            rows = list(push_timestamps)
        except TypeError:
            raise TypeError(
                f"predict_end_times: push_timestamps is a {type(push_timestamps).__name__}; "
                "expected a sequence of per-worker push-timestamp histories"
            ) from None
    if not rows:
        raise ValueError("predict_end_times: no workers; expected one push history per worker")
    histories = []
    for p, row in enumerate(rows):
        history = np.asarray([] if row is None else row)
        if history.ndim != 1:
            raise ValueError(
                f"predict_end_times: the history of worker {p} has shape "
                f"{history.shape}; expected a one-dimensional sequence of stamps"
            )
        if history.size and history.dtype.kind not in "iuf":
            raise TypeError(
                f"predict_end_times: the history of worker {p} has dtype "
                f"{history.dtype}; expected integer or floating-point stamps"
            )
        histories.append(history)
    return histories


def _check_histories(histories):
    problems = []
    too_short = [(p, h.size) for p, h in enumerate(histories) if h.size < 2]
    if too_short:
        listed = ", ".join(f"{p} ({size} push{'es' if size != 1 else ''})" for p, size in too_short)
        problems.append(
            f"worker(s) {listed} have fewer than two push timestamps: the monitoring phase "
            "needs at least two pushes per worker to learn its interval; wait until every "
            "worker has pushed twice, or leave the worker out of the decision"
        )
    long_enough = [(p, h) for p, h in enumerate(histories) if h.size >= 2]
    not_finite = [p for p, h in long_enough if h.dtype.kind == "f" and not np.isfinite(h).all()]
    if not_finite:
        problems.append(
            f"worker(s) {', '.join(map(str, not_finite))} have NaN or infinite "
            "push timestamps; expected finite stamps"
        )
    not_increasing = [p for p, h in long_enough if p not in not_finite and not (h[1:] > h[:-1]).all()]
    if not_increasing:
        problems.append(
            f"worker(s) {', '.join(map(str, not_increasing))} have push timestamps "
            "that do not strictly increase; expected the times of successive "
            "pushes, oldest first"
        )
    if problems:
        raise ValueError("predict_end_times: " + "; ".join(problems))
