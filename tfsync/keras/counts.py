"""This worker's contribution counts over a training run that runs several engines.

One ``fit`` may run more than one engine: auto mode starts a new one at each
switch, and an elastic job a new one after every reset (and its training
spans several ``fit`` calls).  :class:`RunCounts` adds each engine's counts to
the run's once, when it ends (:meth:`RunCounts.fold`), carries the totals of
an epoch it interrupted into that epoch's logs (or, after a reset, the logs of
the epoch that follows), and says what changed since the last elastic commit.
"""

from tfsync.engine.tally import COUNTS, SETTLED


def _zeros():
    return dict.fromkeys(COUNTS, 0)


def _add(a, b):
    return b if a is None else {k: a[k] + b[k] for k in b}


class RunCounts:
    """The counts of every engine of a run, the running one included."""

    def __init__(self):
        self.restart()

    def restart(self):
        """A new run: nothing counted (``fit`` without ``elastic=``; an elastic job counts on)."""
        self._ended = _zeros()  # the engines that ended
        self._folded = None  # the last engine whose counts are in _ended
        self._pending = None  # the totals of engines that ended since the last epoch's logs
        self._committed = _zeros()  # this worker's counts at the last elastic commit

    def fold(self, engine, epoch_totals=True):
        """``engine`` ended: its counts join the run's, once; with ``epoch_totals``, its epoch
        totals join the logs of the next epoch end (a switch mid-epoch, a reset)."""
        if engine is None or engine is self._folded:
            return
        for k in COUNTS:
            self._ended[k] += engine.counts[k]
        if epoch_totals:
            self._pending = _add(self._pending, engine.totals)
        self._folded = engine

    def counts(self, engine) -> dict:
        """The run's counts: the ended engines' and ``engine``'s (the running one, or None)."""
        now = engine.counts if engine is not None and engine is not self._folded else _zeros()
        return {k: self._ended[k] + now[k] for k in COUNTS}

    def epoch_totals(self, engine) -> dict:
        """The epoch's totals for its logs: ``engine``'s and those of the engines that ended since
        the last call."""
        pending, self._pending = self._pending, None
        return _add(pending, engine.totals)

    def since_commit(self, engine) -> dict:
        """This worker's settled contributions since the last commit (one in flight is counted at
        the commit after its round), recorded as committed now."""
        counts = self.counts(engine)
        counts["produced"] = sum(counts[k] for k in SETTLED)
        delta = {k: counts[k] - self._committed[k] for k in COUNTS}
        self._committed = counts
        return delta


__all__ = ["RunCounts"]
