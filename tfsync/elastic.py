"""Elastic training with tfsync: the job goes on through a lost worker or host.

Horovod's elastic launcher (``horovodrun --min-np N --max-np M
--host-discovery-script ...``) re-forms a job when a worker dies or the
discovery script adds or drops a host; Horovod's own state classes do not work
on Keras 3 (their Keras state calls ``optimizer.variables()``, a list in Keras
3; their TensorFlow state runs a collective when it is built, which a joining
worker cannot match), and its ``run`` wrapper resets on Horovod's own op errors
only.  This module is the Keras 3 way, with tfsync's engine:

* :class:`KerasState`: the model's and the optimizer's variables, the data
  position (the epoch, and the samples of it trained on) and tfsync's job-wide
  contribution counts, committed in host memory (NumPy copies) by the
  :class:`tfsync.keras.SyncCallback` given ``elastic=state`` at every epoch end
  and every ``commit_every_steps`` steps within an epoch where the mode and the
  data allow (:mod:`tfsync.keras.commits`); restored from the last commit after
  a failure, and broadcast from rank 0 to every member (joiners included) at
  every reset; with ``commit_dir`` (``TFSYNC_COMMIT_DIR``) written to storage
  too, from which a job with no worker left restarts (:mod:`tfsync._commit_store`).
* :func:`run`: calls the training function, and on a failure that a
  membership change explains (a lost peer: tfsync's
  :class:`~tfsync.engine.WorkerLostError`, a wait past its bound:
  :class:`~tfsync.engine.SyncTimeoutError`, a failed Horovod collective,
  Horovod's ``HorovodInternalError``) or a membership notice from the
  launcher (``HostsUpdatedInterrupt``) it resets: counts the contributions
  in flight as ``lost`` and abandons the running engine, re-forms Horovod
  (``hvd.shutdown(); hvd.init()``: the new ranks, rank 0 possibly another
  process), restores the last commit, broadcasts rank 0's state and calls the
  function again, which starts ``fit`` at ``state.epoch``, on data from the
  committed sample ``state.sample`` (:func:`tfsync.shard` or
  :func:`tfsync.shard_dataset` given ``resume=state``).  The callback's
  ``on_train_begin`` starts a new engine and control path on the new members.
* a hang guard (:mod:`tfsync._hang_guard`): while :func:`run` runs, a small process beside the
  worker ends it once it is frozen or stuck in a step past ``state.hang_timeout_s`` (stopped by
  a signal: once its peers no longer wait for it, :func:`stopped_timeout`), because
  Horovod's launcher re-forms a job only once every member has exited or re-registered, and a
  hung one does neither.

Elastic training runs through the Keras callback only: a model that trains under
:class:`tfsync.distribute.SyncStrategy` is refused when the state is built (or when the
function of :func:`run` is called in the strategy's scope), before any work, because the
strategy cannot re-form: it starts its engine while Keras traces the train step, and Keras
reuses that traced step in every later ``fit``, so after a reset the step
would call the engine of the old membership, which the reset abandoned; the strategy sees no
epoch ends, so nothing would commit the state; and Keras 3 binds a model to the strategy it
was built under (``model.distribute_strategy`` has no setter), so a strategy for the re-formed
job cannot take its place (``docs/guide/elastic.md``, "Limits").

How many resets a job may take is Horovod's launcher's bound
(``horovodrun --reset-limit``): past it the launcher stops the job, ends its
workers and says so ("number of resets during elastic job exceeded limit");
a worker whose re-forming fails before it is ended raises
:class:`ElasticResetError`, saying what failed and what likely caused it.

Example:

    hvd.init()
    model = build_model()                           # built and compiled, the same on every worker
    state = tfsync.elastic.KerasState(model, epoch=0)
    sync = tfsync.keras.SyncCallback("psp", elastic=state)

    @tfsync.elastic.run
    def train(state):                               # re-entered after every reset
        while state.epoch < 10:                     # one fit per epoch, from the committed sample
            x, y = tfsync.shard(x_all, y_all, batch_size=32, resume=state, seed=0)
            model.fit(x, y, batch_size=32, epochs=state.epoch + 1, initial_epoch=state.epoch,
                      shuffle=False, callbacks=[sync])

    train(state)
"""

import copy
import functools
import gc
import logging
import os
import re
import threading
import time

from tfsync import _env, _horovod
from tfsync._commit_store import CommitStore
from tfsync._data import REDONE
from tfsync._hang_guard import FIRST_STEP_FACTOR, HANG_MARGIN_S, STEP_FACTOR, HangGuard
from tfsync.control.client import ControlUnreachableError
from tfsync.control.transport import SILENT_LINK_S
from tfsync.engine import lifecycle
from tfsync.engine.bounded import run_bounded
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.diagnosis import SyncTimeoutError
from tfsync.engine.rounds import WorkerLostError
from tfsync.engine.tally import COUNTS

try:
    from horovod.common.elastic import ObjectState, State, notification_manager
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
except ImportError as _exc:  # pragma: no cover - Horovod is a dependency
    raise ImportError(
        f"tfsync.elastic needs Horovod ({_exc}); install it with `make install` (builds horovod==0.28.1)"
    ) from _exc

log = logging.getLogger("tfsync.elastic")

ELASTIC_ENV = "HOROVOD_ELASTIC"  # set to 1 by horovodrun for an elastic launch (--min-np/--max-np/discovery)
# a TensorFlow op error from a Horovod collective or its Gloo transport (not a user's own error)
HOROVOD_OP_ERROR = re.compile(r"horovod|gloo", re.IGNORECASE)
RESERVED = ("resets", "counts", "sample")  # KerasState's own attributes
DEFAULT_COMMIT_EVERY_STEPS = 100
"""Commits within an epoch every this many steps where the mode and the data allow
(``KerasState``'s ``commit_every_steps="auto"``): a commit copies the model and the optimizer
to host memory and runs one small allreduce and one small broadcast (``docs/guide/elastic.md``,
"Choosing the interval"; ``python -m tfsync.bench elastic --commit-cost`` measures it)."""
# Tries of hvd.init() per reset, REFORM_PAUSE_S apart. A re-form's rendezvous fails when a
# member is lost while the contexts form (killed, cut off): every other member's init then
# fails at Horovod's Gloo timeout, and on the next try the launcher (which has recorded the
# loss) hands out the membership without it; the rendezvous server out of reach for a moment
# (a link cut) fails a try within about 2 s. Three tries cover a second loss during the retry.
REFORM_ATTEMPTS = 3
REFORM_PAUSE_S = 2.0


class ElasticResetError(RuntimeError):
    """Horovod could not re-form the job after a failure (the launcher stopped it: too many
    resets, or fewer workers than ``--min-np``); the message says what failed."""


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
        _refuse_strategy(model, "tfsync.elastic.KerasState")
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


def _refuse_strategy(model, who):
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


def hang_timeout(state) -> float | None:
    """The seconds after which ``state``'s hang guard ends a frozen or stuck worker (None: no
    guard): ``state.hang_timeout_s``, or for ``"auto"`` the longest wait of a step on peers (the
    wait bound of each callback committing the state; the state's own without one) plus
    :data:`~tfsync._hang_guard.HANG_MARGIN_S`."""
    if state.hang_timeout_s != "auto":
        return state.hang_timeout_s
    return _wait_bound(state) + HANG_MARGIN_S


def stopped_timeout(state) -> float | None:
    """The seconds after which ``state``'s hang guard ends a worker stopped by a signal (SIGSTOP;
    None: no guard): under ``hang_timeout_s="auto"``, once its peers have dropped it: its control
    links' keepalive drops them after :data:`~tfsync.control.transport.SILENT_LINK_S`
    (5 s), or the wait bound if shorter.  Such a process is certainly not running (the hang
    timeout's margin is for a silent heartbeat that may be a long call holding Python's lock),
    and ending it lets the launcher, which waits for its exit, re-form the job at once.  Given
    seconds: the hang timeout."""
    if state.hang_timeout_s != "auto":
        return state.hang_timeout_s
    return min(_wait_bound(state), SILENT_LINK_S)


def _wait_bound(state) -> float:
    """The longest wait of a step on peers: the wait bound of each callback committing ``state``
    (the state's own without one)."""
    waits = [commits.frontend.wait_timeout_s for commits in state.committers] or [state.wait_timeout_s]
    return max(waits)


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


def is_reset_error(exc) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a failure a reset answers: a lost
    peer, a wait past its bound, rank 0's control service out of reach when the engine starts, a
    failed Horovod collective (its TensorFlow op error names Horovod or Gloo), or Horovod's
    ``HorovodInternalError``.  Any other error is the program's own: it ends the worker it
    happens on (:func:`run` raises it as it is); under an elastic launch the others reset
    without that worker."""
    import tensorflow as tf

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, HorovodInternalError | WorkerLostError | SyncTimeoutError | ControlUnreachableError):
            return True
        if isinstance(exc, tf.errors.OpError) and HOROVOD_OP_ERROR.search(exc.message or ""):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run(func):
    """Run ``func(state, *args, **kwargs)`` through failures and membership changes (a decorator).

    ``state`` (the first argument) is a :class:`KerasState` (or another Horovod ``State``); it is
    synchronized from rank 0 before the first call.  When ``func`` raises a failure a reset
    answers (:func:`is_reset_error`) or Horovod's ``HostsUpdatedInterrupt`` (the launcher added
    or dropped a host; raised by ``state.commit()``), every member resets:

    1. Horovod is shut down (``hvd.shutdown()``: every collective still pending fails); after
       a failure its Gloo waits on peers are ended first (:func:`tfsync._horovod.interrupt_gloo`),
       so that no member waits out Gloo's timeout on a peer that is resetting too;
    2. each :class:`tfsync.keras.SyncCallback` committing ``state`` (its registered committer) counts this worker's
       contributions in flight as ``lost`` and abandons its engine (no handshake: the peers
       are resetting too), in the trace as an ``event: reset`` record;
    3. Horovod is re-formed (``hvd.init()``) by its elastic launcher: the surviving and the
       added workers, numbered anew; a rendezvous that loses a member while it forms is
       tried again (up to :data:`REFORM_ATTEMPTS` times), without that member;
    4. ``state`` is restored from its last commit and ``state.resets`` counted, then synchronized
       from the new rank 0 (a joining worker gets the whole state), and ``func`` is called again.

    Any other error is raised as it is.  A state whose model trains under
    :class:`tfsync.distribute.SyncStrategy` (``func`` called in the strategy's scope) is refused
    before the sync, as :class:`KerasState` refuses one built under it.  Without an elastic
    launch (``horovodrun`` without ``--min-np``/``--max-np``/``--host-discovery-script``: no
    ``HOROVOD_ELASTIC=1``) Horovod cannot re-form the job: ``func`` runs once after the sync,
    and a failure stops the job as it would without this wrapper.  Returns what ``func`` returns.
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(
                f"tfsync.elastic.run: the first argument of {func.__name__} must be the elastic state "
                f"(tfsync.elastic.KerasState), got {type(state).__name__}; call {func.__name__}(state, ...)"
            )
        if isinstance(state, KerasState):  # (called in a SyncStrategy's scope: refused before the sync)
            _refuse_strategy(state.model, f"tfsync.elastic.run ({func.__name__})")
        hvd = _horovod.horovod()
        if os.environ.get(ELASTIC_ENV) != "1":
            try:
                state.sync()
                return func(state, *args, **kwargs)
            finally:
                if isinstance(state, KerasState):
                    state.flush_storage()
        notification_manager.init()
        notification_manager.register_listener(state)
        guard = _start_guard(hvd, state)
        try:
            while True:
                try:
                    state.sync()
                    return func(state, *args, **kwargs)
                except HostsUpdatedInterrupt as exc:
                    reason = "the launcher " + ("dropped a host" if exc.skip_sync else "changed the hosts")
                    failed = False
                except Exception as exc:
                    if not is_reset_error(exc):
                        raise
                    reason = f"{type(exc).__name__}: {exc}"
                    failed = True
                finally:
                    if guard is not None:
                        guard.idle()  # (a failed step never ended)
                _reset(hvd, state, reason, failed)
                if guard is not None:
                    guard.label(f"rank {hvd.rank()} of {hvd.size()}")
                    guard.begin("restart")  # (the sync and the fit's start, bounded up to its first step)
        finally:
            notification_manager.remove_listener(state)
            if guard is not None:
                state.hang_guard = None
                guard.stop()
            if isinstance(state, KerasState):
                state.flush_storage()

    return wrapper


def _start_guard(hvd, state):
    """The process's :class:`~tfsync._hang_guard.HangGuard` for ``state`` (None without one)."""
    if not isinstance(state, KerasState):
        return None
    timeout_s = hang_timeout(state)
    if timeout_s is None:
        return None
    stopped_s = stopped_timeout(state)
    state.hang_guard = HangGuard(timeout_s, f"rank {hvd.rank()} of {hvd.size()}", stopped_s=stopped_s)
    log.info(
        "tfsync.elastic: a hang guard ends this worker if it is frozen for %.1f s (stopped by a signal: %.1f s), "
        "or in one step for %.1f s (%.1f s once the job went on without it; a fit's first step, the model's trace, "
        "or the restart after a reset up to it: %.1f s)",
        timeout_s,
        stopped_s,
        STEP_FACTOR * timeout_s,
        timeout_s,
        FIRST_STEP_FACTOR * timeout_s,
    )
    return state.hang_guard


def _reset(hvd, state, reason, failed):
    """Abandon the engines (their in-flight contributions counted lost), re-form Horovod, restore
    the last commit.  The caller then synchronizes the state from the new rank 0.

    After a failure (``failed``) Horovod's Gloo waits on peers are ended first: a member may
    wait on a live peer that is resetting too, and ``hvd.shutdown()`` waits for it.  After the
    launcher's notice of new hosts every member is healthy and at the same commit, and Horovod
    shuts down cleanly on its own."""
    t = time.monotonic()
    old = f"rank {_rank_or(hvd)} of {_size_or(hvd)}"
    interrupted = _horovod.interrupt_gloo() if failed else 0  # (waits on peers end now, not at Gloo's timeout)
    try:
        hvd.shutdown()  # first: fails every collective still pending, so the engines end at once
    except Exception:  # noqa: BLE001 - already shut down (an abort) is fine
        pass
    shut_down_s = time.monotonic() - t
    lost = 0
    for commits in getattr(state, "committers", ()):
        lost += commits.reset(reason)
    lifecycle.abandon_all()  # any other engine of this process (a SyncStrategy's)
    HorovodCluster.forget_membership()
    _collect_abandoned()
    resets = getattr(state, "resets", 0) + 1
    parts = {"engines ended": time.monotonic()}  # (each part's end, for the log line below)
    if isinstance(state, KerasState):  # (the last commit on storage before the job re-forms, or ends here)
        state.flush_storage()
    parts["commit stored"] = time.monotonic()
    _reform(hvd, resets, reason)
    parts["Horovod re-formed"] = time.monotonic()
    state.restore()
    parts["state restored"] = time.monotonic()
    ends = [t + shut_down_s, *parts.values()]
    split = ", ".join(f"{name} in {end - start:.2f} s" for name, start, end in zip(parts, ends, ends[1:]))
    if isinstance(state, KerasState):  # (in the commit too: sync() broadcasts rank 0's commit)
        state._saved_state["resets"] = state.resets = resets
    state.on_reset()
    log.warning(
        "tfsync.elastic: reset %d (%s): was %s, now rank %d of %d; %d contributions of this worker were "
        "lost in flight; re-formed in %.2f s (Horovod shut down in %.2f s, %s Gloo connections "
        "interrupted; then %s); training goes on from epoch %s",
        resets,
        reason.splitlines()[0][:300],
        old,
        hvd.rank(),
        hvd.size(),
        lost,
        time.monotonic() - t,
        shut_down_s,
        "no" if interrupted is None else interrupted,
        split,
        getattr(state, "epoch", "?"),
    )


def _collect_abandoned():
    """Collect the interrupted fit's garbage on a daemon thread of its own.

    A fit that a failure interrupted leaves its objects, its ``tf.data`` iterators among them,
    in reference cycles (the exception's frames), which Python collects at some later
    allocation on whichever thread makes it.  In the chaos soak that was the restarted fit's
    trace, where an iterator's destructor then waited 24 s to minutes for the iterator's
    autotuning thread (``RootDataset::Iterator``'s model thread, which sometimes sleeps out its
    period, doubling from 10 ms to 60 s, though the iterator cancelled it; plain Keras shows it
    too, at epoch ends: docs/guide/elastic.md, "Epoch ends"): the restarted worker made no step, and
    its peers gave up on it.  Collected here, such a wait holds only this thread (TensorFlow
    waits without Python's lock: the worker's other threads ran on meanwhile), while the worker
    re-forms and trains."""
    threading.Thread(target=gc.collect, name="tfsync-reset-gc", daemon=True).start()


def _reform(hvd, resets, reason):
    """``hvd.init()``, tried up to :data:`REFORM_ATTEMPTS` times with a shutdown between tries.

    A failed try is a rendezvous that lost a member while it formed (with the Horovod that
    ``make install`` builds, the failure is an error of ``hvd.init()``; Horovod as released
    aborts the process instead); the launcher, which saw the member go, re-forms without it on
    the next try.  A worker whose host the launcher removed does not try again (it would count
    as ready in the launcher's next round): :class:`ElasticResetError` at once, as after the
    last try, saying what failed."""
    for attempt in range(1, REFORM_ATTEMPTS + 1):
        try:
            hvd.init()
            return
        except Exception as exc:
            why = _horovod.init_error() or f"{type(exc).__name__}: {exc}"
            if _horovod.REMOVED in why:
                raise ElasticResetError(
                    f"tfsync.elastic: the launcher removed this worker's host from the job (Horovod: "
                    f"{why}), so this worker ends; the others go on without it. The failure that "
                    f"started this reset was: {reason}"
                ) from exc
            if attempt == REFORM_ATTEMPTS:
                raise ElasticResetError(
                    f"tfsync.elastic: Horovod could not re-form the job for reset {resets} in "
                    f"{REFORM_ATTEMPTS} tries (the last: {why}). horovodrun stops an elastic job when "
                    f"its resets exceed --reset-limit or fewer workers than --min-np remain; its output "
                    f"says which. The failure that started this reset was: {reason}"
                ) from exc
            log.warning(
                "tfsync.elastic: reset %d: Horovod could not re-form the job (try %d of %d: %s); "
                "trying again in %.0f s: the launcher re-forms without a member lost meanwhile",
                resets,
                attempt,
                REFORM_ATTEMPTS,
                why,
                REFORM_PAUSE_S,
            )
            try:
                hvd.shutdown()
            except Exception:  # noqa: BLE001 - nothing left running is fine
                pass
            time.sleep(REFORM_PAUSE_S)


def _rank_or(hvd):
    try:
        return hvd.rank()
    except Exception:  # noqa: BLE001 - for the log only
        return "?"


def _size_or(hvd):
    try:
        return hvd.size()
    except Exception:  # noqa: BLE001 - for the log only
        return "?"


__all__ = ["DEFAULT_COMMIT_EVERY_STEPS", "ElasticResetError", "KerasState", "is_reset_error", "run"]
