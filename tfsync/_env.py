"""Every ``TFSYNC_*`` environment variable tfsync reads, with its default: the one place.

Each module reads its variable through the :class:`Var` defined here, so the
names, defaults and meanings are listed once.  (``setup.py`` reads the build
flags ``TFSYNC_BUILD_OPS`` and ``TFSYNC_BUILD_SCHEDULER`` (default 1) and
``TFSYNC_CUDA_ARCHS`` (default: sm_70, sm_80, sm_90 where ``nvcc`` has them)
itself, since the package is not importable while it is being built.)
"""

import dataclasses
import math
import numbers
import os


@dataclasses.dataclass(frozen=True)
class Var:
    """One environment variable: its name, the default used when unset or empty, its meaning."""

    name: str
    default: str
    doc: str

    def get(self, environ=None) -> str:
        environ = os.environ if environ is None else environ
        return environ.get(self.name, "").strip() or self.default

    def is_set(self, environ=None) -> bool:
        environ = os.environ if environ is None else environ
        return bool(environ.get(self.name, "").strip())


STRAGGLERS = Var("TFSYNC_STRAGGLERS", "", "straggler spec (tfsync.Stragglers.parse syntax); empty: none")
WAIT_TIMEOUT_S = Var("TFSYNC_WAIT_TIMEOUT_S", "120", "bound on one wait for peers, in seconds")
CONTROL_HOST = Var(
    "TFSYNC_CONTROL_HOST",
    "",
    "address rank 0's control service listens on and the workers dial; empty: the address of "
    "Horovod's Gloo interface (HOROVOD_GLOO_IFACE), else of rank 0's host name (tfsync.control.address)",
)
CONTROL_PORT = Var(
    "TFSYNC_CONTROL_PORT",
    "0",
    "TCP port rank 0's control service listens on; 0: one the system picks (open a fixed one in a firewall)",
)
CONTROL_RELAYS = Var(
    "TFSYNC_CONTROL_RELAYS",
    "auto",
    "auto | hosts | off: auto, the workers of each host but rank 0's reach rank 0's control service "
    "through one relay on their host, and past 8 such hosts the relays of 8 hosts through a group relay "
    "(tfsync.control.relay); hosts, the host relays only; off, each worker holds its own link to rank 0",
)
SINGLE_PROCESS = Var("TFSYNC_SINGLE_PROCESS", "0", "1: train one worker without horovodrun, on purpose")
OPS_IMPL = Var("TFSYNC_OPS_IMPL", "compiled", "compiled | reference: the kernels tfsync.ops runs")
SCHEDULER_IMPL = Var(
    "TFSYNC_SCHEDULER_IMPL", "compiled", "compiled | reference: the ZipLine kernels tfsync.scheduler runs"
)
HANG_STACKS = Var(
    "TFSYNC_HANG_STACKS",
    "0",
    "1: the hang guard of an elastic worker writes the worker's stacks (py-spy dump, where py-spy is "
    "installed) to its standard error before it ends the worker",
)

COMMIT_DIR = Var(
    "TFSYNC_COMMIT_DIR",
    "",
    "a directory every host shares: an elastic job's rank 0 writes each commit of its state there, "
    "a job with no worker left restarts from it (set it for horovodrun: its launcher then goes on "
    "when no host of the last round remains); empty: commits in memory only",
)


def wait_timeout_s(value=None) -> float:
    """The bound on one wait for peers: ``value``, else ``TFSYNC_WAIT_TIMEOUT_S``; checked."""
    from_env = value is None
    if value is None:
        raw = WAIT_TIMEOUT_S.get()
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"{WAIT_TIMEOUT_S.name}={raw!r} is not a number of seconds; set it "
                f"to e.g. {WAIT_TIMEOUT_S.default} or unset it"
            ) from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
        source = f"{WAIT_TIMEOUT_S.name}={WAIT_TIMEOUT_S.get()!r}" if from_env else f"wait_timeout_s={value!r}"
        raise ValueError(
            f"{source}: the bound on one wait for peers must be a finite, positive number of seconds "
            f"(a wait without a bound would hang the job on a stuck worker); pass e.g. "
            f"{WAIT_TIMEOUT_S.default}, or a larger finite bound for long steps"
        )
    return float(value)


def control_port(environ=None) -> int:
    """The port of rank 0's control service from ``TFSYNC_CONTROL_PORT`` (0: the system picks); checked."""
    raw = CONTROL_PORT.get(environ)
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(
            f"{CONTROL_PORT.name}={raw!r}: expected a TCP port number, 1 to 65535 (or 0, the default: "
            f"a free port the system picks); set it to a port every worker's host may reach on rank 0's host"
        )
    return port


def control_relays(environ=None) -> str:
    """How the hosts relay their workers' control traffic (``TFSYNC_CONTROL_RELAYS``): ``auto``,
    ``hosts`` or ``off``; checked."""
    raw = CONTROL_RELAYS.get(environ)
    if raw not in ("auto", "hosts", "off"):
        raise ValueError(
            f"{CONTROL_RELAYS.name}={raw!r}: expected auto (the default: one relay per host of several "
            f"workers carries their control traffic to rank 0, and a group relay the traffic of 8 such "
            f"hosts), hosts (the host relays only) or off (each worker links to rank 0 itself); "
            f"set it to one of them, or unset it"
        )
    return raw


def _flag(var: Var, one: str, zero: str) -> bool:
    """``var`` read as a flag: ``1`` (meaning ``one``) or ``0``/unset (``zero``); another value is
    refused rather than read as no."""
    raw = var.get()
    if raw not in ("0", "1"):
        raise ValueError(
            f"{var.name}={raw!r}: expected 1 ({one}) or 0 (the default: {zero}); set it to 1 or 0, or unset it"
        )
    return raw == "1"


def single_process() -> bool:
    """Whether ``TFSYNC_SINGLE_PROCESS`` asks to train one worker without ``horovodrun``."""
    return _flag(
        SINGLE_PROCESS,
        "train one worker without horovodrun, on purpose",
        "refuse to train outside horovodrun",
    )


def hang_stacks() -> bool:
    """Whether ``TFSYNC_HANG_STACKS`` asks the hang guard for the worker's stacks before it ends it."""
    return _flag(
        HANG_STACKS,
        "the hang guard writes a hung worker's stacks before it ends it",
        "it does not",
    )


ALL = (
    STRAGGLERS,
    WAIT_TIMEOUT_S,
    CONTROL_HOST,
    CONTROL_PORT,
    CONTROL_RELAYS,
    SINGLE_PROCESS,
    OPS_IMPL,
    SCHEDULER_IMPL,
    HANG_STACKS,
    COMMIT_DIR,
)
