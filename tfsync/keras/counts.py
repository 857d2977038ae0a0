"""This worker's contribution counts over a training run that runs several engines.

One ``fit`` may run more than one engine: auto mode starts a new one at each
switch, and an elastic job a new one after every reset (and its training
spans several ``fit`` calls).  :class:`RunCounts` adds each engine's counts to
the run's once, when it ends (:meth:`RunCounts.fold`), carries the totals of
an epoch it interrupted into that epoch's logs (or, after a reset, the logs of
the epoch that follows), and says what changed since the last elastic commit.

An elastic job also counts the work a reset undid (:data:`REDONE`): ``steps_redone``, this
worker's steps after the last commit, whose effect on the weights the reset's restore
discarded and which the job trains again, and ``samples_redone``, the rows they took (known
where the data comes from ``tfsync.shard(..., resume=state)`` or ``tfsync.shard_dataset``).
Their contributions stay counted as they settled (applied, mostly): ``produced`` = ``applied``
+ ``compensated`` + ``dropped`` + ``rejected`` + ``lost`` holds as before; redone says how
much of it a reset threw away.
"""

from tfsync._data import REDONE
from tfsync.engine.tally import COUNTS, SETTLED

ALL = COUNTS + REDONE


def _zeros(keys=COUNTS):
    return dict.fromkeys(keys, 0)


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
        self._committed = _zeros(ALL)  # this worker's counts at the last elastic commit
        self._redone = _zeros(REDONE)  # over the run
        self._redone_pending = _zeros(REDONE)  # since the last epoch's logs

    def redo(self, steps: int, samples: int):
        """A reset undid this worker's ``steps`` since the last commit (``samples`` rows)."""
        for key, n in zip(REDONE, (steps, samples), strict=True):
            self._redone[key] += int(n)
            self._redone_pending[key] += int(n)

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

    def counts(self, engine, redone=False) -> dict:
        """The run's counts: the ended engines' and ``engine``'s (the running one, or None); with
        ``redone``, the :data:`REDONE` counts too."""
        now = engine.counts if engine is not None and engine is not self._folded else _zeros()
        counts = {k: self._ended[k] + now[k] for k in COUNTS}
        return {**counts, **self._redone} if redone else counts

    def epoch_totals(self, engine, redone=False) -> dict:
        """The epoch's totals for its logs: ``engine``'s and those of the engines that ended since
        the last call (with ``redone``, the :data:`REDONE` counts since the last call too)."""
        pending, self._pending = self._pending, None
        totals = _add(pending, engine.totals)
        if redone:
            totals = {**totals, **self._redone_pending}
            self._redone_pending = _zeros(REDONE)
        return totals

    def since_commit(self, engine, record=True) -> dict:
        """This worker's settled contributions since the last commit (one in flight is counted at
        the commit after its round) and its :data:`REDONE` counts, recorded as committed now
        (``record=False``: not yet; :meth:`record_commit` does when the commit is made)."""
        counts = self.counts(engine, redone=True)
        counts["produced"] = sum(counts[k] for k in SETTLED)
        delta = {k: counts[k] - self._committed[k] for k in ALL}
        if record:
            self._committed = counts
        return delta

    def record_commit(self, delta: dict):
        """The commit of ``delta`` (:meth:`since_commit` with ``record=False``) was made."""
        self._committed = {k: self._committed[k] + delta[k] for k in ALL}


__all__ = ["ALL", "REDONE", "RunCounts"]
