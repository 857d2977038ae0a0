"""The data position of an elastic job (tfsync/_data.py): how the members share an epoch from a
committed sample, which samples a reset to that commit hands out again, and the helpers that
build a worker's share of NumPy arrays and of a tf.data dataset from it."""

import types

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tfsync
from tfsync import _data
from tfsync._data import plan_epoch, samples_redone


def _trained(plan, steps):
    """The epoch's samples every worker of ``plan`` has trained on after ``steps`` steps."""
    done = plan.rows_done(steps)
    return sorted(int(i) for r in range(plan.size) for i in plan.rows(r)[:done])


@settings(max_examples=200, deadline=None)
@given(
    samples=st.integers(1, 400),
    start_fraction=st.floats(0, 0.99),
    size=st.integers(1, 9),
    batch_size=st.integers(1, 17),
    data=st.data(),
)
def test_after_any_steps_the_job_has_trained_on_exactly_the_samples_before_the_position(
    samples, start_fraction, size, batch_size, data
):
    start = int(start_fraction * samples)
    plan = plan_epoch(samples, start, size, batch_size)
    # every worker takes the same rows and steps; the shares fill [start, end), disjoint unless
    # fewer rows than workers are left (then one each, every row of the rest taken)
    rows = [plan.rows(r) for r in range(size)]
    assert {len(r) for r in rows} == {plan.per_rank}
    if samples - start >= size:
        assert sorted(np.concatenate(rows).tolist()) == list(range(start, plan.end))
    else:
        assert plan.per_rank == 1 and set(np.concatenate(rows).tolist()) == set(range(start, samples))
    assert plan.steps == -(-plan.per_rank // batch_size) >= 1
    assert plan.left_out == samples - plan.end >= 0
    if samples - start >= size * batch_size:  # whole batches wherever the rest holds one per worker
        assert plan.per_rank % batch_size == 0 and plan.left_out < size * batch_size
    steps = data.draw(st.integers(0, plan.steps))
    # a contiguous prefix: one number says what the job has trained on
    assert sorted(set(_trained(plan, steps))) == list(range(start, plan.position(steps)))


@settings(max_examples=200, deadline=None)
@given(
    samples=st.integers(50, 400),
    size_before=st.integers(1, 6),
    size_after=st.integers(1, 6),
    batch_size=st.integers(1, 8),
    data=st.data(),
)
def test_a_reset_redoes_what_was_trained_after_the_commit_and_nothing_before_it(
    samples, size_before, size_after, batch_size, data
):
    before = plan_epoch(samples, 0, size_before, batch_size)
    committed = data.draw(st.integers(0, before.steps - 1))
    failed_at = data.draw(st.integers(committed, before.steps - 1))
    position = before.position(committed)
    after = plan_epoch(samples, position, size_after, batch_size)
    redone = set(_trained(before, failed_at)) - set(_trained(before, committed))
    rest = set(np.concatenate([after.rows(r) for r in range(size_after)]).tolist())
    assert not rest & set(_trained(before, committed))  # nothing committed is trained twice
    # what the reset undid is handed out again, but for the epoch's tail that the new members
    # leave out (fewer than one batch each)
    assert redone <= rest | set(range(after.end, samples))
    assert samples - after.end < max(size_after * batch_size, 1)
    per_worker = samples_redone(before, committed, failed_at)
    assert per_worker * size_before == len(redone)
    assert per_worker <= (failed_at - committed) * batch_size


def test_the_last_share_of_an_epoch_is_one_shorter_step_when_no_batch_is_left_per_worker():
    plan = plan_epoch(100, 90, 3, 8)  # 10 left: 3 each, one step of 3 rows, 1 left out
    assert (plan.per_rank, plan.steps, plan.end, plan.left_out) == (3, 1, 99, 1)
    assert plan.position(1) == 99 and plan.position(5) == 99
    fewer = plan_epoch(100, 98, 3, 8)  # 2 left for 3 workers: one row each, the epoch finished
    assert [fewer.rows(r).tolist() for r in range(3)] == [[98], [99], [98]]
    assert (fewer.steps, fewer.end, fewer.position(1)) == (1, 100, 100)


@pytest.mark.parametrize(
    "args,says",
    [
        ((100, 100, 2, 8), "outside the epoch"),
        ((100, -1, 2, 8), "outside the epoch"),
        ((100, 0, 2, 0), "batch_size >= 1"),
    ],
)
def test_a_plan_that_cannot_be_shared_says_why(args, says):
    with pytest.raises(ValueError, match=says):
        plan_epoch(*args)


class _State:
    """What the helpers read and write of a tfsync.elastic.KerasState."""

    def __init__(self, epoch, sample):
        self.epoch, self.sample, self.plan = epoch, sample, None

    def use_data(self, plan):
        self.plan = plan


@pytest.fixture
def member(monkeypatch):
    """This process as rank ``r`` of ``size`` (set ``member.rank``, ``member.size``)."""
    m = types.SimpleNamespace(rank=0, size=1)
    monkeypatch.setattr(_data, "_membership", lambda: (m.rank, m.size))
    return m


def test_shard_resumes_at_the_committed_sample_of_the_epochs_seeded_order(member):
    x = np.arange(40) * 10
    y = np.arange(40)
    member.rank, member.size = 1, 3
    state = _State(epoch=2, sample=13)
    x_local, y_local = tfsync.shard(x, y, batch_size=4, resume=state, seed=7)
    order = np.random.default_rng([7, 2]).permutation(40)
    assert state.plan == plan_epoch(40, 13, 3, 4, epoch=2)
    assert y_local.tolist() == order[state.plan.rows(1)].tolist()  # the seeded order, from sample 13
    assert x_local.tolist() == (order[state.plan.rows(1)] * 10).tolist()
    member.rank = 0  # the same order on every worker: the shares are disjoint
    y0 = tfsync.shard(y, batch_size=4, resume=_State(2, 13), seed=7)
    assert not set(y0.tolist()) & set(y_local.tolist())


def test_shard_without_resume_is_the_plain_equal_share(member):
    member.rank, member.size = 1, 2
    assert tfsync.shard(np.arange(21), batch_size=4).tolist() == [1, 3, 5, 7, 9, 11, 13, 15]
    with pytest.raises(ValueError, match="seed= shuffles the epoch of the elastic state"):
        tfsync.shard(np.arange(21), batch_size=4, seed=0)
    with pytest.raises(ValueError, match="resume= needs batch_size="):
        tfsync.shard(np.arange(21), resume=_State(0, 0))


def test_shard_dataset_takes_the_same_samples_as_shard(member):
    member.rank, member.size = 2, 3
    y = np.arange(50)
    expected = tfsync.shard(y, batch_size=4, resume=_State(1, 9))
    state = _State(1, 9)
    batches = list(tfsync.shard_dataset(tf.data.Dataset.from_tensor_slices(y), 4, resume=state).as_numpy_iterator())
    assert np.concatenate(batches).tolist() == expected.tolist()
    assert len(batches) == state.plan.steps and {len(b) for b in batches} == {4}
    unknown = tf.data.Dataset.from_tensor_slices(y).filter(lambda v: True)
    with pytest.raises(ValueError, match="pass samples="):
        tfsync.shard_dataset(unknown, 4)
    assert len(list(tfsync.shard_dataset(unknown, 4, samples=50))) == plan_epoch(50, 0, 3, 4).steps
