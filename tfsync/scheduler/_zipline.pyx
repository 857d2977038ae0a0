# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled ZipLine kernels: the ElasticBSP barrier decision (Zhao et al., Section 5).

This module is the fast twin of :mod:`tfsync.scheduler._reference` and exposes
the same names with the same contract.  Callers go through
:func:`tfsync.scheduler.zipline`, which validates the input; the kernels here
assume it was validated:

* ``values``: the predicted end times of all workers, row after row (CSR
  layout), ``float64`` or ``int64``, finite, each row non-decreasing;
* ``offsets``: ``int64``, ``n + 1`` entries, ``offsets[0] == 0``, row ``p`` is
  ``values[offsets[p]:offsets[p + 1]]`` and is not empty.

Every kernel returns ``(t_sync, wait, iterations)``.  The exact algorithms
(everything but ``gridscan``) return the optimum of Problem 1 with the earliest
``t_sync`` on ties (Corollary 1) and the canonical choice per worker: its
latest end time at or before ``t_sync``, so ``iterations[p]`` is the 1-based
index of that end time (the number of iterations worker ``p`` completes
before the barrier).  ``gridscan`` is the paper's heuristic and returns the
set it found.

Algorithms (Section 5):

* ``zipline``: Algorithm 2.  Sort the merged timeline Omega, keep one slot per
  worker, scan left to right, and after each step search the n slots for
  min(Z): O(R n^2).
* ``zipline_opt``: Section 5.3.1.  Z is kept in arrival (= time) order, so
  min(Z) is its head.  When the head has the new element's colour it is popped
  in O(1) and d_Z is evaluated; otherwise the same-coloured element is found
  by a linear search and removed by a shift, and d_Z is not evaluated
  (Theorem 3: it cannot improve).
* ``optbs``: Section 5.3.2, ZipLineOptBS.  As ``zipline_opt``, but the element
  to remove is not searched for in Z: the paper reads its timestamp from the
  matrix M and finds it by binary search; here M records the element's
  position in Z when it entered (elements never move), so the lookup is a
  single read and no binary search runs.  Removal is lazy (a tombstone that
  the head skips) rather than the array shift the paper leaves implicit, so a
  step costs O(1) amortized, not O(n).
* ``gridscan``: Algorithm 1 (baseline heuristic), O(R^2 n).
* ``fullgridscan``: Algorithm 1 with every row designated in turn, O(R^2 n^2).

Omega is sorted by a bucket sort on an order-preserving integer key
(O(n R) expected; buckets that fill up fall back to a stable merge sort), which
is what keeps the whole decision within a small factor of ``numpy.sort``.
"""
import numpy as np

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memmove

ctypedef fused stamp_t:
    double
    int64_t


cdef struct Entry:
    uint64_t key      # order-preserving image of the timestamp
    int32_t worker    # p (0-based here; the public API reports workers 0-based too)
    int32_t index     # i, 0-based position in the worker's row


cdef uint64_t SIGN_BIT = (<uint64_t>1) << 63
# Buckets at most this full are sorted by insertion; fuller ones by merge sort,
# so adversarially clustered stamps cost O(N log N), never O(N^2).
cdef Py_ssize_t INSERTION_SORT_MAX = 24


cdef inline uint64_t key_of(stamp_t value) noexcept nogil:
    """An unsigned key whose order is the numeric order of ``value``."""
    cdef uint64_t bits
    cdef double as_double
    if stamp_t is double:
        as_double = value + 0.0  # folds -0.0 into +0.0: equal stamps, equal keys
        memcpy(&bits, &as_double, 8)
        if bits & SIGN_BIT:
            return ~bits
        return bits | SIGN_BIT
    else:
        return (<uint64_t>value) ^ SIGN_BIT


cdef inline bint entry_less(const Entry* a, const Entry* b) noexcept nogil:
    """Lexicographic (timestamp, worker, index): the paper's order of Omega."""
    if a.key != b.key:
        return a.key < b.key
    if a.worker != b.worker:
        return a.worker < b.worker
    return a.index < b.index


cdef void merge_sort(Entry* items, Entry* scratch, Py_ssize_t count) noexcept nogil:
    """Bottom-up merge sort by (key, worker, index)."""
    cdef Py_ssize_t width = 1, lo, mid, hi, i, j, k
    cdef Entry* src = items
    cdef Entry* dst = scratch
    cdef Entry* swap
    while width < count:
        lo = 0
        while lo < count:
            mid = lo + width
            if mid > count:
                mid = count
            hi = lo + 2 * width
            if hi > count:
                hi = count
            i = lo
            j = mid
            k = lo
            while i < mid and j < hi:
                if entry_less(&src[j], &src[i]):
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < hi:
                dst[k] = src[j]
                j += 1
                k += 1
            lo = hi
        swap = src
        src = dst
        dst = swap
        width *= 2
    if src != items:
        memcpy(items, src, count * sizeof(Entry))


cdef int build_omega(const stamp_t[::1] values, const int64_t[::1] offsets,
                     Entry* omega) noexcept nogil:
    """Fill ``omega`` with all stamps sorted by (timestamp, worker, index).

    Returns 0, or -1 when out of memory.  Both in-bucket sorts compare the full
    (key, worker, index) triple, so the result does not depend on the scatter
    order, which is therefore free to follow the data: column by column, since
    the k-th end times of all workers lie close together in time and a
    column-wise scatter writes to a narrow, cache-resident band of buckets.
    """
    cdef Py_ssize_t n = offsets.shape[0] - 1
    cdef Py_ssize_t total = values.shape[0]
    cdef Py_ssize_t n_buckets = total  # about one stamp per bucket
    cdef Py_ssize_t p, e, b, start, stop, size, i, j, column, longest = 0
    cdef double low, high, scale, first, last
    cdef int32_t* bucket_start
    cdef Entry* scratch
    cdef Entry item

    # Rows are sorted, so the extremes are among the first and last elements.
    low = <double>values[offsets[0]]
    high = <double>values[offsets[1] - 1]
    for p in range(n):
        first = <double>values[offsets[p]]
        last = <double>values[offsets[p + 1] - 1]
        if first < low:
            low = first
        if last > high:
            high = last
        if offsets[p + 1] - offsets[p] > longest:
            longest = offsets[p + 1] - offsets[p]
    # (value - low) * scale is monotone in value, so bucket order is time order.
    scale = 0.0
    if high > low:
        scale = (<double>n_buckets) / (high - low)

    bucket_start = <int32_t*>malloc((n_buckets + 1) * sizeof(int32_t))
    if bucket_start == NULL:
        return -1
    for b in range(n_buckets + 1):
        bucket_start[b] = 0
    for e in range(total):
        b = <Py_ssize_t>((<double>values[e] - low) * scale)
        if b >= n_buckets:
            b = n_buckets - 1
        bucket_start[b + 1] += 1
    for b in range(n_buckets):
        bucket_start[b + 1] += bucket_start[b]
    # Scatter, using bucket_start[b] as the fill cursor of bucket b.
    for column in range(longest):
        for p in range(n):
            e = offsets[p] + column
            if e >= offsets[p + 1]:
                continue
            b = <Py_ssize_t>((<double>values[e] - low) * scale)
            if b >= n_buckets:
                b = n_buckets - 1
            i = bucket_start[b]
            omega[i].key = key_of(values[e])
            omega[i].worker = <int32_t>p
            omega[i].index = <int32_t>column
            bucket_start[b] = <int32_t>(i + 1)
    # Now bucket_start[b] is the end of bucket b and its start is the end of b - 1.
    scratch = NULL
    start = 0
    for b in range(n_buckets):
        stop = bucket_start[b]
        size = stop - start
        if size > INSERTION_SORT_MAX:
            if scratch == NULL:
                scratch = <Entry*>malloc(total * sizeof(Entry))
                if scratch == NULL:
                    free(bucket_start)
                    return -1
            merge_sort(omega + start, scratch, size)
        elif size > 1:
            for i in range(start + 1, stop):
                item = omega[i]
                j = i - 1
                while j >= start and (omega[j].key > item.key or (
                        omega[j].key == item.key and entry_less(&item, &omega[j]))):
                    omega[j + 1] = omega[j]
                    j -= 1
                omega[j + 1] = item
        start = stop
    free(bucket_start)
    free(scratch)
    return 0


cdef inline stamp_t stamp_at(const stamp_t[::1] values, const Entry* item) noexcept nogil:
    """The timestamp of ``item``, decoded from its key (no trip back to ``values``).

    ``values`` only selects the fused specialization.
    """
    cdef uint64_t bits
    cdef double as_double
    if stamp_t is double:
        if item.key & SIGN_BIT:
            bits = item.key ^ SIGN_BIT
        else:
            bits = ~item.key
        memcpy(&as_double, &bits, 8)
        return as_double
    else:
        return <int64_t>(item.key ^ SIGN_BIT)


cdef stamp_t canonical_iterations(const stamp_t[::1] values, const int64_t[::1] offsets,
                                  stamp_t t_sync, int64_t[::1] iterations) noexcept nogil:
    """Per worker, the count of its end times <= t_sync; returns the earliest chosen stamp."""
    cdef Py_ssize_t n = offsets.shape[0] - 1
    cdef Py_ssize_t p, lo, hi, mid
    cdef stamp_t earliest = t_sync
    for p in range(n):
        # upper bound of t_sync in the sorted row
        lo = offsets[p]
        hi = offsets[p + 1]
        while lo < hi:
            mid = (lo + hi) >> 1
            if values[mid] <= t_sync:
                lo = mid + 1
            else:
                hi = mid
        iterations[p] = lo - offsets[p]
        if lo > offsets[p] and values[lo - 1] < earliest:
            earliest = values[lo - 1]
    return earliest


cdef object finish(const stamp_t[::1] values, const int64_t[::1] offsets, stamp_t t_sync):
    iterations = np.empty(offsets.shape[0] - 1, dtype=np.int64)
    cdef int64_t[::1] iterations_view = iterations
    cdef stamp_t earliest
    with nogil:
        earliest = canonical_iterations(values, offsets, t_sync, iterations_view)
    return t_sync, t_sync - earliest, iterations


cdef Entry* omega_or_raise(const stamp_t[::1] values, const int64_t[::1] offsets) except NULL:
    cdef Entry* omega = <Entry*>malloc(values.shape[0] * sizeof(Entry))
    cdef int status = -1
    if omega != NULL:
        with nogil:
            status = build_omega(values, offsets, omega)
    if status != 0:
        free(omega)
        raise MemoryError(f"ZipLine: cannot allocate the merged timeline of {values.shape[0]} stamps")
    return omega


def zipline(const stamp_t[::1] values, const int64_t[::1] offsets):
    """ZipLine (Algorithm 2): one slot per worker, O(n) search for min(Z) per step."""
    cdef Py_ssize_t n = offsets.shape[0] - 1
    cdef Py_ssize_t total = values.shape[0]
    cdef Entry* omega = omega_or_raise(values, offsets)
    cdef stamp_t* slot = <stamp_t*>malloc(n * sizeof(stamp_t))
    cdef char* filled = <char*>malloc(n)
    cdef Py_ssize_t r, q, count = 0
    cdef stamp_t now, smallest, wait, best_wait = 0, best_sync = 0
    cdef bint found = False
    if slot == NULL or filled == NULL:
        free(omega); free(slot); free(filled)
        raise MemoryError("ZipLine: cannot allocate Z")
    with nogil:
        for q in range(n):
            filled[q] = 0
        for r in range(total):
            now = stamp_at(values, &omega[r])
            q = omega[r].worker
            slot[q] = now          # replaces the element of Z with the same colour
            if not filled[q]:
                filled[q] = 1
                count += 1
            if count < n:
                continue
            smallest = slot[0]
            for q in range(1, n):
                if slot[q] < smallest:
                    smallest = slot[q]
            wait = now - smallest
            if not found or wait < best_wait:  # strict: the earliest optimum wins
                best_wait = wait
                best_sync = now
                found = True
    free(omega); free(slot); free(filled)
    return finish(values, offsets, best_sync)


def zipline_opt(const stamp_t[::1] values, const int64_t[::1] offsets):
    """ZipLineOpt (Section 5.3.1): Z in time order, O(1) when the head has the new colour."""
    cdef Py_ssize_t n = offsets.shape[0] - 1
    cdef Py_ssize_t total = values.shape[0]
    cdef Entry* omega = omega_or_raise(values, offsets)
    # Z lives in buffer[head:tail]; every element is appended once, so total suffices.
    cdef int32_t* buffer = <int32_t*>malloc(total * sizeof(int32_t))  # positions in omega
    cdef char* present = <char*>malloc(n)
    cdef Py_ssize_t r, q, k, head = 0, tail = 0, count = 0
    cdef int32_t colour
    cdef stamp_t now, wait, best_wait = 0, best_sync = 0
    cdef bint found = False, evaluate
    if buffer == NULL or present == NULL:
        free(omega); free(buffer); free(present)
        raise MemoryError("ZipLineOpt: cannot allocate Z")
    with nogil:
        for q in range(n):
            present[q] = 0
        for r in range(total):
            colour = omega[r].worker
            now = stamp_at(values, &omega[r])
            evaluate = False
            if not present[colour]:
                present[colour] = 1
                count += 1
                evaluate = count == n       # Z just became a full candidate
            elif omega[buffer[head]].worker == colour:
                head += 1                   # case (i): the oldest element leaves
                evaluate = count == n
            else:
                # case (ii): find the same colour and close the gap; Theorem 3
                # says this candidate is no better than the last one.
                k = head + 1
                while omega[buffer[k]].worker != colour:
                    k += 1
                memmove(&buffer[k], &buffer[k + 1], (tail - k - 1) * sizeof(int32_t))
                tail -= 1
            buffer[tail] = <int32_t>r
            tail += 1
            if evaluate:
                wait = now - stamp_at(values, &omega[buffer[head]])
                if not found or wait < best_wait:
                    best_wait = wait
                    best_sync = now
                    found = True
    free(omega); free(buffer); free(present)
    return finish(values, offsets, best_sync)


def optbs(const stamp_t[::1] values, const int64_t[::1] offsets):
    """ZipLineOptBS (Section 5.3.2): the replaced element is located through M, not searched."""
    cdef Py_ssize_t n = offsets.shape[0] - 1
    cdef Py_ssize_t total = values.shape[0]
    cdef Entry* omega = omega_or_raise(values, offsets)
    # Z is omega[head:r] minus tombstones (elements replaced by a later element
    # of the same worker).  Elements never move, so the place in Z of each
    # worker's current element, recorded in M when it entered, stays valid:
    # the lookup the paper does by binary search is a single read here.
    cdef char* tombstone = <char*>malloc(total)
    cdef int64_t* position_in_z = <int64_t*>malloc(n * sizeof(int64_t))
    cdef Py_ssize_t r, q, previous, head = 0, count = 0
    cdef stamp_t now, wait, best_wait = 0, best_sync = 0
    cdef bint found = False, evaluate
    if tombstone == NULL or position_in_z == NULL:
        free(omega); free(tombstone); free(position_in_z)
        raise MemoryError("ZipLineOptBS: cannot allocate Z")
    with nogil:
        for q in range(n):
            position_in_z[q] = -1
        for r in range(total):
            tombstone[r] = 0
            q = omega[r].worker
            previous = position_in_z[q]
            position_in_z[q] = r
            evaluate = False
            if previous < 0:
                count += 1
                evaluate = count == n       # Z just became a full candidate
            else:
                tombstone[previous] = 1
                if previous == head:        # case (i): min(Z) leaves
                    while tombstone[head]:
                        head += 1
                    evaluate = count == n
                # case (ii): min(Z) stays, so d_Z cannot improve (Theorem 3)
            if evaluate:
                now = stamp_at(values, &omega[r])
                wait = now - stamp_at(values, &omega[head])
                if not found or wait < best_wait:   # strict: the earliest optimum wins
                    best_wait = wait
                    best_sync = now
                    found = True
    free(omega); free(tombstone); free(position_in_z)
    return finish(values, offsets, best_sync)


cdef inline Py_ssize_t first_at_or_after(const stamp_t[::1] values, Py_ssize_t start,
                                         Py_ssize_t stop, stamp_t target) noexcept nogil:
    """Index of the first element >= target in a sorted row, else its last index.

    A linear scan, as in the paper's Algorithm 1 (inner loop over a row's R elements).
    """
    cdef Py_ssize_t k
    for k in range(start, stop):
        if values[k] >= target:
            return k
    return stop - 1


cdef void grid_scan_row(const stamp_t[::1] values, const int64_t[::1] offsets,
                        Py_ssize_t designated, int64_t* chosen, int64_t* best_chosen,
                        stamp_t* best_wait, stamp_t* best_sync, bint* found) noexcept nogil:
    """Algorithm 1 on one designated row: each of its elements is taken as min(Z).

    For every other row the element closest to the designated one from above
    is chosen; with the designated element as the intended min(Z) this is the
    choice that keeps max(Z) smallest.
    """
    cdef Py_ssize_t n = offsets.shape[0] - 1
    cdef Py_ssize_t e, p, k
    cdef stamp_t anchor, smallest, largest, wait
    for e in range(offsets[designated], offsets[designated + 1]):
        anchor = values[e]
        smallest = anchor
        largest = anchor
        for p in range(n):
            if p == designated:
                k = e
            else:
                k = first_at_or_after(values, offsets[p], offsets[p + 1], anchor)
            chosen[p] = k
            if values[k] > largest:
                largest = values[k]
            if values[k] < smallest:
                smallest = values[k]
        wait = largest - smallest
        if not found[0] or wait < best_wait[0] or (wait == best_wait[0] and largest < best_sync[0]):
            found[0] = True
            best_wait[0] = wait
            best_sync[0] = largest
            memcpy(best_chosen, chosen, n * sizeof(int64_t))


cdef object grid_scan(const stamp_t[::1] values, const int64_t[::1] offsets, bint every_row):
    cdef Py_ssize_t n = offsets.shape[0] - 1
    cdef Py_ssize_t p, designated = 0
    cdef int64_t* chosen = <int64_t*>malloc(n * sizeof(int64_t))
    best_chosen = np.empty(n, dtype=np.int64)
    cdef int64_t[::1] best_view = best_chosen
    cdef stamp_t best_wait = 0, best_sync = 0
    cdef bint found = False
    if chosen == NULL:
        raise MemoryError("GridScan: cannot allocate Z")
    with nogil:
        if every_row:
            for p in range(n):
                grid_scan_row(values, offsets, p, chosen, &best_view[0], &best_wait, &best_sync, &found)
        else:
            # Line 4: the designated row is the worker with the earliest first stamp.
            for p in range(1, n):
                if values[offsets[p]] < values[offsets[designated]]:
                    designated = p
            grid_scan_row(values, offsets, designated, chosen, &best_view[0], &best_wait, &best_sync, &found)
        for p in range(n):
            best_view[p] = best_view[p] - offsets[p] + 1   # flat index -> 1-based iteration
    free(chosen)
    return best_sync, best_wait, best_chosen


def gridscan(const stamp_t[::1] values, const int64_t[::1] offsets):
    """GridScan (Algorithm 1): the baseline heuristic; returns the set it found."""
    return grid_scan(values, offsets, False)


def fullgridscan(const stamp_t[::1] values, const int64_t[::1] offsets):
    """FullGridScan: Algorithm 1 with every row designated in turn (exact)."""
    cdef stamp_t t_sync = grid_scan(values, offsets, True)[0]
    return finish(values, offsets, t_sync)
