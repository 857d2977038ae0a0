"""Commits on storage (``KerasState(commit_dir=...)``, ``TFSYNC_COMMIT_DIR``): rank 0 writes each commit,
a fresh rank 0 restarts from it, another job's commit is refused, a failed write is said and counted
(the launches are tests/parallel/test_elastic_launcher.py)."""

import logging
import os

import keras
import numpy as np
import pytest
from fake_cluster import FakeCluster

import tfsync.elastic as elastic
from tfsync._commit_store import FILE_NAME


def _model(seed=0, units=2):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    return model


def _train_one_step(model):
    model.train_on_batch(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"))


def _values(state):
    return [v.numpy().copy() for v in state._variables()]


class Rank:
    """What the state asks of ``horovod.tensorflow``: this process's rank."""

    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


@pytest.fixture
def rank(monkeypatch):
    """Set this process's rank; the state's collectives run on a one-rank in-process cluster."""
    hvd = Rank(0)
    monkeypatch.setattr(elastic.loop._horovod, "horovod", lambda: hvd)
    cluster = FakeCluster(1).rank(0)
    monkeypatch.setattr(elastic.KerasState, "_collective", lambda self, fn, name, purpose: fn(cluster))
    monkeypatch.delenv("TFSYNC_COMMIT_DIR", raising=False)
    return hvd


def test_a_fresh_rank_0_restarts_from_the_commit_on_storage_and_counts_a_reset(tmp_path, rank):
    model = _model(seed=0)
    state = elastic.KerasState(model, epoch=0, scale=1.0, commit_dir=tmp_path)
    _train_one_step(model)
    state.epoch, state.sample, state.scale, state.resets = 3, 160, 0.5, 2
    state.counts["produced"] = state.counts["applied"] = 40
    state.save()
    assert state.flush_storage(10)
    assert os.path.exists(tmp_path / FILE_NAME) and state._store.written == 1
    committed = _values(state)

    fresh_model = _model(seed=1)  # other weights, an optimizer that never stepped
    fresh = elastic.KerasState(fresh_model, epoch=0, scale=1.0, commit_dir=tmp_path)
    assert not np.array_equal(_values(fresh)[0], committed[0])
    fresh.sync()
    assert all(np.array_equal(a, b) for a, b in zip(_values(fresh), committed, strict=True))
    assert int(fresh_model.optimizer.iterations.numpy()) == 1
    assert (fresh.epoch, fresh.sample, fresh.scale, fresh.counts["produced"]) == (3, 160, 0.5, 40)
    assert fresh.resets == 3  # the restart counts as a reset
    fresh.epoch = 9  # the synchronized state is the commit: a restore goes back to it
    fresh.restore()
    assert fresh.epoch == 3 and fresh.resets == 3


def test_a_rank_0_whose_commit_is_as_far_or_further_keeps_its_own(tmp_path, rank):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_dir=tmp_path)
    state.epoch, state.sample = 2, 32
    state.save()
    state.flush_storage(10)
    state.sync()  # as far: its own
    assert (state.epoch, state.sample, state.resets) == (2, 32, 0)
    rank._rank = 1  # a commit that did not reach storage (made while another process was rank 0)
    _train_one_step(model)
    state.sample = 48
    state.save()
    mine = _values(state)
    rank._rank = 0
    state.sync()  # further: its own
    assert (state.epoch, state.sample, state.resets) == (2, 48, 0)
    assert all(np.array_equal(a, b) for a, b in zip(_values(state), mine, strict=True))


def test_only_rank_0_writes_and_reads_the_commit(tmp_path, rank):
    rank._rank = 1
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_dir=tmp_path)
    state.epoch = 4
    state.save()
    state.flush_storage(10)
    assert not os.path.exists(tmp_path / FILE_NAME)
    rank._rank = 0
    state.save()
    state.flush_storage(10)
    rank._rank = 1
    other = elastic.KerasState(_model(seed=1), epoch=0, commit_dir=tmp_path)
    other.sync()  # (a rank other than 0 takes rank 0's state by the broadcast, not from storage)
    assert other.epoch == 0 and other.resets == 0


def test_the_writer_keeps_the_newest_commit_and_the_file_holds_a_whole_one(tmp_path, rank):
    model = _model()
    state = elastic.KerasState(model, epoch=0, commit_dir=tmp_path)
    for sample in range(0, 20 * 16, 16):
        state.sample = sample
        state.save()
    assert state.flush_storage(10)
    meta, values = state._store.read()
    assert meta["position"] == (0, 19 * 16) and meta["attrs"]["sample"] == 19 * 16
    assert 1 <= state._store.written <= 20  # (queued commits replaced by newer ones are not written)
    assert [v.shape for v in values] == [v.shape for v in _values(state)]
    assert not [p for p in os.listdir(tmp_path) if p != FILE_NAME]  # no partial file left


def test_the_directory_comes_from_tfsync_commit_dir(tmp_path, rank, monkeypatch):
    monkeypatch.setenv("TFSYNC_COMMIT_DIR", str(tmp_path / "job"))
    state = elastic.KerasState(_model(), epoch=0)
    assert state.commit_dir == str(tmp_path / "job") and os.path.isdir(tmp_path / "job")
    monkeypatch.delenv("TFSYNC_COMMIT_DIR")
    assert elastic.KerasState(_model(), epoch=0).commit_dir is None


@pytest.mark.parametrize(
    "other,says",
    [
        (lambda: _model(units=5), r"variable 0 \(.*kernel\) is float32\[3, 2\] there and float32\[3, 5\] here"),
        (lambda: _model(), r"its attributes are \['counts', 'epoch', 'resets', 'sample', 'scale'\]"),
    ],
)
def test_a_directory_holding_another_models_or_states_commit_is_refused_before_any_work(tmp_path, rank, other, says):
    state = elastic.KerasState(_model(), epoch=0, scale=1.0, commit_dir=tmp_path)
    state.save()
    state.flush_storage(10)
    with pytest.raises(ValueError, match=says) as info:
        elastic.KerasState(other(), epoch=0, commit_dir=tmp_path)
    assert "remove" in str(info.value) and "a directory of this job's own" in str(info.value)


def test_a_directory_that_cannot_be_made_is_refused(tmp_path, rank):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"commit_dir=.*cannot be created.*every host of the job can write"):
        elastic.KerasState(_model(), epoch=0, commit_dir=tmp_path / "file" / "job")


def test_a_file_that_is_no_commit_is_refused(tmp_path, rank):
    np.savez(tmp_path / FILE_NAME, meta=np.frombuffer(b"not a pickle", np.uint8))
    with pytest.raises(ValueError, match="is not a commit tfsync wrote.*remove it"):
        elastic.KerasState(_model(), epoch=0, commit_dir=tmp_path)


def test_a_failed_write_is_said_and_counted_and_training_goes_on(tmp_path, rank, monkeypatch, caplog):
    state = elastic.KerasState(_model(), epoch=0, commit_dir=tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    with caplog.at_level(logging.WARNING, logger="tfsync.elastic"):
        state.epoch = 1
        state.save()
        assert state.flush_storage(10)
    assert state._store.failed == 1 and state._store.written == 0
    assert "could not be written" in caplog.text and "No space left on device" in caplog.text
    assert not os.listdir(tmp_path)  # (the partial file removed)
    state.restore()  # the commit is still in memory
    assert state.epoch == 1
