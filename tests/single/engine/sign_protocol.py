"""A step protocol written outside tfsync against its interface: signSGD with majority vote.

Bernstein et al., *signSGD: Compressed Optimisation for Non-Convex Problems*
(ICML 2018), Algorithm 3: every worker sends the sign of its gradient (one bit
per parameter on a real wire; float32 signs here), the round sums them, and
every worker's optimizer applies the sign of that sum, the majority vote.  It
is what a new protocol costs: this module (the protocol and its optimizer
path) and its one registry line at the bottom; the policy that names it is a
few lines more (:class:`SignSGD`).  ``test_protocol_extension.py`` trains it
under both frontends.
"""

import dataclasses

import tensorflow as tf

import tfsync
from tfsync.engine import protocols
from tfsync.engine.protocols.gradient import ExchangeBefore


class SignProtocol(protocols.StepProtocol):
    """Push the signs of this step's gradients; the round's result is the sign of their sum."""

    payload = "signs"
    describes = "gradient signs"
    averages = False  # the round sums the votes

    @classmethod
    def optimizer_path(cls, policy, engine, optimizer=None, station="apply", shared=False):
        return MajorityVote(policy, engine, optimizer, station, shared)

    def __init__(self, tensors, size, policy):
        self.shapes = [tuple(t.shape) for t in tensors]
        self.dtypes = [tf.as_dtype(t.dtype) for t in tensors]
        self._zeros = None
        self.vote = None

    def contribution(self, grads):
        finite = tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        return [tf.sign(g) for g in grads], finite

    def absent(self):
        if self._zeros is None:
            self._zeros = [tf.zeros(s, d) for s, d in zip(self.shapes, self.dtypes)]
        return self._zeros

    def reject(self, payload):
        return self.absent()  # (a rejected worker abstains: its zeros vote for nothing)

    def apply_round(self, result):
        self.vote = [tf.sign(t) for t in result.total]

    def last_round(self, completed, required):
        return min(completed, required)  # step r's optimizer applies round r's vote, and only it

    def result(self):
        vote, self.vote = self.vote, None
        return vote


class MajorityVote(ExchangeBefore):
    """The votes are exchanged before the optimizer, which applies the majority's signs."""

    def serves(self, policy):
        return False


@dataclasses.dataclass(frozen=True)
class SignSGD(tfsync.Policy):
    """Every step waits for its own round, as BSP's does."""

    name = "signsgd"
    payload = "signs"

    def required_round(self, step):
        return step


protocols.register(SignProtocol)
