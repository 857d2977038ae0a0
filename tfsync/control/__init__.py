"""The control plane: which workers are alive and where their clocks are, served by rank 0.

A package beside the engine, not inside it: it imports nothing of :mod:`tfsync.engine` (nor
TensorFlow, nor Horovod), so a process that only speaks the control path (a simulated worker
of ``python -m tfsync.bench control``) loads gRPC alone.

Rank 0 runs one gRPC service (:class:`ControlServer`, asyncio: one event loop,
no thread per worker); every worker holds a :class:`ControlClient`, one
long-lived link to it, or to its host's relay (:class:`HostRelay`), which
carries the host's workers to rank 0 on one link (in a job of more than 8
relaying hosts, through a group relay that carries 8 hosts' relays on one).  It names lost and lagging
ranks for every mode, and for some it is on the step path: PSP and backup
workers send one ready notice per step and get the coordinator's round
closings on their link; DSSP's workers tell the coordinator of each push and
ask it for grants.  One module per concern:

* :mod:`~tfsync.control.transport`: gRPC with keepalive, the wire (batches of items), the job's token;
* :mod:`~tfsync.control.link`: the reliable link, written once for the worker's end and a relay's
  (what goes again after a re-attach, the closings in order, where and until when to re-attach);
* :mod:`~tfsync.control.streams`: rank 0's links, the broadcast, losses, re-attach;
* :mod:`~tfsync.control.relay`: a host's relay, and a group of hosts' relay
  (:mod:`~tfsync.control.outgoing`: what it sends rank 0 next, batched);
* :mod:`~tfsync.control.topology`: which ranks run a relay, from the ranks' hosts;
* :mod:`~tfsync.control.address`: the address rank 0's service (and a group relay) listens on;
* :mod:`~tfsync.control.stop`: the stop handshake;
* :mod:`~tfsync.control.coordinator`: the rounds rank 0 closes;
* :mod:`~tfsync.control.services`: the clock table, the policy's service;
* :mod:`~tfsync.control.server` and :mod:`~tfsync.control.client` (:mod:`~tfsync.control.client_link`:
  one attempt at its link): the two ends.
"""

from tfsync.control.client import (
    ASK_TIMEOUT_S,
    CALL_TIMEOUT_S,
    CONNECT_TIMEOUT_S,
    LATE_TIMEOUT_S,
    READY_TIMEOUT_S,
    REPORT_INTERVAL_S,
    ControlClient,
)
from tfsync.control.relay import HostRelay
from tfsync.control.server import ControlServer
from tfsync.control.stop import STOP_CALL_TIMEOUT_S, STOP_NOTICE_GRACE_S
from tfsync.control.transport import (
    CONNECT_ATTEMPT_MS,
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    RECONNECT_BACKOFF_MS,
    RECONNECT_GRACE_S,
)

__all__ = [
    "ASK_TIMEOUT_S",
    "CALL_TIMEOUT_S",
    "CONNECT_ATTEMPT_MS",
    "CONNECT_TIMEOUT_S",
    "KEEPALIVE_TIMEOUT_MS",
    "KEEPALIVE_TIME_MS",
    "LATE_TIMEOUT_S",
    "READY_TIMEOUT_S",
    "RECONNECT_BACKOFF_MS",
    "RECONNECT_GRACE_S",
    "REPORT_INTERVAL_S",
    "STOP_CALL_TIMEOUT_S",
    "STOP_NOTICE_GRACE_S",
    "ControlClient",
    "ControlServer",
    "HostRelay",
]
