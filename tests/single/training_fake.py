"""Two ranks training one small Keras model on threads of one process, through either frontend.

What :mod:`test_update_paths` and :mod:`test_start_check` share: each rank's
shard of a linear regression, models whose ``train_step`` takes each of Keras
3's update paths, the optimizers (plain, mixed precision's loss scaling,
gradient accumulation), one rank's ``fit`` with ``SyncCallback`` or under
``SyncStrategy`` on the fake cluster (:mod:`fake_cluster`), and the reference:
one model that applies, at every step, the mean of every shard's gradients
(what BSP must do).
"""

import keras
import numpy as np
import tensorflow as tf
from fake_cluster import FakeCluster, on_threads

import tfsync

SIZE = 2
BATCH, STEPS, EPOCHS = 4, 6, 2
JOIN_S = 120.0  # one deadline for the job's threads (tracing two models on two cores included)
OVERFLOW = 1e30  # an input that makes the loss, and so the gradients, overflow float32


def data(rank, overflow_at=None):
    """Rank ``rank``'s shard, STEPS batches; ``overflow_at``: a batch of rank 1 whose gradients
    are not finite."""
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(BATCH * STEPS, 3)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
    if overflow_at is not None and rank == 1:
        x[overflow_at * BATCH] = OVERFLOW
    return x, y


def layers():
    return [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)]


class _CustomStep(keras.Sequential):
    """A model whose ``train_step`` subclasses write themselves: ``gradients`` is the part they share."""

    def gradients(self, data, scaled=False):
        """This batch's loss and the gradients of the trainable variables (``scaled``: of the loss
        as the optimizer scales it, for a loss-scaling optimizer)."""
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            target = self.optimizer.scale_loss(loss) if scaled else loss
        return loss, tape.gradient(target, self.trainable_variables)


class ApplyStep(_CustomStep):
    """A custom ``train_step`` on Keras 3's documented low-level path: ``optimizer.apply``."""

    def train_step(self, data):
        loss, grads = self.gradients(data, scaled=True)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class ApplyGradientsStep(_CustomStep):
    """A custom ``train_step`` that calls ``optimizer.apply_gradients``."""

    def train_step(self, data):
        loss, grads = self.gradients(data)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


class AssignStep(_CustomStep):
    """A custom ``train_step`` that updates the weights itself, past the optimizer."""

    def train_step(self, data):
        loss, grads = self.gradients(data)
        for g, v in zip(grads, self.trainable_variables):
            v.assign_sub(0.01 * g)
        return {"loss": loss}


class TwiceStep(_CustomStep):
    """A custom ``train_step`` that applies its gradients twice."""

    def train_step(self, data):
        loss, grads = self.gradients(data)
        self.optimizer.apply(grads, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def optimizer(kind="adam"):
    """``"adam"``; ``"lso"``: Adam under mixed precision's ``LossScaleOptimizer``;
    ``"accumulate"``: Adam accumulating gradients over 2 steps; ``"static"``: Adam with a fixed
    loss scale (``loss_scale_factor``)."""
    if kind == "lso":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01))
    if kind == "accumulate":
        return keras.optimizers.Adam(0.01, gradient_accumulation_steps=2)
    if kind == "static":
        return keras.optimizers.Adam(0.01, loss_scale_factor=4.0)
    return keras.optimizers.Adam(0.01)


def state(model):
    """A replica's state: every model variable and every optimizer variable."""
    return [v.numpy() for v in model.variables], [v.numpy() for v in model.optimizer.variables]


def build(model_class, make_layers, kind, make_optimizer):
    model = model_class(make_layers())
    model.compile(optimizer=make_optimizer() if make_optimizer is not None else optimizer(kind), loss="mse")
    return model


def fit_callback(
    cluster,
    mode,
    model_class=keras.Sequential,
    kind="adam",
    initial=None,
    before_fit=None,
    make_layers=layers,
    make_optimizer=None,
    wait_timeout_s=30,
    after_fit=None,
    **data_kw,
):
    """One rank's ``fit`` with ``SyncCallback``; ``before_fit(model, rank)`` runs first,
    ``after_fit(callback, rank)`` last."""
    rank = cluster.rank()
    model = build(model_class, make_layers, kind, make_optimizer)
    if initial is not None and rank == 0:
        model.set_weights(initial)
    if before_fit is not None:
        before_fit(model, rank)
    sync = tfsync.keras.SyncCallback(mode, cluster=cluster, wait_timeout_s=wait_timeout_s)
    x, y = data(rank, **data_kw)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[sync])
    if after_fit is not None:
        after_fit(sync, rank)
    return state(model)


def fit_strategy(
    cluster,
    mode,
    model_class=keras.Sequential,
    kind="adam",
    initial=None,
    before_fit=None,
    make_layers=layers,
    make_optimizer=None,
    wait_timeout_s=30,
    **data_kw,
):
    """One rank's ``fit`` under ``SyncStrategy``, then ``finish()``; ``before_fit(model, rank)``
    runs in the strategy's scope, the optimizer built."""
    rank = cluster.rank()
    strategy = tfsync.distribute.SyncStrategy(mode, cluster=cluster, wait_timeout_s=wait_timeout_s)
    try:
        with strategy.scope():
            model = build(model_class, make_layers, kind, make_optimizer)
            if initial is not None and rank == 0:
                model.set_weights(initial)
            if before_fit is not None:
                model.optimizer.build(model.trainable_variables)
                before_fit(model, rank)
        x, y = data(rank, **data_kw)
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        strategy.finish()
    finally:
        if strategy.engine is not None:  # (a refused or failed fit: nothing to drain)
            strategy.engine.abandon()
    return state(model)


FRONTENDS = {"callback": fit_callback, "strategy": fit_strategy}


def job(frontend, mode, per_rank=None, **kwargs):
    """Every rank's ``frontend`` fit (``"callback"`` or ``"strategy"``), with ``kwargs`` and, for
    rank ``r``, ``per_rank[r]`` on top (``mode`` among them): results and errors per rank."""
    fake = FakeCluster(SIZE, timeout_s=60)
    fit = FRONTENDS[frontend]
    per_rank = per_rank or {}

    def fit_rank(r):
        settings = {"mode": mode, **kwargs, **per_rank.get(r, {})}
        return fit(fake.rank(r), settings.pop("mode"), **settings)

    return on_threads([lambda r=r: fit_rank(r) for r in range(SIZE)], JOIN_S)


def assert_identical(results, optimizer_too=True):
    """Every replica's weights (and optimizer variables) bit-identical to rank 0's; they moved."""
    (weights0, opt0), *others = results
    for weights, opt in others:
        for a, b in zip(weights0, weights):
            np.testing.assert_array_equal(a, b)
        if optimizer_too:
            assert len(opt) == len(opt0)
            for a, b in zip(opt0, opt):
                np.testing.assert_array_equal(a, b)


def reference(initial, kind="adam"):
    """One model applying, at every step, the mean of every shard's gradients, from ``initial``:
    its weights.  Loss scaling changes nothing while no gradient overflows: ``"lso"`` and
    ``"static"`` are Adam."""
    model = keras.Sequential(layers())
    model.compile(optimizer=optimizer("adam" if kind in ("lso", "static") else kind), loss="mse")
    model.set_weights(initial)
    return train_on_mean_gradients(model)


def train_on_mean_gradients(model):
    """``model`` applies, at every step, the mean of every rank's gradients of its shard (one
    optimizer for the whole job: what BSP's replicas must end at); its weights."""
    return train_on_shards(model, lambda grads: [tf.reduce_mean(tf.stack(g), axis=0) for g in zip(*grads)])


def train_on_shards(model, aggregate):
    """``model`` applies, at every step, ``aggregate(grads)`` of every rank's gradients of its
    shard (``grads[rank]``: that rank's, per weight); its weights."""
    shards = [data(r) for r in range(SIZE)]
    loss = keras.losses.MeanSquaredError()
    for _ in range(EPOCHS):
        for k in range(STEPS):
            grads = []
            for x, y in shards:
                with tf.GradientTape() as tape:
                    value = loss(y[k * BATCH : (k + 1) * BATCH], model(x[k * BATCH : (k + 1) * BATCH]))
                grads.append(tape.gradient(value, model.trainable_variables))
            model.optimizer.apply(aggregate(grads), model.trainable_variables)
    return model.get_weights()
