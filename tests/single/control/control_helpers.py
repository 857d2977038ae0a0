"""What the control tests share: a TCP proxy that can flap a link, a client's closings, a
bounded wait."""

import socket
import threading
import time

POLL_S = 0.05  # the proxy's socket timeout: how soon its threads see a cut or a shutdown
HOLD_MAX_S = 30.0  # the longest the proxy holds a stalled connection
JOIN_S = 2.0


class TcpProxy:
    """A TCP proxy that can drop (reset every connection, refuse new ones) or stall
    (forward nothing, hold new connections) the link, and restore it."""

    def __init__(self, upstream_port, source_ip="127.0.0.2"):
        self._upstream, self._source = ("127.0.0.1", upstream_port), (source_ip, 0)
        self._cond = threading.Condition()
        self._state = "up"  # or "dropped", "stalled"
        self._shut = False
        self._sockets, self._threads = set(), []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(POLL_S)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._spawn(self._accept)

    def cut(self, how):
        with self._cond:
            self._state = {"drop": "dropped", "stall": "stalled"}[how]
            doomed = list(self._sockets) if how == "drop" else []
            self._cond.notify_all()
        for sock in doomed:
            self._reset(sock)

    def restore(self):
        with self._cond:
            self._state = "up"
            self._cond.notify_all()

    def shutdown(self):
        with self._cond:
            self._shut = True
            doomed = list(self._sockets)
            self._cond.notify_all()
        self._listener.close()
        for sock in doomed:
            self._reset(sock)
        for thread in self._threads:
            thread.join(JOIN_S)

    def _spawn(self, target, *args):
        thread = threading.Thread(target=target, args=args, daemon=True, name="test-link")
        self._threads.append(thread)
        thread.start()

    def _open(self):
        """Wait while the link stalls (bounded); whether traffic may pass (not dropped or shut)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state != "stalled" or self._shut, HOLD_MAX_S)
            return self._state == "up" and not self._shut

    def _track(self, sock):
        with self._cond:
            self._sockets.add(sock)

    def _reset(self, sock):
        with self._cond:
            self._sockets.discard(sock)
        try:  # an abortive close (RST), as a middlebox or a peer's kernel sends it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        sock.close()

    def _accept(self):
        while not self._shut:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._spawn(self._connect, conn)

    def _connect(self, conn):
        self._track(conn)
        if not self._open():  # a dropped link refuses new connections
            self._reset(conn)
            return
        try:
            upstream = socket.create_connection(self._upstream, timeout=JOIN_S, source_address=self._source)
        except OSError:
            self._reset(conn)
            return
        self._track(upstream)
        self._spawn(self._pump, conn, upstream)
        self._spawn(self._pump, upstream, conn)

    def _pump(self, src, dst):
        try:
            src.settimeout(POLL_S)  # (the other direction's pump may have closed it already)
            while not self._shut:
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data or not self._open():  # (a stall holds what was read)
                    break
                dst.sendall(data)
        except OSError:
            pass
        self._reset(src)
        self._reset(dst)


class Closes:
    """One client's ``on_close`` notices, in the order its link delivered them: ``(round,
    accepted)``, and the late ranks when any."""

    def __init__(self):
        self.seen, self._cond = [], threading.Condition()

    def __call__(self, round_, accepted, late=()):
        with self._cond:
            self.seen.append((round_, accepted) + ((late,) if late else ()))
            self._cond.notify_all()

    def wait_for(self, n, timeout_s=10.0):
        with self._cond:
            self._cond.wait_for(lambda: len(self.seen) >= n, timeout_s)
            return list(self.seen)


def wait_until(predicate, timeout_s):
    """Whether ``predicate()`` came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def rounds(clients, rounds_):
    """Every client sends its ready notice for each of ``rounds_`` and has its answer (bounded)."""
    for round_ in rounds_:
        for client in clients:
            client.ready(round_)
        for client in clients:
            client._ready_calls[-1].result(timeout=5)


def vanish(client):
    """The client's process ends without a word: its link closes, no leave."""
    client._closing = True
    client._stream.cancel()
