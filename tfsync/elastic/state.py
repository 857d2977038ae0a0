"""What an elastic job keeps through a membership change (:class:`KerasState`): a Keras 3 model,
its optimizer and the progress of training, committed in host memory and, with ``commit_dir``,
to storage; checked when it is built (:mod:`tfsync.elastic` says how a job resets around it).
"""

import copy
import logging
import time

from horovod.common.elastic import ObjectState  # (checked by tfsync.elastic, which is imported first)

from tfsync import _env, _horovod
from tfsync._commit_store import CommitStore
from tfsync._data import REDONE
from tfsync.engine.bounded import run_bounded
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.tally import COUNTS

log = logging.getLogger("tfsync.elastic")

RESERVED = ("resets", "counts", "sample")  # KerasState's own attributes
DEFAULT_COMMIT_EVERY_STEPS = 100
"""Commits within an epoch every this many steps where the mode and the data allow
(``KerasState``'s ``commit_every_steps="auto"``): a commit copies the model and the optimizer
to host memory and runs one small allreduce and one small broadcast (``docs/guide/elastic.md``,
"Choosing the interval"; ``python -m tfsync.bench elastic --commit-cost`` measures it)."""


class KerasState(ObjectState):
    """What an elastic job keeps through a membership change: a Keras 3 model, its optimizer and
    the progress of training.

    Building it runs no collective (a worker that joins a running job builds it while the
    others wait in their reset).  Committed by the :class:`tfsync.keras.SyncCallback` given
    ``elastic=state`` (:class:`tfsync.keras.commits.ElasticCommits`) at every epoch end and,
    where the mode and the data allow, every ``commit_every_steps`` steps within an epoch:
    NumPy copies of every model and optimizer variable (weights, non-trainable statistics,
    iterations, slots, learning rate) and of the attributes.  Restored (``restore()``) after
    a failure; synchronized (``sync()``: rank 0's variables and attributes broadcast to every
    member, each collective bounded by the wait bound) when :func:`run` starts and after every
    reset.

    Args:
        model: a built, compiled Keras 3 model, the same on every worker, trained by ``fit``
            with ``tfsync.keras.SyncCallback(..., elastic=state)``; one built under
            :class:`tfsync.distribute.SyncStrategy` is refused (``ValueError``, saying why:
            the strategy cannot re-form the job).
        optimizer: default ``model.optimizer``; built now (its slots) if it is not.
        wait_timeout_s: bound on each collective of ``sync()`` and ``commit()`` (default
            120 s, or ``TFSYNC_WAIT_TIMEOUT_S``).
        commit_every_steps: ``"auto"`` (default): every ``DEFAULT_COMMIT_EVERY_STEPS`` (100)
            steps within an epoch where mid-epoch commits can run (the mode comes to rest
            between steps and ``fit``'s data comes from ``tfsync.shard(..., resume=state)`` or
            ``tfsync.shard_dataset(..., resume=state)``), at epoch ends only elsewhere; an
            integer ``N >= 1``: every ``N`` steps, and a ``fit`` where that cannot run is refused
            before its first step, saying why; ``"epoch"``: at epoch ends only.  Local SGD and
            DiLoCo commit at outer steps: ``N`` is rounded up to a multiple of ``inner_steps``.
        commit_every_s: also commit once this many seconds of training have passed since the
            last commit (default None: no time bound), measured as the workers' mean step time
            at each commit, so every worker picks the same step; with ``commit_every_steps`` an
            integer or ``"auto"``, whichever comes first.  Refused with ``"epoch"``.
        hang_timeout_s: under an elastic launch, a guard process beside the worker ends it
            (SIGKILL, saying why on its standard error) once it has been frozen (SIGSTOP, a
            paused VM) this long, or in one training step (a deadlock, a stuck kernel) twice
            as long (a step's own compute comes on top of its wait on peers), or this long
            and 2 s after its control path said the job went on without it (a peer stopped or
            was lost: a healthy worker leaves the step for its reset by then), so that
            the launcher, which waits for every worker's exit, re-forms the job without it
            (``docs/guide/elastic.md``, "Hung workers").  ``"auto"`` (default): the wait bound of
            the callback committing the state plus 2 s: a peer waiting on a hung worker gives up
            (and resets) within that bound, so a worker stalled that long is already out, and a
            shorter stall is ridden through; a worker the kernel says is stopped by a signal
            (SIGSTOP) is ended once its peers' control links have dropped it, after 5 s
            (:func:`stopped_timeout`); seconds (for every freeze alike); or None (no guard).
            A fit's first step (the model's trace), and the restart after a reset up to it
            (the state's sync, the fit's start), are bounded at ten times the hang timeout.
        commit_dir: a directory every host of the job shares (default: ``TFSYNC_COMMIT_DIR``,
            else None: commits in memory only).  The job's rank 0 writes each commit there too
            (one file, replaced atomically, by a thread of its own: the step does not wait for
            the disk), and a rank 0 that has no later commit in memory (a fresh process: every
            worker of the job was lost, or the job was launched again) restarts from it when the
            state is synchronized, counting a reset.  Set ``TFSYNC_COMMIT_DIR`` for
            ``horovodrun`` so that its launcher, too, goes on when no host of the last round
            is left (``docs/guide/elastic.md``, "Commits on storage").  A directory holding
            another model's or state's commit is refused here, saying what differs.
        **attributes: values kept and restored with the model, as attributes of the state
            (``epoch=0`` by default; any other picklable value: a learning-rate scale).
            ``resets`` (the resets so far), ``counts`` (the job's contributions as of the last
            commit, summed over the workers, and the steps and samples resets redid) and
            ``sample`` (the committed data position: the samples of ``epoch``'s order trained
            on, :mod:`tfsync._data`) are the state's own.

    Example:

        state = tfsync.elastic.KerasState(model, epoch=0, commit_every_steps=200)
        sync = tfsync.keras.SyncCallback("bsp", elastic=state)
    """

    def __init__(
        self,
        model,
        optimizer=None,
        *,
        wait_timeout_s=None,
        commit_every_steps="auto",
        commit_every_s=None,
        hang_timeout_s="auto",
        commit_dir=None,
        **attributes,
    ):
        refuse_strategy(model, "tfsync.elastic.KerasState")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "tfsync.elastic.KerasState: the model has no optimizer; call model.compile(optimizer=..., "
                "loss=...) before building the state, or pass optimizer="
            )
        if not getattr(model, "built", False) or not model.variables:
            raise ValueError(
                "tfsync.elastic.KerasState: the model is not built, so it has no variables to keep; "
                "build it before the state (start it with keras.Input(shape), or call model.build(shape))"
            )
        for name in RESERVED:
            if name in attributes:
                raise ValueError(
                    f"tfsync.elastic.KerasState: {name!r} is the state's own attribute (resets: the resets "
                    f"so far; counts: the job's committed contribution counts; sample: the committed data "
                    f"position); name yours differently"
                )
        self.commit_every_steps, self.commit_every_s = _check_interval(commit_every_steps, commit_every_s)
        if not optimizer.built:  # its slots exist before the first commit and every broadcast
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer = model, optimizer
        self.wait_timeout_s = _env.wait_timeout_s(wait_timeout_s)
        self.hang_timeout_s = _check_hang_timeout(hang_timeout_s)
        if commit_dir is None and _env.COMMIT_DIR.is_set():
            commit_dir = _env.COMMIT_DIR.get()
        self._store = CommitStore(commit_dir) if commit_dir is not None else None
        self.hang_guard = None  # the process's HangGuard while tfsync.elastic.run runs
        self._commits = []  # the committers (a SyncCallback's tfsync.keras.commits.ElasticCommits) of this state
        self.plan = None  # the epoch's data plan (tfsync._data.EpochPlan) of the next fit, not committed
        attributes.setdefault("epoch", 0)
        attributes["sample"] = 0
        attributes["resets"] = 0
        attributes["counts"] = dict.fromkeys(COUNTS + REDONE, 0)
        super().__init__(bcast_object=self._broadcast_object, get_rank=self._rank, **attributes)
        self._saved_values = self._values()
        if self._store is not None:  # (every rank refuses another job's commit alike, before any work)
            names = [v.path for v in self._variables()]
            self._store.check(self._saved_values, names, self._saved_state)

    @property
    def commit_dir(self):
        """The directory the job's commits are written to (None: in memory only)."""
        return None if self._store is None else self._store.directory

    # -------------------------------------------------------------- Horovod's State
    def save(self):
        """Copy every variable and attribute to host memory (local: no collective); with a
        ``commit_dir``, rank 0 also queues the commit for storage (written by a thread of its own)."""
        self._save_in_memory()
        if self._store is not None and self._rank() == 0:
            self._store.write(self._saved_values, dict(self._saved_state), (self.epoch, self.sample))

    def _save_in_memory(self):
        self._saved_values = self._values()
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self):
        """Set every variable and attribute back to the last commit (local)."""
        for variable, value in zip(self._variables(), self._saved_values, strict=True):
            variable.assign(value)
        self._set_attrs()

    def sync(self):
        """Rank 0's variables and attributes on every member, then committed in memory
        (collective, bounded).  With a ``commit_dir``, rank 0 first takes the commit there if it
        is further on than its own (a fresh process: the job restarted with no worker left)."""
        if self._store is not None and self._rank() == 0:
            self._restore_from_storage()
        self._collective(
            lambda cluster: cluster.broadcast_variables(self._variables(), 0, "tfsync.elastic.variables"),
            "tfsync.elastic.variables",
            "rank 0's model and optimizer variables, broadcast to every member of the re-formed job",
        )
        super().sync()  # (the attributes, through _broadcast_object)
        self._save_in_memory()  # (storage already holds this commit, or an equal one)

    def _restore_from_storage(self):
        """Take the commit on storage where it is further on (epoch, then sample) than this
        process's last commit, counting the restart as a reset."""
        mine = (self._saved_state["epoch"], self._saved_state["sample"])  # (what the sync would broadcast)
        stored = self._store.read(after=mine)
        if stored is None:
            return
        meta, values = stored
        for variable, value in zip(self._variables(), values, strict=True):
            variable.assign(value)
        resets = max(meta["attrs"].get("resets", 0), self.resets) + 1
        self._saved_state = {**meta["attrs"], "resets": resets}  # (what the sync broadcasts)
        self._set_attrs()
        log.warning(
            "tfsync.elastic: restarted from the commit in %s (epoch %s, sample %s, written %.1f s ago): no "
            "worker of the job had a later one; reset %d",
            self._store.path,
            self.epoch,
            self.sample,
            time.time() - meta["time"],
            resets,
        )

    def flush_storage(self, timeout_s=None) -> bool:
        """Wait (up to ``timeout_s``, default the wait bound) until the last commit queued for
        ``commit_dir`` is written; whether it is (True without a ``commit_dir``)."""
        if self._store is None:
            return True
        timeout_s = self.wait_timeout_s if timeout_s is None else timeout_s
        done = self._store.flush(timeout_s)
        if not done:
            log.warning(
                "tfsync.elastic: the last commit was not written to %s within %.0f s; a restart with no "
                "worker left would take the one before",
                self._store.path,
                timeout_s,
            )
        return done

    def _set_attrs(self):
        for attr, value in self._saved_state.items():  # copies: a commit is never changed in place
            setattr(self, attr, copy.deepcopy(value))

    # ------------------------------------------------------------------- internals
    def _variables(self):
        return list(self.model.variables) + list(self.optimizer.variables)

    def _values(self):
        return [v.numpy().copy() for v in self._variables()]

    def _rank(self):
        return _horovod.horovod().rank()

    def _broadcast_object(self, obj):
        return self._collective(
            lambda cluster: cluster.broadcast_object(obj, 0, "tfsync.elastic.attributes"),
            "tfsync.elastic.attributes",
            "rank 0's elastic state attributes (or the launcher's membership notices), broadcast",
        )

    def _collective(self, fn, name, purpose):
        """``fn(cluster)`` bounded by the wait bound, after the running engine's rounds if one runs
        (the job's collectives stay in one order on every rank)."""
        for commits in self._commits:
            if commits.running:
                return commits.collective(fn, name, purpose)
        cluster = HorovodCluster()
        return run_bounded(cluster, lambda: fn(cluster), name=name, purpose=purpose, timeout_s=self.wait_timeout_s)

    def use_data(self, plan):
        """``plan`` (a :class:`tfsync._data.EpochPlan`) says how the next ``fit``'s data shares
        the rest of the epoch from the committed position: ``tfsync.shard(..., resume=state)``
        and ``tfsync.shard_dataset(..., resume=state)`` call this; the callback takes it when
        ``fit`` begins."""
        self.plan = plan

    def take_plan(self):
        """The plan of the ``fit`` beginning (None: its data is not positioned), used once."""
        plan, self.plan = self.plan, None
        return plan

    def register(self, commits):
        """Commit this state from ``commits`` (a :class:`tfsync.keras.commits.ElasticCommits`, which a
        ``SyncCallback(elastic=state)`` builds): at a reset :func:`run` calls its ``reset(reason)``,
        and while its engine runs this state's collectives queue behind the engine's rounds."""
        if commits not in self._commits:
            self._commits.append(commits)

    @property
    def committers(self) -> tuple:
        """The registered committers (:meth:`register`)."""
        return tuple(self._commits)


def refuse_strategy(model, who):
    """Refuse ``model`` when it trains under :class:`tfsync.distribute.SyncStrategy` (built in its
    scope, or read in it: Keras' ``distribute_strategy`` is the strategy of the model's creation,
    else the one of the current scope), before any work: the strategy cannot re-form the job."""
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None:
        return
    from tfsync.distribute.strategy import SyncStrategy

    if isinstance(strategy, SyncStrategy):
        raise ValueError(
            f"{who}: the model trains under tfsync.distribute.SyncStrategy (built in strategy.scope(), or "
            f"used in it), which cannot train elastically. Expected a model built without a strategy and "
            f"trained by model.fit with callbacks=[tfsync.keras.SyncCallback(mode, elastic=state)]: build the "
            f"model and the state outside strategy.scope() and pass that callback to fit, or keep SyncStrategy "
            f"and train without tfsync.elastic. Why: SyncStrategy starts its engine while Keras traces the "
            f"train step, and Keras reuses that traced step in every later fit, so after a reset "
            f"the step would call the engine of the old membership, which the reset abandoned; the "
            f"strategy sees no epoch ends, so nothing would commit the state; and Keras 3 binds a model to the "
            f"strategy it was built under, so a strategy for the re-formed job cannot replace it "
            f"(docs/guide/elastic.md, Limits)"
        )


def _check_hang_timeout(value):
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < float("inf")):
        raise ValueError(
            f'tfsync.elastic.KerasState: hang_timeout_s must be "auto", a positive number of seconds or None, '
            f'got {value!r}; pass hang_timeout_s="auto" (the wait bound plus 2 s), e.g. 60, or None '
            f"(no hang guard)"
        )
    return float(value)


def _check_interval(every_steps, every_s):
    """``commit_every_steps`` and ``commit_every_s`` of a :class:`KerasState`, checked."""
    if every_steps not in ("auto", "epoch") and (
        isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1
    ):
        raise ValueError(
            f"tfsync.elastic.KerasState: commit_every_steps={every_steps!r}; expected an integer >= 1, "
            f'"auto" (every {DEFAULT_COMMIT_EVERY_STEPS} steps where mid-epoch commits can run) or "epoch" '
            f"(at epoch ends only)"
        )
    if every_s is not None:
        if isinstance(every_s, bool) or not isinstance(every_s, int | float) or not every_s > 0:
            raise ValueError(
                f"tfsync.elastic.KerasState: commit_every_s={every_s!r}; expected seconds > 0, or None (no time bound)"
            )
        if every_steps == "epoch":
            raise ValueError(
                f'tfsync.elastic.KerasState: commit_every_s={every_s} with commit_every_steps="epoch" asks for '
                f'commits within an epoch and at epoch ends only; pass commit_every_steps="auto" or an integer'
            )
        every_s = float(every_s)
    return every_steps, every_s


__all__ = ["DEFAULT_COMMIT_EVERY_STEPS", "KerasState"]
