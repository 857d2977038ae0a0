"""The control path: which workers are alive and where their clocks are, served by rank 0.

Rank 0 runs one gRPC service (:class:`ControlServer`, asyncio: one event loop,
no thread per worker); every worker holds a :class:`ControlClient`, one
long-lived link to it, or to its host's relay (:class:`HostRelay`), which
carries the host's workers to rank 0 on one link (in a job of more than 8
relaying hosts, through a group relay that carries 8 hosts' relays on one).  It names lost and lagging
ranks for every mode, and for some it is on the step path: PSP and backup
workers send one ready notice per step and get the coordinator's round
closings on their link; DSSP's workers tell the coordinator of each push and
ask it for grants.  One module per concern:

* :mod:`~tfsync.engine.control.transport`: gRPC with keepalive, the wire (batches of items), the job's token;
* :mod:`~tfsync.engine.control.streams`: rank 0's links, the broadcast, losses, re-attach;
* :mod:`~tfsync.engine.control.relay`: a host's relay, and a group of hosts' relay;
* :mod:`~tfsync.engine.control.stop`: the stop handshake;
* :mod:`~tfsync.engine.control.coordinator`: the rounds rank 0 closes;
* :mod:`~tfsync.engine.control.services`: the clock table, the policy's service;
* :mod:`~tfsync.engine.control.server` and :mod:`~tfsync.engine.control.client`: the two ends.
"""

from tfsync.engine.control.client import (
    ASK_TIMEOUT_S,
    CALL_TIMEOUT_S,
    CONNECT_TIMEOUT_S,
    LATE_TIMEOUT_S,
    READY_TIMEOUT_S,
    REPORT_INTERVAL_S,
    ControlClient,
)
from tfsync.engine.control.relay import HostRelay
from tfsync.engine.control.server import ControlServer
from tfsync.engine.control.stop import STOP_CALL_TIMEOUT_S, STOP_NOTICE_GRACE_S
from tfsync.engine.control.transport import (
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
