"""Elastic training's commits under ``SyncCallback`` (:class:`ElasticCommits`).

Given ``elastic=state`` (a :class:`tfsync.elastic.KerasState`), the callback
commits the state at every epoch end, after that epoch's rounds: the job's
contributions since the last commit summed over the workers, the next epoch,
and the model (``state.save()``: host-memory copies).  The launcher's notices
of changed hosts are checked when the next epoch begins, after every
callback's epoch end (checkpoints, evaluations).  At a reset
(:func:`tfsync.elastic.run`) :meth:`ElasticCommits.reset` ends the running
engine through the callback's public seam,
:meth:`SyncCallback.abandon_engine <tfsync.keras.SyncCallback.abandon_engine>`,
which counts its contributions in flight as ``lost``.
"""

import os


class ElasticCommits:
    """Commits and resets for one callback of an elastic job (see the module docstring)."""

    def __init__(self, state, callback):
        from tfsync.elastic import KerasState  # (Horovod's elastic module: only when asked for)

        if not isinstance(state, KerasState):
            raise TypeError(
                f"tfsync.keras.SyncCallback: elastic must be a tfsync.elastic.KerasState or None, got "
                f"{type(state).__name__}; pass elastic=tfsync.elastic.KerasState(model)"
            )
        self.state, self.callback = state, callback
        self._hosts_check_due = False  # a commit was made, the launcher's notices not yet checked
        state.register(self)

    @property
    def frontend(self):
        return self.callback.frontend

    def trace_name(self, inner=None) -> str:
        """Where each membership's engines trace under ``trace_dir``: ``reset<k>[/inner]``."""
        name = f"reset{self.state.resets}"
        return os.path.join(name, inner) if inner else name

    def begin(self, model, mode):
        """Before a ``fit`` of an elastic job (first, or after a reset): the state's model, and a
        mode (a policy or ``tfsync.Auto``) that works with this membership's size (every rank
        refuses alike, before any collective)."""
        state, size = self.state, self.frontend.cluster.size()
        if model is not state.model:
            raise ValueError(
                "tfsync.keras.SyncCallback: elastic= holds another model than the one being fit; build "
                "the state on the model you train: tfsync.elastic.KerasState(model)"
            )
        try:
            mode.validate(size)
        except ValueError as exc:
            raise ValueError(
                f"tfsync.elastic: the job has {size} workers now (after {state.resets} resets) and the mode "
                f"cannot run on them: {exc}. Launch with horovodrun --min-np at least the smallest number "
                f"of workers the mode takes, or choose settings that rescale (PSP's min_contributions=None "
                f"waits for size - 1)"
            ) from exc
        self._hosts_check_due = False  # (the state was just synchronized: nothing older to check)

    def epoch_begin(self):
        """The launcher's notices since the last commit (collective: rank 0's, broadcast): if it
        changed the hosts, Horovod's ``HostsUpdatedInterrupt`` (:func:`tfsync.elastic.run` resets,
        the state just committed)."""
        if self._hosts_check_due:
            self._hosts_check_due = False
            self.state.check_host_updates()

    def epoch_end(self, epoch: int, delta: dict):
        """Commit at an epoch's end (collective): ``delta``, this worker's contributions since the
        last commit, summed over the workers into the state's counts; the next epoch; the model."""
        keys = list(delta)
        mean = self.frontend.average(
            [float(delta[k]) for k in keys],
            "tfsync.elastic.counts",
            "every worker's contributions since the last commit, summed for the job",
        )
        size = self.frontend.cluster.size()
        for k, m in zip(keys, mean, strict=True):
            self.state.counts[k] += int(round(float(m) * size))
        self.state.epoch = epoch + 1
        self.state.save()
        self._hosts_check_due = True

    def reset(self, reason: str) -> int:
        """A reset (Horovod already shut down): the callback abandons its engine; returns how many
        of this worker's contributions were lost in flight."""
        self._hosts_check_due = False
        return self.callback.abandon_engine(reason)

    @property
    def running(self) -> bool:
        """Whether the callback's engine runs (the state's collectives then queue behind its rounds)."""
        return self.frontend.running

    def collective(self, fn, name, purpose):
        """``fn(cluster)`` after the running engine's rounds, bounded by the wait bound."""
        frontend = self.frontend
        return frontend.collective(lambda: fn(frontend.cluster), name, purpose)


__all__ = ["ElasticCommits"]
