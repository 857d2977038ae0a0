"""What happened to this worker's contributions and steps, counted once; and its trace.

Every contribution a worker produces ends ``applied``, ``compensated``,
``dropped`` or ``rejected`` (it had a NaN or an infinity and went into no
round: :mod:`tfsync.engine.nonfinite`) or, when an elastic job resets
(:mod:`tfsync.elastic`), ``lost``: in flight in a round the failure ended; a step
that computed nothing is ``skipped``.  Events are noted as they happen (:meth:`Tally.add`; drops are
recorded by the exchange) and settled into the run's counts and the epoch's
totals at the end of each step (:meth:`Tally.settle`), so a step's trace
record says what that step settled.
"""

import json
import os

import numpy as np

BYTES = ("bytes_sent", "bytes_received", "uncompressed_bytes_sent", "uncompressed_bytes_received")
SETTLED = ("applied", "compensated", "dropped", "rejected", "lost")  # what becomes of a contribution
COUNTS = ("produced", "applied", "compensated", "dropped", "rejected", "lost", "skipped")


class Tally:
    """One worker's counters: ``counts`` for the whole run, ``totals`` per epoch (with times)."""

    def __init__(self):
        self.counts = dict.fromkeys(COUNTS, 0)
        self._pending = dict.fromkeys(COUNTS, 0)
        self.reset_totals()

    def reset_totals(self):
        """Zero the epoch's totals; ``counts`` keeps the whole run's."""
        self.totals = {
            "steps": 0,
            "compute_s": 0.0,
            "wait_s": 0.0,
            **dict.fromkeys(COUNTS, 0),
            **dict.fromkeys(BYTES, 0.0),
        }

    def add_bytes(self, sent: dict) -> dict:
        """Add the rounds' bytes on the wire (:class:`tfsync.engine.wire.counting.WireBytes`) to the
        epoch's totals; returns ``sent``."""
        for key in BYTES:
            self.totals[key] += sent[key]
        return sent

    def add(self, key: str, n: int = 1):
        """Note ``n`` contributions (or skipped steps) under ``key``, until :meth:`settle`."""
        self._pending[key] += n

    def pending(self, key: str) -> int:
        return self._pending[key]

    def count_round(self, res, rank: int, components) -> None:
        """Note what round ``res`` did with this worker's contributions: its fresh one applied
        (or ``compensated``, as a component says: DC-S3GD's corrected gradients), its late one
        compensated.  A rejected one is not in the round: it was counted when it was rejected."""
        if res.present[rank] == 1.0:
            self.add(next((k for k in (c.own_count(res) for c in components) if k), "applied"))
        if res.late[rank] == 1.0:
            self.add("compensated")

    def settle_step(self, exchange):
        """:meth:`settle`, and how many contributions were compensated since the last: ``(drops, compensated)``."""
        compensated = self._pending["compensated"]
        return self.settle(exchange), compensated

    def settle(self, exchange) -> list:
        """Move what was noted, and the drops the exchange recorded, into the counts and
        totals; the drops as ``[[stamp, round]]``."""
        drops = [[int(s), int(r)] for s, r in exchange.take_drops()]
        self._pending["dropped"] += len(drops)
        for key, n in self._pending.items():
            self.totals[key] += n
            self.counts[key] += n
        self._pending = dict.fromkeys(COUNTS, 0)
        return drops

    def unsettled(self) -> int:
        """Contributions produced and not yet applied, compensated, dropped, rejected or lost."""
        c = self.counts
        return c["produced"] - sum(c[k] for k in SETTLED)

    def lose_unsettled(self) -> int:
        """Count every unsettled contribution as ``lost`` (a failure ended its round); returns how
        many.  Call after :meth:`settle`."""
        lost = self.unsettled()
        self.counts["lost"] += lost
        self.totals["lost"] += lost
        return lost

    def check(self, rank: int):
        """Every contribution produced is applied, compensated, dropped, rejected or lost (after the last drain)."""
        c = self.counts
        if self.unsettled() != 0:
            raise RuntimeError(
                f"tfsync: rank {rank} lost track of contributions: produced {c['produced']}, "
                + ", ".join(f"{k} {c[k]}" for k in SETTLED)
                + " after every round was drained"
            )


def round_stamps(res) -> list:
    """The steps the contributions round ``res`` applied were computed for: its fresh ones',
    then its late ones' (for the trace)."""
    stamps = [int(res.steps[k]) for k in np.flatnonzero(res.present)]
    return stamps + [int(res.late_steps[k]) for k in np.flatnonzero(res.late)]


def settled_fields(applied, step: int, applied_through: int, drops: list, compensated: int) -> dict:
    """What a trace record says of a settlement (:meth:`Tally.settle`): the rounds ``step``
    applied (``applied``: ``(round, contributors, stamps)``) and this worker's contributions
    compensated and dropped since the last record."""
    return {
        "applied": [[r, step - r, n] for r, n, _ in applied],
        "stamps": [[r, s] for r, _, s in applied],
        "applied_through": applied_through,
        "dropped": len(drops),
        "drops": drops,
        "compensated": compensated,
    }


class Trace:
    """One worker's JSON-lines trace, ``<trace_dir>/rank<R>.jsonl`` (nothing without a directory)."""

    def __init__(self, trace_dir, rank):
        self._file = None
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            self._file = open(os.path.join(trace_dir, f"rank{rank}.jsonl"), "w")

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
