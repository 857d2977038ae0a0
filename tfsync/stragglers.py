"""Built-in straggler injection: simulated device time, slow ranks, rare delays, jitter,
slow pulls.

Off by default.  A delay is a ``time.sleep`` (it frees the CPU, as a slow GPU
would), drawn from a generator seeded with ``(seed, rank)`` so the same spec
gives the same delays in every launch.  Rare delays follow the PSP paper's
simulation (Section 4: 0.16% of responses delayed by 4 s).  Slow pulls are the
same paper's delays on the receive side: a block of a round's result reaches
one worker's training thread late (see :class:`tfsync.PSP`'s partial pulling);
they are drawn from a stream of their own, so adding them leaves the step
delays of a spec unchanged.

Set it from code (``tfsync.Stragglers(...)``), from a spec string on the
command line (``--stragglers "base=0.02,slow=3:0.04"``) or from the environment
(``TFSYNC_STRAGGLERS``, same syntax).
"""

import dataclasses
import math
import numbers
import time

import numpy as np

from tfsync import _env

ENV_VAR = _env.STRAGGLERS.name
_SPEC_HELP = (
    "comma-separated key=value items: base=SECONDS (simulated device time of every step), "
    "slow=RANK:SECONDS (extra time per step on RANK; repeatable), "
    "rare=PROBABILITY:SECONDS (a rare long delay), jitter=SECONDS (uniform extra 0..SECONDS), "
    "pull=PROBABILITY:SECONDS (a block of a round's result reaches the worker that late), "
    "seed=INT; e.g. 'base=0.02,slow=3:0.04,rare=0.0016:4,seed=1'"
)


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """Per-step simulated delays for one job.

    Args:
        base_s: simulated device time every worker spends per step (default 0).
        slow_ranks: ``{rank: extra_seconds}`` added to every step of those ranks.
        rare_prob: probability that a step gets a rare delay (default 0).
        rare_s: length of a rare delay in seconds.
        jitter_s: each step gets an extra ``uniform(0, jitter_s)`` seconds.
        pull_prob: probability that one block of one round's result reaches a
            worker late (a receive-side delay; drawn per worker, round and block).
        pull_s: how late, in seconds.
        seed: makes the delays identical across launches (default 0).

    Example:

        tfsync.Stragglers(base_s=0.02, slow_ranks={3: 0.04})
        tfsync.Stragglers.parse("base=0.02,slow=3:0.04,rare=0.0016:4")
    """

    base_s: float = 0.0
    slow_ranks: tuple = ()
    rare_prob: float = 0.0
    rare_s: float = 0.0
    jitter_s: float = 0.0
    pull_prob: float = 0.0
    pull_s: float = 0.0
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "slow_ranks", _check_slow_ranks(self.slow_ranks))
        for name in ("base_s", "rare_s", "jitter_s", "pull_s"):
            _check_seconds(name, getattr(self, name))
        for rank, extra in self.slow_ranks:
            _check_seconds(f"slow_ranks[{rank}]", extra)
        object.__setattr__(self, "slow_ranks", tuple((rank, float(extra)) for rank, extra in self.slow_ranks))
        for name in ("rare_prob", "pull_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"Stragglers: {name}={value!r} must be a probability, a number in [0, 1]; "
                    f"e.g. tfsync.Stragglers(rare_prob=0.0016, rare_s=4.0) (0: never)"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise ValueError(
                f"Stragglers: seed={self.seed!r} must be an integer >= 0 (it seeds every rank's delays); "
                f"e.g. tfsync.Stragglers(base_s=0.02, seed=1)"
            )
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def enabled(self) -> bool:
        return bool(
            self.base_s
            or self.slow_ranks
            or (self.rare_prob and self.rare_s)
            or self.jitter_s
            or (self.pull_prob and self.pull_s)
        )

    @classmethod
    def parse(cls, spec: str) -> "Stragglers":
        """Parse a spec string (see the module docstring); '' or 'none' means off."""
        spec = (spec or "").strip()
        if spec.lower() in ("", "none", "off"):
            return cls()
        kwargs, slow, seen = {}, {}, set()
        for item in spec.split(","):
            key, sep, value = item.strip().partition("=")
            try:
                if not sep:
                    raise ValueError("missing '='")
                if key in seen and key != "slow":
                    raise ValueError(f"{key!r} given twice; give each key once (slow= once per rank)")
                seen.add(key)
                if key == "base":
                    kwargs["base_s"] = float(value)
                elif key == "slow":
                    rank, extra = _pair(value, "RANK:SECONDS")
                    if int(rank) in slow:
                        raise ValueError(f"rank {int(rank)} given twice; give each slow rank once")
                    slow[int(rank)] = float(extra)
                elif key == "rare":
                    prob, seconds = _pair(value, "PROBABILITY:SECONDS")
                    kwargs["rare_prob"], kwargs["rare_s"] = float(prob), float(seconds)
                elif key == "pull":
                    prob, seconds = _pair(value, "PROBABILITY:SECONDS")
                    kwargs["pull_prob"], kwargs["pull_s"] = float(prob), float(seconds)
                elif key == "jitter":
                    kwargs["jitter_s"] = float(value)
                elif key == "seed":
                    kwargs["seed"] = int(value)
                else:
                    raise ValueError(f"unknown key {key!r}")
            except ValueError as exc:
                raise ValueError(
                    f"bad straggler spec item {item.strip()!r} in {spec!r} ({exc}); " f"expected {_SPEC_HELP}"
                ) from None
        try:
            return cls(slow_ranks=slow, **kwargs)
        except ValueError as exc:
            raise ValueError(f"bad straggler spec {spec!r}: {exc}") from None

    @classmethod
    def from_env(cls) -> "Stragglers":
        """The spec in ``TFSYNC_STRAGGLERS`` (unset or empty: none); a bad one names the variable."""
        try:
            return cls.parse(_env.STRAGGLERS.get())
        except ValueError as exc:
            raise ValueError(f"{ENV_VAR}: {exc}; or unset {ENV_VAR}") from None

    def spec(self) -> str:
        """Inverse of :meth:`parse`, for passing the config to launched workers."""
        items = [f"base={self.base_s}"] if self.base_s else []
        items += [f"slow={r}:{s}" for r, s in self.slow_ranks]
        if self.rare_prob:
            items.append(f"rare={self.rare_prob}:{self.rare_s}")
        if self.jitter_s:
            items.append(f"jitter={self.jitter_s}")
        if self.pull_prob:
            items.append(f"pull={self.pull_prob}:{self.pull_s}")
        items.append(f"seed={self.seed}")
        return ",".join(items) if self.enabled else "none"

    def validate(self, size: int) -> None:
        """Refuse slow ranks the job does not have (checked when an engine starts, when the
        number of workers is known): a delay meant for a rank that does not exist would
        silently simulate nothing."""
        missing = [r for r, _ in self.slow_ranks if r >= size]
        if missing:
            raise ValueError(
                f"Stragglers: slow ranks {missing} in {self.spec()!r}, but this job has {size} workers "
                f"(ranks 0..{size - 1}); name ranks below {size}, or launch more workers"
            )

    def for_rank(self, rank: int) -> "RankDelays":
        return RankDelays(self, rank)


class RankDelays:
    """The delay sequence of one rank: ``next_delay_s()`` per step, in step order."""

    def __init__(self, config: Stragglers, rank: int):
        self.config = config
        self.rank = rank
        self._fixed_s = config.base_s + dict(config.slow_ranks).get(rank, 0.0)
        self._rng = np.random.default_rng([config.seed, rank])
        self._pull_rng = np.random.default_rng([config.seed, rank, 1])  # its own stream

    @property
    def idle(self) -> bool:
        """Whether this rank's steps never sleep (no delay of any kind is configured for it)."""
        return not (self._fixed_s or self.config.jitter_s or self.config.rare_prob)

    def next_delay_s(self) -> float:
        delay = self._fixed_s
        cfg = self.config
        if cfg.jitter_s:
            delay += cfg.jitter_s * self._rng.random()
        if cfg.rare_prob and self._rng.random() < cfg.rare_prob:
            delay += cfg.rare_s
        return delay

    def next_delays_s(self, count: int) -> np.ndarray:
        """The next ``count`` delays at once: the values ``count`` calls of
        :meth:`next_delay_s` would return (same draws, same order)."""
        cfg = self.config
        draws_per_step = bool(cfg.jitter_s) + bool(cfg.rare_prob)
        draws = self._rng.random(count * draws_per_step).reshape(count, draws_per_step)
        delays = np.full(count, self._fixed_s)
        if cfg.jitter_s:
            delays += cfg.jitter_s * draws[:, 0]
        if cfg.rare_prob:
            delays += np.where(draws[:, -1] < cfg.rare_prob, cfg.rare_s, 0.0)
        return delays

    def pull_delays_s(self, blocks: int) -> np.ndarray:
        """How late each of a round's ``blocks`` reaches this worker (seconds, mostly 0);
        call once per round, in round order."""
        cfg = self.config
        if not (cfg.pull_prob and cfg.pull_s):
            return np.zeros(blocks)
        return np.where(self._pull_rng.random(blocks) < cfg.pull_prob, cfg.pull_s, 0.0)

    def sleep_for_round(self, blocks: int) -> None:
        """A worker without partial pulling waits for a round's last block: sleep for the
        slowest of its ``blocks`` (nothing, and no draw, when slow pulls are off)."""
        delay = float(np.max(self.pull_delays_s(blocks)))
        if delay > 0:
            time.sleep(delay)

    def sleep(self) -> float:
        """Sleep for the next step's delay; returns the seconds slept."""
        delay = self.next_delay_s()
        if delay > 0:
            time.sleep(delay)
        return delay


def _pair(value, form):
    """``"A:B"`` -> ``("A", "B")``; anything else is refused naming the ``form`` expected."""
    parts = value.split(":")
    if len(parts) != 2:
        raise ValueError(f"{value!r} is not {form}")
    return parts


def _check_slow_ranks(slow_ranks):
    """``{rank: seconds}`` or ``(rank, seconds)`` pairs -> sorted pairs; ranks are integers >= 0."""
    hint = "e.g. tfsync.Stragglers(slow_ranks={3: 0.04}): rank 3 is 40 ms slower on every step"
    try:
        pairs = list(slow_ranks.items() if isinstance(slow_ranks, dict) else slow_ranks)
        pairs = [(rank, extra) for rank, extra in pairs]
    except (TypeError, ValueError):
        raise ValueError(
            f"Stragglers: slow_ranks={slow_ranks!r} must map ranks to extra seconds per step; {hint}"
        ) from None
    for rank, _ in pairs:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
            problem = "is negative" if isinstance(rank, numbers.Real) and rank < 0 else "is not an integer"
            raise ValueError(
                f"Stragglers: slow rank {rank!r} {problem}; it must be an integer >= 0 (ranks start at 0); {hint}"
            )
    ranks = [int(rank) for rank, _ in pairs]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"Stragglers: slow_ranks={slow_ranks!r} names a rank twice; give each rank once; {hint}")
    return tuple(sorted((int(rank), extra) for rank, extra in pairs))


def _check_seconds(name, value):
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
        raise ValueError(
            f"Stragglers: {name}={value!r} must be a finite number of seconds >= 0; "
            f"e.g. tfsync.Stragglers(base_s=0.02) or the spec 'base=0.02' (0: no delay)"
        )
