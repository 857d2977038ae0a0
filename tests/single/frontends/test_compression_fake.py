"""``compression=`` through ``model.fit``: two ranks on threads of one process (:mod:`fake_cluster`,
whose float16 sum rounds as Horovod's does), both frontends, and the bytes in the epoch logs."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import assert_no_errors
from training_fake import EPOCHS, SIZE, STEPS, assert_identical, job, layers, optimizer, train_on_shards

import tfsync
from tfsync.engine.wire import layout

pytestmark = pytest.mark.usefixtures("engines_on_localhost")

PARAMS = 3 * 4 + 4 + 4 * 1 + 1  # the two Dense layers of training_fake.layers()
# a compressed round's payload: fp16, a float16 allreduce (a ring of 2-byte values); bf16, SIZE
# chunks of 2-byte values (the last padded), an alltoall and an all-gather of SIZE - 1 chunks each way
WIRE_PAYLOAD = {"fp16": 2 * (SIZE - 1) / SIZE * PARAMS * 2, "bf16": 2 * (SIZE - 1) * -(-PARAMS // SIZE) * 2}


def fp16_mean(grads):
    """What BSP under fp16 applies: each rank's gradient in float16, their float16 sum, cast back
    and divided by the number of workers (BSP checks and divides the plain sum itself)."""
    out = []
    for per_rank in zip(*grads):
        values = [tf.cast(tf.cast(g, tf.float16), tf.float32) for g in per_rank]
        total = values[0]
        for v in values[1:]:
            total = tf.cast(tf.cast(total + v, tf.float16), tf.float32)
        out.append(total * (1.0 / SIZE))
    return out


def reference(initial, aggregate):
    model = keras.Sequential(layers())
    model.compile(optimizer=optimizer("adam"), loss="mse")
    model.set_weights(initial)
    return train_on_shards(model, aggregate)


@pytest.mark.parametrize("frontend", ["callback", "strategy"])
def test_bsp_with_fp16_trains_as_one_model_on_the_rounded_mean_with_identical_replicas(frontend):
    initial = keras.Sequential(layers()).get_weights()
    results, errors = job(frontend, tfsync.BSP(compression="fp16"), initial=initial)
    assert_no_errors(errors)
    assert_identical(results)
    weights = results[0][0][: len(initial)]
    rounded = reference(initial, fp16_mean)
    exact = reference(initial, lambda grads: [tf.reduce_mean(tf.stack(g), axis=0) for g in zip(*grads)])
    for w, r in zip(weights, rounded):
        np.testing.assert_allclose(w, r, rtol=1e-4, atol=1e-6)
    assert any(not np.array_equal(r, e) for r, e in zip(rounded, exact))  # (the rounding shows: not vacuous)


def test_the_epoch_logs_count_the_bytes_on_the_wire_before_and_after_compression():
    seen = {}

    def after_fit(sync, rank):
        seen[rank] = (dict(sync.engine.bytes), sync.model.history.history)

    results, errors = job("callback", tfsync.BSP(compression="fp16"), after_fit=after_fit)
    assert_no_errors(errors)
    meta = SIZE * layout.META_WIDTH * 4
    ring = 2 * (SIZE - 1) / SIZE
    per_round = {"before": ring * (PARAMS * 4 + meta), "after": WIRE_PAYLOAD["fp16"] + ring * meta}
    for rank in range(SIZE):
        total, history = seen[rank]
        assert total["bytes_sent"] == total["bytes_received"] == STEPS * EPOCHS * per_round["after"]
        assert total["uncompressed_bytes_sent"] == STEPS * EPOCHS * per_round["before"]
        for epoch in range(EPOCHS):  # every epoch's rounds in its logs (one round a step)
            assert history["tfsync_bytes_sent"][epoch] == STEPS * per_round["after"]
            assert history["tfsync_uncompressed_bytes_received"][epoch] == STEPS * per_round["before"]


@pytest.mark.parametrize(
    "mode",
    [
        tfsync.SSP(staleness=2, compression="fp16"),
        tfsync.PSP(min_contributions=2, compression="fp16"),
        tfsync.DCS3GD(compression="bf16"),
        tfsync.LocalSGD(period=3, compression="fp16"),
        tfsync.DiLoCo(inner_steps=3, compression="bf16"),
    ],
    ids=lambda m: f"{m.name}-{m.compression}",
)
def test_every_protocol_ends_with_identical_replicas_and_counts_its_rounds_bytes(mode):
    seen = {}

    def after_fit(sync, rank):
        seen[rank] = (dict(sync.counts), dict(sync.engine.bytes), sync.engine.step)

    results, errors = job("callback", mode, after_fit=after_fit)
    assert_no_errors(errors)
    assert_identical(results, optimizer_too=False)  # (an inner optimizer's state is each worker's own)
    meta = SIZE * layout.META_WIDTH * 4
    ring = 2 * (SIZE - 1) / SIZE
    for counts, sent, rounds_run in seen.values():
        assert counts["produced"] == counts["applied"] + counts["compensated"] + counts["dropped"] + counts["rejected"]
        assert rounds_run > 0
        # every round (one per H steps under Local SGD and DiLoCo) the payload in 16 bits and one call
        # of the metadata
        per_round = WIRE_PAYLOAD[mode.compression] + ring * meta
        assert sent["bytes_sent"] == rounds_run * per_round, (sent, rounds_run)
        assert sent["uncompressed_bytes_sent"] / (ring * (PARAMS * 4 + meta)) == sent["bytes_sent"] / per_round


def test_auto_mode_runs_its_modes_compressed():
    seen = {}

    def after_fit(sync, rank):
        seen[rank] = (sync.engine.policy.compression, dict(sync.engine.bytes), dict(sync.counts))

    results, errors = job("callback", tfsync.Auto(compression="fp16", window_steps=4), after_fit=after_fit)
    assert_no_errors(errors)
    assert_identical(results, optimizer_too=False)
    for compression, sent, counts in seen.values():
        assert compression == "fp16"
        assert 0 < sent["bytes_sent"] < sent["uncompressed_bytes_sent"]
        assert counts["produced"] == counts["applied"] + counts["compensated"] + counts["dropped"]
