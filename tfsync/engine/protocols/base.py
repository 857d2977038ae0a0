"""The interface every step protocol implements (:class:`StepProtocol`).

A step protocol is what one step of a worker contributes to a round and what a
completed round does to its weights: the gradients before the optimizer
(:mod:`~tfsync.engine.protocols.gradient`), the update after it
(:mod:`~tfsync.engine.protocols.update`), DC-S3GD's corrected update
(:mod:`~tfsync.engine.protocols.compensated`), Local SGD's and DiLoCo's
pseudo-gradient every ``H`` steps (:mod:`~tfsync.engine.protocols.outer`).
A policy names its protocol by ``policy.payload``; the engine builds the
protocol object once, when it starts, on the tensors the frontend hands it,
and calls only this interface.  What the protocol makes of the optimizer's
update is its :class:`~tfsync.engine.protocols.path.OptimizerPath`, which the
frontends install and call without asking the protocol what it is.

A new protocol is one module with a subclass of :class:`StepProtocol` (and its
path) and one :func:`tfsync.engine.protocols.register` call.
"""

from tfsync.engine.wire import Round

REST_PROBE_STEPS = 64  # the steps rest_steps asks a policy's sync_round about (its rule is periodic or fixed)


class StepProtocol:
    """One step's contribution and a round's application (base class: documents every hook).

    Class attributes:
        payload: the name a policy gives (``Policy.payload``).
        describes: what one contribution is, in words (warnings and errors say it).
        averages: the round's collective averages the contributions (Horovod's ``Average``);
            False: it sums them.
    """

    payload = ""
    describes = "contribution"
    averages = False

    # ------------------------------------------------------------ decided once
    @classmethod
    def check_policy(cls, policy) -> None:
        """Raise ``ValueError`` when ``policy`` asks for what this protocol cannot do (called
        when the engine resolves the protocol, before any collective)."""
        if policy.coordinated:
            raise ValueError(
                f"tfsync: policy {policy.name!r} is coordinated but names the {cls.payload!r} protocol; "
                f"coordinated rounds carry gradients"
            )

    @classmethod
    def components(cls, policy) -> list:
        """The engine components (:class:`tfsync.engine.components.StepComponent`) this protocol
        adds to every step of ``policy``'s engine."""
        return []

    @classmethod
    def round(cls, policy) -> Round:
        """What this protocol's rounds are (:class:`~tfsync.engine.wire.Round`): they average
        with ``averages`` by default; the engine opens the wire for them once
        (:func:`tfsync.engine.wire.open_wire`), in ``policy.compression``'s wire type where set."""
        return Round(averages=cls.averages)

    @classmethod
    def optimizer_path(cls, policy, engine, optimizer=None, station="apply", shared=False):
        """What ``optimizer``'s update becomes under this protocol
        (:class:`~tfsync.engine.protocols.path.OptimizerPath`): built once, installed by a frontend.

        ``engine``: the engine, or a callable returning it (looked up at every step);
        ``station``: where the frontend hooks the optimizer, ``"apply"`` (its ``apply``, the
        callback) or ``"all_reduce"`` (its gradient all-reduce, the strategy); ``shared``: a
        compiled train step built on this path serves later engines too (auto mode)."""
        raise NotImplementedError(f"{cls.__name__} does not say what the optimizer's update becomes")

    @classmethod
    def rest_steps(cls, policy):
        """How often every worker is at rest under ``policy`` (:meth:`SyncEngine.at_rest
        <tfsync.engine.SyncEngine.at_rest>`: its weights hold every round it pushed and nothing
        else, the same on every replica): 1, after every step, when each step waits for its own
        round; None when a worker goes on before it (then no step is sure to be one: an elastic
        job commits at epoch ends only)."""
        return 1 if all(policy.sync_round(s) >= s for s in range(REST_PROBE_STEPS)) else None

    # ------------------------------------------------------------- the engine's
    def __init__(self, tensors, size: int, policy):
        """The protocol's state for ``tensors`` (the model's trainable variables, or the gradients'
        shapes and dtypes) of a job of ``size`` workers under ``policy``."""

    def bind(self, engine) -> None:
        """Called once the engine's exchange and control path exist."""

    def contribution(self, inputs):
        """This step's contribution from what the frontend's ``sync_step`` passed: ``(payload,
        finite)``, ``finite`` a bool per tensor or None (not checked here)."""
        raise NotImplementedError

    def reject(self, payload):
        """A contribution that is not finite goes nowhere: undo what it did to this worker's
        weights; returns what is sent in its place (zeros)."""
        raise NotImplementedError

    def absent(self):
        """What a rank that contributes nothing to a round sends (zeros, built once)."""
        raise NotImplementedError

    def apply_round(self, result) -> None:
        """Apply a completed round (:class:`~tfsync.engine.rounds.RoundResult`)."""
        raise NotImplementedError

    def last_round(self, completed: int, required: int) -> int:
        """The newest round a step that waited for ``required`` applies (``completed``: the newest
        complete one): every complete round by default."""
        return completed

    def result(self):
        """What the step's ``sync_step`` returns to the compiled step."""
        return []

    def finish(self) -> None:
        """Every round is applied: leave the weights identical on every replica."""

    def at_rest(self) -> bool:
        """Whether the weights hold nothing beyond the rounds applied (the engine checks that every
        round pushed is): True unless the protocol keeps a worker's own work aside (an outer period
        under way)."""
        return True


__all__ = ["StepProtocol"]
