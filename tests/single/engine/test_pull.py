"""PSP's partial pulling: the block partition, the worker's block queues (in-order
application, ``⌈b·B⌉`` and ``τ2``, late blocks, the drain, the bound), its settings,
the simulated slow pulls, and what refuses it."""

import argparse
import time

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tfsync
from tfsync.engine.components.pull import BlockPull, PartialPull, partition
from tfsync.engine.protocols.gradient import check_blockwise_optimizer
from tfsync.engine.settings import EngineSettings
from tfsync.launch import add_mode_arguments, describe_mode, mode_from_args

# ------------------------------------------------------------------ the partition


@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30), data=st.data())
def test_partition_covers_every_tensor_once_in_order_in_nonempty_blocks(sizes, data):
    blocks = data.draw(st.integers(1, len(sizes)))
    groups = partition(sizes, blocks)
    assert len(groups) == blocks
    assert all(groups)
    assert [i for g in groups for i in g] == list(range(len(sizes)))


def test_partition_balances_by_size():
    assert partition([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert partition([1, 1, 1000, 1, 1], 3) == [[0, 1], [2], [3, 4]]
    assert partition([100, 1, 50, 1], 2) == [[0], [1, 2, 3]]


def test_partition_refuses_more_blocks_than_tensors():
    with pytest.raises(ValueError, match="cannot split 2 weight tensors into 3"):
        partition([4, 4], 3)


# ------------------------------------------------------------------ the block queues


class Recorder:
    """An applier that records what it was given, in order."""

    def __init__(self):
        self.applied, self.settled = [], []

    def apply(self, block, round_, tensors):
        self.applied.append((block, round_, list(tensors)))

    def settle(self, rounds):
        self.settled.append(rounds)


class Clock:
    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self):
        return time.monotonic() - self.t0


def pull_with(delays_per_round, need=2, timeout_s=None, blocks=3):
    """A BlockPull over ``blocks`` one-tensor blocks whose round ``r`` lands ``delays_per_round[r]`` late."""
    rounds = iter(delays_per_round)
    pull = BlockPull([[j] for j in range(blocks)], need, timeout_s, lambda n: np.asarray(next(rounds), float))
    pull.applier = Recorder()
    return pull


def total(round_, blocks=3):
    return [np.full(2, 10.0 * round_ + j) for j in range(blocks)]


def test_a_step_goes_on_with_need_blocks_and_the_late_one_is_applied_when_it_lands():
    clock = Clock()
    pull = pull_with([[0.0, 0.0, 0.3]])
    pull.land(0, total(0), clock())
    waited = pull.wait(0, clock, time.monotonic() + 5)
    assert waited < 0.2  # two of three blocks were there: no wait for the third
    pull.apply_arrived(clock())
    assert [(b, r) for b, r, _ in pull.applier.applied] == [(0, 0), (1, 0)]
    assert pull.queued == 1
    time.sleep(0.35)
    pull.apply_arrived(clock())
    assert [(b, r) for b, r, _ in pull.applier.applied] == [(0, 0), (1, 0), (2, 0)]
    np.testing.assert_array_equal(pull.applier.applied[-1][2][0], total(0)[2])
    assert pull.counts == {"blocks": 3, "late_blocks": 1, "delayed_blocks": 1}
    assert pull.applier.settled == [1, 1]


def test_a_newer_round_of_a_block_never_overtakes_an_older_one():
    clock = Clock()
    # block 0 of round 0 is 0.3 s late; round 1's block 0 lands at once but must wait behind it
    pull = pull_with([[0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    pull.land(0, total(0), clock())
    pull.wait(0, clock, time.monotonic() + 5)
    pull.apply_arrived(clock())
    pull.land(1, total(1), clock())
    pull.wait(1, clock, time.monotonic() + 5)  # blocks 1 and 2 of round 1: enough
    pull.apply_arrived(clock())
    assert [(b, r) for b, r, _ in pull.applier.applied] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    pull.drain(clock, time.monotonic() + 5)
    order = [(b, r) for b, r, _ in pull.applier.applied]
    assert order[4:] == [(0, 0), (0, 1)]  # in round order, once round 0's landed
    assert pull.counts["late_blocks"] == 2  # round 1's block 0 was late too (behind round 0's)
    assert pull.queued == 0


class RecorderAll(Recorder):
    """An applier that can take a whole round at once."""

    def apply_all(self, round_, tensors):
        self.applied.append(("all", round_, list(tensors)))


def test_a_round_whose_blocks_all_arrive_together_is_applied_in_one_call():
    clock = Clock()
    rounds = iter([[0.0, 0.0, 0.0], [0.0, 0.3, 0.0], [0.0, 0.0, 0.0]])
    # blocks of two tensors, one and one: the whole round comes back in the weights' order
    pull = BlockPull([[0, 1], [2], [3]], 2, None, lambda n: np.asarray(next(rounds), float))
    pull.applier = RecorderAll()
    four = [np.full(2, float(i)) for i in range(4)]
    for r in range(3):
        pull.land(r, [t + 10 * r for t in four], clock())
        pull.wait(r, clock, time.monotonic() + 5)
        pull.apply_arrived(clock())
    pull.drain(clock, time.monotonic() + 5)
    calls = [(b, r) for b, r, _ in pull.applier.applied]
    # round 1's block 1 was late, so round 1 and round 2 go block by block (round 2's block 1
    # waits behind round 1's); round 0 is one call
    assert calls == [("all", 0), (0, 1), (2, 1), (0, 2), (2, 2), (1, 1), (1, 2)]
    np.testing.assert_array_equal(np.stack(pull.applier.applied[0][2]), np.stack(four))
    assert pull.counts["blocks"] == 9 and pull.counts["late_blocks"] == 2


def test_the_steps_own_round_arrived_whole_is_handed_back_with_the_step_count_at_its_round():
    clock = Clock()
    rounds = iter([[0.0, 0.3, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    pull = BlockPull([[0], [1], [2]], 2, None, lambda n: np.asarray(next(rounds), float))
    pull.applier = RecorderAll()
    pull.land(0, total(0), clock())
    pull.wait(0, clock, time.monotonic() + 5)
    assert pull.apply_arrived(clock(), hand_back=0) is None  # block 1 is late: not whole
    time.sleep(0.35)
    pull.land(1, total(1), clock())
    pull.wait(1, clock, time.monotonic() + 5)
    handed = pull.apply_arrived(clock(), hand_back=1)
    # round 0's late block applied here, round 1 whole: handed back, not applied
    assert [(b, r) for b, r, _ in pull.applier.applied] == [(0, 0), (2, 0), (1, 0)]
    np.testing.assert_array_equal(np.stack(handed), np.stack(total(1)))
    assert pull.applier.settled[-1] == 1  # the caller's apply takes the count from 1 to 2
    pull.land(2, total(2), clock())
    pull.wait(2, clock, time.monotonic() + 5)
    assert pull.apply_arrived(clock()) is None  # no hand-back asked: applied in one call
    assert pull.applier.applied[-1][:2] == ("all", 2) and pull.applier.settled[-1] == 3
    assert pull.counts["blocks"] == 9 and pull.queued == 0


def test_the_wait_is_for_need_blocks_when_fewer_have_arrived():
    clock = Clock()
    pull = pull_with([[0.0, 0.2, 0.4]], need=2)
    pull.land(0, total(0), clock())
    waited = pull.wait(0, clock, time.monotonic() + 5)
    assert 0.15 <= waited < 0.35  # for the second block, not the third
    pull.apply_arrived(clock())
    assert sorted(b for b, _, _ in pull.applier.applied) == [0, 1]


@pytest.mark.parametrize(
    "timeout_s,low,high,applied",
    [
        (None, 0.05, 0.2, [0, 1]),  # go on at the 2nd block (tau2 = 0, the paper's setting)
        (0.2, 0.2, 0.45, [0, 1]),  # wait up to 0.2 s more for the 3rd, which comes at 0.5 s
        (0.8, 0.45, 0.75, [0, 1, 2]),  # the 3rd comes within tau2: go on once all are there
    ],
)
def test_the_pull_timeout_is_a_wait_for_more_blocks_once_enough_arrived(timeout_s, low, high, applied):
    clock = Clock()
    pull = pull_with([[0.0, 0.05, 0.5]], need=2, timeout_s=timeout_s)
    pull.land(0, total(0), clock())
    waited = pull.wait(0, clock, time.monotonic() + 5)
    assert low <= waited < high
    pull.apply_arrived(clock())
    assert sorted(b for b, _, _ in pull.applier.applied) == applied


def test_the_pull_timeout_never_lets_a_step_go_with_fewer_than_need_blocks():
    clock = Clock()
    pull = pull_with([[0.0, 0.3, 0.3]], need=2, timeout_s=0.0)
    pull.land(0, total(0), clock())
    assert pull.wait(0, clock, time.monotonic() + 5) >= 0.25  # one block at once, the 2nd at 0.3 s


def test_a_wait_past_its_bound_raises_instead_of_hanging():
    clock = Clock()
    pull = pull_with([[5.0, 5.0, 5.0]], need=1)
    pull.land(0, total(0), clock())
    with pytest.raises(TimeoutError, match="round 0"):
        pull.wait(0, clock, time.monotonic() + 0.2)
    with pytest.raises(TimeoutError, match="3 blocks"):
        pull.drain(clock, time.monotonic() + 0.2)


# ------------------------------------------------------------------ the settings


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(pull_fraction=0.0), ValueError, r"a number in \(0, 1\]"),
        (dict(pull_fraction=1.5), ValueError, r"a number in \(0, 1\]"),
        (dict(pull_fraction="0.5"), TypeError, "must be a number"),
        (dict(pull_fraction=True), TypeError, "must be a number"),
        (dict(pull_fraction=0.5, pull_timeout_s=-1), ValueError, ">= 0"),
        (dict(pull_fraction=0.5, pull_timeout_s=float("nan")), ValueError, ">= 0"),
        (dict(pull_fraction=0.5, pull_timeout_s="1"), TypeError, "number of seconds"),
        (dict(pull_fraction=0.5, pull_blocks=0), ValueError, "pull_blocks must be >= 1"),
        (dict(pull_fraction=0.5, pull_blocks=2.0), TypeError, "must be an int"),
        (dict(pull_blocks=4), ValueError, "act only with partial pulling"),
        (dict(pull_timeout_s=0.1), ValueError, "act only with partial pulling"),
        (dict(pull_fraction=0.5, compensate=tfsync.DelayCompensation()), ValueError, "cannot be combined"),
    ],
)
def test_psp_refuses_bad_pull_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        tfsync.PSP(**kwargs)


def test_blocks_needed_is_the_ceiling_of_b_times_blocks():
    assert tfsync.PSP(pull_fraction=0.9).blocks_needed(10) == 9
    assert tfsync.PSP(pull_fraction=0.75).blocks_needed(4) == 3
    assert tfsync.PSP(pull_fraction=0.7).blocks_needed(4) == 3
    assert tfsync.PSP(pull_fraction=0.01).blocks_needed(4) == 1
    assert tfsync.PSP().blocks_needed(4) == 4 and not tfsync.PSP().pulls_partially


@pytest.mark.parametrize(
    "optimizer,problem",
    [
        (keras.optimizers.SGD(0.1, global_clipnorm=1.0), "global_clipnorm"),
        (keras.optimizers.Adam(use_ema=True), "use_ema"),
        (keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), "gradient_accumulation_steps"),
        (keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), "loss scaling"),
    ],
)
def test_an_optimizer_that_couples_the_weights_is_refused(optimizer, problem):
    with pytest.raises(ValueError, match=problem) as info:
        check_blockwise_optimizer(optimizer, tfsync.PSP(pull_fraction=0.5))
    assert "pull_fraction=1.0" in str(info.value)
    check_blockwise_optimizer(keras.optimizers.Adam(clipnorm=1.0), tfsync.PSP(pull_fraction=0.5))


def test_the_strategy_and_auto_mode_refuse_partial_pulling():
    with pytest.raises(ValueError, match="only tfsync.keras.SyncCallback"):
        tfsync.distribute.SyncStrategy(mode=tfsync.PSP(pull_fraction=0.5))
    with pytest.raises(ValueError, match="pulls partially"):
        tfsync.Auto(modes={"rare": tfsync.PSP(pull_fraction=0.5)})


def _args(*argv):
    p = argparse.ArgumentParser()
    add_mode_arguments(p)
    return p.parse_args(list(argv))


def test_the_command_line_sets_partial_pulling_on_psp_only():
    policy = mode_from_args(_args("--mode", "psp", "--pull-fraction", "0.75", "--pull-blocks", "2"))
    assert policy == tfsync.PSP(pull_fraction=0.75, pull_blocks=2)
    assert describe_mode(policy) == "psp(pull=0.75, B=2)"
    assert describe_mode(tfsync.PSP()) == "psp"
    with pytest.raises(SystemExit, match="use them with --mode psp"):
        mode_from_args(_args("--mode", "backup", "--pull-fraction", "0.5"))


# ------------------------------------------------------------------ slow pulls


def test_slow_pulls_parse_and_leave_the_step_delays_unchanged():
    spec = tfsync.Stragglers.parse("base=0.01,jitter=0.02,pull=0.25:0.5,seed=3")
    assert (spec.pull_prob, spec.pull_s) == (0.25, 0.5)
    assert tfsync.Stragglers.parse(spec.spec()) == spec
    without = tfsync.Stragglers(base_s=0.01, jitter_s=0.02, seed=3).for_rank(1)
    with_pulls = spec.for_rank(1)
    draws = [with_pulls.pull_delays_s(4) for _ in range(200)]
    assert [with_pulls.next_delay_s() for _ in range(50)] == [without.next_delay_s() for _ in range(50)]
    draws = np.concatenate(draws)
    assert set(np.unique(draws)) == {0.0, 0.5}
    assert 0.15 < np.mean(draws > 0) < 0.35
    again = tfsync.Stragglers.parse(spec.spec()).for_rank(1)
    np.testing.assert_array_equal(np.concatenate([again.pull_delays_s(4) for _ in range(200)]), draws)


@pytest.mark.parametrize("spec", ["pull=1.5:1", "pull=0.1:-1", "pull=0.1"])
def test_bad_slow_pull_specs_are_refused(spec):
    with pytest.raises(ValueError, match="pull"):
        tfsync.Stragglers.parse(spec)


def test_more_blocks_than_weight_tensors_is_refused_before_training():
    pull = PartialPull(tfsync.PSP(pull_fraction=0.5, pull_blocks=5))
    with pytest.raises(ValueError, match=r"pull_blocks=5\) with a model of 4 weight tensors \(40 parameters\)"):
        pull.plan([[10]] * 4, 40)
    assert pull.plan([[10]] * 5, 50) == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(0.01),
        lambda: keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)),
    ],
    ids=["momentum", "adam", "adamw_schedule"],
)
def test_blocks_applied_late_through_the_optimizer_end_as_if_on_time(make):
    # the applier the callback uses: round r's block through the optimizer with its step count
    # set to r; blocks applied out of step (each block's rounds in order) end as the whole rounds
    import tensorflow as tf

    from tfsync.engine.protocols.gradient import OptimizerBlocks

    rng = np.random.default_rng(0)
    shapes = [(3, 2), (2,), (4,)]
    rounds = [[rng.normal(size=s).astype("float32") for s in shapes] for _ in range(5)]

    def variables():
        return [keras.Variable(np.ones(s, "float32")) for s in shapes]

    on_time, opt_a = variables(), make()
    for grads in rounds:
        opt_a.apply_gradients(zip([tf.constant(g) for g in grads], on_time))

    late, opt_b = variables(), make()
    groups = [[0], [1, 2]]
    blocks = OptimizerBlocks(opt_b, type(opt_b).apply_gradients.__get__(opt_b), late, groups)
    # block 1 lags: rounds 0-2 of block 0 first, then block 1's 0-3, round 3 of block 0, round 4 whole
    order = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (0, 3)]
    for j, r in order:
        blocks.apply(j, r, [tf.constant(rounds[r][i]) for i in groups[j]])
    blocks.settle(4)
    blocks.apply_all(4, [tf.constant(g) for g in rounds[4]])
    blocks.settle(5)

    for a, b in zip(on_time, late):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-6, atol=1e-7)
    for a, b in zip(opt_a.variables, opt_b.variables):
        np.testing.assert_allclose(np.asarray(b.numpy(), float), np.asarray(a.numpy(), float), rtol=1e-6, atol=1e-7)
    assert int(opt_b.iterations.numpy()) == 5


# ------------------------------------------------------------------ real engines, fake ranks


class ArrayApplier:
    """A rank's weights as NumPy arrays; applying a mean subtracts it.  Records, per block,
    the rounds in the order they were applied."""

    def __init__(self, groups, tensors):
        self.groups = groups
        self.weights = [np.zeros(4, np.float32) for _ in range(tensors)]
        self.order = [[] for _ in groups]

    def apply(self, block, round_, tensors):
        for i, t in zip(self.groups[block], tensors):
            self.weights[i] = self.weights[i] - t.numpy()
        self.order[block].append(round_)

    def apply_all(self, round_, tensors):
        for j in range(len(self.groups)):
            self.apply(j, round_, [tensors[i] for i in self.groups[j]])

    def settle(self, rounds):
        pass


@pytest.mark.usefixtures("engines_on_localhost")
@pytest.mark.parametrize("seed", [1, 2])
def test_real_engines_under_slow_pulls_apply_every_block_in_round_order_and_end_identical(tmp_path, seed):
    import random

    from fake_cluster import FakeCluster, assert_no_errors, on_threads

    size, steps, tensors = 3, 40, 3
    policy = tfsync.PSP(push_timeout_s=0.0, pull_fraction=0.6)  # 2 of 3 blocks
    pulls = tfsync.Stragglers(pull_prob=0.08, pull_s=0.03, seed=seed)
    cluster = FakeCluster(size, timeout_s=15.0)
    engines = [
        tfsync.engine.SyncEngine(policy, EngineSettings(stragglers=pulls, wait_timeout_s=15.0), cluster=cluster.rank(r))
        for r in range(size)
    ]
    seen = [[] for _ in range(size)]  # (step, blocks of its round applied when the step returned)

    def train(rank):
        import tensorflow as tf

        engine, rng = engines[rank], random.Random(seed * 10 + rank)
        engine.start([tf.zeros([4]) for _ in range(tensors)])
        pull = engine.find(PartialPull)
        applier = ArrayApplier(pull.groups, tensors)
        pull.applier = applier
        for step in range(steps):
            if engine.begin_step():
                time.sleep(rng.uniform(0.0, 0.004))
                grads = [tf.constant(np.full(4, (rank + 1) * (step + 1) * (i + 1), np.float32)) for i in range(3)]
                *mean, whole = engine.sync_step(grads)
                if whole:  # what the compiled step does with a round handed back whole
                    applier.apply_all(step, mean)
                seen[rank].append((step, sum(step in order for order in applier.order)))
            else:
                engine.skip_step()
        engine.finish()
        counts, pull = dict(engine.counts), pull.counts
        engine.close()
        return applier, counts, pull

    results, errors = on_threads([lambda r=r: train(r) for r in range(size)], timeout_s=60)
    assert_no_errors(errors)
    for rank, (applier, counts, pull) in enumerate(results):
        # every block applied every round once, in round order
        assert applier.order == [list(range(steps))] * tensors, (rank, applier.order)
        # a step went on with at least 2 of its round's 3 blocks applied
        assert all(n >= 2 for _, n in seen[rank]), (rank, seen[rank])
        assert counts["produced"] == counts["applied"] + counts["dropped"], counts
        assert pull["blocks"] == steps * tensors, pull
    for applier, _, _ in results[1:]:  # the same means in the same order: bit-identical
        for a, b in zip(applier.weights, results[0][0].weights):
            np.testing.assert_array_equal(a, b)
    assert sum(p["delayed_blocks"] for _, _, p in results) > 0
    assert sum(p["late_blocks"] for _, _, p in results) > 0  # some step went on without a block
