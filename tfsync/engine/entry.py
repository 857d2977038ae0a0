"""How a worker's contribution enters its round: :class:`OpenRounds` or :class:`CoordinatedRounds`.

* Open rounds (BSP, SSP, DSSP, ElasticBSP, DC-S3GD): round ``r`` closes when
  every worker contributed, a rule each worker can apply alone.  A worker
  submits its contribution and its communication thread enters the round;
  Horovod's allreduce is the barrier.  A skipped step still enters its round,
  with zeros, or the round could never close.
* Coordinated rounds (``Policy.coordinated``: PSP, backup workers): rank 0's
  coordinator closes a round on the policy's ``close_round`` decision,
  possibly without the slow workers.  A worker pushes into the exchange's
  outbox and tells the coordinator (``Ready``); its thread enters on the
  closing, or at once when the round will take it for certain
  (``Policy.enters_when_ready``, ``Policy.accepts_ready``; see
  :mod:`tfsync.engine.exchange`).  A worker whose next round closed without
  it skips that step, which then enters nothing.
"""

import abc


class RoundEntry(abc.ABC):
    """The interface of both entries (the engine holds one, chosen by ``Policy.coordinated``)."""

    def __init__(self, engine):
        self.engine = engine

    def exchange_options(self) -> dict:
        """Keyword arguments of :class:`~tfsync.engine.exchange.RoundExchange` this entry needs."""
        return {}

    def on_close(self):
        """What the control path calls with each closing it carries, or None."""
        return None

    @abc.abstractmethod
    def push(self, step: int, payload, t_push: float, compute_s: float, inline: bool, rejected: bool = False) -> None:
        """This worker's contribution to round ``step`` is ready (``inline``: the worker would
        wait for this very round next, so it may run it on its own thread; ``rejected``: it was
        not finite, and ``payload`` is the zeros that go in its place)."""

    def computes(self, step: int) -> bool:
        """False when round ``step`` already closed without this worker (the step is skipped)."""
        return True

    def skip(self, step: int) -> bool:
        """A skipped step; whether it entered its round (with zeros)."""
        return False

    def drain(self) -> bool:
        """Training ended: whether a contribution left unsent was dropped."""
        return False


class OpenRounds(RoundEntry):
    """Every worker enters every round; the allreduce closes it."""

    def push(self, step, payload, t_push, compute_s, inline, rejected=False):
        engine = self.engine
        engine.exchange.submit(
            step, payload, t_push, compute_s, inline=inline, timeout_s=engine.wait_timeout_s, rejected=rejected
        )

    def skip(self, step):
        engine = self.engine
        engine.exchange.submit(step, engine.protocol.absent(), engine.now(), 0.0, inline=False, present=False)
        return True


class CoordinatedRounds(RoundEntry):
    """Rounds closed by rank 0's coordinator on the policy's decision."""

    def __init__(self, engine):
        super().__init__(engine)
        self.policy = engine.policy  # (its protocol carries gradients: StepProtocol.check_policy)

    def exchange_options(self):
        return dict(
            absent=lambda: self.engine.protocol.absent(),
            enters_when_ready=self.policy.enters_when_ready,
        )

    def on_close(self):
        return self.engine.exchange.close_round

    def push(self, step, payload, t_push, compute_s, inline, rejected=False):
        # a rejected contribution is still announced: the policy's rule may wait for this rank's
        # notice, and a round that takes it gets this rank's zeros
        exchange, control = self.engine.exchange, self.engine.control
        exchange.push(step, payload, t_push, compute_s, rejected)
        if self.policy.enters_when_ready:  # the round takes what its ranks hold when they enter
            exchange.enter_accepted(step)
            control.ready(step)
        else:
            control.ready(step, on_accepted=exchange.enter_accepted)

    def computes(self, step):
        return not (self.policy.skips and self.engine.exchange.closed_through >= step)

    def drain(self):
        return bool(self.engine.exchange.drain_outbox())
