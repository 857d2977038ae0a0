"""A byte-level language model (a small decoder-only transformer) on real text, trained with tfsync.

One process per worker, as Horovod's examples do::

    horovodrun -np 2 -H localhost:2 --gloo python keras_examples/text_lm.py --mode diloco --quantize int8

The text is every text file under ``--corpus DIR``, whatever its extension (a file that is
not UTF-8, or holds a NUL byte, is skipped); by default the running interpreter's standard
library (``sysconfig.get_paths()["stdlib"]``, its ``site-packages`` and ``dist-packages``
left out): megabytes of real text that ship with every Python.  The tokens are its bytes
(256 of them).  A fixed share of the files (``--val-fraction``, chosen by a hash of each
file's path under the corpus, so the split does not move with the seed, the workers or the
other files) is held out for validation.

The model is plain Keras 3 layers: token and learned position embeddings, ``--layers``
pre-norm blocks (``MultiHeadAttention`` with a causal mask, then a GELU MLP four times
``--width``), a final ``LayerNormalization`` and a ``Dense`` to the 256 byte logits.  The
optimizer is AdamW with a linear warm-up and a cosine decay to a tenth of ``--lr`` over the
whole run, the same for every mode (under Local SGD and DiLoCo it is each worker's inner
optimizer, and its schedule counts inner steps).

The job trains on ``--epochs`` × ``--steps-per-epoch`` steps of ``--batch-size``
sequences of ``--context`` bytes on each worker: windows drawn at random from the training
files with ``--seed`` (the same windows for every mode, shared out by ``tfsync.shard``).
After every epoch each worker computes the loss of its own weights on its share of the
``--val-sequences`` held-out windows (drawn once, with a fixed seed); the job's validation
loss is their mean over every window.  Rank 0 prints one JSON line (``TFSYNC_RESULT {...}``):
``val_loss`` (nats per byte, after training), ``perplexity`` (its exponential),
``bits_per_byte``, ``tokens_per_s``, ``bytes_sent`` (what this worker put on the wire over
every round, counted by the engine's model, :mod:`tfsync.engine.wire.compression`; under
``--plain-horovod`` the same ring model for its allreduce of every gradient,
``tfsync.bench.baseline.ring_bytes``), ``wall_s`` (rank 0's training time from the end of its
first step, which compiles the train step, its evaluations left out), ``replicas_identical``
and ``curve``: ``[wall_s, tokens, val_loss]`` after every epoch (tokens over every worker),
with ``curve_bytes_sent`` beside it.  ``--plain-horovod``
trains the same job with plain Horovod (in-graph ``hvd.grouped_allreduce`` of the
gradients), the anchor of ``python -m tfsync.bench lm``.

The defaults (3.3M parameters: 4 layers of width 256, 4 heads; 1,200 steps of 8 sequences of 64
bytes per worker) train in about five minutes under plain Horovod with two workers on this
project's 2-core machine (240 ms a step).
"""

import argparse
import math
import os
import sys
import sysconfig
import time
import zlib

import keras
import numpy as np
from digits import add_run_arguments, init_horovod, plain_horovod_callback, replicas_identical

from tfsync.launch import add_mode_arguments, check_mode_args, integer, number

VOCABULARY = 256  # byte-level: one token per byte value
SKIPPED_DIRECTORIES = ("site-packages", "dist-packages")  # not the standard library (default corpus only)
VALIDATION_SEED = 0  # the held-out windows are the same in every run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_arguments(p)
    p.add_argument(
        "--corpus",
        default=None,
        help="a directory: every text file under it is the corpus (default: the standard library of the running "
        "interpreter, sysconfig's 'stdlib' path, less site-packages and dist-packages)",
    )
    p.add_argument(
        "--val-fraction",
        type=number(above=0, below=1),
        default=0.1,
        help="the share of the corpus's files held out for validation (by a hash of their paths)",
    )
    p.add_argument("--val-sequences", type=integer(1), default=256, help="held-out windows evaluated every epoch")
    p.add_argument("--epochs", type=integer(1), default=20, help="evaluations: the validation loss after each")
    p.add_argument("--steps-per-epoch", type=integer(1), default=60, help="steps per worker between evaluations")
    p.add_argument("--batch-size", type=integer(1), default=8, help="sequences per step, per worker")
    p.add_argument("--context", type=integer(2), default=64, help="bytes per sequence (the attention's span)")
    p.add_argument("--layers", type=integer(1), default=4, help="transformer blocks")
    p.add_argument("--width", type=integer(1), default=256, help="the model's width (the MLP's is four times it)")
    p.add_argument("--heads", type=integer(1), default=4, help="attention heads (they divide --width)")
    p.add_argument("--lr", type=number(above=0), default=2e-3, help="AdamW's peak learning rate")
    p.add_argument("--warmup-steps", type=integer(0), default=30, help="steps of linear warm-up to --lr")
    p.add_argument("--weight-decay", type=number(0), default=0.01, help="AdamW's weight decay")
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.width % args.heads:
        p.error(
            f"--width {args.width} --heads {args.heads}: the heads split the width evenly; pass a width that "
            f"--heads divides (e.g. --width {args.heads * max(args.width // args.heads, 1)})"
        )
    if args.epochs * args.steps_per_epoch < 2:
        p.error(
            "--epochs 1 --steps-per-epoch 1: the first step compiles the train step and is not timed; give the run "
            "two steps or more"
        )
    if args.warmup_steps >= args.epochs * args.steps_per_epoch:
        p.error(
            f"--warmup-steps {args.warmup_steps}: the run has {args.epochs * args.steps_per_epoch} steps "
            f"(--epochs × --steps-per-epoch); warm up for fewer steps than that"
        )
    if args.corpus is not None and not os.path.isdir(args.corpus):
        p.error(f"--corpus {args.corpus}: no such directory; pass a directory of text files (or leave it out)")
    check_mode_args(p, args)  # a bad mode setting stops here, before any worker starts
    return args


def default_corpus():
    """The running interpreter's standard library: ``(directory, directory names to skip)``."""
    return sysconfig.get_paths()["stdlib"], SKIPPED_DIRECTORIES


def read_text_files(directory, skip=()):
    """Every text file under ``directory`` (UTF-8 with no NUL byte, not empty), as
    ``{relative posix path: bytes}`` in path order; directories named in ``skip`` and
    ``__pycache__`` are not entered, and symbolic links are not followed."""
    files = {}
    for root, dirs, names in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in skip and d != "__pycache__")
        for name in sorted(names):
            path = os.path.join(root, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                data = f.read()
            if not data or b"\0" in data:
                continue
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            files[os.path.relpath(path, directory).replace(os.sep, "/")] = data
    return files


def held_out(relative_path, val_fraction):
    """Whether a file is in the validation split: a hash of its path, the same on every machine."""
    return zlib.crc32(relative_path.encode("utf-8")) / 2**32 < val_fraction


def split_corpus(files, val_fraction, directory="the corpus"):
    """``(train, validation)``: each split's files concatenated, as uint8 arrays; raises
    ``ValueError`` when a split is empty."""
    parts = {True: [], False: []}
    for path, data in files.items():
        parts[held_out(path, val_fraction)].append(data)
    if not parts[True] or not parts[False]:
        raise ValueError(
            f"{directory}: {len(files)} text files, {len(parts[False])} for training and {len(parts[True])} held "
            f"out at --val-fraction {val_fraction}; both splits need a file: point --corpus at a directory with "
            f"more text files, or change --val-fraction"
        )
    return tuple(np.frombuffer(b"".join(parts[k]), np.uint8) for k in (False, True))


def windows(stream, count, context, rng):
    """``count`` windows of ``context + 1`` bytes at random offsets of ``stream``: inputs and
    next-byte targets, int32 arrays of shape ``(count, context)``."""
    if len(stream) <= context + 1:
        raise ValueError(
            f"a split of {len(stream)} bytes holds no window of --context {context} + 1 bytes; use a larger "
            f"corpus or a shorter --context"
        )
    starts = rng.integers(0, len(stream) - context - 1, size=count)
    rows = stream[starts[:, None] + np.arange(context + 1)].astype(np.int32)
    return rows[:, :-1], rows[:, 1:]


class PositionEmbedding(keras.layers.Layer):
    """A learned vector per position, added to the token embeddings."""

    def __init__(self, context, width, **kwargs):
        super().__init__(**kwargs)
        self.context, self.width = context, width

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=(self.context, self.width), initializer=keras.initializers.RandomNormal(stddev=0.02), name="positions"
        )

    def call(self, x):
        return x + self.positions

    def get_config(self):
        return {**super().get_config(), "context": self.context, "width": self.width}


def build_model(args, total_steps):
    """The compiled decoder-only transformer (module docstring): logits over the 256 bytes."""
    tokens = keras.Input((args.context,), dtype="int32")
    x = keras.layers.Embedding(VOCABULARY, args.width)(tokens)
    x = PositionEmbedding(args.context, args.width)(x)
    for _ in range(args.layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.MultiHeadAttention(args.heads, args.width // args.heads)(h, h, use_causal_mask=True)
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-5)(x)
        h = keras.layers.Dense(4 * args.width, activation="gelu")(h)
        x = x + keras.layers.Dense(args.width)(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5)(x)
    model = keras.Model(tokens, keras.layers.Dense(VOCABULARY)(x))
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        decay_steps=total_steps - args.warmup_steps,
        alpha=0.1,
        warmup_target=args.lr,
        warmup_steps=args.warmup_steps,
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(schedule, weight_decay=args.weight_decay),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def loss_sum(model, x, y, batch_size=32):
    """The summed next-byte cross-entropy (nats) of ``model`` on ``(x, y)``, and the count of bytes."""
    total = 0.0
    for i in range(0, len(x), batch_size):
        logits = np.asarray(model.predict_on_batch(x[i : i + batch_size]), np.float64)
        top = logits.max(axis=-1, keepdims=True)
        log_norm = np.log(np.exp(logits - top).sum(axis=-1)) + top[..., 0]
        picked = np.take_along_axis(logits, y[i : i + batch_size, :, None], axis=-1)[..., 0]
        total += float(np.sum(log_norm - picked))
    return total, int(y.size)


class ValidationCurve(keras.callbacks.Callback):
    """After every epoch: this worker's loss on its held-out windows, the training time so far
    and this worker's bytes on the wire so far (``sent_so_far(epoch, logs)``).

    The training time runs from the end of the first step, which traces and compiles the train
    step (``first_step_s``: plain Horovod's takes about 10 s longer here than a tfsync mode's),
    and leaves the evaluations out."""

    def __init__(self, x_val, y_val, tokens_per_epoch, sent_so_far):
        super().__init__()
        self.x_val, self.y_val = x_val, y_val
        self.tokens_per_epoch, self.sent_so_far = tokens_per_epoch, sent_so_far

    def on_train_begin(self, logs=None):
        self.begin, self.start = time.time(), None
        self.evaluating_s = 0.0
        self.points = []  # [elapsed_s, tokens, loss sum, bytes, bytes sent]

    def on_train_batch_end(self, batch, logs=None):
        if self.start is None:
            self.start = time.time()
            self.first_step_s = self.start - self.begin

    def on_epoch_end(self, epoch, logs=None):
        now = time.time()
        elapsed_s = now - self.start - self.evaluating_s
        sent = self.sent_so_far(epoch, logs)
        total, count = loss_sum(self.model, self.x_val, self.y_val)
        self.evaluating_s += time.time() - now
        self.points.append([elapsed_s, (epoch + 1) * self.tokens_per_epoch, total, count, sent])

    def training_s(self):
        """Time since ``fit`` began, the evaluations left out."""
        return time.time() - self.start - self.evaluating_s


class EngineBytes:
    """This worker's bytes on the wire under ``SyncCallback``, over every engine of the run: the
    epoch logs' ``tfsync_bytes_sent`` (this worker's, with ``average_epoch_logs=False``), and
    at the end what the engine sent after the last epoch's logs (a final outer step)."""

    def __init__(self, sync):
        self.sync, self.logged, self._seen = sync, 0.0, (None, 0.0)

    def at_epoch_end(self, epoch, logs):
        self.logged += float(logs["tfsync_bytes_sent"])
        engine = self.sync.engine
        self._seen = (engine, engine.bytes["bytes_sent"])
        return self.logged

    def total(self):
        engine, then = self._seen
        return self.logged + (engine.bytes["bytes_sent"] - then if engine is self.sync.engine else 0.0)


def load_corpus(args, workers):
    """``(x_train, y_train, x_val, y_val, corpus description)``: the whole job's training windows,
    and every held-out window."""
    directory, skip = default_corpus() if args.corpus is None else (args.corpus, ())
    files = read_text_files(directory, skip)
    train, val = split_corpus(files, args.val_fraction, directory)
    sequences = workers * args.epochs * args.steps_per_epoch * args.batch_size
    x, y = windows(train, sequences, args.context, np.random.default_rng(args.seed))
    x_val, y_val = windows(val, args.val_sequences, args.context, np.random.default_rng(VALIDATION_SEED))
    about = {"corpus": directory, "files": len(files), "train_bytes": len(train), "val_bytes": len(val)}
    return x, y, x_val, y_val, about


def main(argv=None):
    args = parse_args(argv)
    hvd = init_horovod()
    import tfsync
    from tfsync.bench.baseline import ring_bytes
    from tfsync.launch import contribution_totals, describe_mode, mode_from_args, print_result

    rank, size = hvd.rank(), hvd.size()
    if args.val_sequences < size:
        sys.exit(
            f"--val-sequences {args.val_sequences}: each of the {size} workers evaluates a share of the held-out "
            f"windows; pass --val-sequences {size} or more"
        )
    x, y, x_val, y_val, about = load_corpus(args, size)
    x_local, y_local = tfsync.shard(x, y, batch_size=args.batch_size)
    x_val, y_val = x_val[rank::size], y_val[rank::size]
    steps = args.epochs * args.steps_per_epoch
    keras.utils.set_random_seed(args.seed)
    model = build_model(args, steps)

    stragglers = tfsync.Stragglers.parse(args.stragglers) if args.stragglers is not None else None
    tokens_per_epoch = size * args.steps_per_epoch * args.batch_size * args.context
    if args.plain_horovod:
        per_step = ring_bytes(model, size)["bytes_sent"]  # (one allreduce of every gradient a step)
        curve = ValidationCurve(
            x_val, y_val, tokens_per_epoch, lambda epoch, logs: per_step * args.steps_per_epoch * (epoch + 1)
        )
        callbacks, label = [plain_horovod_callback(model, hvd, stragglers), curve], "horovod"
    else:
        mode = mode_from_args(args)
        sync = tfsync.keras.SyncCallback(
            mode=mode, stragglers=stragglers, trace_dir=args.trace_dir, average_epoch_logs=False
        )
        sent = EngineBytes(sync)
        curve = ValidationCurve(x_val, y_val, tokens_per_epoch, sent.at_epoch_end)
        callbacks, label = [sync, curve], describe_mode(mode)

    model.fit(
        x_local,
        y_local,
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        shuffle=False,
        verbose=args.verbose if rank == 0 else 0,
        callbacks=callbacks,
    )
    wall_s = curve.training_s()
    tokens = steps * size * args.batch_size * args.context
    timed_tokens = (steps - 1) * size * args.batch_size * args.context  # (after the first step)
    if args.plain_horovod:
        bytes_sent, counts = per_step * steps, {"produced": steps * size, "applied": steps * size}
    else:
        bytes_sent = sent.total()
        counts = contribution_totals(hvd, sync.counts, args.batch_size, wall_s, samples=len(x_local) * size)
    # the validation loss over every held-out window: each worker's shares summed
    final = hvd.allgather_object(loss_sum(model, x_val, y_val))
    every = hvd.allgather_object(curve.points)
    val_loss = sum(t for t, _ in final) / sum(n for _, n in final)
    points = [[p[0], p[1], sum(w[i][2] for w in every) / sum(w[i][3] for w in every)] for i, p in enumerate(every[0])]
    result = {
        "mode": label,
        "workers": size,
        "parameters": model.count_params(),
        "model": {"layers": args.layers, "width": args.width, "heads": args.heads, "context": args.context},
        **about,
        "tokens": tokens,
        "wall_s": wall_s,
        "first_step_s": curve.first_step_s,
        "tokens_per_s": timed_tokens / wall_s,
        "ms_per_step": wall_s / (steps - 1) * 1e3,
        "val_loss": val_loss,
        "perplexity": math.exp(val_loss),
        "bits_per_byte": val_loss / math.log(2),
        "bytes_sent": bytes_sent,
        **counts,
        "curve": points,
        "curve_bytes_sent": [p[4] for p in curve.points],
        "replicas_identical": replicas_identical(model, hvd),
    }
    if rank == 0:
        print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
