"""Every way Keras 3 updates the weights is synchronized, or refused before the first step.

Two ranks on the fake cluster (:mod:`training_fake`), through ``SyncCallback``
and ``SyncStrategy``: a custom ``train_step`` calling ``optimizer.apply`` or
``optimizer.apply_gradients``, Keras' own step under mixed precision's
``LossScaleOptimizer``, and gradient accumulation.  Under BSP the replicas end
bit-identical, weights and optimizer state, where one model on the mean
gradient ends; under an update protocol (SSP) their weights end identical.
"""

import keras
import numpy as np
import pytest
from fake_cluster import assert_no_errors
from training_fake import (
    EPOCHS,
    STEPS,
    ApplyGradientsStep,
    ApplyStep,
    AssignStep,
    TwiceStep,
    assert_identical,
    job,
    layers,
    reference,
)

# real engines on localhost, without stragglers from the environment (conftest.py)
pytestmark = pytest.mark.usefixtures("engines_on_localhost")

PATHS = {
    "apply": {"model_class": ApplyStep},
    "apply_gradients": {"model_class": ApplyGradientsStep},
    "loss_scaling": {"kind": "lso"},
    "static_loss_scale": {"kind": "static"},
    "accumulation": {"kind": "accumulate"},
}


@pytest.mark.parametrize("frontend", ["callback", "strategy"])
@pytest.mark.parametrize("path", list(PATHS))
def test_bsp_trains_every_update_path_as_one_model_on_the_mean_gradient(frontend, path):
    initial = keras.Sequential(layers()).get_weights()
    kind = PATHS[path].get("kind", "adam")
    results, errors = job(frontend, "bsp", initial=initial, **PATHS[path])
    assert_no_errors(errors)
    assert_identical(results)
    for w, expected in zip(results[1][0], reference(initial, kind)):
        np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("frontend", ["callback", "strategy"])
@pytest.mark.parametrize(
    ("mode", "path"),
    [
        ("ssp", "apply"),
        ("ssp", "apply_gradients"),
        ("ssp", "loss_scaling"),
        ("dcs3gd", "loss_scaling"),
        ("dcs3gd", "static_loss_scale"),
    ],
)
def test_an_update_protocol_ends_with_identical_weights_on_every_update_path(frontend, mode, path):
    initial = keras.Sequential(layers()).get_weights()
    results, errors = job(frontend, mode, initial=initial, **PATHS[path])
    assert_no_errors(errors)
    assert_identical(results, optimizer_too=False)  # (each worker's optimizer state is its own)
    assert not np.array_equal(results[0][0][0], initial[0])  # they trained


@pytest.mark.parametrize("frontend", ["callback", "strategy"])
def test_a_gradient_overflow_on_one_rank_skips_the_step_on_every_rank(frontend):
    """Loss scaling under BSP: rank 1's gradients overflow at step 2 of every epoch; every
    rank's ``LossScaleOptimizer`` skips those steps and halves its scale, as one optimizer on
    every rank's gradients would, and nothing that is not finite reaches the exchange."""
    results, errors = job(frontend, "bsp", kind="lso", overflow_at=2)
    assert_no_errors(errors)
    assert_identical(results)
    for weights, _ in results:
        assert all(np.isfinite(w).all() for w in weights)
    # the optimizer's variables in the order training_fake.state lists them: the loss scale's, Adam's
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    lso.build(keras.Sequential(layers()).trainable_variables)
    variables = lso.variables
    scale = results[0][1][next(i for i, v in enumerate(variables) if v is lso.dynamic_scale)]
    iterations = results[0][1][next(i for i, v in enumerate(variables) if v is lso.inner_optimizer.iterations)]
    assert scale == 2.0**15 / 2**EPOCHS, scale
    assert iterations == (STEPS - 1) * EPOCHS, iterations


REFUSED = {
    "callback-ssp-accumulation": ("callback", "ssp", {"kind": "accumulate"}, "gradient_accumulation_steps=2"),
    "callback-dcs3gd-accumulation": ("callback", "dcs3gd", {"kind": "accumulate"}, "gradient_accumulation_steps=2"),
    "strategy-ssp-accumulation": ("strategy", "ssp", {"kind": "accumulate"}, "gradient_accumulation_steps=2"),
    "strategy-psp-accumulation": ("strategy", "psp", {"kind": "accumulate"}, "gradient_accumulation_steps=2"),
    "callback-bsp-assign": ("callback", "bsp", {"model_class": AssignStep}, "apply_gradients() 0 times"),
    "callback-ssp-twice": ("callback", "ssp", {"model_class": TwiceStep}, "apply_gradients() 2 times"),
    "strategy-bsp-assign": ("strategy", "bsp", {"model_class": AssignStep}, "through model.optimizer 0 times"),
    "strategy-ssp-assign": ("strategy", "ssp", {"model_class": AssignStep}, "through model.optimizer 0 times"),
    "strategy-bsp-twice": ("strategy", "bsp", {"model_class": TwiceStep}, "through model.optimizer 2 times"),
}


@pytest.mark.parametrize(("frontend", "mode", "path", "message"), REFUSED.values(), ids=REFUSED)
def test_a_path_that_cannot_be_synchronized_is_refused_before_the_first_step(frontend, mode, path, message):
    initial = keras.Sequential(layers()).get_weights()
    models = {}
    _, errors = job(frontend, mode, initial=initial, before_fit=lambda m, r: models.update({r: m}), **path)
    for e in errors:
        assert isinstance(e, ValueError) and message in str(e), errors
    # no step ran: rank 0's weights are its initial ones, no optimizer counted an update
    for v, w in zip(models[0].trainable_variables, initial):
        np.testing.assert_array_equal(v.numpy(), w)
    for model in models.values():
        assert int(model.optimizer.iterations.numpy()) == 0
