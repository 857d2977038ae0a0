"""Late contributions kept, corrected and offered again (``compensate=`` of PSP and backup workers).

A coordinated round may close without this worker's contribution.  Without
compensation the exchange drops it (counted); with a
:class:`tfsync.DelayCompensation` the :class:`LateContributions` component
withdraws it from the outbox with a snapshot of the weights it was computed
on (before the round's mean moves them), corrects it at the worker's next
computed step, whose weights are those that step's round applies to, and
offers it to that round (``Late`` on the control path, :meth:`ControlClient.join_late
<tfsync.control.client.ControlClient.join_late>`); a round that closed
meanwhile makes the step skip and the offer is made again at the next.  A
worker holds one at most: an older one is dropped.  Those still held when
training ends go into one final round that every replica applies
(:meth:`RoundExchange.final_round <tfsync.engine.exchange.RoundExchange.final_round>`)
when the frontend can apply a mean gradient, else they are dropped; either
way counted.  A corrected contribution with a NaN or an infinity is rejected
(:mod:`tfsync.engine.nonfinite`) before it is offered, in a step or in the
final round, and counted as such.
"""

from tfsync.engine.components.base import StepComponent


class LateContributions(StepComponent):
    """Hold this worker's contribution that missed its round; correct and offer it later."""

    def __init__(self, compensation):
        self.compensation = compensation
        self.held = None  # (stamp, payload)

    def exchange_options(self):
        return {"keep_stale": True}

    def before_apply(self, res):
        engine = self.engine
        if res.round == engine.last_pushed and engine.rank not in res.accepted:
            self._hold(res.round)  # before its mean moves the weights it was computed on

    def computes(self, step):
        if self.held is None:
            return True
        engine = self.engine
        stamp, payload = self.held
        corrected, finite = engine.protocol.compensate(payload)
        if engine.nonfinite.screen_late(stamp, step, finite, corrected):  # rejected: nothing to offer
            self.held = None
            return True
        engine.exchange.set_late(step, stamp, corrected)
        if not engine.control.join_late(step):
            engine.exchange.clear_late()
            return False
        self.held = None
        return True

    def at_rest(self):
        return self.held is None

    def finish(self, apply_mean):
        if apply_mean is not None:
            self._final_round(apply_mean)
        if self.held is None:
            return False
        exchange = self.engine.exchange
        exchange.drop(self.held[0], exchange.closed_through + 1)  # no round is left to take it
        self.held = None
        return True

    def _hold(self, round_):
        engine = self.engine
        payload = engine.exchange.withdraw(round_)
        if payload is None:
            return
        if self.held is not None:
            engine.exchange.drop(self.held[0], round_)
        self.held = (round_, payload)
        engine.protocol.keep_weights()

    def _final_round(self, apply_mean):
        """The late gradients held when training ends, compensated and applied everywhere."""
        engine = self.engine
        round_, late = engine.step, None
        if self.held is not None:  # corrected first (w_now: the final weights): a rejected one is not held
            stamp, payload = self.held
            corrected, finite = engine.protocol.compensate(payload)
            if engine.nonfinite.screen_late(stamp, round_, finite, corrected):
                self.held = None
            else:
                late = (stamp, corrected)
        holds = engine.exchange.call(
            lambda: engine.cluster.allgather_object(late is not None, name="tfsync.final_round"),
            timeout_s=engine.wait_timeout_s,
        )
        holders = [r for r, h in enumerate(holds) if h]
        if not holders:
            return
        total = engine.exchange.final_round(round_, late, holders, engine.protocol.absent(), engine.wait_timeout_s)
        apply_mean(total)
        if late is not None:
            self.held = None
            engine.tally.add("compensated")
        compensated = engine.tally.pending("compensated")
        engine.tally.settle(engine.exchange)
        engine.trace(
            {
                "event": "final_round",
                "rank": engine.rank,
                "t": engine.now(),
                "round": round_,
                "late": holders,
                "compensated": compensated,
            }
        )
