"""What every rank agrees on before the first step: checked, each through one bounded collective.

Each runs once per :meth:`SyncEngine.start <tfsync.engine.SyncEngine.start>` through the
cluster's own collectives (Horovod's in production), each bounded by the engine's wait bound
(:func:`tfsync.engine.bounded.run_bounded`: a rank that does not come stops every rank with an
error naming it), so a job whose ranks disagree stops with both sides named before any round
runs.  The frontends compare their own fingerprints with :func:`check_agreement` too
(:mod:`tfsync.frontend`).
"""

import socket
import time

from tfsync.engine.bounded import run_bounded


def check_trainable(tensors) -> None:
    """Refuse a trainable variable that is not floating point, before any collective: rounds
    average the workers' contributions, which only floating-point weights have."""
    import tensorflow as tf

    for i, t in enumerate(tensors):
        dtype = tf.as_dtype(t.dtype)
        if not dtype.is_floating:
            name = getattr(t, "path", None) or getattr(t, "name", None) or f"#{i}"
            raise TypeError(
                f"tfsync: trainable variable {name} has dtype {dtype.name}; every trainable variable "
                f"must be floating point (tfsync averages them across workers). Create it with "
                f"trainable=False, or with a float dtype"
            )


def agree_config(cluster, config: dict, timeout_s: float) -> list:
    """Raise ``ValueError`` naming the ranks whose ``config`` differs from rank 0's, and the first
    difference (collective, bounded by ``timeout_s``; :func:`check_agreement`).  Returns every
    rank's host name, in rank order (gathered with the configs: the errors name the host of a
    rank at fault)."""
    gathered = run_bounded(
        cluster,
        lambda: cluster.allgather_object((config, socket.gethostname()), name="tfsync.config"),
        name="tfsync.config",
        purpose="every rank's mode, model and straggler settings, gathered when the engine starts to check they match",
        timeout_s=timeout_s,
    )
    check_agreement([c for c, _ in gathered], "mode, model and straggler settings")
    return [h for _, h in gathered]


def check_agreement(
    configs: list, what: str, fix: str = "launch the same script with the same arguments on every rank"
):
    """Raise ``ValueError`` if any rank's config (``configs``, in rank order, plain data) differs
    from rank 0's: the error names those ranks and, for the first of them, only the first
    difference (``rank 1: variable dense_1/kernel dtype float16, rank 0 float32``), not the
    whole config, which may list every variable of a model.  ``what``: what the configs hold, in
    words; ``fix``: how to make them agree."""
    mismatched = [r for r, c in enumerate(configs) if c != configs[0]]
    if mismatched:
        r = mismatched[0]
        raise ValueError(
            f"tfsync: ranks {mismatched} are configured differently from rank 0 "
            f"(rank {r}: {first_difference(configs[r], configs[0])}). Every worker must run the same "
            f"{what}: {fix}"
        )


def first_difference(mine, rank0, where: str = "") -> str:
    """The first place where ``mine`` differs from rank 0's ``rank0`` (nested dicts and lists of
    plain data), in words: ``policy staleness 3, rank 0 2``.  A list's items that are dicts with
    a ``path`` (a model's variables) are named by it: ``variable dense/kernel dtype ...``."""
    if isinstance(mine, dict) and isinstance(rank0, dict):
        for key in [*mine, *(k for k in rank0 if k not in mine)]:
            at = f"{where} {key}".strip()
            if key not in rank0:
                return f"{at} {_short(mine[key])}, rank 0 has none"
            if key not in mine:
                return f"{at} missing, rank 0 {_short(rank0[key])}"
            if mine[key] != rank0[key]:
                return first_difference(mine[key], rank0[key], at)
    if isinstance(mine, list | tuple) and isinstance(rank0, list | tuple):
        for i, (a, b) in enumerate(zip(mine, rank0)):
            if a != b:
                return first_difference(a, b, _item(where, i, a, b))
        if len(mine) != len(rank0):
            extra = mine[len(rank0)] if len(mine) > len(rank0) else rank0[len(mine)]
            named = _item(where, min(len(mine), len(rank0)), extra, extra)
            return f"{where} {len(mine)} entries, rank 0 {len(rank0)} (the first unmatched: {named})".strip()
    return f"{where} {_short(mine)}, rank 0 {_short(rank0)}".strip()


def _item(where, i, a, b):
    """The name of item ``i`` of a list at ``where``: a variable by its path when both have it."""
    if isinstance(a, dict) and isinstance(b, dict) and a.get("path") and a.get("path") == b.get("path"):
        return f"variable {a['path']}"
    if isinstance(a, dict) and "path" in a:
        return f"variable #{i}"
    return f"{where}[{i}]"


def _short(value, limit=80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def agree_t0(cluster, timeout_s: float) -> float:
    """Rank 0's clock, the job's t0 (every time in rounds and traces is relative to it; collective,
    bounded by ``timeout_s``)."""
    now = time.time()
    return run_bounded(
        cluster,
        lambda: cluster.broadcast_object(now, root_rank=0, name="tfsync.t0"),
        name="tfsync.t0",
        purpose="rank 0's clock, the job's t0, broadcast when the engine starts",
        timeout_s=timeout_s,
    )


__all__ = ["agree_config", "agree_t0", "check_agreement", "check_trainable", "first_difference"]
