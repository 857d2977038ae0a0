"""The ElasticBSP barrier scheduler: predict, then ZipLine (Zhao et al., Sections 4-5).

ElasticBSP replaces BSP's barrier after every step with one at the time that
minimizes the workers' waiting.  :func:`predict_end_times` turns each worker's
push timestamps into its next ``R`` iteration end times (Section 4);
:func:`zipline` picks one end time per worker so that their spread is
smallest, preferring the earliest such barrier (Problem 1, Corollary 1), with
ZipLine, ZipLineOpt, ZipLineOptBS or the GridScan/FullGridScan baselines
(Section 5).

The kernels are compiled (Cython, :mod:`._zipline`) with a plain-Python twin
(:mod:`._reference`); which one runs is chosen in :mod:`._backend`
(``TFSYNC_SCHEDULER_IMPL=compiled|reference`` or ``implementation=``).  This
package is pure NumPy/Cython: it never imports TensorFlow.

Example:
    >>> from tfsync.scheduler import predict_end_times, zipline
    >>> ends = predict_end_times([[0, 1000], [0, 1300], [0, 1500]], R=15)
    >>> result = zipline(ends)
    >>> result.t_sync, result.iterations.tolist(), result.wait
    (9100, [8, 6, 5], 100)
"""

from ._api import ALGORITHMS, EXACT_ALGORITHMS, ZipLineResult, zipline
from ._backend import ENV_VAR, IMPLEMENTATIONS, implementation_name
from ._predictor import predict_end_times

__all__ = [
    "ALGORITHMS",
    "ENV_VAR",
    "EXACT_ALGORITHMS",
    "IMPLEMENTATIONS",
    "ZipLineResult",
    "implementation_name",
    "predict_end_times",
    "zipline",
]
