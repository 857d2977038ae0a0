"""Dataset sharding by rank, with equal shares so every worker runs the same steps, and an
elastic job's data position (where the committed epoch resumes, which samples a reset redoes).

An epoch is an order of its samples, the same on every worker (the arrays' order, or a
permutation drawn from ``seed`` and the epoch).  Rank ``r`` of ``W`` takes the rows
``start + r``, ``start + r + W``, ... of that order, so after ``k`` whole steps of ``B`` rows
on every worker the job has trained on exactly the samples ``[start, start + k·W·B)``: a
contiguous prefix, which one number, :attr:`EpochPlan.position`, says.  An elastic job
commits that number (``state.sample``); after a reset the new members share the rest of
the epoch from it, however many they are (:func:`plan_epoch`).
"""

import dataclasses

import numpy as np

from tfsync import _horovod

# what an elastic job's resets undid, counted beside the contributions (tfsync.keras.counts)
REDONE = ("steps_redone", "samples_redone")


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """How ``size`` workers share an epoch's samples from ``start`` on (:func:`plan_epoch`).

    Attributes:
        epoch: the epoch (of an elastic state; 0 without one).
        samples: the epoch's samples.
        start: the first sample of the epoch's order not yet trained on.
        size: the workers sharing the rest.
        batch_size: rows of a worker's step (its last step may be shorter: see ``per_rank``).
        per_rank: the rows each worker takes; a whole number of batches when the rest holds at
            least one batch per worker, else the rest shared as one shorter step (one row each
            when fewer rows than workers are left: some of them taken by two workers).
        steps: each worker's steps (``ceil(per_rank / batch_size)``).
    """

    epoch: int
    samples: int
    start: int
    size: int
    batch_size: int
    per_rank: int
    steps: int

    @property
    def end(self) -> int:
        """The position after the last step: the samples from here on are left out this epoch."""
        return self.start + min(self.size * self.per_rank, self.samples - self.start)

    @property
    def left_out(self) -> int:
        return self.samples - self.end

    def rows_done(self, steps: int) -> int:
        """The rows one worker has trained on after ``steps`` of its steps."""
        return min(max(int(steps), 0) * self.batch_size, self.per_rank)

    def position(self, steps: int) -> int:
        """The epoch's samples the job has trained on after ``steps`` steps of every worker."""
        return self.start + min(self.size * self.rows_done(steps), self.samples - self.start)

    def rows(self, rank: int) -> np.ndarray:
        """Indices into the epoch's order of ``rank``'s rows, in the order it trains on them."""
        rows = np.arange(rank, self.size * self.per_rank, self.size, dtype=np.int64)
        return self.start + rows % (self.samples - self.start)  # (wraps only with fewer rows than workers)


def plan_epoch(samples: int, start: int, size: int, batch_size: int, epoch: int = 0) -> EpochPlan:
    """How ``size`` workers share the samples ``[start, samples)`` of an epoch in steps of
    ``batch_size`` rows (pure arithmetic; see the module docstring).

    Raises ``ValueError`` when ``start`` is not a sample of the epoch."""
    samples, start, size, batch_size = int(samples), int(start), int(size), int(batch_size)
    if batch_size < 1 or size < 1:
        raise ValueError(
            f"tfsync.shard: batch_size={batch_size} with {size} workers; expected batch_size >= 1 and "
            f"at least one worker"
        )
    if not 0 <= start < samples:
        raise ValueError(
            f"tfsync.shard: the data position {start} is outside the epoch's {samples} samples; expected "
            f"0 <= position < {samples}. The elastic state was committed for other data: build it with the "
            f"same arrays (or dataset and samples=) in every call"
        )
    # fewer rows left than workers (a reset that added workers near the epoch's end): one each,
    # some rows taken twice, rather than an epoch that no worker can finish
    per_rank = max((samples - start) // size, 1)
    if per_rank >= batch_size:
        per_rank -= per_rank % batch_size
    steps = -(-per_rank // batch_size)
    return EpochPlan(epoch, samples, start, size, batch_size, per_rank, steps)


def epoch_order(samples: int, epoch: int, seed=None) -> np.ndarray | None:
    """The epoch's order of ``samples`` indices: a permutation drawn from ``(seed, epoch)``, the
    same on every worker and in every process; None (the arrays' order) without a seed."""
    if seed is None:
        return None
    return np.random.default_rng([int(seed), int(epoch)]).permutation(int(samples))


def samples_redone(plan: EpochPlan, committed_steps: int, steps_done: int) -> int:
    """The rows one worker trained on after the commit at ``committed_steps`` (of this plan's steps)
    up to ``steps_done``: the rows a reset to that commit hands out again."""
    return plan.rows_done(steps_done) - plan.rows_done(committed_steps)


def _membership():
    hvd = _horovod.horovod()
    return hvd.rank(), hvd.size()


def _plan_for(resume, samples, size, batch_size):
    if resume is None:
        return None
    if not batch_size:
        raise ValueError(
            "tfsync.shard: resume= needs batch_size= (the data position advances by every worker's batch); "
            "pass the batch_size you give model.fit"
        )
    return plan_epoch(samples, resume.sample, size, batch_size, epoch=resume.epoch)


def shard(*arrays, batch_size=None, resume=None, seed=None):
    """Return this rank's share of each array: rows ``rank::size``, cut to equal length.

    Every rank gets exactly ``len // size`` rows (and, with ``batch_size``, a
    whole number of batches), because tfsync's collectives need every worker
    to take the same number of steps.  Rows past that are left out on every
    rank; their count is ``len - size * per_rank``.

    Args:
        batch_size: rows of a step (default: none, the shares are not cut to whole batches).
        resume: a :class:`tfsync.elastic.KerasState`: this rank's share of the rest of the
            state's epoch, from its committed data position ``state.sample`` on (after a reset:
            what the job had not trained on when it last committed, shared by the new members);
            the state records the share's plan, so the callback commits the position every
            ``commit_every_steps`` and a reset says which samples it redoes.  Call it once per
            epoch and fit one epoch on it (``docs/guide/elastic.md``, "Mid-epoch resume").
            Needs ``batch_size``.
        seed: shuffle each epoch by a permutation drawn from ``(seed, epoch)``, the same on
            every worker and after every reset (default: none, the arrays' order).  Pass
            ``shuffle=False`` to ``fit``: its own shuffle differs per worker and per call, so
            no position could say what was trained on.

    Example:

        x_local, y_local = tfsync.shard(x, y, batch_size=32)
        x_local, y_local = tfsync.shard(x, y, batch_size=32, resume=state, seed=0)   # elastic
    """
    if not arrays:
        raise ValueError("tfsync.shard: pass at least one array")
    rank, size = _membership()
    lengths = {len(a) for a in arrays}
    if len(lengths) != 1:
        raise ValueError(
            f"tfsync.shard: arrays have different lengths {sorted(lengths)}; "
            "pass features and labels of the same length"
        )
    samples = lengths.pop()
    if seed is not None and resume is None:
        raise ValueError(
            "tfsync.shard: seed= shuffles the epoch of the elastic state given as resume=; without one, "
            "shuffle the arrays yourself (the same permutation on every worker) or pass fit(shuffle=True)"
        )
    plan = _plan_for(resume, samples, size, batch_size)
    if plan is not None:
        rows = plan.rows(rank)
        order = epoch_order(samples, plan.epoch, seed)
        rows = order[rows] if order is not None else rows
        out = [np.asarray(a)[rows] for a in arrays]
        resume.use_data(plan)
        return out[0] if len(out) == 1 else tuple(out)
    per_rank = samples // size
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


def shard_dataset(dataset, batch_size, *, resume=None, samples=None):
    """This rank's share of a ``tf.data`` dataset of single samples, batched: elements
    ``rank::size`` (of the rest of the state's epoch with ``resume``), cut so every rank takes
    the same number of steps (:func:`shard`'s rule).

    The dataset must yield the epoch's samples unbatched, in the same order on every worker
    and in every call for the same epoch (shuffle it with a seed drawn from the epoch:
    ``dataset.shuffle(n, seed=epoch)``).  Its samples: ``samples``, or its cardinality when
    known.  With ``resume`` the samples before ``state.sample`` are skipped (read and
    discarded: ``Dataset.skip``), and the state records the plan, as :func:`shard` does.

    Example:

        ds = tfsync.shard_dataset(make_dataset(seed=state.epoch), 32, resume=state)
        model.fit(ds, epochs=state.epoch + 1, initial_epoch=state.epoch, callbacks=[sync])
    """
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            f"tfsync.shard_dataset: expected a tf.data.Dataset of single samples, got {type(dataset).__name__}; "
            f"for NumPy arrays use tfsync.shard"
        )
    if not batch_size or int(batch_size) < 1:
        raise ValueError(f"tfsync.shard_dataset: batch_size={batch_size!r}; expected an integer >= 1")
    if samples is None:
        cardinality = int(dataset.cardinality())
        if cardinality < 0:
            raise ValueError(
                "tfsync.shard_dataset: the dataset's number of samples is unknown (or infinite); every "
                "worker must take the same steps, so pass samples= (the samples of one epoch)"
            )
        samples = cardinality
    rank, size = _membership()
    start, epoch = (resume.sample, resume.epoch) if resume is not None else (0, 0)
    plan = plan_epoch(samples, start, size, batch_size, epoch=epoch)
    sharded = dataset.skip(plan.start).shard(size, rank).take(plan.per_rank)
    sharded = sharded.batch(min(plan.batch_size, plan.per_rank), drop_remainder=False)
    if resume is not None:
        resume.use_data(plan)
    return sharded
