"""Plain-Python ZipLine kernels, written to follow the paper line by line.

The reference twin of the compiled :mod:`tfsync.scheduler._zipline` (Zhao et
al., "ElasticBSP", Section 5): same names, same arguments, same results.  It
exists so the tests can check the compiled kernels against an implementation
whose every step can be read next to the paper, and it is selectable with
``TFSYNC_SCHEDULER_IMPL=reference`` or ``implementation="reference"``.  It is
far slower (see ``docs/scheduler.md``), so production uses the compiled one.

Contract (callers go through :func:`tfsync.scheduler.zipline`, which
validates): ``values`` holds all predicted end times row after row (CSR),
``offsets`` has ``n + 1`` entries and row ``p`` is
``values[offsets[p]:offsets[p + 1]]``, non-empty, finite and non-decreasing.
Each kernel returns ``(t_sync, wait, iterations)``; the exact kernels report,
per worker, the 1-based index of its latest end time at or before ``t_sync``.
"""

import bisect

import numpy as np


def _rows(values, offsets):
    values = values.tolist()  # Python numbers: float stays float, int64 stays int
    offsets = offsets.tolist()
    return [values[offsets[p] : offsets[p + 1]] for p in range(len(offsets) - 1)]


def _omega(rows):
    """Step 1: merge all S^p into Omega, sorted by timestamp, then worker id, then index.

    Elements are the paper's triples <t, p, i> (p and i 0-based here).
    """
    return sorted((t, p, i) for p, row in enumerate(rows) for i, t in enumerate(row))


def _result(rows, t_sync):
    """Canonical Z* for a barrier at t_sync: each worker's latest end time <= t_sync."""
    iterations = [bisect.bisect_right(row, t_sync) for row in rows]
    earliest = min(row[k - 1] for row, k in zip(rows, iterations))
    return t_sync, t_sync - earliest, np.asarray(iterations, dtype=np.int64)


def zipline(values, offsets):
    """ZipLine, Algorithm 2: scan Omega once; Z holds one element per worker.

    After each new element, min(Z) is found by searching Z: O(R n^2).
    """
    rows = _rows(values, offsets)
    n = len(rows)
    z = {}  # worker -> timestamp of its element in Z
    best_wait = best_sync = None
    for t, p, _ in _omega(rows):
        z[p] = t  # replaces the element of Z with the same colour, if any
        if len(z) < n:
            continue
        wait = t - min(z.values())
        if best_wait is None or wait < best_wait:  # strict: the earliest optimum wins
            best_wait, best_sync = wait, t
    return _result(rows, best_sync)


def zipline_opt(values, offsets):
    """ZipLineOpt, Section 5.3.1: Z kept in arrival order, so min(Z) is its head.

    Case (i): the head has the new element's colour; it leaves and d_Z is
    evaluated.  Case (ii): the same-coloured element is searched for and
    removed; by Theorem 3 d_Z cannot improve, so it is not evaluated.
    """
    rows = _rows(values, offsets)
    n = len(rows)
    z = []  # (t, p) in arrival order
    present = set()
    best_wait = best_sync = None
    for t, p, _ in _omega(rows):
        evaluate = False
        if p not in present:
            present.add(p)
            evaluate = len(present) == n
        elif z[0][1] == p:
            del z[0]
            evaluate = len(present) == n
        else:
            k = next(k for k, (_, colour) in enumerate(z) if colour == p)
            del z[k]
        z.append((t, p))
        if evaluate:
            wait = t - z[0][0]
            if best_wait is None or wait < best_wait:
                best_wait, best_sync = wait, t
    return _result(rows, best_sync)


def optbs(values, offsets):
    """ZipLineOptBS, Section 5.3.2: as ZipLineOpt, but the element to remove is
    located by binary search.

    Its timestamp is the worker's previous end time, read from the matrix M
    (``rows``); Z is sorted by (timestamp, worker, index), the order of Omega,
    so the search is exact also among equal timestamps.
    """
    rows = _rows(values, offsets)
    n = len(rows)
    z = []  # triples (t, p, i), sorted
    present = set()
    best_wait = best_sync = None
    for t, p, i in _omega(rows):
        evaluate = False
        if p not in present:
            present.add(p)
            evaluate = len(present) == n
        else:
            previous = (rows[p][i - 1], p, i - 1)
            k = bisect.bisect_left(z, previous)
            del z[k]
            evaluate = k == 0 and len(present) == n
        z.append((t, p, i))
        if evaluate:
            wait = t - z[0][0]
            if best_wait is None or wait < best_wait:
                best_wait, best_sync = wait, t
    return _result(rows, best_sync)


def _first_at_or_after(row, anchor):
    """Algorithm 1's inner loop: the element closest to the anchor from above (linear scan)."""
    for k, t in enumerate(row):
        if t >= anchor:
            return k
    return len(row) - 1


def _grid_scan_row(rows, designated, best):
    for e, anchor in enumerate(rows[designated]):
        chosen = [e if p == designated else _first_at_or_after(row, anchor) for p, row in enumerate(rows)]
        stamps = [row[k] for row, k in zip(rows, chosen)]
        wait, t_sync = max(stamps) - min(stamps), max(stamps)
        if best is None or (wait, t_sync) < (best[0], best[1]):
            best = (wait, t_sync, chosen)
    return best


def gridscan(values, offsets):
    """GridScan, Algorithm 1: the baseline heuristic; returns the set it found.

    The designated row is the worker with the earliest first end time (line 4);
    each of its elements is taken as min(Z) and every other worker contributes
    its first end time at or after it.
    """
    rows = _rows(values, offsets)
    designated = min(range(len(rows)), key=lambda p: (rows[p][0], p))
    wait, t_sync, chosen = _grid_scan_row(rows, designated, None)
    return t_sync, wait, np.asarray(chosen, dtype=np.int64) + 1


def fullgridscan(values, offsets):
    """FullGridScan: Algorithm 1 with every row designated in turn (line 4 skipped).

    Exact: the optimum's min(Z*) is some element x, and with x designated the
    first-at-or-after choice in every other row keeps max(Z) <= max(Z*).
    """
    rows = _rows(values, offsets)
    best = None
    for designated in range(len(rows)):
        best = _grid_scan_row(rows, designated, best)
    return _result(rows, best[1])
