"""DC-S3GD's wait before the optimizer (:class:`Corrections`), for protocols that correct gradients.

The compensated-update protocol (:class:`tfsync.engine.protocols.CompensatedUpdateProtocol`)
corrects a step's gradient for the one round it is late before the optimizer
runs.  So the step waits twice: before the optimizer, for the round the
correction needs (:meth:`Corrections.round_mean`, called from the compiled
step through one ``tf.py_function``), and after it, to push the update
(:meth:`SyncEngine.sync_step`).  The first wait is the step's wait, not its
computation, and a contribution whose gradient was corrected against moved
weights counts as ``compensated`` when its round is applied.
"""

from tfsync.engine.components import StepComponent


class Corrections(StepComponent):
    """The wait before the optimizer and what it applied, until the step pushes."""

    def __init__(self):
        self._wait = None  # (wait_s, rounds applied) of this step's correction, until its push
        self._rounds = set()  # own contributions whose gradient was corrected against moved weights

    def round_mean(self):
        """Wait for the round this step's gradients are applied after, apply it, and return the
        mean update the correction adds to ``w̄``."""
        engine = self.engine
        with engine.guard():
            engine.delays.sleep()
            t = engine.now()
            applied = engine.wait_and_apply(engine.policy.sync_round(engine.step))
            self._wait = (engine.now() - t, applied)
            if engine.applied_through >= 0:  # w̄ moved past the weights the gradients were computed at
                self._rounds.add(engine.step)
            return engine.protocol.take_mean()

    def correct(self, grads):
        """:meth:`round_mean`, then the gradients corrected (eager; the frontends build the
        correction into the compiled step instead, :func:`tfsync.engine.tf_bridge.correct_gradients`)."""
        return self.engine.protocol.correct(grads, self.round_mean())

    def before_push(self, step):
        if self._wait is None:
            raise RuntimeError(
                f"tfsync: policy {self.engine.policy.name!r} corrects each step's gradients before the "
                f"optimizer runs: call Corrections.round_mean (or correct) before SyncEngine.sync_step"
            )
        waited, self._wait = self._wait, None
        return waited

    def own_count(self, res):
        if res.round in self._rounds:
            self._rounds.discard(res.round)
            return "compensated"
        return None

    def after_apply(self, res):
        self._rounds.discard(res.round)  # (a rejected contribution's round: not counted here)
