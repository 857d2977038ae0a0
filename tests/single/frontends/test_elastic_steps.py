"""Commits within an epoch (tfsync/keras/commits.py) in one process: when they are due, which
modes can make them, and the callback committing every N steps, a reset redoing only the steps
since the last commit, and the next fit resuming at the committed sample (the launches are
tests/parallel/test_elastic_launcher.py)."""

import keras
import numpy as np
import pytest
from fake_cluster import FakeCluster

import tfsync
import tfsync.elastic as elastic
from tfsync import _data
from tfsync.engine import SyncEngine, WorkerLostError
from tfsync.keras.commits import FIRST_TIMED_COMMIT_STEPS, CommitSchedule, rest_period

SETTLED = ("applied", "compensated", "dropped", "rejected", "lost")


def test_commits_are_due_every_n_steps_at_multiples_of_the_rest_period():
    every = CommitSchedule(every_steps=5)
    assert [s for s in range(1, 12) if every.is_due(s)] == list(range(5, 12))  # due until made
    assert every.committed(5, 5, 1.0) == 10
    outer = CommitSchedule(every_steps=5, period=4)  # an outer step every 4: commits at 8, 16, ...
    assert [s for s in range(1, 17) if outer.is_due(s)] == [8, 12, 16]  # (a deferred one: the next)
    assert outer.committed(8, 8, 1.0) == 16


def test_a_time_bound_becomes_the_step_every_worker_computes_from_the_mean_step_time():
    timed = CommitSchedule(every_s=30.0)
    assert timed.due == FIRST_TIMED_COMMIT_STEPS  # the first commit measures the step time
    assert timed.committed(10, 10, 2.0) == 10 + 150  # 0.2 s a step: 150 steps in 30 s
    both = CommitSchedule(every_steps=100, every_s=30.0)
    assert both.due == FIRST_TIMED_COMMIT_STEPS
    assert both.committed(10, 10, 2.0) == 110  # whichever comes first: 100 steps
    assert both.committed(110, 100, 60.0) == 160  # 0.6 s a step: 50 steps
    assert CommitSchedule(every_s=1.0).committed(10, 10, 100.0) == 11  # at least one step


@pytest.mark.parametrize(
    "mode,period",
    [
        (tfsync.BSP(), 1),
        (tfsync.PSP(), 1),
        (tfsync.BackupWorkers(), 1),
        (tfsync.PSP(compensate=tfsync.DelayCompensation()), 1),  # (a late one held defers a commit)
        (tfsync.SSP(staleness=0), 1),
        (tfsync.LocalSGD(period=4), 4),
        (tfsync.DiLoCo(inner_steps=6), 6),
        (tfsync.DiLoCo(inner_steps=6, overlap_steps=2), 6),  # mixing 0: every replica at w_outer
        (tfsync.DiLoCo(inner_steps=6, overlap_steps=2, mixing=0.5), None),
        (tfsync.SSP(staleness=3), None),
        (tfsync.DSSP(), None),
        (tfsync.ElasticBSP(), None),
        (tfsync.DCS3GD(), None),
    ],
)
def test_only_modes_that_come_to_rest_between_steps_commit_within_an_epoch(mode, period):
    assert SyncEngine.rest_steps(mode) == period


def test_a_fit_running_several_modes_commits_where_all_of_them_rest():
    assert rest_period([tfsync.BSP(), tfsync.LocalSGD(period=4), tfsync.DiLoCo(inner_steps=6)]) == 12
    assert rest_period([tfsync.BSP(), tfsync.SSP(staleness=2)]) is None


@pytest.mark.parametrize(
    "kwargs,says",
    [
        (dict(commit_every_steps=0), "expected an integer >= 1"),
        (dict(commit_every_steps="often"), "expected an integer >= 1"),
        (dict(commit_every_steps=True), "expected an integer >= 1"),
        (dict(commit_every_s=0), "expected seconds > 0"),
        (dict(commit_every_steps="epoch", commit_every_s=10), "epoch ends only"),
        (dict(sample=3), "the state's own attribute"),
    ],
)
def test_the_state_refuses_an_interval_it_cannot_keep(kwargs, says):
    with pytest.raises(ValueError, match=says):
        elastic.KerasState(_model(), **kwargs)


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


X = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
Y = np.zeros((32, 2), "float32")
BATCH = 4  # 8 steps an epoch on one worker


@pytest.fixture
def one_worker(monkeypatch):
    """Rank 0 of 1 for the data helpers (the callback runs on the in-process cluster)."""
    monkeypatch.setattr(_data, "_membership", lambda: (0, 1))


def _callback(state, mode="bsp"):
    return tfsync.keras.SyncCallback(mode, cluster=FakeCluster(1).rank(0), elastic=state, wait_timeout_s=10)


def _fit(model, state, sync, extra=(), seed=0):
    x, y = tfsync.shard(X, Y, batch_size=BATCH, resume=state, seed=seed)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=state.epoch + 1,
        initial_epoch=state.epoch,
        shuffle=False,
        verbose=0,
        callbacks=[sync, *extra],
    )
    return x


class FailAt(keras.callbacks.Callback):
    """Raises a reset error after ``batch`` of ``epoch``, once."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.failed = (epoch, batch), False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at and not self.failed:
            self.failed = True
            raise WorkerLostError("tfsync: lost rank 1 (a test)")


def test_a_reset_mid_epoch_redoes_the_steps_since_the_commit_and_resumes_at_its_sample(one_worker):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_every_steps=3)
    sync = _callback(state)
    _fit(model, state, sync)
    assert (state.epoch, state.sample) == (1, 0)  # an epoch end commits the next epoch's start
    fail = FailAt(1, 4)  # after 5 steps of epoch 1: committed after step 3, two steps since
    with pytest.raises(WorkerLostError):
        _fit(model, state, sync, [fail])
    assert (state.epoch, state.sample) == (1, 3 * BATCH)
    committed = [v.copy() for v in state._saved_values]
    sync.elastic.reset("WorkerLostError: a test")
    state.restore()
    assert all(np.array_equal(v.numpy(), c) for v, c in zip(state._variables(), committed, strict=True))
    counts = sync.counts
    assert (counts["steps_redone"], counts["samples_redone"]) == (2, 2 * BATCH)
    assert counts["produced"] == 8 + 5 == sum(counts[k] for k in SETTLED) and counts["lost"] == 0  # (BSP)

    x = _fit(model, state, sync)  # the rest of epoch 1: its samples from the committed position on
    order = np.random.default_rng([0, 1]).permutation(len(X))
    assert np.array_equal(x, X[order[3 * BATCH :]])
    assert sync.engine.counts["produced"] == 5  # steps 4-8 of epoch 1 (the redone two included)
    assert (state.epoch, state.sample) == (2, 0)
    job = state.counts  # one worker: the job's counts are its own
    assert job == sync.counts and job["produced"] == 8 + 5 + 5 == sum(job[k] for k in SETTLED)
    assert (job["steps_redone"], job["samples_redone"]) == (2, 2 * BATCH)


def test_a_commit_waits_for_a_step_at_which_every_worker_is_at_rest(one_worker, monkeypatch):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_every_steps=3)
    sync = _callback(state)
    rest = {3: False, 4: False}  # not at rest after steps 3 and 4 (a late contribution held, say)
    steps_seen = []

    def at_rest(engine):
        steps_seen.append(engine.step)
        return rest.get(engine.step, True)

    monkeypatch.setattr(SyncEngine, "at_rest", at_rest)
    saves = []
    real_save = state.save
    monkeypatch.setattr(state, "save", lambda: (saves.append(state.sample), real_save()))
    _fit(model, state, sync)
    assert steps_seen == [3, 4, 5]  # asked at the due step 3, again at 4 and 5, not after
    assert saves == [5 * BATCH, 0] and sync.elastic.deferred == 2  # made after step 5; the epoch end


@pytest.mark.parametrize(
    "mode,kwargs,says",
    [
        ("ssp", dict(commit_every_steps=3), "lets a worker go on before its round completes"),
        ("bsp", dict(commit_every_s=5.0), None),
    ],
)
def test_commits_asked_for_within_an_epoch_are_refused_before_training_where_they_cannot_run(
    one_worker, mode, kwargs, says
):
    model = _model()
    state = elastic.KerasState(model, epoch=0, **kwargs)
    sync = _callback(state, mode)
    if says is None:  # the data has no position: built without resume=
        with pytest.raises(ValueError, match="has no position to commit"):
            model.fit(*tfsync.shard(X, Y, batch_size=BATCH), batch_size=BATCH, epochs=1, verbose=0, callbacks=[sync])
        return
    with pytest.raises(ValueError, match=says):
        _fit(model, state, sync)
    assert int(model.optimizer.iterations.numpy()) == 0  # refused before the first step


def test_by_default_a_mode_without_rest_points_commits_at_epoch_ends(one_worker):
    model = _model()
    state = elastic.KerasState(model, epoch=0)  # commit_every_steps="auto"
    sync = _callback(state, tfsync.SSP(staleness=2))
    _fit(model, state, sync)
    assert sync.elastic.schedule is None and (state.epoch, state.sample) == (1, 0)


def test_data_that_does_not_start_at_the_committed_sample_is_refused(one_worker):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_every_steps=3)
    sync = _callback(state)
    with pytest.raises(WorkerLostError):
        _fit(model, state, sync, [FailAt(0, 4)])
    sync.elastic.reset("a test")
    state.restore()
    assert state.sample == 3 * BATCH
    whole = tfsync.shard(X, Y, batch_size=BATCH)  # the epoch from its start: not what was committed
    with pytest.raises(ValueError, match="does not start there"):
        model.fit(*whole, batch_size=BATCH, epochs=1, verbose=0, callbacks=[sync])
    tfsync.shard(X, Y, batch_size=BATCH, resume=state)
    with pytest.raises(ValueError, match="fit one epoch per data"):
        model.fit(*whole, batch_size=BATCH, epochs=3, verbose=0, callbacks=[sync])


def test_the_commit_cost_bench_measures_the_default_interval():
    from tfsync.bench import elastic as bench

    assert bench.DEFAULT_COMMIT_EVERY_STEPS == elastic.DEFAULT_COMMIT_EVERY_STEPS
    args = bench.parse_args(["--commit-cost", "--model", "small"])
    assert (args.commit_every, args.steps) == (elastic.DEFAULT_COMMIT_EVERY_STEPS, 501)


def test_local_sgd_commits_after_its_outer_steps(one_worker, monkeypatch):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_every_steps=3)  # rounded up to 4: 2 outer steps
    sync = _callback(state, tfsync.LocalSGD(period=2))
    saves = []
    real_save = state.save
    monkeypatch.setattr(state, "save", lambda: (saves.append(state.sample), real_save()))
    rest = []
    real_at_rest = SyncEngine.at_rest
    monkeypatch.setattr(SyncEngine, "at_rest", lambda engine: rest.append(real_at_rest(engine)) or rest[-1])
    _fit(model, state, sync)
    assert rest == [True] and sync.elastic.deferred == 0  # asked once, after step 4: at rest
    assert saves == [4 * BATCH, 0]  # step 4's sample; the epoch end (step 8)


def test_a_host_check_due_from_a_fits_last_commit_is_made_when_the_next_fit_begins(one_worker, monkeypatch):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_every_steps="epoch")
    sync = _callback(state)
    checks = []
    monkeypatch.setattr(state, "check_host_updates", lambda: checks.append(state.epoch))
    _fit(model, state, sync)
    assert checks == []  # (due after the epoch-end commit: checked when the next epoch begins)
    _fit(model, state, sync)
    assert checks == [1]


def test_a_reset_just_after_an_epoch_end_commit_redoes_nothing(one_worker):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_every_steps=3)
    sync = _callback(state)
    _fit(model, state, sync)
    sync.elastic.reset("a test")
    assert (sync.counts["steps_redone"], sync.counts["samples_redone"]) == (0, 0)


@pytest.mark.parametrize("every_s,sampled_steps", [(1e-9, [2, 3, 4, 5, 6, 7]), (1e9, [2])])
def test_the_callback_commits_by_time_from_the_step_the_workers_mean_step_time_gives(
    one_worker, monkeypatch, every_s, sampled_steps
):
    # the extremes make the step independent of this machine's speed: a bound far below one
    # step commits at every step after the first, one far above none again this epoch
    monkeypatch.setattr("tfsync.keras.commits.FIRST_TIMED_COMMIT_STEPS", 2)
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_every_steps="auto", commit_every_s=every_s)
    sync = _callback(state)
    saves = []
    real_save = state.save
    monkeypatch.setattr(state, "save", lambda: (saves.append(state.sample), real_save()))
    _fit(model, state, sync)
    assert saves == [s * BATCH for s in sampled_steps] + [0]  # then the epoch end (step 8)
