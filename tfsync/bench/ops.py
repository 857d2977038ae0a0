"""Benchmark of the fused ops in :mod:`tfsync.ops` against the same math composed
from stock TensorFlow ops, eagerly and under XLA (``tf.function(jit_compile=True)``).

``python -m tfsync.bench ops [--json PATH] [--repeats N] [--sizes N ...]``

The ops are memory-bound streams, so each record carries the bytes the op must move
(reads + writes of the fused version) and the bandwidth that implies, next to the
machine's copy bandwidth measured in the same run (``np.copyto`` of the same number
of float32 elements into a preallocated buffer: one read and one write per element).
Timings are the median of ``--repeats`` calls after warm-up, the implementations
of an op (and the copy) timed round-robin, with TensorFlow's default thread settings.
``fused_result_held`` is the fused op called while the caller still holds its
previous result, so that its output buffer cannot be reused and is freshly
allocated on every call. Ops: DC-ASGD-c / DC-ASGD-a delay compensation and the
"updates" protocol's push and round application (whose reference the protocol
ran before the kernels: its eager row is the apply's old path, its XLA row the push's).
"""

import argparse
import json
import statistics
import time

import numpy as np

FLOAT32_BYTES = 4
DC_LAMBDA = 0.04
DCA_LAMBDA0, DCA_MOMENTUM, DCA_EPSILON = 2.0, 0.95, 1e-7


def _parse_size(text):
    """Element counts like 1048576, 1M or 16M (M = 2**20, K = 2**10)."""
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper()
    try:
        if text and text[-1] in units:
            return int(text[:-1]) * units[text[-1]]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected an element count like 1048576, 1M or 16M") from None


def _interleaved_medians(fns, repeats, warmup):
    """Median seconds of each callable, timed round-robin.

    Interleaving the implementations of one op (and the copy) spreads any load from
    other processes over all of them instead of penalizing whichever ran during it.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class _HoldingResult:
    """Calls fn, keeping each result alive until the next call has returned.

    The kernels reuse their previous output buffer once it is released; a caller
    that still holds it makes every call allocate (and page-fault in) a fresh one.
    This variant shows that cost. It is timed in a group of its own (with the copy)
    and released afterwards: interleaved with the plain fused calls, which run the
    same kernel instance, it would hold the buffer they reuse.
    """

    def __init__(self, fn):
        self._fn = fn
        self._held = None

    def __call__(self):
        self._held = self._fn()

    def release(self):
        self._held = None


def _cases(tf, ops, n):
    """(op, bytes moved, {impl: callable}) for every benchmarked op at n elements."""
    rng = np.random.default_rng(0)
    g = tf.constant(rng.standard_normal(n, dtype=np.float32))
    w_now = tf.constant(rng.standard_normal(n, dtype=np.float32))
    w_stale = tf.constant(rng.standard_normal(n, dtype=np.float32))
    lam = tf.constant(DC_LAMBDA, tf.float32)
    cases = []

    def dc_composed(g, w_now, w_stale, lam):
        return g + lam * g * g * (w_now - w_stale)

    dc_xla = tf.function(dc_composed, jit_compile=True)
    cases.append(
        (
            "delay_compensate",
            4 * n * FLOAT32_BYTES,
            {
                "fused": lambda: ops.delay_compensate(g, w_now, w_stale, lam),
                "composed_eager": lambda: dc_composed(g, w_now, w_stale, lam),
                "composed_xla": lambda: dc_xla(g, w_now, w_stale, lam),
            },
        )
    )

    v_fused = tf.Variable(tf.zeros(n, tf.float32))
    v_eager = tf.Variable(tf.zeros(n, tf.float32))
    v_xla = tf.Variable(tf.zeros(n, tf.float32))
    lambda0 = tf.constant(DCA_LAMBDA0)
    momentum = tf.constant(DCA_MOMENTUM)
    epsilon = tf.constant(DCA_EPSILON)

    def dca_composed(g, w_now, w_stale, v):
        gg = g * g
        v_new = momentum * v + (1.0 - momentum) * gg
        v.assign(v_new)
        return g + lambda0 / tf.sqrt(v_new + epsilon) * gg * (w_now - w_stale)

    dca_xla = tf.function(dca_composed, jit_compile=True)
    # Reads g, w_now, w_stale, v; writes v and the result.
    cases.append(
        (
            "delay_compensate_adaptive",
            6 * n * FLOAT32_BYTES,
            {
                "fused": lambda: ops.delay_compensate_adaptive(g, w_now, w_stale, v_fused, lambda0, momentum, epsilon),
                "composed_eager": lambda: dca_composed(g, w_now, w_stale, v_eager),
                "composed_xla": lambda: dca_xla(g, w_now, w_stale, v_xla),
            },
        )
    )

    # The "updates" protocol's state updates (SSP, DSSP, ElasticBSP), against their
    # reference (the TensorFlow ops the protocol ran before): eager, and under XLA as
    # the protocol compiled the push.  Each implementation updates its own variables.
    from tfsync.ops import _reference

    size = tf.constant(4.0)
    total = tf.constant(rng.standard_normal(n, dtype=np.float32) * 0.01)

    def variables():
        return [tf.Variable(tf.constant(rng.standard_normal(n, dtype=np.float32))) for _ in range(3)]

    push_vars = {impl: variables() for impl in ("fused", "composed_eager", "composed_xla")}
    push_xla = tf.function(lambda: _reference.update_push_share(*push_vars["composed_xla"], size), jit_compile=True)
    # Reads the variable, w_bar and pending; writes the share, pending and the variable.
    cases.append(
        (
            "update_push_share",
            6 * n * FLOAT32_BYTES,
            {
                "fused": lambda: ops.update_push_share(*push_vars["fused"], size),
                "composed_eager": lambda: _reference.update_push_share(*push_vars["composed_eager"], size),
                "composed_xla": push_xla,
            },
        )
    )
    apply_vars = {impl: variables() for impl in ("fused", "composed_eager", "composed_xla")}

    def apply_composed(v, w, p, t, own):  # the reference's float path, as XLA sees it
        w.assign(w + t)
        p.assign(p - own)
        v.assign(w + p)

    apply_xla = tf.function(lambda: apply_composed(*apply_vars["composed_xla"], total, g), jit_compile=True)
    # Reads w_bar, pending, the round's total and the own share; writes the three variables.
    cases.append(
        (
            "update_apply_round",
            7 * n * FLOAT32_BYTES,
            {
                "fused": lambda: ops.update_apply_round(*apply_vars["fused"], total, g),
                "composed_eager": lambda: _reference.update_apply_round(*apply_vars["composed_eager"], total, g),
                "composed_xla": apply_xla,
            },
        )
    )
    return cases


# ops with no output: nothing for a caller to hold (no fused_result_held row)
NO_OUTPUT = ("update_apply_round",)


def run(sizes, repeats, warmup):
    """Runs the benchmark and returns its records (dicts, JSON-ready)."""
    import tensorflow as tf

    from tfsync import ops

    ops.set_implementation("compiled")
    records = []

    def record(op, n, impl, seconds, nbytes):
        records.append(
            {
                "op": op,
                "elements": n,
                "impl": impl,
                "seconds": seconds,
                "bytes": nbytes,
                "gbytes_per_s": nbytes / seconds / 1e9,
            }
        )

    for n in sizes:
        src = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
        dst = np.empty_like(src)
        copy_seconds = []
        first_of_size = len(records)
        for op, nbytes, impls in _cases(tf, ops, n):
            copy = lambda dst=dst, src=src: np.copyto(dst, src)
            medians = _interleaved_medians(dict(impls, copy=copy), repeats, warmup)
            copy_seconds.append(medians.pop("copy"))
            held_medians = {}
            if op not in NO_OUTPUT:
                held = _HoldingResult(impls["fused"])
                held_medians = _interleaved_medians({"fused_result_held": held, "copy": copy}, repeats, warmup)
                held.release()
                copy_seconds.append(held_medians.pop("copy"))
            for impl, seconds in {**medians, **held_medians}.items():
                record(op, n, impl, seconds, nbytes)
        # The copy ran beside every op; its median over those runs is the reference.
        record("copy", n, "numpy_copyto", statistics.median(copy_seconds), 2 * n * FLOAT32_BYTES)
        records.insert(first_of_size, records.pop())
    return records


def format_table(records):
    """A Markdown table: one row per record, with each op's speed relative to fused."""
    fused = {(r["op"], r["elements"]): r["seconds"] for r in records if r["impl"] == "fused"}
    copy = {r["elements"]: r["gbytes_per_s"] for r in records if r["op"] == "copy"}
    lines = [
        "| op | elements | impl | ms | GB/s | of copy GB/s | fused speedup |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in records:
        base = fused.get((r["op"], r["elements"]))
        speedup = f"{r['seconds'] / base:.2f}x" if base and r["impl"] != "fused" else ""
        lines.append(
            f"| {r['op']} | {r['elements']:,} | {r['impl']} | {r['seconds'] * 1e3:.2f} | "
            f"{r['gbytes_per_s']:.1f} | {r['gbytes_per_s'] / copy[r['elements']]:.2f} | "
            f"{speedup} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tfsync.bench ops",
        description="Time tfsync's fused ops against composed stock TensorFlow ops (eager and "
        "XLA) and the machine's copy bandwidth.",
    )
    parser.add_argument("--json", metavar="PATH", help="write the records as a JSON list here")
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed calls per case; the median is reported (default 15)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    parser.add_argument(
        "--sizes",
        type=_parse_size,
        nargs="+",
        default=[1 << 20, 16 << 20],
        help="float32 elements per tensor, e.g. 1M 16M (default)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("expected --repeats >= 1 and --warmup >= 0")
    records = run(args.sizes, args.repeats, args.warmup)
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0
