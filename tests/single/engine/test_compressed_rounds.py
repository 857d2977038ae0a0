"""Rounds sent in 16 bits (``compression=``), and the bytes every round puts on the wire.

The round collective is production's :func:`tfsync.engine.rounds.horovod_collective`
over the in-process ranks of :mod:`fake_cluster`, which sum float16 as Horovod
does (each addition rounded to float16), so the rounding and the overflow seen
here are production's.  Real engines on threads check what the engine does with
it: the mean each rank receives, the contributions it rejects (counted), the
replicas, and the bytes it counts.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, assert_no_errors, on_threads

from tfsync import timeline
from tfsync.engine import NonFiniteError, SyncEngine, rounds
from tfsync.engine.compression import WireBytes, WireFormat
from tfsync.engine.settings import EngineSettings
from tfsync.policies import BSP, PSP, SSP
from tfsync.stragglers import Stragglers

pytestmark = pytest.mark.usefixtures("engines_on_localhost")

JOIN_S = 60.0
META_BYTES = 2 * rounds.META_WIDTH * 4  # two workers' rows of float32 digits


def collect(size, compression, payloads, meta, **kwargs):
    """Every rank's ``(total, meta)`` of one round of ``payloads[rank]``."""
    fake = FakeCluster(size)

    def run(r):
        cluster = fake.rank(r)
        wire = {"compression": compression} if compression else {}
        return cluster.collective(True, **wire)(payloads[r], meta[r], **kwargs)

    results, errors = on_threads([lambda r=r: run(r) for r in range(size)], JOIN_S)
    assert_no_errors(errors)
    return results


def rows(size, rank, push_time):
    meta = np.zeros((size, rounds.META_COLUMNS))
    meta[rank, :4] = (1.0, 12345678, push_time, 0.25)
    return meta


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the sum that overflows, below)
def test_an_fp16_round_is_horovods_float16_reduction_cast_back_and_the_metadata_stays_exact():
    g = [np.array([1.0, 1e-3, 3.14159265, 1e-7], np.float32), np.array([2.0, 2e-3, -1.0, 1e-7], np.float32)]
    ints = [np.array([7, 9], np.int32), np.array([1, 2], np.int32)]
    payloads = [[tf.constant(g[r]), tf.constant(ints[r])] for r in range(2)]
    meta = [rows(2, r, 1e6 + 0.123456 * (r + 1)) for r in range(2)]
    # each rank's values cast to float16, summed in float16, post-scaled in float16 (Horovod's
    # Average: 1 / size; a divisor d: 1 / d), then cast back
    summed = (f16(g[0]).astype(np.float32) + f16(g[1]).astype(np.float32)).astype(np.float16)
    for kwargs, factor in (({}, 0.5), ({"divisor": 1}, 1.0), ({"divisor": 3}, 1.0 / 3.0)):
        results = collect(2, "fp16", payloads, meta, **kwargs)
        plain = collect(2, None, payloads, meta, **kwargs)[0][0]
        expected = (summed.astype(np.float64) * factor).astype(np.float16).astype(np.float32)
        for total, decoded in results:
            assert total[0].dtype == tf.float32
            np.testing.assert_array_equal(total[0].numpy(), expected)
            np.testing.assert_array_equal(total[1].numpy(), plain[1].numpy())  # (integers go as they are)
            np.testing.assert_array_equal(decoded[:, 1], [12345678, 12345678])  # (exact: float32 digits)
            np.testing.assert_array_equal(decoded[:, 2], [1e6 + 0.123456, 1e6 + 0.246912])
        assert not np.array_equal(plain[0].numpy(), expected)  # (the rounding is seen: the test can fail)
    # a finite float16 sum that overflows: what Horovod's Compression.fp16 lets through, and the
    # reason each contribution must keep within WireFormat.limit
    big = [[tf.constant([40000.0])], [tf.constant([40000.0])]]
    assert np.isinf(collect(2, "fp16", big, meta, divisor=1)[0][0][0].numpy()).all()


def test_a_bf16_round_is_the_float32_sum_of_bfloat16_values_in_rank_order():
    g = [np.array([1.0, 1e-3, 3.14159265, 1e30], np.float32), np.array([2.0, 2e-3, -1.0, 1e30], np.float32)]
    payloads = [[tf.constant(g[r])] for r in range(2)]
    meta = [rows(2, r, 5.5) for r in range(2)]
    values = [tf.cast(tf.cast(tf.constant(x), tf.bfloat16), tf.float32).numpy() for x in g]
    for kwargs, factor in (({}, 0.5), ({"divisor": 1}, 1.0), ({"divisor": 3}, 1.0 / 3.0)):
        results = collect(2, "bf16", payloads, meta, **kwargs)
        expected = (values[0] + values[1]) * np.float32(factor) if factor != 1.0 else values[0] + values[1]
        for total, decoded in results:
            np.testing.assert_array_equal(total[0].numpy(), expected)
            np.testing.assert_array_equal(decoded[:, 2], [5.5, 5.5])
        assert not np.array_equal(expected, (g[0] + g[1]) * np.float32(factor))  # (rounded: 8 bits of mantissa)


def test_the_range_a_contribution_must_keep_leaves_the_sum_room():
    fp16 = WireFormat("fp16", 2)
    assert 32500 < fp16.limit < 65504 / 2  # (two rows sum: each keeps under half of float16's range)
    assert WireFormat("fp16", 2, per_rank=2).limit == pytest.approx(fp16.limit / 2)
    assert WireFormat("fp16", 8).limit < 65504 / 8  # (more rows, more rounding room)
    inside, beyond = tf.constant([1.0, -fp16.limit]), tf.constant([1.0, -fp16.limit * 1.001])
    ints = tf.constant([10**6])
    np.testing.assert_array_equal(fp16.in_range([inside, beyond, ints]), [True, False, True])
    np.testing.assert_array_equal(fp16.in_range([tf.constant([np.nan, 1.0]), inside, ints]), [False, True, True])
    assert WireFormat("bf16", 2).limit > 1e38


def test_the_bytes_model_is_a_ring_and_fp16_halves_the_float_payload():
    shapes, dtypes = [[1000, 10], [10], [3]], ["float32", "float32", "int32"]
    payload = (10010 * 4, 3 * 4)  # floating, other
    for size in (2, 4):
        ring = 2 * (size - 1) / size
        meta = size * rounds.META_WIDTH * 4
        plain = WireBytes(size, None, rounds.META_WIDTH).per_call(shapes, dtypes)
        fp16 = WireBytes(size, "fp16", rounds.META_WIDTH).per_call(shapes, dtypes)
        bf16 = WireBytes(size, "bf16", rounds.META_WIDTH).per_call(shapes, dtypes)
        assert plain["bytes_sent"] == plain["bytes_received"] == ring * (sum(payload) + meta)
        assert fp16["uncompressed_bytes_sent"] == plain["bytes_sent"]
        assert fp16["bytes_sent"] == fp16["bytes_received"] == ring * (payload[0] / 2 + payload[1] + meta)
        assert bf16["bytes_sent"] == (size - 1) * payload[0] / 2 + ring * (payload[1] + meta)  # (an allgather)
    assert WireBytes(1, "fp16", rounds.META_WIDTH).per_call(shapes, dtypes)["bytes_sent"] == 0


def train(policy, size=2, steps=6, bad=None, width=5, trace_dir=None, on_nonfinite="reject"):
    """``size`` real engines on threads, each pushing ``grad(rank, step)`` (``bad``: {(rank, step):
    value} put in its first element) and applying what comes back as plain SGD; per rank:
    ``(weights, counts, bytes, means)``."""
    fake = FakeCluster(size, timeout_s=20.0)
    bad = dict(bad or {})
    updates = policy.payload != "gradients"

    def grad(rank, step):
        g = np.linspace(0.1, 1.0, width, dtype=np.float32) * (rank + 1) / (step + 3)
        if (rank, step) in bad:
            g[0] = bad[(rank, step)]
        return g

    def run(rank):
        engine = SyncEngine(
            policy,
            EngineSettings(
                stragglers=Stragglers(), wait_timeout_s=20.0, trace_dir=trace_dir, on_nonfinite=on_nonfinite
            ),
            cluster=fake.rank(rank),
        )
        var = tf.Variable(tf.zeros([width]))
        engine.start([var])
        means = []
        for step in range(steps):
            if not engine.begin_step():
                result = engine.skip_step()
                if not updates:
                    var.assign_sub(0.1 * result[0])
                continue
            g = grad(rank, step)
            if updates:
                var.assign_add(-0.1 * g)
                engine.sync_step([])
                continue
            (mean,) = engine.sync_step([tf.constant(g)])
            means.append(mean.numpy())
            var.assign_sub(0.1 * mean)
        engine.finish(apply_mean=None if updates else (lambda mean: var.assign_sub(0.1 * mean[0])))
        out = var.numpy(), dict(engine.counts), engine.bytes, means, engine.totals
        engine.close()
        return out

    results, errors = on_threads([lambda r=r: run(r) for r in range(size)], JOIN_S)
    if on_nonfinite == "raise":
        return errors
    assert_no_errors(errors)
    return results


def assert_identical_and_counted(results):
    for weights, counts, *_ in results:
        np.testing.assert_array_equal(weights, results[0][0])
        assert np.isfinite(weights).all()
        settled = counts["applied"] + counts["compensated"] + counts["dropped"] + counts["rejected"]
        assert counts["produced"] == settled, counts


def test_bsp_under_fp16_applies_the_rounded_mean_on_every_replica_and_counts_its_bytes():
    steps = 6
    results = train(BSP(compression="fp16"), steps=steps)
    plain = train(BSP(), steps=steps)
    assert_identical_and_counted(results)
    for (_, _, _, means, _), (_, _, _, exact, _) in zip(results, plain):
        for m, e in zip(means, exact):
            np.testing.assert_allclose(m, e, rtol=2e-3)
        assert any(not np.array_equal(m, e) for m, e in zip(means, exact))  # (rounded: the test can fail)
    for (_, _, sent, _, totals), (_, _, plain_sent, _, _) in zip(results, plain):
        # one allreduce per round under the ring model: 2·(n−1)/n of the bytes each way, n = 2
        floats = 5 * 4
        assert sent["uncompressed_bytes_sent"] == plain_sent["bytes_sent"] == steps * (floats + META_BYTES)
        assert sent["bytes_sent"] == sent["bytes_received"] == steps * (floats / 2 + META_BYTES)
        # after = before / 2 for the float32 payload (the metadata is float32 either way)
        assert sent["bytes_sent"] - steps * META_BYTES == (sent["uncompressed_bytes_sent"] - steps * META_BYTES) / 2
        assert totals["bytes_sent"] == sent["bytes_sent"]  # (the epoch's totals: the only epoch here)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_bsp_under_fp16_redoes_a_round_whose_float16_sum_overflowed_without_the_contribution_beyond_range(caplog):
    caplog.set_level(logging.WARNING, logger="tfsync.nonfinite")
    # finite in float32, but its share overflows float16: the round's sum is inf, and is redone
    results = train(BSP(compression="fp16"), steps=4, bad={(0, 2): 1e6})
    assert_identical_and_counted(results)
    (_, counts0, sent, means0, _), (_, counts1, *_) = results
    assert counts0["rejected"] == 1 and counts1["rejected"] == 0, (counts0, counts1)
    assert counts1["applied"] == 4 and counts0["applied"] == 3
    # round 2's mean is rank 1's contribution alone, as every replica applied it
    expected = np.linspace(0.1, 1.0, 5, dtype=np.float32) * 2 / 5
    np.testing.assert_allclose(means0[2], expected, rtol=2e-3)
    assert sent["bytes_sent"] == 5 * (20 / 2 + META_BYTES)  # (4 rounds, one of them sent twice)
    assert any("float16" in r.getMessage() and "rank 0" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("policy", [SSP(staleness=1, compression="fp16"), PSP(min_contributions=2, compression="fp16")])
def test_a_contribution_beyond_float16s_range_is_rejected_before_it_is_sent_and_counted(policy, caplog):
    caplog.set_level(logging.WARNING, logger="tfsync.nonfinite")
    # (SSP pushes the update, -0.1·g: 1e7 makes it beyond float16's range too)
    results = train(policy, steps=5, bad={(1, 3): 1e7})
    assert_identical_and_counted(results)
    (_, counts0, *_), (_, counts1, *_) = results
    assert counts1["rejected"] == 1 and counts0["rejected"] == 0, (counts0, counts1)
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "rank 1" in message and "float16" in message and "compression='bf16'" in message


def test_contributions_within_the_bound_sum_without_overflow_and_one_beyond_it_is_rejected_though_float16_holds_it():
    results = train(PSP(min_contributions=2, compression="fp16"), steps=3, bad={(0, 1): 30000.0, (1, 1): 30000.0})
    assert_identical_and_counted(results)
    assert all(counts["rejected"] == 0 for _, counts, *_ in results)
    assert all(means[1][0] == 30000.0 for *_, means, _ in results)  # (their float16 sum: 60000, finite)
    # 40000 is a float16 value, but two of them sum to an infinity: rejected before it is sent
    results = train(PSP(min_contributions=2, compression="fp16"), steps=3, bad={(0, 1): 40000.0})
    assert_identical_and_counted(results)
    assert [counts["rejected"] for _, counts, *_ in results] == [1, 0]


def test_the_trace_carries_every_rounds_bytes_and_the_timeline_adds_them_up(tmp_path):
    results = train(SSP(staleness=2, compression="fp16"), steps=5, trace_dir=str(tmp_path))
    summary = timeline.summarize(timeline.load_trace(str(tmp_path)))
    for rank, (_, _, sent, _, _) in enumerate(results):
        for key in ("bytes_sent", "bytes_received", "uncompressed_bytes_sent"):
            assert summary["ranks"][rank][key] == sent[key] > 0


def test_under_on_nonfinite_raise_a_contribution_beyond_the_bound_stops_the_job_saying_what_to_do():
    errors = train(SSP(staleness=0, compression="fp16"), steps=4, bad={(1, 2): 1e7}, on_nonfinite="raise")
    assert all(isinstance(e, NonFiniteError) for e in errors), errors
    message = str(errors[1])
    assert "rank 1" in message and "step 2" in message and "float16" in message  # what, where
    assert "compression='bf16'" in message and "on_nonfinite='reject'" in message  # the ways out
