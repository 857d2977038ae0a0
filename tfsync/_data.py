"""Dataset sharding by rank, with equal shares so every worker runs the same steps."""

from tfsync import _horovod


def shard(*arrays, batch_size=None):
    """Return this rank's share of each array: rows ``rank::size``, cut to equal length.

    Every rank gets exactly ``len // size`` rows (and, with ``batch_size``, a
    whole number of batches), because tfsync's collectives need every worker
    to take the same number of steps.  Rows past that are left out on every
    rank; their count is ``len - size * per_rank``.

    Example:

        x_local, y_local = tfsync.shard(x, y, batch_size=32)
    """
    if not arrays:
        raise ValueError("tfsync.shard: pass at least one array")
    hvd = _horovod.horovod()
    rank, size = hvd.rank(), hvd.size()
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise ValueError(
            f"tfsync.shard: arrays have different lengths {sorted(lengths)}; "
            "pass features and labels of the same length"
        )
    per_rank = lengths.pop() // size
    if batch_size:
        per_rank -= per_rank % batch_size
    if per_rank == 0:
        raise ValueError(
            f"tfsync.shard: {size} workers leave no full share"
            + (f" of batch_size={batch_size}" if batch_size else "")
            + "; use more data or fewer workers"
        )
    out = [a[rank::size][:per_rank] for a in arrays]
    return out[0] if len(out) == 1 else tuple(out)
