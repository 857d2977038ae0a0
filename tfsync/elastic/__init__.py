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

try:  # (Horovod's elastic classes, which the state and the loop build on)
    import horovod.common.elastic  # noqa: F401
except ImportError as _exc:  # pragma: no cover - Horovod is a dependency
    raise ImportError(
        f"tfsync.elastic needs Horovod ({_exc}); install it with `make install` (builds horovod==0.28.1)"
    ) from _exc

from tfsync.elastic.loop import ELASTIC_ENV as ELASTIC_ENV  # noqa: E402
from tfsync.elastic.loop import ElasticResetError, is_reset_error, run  # noqa: E402
from tfsync.elastic.loop import hang_timeout as hang_timeout  # noqa: E402
from tfsync.elastic.loop import stopped_timeout as stopped_timeout  # noqa: E402
from tfsync.elastic.state import DEFAULT_COMMIT_EVERY_STEPS, KerasState  # noqa: E402

__all__ = ["DEFAULT_COMMIT_EVERY_STEPS", "ElasticResetError", "KerasState", "is_reset_error", "run"]
