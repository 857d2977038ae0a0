"""The one place tfsync imports Horovod and checks how the process was launched."""

import ctypes
import os
import re
import sys

from tfsync import _env

LAUNCHER_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
SINGLE_PROCESS_ENV = _env.SINGLE_PROCESS.name
# Read by Horovod as ``make install`` builds it (third_party/horovod, hunk 14), in each Gloo
# connection: the longest TCP waits between two retransmissions on it (TCP_RTO_MAX_MS)
RTO_MAX_ENV = "HOROVOD_TFSYNC_TCP_RTO_MAX_MS"
RTO_MAX_DEFAULT_MS = 1000  # (the smallest Linux takes)
RTO_MAX_RANGE_MS = (1000, 120000)  # (what Linux takes)
TCP_RTO_MAX_MS = 44  # the socket option (Linux 6.15 and newer; Python's socket module has no name for it)


def gloo_rto_max_ms(environ=None) -> int:
    """The cap on TCP's retransmission timeout that Horovod's Gloo connections get, in ms: from
    ``HOROVOD_TFSYNC_TCP_RTO_MAX_MS`` (0: the kernel's own backoff), 1000 when it is unset.

    TCP doubles a connection's retransmission timeout after each unanswered retransmission, so a
    collective whose link was down for 3.5 s would resume only at 6.2 s, one down for 6.5 s only
    at 12.6 s; with the cap it resumes within that many milliseconds of the link's return.
    Raises ``ValueError`` for a value Linux would refuse: Horovod's C++ reads it in every
    process and can only keep the kernel's cap."""
    environ = os.environ if environ is None else environ
    raw = environ.get(RTO_MAX_ENV, "")
    if raw == "":
        return RTO_MAX_DEFAULT_MS
    low, high = RTO_MAX_RANGE_MS
    if not re.fullmatch(r"[0-9]+", raw) or (int(raw) != 0 and not low <= int(raw) <= high):
        raise ValueError(
            f"{RTO_MAX_ENV}={raw!r}: expected 0 (TCP's own backoff) or a number of milliseconds from "
            f"{low} to {high} (the longest a Gloo connection waits between two retransmissions; Linux "
            f"takes nothing outside that range); set it in that range, or unset it for {RTO_MAX_DEFAULT_MS}"
        )
    return int(raw)


def horovod():
    """Return ``horovod.tensorflow`` after checking it is initialized and launched.

    Raises ``RuntimeError`` saying how to fix it otherwise (``ValueError`` for a
    ``TFSYNC_SINGLE_PROCESS`` that is neither 0 nor 1, or a ``HOROVOD_TFSYNC_TCP_RTO_MAX_MS``
    Linux would refuse: :func:`gloo_rto_max_ms`).
    """
    single_process = _env.single_process()
    gloo_rto_max_ms()
    try:
        import horovod.tensorflow as hvd
    except ImportError as exc:
        raise RuntimeError(
            f"tfsync needs Horovod with TensorFlow support ({exc}); install it with "
            "`make install` (builds horovod==0.28.1 against the installed TensorFlow)"
        ) from exc
    try:
        initialized = hvd.is_initialized()
    except ValueError:
        initialized = False
    if not initialized:
        raise RuntimeError(
            "tfsync: Horovod is not initialized in this process; call "
            "`import horovod.tensorflow as hvd; hvd.init()` before training, and launch one "
            "process per worker with e.g. `horovodrun -np 4 -H localhost:4 --gloo python train.py`"
        )
    launched = any(k in os.environ for k in LAUNCHER_ENV) or hvd.size() > 1
    if not launched and not single_process:
        raise RuntimeError(
            "tfsync: this process was not started by horovodrun (or mpirun), so it would train "
            "alone with nothing to synchronize; launch it with e.g. "
            "`horovodrun -np 4 -H localhost:4 --gloo python train.py`, or set "
            f"{SINGLE_PROCESS_ENV}=1 to train a single worker on purpose"
        )
    return hvd


REMOVED = "has been removed from elastic job"  # Horovod's text for a host the launcher dropped


def init_error():
    """Why this process's last ``hvd.init()`` failed (the text of the exception its Gloo
    rendezvous threw; "" when none failed), or None where this Horovod cannot say.

    Horovod as ``make install`` builds it (``third_party/horovod``, hunk 6) makes a failed
    rendezvous an error of ``hvd.init()``, whose own message only points at the log, and
    exports ``horovod_tfsync_init_error`` with the reason.  Horovod as released aborts the
    process on such a failure: None."""
    fn = _library_function("horovod_tfsync_init_error")
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return (fn() or b"").decode("utf-8", "replace")


def interrupt_gloo():
    """End every Gloo operation of this process that waits on a peer, now; the number of
    connections ended, -1 where Horovod's table was busy, None where this Horovod cannot.

    Horovod as ``make install`` builds it (``third_party/horovod``, hunk 7) exports
    ``horovod_tfsync_interrupt``: each connection of its Gloo contexts is put in error as a
    Gloo timeout would put it, which also closes it, so the peers' operations on this process
    end too.  An elastic reset calls it before ``hvd.shutdown()``, which otherwise waits for
    Horovod's background thread, blocked on a live peer (itself resetting) for up to
    ``HOROVOD_GLOO_TIMEOUT_SECONDS``.  Horovod as released has no such function: None.
    """
    fn = _library_function("horovod_tfsync_interrupt")
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return int(fn())


def _library_function(name):
    """``name`` in Horovod's loaded TensorFlow library (ctypes), or None where it is not."""
    mpi_ops = sys.modules.get("horovod.tensorflow.mpi_ops")
    lib = getattr(getattr(mpi_ops, "_basics", None), "MPI_LIB_CTYPES", None)
    return getattr(lib, name, None)
