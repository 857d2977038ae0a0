"""An engine's settings, declared once and checked once, when a frontend is built (:class:`EngineSettings`).

The frontends (``SyncCallback``, ``SyncStrategy``) take them as keyword arguments and pass
them here as they came (:meth:`EngineSettings.of`): their names, defaults and checks are
written only in this class."""

import dataclasses
import os

from tfsync import _env
from tfsync.engine.nonfinite import check_option
from tfsync.stragglers import Stragglers


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """What every engine of a frontend runs with, checked when it is built (before any training)
    and with its defaults filled in from the environment.

    Args:
        stragglers: a :class:`tfsync.Stragglers`; default: from ``TFSYNC_STRAGGLERS`` (off when unset).
        trace_dir: directory for the JSON-lines trace, one ``rank<R>.jsonl`` per worker;
            ``None`` (default) writes no trace.
        wait_timeout_s: bound on any single wait for peers (default 120 s, or
            ``TFSYNC_WAIT_TIMEOUT_S``); past it the engine raises
            :class:`~tfsync.engine.SyncTimeoutError` naming the ranks that are behind.
        on_nonfinite: ``"reject"`` (default: a contribution with a NaN or an infinity is left
            out of its round and counted as ``rejected``) or ``"raise"`` (the job stops with
            :class:`~tfsync.engine.NonFiniteError` naming the rank and step).
        elastic: the job runs under ``tfsync.elastic.run`` (default False): a failed collective
            raises at once, without waiting for rank 0's loss notices or announcing a stop,
            since every survivor resets on its own failure.
    """

    stragglers: Stragglers = None
    trace_dir: str = None
    wait_timeout_s: float = None
    on_nonfinite: str = "reject"
    elastic: bool = False

    def __post_init__(self):
        stragglers = self.stragglers if self.stragglers is not None else Stragglers.from_env()
        if not isinstance(stragglers, Stragglers):
            raise TypeError(
                f"tfsync: stragglers must be a tfsync.Stragglers or None, got {type(stragglers).__name__}; "
                f"pass e.g. tfsync.Stragglers.parse('base=0.02,slow=1:0.04'), or None for none"
            )
        if self.trace_dir is not None and not isinstance(self.trace_dir, str | os.PathLike):
            raise TypeError(
                f"tfsync: trace_dir must be a directory path (str or os.PathLike) or None, got "
                f"{type(self.trace_dir).__name__}; pass e.g. trace_dir='traces/run1', or None for no trace"
            )
        object.__setattr__(self, "stragglers", stragglers)
        object.__setattr__(self, "wait_timeout_s", _env.wait_timeout_s(self.wait_timeout_s))
        object.__setattr__(self, "on_nonfinite", check_option(self.on_nonfinite))
        object.__setattr__(self, "elastic", bool(self.elastic))

    @classmethod
    def of(cls, who: str, settings: dict, **own) -> "EngineSettings":
        """The settings a frontend's caller passed as keyword arguments (``settings``), checked:
        a keyword that is not one of :data:`FRONTEND_SETTINGS` is refused, naming them (``who``:
        the frontend, for the message); ``own``: what the frontend sets itself (``elastic``)."""
        unknown = sorted(set(settings) - set(FRONTEND_SETTINGS))
        if unknown:
            raise TypeError(
                f"{who}: unexpected keyword argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"the engine's settings it takes are {', '.join(FRONTEND_SETTINGS)} (tfsync.engine.EngineSettings)"
            )
        return cls(**settings, **own)

    def with_trace_dir(self, trace_dir):
        """These settings, tracing to ``trace_dir``."""
        return dataclasses.replace(self, trace_dir=trace_dir)


# the settings a frontend's caller passes by keyword (``elastic`` is the frontend's own)
FRONTEND_SETTINGS = ("stragglers", "trace_dir", "wait_timeout_s", "on_nonfinite")

__all__ = ["FRONTEND_SETTINGS", "EngineSettings"]
