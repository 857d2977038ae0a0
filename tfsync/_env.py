"""Every ``TFSYNC_*`` environment variable tfsync reads, with its default: the one place.

Each module reads its variable through the :class:`Var` defined here, so the
names, defaults and meanings are listed once.  (``setup.py`` reads the build
flags ``TFSYNC_BUILD_OPS`` and ``TFSYNC_BUILD_SCHEDULER`` (default 1) and
``TFSYNC_CUDA_ARCHS`` (default: sm_70, sm_80, sm_90 where ``nvcc`` has them)
itself, since the package is not importable while it is being built.)
"""

import dataclasses
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
    "Horovod's Gloo interface (HOROVOD_GLOO_IFACE), else of rank 0's host name (tfsync.engine.address)",
)
SINGLE_PROCESS = Var("TFSYNC_SINGLE_PROCESS", "0", "1: train one worker without horovodrun, on purpose")
OPS_IMPL = Var("TFSYNC_OPS_IMPL", "compiled", "compiled | reference: the kernels tfsync.ops runs")
SCHEDULER_IMPL = Var(
    "TFSYNC_SCHEDULER_IMPL", "compiled", "compiled | reference: the ZipLine kernels tfsync.scheduler runs"
)


def wait_timeout_s(value=None) -> float:
    """The bound on one wait for peers: ``value``, else ``TFSYNC_WAIT_TIMEOUT_S``; checked."""
    if value is None:
        raw = WAIT_TIMEOUT_S.get()
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"{WAIT_TIMEOUT_S.name}={raw!r} is not a number of seconds; set it "
                f"to e.g. {WAIT_TIMEOUT_S.default} or unset it"
            ) from None
    if not value > 0:
        raise ValueError(f"wait_timeout_s={value!r} must be a positive number of seconds")
    return float(value)


ALL = (STRAGGLERS, WAIT_TIMEOUT_S, CONTROL_HOST, SINGLE_PROCESS, OPS_IMPL, SCHEDULER_IMPL)
