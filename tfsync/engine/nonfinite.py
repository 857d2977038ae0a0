"""Contributions that are not finite: rejected before they reach a round, or the job stopped.

One worker's batch with a NaN in its inputs, or an update that overflowed,
makes its contribution NaN or infinite; summed into a round, it would make
every replica's weights NaN.  Each step protocol hands the engine, with its
contribution, whether each of its tensors is finite, found where the
contribution is built (:mod:`tfsync.engine.protocols`).  Under BSP the
round's sum is checked instead: a contribution found not finite once its
round's sum was not, or a round whose finite contributions overflowed in
their sum, comes back in the round's result, counted on apply
(:meth:`NonFinite.before_apply`).  Either way
:class:`NonFinite`, a component every engine holds, decides with the
engine's ``on_nonfinite``:

* ``"reject"`` (the default): the contribution is rejected.  The protocol
  takes back what it already did to this worker's weights (the update
  protocols apply their own update before the exchange) and zeros go in its
  place; its row in the round's metadata says ``present`` 0 and ``rejected``
  1, so the round's mean is over the ranks present
  (:mod:`tfsync.engine.exchange`) and every replica applies the same finite
  result.  A round whose every contribution was rejected has zeros for its
  result: under the modes that exchange gradients (BSP, PSP, backup workers)
  every replica's optimizer applies them (plain SGD does not move; momentum
  and Adam move by what their slots hold, alike on every replica); under the
  others the average weights do not move.
  Under the modes whose optimizer runs on each worker's own gradients first
  (SSP, DSSP, ElasticBSP, DC-S3GD) the frontends keep a non-finite gradient
  from that optimizer (:func:`tfsync.engine.protocols.path.apply_if_finite`), so
  no NaN stays in its slots.  A rejection is counted as ``rejected`` (produced = applied
  + compensated + dropped + rejected), traced (``{"event": "rejected",
  "rank", "step", ...}``, and the step's record's ``rejected``) and logged as a
  warning (logger ``tfsync.nonfinite``) at most once per ``WARN_INTERVAL_S``,
  with the number not logged since the last.
* ``"raise"``: the job stops with :class:`NonFiniteError` naming the rank and
  the step.  The contribution is still sent rejected, so its round completes
  on every rank (a peer waiting inside the collective is not left there);
  this rank then raises, and every other rank raises the same error when it
  applies a round whose metadata has a rejected row, or, where no round took
  the row (a coordinated round that closed without this rank), from the stop
  notice the control path brings.

A late contribution (``compensate=``, :mod:`tfsync.engine.components.late`) is checked
once corrected, before it is offered: one that is not finite is rejected the
same way and never offered.

Under ``compression=`` (:mod:`tfsync.engine.wire.compression`) a contribution that
is finite but has an element beyond what the wire type's sum can carry
(float16: 65504 over the number of workers, less rounding room) could make
the round's sum an infinity: it is rejected the same way, before it is sent,
and the warning or error says so.  Under BSP the round's sum shows it, and
the redone round rejects such a contribution with the ones that are not finite.
"""

import logging
import time

import numpy as np

from tfsync.engine.components import StepComponent

ON_NONFINITE = ("reject", "raise")
WARN_INTERVAL_S = 10.0  # at most one warning per this many seconds per worker; the rest are counted in it

log = logging.getLogger("tfsync.nonfinite")

FIX = (
    "look for a NaN or an infinity in that batch's inputs or labels, or an update that overflows "
    "(lower the learning rate, clip gradients)"
)
OUTCOME = "have a NaN or an infinity; the round goes on without it"
WIRE_FIX = "lower the learning rate or clip gradients, or use compression='bf16' (float32's range) or compression=None"


class NonFiniteError(FloatingPointError):
    """A worker's contribution was NaN or infinite under ``on_nonfinite="raise"``; the message
    names the rank and the step."""


def check_option(on_nonfinite) -> str:
    """``on_nonfinite`` checked: ``"reject"`` or ``"raise"``."""
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(
            f"tfsync: on_nonfinite={on_nonfinite!r} is not one of {list(ON_NONFINITE)}; use 'reject' "
            f"(the default: a contribution with a NaN or an infinity is left out of its round, counted "
            f"as tfsync_rejected, and training goes on) or 'raise' (the job stops, naming the rank and step)"
        )
    return on_nonfinite


class NonFinite(StepComponent):
    """Rejects this worker's contributions that are not finite, or stops the job (module docstring)."""

    def __init__(self, on_nonfinite="reject"):
        self.on_nonfinite = check_option(on_nonfinite)
        self._error = None  # under "raise": this rank's error, raised once its round is pushed
        self._this_step = 0  # rejected since the last step record
        self._warned_at = None  # monotonic time of the last warning
        self._unlogged = 0  # rejections not logged since then

    def screen(self, step: int, payload: list, finite):
        """``(payload, rejected)`` for this worker's contribution to ``step`` (``finite``: a
        bool per tensor): a contribution that is not finite is taken back from this worker's
        weights (``protocol.reject``) and replaced by zeros."""
        if finite is None:  # not checked here: the round's sum is (open rounds of gradients)
            return payload, False
        engine = self.engine
        bad, what, why = _not_finite(finite), engine.protocol.describes, {}
        if not bad and engine.wire.format is not None:
            bad = _not_finite(engine.wire.format.in_range(payload))
            what, why = self._beyond_wire(what)
        if not bad:
            return payload, False
        payload = engine.protocol.reject(payload)
        self._reject(step, bad, what, {}, **why)
        if self.on_nonfinite == "raise":
            self._error = self._own_error(step, bad, what, why.get("fix", FIX))
        return payload, True

    def _beyond_wire(self, what):
        """``(what, {outcome, fix})`` for a contribution finite but beyond the wire type's range."""
        wire = self.engine.wire.format
        return (
            f"{what} (finite, but beyond what {wire.describe()} carries: |x| > {wire.limit:.6g})",
            {"outcome": "would overflow on the wire; the round goes on without it", "fix": WIRE_FIX},
        )

    def pushed(self):
        """The step's round is pushed: under ``"raise"``, a rejected contribution now stops the job."""
        error, self._error = self._error, None
        if error is not None:
            raise self.engine.stop(error)

    def screen_late(self, stamp: int, offered_at: int, finite, payload=None) -> bool:
        """Whether this worker's late contribution computed for step ``stamp``, corrected to be
        offered at ``offered_at``, is rejected (under ``"raise"``: the job stops); ``payload``: the
        corrected contribution (checked against the wire type's range under ``compression=``)."""
        bad = _not_finite(finite)
        what, why = "late gradient (corrected for its delay)", {}
        if not bad and payload is not None and self.engine.wire.format is not None:
            bad = _not_finite(self.engine.wire.format.in_range(payload))
            what, why = self._beyond_wire(what)
        if not bad:
            return False
        self._reject(stamp, bad, what, {"offered_at": offered_at}, **why)
        if self.on_nonfinite == "raise":
            raise self.engine.stop(self._own_error(stamp, bad, what, why.get("fix", FIX)))
        return True

    def before_apply(self, res):
        found = res.rejected_after_sum
        if found is not None:  # this rank's contribution, rejected once the round's sum was not finite
            kind, bad = found
            step = int(res.steps[self.engine.rank])
            what = "gradients" if kind == "own" else "gradients (finite, but the round's sum of them overflowed)"
            wire = self.engine.wire.format
            beyond = "" if wire is None else f" or exceed what {wire.describe()} carries (|x| > {wire.limit:.6g})"
            outcome = (
                f"have a NaN or an infinity{beyond}; the round went on without it"
                if kind == "own"
                else "summed over the workers to a NaN or an infinity; the round was rejected on every worker"
            )
            fix = FIX if wire is None else f"{FIX}; if it is finite, {WIRE_FIX}"
            self._reject(step, bad, what, {"round": res.round}, outcome, fix)
            if kind == "own" and self.on_nonfinite == "raise":
                raise self.engine.stop(self._own_error(step, bad, what, fix))
            if kind == "sum" and self.on_nonfinite == "raise":
                raise self.engine.stop(
                    NonFiniteError(
                        f"tfsync: the sum of round {res.round}'s gradients overflowed (weight tensors {bad}) "
                        f"though every contribution was finite, and on_nonfinite='raise' stops the job; lower "
                        f"the learning rate or clip gradients, or pass on_nonfinite='reject' to train on "
                        f"without such rounds"
                    )
                )
        if self.on_nonfinite != "raise" or res.rejected is None or not res.rejected.any():
            return
        ranks = np.flatnonzero(res.rejected).tolist()
        steps = [int(res.steps[k]) for k in ranks]
        named = ", ".join(f"rank {k} at step {s}" for k, s in zip(ranks, steps))
        raise self.engine.stop(
            NonFiniteError(
                f"tfsync: the contribution of {named} had a NaN or an infinity (round {res.round}), and "
                f"on_nonfinite='raise' stops the job; {FIX}, or pass on_nonfinite='reject' to train on "
                f"without such contributions"
            )
        )

    def end_step(self, step, wait_s, skipped):
        rejected, self._this_step = self._this_step, 0
        return {"rejected": rejected}

    # ------------------------------------------------------------------ internals
    def _reject(self, step, bad, what, extra, outcome=OUTCOME, fix=FIX):
        engine = self.engine
        engine.tally.add("rejected")
        self._this_step += 1
        record = {"event": "rejected", "rank": engine.rank, "step": step, "t": engine.now(), "what": what}
        engine.trace({**record, "tensors": bad, "shapes": [engine.shapes[i] for i in bad], **extra})
        now = time.monotonic()
        if self._warned_at is not None and now - self._warned_at < WARN_INTERVAL_S:
            self._unlogged += 1
            return
        since = f" ({self._unlogged} more since the last warning)" if self._unlogged else ""
        self._warned_at, self._unlogged = now, 0
        log.warning(
            "tfsync: rank %d rejected its %s at step %d: weight tensors %s (of %d) %s%s. If this repeats, %s",
            engine.rank,
            what,
            step,
            bad,
            len(engine.shapes),
            outcome,
            since,
            fix,
        )

    def _own_error(self, step, bad, what, fix=FIX):
        engine = self.engine
        shapes = [engine.shapes[i] for i in bad]
        problem = "was beyond the wire type's range" if fix is WIRE_FIX else "had a NaN or an infinity"
        return NonFiniteError(
            f"tfsync: rank {engine.rank}'s {what} at step {step} {problem} (weight tensors "
            f"{bad} of {len(engine.shapes)}, shapes {shapes}), and on_nonfinite='raise' stops the job; {fix}, "
            f"or pass on_nonfinite='reject' to train on without such contributions"
        )


def _not_finite(finite) -> list:
    """The indices of the tensors that are not finite (``finite``: a bool tensor or array)."""
    finite = np.asarray(finite)
    if finite.all():
        return []
    return np.flatnonzero(~finite).tolist()
