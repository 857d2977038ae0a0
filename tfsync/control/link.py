"""The reliable link, written once for both ends that re-attach: a worker's and a relay's.

A worker (:class:`~tfsync.control.client.ControlClient`, on threads) and a relay
(:class:`~tfsync.control.relay.HostRelay`, on an asyncio loop) each hold one link upward, to
rank 0's service or to a relay, and keep the same promises over it; what they keep to do so
is here, with no I/O, so the two ends run one implementation:

* :class:`SendWindow`: the messages sent on the current link and not yet acknowledged
  (upward every message is acknowledged by count); when the link breaks, what it holds goes
  again on the next link, and the receiving end takes a repeated item as once (every item is
  idempotent), so a flap loses nothing.  Clock reports are not kept: a later one supersedes them.
* :class:`ClosingLog`: the round closings taken from upstream, in order and each once (an end
  says, when it re-attaches, how many it has; what comes again is skipped).
* :class:`Reattach`: when the link breaks, where and until when to try again: within
  :data:`~tfsync.control.transport.RECONNECT_GRACE_S` of the end of a link that worked; with two
  addresses (a relay, then rank 0's service, its fallback) an attempt that did not get through
  moves to the other, and each attempt gets
  :data:`~tfsync.control.transport.ATTEMPT_S`, so a relay that died with its process does not
  keep its workers from rank 0 for the whole grace; an upstream that says it lost rank 0
  (``["host_lost"]``) sends the end to rank 0 itself, once.
* :func:`refused`: whether nothing listens at an address any more (a refused connection, not a
  link down): the service closed, and no re-attach there can get through.
"""

import collections
import socket
import time

from tfsync.control.transport import ATTEMPT_S, RECONNECT_BACKOFF_MS, RECONNECT_GRACE_S

PROBE_S = 0.5  # one look whether anything listens at an address (a TCP connect) gives up after this


def refused(address: str) -> bool:
    """Whether a TCP connect to ``address`` (``host:port``, ``[v6]:port``) is refused: nothing
    listens there.  A timeout or an unreachable network is not a refusal (a link down)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


class SendWindow:
    """What one end sent on its current link and upstream has not acknowledged yet.

    Args:
        unkept: the kinds of item not kept for resending (clock reports: a later one supersedes).

    ``carried``, given with a message, is what its acknowledgement releases in turn (a relay:
    its workers' messages, acknowledged to them once rank 0 acknowledged what carried them).
    Not thread-safe: the caller holds its own lock where two threads use it.
    """

    def __init__(self, unkept=()):
        self._unkept = frozenset(unkept)
        self.sent = 0  # messages sent on the current link
        self._unacked = collections.deque()  # (index, kept items, carried)

    def sent_message(self, items, carried=()) -> None:
        """One message of ``items`` went on the link."""
        self.sent += 1
        kept = [i for i in items if i[0] not in self._unkept]
        if kept or carried:  # (reports alone: not resent, not acknowledged, not in the window)
            self._unacked.append((self.sent, kept, list(carried)))

    def acked(self, count: int) -> list:
        """Upstream acknowledged the first ``count`` messages: what they carried, released."""
        released = []
        while self._unacked and self._unacked[0][0] <= count:
            released.extend(self._unacked.popleft()[2])
        return released

    def waiting(self) -> bool:
        """Whether a sent message is still unacknowledged."""
        return bool(self._unacked)

    def pending(self) -> list:
        """Every item sent and not acknowledged, in order."""
        return [item for _, items, _ in self._unacked for item in items]

    def restart(self) -> tuple:
        """A new link: ``(items, carried)`` the old one left unacknowledged, to send first; the
        window starts empty, counting the new link's messages from one."""
        items = self.pending()
        carried = [c for _, _, cs in self._unacked for c in cs]
        self._unacked.clear()
        self.sent = 0
        return items, carried


class ClosingLog:
    """The round closings taken from upstream, in order, each once."""

    def __init__(self):
        self.seen = 0

    def fresh(self, start: int, entries) -> list:
        """A ``["closed", start, entries]`` item's closings this end has not taken yet (a resend
        after a re-attach repeats some), counted as taken."""
        new = list(entries[max(self.seen - start, 0) :])
        self.seen += len(new)
        return new


class Reattach:
    """Where and until when an end whose link broke tries again (the module docstring).

    Args:
        addresses: where it attaches, then its fallback (rank 0's service), if any.
        retry_first: whether a first attach that fails is tried again within the grace (a
            relay's); False: it ends the link for good (a worker's first attach has a bound of
            its own, and a refused token must end it at once).

    After each link ends, :meth:`next` says where the next attempt goes and until when, or
    that there is none (:attr:`gave_up` says why: ``"first"``, ``"gone"`` or ``"grace"``).
    """

    def __init__(self, addresses, retry_first=False):
        self.addresses = list(addresses)
        self._retry_first = retry_first
        self.deadline = None  # the grace's end, from the end of the last link that worked
        self._upstream_gone = False
        self.gave_up = None

    @property
    def address(self) -> str:
        return self.addresses[0]

    def upstream_gave_up(self) -> None:
        """Its upstream (a relay) could not re-attach to rank 0 within the grace: the next
        attempt goes to rank 0 itself, once."""
        self._upstream_gone = True

    def next(self, attached: bool, gone=None):
        """The link ended (``attached``: it had got through).  ``(address, attempt_end, pause_s)``
        of the next attempt (wait ``pause_s`` first; give it up at ``attempt_end``), or None.

        ``gone(addresses)``: whether nothing listens at any of them any more (:func:`refused`):
        then no re-attach can get through, and it gives up at once, not after the grace."""
        now = time.monotonic()
        pause = 0.0
        if attached or (self.deadline is None and self._retry_first):
            self.deadline = now + RECONNECT_GRACE_S  # (the grace runs from the end of a link that worked)
        elif self.deadline is None:  # its first attach failed: nothing to come back to
            return self._give_up("first")
        elif gone is not None and gone(self.addresses):
            return self._give_up("gone")
        else:  # an attempt that did not get through: not at once again
            pause = RECONNECT_BACKOFF_MS[0] / 1e3
        if self._upstream_gone:  # its relay gave up on rank 0: one try at rank 0 itself
            self._upstream_gone = False
            if len(self.addresses) > 1:
                self.addresses = self.addresses[1:]
            self.deadline = min(self.deadline, now + ATTEMPT_S)
        elif len(self.addresses) > 1 and not attached:
            self.addresses.append(self.addresses.pop(0))
        if now >= self.deadline:
            return self._give_up("grace")
        end = min(self.deadline, now + ATTEMPT_S) if len(self.addresses) > 1 else self.deadline
        return self.addresses[0], end, pause

    def _give_up(self, why):
        self.gave_up = why
        return None


__all__ = ["ClosingLog", "Reattach", "SendWindow", "refused"]
