"""``mode="auto"``: measure the workers' iteration times, classify the slowness, pick a mode.

:class:`Auto` is not a synchronization rule of its own: ``SyncCallback`` runs
one of the other modes at a time, as its :class:`AutoController` decides:
once ``window_steps`` training steps have run (the first decision: mid-epoch,
as soon as they have, since Keras looks its train function up at every step;
the later ones at the first epoch end after ``window_steps`` more, where the
epoch logs' averaging waits for every worker anyway), the controller
classifies the iteration times every worker measured in them
(:func:`classify`, a pure function of those times) and switches to the mode
chosen for the profile.  A switch drains the running mode (every in-flight
round applied, update protocols settled: every replica holds identical
weights), broadcasts rank 0's optimizer state (SSP-family modes keep it per
worker), and starts the next mode's engine.  The first window runs BSP
(``initial``); its rounds' replicated metadata give every rank every worker's
compute time per step, so a worker that is persistently slow (:func:`early`) is
switched away from after ``EARLY_STEPS`` measured steps instead of the full window,
at the same step on every rank and without a gather.

Profiles, from the per-step compute times ``t[i][k]`` of worker ``i`` (its own
device time, waits excluded); ``m_i`` is worker ``i``'s median, ``M`` the
fastest worker's (the smallest ``m_i``: with two workers a median of the
medians would hide the slow one):

* ``straggler``: a persistently slow worker, ``max m_i >= STRAGGLER_RATIO * M``
  (its work is worth less than the others' wait for it);
* ``heterogeneous``: a persistently slower device,
  ``HETEROGENEOUS_RATIO * M <= max m_i < STRAGGLER_RATIO * M``;
* ``rare``: no persistent difference, and a few steps (at most
  ``RARE_MAX_FRACTION`` of them) take ``RARE_FACTOR`` times their worker's
  median or more;
* ``jitter``: no persistent difference, not rare, and the steps vary around
  their worker's median: the 10th to 90th percentile spread of ``t[i][k] / m_i``
  is ``JITTER_SPREAD`` or more (a percentile spread, so that one slow step does
  not make jitter; frequent large delays do);
* ``none``: otherwise.

The mode chosen for each slow profile (:func:`default_modes`) is the tfsync
mode that reached 0.95 test accuracy first in that scenario in the convergence
studies (docs/choosing.md): backup workers (b = 1) with delay compensation.  With no slowness it is BSP, every gradient
averaged at the optimizer's own step: backup+dc reached 0.95 sooner there too,
but through a larger effective step (a late gradient applied on top of the
round's mean), not by waiting less.  The profiles stay distinct so
that ``modes=`` can choose per profile (e.g. ``{"heterogeneous":
tfsync.ElasticBSP()}`` where dropping a slower device's work costs accuracy).
"""

import dataclasses
import statistics
import time

from tfsync.policies.base import Policy, check_compression
from tfsync.policies.compensation import DelayCompensation
from tfsync.policies.local import DiLoCo, LocalSGD
from tfsync.policies.partial import BackupWorkers
from tfsync.policies.sync import BSP

PROFILES = ("none", "straggler", "heterogeneous", "jitter", "rare")
STRAGGLER_RATIO = 2.5
HETEROGENEOUS_RATIO = 1.3
RARE_FACTOR = 10.0
RARE_MAX_FRACTION = 0.05
JITTER_SPREAD = 0.4
EARLY_STEPS = 4


@dataclasses.dataclass(frozen=True)
class Profile:
    """What :func:`classify` found: ``name`` (one of :data:`PROFILES`), a ``reason`` in words
    with the numbers behind it, and those numbers (``slowest_ratio``, ``rare_fraction``,
    ``spread``, ``slowest`` rank, ``steps`` per worker)."""

    name: str
    reason: str
    slowest_ratio: float
    slowest: int
    rare_fraction: float
    spread: float
    steps: int


def classify(step_times) -> Profile:
    """The profile of ``step_times``: one list per worker of its per-step compute seconds.

    A pure function: every rank gets the same answer from the same table.
    """
    if len(step_times) < 2 or min(len(t) for t in step_times) < 1:
        raise ValueError(
            f"tfsync.policies.auto.classify: need the step times of at least 2 workers with at least one "
            f"step each, got {[len(t) for t in step_times]} steps per worker"
        )
    if any(not (x >= 0.0) for t in step_times for x in t):
        raise ValueError("tfsync.policies.auto.classify: step times must be non-negative seconds")
    medians = [statistics.median(t) for t in step_times]
    typical = min(medians)
    slowest = max(range(len(medians)), key=medians.__getitem__)
    ratio = medians[slowest] / typical if typical > 0 else 1.0
    relative = [x / m for t, m in zip(step_times, medians) if m > 0 for x in t]
    outliers = [r for r in relative if r >= RARE_FACTOR]
    rare_fraction = len(outliers) / len(relative) if relative else 0.0
    deciles = statistics.quantiles(relative, n=10) if len(relative) > 1 else [1.0] * 9
    spread = deciles[-1] - deciles[0]
    steps = min(len(t) for t in step_times)
    numbers = dict(slowest_ratio=ratio, slowest=slowest, rare_fraction=rare_fraction, spread=spread, steps=steps)
    if ratio >= STRAGGLER_RATIO:
        return Profile(
            "straggler",
            f"worker {slowest}'s median step is {ratio:.2f}x the fastest worker's (>= {STRAGGLER_RATIO})",
            **numbers,
        )
    if ratio >= HETEROGENEOUS_RATIO:
        return Profile(
            "heterogeneous",
            f"worker {slowest}'s median step is {ratio:.2f}x the fastest worker's "
            f"(in [{HETEROGENEOUS_RATIO}, {STRAGGLER_RATIO}))",
            **numbers,
        )
    if outliers and rare_fraction <= RARE_MAX_FRACTION:
        return Profile(
            "rare",
            f"{len(outliers)} of {len(relative)} steps ({rare_fraction:.1%}) took >= {RARE_FACTOR}x their "
            f"worker's median (at most {RARE_MAX_FRACTION:.0%})",
            **numbers,
        )
    if spread >= JITTER_SPREAD:
        return Profile(
            "jitter",
            f"steps spread {spread:.2f}x their worker's median from the 10th to the 90th percentile "
            f"(>= {JITTER_SPREAD})",
            **numbers,
        )
    return Profile(
        "none",
        f"medians within {ratio:.2f}x, spread {spread:.2f} (< {JITTER_SPREAD}), "
        f"{len(outliers)} steps >= {RARE_FACTOR}x their median",
        **numbers,
    )


def early(step_times):
    """The profile of a persistently slow worker, if ``step_times`` already show one; else None.

    ``step_times``: per worker, its compute seconds in the same rounds (one list per worker,
    equally long: the first window's rounds under BSP, whose replicated metadata gives every
    rank the same table).  A pure function.  After at least ``EARLY_STEPS`` rounds, a
    ``straggler`` or ``heterogeneous`` profile (:func:`classify`) is taken at once when its
    slowest worker was the slowest in every one of them: with one worker slower by chance
    in each round, the same one is the slowest in all of ``n`` rounds with probability
    ``size**(1-n)`` (1 in 64 for 4 workers and 4 rounds), and then its median must still be
    ``HETEROGENEOUS_RATIO`` times the fastest one's.  Transient slowness (jitter, rare delays)
    needs the full window.
    """
    n = min(len(t) for t in step_times) if step_times else 0
    if n < EARLY_STEPS or len(step_times) < 2:
        return None
    profile = classify(step_times)
    if profile.name not in ("straggler", "heterogeneous"):
        return None
    slow = profile.slowest
    if any(max(range(len(step_times)), key=lambda i: step_times[i][k]) != slow for k in range(n)):
        return None
    return dataclasses.replace(
        profile, reason=f"{profile.reason}, and the slowest in each of the first {n} measured steps"
    )


def default_modes():
    """Profile -> policy, from the convergence studies (module docstring).

    Under every kind of slowness, backup workers (b = 1) with delay compensation; with none,
    BSP, which keeps the user's step: backup+dc adds each late gradient on top of the round's
    mean, a step up to 4/3 of BSP's, and choosing that would change the effective learning
    rate, not the synchronization. The measurements behind this are in docs/choosing.md.
    """
    slow = BackupWorkers(backups=1, compensate=DelayCompensation())
    return {"none": BSP(), "straggler": slow, "heterogeneous": slow, "jitter": slow, "rare": slow}


@dataclasses.dataclass(frozen=True)
class Auto:
    """Pick the synchronization mode from measured iteration times, and re-pick when they change.

    Args:
        modes: ``{profile: policy}`` overriding :func:`default_modes` for some profiles
            (profiles: ``"none"``, ``"straggler"``, ``"heterogeneous"``, ``"jitter"``, ``"rare"``).
        window_steps: the first decision is taken after this many training steps, mid-epoch
            included, the later ones at the first epoch end with at least this many steps since
            the last (default 16; skipped steps count; the first step of an epoch and of a newly
            compiled mode is not measured); every rank decides after the same step; none when
            fewer steps than this remain in ``fit`` (a switch there could not pay for itself).
        confirm: after the first decision, a switch needs the same new profile at this many
            consecutive decisions (default 2), so that one unusual epoch does not flip the mode.
        initial: the mode of the first window (default BSP: plain Horovod's semantics until
            a slowness is measured).  Under BSP every round's metadata carries every worker's
            compute time, the same on every rank, so a persistently slow worker switches the
            mode after ``EARLY_STEPS`` (4) measured steps (:func:`early`), without a gather.
        compression: None (default), ``"fp16"`` or ``"bf16"``: the wire type of every mode it
            runs that sets none of its own (:class:`tfsync.policies.Policy`).

    Only ``tfsync.keras.SyncCallback`` runs it (it switches between two steps).  Each
    decision is logged on rank 0 (logger ``tfsync.auto``, INFO), written to the trace
    (``{"event": "auto", ...}``), kept in ``SyncCallback.auto_decisions``, and put in
    the epoch logs as ``tfsync_auto_profile`` (an index into ``PROFILES``) and
    ``tfsync_auto_switches``.

    Example:

        tfsync.keras.SyncCallback(mode="auto")
        tfsync.keras.SyncCallback(mode=tfsync.Auto(modes={"straggler": tfsync.PSP()}))
    """

    name = "auto"
    modes: dict = None
    window_steps: int = 16
    confirm: int = 2
    initial: object = None
    compression: str = None

    def __post_init__(self):
        check_compression("Auto", self.compression)
        for field, value, low, default in (
            ("window_steps", self.window_steps, 1, 16),
            ("confirm", self.confirm, 1, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"tfsync.Auto: {field}={value!r} must be an integer >= {low}; "
                    f"e.g. tfsync.Auto({field}={default}) (the default)"
                )
        if self.modes is not None and not isinstance(self.modes, dict):
            raise ValueError(
                f"tfsync.Auto: modes={self.modes!r} must be a dict mapping profiles to policies "
                f"(profiles: {', '.join(PROFILES)}); e.g. tfsync.Auto(modes={{'straggler': tfsync.PSP()}})"
            )
        given = dict(self.modes or {})
        unknown = sorted(set(given) - set(PROFILES), key=repr)
        if unknown:
            raise ValueError(
                f"tfsync.Auto: modes has unknown profiles {unknown}; the profiles are {', '.join(PROFILES)}; "
                f"key modes by those names, e.g. tfsync.Auto(modes={{'straggler': tfsync.PSP()}})"
            )
        chosen = {**default_modes(), **given}
        initial = BSP() if self.initial is None else self.initial
        for where, policy in [*((f"modes[{p!r}]", m) for p, m in chosen.items()), ("initial", initial)]:
            if not isinstance(policy, Policy):
                raise ValueError(
                    f"tfsync.Auto: {where}={policy!r} is not a synchronization mode; pass a policy object "
                    f"such as tfsync.SSP(staleness=3) (not 'auto' or a string)"
                )
            if policy.pulls_partially:
                raise ValueError(
                    f"tfsync.Auto: {where}={policy!r} pulls partially, which auto mode does not switch "
                    f"to or from (its rounds are applied block by block outside the shared train "
                    f"step); use PSP(pull_fraction=1.0) there, or the PSP mode on its own"
                )
            if isinstance(policy, LocalSGD | DiLoCo):
                raise ValueError(
                    f"tfsync.Auto: {where}={policy!r} takes local steps between rounds, which auto mode "
                    f"does not switch to or from (its measurements and decisions are per step, and only "
                    f"every H-th step is a round there); use {type(policy).__name__} on its own"
                )
        if self.compression is not None:  # (a mode that sets its own keeps it)
            chosen = {p: _compressed(m, self.compression) for p, m in chosen.items()}
            initial = _compressed(initial, self.compression)
        object.__setattr__(self, "modes", chosen)
        object.__setattr__(self, "initial", initial)

    def config(self) -> dict:
        return {
            "mode": self.name,
            "modes": {p: m.config() for p, m in self.modes.items()},
            "window_steps": self.window_steps,
            "confirm": self.confirm,
            "initial": self.initial.config(),
            "compression": self.compression,
        }

    def validate(self, size: int) -> None:
        for policy in (self.initial, *self.modes.values()):
            policy.validate(size)

    def mode_for(self, profile: str):
        return self.modes[profile]

    def in_force(self, current, candidate, observed):
        """The profile in force after a decision that ``observed`` a profile (a pure function).

        ``current``: the profile in force (``None`` before the first decision, which takes
        ``observed`` at once); ``candidate``: ``(profile, times seen in a row)`` so far.
        Returns ``(profile in force, new candidate)``: a different profile takes over once it
        was observed at ``confirm`` consecutive decisions.
        """
        name, seen = candidate
        seen = seen + 1 if observed == name else 1
        confirmed = current is None or (observed != current and seen >= self.confirm)
        return (observed if confirmed else current), (observed, seen)


def _compressed(policy, compression):
    return policy if policy.compression is not None else dataclasses.replace(policy, compression=compression)


class AutoController:
    """Auto mode's measurements and decisions during one ``fit``; the frontend runs the switches.

    Pure Python over the numbers the engine reports after each step
    (``engine.last``): the frontend calls :meth:`epoch_begin`, :meth:`after_step`
    after every training step and :meth:`due_at_epoch_end` at an epoch's end;
    when a decision is due it calls :meth:`decide`, and when that returns a mode
    to switch to, it drains the running engine, starts the new one and calls
    :meth:`started` with whether the train step was compiled again.

    Args:
        auto: the :class:`Auto` settings.
        size: the number of workers (2 or more: auto mode compares them).
        steps: the training steps ``fit`` will run (steps per epoch times epochs).
        gather: ``gather(window) -> every rank's window``, a collective in the job's order.
    """

    def __init__(self, auto, size, steps, gather):
        if size < 2:
            raise ValueError("tfsync.keras.SyncCallback: mode 'auto' compares workers; launch 2 or more")
        auto.validate(size)  # every mode it may switch to, before training, not at a switch
        self.auto, self._gather = auto, gather
        self.policy = auto.initial
        self.decisions, self.switches = [], 0
        self.deferred = []  # decisions put off: a worker computed no step in the window
        self._window, self._window_steps, self._candidate = [], 0, (None, 0)
        self._shared = [[] for _ in range(size)]  # every rank's times, from BSP's rounds
        self._steps_left = steps
        self._unmeasured = True

    def epoch_begin(self):
        # an epoch's first step also times what ran between epochs (evaluation, callbacks):
        # left out, or it would look like a rare delay
        self._unmeasured = True

    def started(self, retraced):
        """A switch started the next mode's engine; its first step is not measured when it retraces."""
        self._unmeasured = retraced

    def after_step(self, last):
        """Record one training step (``engine.last``); returns ``(due, found)``: whether a decision
        is due now, and the profile :func:`early` found in every rank's times (or None)."""
        self._window_steps += 1
        self._steps_left -= 1
        measured = not self._unmeasured
        if measured and not last.get("skipped", 0) and "compute_s" in last:
            self._window.append(last["compute_s"])
        self._unmeasured = False
        if self.decisions:
            return False, None  # the later decisions are taken at epoch ends
        # before the first decision under BSP: every round's metadata has every rank's time,
        # the same table on every rank, so a persistently slow worker is acted on early at the
        # same step everywhere, without a gather
        times = last.get("round_compute_s")
        if self.policy.name != "bsp" or times is None:
            self._shared = None  # not every rank's time in this step's round: no shared table
        elif measured and self._shared is not None:
            for row, t in zip(self._shared, times):
                row.append(float(t))
            found = early(self._shared) if self._steps_left >= self.auto.window_steps else None
            if found is not None:
                return True, found
        # the first decision as soon as the window is full, mid-epoch included
        return self._window_full(), None

    def due_at_epoch_end(self):
        """A later decision is due at this epoch's end (where the epoch logs' averaging waits for
        every worker anyway: a decision mid-epoch is one more barrier a rare delay makes every
        worker wait at)."""
        return bool(self.decisions) and self._window_full()

    def _window_full(self):
        """A full window, and enough steps left for a switch to pay."""
        return self._window_steps >= self.auto.window_steps and self._steps_left >= self.auto.window_steps

    def decide(self, epoch, batch, found=None):
        """Classify the window's step times (every rank the same table, the same answer).

        Every rank calls this after the same step.  ``found``: the profile :func:`early` found
        (no gather).  Returns ``(decision, policy to switch to or None)``; ``(None, None)`` when a
        worker computed nothing in the window (it skipped every step): decided later.  A switch
        at the first decision, later only after ``confirm`` consecutive decisions agree.  A
        put-off decision is noted in ``deferred`` (with the ranks that computed nothing).
        """
        from tfsync.policies.registry import describe

        window, t = self._window, time.monotonic()
        profile = found
        every = self._gather(window) if found is None else None
        wait_s = time.monotonic() - t
        self._window, self._window_steps, self._shared = [], 0, None
        if found is None:
            if min(len(w) for w in every) == 0:
                idle = [r for r, w in enumerate(every) if not w]
                self.deferred.append({"epoch": epoch, "batch": batch, "ranks_without_steps": idle})
                return None, None
            profile = classify(every)
        current = self.decisions[-1]["profile"] if self.decisions else None
        in_force, self._candidate = self.auto.in_force(current, self._candidate, profile.name)
        wanted = self.auto.mode_for(in_force)
        switch = wanted != self.policy
        decision = {
            "epoch": epoch,
            "batch": batch,
            "profile": in_force,
            "observed": profile.name,
            "reason": profile.reason,
            "slowest_ratio": profile.slowest_ratio,
            "rare_fraction": profile.rare_fraction,
            "spread": profile.spread,
            "steps": profile.steps,
            "early": found is not None,  # from the rounds' metadata after EARLY_STEPS steps
            "running": describe(self.policy),
            "mode": describe(wanted),
            "switched": switch,
            "wait_s": wait_s,  # this rank's wait for the others to reach the decision
        }
        self.decisions.append(decision)
        if not switch:
            return decision, None
        self.policy = wanted
        self.switches += 1
        return decision, wanted

    def epoch_logs(self):
        """``tfsync_auto_profile`` (an index into :data:`PROFILES`) and ``tfsync_auto_switches``."""
        if not self.decisions:
            return {}
        return {
            "tfsync_auto_profile": float(PROFILES.index(self.decisions[-1]["profile"])),
            "tfsync_auto_switches": float(self.switches),
        }
