"""The one place tfsync imports Horovod and checks how the process was launched."""

import ctypes
import os
import sys

from tfsync import _env

LAUNCHER_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
SINGLE_PROCESS_ENV = _env.SINGLE_PROCESS.name


def horovod():
    """Return ``horovod.tensorflow`` after checking it is initialized and launched.

    Raises ``RuntimeError`` saying how to fix it otherwise (``ValueError`` for a
    ``TFSYNC_SINGLE_PROCESS`` that is neither 0 nor 1).
    """
    single_process = _env.single_process()
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
