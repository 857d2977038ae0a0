"""Auto mode's switching under ``SyncCallback`` (:class:`AutoSwitching`).

The decisions are :class:`tfsync.policies.auto.AutoController`'s (pure: the
workers' measured iteration times in, a mode out); this collaborator feeds it
each step's times, asks it at the points it names (mid-epoch after the first
window, then at epoch ends), and carries a switch out through the callback's
public seam, :meth:`SyncCallback.switch_mode <tfsync.keras.SyncCallback.switch_mode>`,
between two steps on every rank.  Each decision is logged on rank 0 (logger
``tfsync.auto``), written to ``trace_dir/auto.jsonl`` and kept in
:attr:`AutoSwitching.decisions`.
"""

import json
import logging
import os
import time

from tfsync.policies.auto import AutoController

log = logging.getLogger("tfsync.auto")


class AutoSwitching:
    """Auto mode (``mode=tfsync.Auto(...)`` or ``"auto"``) for one :class:`~tfsync.keras.SyncCallback`."""

    def __init__(self, auto, callback):
        self.auto, self.callback = auto, callback
        self.controller = None
        self.segment = 0  # the modes run in this fit so far, less one

    @property
    def modes(self):
        """Every mode this run may switch to, the initial one first."""
        return (self.auto.initial, *self.auto.modes.values())

    @property
    def decisions(self):
        return self.controller.decisions if self.controller is not None else []

    @property
    def deferred(self):
        return self.controller.deferred if self.controller is not None else []

    def trace_name(self, policy) -> str:
        """Where each mode's engine traces under ``trace_dir``: ``<segment>-<mode>``."""
        return f"{self.segment}-{policy.name}"

    def begin(self, steps_per_epoch: int, epochs: int):
        """A ``fit`` begins: the initial mode, a new controller."""
        frontend = self.callback.frontend
        self.segment = 0
        self.controller = AutoController(
            self.auto,
            frontend.cluster.size(),
            steps_per_epoch * epochs,
            gather=lambda window: frontend.allgather(
                window, "tfsync.auto.window", "every rank's iteration times, gathered for auto mode's decision"
            ),
        )
        return self.auto.initial

    def epoch_begin(self):
        self.controller.epoch_begin()

    def batch_end(self, epoch: int, batch: int, last: dict):
        """After a step (mid-epoch included: Keras looks its train function up at every step)."""
        due, found = self.controller.after_step(last)
        if due:
            self._decide(epoch, batch, found)

    def epoch_end(self, epoch: int, last_batch: int):
        """At an epoch's end, before its logs are built (a switch's drain applies rounds that
        this epoch's counts include)."""
        if self.controller.due_at_epoch_end():
            self._decide(epoch, last_batch)

    def epoch_logs(self) -> dict:
        return self.controller.epoch_logs()

    def _decide(self, epoch, batch, found=None):
        """The decision after this step (every rank after the same one), and its switch."""
        decision, wanted = self.controller.decide(epoch, batch, found)
        rank0 = self.callback.frontend.cluster.rank() == 0
        if decision is None:  # put off: a worker computed no step in the window
            if rank0:
                deferred = self.controller.deferred[-1]
                log.info(
                    "tfsync auto, epoch %d batch %d: no decision, ranks %s computed no step since the last",
                    epoch,
                    batch,
                    deferred["ranks_without_steps"],
                )
                self._trace({"event": "auto_deferred", **deferred})
            return
        if wanted is not None:
            t = time.monotonic()
            self.segment += 1
            decision["retraced"] = self.callback.switch_mode(wanted)
            decision["switch_s"] = time.monotonic() - t  # the retracing, if any, is in the next step
            self.controller.started(retraced=decision["retraced"])  # the new engine's first step retraces
        if rank0:
            log.info(
                "tfsync auto, epoch %d batch %d: %s (%s) -> %s",
                epoch,
                batch,
                decision["observed"],
                decision["reason"],
                decision["mode"],
            )
            self._trace({"event": "auto", **decision})

    def _trace(self, record):
        """One line of ``trace_dir/auto.jsonl`` (rank 0; nothing without ``trace_dir``)."""
        trace_dir = self.callback.frontend.settings.trace_dir
        if trace_dir:
            with open(os.path.join(trace_dir, "auto.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")


__all__ = ["AutoSwitching"]
