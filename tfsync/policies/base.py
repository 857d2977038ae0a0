"""The interface every synchronization mode implements (see :mod:`tfsync.policies`)."""

import abc
import dataclasses


@dataclasses.dataclass(frozen=True)
class Closing:
    """A coordinator's decision about one round (:meth:`Policy.close_round`).

    ``accepted``: the ranks whose contributions the round aggregates, sorted,
    or ``None`` while the round stays open; only ranks whose contribution is
    ready, each once (:func:`decide_round` checks, and the job stops
    otherwise).  ``recheck_s``: when to ask again if no new contribution
    arrives before (``None``: only on a new arrival).
    """

    accepted: tuple = None
    recheck_s: float = None


COMPRESSIONS = ("fp16", "bf16")  # the wire formats of ``compression=`` (None: the payload's own dtype)


def check_compression(owner: str, compression):
    """``compression`` checked: None, ``"fp16"`` or ``"bf16"`` (``owner``: the class, for the message)."""
    if compression is None or (isinstance(compression, str) and compression in COMPRESSIONS):
        return compression
    raise ValueError(
        f"{owner}(compression={compression!r}): compression must be None (the payload goes on the wire in "
        f"its own dtype, the default), 'fp16' or 'bf16' (floating tensors are cast to that 16-bit type for "
        f"the exchange, half the bytes of float32, and cast back after it); e.g. "
        f"tfsync.{owner}(compression='fp16')"
    )


@dataclasses.dataclass(frozen=True)
class Policy(abc.ABC):
    """Interface of a synchronization mode.

    Subclasses are small frozen dataclasses validated on construction, so that
    a bad configuration fails before any worker starts training; settings that
    depend on the number of workers are checked by :meth:`validate` when the
    engine starts, before the first step.  A subclass that defines
    ``__post_init__`` calls ``super().__post_init__()``.

    Every mode takes the keyword ``compression`` (default None): ``"fp16"`` or
    ``"bf16"`` sends the floating tensors of each round's exchange in that
    16-bit type (half float32's bytes) and casts the result back, as Horovod's
    ``Compression.fp16`` does; what that does to overflow and rounding is in
    :mod:`tfsync.engine.wire.compression`.  The round's metadata stays float32 and exact.

    Class attributes:
        name: the mode's string (``mode="ssp"``).
        payload: the step protocol (``"gradients"`` or ``"updates"``).
        coordinated: rounds close by rank 0's :meth:`close_round` decision
            rather than when every worker has contributed.
        skips: a worker whose next round closed without it skips that step's
            computation (counted as ``skipped``) instead of computing a
            contribution that could only be dropped.
        accepts_ready: (coordinated policies) every rank whose ready notice
            for the oldest open round arrives before :meth:`close_round`
            closes it is in the accepted set, so the coordinator can tell
            it so at once and it enters the round's allreduce without
            waiting for the closing (the coordinator checks the promise at
            every closing and stops the job if a policy breaks it).
        enters_when_ready: (coordinated policies) a round aggregates every
            fresh contribution its ranks hold when they enter it, so a rank
            enters the oldest open round at once when its contribution is
            ready, without waiting for the coordinator's answer, and a rank
            that is not ready enters on the closing with what it holds then
            (its contribution if it became ready meanwhile, zeros
            otherwise).  The closing's accepted ranks are then a lower bound
            of what the round aggregates, which the round's metadata states
            identically on every rank.  ``False``: exactly the closing's
            ranks (backup workers' first ``N``).
        pulls_partially: a worker may start a step before every block of its
            round's result arrived (PSP's partial pulling).
        compensate: a :class:`tfsync.DelayCompensation` when late
            contributions are corrected and applied instead of dropped
            (the gradient protocol then keeps the weights they were computed on).
        every_round_whole: every rank enters every round and applies its mean at the step
            that pushed it, and nothing is decided per step (BSP): the round can run as in-graph
            ops inside the compiled step (:mod:`tfsync.engine.protocols.in_graph`).  A subclass
            that decides anything per step sets it False.

    What a mode does beyond choosing rounds is in engine components and a
    service on rank 0's coordinator: the engine binds the built-in modes to
    theirs (:mod:`tfsync.engine.components.bindings`); a mode defined outside tfsync
    supplies its own through :meth:`components` and :meth:`service`.
    """

    name = ""
    payload = ""
    coordinated = False
    skips = False
    accepts_ready = False
    enters_when_ready = False
    pulls_partially = False
    compensate = None
    every_round_whole = False
    compression: str = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        check_compression(type(self).__name__, self.compression)

    @abc.abstractmethod
    def required_round(self, step: int) -> int:
        """Newest round that must be complete at the sync point of ``step`` (-1: none)."""

    def sync_round(self, step: int) -> int:
        """The round a worker that pushed ``step`` waits for before it goes on (the engine's
        wait and the simulator's, one rule): :meth:`required_round` of the next use of the
        weights its step protocol makes.  Under the gradient protocols that is step ``step``'s
        own apply (DC-S3GD: its correction); under the update protocol (SSP, DSSP, ElasticBSP)
        it is computing step ``step + 1``.
        """
        return self.required_round(step + 1 if self.payload == "updates" else step)

    def validate(self, size: int) -> None:  # noqa: B027 (a hook: most policies take any size)
        """Raise ``ValueError`` if the settings cannot work with ``size`` workers."""

    def close_round(self, ready, opened_s: float, now_s: float, size: int) -> Closing:
        """Whether the round closes now (coordinated policies only).

        Args:
            ready: ``(rank, ready_s)`` pairs, in arrival order, of the workers
                whose contribution to this round (computed on the weights of
                the round before it) is ready.
            opened_s: when the previous round closed (the job's start for round 0).
            now_s: the coordinator's clock; all times are seconds since the job's t0.
            size: the number of workers.
        """
        raise NotImplementedError(
            f"{type(self).__name__} closes a round when every worker contributed; the coordinator "
            "asks only policies with coordinated = True"
        )

    def components(self) -> list:
        """The engine components a mode defined outside tfsync adds to every step, built once per
        engine (:class:`tfsync.engine.components.StepComponent`; called when the engine starts,
        after the built-in modes' own, :mod:`tfsync.engine.components.bindings`)."""
        return []

    def service(self, size: int):
        """What rank 0's coordinator runs for this mode, or None: an object with
        ``tell(rank, topic, message, now_s)`` and ``ask(rank, topic, message, now_s) -> dict``,
        which workers reach through :meth:`ControlClient.tell` and :meth:`ControlClient.ask`
        (:mod:`tfsync.control`)."""
        return None

    def config(self) -> dict:
        """Plain-data description, compared across ranks and written to traces."""
        return {"mode": self.name, **dataclasses.asdict(self)}


def decide_round(policy: Policy, ready, opened_s: float, now_s: float, size: int) -> Closing:
    """``policy.close_round``, checked: a closing may accept only ranks whose contribution
    is ready, each once, and at least one (every replica divides the round's sum by the
    number accepted, so a rank accepted without a contribution would skew every mean).

    Raises ``ValueError`` naming the ranks, for the coordinator to stop the job with.
    """
    closing = policy.close_round(ready, opened_s, now_s, size)
    if closing.accepted is None:
        return closing
    accepted = list(closing.accepted)
    ready_ranks = {rank for rank, _ in ready}
    not_ready = sorted(set(accepted) - ready_ranks)
    if not accepted or not_ready or len(set(accepted)) != len(accepted):
        raise ValueError(
            f"{type(policy).__name__}.close_round accepted {accepted} with ranks {sorted(ready_ranks)} ready: "
            f"expected a non-empty set of ready ranks, each once" + (f" (not ready: {not_ready})" if not_ready else "")
        )
    return closing
