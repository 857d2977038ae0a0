"""One attempt at a worker's link, on gRPC's threads (:class:`LinkCall`).

:class:`~tfsync.control.client.ControlClient` opens one per attach and re-attach: a
bidirectional call whose outgoing messages gRPC takes from a queue (everything queued when it
asks goes as one message), with the messages sent and not yet acknowledged kept in a
:class:`~tfsync.control.link.SendWindow` for the next attempt to send again.
"""

import queue
import threading

from tfsync.control import link as reliable
from tfsync.control.transport import LINK_METHOD, encode


class LinkCall:
    """One attempt at a link: its call, the queue its messages are taken from, what it sent
    (:class:`~tfsync.control.link.SendWindow`)."""

    def __init__(self, channel, metadata):
        self.attached = False  # rank 0 (or the relay) answered its attach
        self.queue = queue.Queue()
        self.window = reliable.SendWindow(unkept=("report",))
        self.lock = threading.Lock()
        self.call = channel.stream_stream(LINK_METHOD)(self._messages(), metadata=metadata, wait_for_ready=True)

    def _messages(self):
        """What gRPC sends: everything queued when it asks, as one message (reports are not
        kept for resending: a later one supersedes them)."""
        while True:
            first = self.queue.get()
            if first is None:
                return
            items, end = list(first), False
            while True:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    end = True
                    break
                items.extend(more)
            with self.lock:
                self.window.sent_message(items)
            yield encode(items)
            if end:
                return

    def acked(self, count):
        with self.lock:
            self.window.acked(count)

    def pending(self):
        with self.lock:
            return self.window.pending()


__all__ = ["LinkCall"]
