"""Elastic training's commits under ``SyncCallback`` (:class:`ElasticCommits`).

Given ``elastic=state`` (a :class:`tfsync.elastic.KerasState`), the callback
commits the state at every epoch end, after that epoch's rounds, and between
epoch ends every ``state.commit_every_steps`` steps (or ``commit_every_s``
seconds; :class:`CommitSchedule`): the job's contributions since the last
commit summed over the workers, the data position (the next epoch and sample
0 at an epoch end; ``state.sample``, the samples of the epoch the job has
trained on, at a step), and the model (``state.save()``: host-memory copies).

A commit is a collective: every worker makes it at the same step, after the
rounds it queued before (its allreduce runs on the engine's exchange thread,
behind them).  A commit within an epoch needs identical replicas, so it is
made at a step after which every worker is at rest
(:meth:`SyncEngine.at_rest <tfsync.engine.SyncEngine.at_rest>`: every round
it pushed applied, nothing held, no outer period under way), which the
commit's own allreduce checks; a due commit at which some worker is not at
rest (a late contribution held, a block still arriving) is made at the next
step at which all are.  Modes that let a worker go on before its round
completes (SSP, DSSP, ElasticBSP, DC-S3GD, streaming DiLoCo with ``mixing``)
have no such step and commit at epoch ends only
(:meth:`SyncEngine.rest_steps <tfsync.engine.SyncEngine.rest_steps>`); Local
SGD and DiLoCo are at rest after each outer step, where their commits go.  It
also needs the data position, which the data helpers record
(:func:`tfsync.shard` and :func:`tfsync.shard_dataset` given ``resume=state``:
one ``fit`` per epoch, from the committed sample).

The launcher's notices of changed hosts are checked after a commit: when the
next epoch begins (after every callback's epoch end: checkpoints,
evaluations), or at the next step after a commit within an epoch.  At a reset
(:func:`tfsync.elastic.run`) :meth:`ElasticCommits.reset` counts the steps
since the last commit as redone (their samples too, with a data plan) and
ends the running engine through the callback's public seam,
:meth:`SyncCallback.abandon_engine <tfsync.keras.SyncCallback.abandon_engine>`,
which counts its contributions in flight as ``lost``.
"""

import logging
import math
import os
import time

from tfsync._data import samples_redone

log = logging.getLogger("tfsync.elastic")

# with commit_every_s and no step interval to start from, the first commit of a fit is due after
# this many steps: the step time it measures sets the next commit's step
FIRST_TIMED_COMMIT_STEPS = 10
AT_REST = 1.0 - 1e-9  # the mean of every worker's at-rest flag (1 or 0) when all are at rest


class CommitSchedule:
    """At which steps of a ``fit`` the commits within its epoch are due (pure arithmetic).

    Args:
        every_steps: commit every this many steps (None: by time only).
        every_s: commit once this many seconds have passed since the last commit (None: by
            steps only), converted to steps by the workers' mean step time since the last
            commit, so every worker picks the same step.
        period: commits are made only at multiples of this many steps (an outer step's
            ``inner_steps``; 1 otherwise).
    """

    def __init__(self, every_steps=None, every_s=None, period=1):
        if every_steps is None and every_s is None:
            raise ValueError("CommitSchedule: pass every_steps, every_s or both")
        self.every_steps, self.every_s, self.period = every_steps, every_s, int(period)
        first = [n for n in (every_steps, FIRST_TIMED_COMMIT_STEPS if every_s is not None else None) if n]
        self.due = self._round_up(min(first))

    def _round_up(self, step: int) -> int:
        return max(self.period, -(-int(step) // self.period) * self.period)

    def is_due(self, step: int) -> bool:
        """Whether a commit is due after ``step`` steps of the fit (made or, where some worker is not
        at rest, tried again at the next multiple of the period)."""
        return step >= self.due and step % self.period == 0

    def committed(self, step: int, steps_since: int, mean_elapsed_s: float) -> int:
        """A commit was made after ``step`` steps, ``steps_since`` of them since the last commit,
        which took ``mean_elapsed_s`` seconds (the workers' mean): returns the next due step."""
        interval = [self.every_steps] if self.every_steps is not None else []
        if self.every_s is not None:
            if mean_elapsed_s > 0 and steps_since > 0:
                interval.append(max(1, math.floor(self.every_s * steps_since / mean_elapsed_s)))
            else:
                interval.append(self.every_steps or FIRST_TIMED_COMMIT_STEPS)
        self.due = self._round_up(step + min(interval))
        return self.due


def rest_period(policies):
    """The steps between the points at which every worker of each of ``policies`` (the modes a
    fit may run) is at rest, or None where one of them has none."""
    from tfsync.engine import SyncEngine

    periods = [SyncEngine.rest_steps(p) for p in policies]
    if any(p is None for p in periods):
        return None
    return math.lcm(*periods)


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
        self.plan = None  # the running fit's data plan (tfsync._data.EpochPlan), or None
        self.schedule = None  # its commits within the epoch (CommitSchedule), or None
        self.steps = 0  # steps of the running fit's epoch
        self.committed_steps = 0  # of them, at the last commit
        self.since_commit = 0  # this worker's steps since the last commit (what a reset redoes)
        self.fit_steps = 0  # steps of the running fit (its first traces the model: a longer hang bound)
        self.deferred = 0  # due commits put off because a worker was not at rest
        self._t_commit = time.monotonic()
        self._told = False  # the note that mid-epoch commits are off was logged
        state.register(self)

    @property
    def frontend(self):
        return self.callback.frontend

    def trace_name(self, inner=None) -> str:
        """Where each membership's engines trace under ``trace_dir``: ``reset<k>[/inner]``."""
        name = f"reset{self.state.resets}"
        return os.path.join(name, inner) if inner else name

    def begin(self, model, mode, params, policies):
        """Before a ``fit`` of an elastic job (first, or after a reset): the state's model, a mode
        (a policy or ``tfsync.Auto``) that works with this membership's size, data that starts at
        the committed position, and the commits within the epoch (``params``: Keras' ``epochs``
        and ``steps``; ``policies``: the modes the fit may run).  Every rank refuses alike (the
        state is rank 0's), before any collective."""
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
        # (a check due from the last fit's final commit stays due: with one fit per epoch, every
        # epoch end is a fit's last, and the next fit's first epoch begin checks; a reset clears it)
        self.plan = state.take_plan()
        self.schedule = self._schedule(mode, params, policies)
        self.steps = self.committed_steps = self.since_commit = self.fit_steps = 0
        self._t_commit = time.monotonic()

    def _schedule(self, mode, params, policies):
        """The fit's :class:`CommitSchedule`, or None (commits at epoch ends only)."""
        state, plan = self.state, self.plan
        every, every_s = state.commit_every_steps, state.commit_every_s
        if plan is not None:
            self._check_plan(plan, params)
        elif state.sample:
            raise ValueError(
                f"tfsync.elastic: the state was committed within epoch {state.epoch}, after {state.sample} of "
                f"its samples, but the data given to fit does not start there (it was not built from the "
                f"state); build it inside the function tfsync.elastic.run calls, once per epoch: "
                f"tfsync.shard(x, y, batch_size=B, resume=state) or tfsync.shard_dataset(ds, B, resume=state), "
                f"then fit(..., epochs=state.epoch + 1, initial_epoch=state.epoch)"
            )
        if every == "epoch":
            return None
        period = rest_period(policies)
        if plan is None:
            why = (
                "fit's data has no position to commit (build it with tfsync.shard(x, y, batch_size=B, "
                "resume=state) or tfsync.shard_dataset(ds, B, resume=state), one fit per epoch)"
            )
        elif period is None:
            why = (
                f"mode {getattr(mode, 'name', mode)!r} lets a worker go on before its round completes, so no "
                f"step leaves every replica with the same weights (modes that commit within an epoch: bsp, "
                f"psp, backup, localsgd, diloco)"
            )
        else:
            from tfsync.elastic import DEFAULT_COMMIT_EVERY_STEPS

            return CommitSchedule(DEFAULT_COMMIT_EVERY_STEPS if every == "auto" else every, every_s, period)
        if every == "auto" and every_s is None:
            if not self._told:
                log.info("tfsync.elastic: commits at epoch ends only: %s", why)
                self._told = True
            return None
        asked = f"commit_every_steps={every!r}" + (f", commit_every_s={every_s}" if every_s is not None else "")
        raise ValueError(
            f"tfsync.elastic: the state asks for commits within an epoch ({asked}), which this fit cannot "
            f'make: {why}. Fix that, or pass KerasState(..., commit_every_steps="epoch") to commit at '
            f"epoch ends only"
        )

    def _check_plan(self, plan, params):
        state = self.state
        if (plan.epoch, plan.start) != (state.epoch, state.sample):
            raise ValueError(
                f"tfsync.elastic: fit's data was built for epoch {plan.epoch} from sample {plan.start}, but the "
                f"state is at epoch {state.epoch}, sample {state.sample}; build the data from the state right "
                f"before each fit, inside the function tfsync.elastic.run calls (a reset restores the state)"
            )
        if params.get("epochs") != state.epoch + 1:
            raise ValueError(
                f"tfsync.elastic: fit runs to epoch {params.get('epochs')} on data built for epoch {state.epoch} "
                f"alone (from its committed sample); fit one epoch per data: fit(..., "
                f"epochs=state.epoch + 1, initial_epoch=state.epoch) in a loop while state.epoch < epochs"
            )
        if params.get("steps") != plan.steps:
            raise ValueError(
                f"tfsync.elastic: fit runs {params.get('steps')} steps on data that holds {plan.steps} "
                f"(batches of {plan.batch_size}); pass fit the batch_size given to the data helper, and no "
                f"steps_per_epoch"
            )

    def batch_begin(self):
        """After a commit within the epoch: the launcher's notices (as at an epoch's begin); the
        hang guard bounds the step from here (a fit's first step, its trace, at a longer bound),
        and sooner once the engine says the job went on without this worker."""
        self._check_hosts()
        guard = self.state.hang_guard
        if guard is not None:
            engine = self.callback.engine
            guard.begin("first" if self.fit_steps == 0 else "step", None if engine is None else engine.job_went_on)

    def batch_end(self, batch: int):
        """Step ``batch`` of the epoch is done: commit if one is due and every worker is at rest."""
        guard = self.state.hang_guard
        if guard is not None:
            guard.idle()
        self.fit_steps += 1
        self.since_commit += batch + 1 - self.steps  # (Keras' batch index: steps of the epoch, less one)
        self.steps = batch + 1
        schedule, plan = self.schedule, self.plan
        if schedule is None or self.steps >= plan.steps or not schedule.is_due(self.steps):
            return  # (the epoch's last step: its epoch end commits)
        callback = self.callback
        engine, run_counts = callback.engine, callback.run_counts
        delta = run_counts.since_commit(engine, record=False)
        keys = list(delta)
        now = time.monotonic()
        mean = self.frontend.average(
            [1.0 if engine.at_rest() else 0.0, now - self._t_commit, *(float(delta[k]) for k in keys)],
            "tfsync.elastic.commit",
            "whether every worker is at rest, its seconds and its contributions since the last commit",
        )
        if mean[0] < AT_REST:
            self.deferred += 1
            return
        run_counts.record_commit(delta)
        self._add_counts(keys, mean[2:])
        self.state.sample = plan.position(self.steps)
        self.state.save()
        schedule.committed(self.steps, self.steps - self.committed_steps, float(mean[1]))
        if engine.tracing:
            engine.trace(
                {
                    "event": "commit",
                    "rank": engine.rank,
                    "t": engine.now(),
                    "epoch": self.state.epoch,
                    "steps": self.steps,
                    "sample": self.state.sample,
                    "next_due": schedule.due,
                }
            )
        self.committed_steps, self.since_commit, self._t_commit = self.steps, 0, time.monotonic()
        self._hosts_check_due = True

    def _add_counts(self, keys, mean):
        size = self.frontend.cluster.size()
        for k, m in zip(keys, mean, strict=True):
            self.state.counts[k] += int(round(float(m) * size))

    def epoch_begin(self):
        """An epoch begins: its steps count from 0; the launcher's notices (:meth:`_check_hosts`)."""
        self.steps = self.committed_steps = 0  # (the last commit: the previous epoch's end, or the restore)
        self._check_hosts()

    def _check_hosts(self):
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
        self._add_counts(keys, mean)
        self.state.epoch, self.state.sample = epoch + 1, 0
        self.state.save()
        self.committed_steps, self.since_commit, self._t_commit = self.steps, 0, time.monotonic()
        self._hosts_check_due = True

    def reset(self, reason: str) -> int:
        """A reset (Horovod already shut down): this worker's steps since the last commit (and their
        rows, with a data plan) are counted redone, and the callback abandons its engine; returns
        how many of this worker's contributions were lost in flight."""
        self._hosts_check_due = False
        steps, plan = self.since_commit, self.plan
        rows = samples_redone(plan, self.committed_steps, self.steps) if plan is not None else 0
        self.callback.run_counts.redo(steps, rows)
        self.since_commit = 0
        return self.callback.abandon_engine(reason)

    @property
    def running(self) -> bool:
        """Whether the callback's engine runs (the state's collectives then queue behind its rounds)."""
        return self.frontend.running

    def collective(self, fn, name, purpose):
        """``fn(cluster)`` after the running engine's rounds, bounded by the wait bound."""
        frontend = self.frontend
        return frontend.collective(lambda: fn(frontend.cluster), name, purpose)


__all__ = ["CommitSchedule", "ElasticCommits", "rest_period"]
