"""An open round whose *sum* is checked instead of each contribution (BSP's gradients).

The round asks the collective for the plain sum (Horovod makes no post-scale pass) and
divides it by its number of contributions ``d`` with one pass that also says whether it is
finite (:func:`tfsync.ops.scale_all_finite`, the step protocol's ``scale_sum``), so a finite
round costs no pass of its own.  Every rank receives the same sum, so every rank sees a
non-finite one, and the round is redone: a rank whose own contribution is not finite (or,
under ``compression=``, beyond its wire type's range: ``in_range``) sends zeros and a
``rejected`` row, the others theirs again; a redone sum still not finite came from finite
contributions whose sum overflowed, and the round is rejected whole (zeros, every row
``rejected``).  What :func:`checked_round` returns as ``after_sum`` is what the engine counts
when it applies the round (:attr:`tfsync.engine.rounds.RoundResult.rejected_after_sum`).
"""

import numpy as np

from tfsync.engine.wire.layout import META_COLUMNS, REJECTED


def _summed(collective, payload, meta, size, sum_check):
    """An open round's plain sum (no post-scale in Horovod) divided by its number of
    contributions ``d`` in one checked pass: ``(total, meta, finite per tensor)``."""
    total, wire = collective(payload, meta, divisor=1)
    meta = np.asarray(wire, np.float64).reshape(size, META_COLUMNS)
    d = int(np.count_nonzero(meta[:, 0]))
    total, finite = sum_check.scale_sum(total, max(d, 1))
    return list(total), meta, np.asarray(finite, bool)


def checked_round(collective, payload, meta, rank: int, size: int, sum_check, in_range=None):
    """One open round over ``collective`` whose sum is checked (the module docstring):
    ``(payload, total, meta, after_sum)``.

    ``sum_check``: the step protocol's ``scale_sum(total, d) -> (total / d, finite)``,
    ``finite(payload)`` and ``absent()``; ``in_range(payload)``: under ``compression=``, whether
    each tensor fits the wire type (None: no compression).  A finite sum is the round (every
    rank sees the same sum, so every rank takes this branch).  ``after_sum``: ``("own",
    tensors)`` when this rank's contribution was rejected, ``("sum", tensors)`` when the round
    was, else None.
    """
    sent = meta
    total, meta, finite = _summed(collective, payload, sent, size, sum_check)
    if finite.all():
        return payload, total, meta, None
    after_sum = None
    if sent[rank, 0] == 1.0:
        ok = np.asarray(sum_check.finite(payload), bool)
        if in_range is not None and ok.all():  # (finite, but beyond the wire type's range)
            ok = ok & in_range(payload)
        bad = np.flatnonzero(~ok).tolist()
        if bad:
            after_sum = ("own", bad)
            payload = sum_check.absent()
            sent = sent.copy()
            sent[rank, 0], sent[rank, REJECTED] = 0.0, 1.0
    total, meta, finite = _summed(collective, payload, sent, size, sum_check)
    if not finite.all():
        meta = meta.copy()
        if after_sum is None and meta[rank, 0] == 1.0:
            after_sum = ("sum", np.flatnonzero(~finite).tolist())
        meta[:, REJECTED] += meta[:, 0]
        meta[:, 0] = 0.0
        payload = total = sum_check.absent()
    return payload, list(total), meta, after_sum


__all__ = ["checked_round"]
