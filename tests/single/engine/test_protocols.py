"""The step protocols' state updates, as compiled once over their variables."""

import numpy as np
import tensorflow as tf

from tfsync import DelayCompensation
from tfsync.engine._tf import compile_flat
from tfsync.engine.protocols import GradientProtocol, UpdateProtocol
from tfsync.engine.rounds import RoundResult


def test_compiled_functions_take_tensorflows_flat_entry_point_on_the_pinned_tensorflow():
    # Without it the protocols still work (a ConcreteFunction call), but every small-model
    # step pays the argument binding again: a TensorFlow upgrade that removes it shows here.
    v = tf.Variable([1.0, 2.0])
    add = compile_flat(lambda t: v.assign_add(t), [tf.TensorSpec([2], tf.float32)])
    assert not isinstance(add, tf.types.experimental.ConcreteFunction)
    add(tf.constant([0.5, 0.25]))
    np.testing.assert_array_equal(v.numpy(), [1.5, 2.25])


def _round(total, own):
    """Round 0 of 4 ranks, every one present."""
    zeros = np.zeros(4)
    return RoundResult(0, total, zeros + 1, zeros, zeros, zeros, contribution=own, accepted=(0, 1, 2, 3))


def test_the_update_protocol_pushes_a_share_applies_a_round_and_settles_as_its_formulas_say():
    rng = np.random.default_rng(0)
    w0 = [rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(2,)).astype(np.float32)]
    variables = [tf.Variable(w) for w in w0]
    protocol = UpdateProtocol(variables, 4)
    delta = [rng.normal(size=w.shape).astype(np.float32) for w in w0]
    for v, d in zip(variables, delta):  # the optimizer's step
        v.assign_add(d)

    shares, finite = protocol.contribution([])
    assert finite.numpy().tolist() == [True, True]
    for s, d, w, v, p in zip(shares, delta, w0, variables, protocol.pending):
        np.testing.assert_allclose(s.numpy(), d / 4, rtol=1e-6)
        np.testing.assert_allclose(p.numpy(), d / 4, rtol=1e-6)
        np.testing.assert_allclose(v.numpy(), w + d / 4, rtol=1e-6)

    others = [rng.normal(size=w.shape).astype(np.float32) for w in w0]  # the other ranks' shares, summed
    total = [tf.constant(s.numpy() + o) for s, o in zip(shares, others)]
    protocol.apply_round(_round(total, shares))
    for t, w, wb, v, p in zip(total, w0, protocol.w_bar, variables, protocol.pending):
        np.testing.assert_allclose(wb.numpy(), w + t.numpy(), rtol=1e-6)
        np.testing.assert_allclose(p.numpy(), 0.0, atol=1e-7)
        np.testing.assert_allclose(v.numpy(), w + t.numpy(), rtol=1e-6)

    protocol.settle()
    for wb, v, p in zip(protocol.w_bar, variables, protocol.pending):
        np.testing.assert_array_equal(v.numpy(), wb.numpy())
        np.testing.assert_array_equal(p.numpy(), 0.0)


def test_a_late_gradient_is_compensated_against_the_weights_kept_when_it_was_held():
    lam = 0.5
    w_then = np.array([1.0, -2.0, 3.0], np.float32)
    variables = [tf.Variable(w_then)]

    class Policy:
        compensate = DelayCompensation(lam=lam)

    protocol = GradientProtocol(variables, 4, Policy())
    protocol.keep_weights()
    w_now = np.array([0.5, -1.0, 4.0], np.float32)
    variables[0].assign(w_now)
    g = np.array([0.2, -0.4, 1.0], np.float32)
    (corrected,), finite = protocol.compensate([tf.constant(g)])
    np.testing.assert_allclose(corrected.numpy(), g + lam * g * g * (w_now - w_then), rtol=1e-6)
    assert finite.numpy().tolist() == [True]
    # a correction that overflows says so (the engine then rejects the late gradient)
    (_,), finite = protocol.compensate([tf.constant([1e30, 0.0, 0.0], tf.float32)])
    assert finite.numpy().tolist() == [False]


def test_the_gradient_protocol_says_which_gradients_are_not_finite_and_rejects_them_as_zeros():
    protocol = GradientProtocol([tf.zeros([3]), tf.zeros([2], tf.float64)], 4)
    grads = [tf.constant([1.0, np.nan, 2.0]), tf.constant([1.0, 2.0], tf.float64)]
    payload, finite = protocol.contribution(grads)
    assert payload is grads and finite.numpy().tolist() == [False, True]
    zeros = protocol.reject(payload)
    assert [z.numpy().tolist() for z in zeros] == [[0.0] * 3, [0.0] * 2]
    _, finite = protocol.contribution([tf.ones([3]), tf.constant([np.inf, 0.0], tf.float64)])
    assert finite.numpy().tolist() == [True, False]


def test_a_rejected_update_leaves_the_weights_where_the_step_found_them():
    # the update protocol moves the weights by the share at its push; a share that is not finite
    # must not stay there, or this replica would part from the others (every replica applies
    # the round without it)
    rng = np.random.default_rng(1)
    w0 = [rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(5,)).astype(np.float32)]
    variables = [tf.Variable(w) for w in w0]
    protocol = UpdateProtocol(variables, 2)
    # an earlier step's share still pending (its round not complete): the view is w̄ + pending
    for v in variables:
        v.assign_add(tf.fill(v.shape, 0.5))
    protocol.contribution([])
    view = [v.numpy().copy() for v in variables]
    pending = [p.numpy().copy() for p in protocol.pending]

    bad = np.ones((5,), np.float32)
    bad[[1, 3]] = [np.nan, np.inf]
    variables[0].assign_add(tf.fill([3, 2], 0.25))  # finite here ...
    variables[1].assign_add(bad)  # ... not there
    shares, finite = protocol.contribution([])
    assert finite.numpy().tolist() == [True, False]
    zeros = protocol.reject(shares)
    assert all(not np.any(z.numpy()) for z in zeros)
    for v, seen, p, before in zip(variables, view, protocol.pending, pending):
        np.testing.assert_allclose(v.numpy(), seen, rtol=0, atol=1e-6)
        np.testing.assert_allclose(p.numpy(), before, rtol=0, atol=1e-6)
        assert np.all(np.isfinite(v.numpy()))
    # the round that takes the earlier share, and none of this one, leaves w̄ + the rest of pending
    own = [tf.fill(v.shape, 0.25) for v in variables]  # the earlier share: 0.5 / 2
    protocol.apply_round(_round([tf.fill(v.shape, 1.0) for v in variables], own))
    for v, w in zip(variables, w0):
        np.testing.assert_allclose(v.numpy(), w + 1.0, rtol=0, atol=1e-6)
