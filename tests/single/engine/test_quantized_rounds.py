"""Quantized outer rounds (:mod:`tfsync.engine.wire.quantized`) on the in-process fake cluster: the
collective production runs (an alltoall of packed codes, a float32 sum, an all-gather), its
meaning (a mean, or a sum over a divisor), what a rejected contribution sends, 4-bit error
feedback, the bytes on the wire, and the mode's argument and launcher flag."""

import argparse

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, assert_no_errors, on_threads

import tfsync
from tfsync.engine.wire import quantized
from tfsync.engine.wire.layout import META_COLUMNS
from tfsync.launch import add_mode_arguments, mode_from_args

SHAPES = [(40, 30), (7,)]


def payloads(size, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(size)]


def run_rounds(size, quantize, per_rank, rounds=1, present=None, average=True, divisor=None):
    """``rounds`` rounds of ``per_rank[r]`` on every rank: each rank's results, round by round."""
    fake = FakeCluster(size, timeout_s=30)
    present = present if present is not None else [True] * size

    def rank(r):
        collective = quantized.quantized_collective(quantize, average, hvd=fake.rank(r).wire_ops())
        meta = np.zeros((size, META_COLUMNS))
        meta[r, 0] = 1.0 if present[r] else 0.0
        out = []
        for _ in range(rounds):
            payload = per_rank[r] if present[r] else [np.zeros_like(p) for p in per_rank[r]]
            total, wire_meta = collective([tf.constant(p) for p in payload], meta, divisor)
            out.append(([t.numpy() for t in total], wire_meta))
        return out

    results, errors = on_threads([lambda r=r: rank(r) for r in range(size)], 60)
    assert_no_errors(errors)
    return results


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_every_rank_decodes_the_same_bytes_near_the_mean(quantize):
    size = 3
    per_rank = payloads(size)
    results = run_rounds(size, quantize, per_rank)
    mean = [np.mean([p[i] for p in per_rank], axis=0) for i in range(len(SHAPES))]
    qmax = 127 if quantize == "int8" else 7
    for r in range(size):
        total, meta = results[r][0]
        assert [t.shape for t in total] == SHAPES and all(t.dtype == np.float32 for t in total)
        for a, b in zip(total, results[0][0][0]):
            assert a.tobytes() == b.tobytes(), "the replicas decoded different values"
        np.testing.assert_array_equal(meta[:, 0], np.ones(size))  # (the metadata: summed, exact)
    largest = max(float(np.abs(p).max()) for ps in per_rank for p in ps)
    for got, want in zip(results[0][0][0], mean):
        error = np.abs(got - want).max()
        assert 0 < error <= largest / qmax, (error, largest / qmax)  # (the codes went over the wire)


def test_a_rank_not_present_sends_zeros_and_a_divisor_divides_the_sum():
    size = 3
    per_rank = payloads(size, seed=1)
    results = run_rounds(size, "int8", per_rank, present=[True, False, True], average=False, divisor=2)
    want = [(per_rank[0][i] + per_rank[2][i]) / 2 for i in range(len(SHAPES))]
    for got, expected in zip(results[1][0][0], want):
        np.testing.assert_allclose(got, expected, atol=2 * max(np.abs(expected).max(), 1) / 127)


def test_4bit_error_feedback_delivers_what_one_round_would_round_away():
    """Every value of a block but one is 0.1 where the block's scale is 1.0: one round's 4-bit
    code for it is 0.  With error feedback the worker keeps 0.1 a round, sends a 1 when its
    kept error reaches 0.6, and ten rounds deliver their 1.0 in all; the float32 sum was 1.0."""
    values = np.full(quantized.BLOCK, 0.1, np.float32)
    values[0] = 7.0
    per_rank = [[values.copy()] for _ in range(2)]
    fake = FakeCluster(2, timeout_s=30)

    def rank(r):
        collective = quantized.quantized_collective("int4", True, hvd=fake.rank(r).wire_ops())
        meta = np.zeros((2, META_COLUMNS))
        meta[r, 0] = 1.0
        return [collective([tf.constant(per_rank[r][0])], meta)[0][0].numpy() for _ in range(10)]

    results, errors = on_threads([lambda r=r: rank(r) for r in range(2)], 60)
    assert_no_errors(errors)
    delivered = np.sum(results[0], axis=0)
    assert results[0][0][1] == 0.0  # (a round alone rounds 0.1 away)
    np.testing.assert_allclose(delivered[1:], 1.0, atol=1e-6)
    np.testing.assert_allclose(delivered[0], 70.0, atol=1e-4)


@pytest.mark.parametrize("size", [2, 8, 64, 1024])
def test_the_bytes_on_the_wire_shrink_at_any_worker_count(size):
    values = 17_900_000  # (the network bench's large model)
    float32 = quantized.wire_bytes(values, size, None)
    assert float32 == round(2 * (size - 1) / size * 4 * values)
    assert quantized.wire_bytes(values, size, "int8") <= 0.26 * float32
    assert quantized.wire_bytes(values, size, "int4") <= 0.14 * float32


@pytest.mark.parametrize(
    "make,error",
    [
        (lambda: tfsync.LocalSGD(quantize="int2"), r"LocalSGD\(quantize='int2'\): quantize must be None"),
        (lambda: tfsync.DiLoCo(quantize=8), r"DiLoCo\(quantize=8\).*'int8'.*'int4'.*e\.g\. tfsync\.DiLoCo"),
    ],
)
def test_a_bad_quantize_is_refused_naming_the_choices(make, error):
    with pytest.raises(ValueError, match=error):
        make()


@pytest.mark.parametrize("mode", ["localsgd", "diloco"])
def test_the_launcher_flag_sets_it(mode):
    parser = argparse.ArgumentParser()
    add_mode_arguments(parser)
    policy = mode_from_args(parser.parse_args(["--mode", mode, "--quantize", "int4"]))
    assert policy.quantize == "int4" and policy.config()["quantize"] == "int4"
    assert mode_from_args(parser.parse_args(["--mode", mode])).quantize is None
