"""The one loader of tfsync's compiled TensorFlow op library (``_tfsync_ops.so``).

The library holds the kernels of :mod:`tfsync.ops` (DC-ASGD delay compensation, the
"updates" protocol's state updates, the finiteness check; see ``docs/ops.md``).
It is loaded lazily, on the first call of a compiled op, never at import, so that
``import tfsync`` works without it when the reference implementation is selected.

Two checks run before ``tf.load_op_library``, as Horovod does for its own library:
the file must exist (it is compiled at install time), and the TensorFlow version it
was compiled against (recorded in ``_build_info.json`` by ``setup.py``) must be the
running one, since TensorFlow's C++ ABI changes between releases.
"""

import json
import os
import threading

import tensorflow as tf

LIBRARY_FILE = "_tfsync_ops.so"
BUILD_INFO_FILE = "_build_info.json"
BUILD_COMMAND = (
    "`pip install --no-build-isolation -e .` (or `make install`) in the tfsync checkout, or "
    "`pip install --no-build-isolation --force-reinstall tfsync-<version>.tar.gz` from its sdist"
)

# Op names as registered in ops/cc/ops/tfsync_ops.cc.
OP_NAMES = (
    "TfSync>DelayCompensate",
    "TfSync>DelayCompensateAdaptive",
    "TfSync>UpdatePushShare",
    "TfSync>UpdateApplyRound",
    "TfSync>AllFinite",
    "TfSync>ScaleAllFinite",
)

_lock = threading.Lock()
_library = None
_gpu_kernels = None  # read from the build info once, with the library


class OpLibraryError(ImportError):
    """The compiled op library is missing, stale or does not load."""


def library_dir():
    """The directory holding ``_tfsync_ops.so`` and ``_build_info.json``."""
    return os.path.dirname(os.path.abspath(__file__))


def load_library():
    """Returns the loaded op library module, loading it on the first call.

    Raises:
      OpLibraryError: the library is missing, was built for another TensorFlow, or
        fails to load.
    """
    global _library
    with _lock:
        if _library is None:
            _library = _load(library_dir())
            # Registered once per process (TensorFlow refuses a second registration).
            # The ops have no gradient: differentiating through them is a mistake, and
            # a None gradient makes Keras optimizers fail loudly.
            for op_name in OP_NAMES:
                tf.no_gradient(op_name)
        return _library


def has_gpu_kernels():
    """Whether the loaded library has GPU kernels: its build compiled the CUDA kernels
    (``cuda_kernels`` in ``_build_info.json``; a TensorFlow with CUDA and ``nvcc``).

    Loads the library first, so a missing or stale one raises :class:`OpLibraryError`.
    """
    global _gpu_kernels
    if _gpu_kernels is None:
        load_library()
        with open(os.path.join(library_dir(), BUILD_INFO_FILE)) as f:
            _gpu_kernels = bool(json.load(f).get("cuda_kernels", False))
    return _gpu_kernels


def _load(directory):
    """Checks and loads the library found in ``directory`` (separate for tests)."""
    path = os.path.join(directory, LIBRARY_FILE)
    if not os.path.exists(path):
        raise OpLibraryError(
            f"tfsync's compiled op library {path} does not exist. It is compiled against the "
            f"installed TensorFlow when tfsync is installed: build it with {BUILD_COMMAND}, "
            "or select the pure-TensorFlow implementation with TFSYNC_OPS_IMPL=reference "
            "(or tfsync.ops.set_implementation('reference'))."
        )
    info_path = os.path.join(directory, BUILD_INFO_FILE)
    try:
        with open(info_path) as f:
            built_with = json.load(f)["tensorflow_version"]
    except (OSError, ValueError, KeyError) as exc:
        raise OpLibraryError(
            f"{info_path} is missing or unreadable ({exc}), so the TensorFlow version "
            f"{path} was built against is unknown; rebuild with {BUILD_COMMAND}."
        ) from exc
    if built_with != tf.__version__:
        raise OpLibraryError(
            f"{path} was built against TensorFlow {built_with}, but TensorFlow "
            f"{tf.__version__} is running; custom ops must be compiled against the running "
            f"TensorFlow. Rebuild with {BUILD_COMMAND}."
        )
    try:
        return tf.load_op_library(path)
    except (tf.errors.NotFoundError, OSError) as exc:
        raise OpLibraryError(
            f"TensorFlow {tf.__version__} could not load {path}: {exc}. Rebuild with " f"{BUILD_COMMAND}."
        ) from exc
