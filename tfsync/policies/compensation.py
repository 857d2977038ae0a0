"""Delay compensation: a gradient applied at weights other than those it was computed on,
corrected to first order instead of used as it is.

* :class:`DelayCompensation`: the correction's settings, DC-ASGD (Zheng et al.,
  ICML 2017): ``g̃ = g + λ · g ⊙ g ⊙ (w_now − w_stale)``, where ``g`` was
  computed at ``w_stale`` and is applied at ``w_now``; ``g ⊙ g`` stands in for
  the Hessian's diagonal.  Constant ``λ`` is DC-ASGD-c; ``adaptive=True`` is
  DC-ASGD-a, ``λ_t = λ0 / sqrt(v_t + ε)`` with ``v_t = m · v_{t−1} + (1 − m) · g ⊙ g``
  kept per parameter.  Both run as one fused pass of :mod:`tfsync.ops`.
* :class:`DCS3GD`: decentralized stale-synchronous SGD with delay compensation
  (*DC-S3GD: Delay-Compensated Stale-Synchronous SGD for Large-Scale
  Decentralized Neural Network Training*, Section III-C and Algorithm 1).
* ``compensate=`` of PSP and backup workers (:mod:`tfsync.policies.partial`): a
  contribution that missed its round is corrected and joins a later one
  instead of being dropped.
"""

import dataclasses
import math

from tfsync.policies.base import Policy

# DC-ASGD's settings on CIFAR-10 (Zheng et al. 2017): λ = 0.04 for the constant
# form, λ0 = 2 for the adaptive one with m = 0.95.
DEFAULT_LAMBDA = 0.04
DEFAULT_ADAPTIVE_LAMBDA = 2.0
DEFAULT_MOMENTUM = 0.95
DEFAULT_EPSILON = 1e-7


def _check_number(owner, name, value, hint, *, minimum=None, positive=False, below=None):
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be a number, got {type(value).__name__}; {hint}")
    ok = math.isfinite(value)
    expected = "a finite number"
    if minimum is not None:
        ok, expected = ok and value >= minimum, f"a finite number >= {minimum}"
    if positive:
        ok, expected = ok and value > 0, "a finite number > 0"
    if below is not None:
        ok, expected = ok and value < below, f"{expected} and < {below}"
    if not ok:
        raise ValueError(f"{owner}({name}={value!r}): {name} must be {expected}; {hint}")


@dataclasses.dataclass(frozen=True)
class DelayCompensation:
    """DC-ASGD's first-order correction of a stale gradient (Zheng et al. 2017).

    ``g̃ = g + λ · g ⊙ g ⊙ (w_now − w_stale)``: ``g`` was computed at the
    weights ``w_stale`` and is applied at ``w_now``.

    Args:
        lam: ``λ`` (constant form) or ``λ0`` (adaptive form), a finite number
            ``>= 0``; ``0`` turns the correction off (the mode then behaves
            exactly as without it).  Default ``None``: 0.04 constant, 2.0
            adaptive (DC-ASGD's CIFAR-10 settings).
        adaptive: ``False`` (default): constant ``λ`` (DC-ASGD-c).  ``True``:
            ``λ_t = lam / sqrt(v_t + epsilon)`` per parameter, with
            ``v_t = momentum · v_{t−1} + (1 − momentum) · g ⊙ g`` (DC-ASGD-a);
            ``v`` costs one float32 per parameter.
        momentum: ``m`` of the adaptive form, in ``[0, 1)``. Default 0.95.
        epsilon: ``ε`` of the adaptive form, ``> 0``. Default 1e-7.

    Example:

        tfsync.DCS3GD(compensation=tfsync.DelayCompensation(lam=0.04))
    """

    lam: float = None
    adaptive: bool = False
    momentum: float = DEFAULT_MOMENTUM
    epsilon: float = DEFAULT_EPSILON

    def __post_init__(self):
        hint = "e.g. tfsync.DelayCompensation(lam=0.04) or DelayCompensation(lam=2.0, adaptive=True, momentum=0.95)"
        if not isinstance(self.adaptive, bool):
            raise TypeError(
                f"DelayCompensation(adaptive={self.adaptive!r}): adaptive must be True or False, "
                f"got {type(self.adaptive).__name__}; {hint}"
            )
        if self.lam is not None:
            _check_number("DelayCompensation", "lam", self.lam, hint, minimum=0)
        _check_number("DelayCompensation", "momentum", self.momentum, hint, minimum=0, below=1)
        _check_number("DelayCompensation", "epsilon", self.epsilon, hint, positive=True)

    @property
    def strength(self) -> float:
        """``λ`` (or ``λ0``) in effect."""
        if self.lam is not None:
            return float(self.lam)
        return DEFAULT_ADAPTIVE_LAMBDA if self.adaptive else DEFAULT_LAMBDA


def check_compensate(owner: str, value) -> None:
    """``compensate=`` of a mode that applies late contributions: ``None`` or a DelayCompensation."""
    if value is not None and not isinstance(value, DelayCompensation):
        raise TypeError(
            f"{owner}(compensate={value!r}): compensate must be None (drop late contributions) or "
            f"a tfsync.DelayCompensation (correct and apply them), got {type(value).__name__}; e.g. "
            f"tfsync.{owner}(compensate=tfsync.DelayCompensation(lam=0.04))"
        )


@dataclasses.dataclass(frozen=True)
class DCS3GD(Policy):
    """Delay-compensated stale-synchronous SGD (DC-S3GD), decentralized, staleness 1.

    Each worker computes a gradient ``g_i`` at its local weights ``w_i`` while
    the allreduce of the previous step's updates is in flight (the overlap of
    Section III-C); then it waits for that round, moves the replicated average
    ``w̄ ← w̄ + (1/N) Σ_j Δ_j`` (equation 8), corrects its gradient with
    ``w_now = w̄`` and ``w_stale = w_i`` (equation 10, through
    :func:`tfsync.ops.delay_compensate`), lets the model's optimizer turn it
    into the update ``Δ_i = U(g̃_i)`` (equation 11; the paper's U is momentum
    SGD, here it is whatever optimizer the model was compiled with), moves to
    ``w_i = w̄ + Δ_i`` (equation 12) and hands ``Δ_i`` to the next round.

    The update follows DC-S3GD, Section III, with DC-ASGD's correction (Zheng
    et al., ICML 2017).  The optimizer's state (e.g. momentum) stays local to
    each worker, as in the paper's MXNet implementation, where every worker
    runs its own update function.

    Guarantees (tested): every round averages every worker's update of one
    step (no contribution is dropped or skipped); a gradient is applied one
    step after the weights it was computed on were current, corrected;
    ``lam=0`` applies it uncorrected; when training ends every replica holds
    the identical ``w̄``.  Per-parameter memory beside the model: ``w̄``, the
    local weights the gradient was computed on, the update in flight, and
    ``v`` with ``adaptive=True``: 3-4 copies of the parameters.

    Args:
        compensation: a :class:`DelayCompensation`. Default: constant
            ``λ = 0.04``.
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.DCS3GD())   # or mode="dcs3gd"
    """

    compensation: DelayCompensation = DelayCompensation()
    name = "dcs3gd"
    payload = "compensated_updates"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.compensation, DelayCompensation):
            raise TypeError(
                f"DCS3GD(compensation={self.compensation!r}): compensation must be a "
                f"tfsync.DelayCompensation, got {type(self.compensation).__name__}; e.g. "
                f"tfsync.DCS3GD(compensation=tfsync.DelayCompensation(lam=0.04))"
            )

    def required_round(self, step: int) -> int:
        # staleness 1: step t's gradient is applied once round t - 1 (the updates of step t - 1) is in
        return step - 1
