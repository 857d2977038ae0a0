"""What a relay sends rank 0 next (:class:`Outgoing`), batched as the relay's docstring says.

Its workers' items wait here with the worker messages they carry (acknowledged to those
workers once rank 0 acknowledged what carried them), one message in flight at a time: what is
queued meanwhile goes as the next message.  Ready notices are held until every worker of the
host has sent its own, or for at most :data:`READY_HOLD_S`; clocks go together, the newest of
each rank, with the next message or on their own at most every :data:`REPORT_FLUSH_S`.
Everything runs on the relay's event loop.
"""

import time

REPORT_FLUSH_S = 0.25  # a host's clocks go to rank 0 on their own at most this often
READY_HOLD_S = 0.002  # a ready notice waits at most this for the host's other workers' notices


class Outgoing:
    """The relay's queue for rank 0.

    Args:
        loop: the relay's event loop (a held notice's timer).
        wake: an ``asyncio.Event`` set whenever there is something to send.
        expected: a function returning the ranks whose ready notice a held batch waits for
            (the host's workers attached and not left).
    """

    def __init__(self, loop, wake, expected):
        self._loop, self.wake, self._expected = loop, wake, expected
        self.pending = []  # (items, [(local link id, its message index)]) not yet sent
        self._held = []  # the same, of ready notices held for the host's others
        self._held_ranks = set()  # the ranks whose notice is held
        self._hold_timer = None
        self.clocks = {}  # rank -> newest clock not yet sent
        self._flushed = float("-inf")  # when clocks last went

    def forward(self, items, carried=()):
        """Queue ``items`` (``carried``: the worker messages they came in); what is held goes with them."""
        if not items:
            return
        self.release()
        self.pending.append((items, list(carried)))
        self.wake.set()

    def first(self, items, carried):
        """Queue ``items`` ahead of everything (a new link's attach and what the last one left)."""
        self.pending.insert(0, (items, list(carried)))
        self.wake.set()

    def hold(self, items, carried):
        """Hold ready notices until every expected worker has sent one, or ``READY_HOLD_S``."""
        self._held.append((items, list(carried)))
        self._held_ranks.update(int(item[1]) for item in items)
        if self._held_ranks >= self._expected():
            self.release()
        elif self._hold_timer is None:
            self._hold_timer = self._loop.call_later(READY_HOLD_S, self.release)

    def release(self):
        """Queue the held ready notices."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        if self._held:
            self.pending.extend(self._held)
            self._held, self._held_ranks = [], set()
            self.wake.set()

    def clock(self, rank: int, clock: int):
        """A worker's clock: it goes with the next message, or at once when none went for
        ``REPORT_FLUSH_S`` (a lone report goes at once)."""
        self.clocks[rank] = max(self.clocks.get(rank, -1), clock)

    def clocks_came(self):
        """Clocks just came (:meth:`clock`): at once if none went for ``REPORT_FLUSH_S``."""
        if time.monotonic() - self._flushed >= REPORT_FLUSH_S:
            self.send_clocks()

    def flush_due(self):
        """Clocks that no message took along go on their own, ``REPORT_FLUSH_S`` after the last went."""
        if self.clocks and time.monotonic() - self._flushed >= REPORT_FLUSH_S:
            self.send_clocks()

    def send_clocks(self):
        """Every clock not sent yet, in one item."""
        self.pending.append((self._take_clocks(), []))
        self.wake.set()

    def _take_clocks(self):
        clocks, self.clocks = self.clocks, {}
        self._flushed = time.monotonic()
        return [["reports", {str(r): c for r, c in clocks.items()}]]

    def take(self):
        """Everything queued, as one message: ``(items, carried)`` (the clocks ride along)."""
        pending, self.pending = self.pending, []
        if self.clocks:
            pending.append((self._take_clocks(), []))
        items = [item for batch, _ in pending for item in batch]
        carried = [c for _, cs in pending for c in cs]
        return items, carried


__all__ = ["READY_HOLD_S", "REPORT_FLUSH_S", "Outgoing"]
