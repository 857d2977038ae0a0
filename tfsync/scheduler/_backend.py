"""The one place that chooses the compiled or the reference ZipLine kernels.

``TFSYNC_SCHEDULER_IMPL=compiled|reference`` (default ``compiled``) or an
explicit ``implementation=`` argument picks the module; the argument wins.
A missing compiled extension is an error that names the build command, never
a silent fall back to the (much slower) reference.
"""

import importlib

from tfsync import _env

ENV_VAR = _env.SCHEDULER_IMPL.name
IMPLEMENTATIONS = ("compiled", "reference")
_MODULES = {"compiled": "tfsync.scheduler._zipline", "reference": "tfsync.scheduler._reference"}
_loaded = {}


def implementation_name(implementation=None):
    """The implementation that runs: ``implementation`` if given, else the env var, else compiled."""
    source = "implementation="
    if implementation is None:
        implementation = _env.SCHEDULER_IMPL.get()
        source = ENV_VAR + "="
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"tfsync.scheduler: {source}{implementation!r} is not an implementation; "
            f"expected one of {', '.join(IMPLEMENTATIONS)}; unset it for 'compiled' (the default), "
            "or choose 'reference', the plain-Python twin kept for tests"
        )
    return implementation


def load(implementation=None):
    """The kernel module of the chosen implementation (imported once)."""
    name = implementation_name(implementation)
    module = _loaded.get(name)
    if module is None:
        try:
            module = importlib.import_module(_MODULES[name])
        except ImportError as exc:
            if name != "compiled":
                raise
            raise ImportError(
                "tfsync.scheduler: the compiled ZipLine extension tfsync.scheduler._zipline "
                f"is not built ({exc}). Build it with `pip install --no-build-isolation -e .` "
                "or `make install` (from the sdist: `pip install --no-build-isolation --force-reinstall "
                "tfsync-<version>.tar.gz`; in a checkout, `TFSYNC_BUILD_OPS=0 python setup.py "
                "build_ext --inplace` builds only the scheduler), or choose the slow "
                f"pure-Python kernels explicitly with {ENV_VAR}=reference."
            ) from exc
        _loaded[name] = module
    return module
