"""What every rank agrees on before training, through ``SyncCallback`` and ``SyncStrategy``.

Two ranks on the fake cluster (:mod:`training_fake`).  Every variable training
reads starts as rank 0's, the optimizer's included (a rank whose optimizer
state is ahead, as after a checkpoint loaded on that rank alone, trains on
rank 0's); ranks whose models, optimizers or modes differ are refused with an
error naming the rank and the first difference, even where every parameter
shape is the same.
"""

import keras
import pytest
import tensorflow as tf
from fake_cluster import assert_no_errors
from training_fake import assert_identical, job

import tfsync
from tfsync.engine.diagnosis import SyncTimeoutError

# real engines on localhost, without stragglers from the environment (conftest.py)
pytestmark = pytest.mark.usefixtures("engines_on_localhost")

FRONTENDS = ["callback", "strategy"]


def advance_optimizer(model, rank):
    """Rank 1's optimizer state moves ahead of rank 0's, every variable of it (iterations, slots,
    learning rate, a loss scale), as a checkpoint loaded on rank 1 alone would leave it."""
    if rank != 1:
        return
    for v in model.optimizer.variables:
        v.assign(v + tf.cast(3 if tf.as_dtype(v.dtype).is_integer else 0.5, v.dtype))


def apply_one_update(model, rank):
    """Rank 1 applies one update before ``fit`` (Adam's slots and iterations move ahead)."""
    if rank == 1:
        model.optimizer.apply([tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("kind", ["adam", "lso"])
def test_a_rank_whose_optimizer_state_is_ahead_trains_from_rank_0s(frontend, kind):
    results, errors = job(frontend, "bsp", kind=kind, before_fit=advance_optimizer)
    assert_no_errors(errors)
    assert_identical(results)  # weights and every optimizer variable, loss scale included


def test_a_rank_that_applied_an_update_before_fit_trains_from_rank_0s_state():
    results, errors = job("callback", "bsp", before_fit=apply_one_update)
    assert_no_errors(errors)
    assert_identical(results)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_learning_rate_held_in_a_variable_is_state_and_comes_from_rank_0(frontend):
    """The learning rate's value is not compared (callbacks such as ReduceLROnPlateau change it,
    and checkpoints hold it): it is broadcast with the optimizer's variables."""
    results, errors = job(frontend, "bsp", per_rank={1: {"make_optimizer": lambda: keras.optimizers.Adam(0.5)}})
    assert_no_errors(errors)
    assert_identical(results)


def dense16():
    return [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float16")]


def einsum():
    return [
        keras.Input((3,)),
        keras.layers.EinsumDense("ab,bc->ac", output_shape=4, bias_axes="c"),
        keras.layers.Dense(1),
    ]


def dropout():
    return [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dropout(0.0), keras.layers.Dense(1)]


def decaying(rate):
    """Adam whose learning rate is a schedule: configuration, compared."""
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 5, rate))


MISMATCHES = {
    "dtype": (
        {"make_layers": dense16},
        "rank 1: variable sequential/dense_1/kernel dtype float16, rank 0 float32",
    ),
    "layer_kind": (
        {"make_layers": einsum},
        "rank 1: variable #0 path sequential/einsum_dense/kernel, rank 0 sequential/dense/kernel",
    ),
    "layer_without_variables": (
        {"make_layers": dropout},
        "rank 1: layers[2] keras.src.layers.regularization.dropout.Dropout, rank 0 keras.src.layers.core.dense.Dense",
    ),
    "optimizer_class": (  # (with the same variables: the strategy broadcasts each as it is created)
        {"make_optimizer": lambda: keras.optimizers.AdamW(0.01)},
        "rank 1: optimizer class keras.src.optimizers.adamw.AdamW, rank 0 keras.src.optimizers.adam.Adam",
    ),
    "optimizer_config": (
        {"make_optimizer": lambda: keras.optimizers.Adam(0.01, beta_1=0.8)},
        "rank 1: optimizer config beta_1 0.8, rank 0 0.9",
    ),
    "learning_rate_schedule": (  # (rank 0's schedules the rate too: see learning_rate_decaying)
        {"make_optimizer": lambda: decaying(0.9)},
        "rank 1: optimizer config learning_rate config decay_rate 0.9, rank 0 0.5",
    ),
    "mode": (
        {"mode": tfsync.SSP(staleness=3)},
        "rank 1: mode staleness 3, rank 0 2",
    ),
}


# (a variable of another dtype never reaches the strategy's start check: it is refused when it is
# created, the next test)
COMPARED = [
    pytest.param(frontend, rank1, message, id=f"{name}-{frontend}")
    for name, (rank1, message) in MISMATCHES.items()
    for frontend in FRONTENDS
    if not (frontend == "strategy" and rank1.get("make_layers") is dense16)
]


@pytest.mark.parametrize(("frontend", "rank1", "message"), COMPARED)
def test_ranks_that_differ_are_refused_naming_the_rank_and_the_first_difference(frontend, rank1, message):
    everyone = {"make_optimizer": lambda: decaying(0.5)} if "decay_rate" in message else {}
    _, errors = job(frontend, tfsync.SSP(staleness=2), per_rank={1: rank1}, **everyone)
    for e in errors:
        assert isinstance(e, ValueError), errors
        assert "ranks [1] are configured differently from rank 0" in str(e) and message in str(e), str(e)
        assert "same script with the same arguments on every rank" in str(e), str(e)


def test_the_strategy_refuses_a_variable_created_in_another_dtype_when_it_is_created():
    """A variable is broadcast from rank 0 as it is created in the strategy's scope, before any
    model exists to compare: the rank whose variable differs says how; rank 0, which cannot
    know, stops at the wait bound naming it (under Horovod its broadcast fails at once)."""
    _, errors = job("strategy", "bsp", per_rank={1: {"make_layers": dense16}}, wait_timeout_s=2)
    assert isinstance(errors[1], ValueError), errors
    assert "rank 1 creates its variable #2 (kernel) as float16 [4, 1], rank 0 as float32 [4, 1]" in str(errors[1])
    assert isinstance(errors[0], SyncTimeoutError) and "[1]" in str(errors[0]), errors
