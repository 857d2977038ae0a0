"""Each rank lists its TCP connections with the retransmission-timeout cap Linux keeps for each
(``TCP_RTO_MAX_MS``), after the job's Gloo contexts formed and an allreduce went through; the
test keeps the connections between the two ranks (Horovod's Gloo pairs: nothing else connects
the two worker processes) and checks their cap (``third_party/horovod``, hunk 14)."""

import os
import socket
import sys

from common import init, write_result

hvd = init()
import tensorflow as tf  # noqa: E402

from tfsync import _horovod  # noqa: E402

assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == 2.0  # the job formed
connections = []
for name in os.listdir("/proc/self/fd"):
    try:
        if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
            continue
        sock = socket.socket(fileno=os.dup(int(name)))
    except OSError:  # (closed meanwhile)
        continue
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            peer = sock.getpeername()
            rto_max_ms = sock.getsockopt(socket.IPPROTO_TCP, _horovod.TCP_RTO_MAX_MS)
            connections.append(
                {"local": list(sock.getsockname()[:2]), "peer": list(peer[:2]), "rto_max_ms": rto_max_ms}
            )
    except OSError:  # (a listening socket has no peer)
        pass
    finally:
        sock.close()
write_result(sys.argv[1], hvd.rank(), {"connections": connections, "setting_ms": _horovod.gloo_rto_max_ms()})
