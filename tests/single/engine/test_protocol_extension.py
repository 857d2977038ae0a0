"""A step protocol added outside tfsync (:mod:`sign_protocol`: one module, one registry line)
trains under both frontends on the fake cluster: every replica applies the majority vote of
the workers' gradient signs, as one model on every shard's votes does, and a worker whose
gradients are not finite abstains, counted."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import assert_no_errors
from sign_protocol import SignProtocol, SignSGD
from training_fake import EPOCHS, STEPS, assert_identical, job, layers, train_on_shards

from tfsync.engine import protocols

pytestmark = pytest.mark.usefixtures("engines_on_localhost")

LEARNING_RATE = 0.01


def sgd():
    return keras.optimizers.SGD(LEARNING_RATE)


def majority_vote_reference(initial):
    """One model applying, at every step, the sign of the sum of every shard's gradient signs."""
    model = keras.Sequential(layers())
    model.compile(optimizer=sgd(), loss="mse")
    model.set_weights(initial)
    return train_on_shards(model, lambda grads: [tf.sign(tf.add_n([tf.sign(g) for g in gs])) for gs in zip(*grads)])


def test_a_protocol_registers_once_under_its_payload():
    assert protocols.for_policy(SignSGD()) is SignProtocol
    assert "signs" in protocols.names()
    protocols.register(SignProtocol)  # (the same class again: nothing changes)

    class Another(SignProtocol):
        pass

    with pytest.raises(ValueError, match="a step protocol named 'signs' is registered already"):
        protocols.register(Another)


@pytest.mark.parametrize("frontend", ["callback", "strategy"])
def test_the_new_protocol_trains_every_replica_on_the_majority_vote(frontend):
    initial = keras.Sequential(layers()).get_weights()
    results, errors = job(frontend, SignSGD(), initial=initial, make_optimizer=sgd)
    assert_no_errors(errors)
    assert_identical(results)
    for w, expected in zip(results[0][0], majority_vote_reference(initial)):
        np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)


def test_a_worker_whose_gradients_are_not_finite_abstains_and_is_counted():
    counts = {}
    results, errors = job(
        "callback",
        SignSGD(),
        make_optimizer=sgd,
        overflow_at=2,  # rank 1's third batch of every epoch
        after_fit=lambda sync, rank: counts.update({rank: sync.counts}),
    )
    assert_no_errors(errors)
    assert_identical(results)
    for weights, _ in results:
        assert all(np.isfinite(w).all() for w in weights)
    assert counts[1]["rejected"] == EPOCHS and counts[0]["rejected"] == 0, counts
    for c in counts.values():
        assert c["produced"] == STEPS * EPOCHS == c["applied"] + c["rejected"], c
