"""Rounds sent in 16 bits (``compression=``), and the bytes every round puts on the wire.

The round collective is production's :func:`tfsync.engine.wire.horovod.horovod_collective`
over the in-process ranks of :mod:`fake_cluster` (a float16 allreduce that rounds each
addition as Gloo's ring does, an alltoall and an all-gather that move bytes as Horovod's
do), so the rounding and the overflow seen here are production's.  Real engines on
threads check what the engine does with it: the mean each rank receives, the
contributions it rejects (counted), the replicas, and the bytes it counts.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, assert_no_errors, on_threads

from tfsync import timeline
from tfsync.engine import NonFiniteError, SyncEngine
from tfsync.engine.settings import EngineSettings
from tfsync.engine.wire import layout
from tfsync.engine.wire.compression import WireFormat
from tfsync.engine.wire.counting import WireBytes
from tfsync.engine.wire.horovod import horovod_collective
from tfsync.policies import BSP, PSP, SSP
from tfsync.stragglers import Stragglers

pytestmark = pytest.mark.usefixtures("engines_on_localhost")

JOIN_S = 60.0
META_BYTES = 2 * layout.META_WIDTH * 4  # two workers' rows of float32 digits


def collect(size, compression, payloads, meta, **kwargs):
    """Every rank's ``(total, meta)`` of one round of ``payloads[rank]``."""
    fake = FakeCluster(size)

    def run(r):
        cluster = fake.rank(r)
        wire = {"compression": compression} if compression else {}
        return horovod_collective(True, hvd=cluster.wire_ops(), **wire)(payloads[r], meta[r], **kwargs)

    results, errors = on_threads([lambda r=r: run(r) for r in range(size)], JOIN_S)
    assert_no_errors(errors)
    return results


def rows(size, rank, push_time):
    meta = np.zeros((size, layout.META_COLUMNS))
    meta[rank, :4] = (1.0, 12345678, push_time, 0.25)
    return meta


def on_wire(x, compression):
    """``x`` rounded to the wire type, back in float32."""
    dtype = {"fp16": tf.float16, "bf16": tf.bfloat16}[compression]
    return tf.cast(tf.cast(tf.constant(np.asarray(x, np.float32)), dtype), tf.float32).numpy()


def reduced(values, factor, compression):
    """A compressed round's result: each rank's values rounded to the wire type and summed,
    each addition rounded to float16 (fp16: a float16 allreduce) or the float32 sum rounded
    to bfloat16 once (bf16: alltoall, float32 sums, all-gather), then scaled in float32."""
    total = on_wire(values[0], compression)
    for v in values[1:]:
        total = total + on_wire(v, compression)
        if compression == "fp16":
            total = on_wire(total, compression)
    return on_wire(total, compression) * np.float32(factor)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
@pytest.mark.parametrize("size", [2, 3])
def test_a_compressed_round_sums_the_wire_values_scales_the_sum_and_keeps_the_metadata_exact(compression, size):
    # bf16, 3 ranks: 5 values make chunks of 2, the last padded (alltoall, float32 sums, all-gather)
    base = np.array([1.0, 1e-3, 3.14159265, 1e-7, -7.5], np.float32)
    g = [base * (r + 1) + np.float32(0.01 * r) for r in range(size)]
    ints = [np.array([7, 9], np.int32) + r for r in range(size)]
    payloads = [[tf.constant(g[r]), tf.constant(ints[r])] for r in range(size)]
    meta = [rows(size, r, 1e6 + 0.123456 * (r + 1)) for r in range(size)]
    for kwargs, factor in (({}, 1.0 / size), ({"divisor": 1}, 1.0), ({"divisor": 3}, 1.0 / 3.0)):
        results = collect(size, compression, payloads, meta, **kwargs)
        plain = collect(size, None, payloads, meta, **kwargs)[0][0]
        expected = reduced(g, factor, compression)
        for total, decoded in results:
            assert total[0].dtype == tf.float32
            np.testing.assert_array_equal(total[0].numpy(), expected)
            np.testing.assert_array_equal(total[1].numpy(), plain[1].numpy())  # (integers go as they are)
            np.testing.assert_array_equal(decoded[:, 1], [12345678] * size)  # (exact: float32 digits)
            np.testing.assert_array_equal(decoded[:, 2], [1e6 + 0.123456 * (r + 1) for r in range(size)])
        assert not np.array_equal(plain[0].numpy(), expected)  # (the rounding is seen: the test can fail)


@pytest.mark.parametrize("compression, ulp, summed", [("fp16", 2.0**-10, 1.0), ("bf16", 2.0**-7, 1.0 + 2.0**-7)])
def test_fp16_rounds_each_addition_as_horovods_float16_allreduce_and_bf16_rounds_its_sum_once(compression, ulp, summed):
    # 1 + ulp/2 is a tie at 1 (rounds to even, 1): a float16 ring rounds 1 + ulp/2 back to 1 at
    # each addition; a float32 sum of the three, 1 + ulp, is a value of the wire type
    payloads = [[tf.constant([v])] for v in (1.0, ulp / 2, ulp / 2)]
    meta = [rows(3, r, 1.0) for r in range(3)]
    for total, _ in collect(3, compression, payloads, meta, divisor=1):
        assert total[0].numpy()[0] == summed


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_a_finite_fp16_sum_beyond_float16s_range_arrives_as_an_infinity():
    # what Horovod's Compression.fp16 lets through too, and the reason each contribution must
    # keep within WireFormat.limit
    big = [[tf.constant([40000.0])], [tf.constant([40000.0])]]
    meta = [rows(2, r, 1.0) for r in range(2)]
    assert np.isinf(collect(2, "fp16", big, meta, divisor=1)[0][0][0].numpy()).all()
    # and so is its mean: the sum is scaled after it crossed the wire
    assert np.isinf(collect(2, "fp16", big, meta)[0][0][0].numpy()).all()


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
        meta = size * layout.META_WIDTH * 4
        plain = WireBytes(size, None, layout.META_WIDTH).per_call(shapes, dtypes)
        fp16 = WireBytes(size, "fp16", layout.META_WIDTH).per_call(shapes, dtypes)
        bf16 = WireBytes(size, "bf16", layout.META_WIDTH).per_call(shapes, dtypes)
        assert plain["bytes_sent"] == plain["bytes_received"] == ring * (sum(payload) + meta)
        assert fp16["uncompressed_bytes_sent"] == plain["bytes_sent"]
        # fp16: a float16 allreduce, the ring of the floating values in 2 bytes
        assert fp16["bytes_sent"] == fp16["bytes_received"] == ring * (10010 * 2 + payload[1] + meta)
        # bf16: the alltoall's and the all-gather's size - 1 chunks of 2-byte values each way (a
        # ring's 2·(n-1)/n of them, and the padding: 10010 values over 4 ranks, 2503 each)
        chunk = {2: 5005, 4: 2503}[size]
        assert bf16["bytes_sent"] == bf16["bytes_received"] == 2 * (size - 1) * chunk * 2 + ring * (payload[1] + meta)
    assert WireBytes(1, "fp16", layout.META_WIDTH).per_call(shapes, dtypes)["bytes_sent"] == 0


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
        # the 5 values in float16: a float16 allreduce, 2·(n−1)/n of them each way
        assert sent["bytes_sent"] == sent["bytes_received"] == steps * (5 * 2 + META_BYTES)
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
    assert sent["bytes_sent"] == 5 * (5 * 2 + META_BYTES)  # (4 rounds, one of them sent twice)
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
