"""The one place that chooses between the compiled ops and their pure-TensorFlow twins.

``TFSYNC_OPS_IMPL`` (read when :mod:`tfsync.ops` is imported) or
:func:`set_implementation` picks ``"compiled"`` (the default: the kernels in
``ops/cc``, loaded by :mod:`tfsync.ops._loader`) or ``"reference"``
(:mod:`tfsync.ops._reference`). There is no fallback: with ``"compiled"``
selected and the library missing, the first call raises the loader's error.
"""

from tfsync import _env

IMPLEMENTATIONS = ("compiled", "reference")
ENV_VAR = _env.OPS_IMPL.name


def implementation_from_env(environ=None):
    """The implementation named by ``TFSYNC_OPS_IMPL`` (``"compiled"`` when unset)."""
    value = _env.OPS_IMPL.get(environ).lower()
    if value not in IMPLEMENTATIONS:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not an implementation of tfsync.ops; "
            f"expected one of {', '.join(IMPLEMENTATIONS)}; unset it to run the compiled kernels, or "
            f"set {ENV_VAR}=reference for the TensorFlow-ops twin."
        )
    return value


_current = implementation_from_env()


def set_implementation(name):
    """Selects ``"compiled"`` or ``"reference"`` for every later call of tfsync.ops."""
    global _current
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown tfsync.ops implementation {name!r}; expected one of " f"{', '.join(IMPLEMENTATIONS)}."
        )
    _current = name


def get_implementation():
    """The name of the selected implementation: ``"compiled"`` or ``"reference"``."""
    return _current


def backend():
    """The module implementing the selected ops (both expose the same functions)."""
    if _current == "reference":
        from tfsync.ops import _reference

        return _reference
    from tfsync.ops import _compiled

    return _compiled
