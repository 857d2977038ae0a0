"""A round's bytes spread over the time it has: Streaming DiLoCo's fragments, paced.

An overlapped fragment's round (``tfsync.DiLoCo(fragments=P, overlap_steps=τ)``)
is not needed until ``τ`` inner steps after its push.  Sent at once, it crosses
the link at line rate and leaves the link idle for the rest of its window: the
link's peak rate is then its line rate whatever ``P`` is.  Paced, the round goes
in ``k`` pieces (about :data:`PIECE_BYTES` each on the wire, at most
:data:`MAX_PIECES`), the first at once and piece ``i`` no earlier than ``i/k``
of what is left of the window once the first is through, so the link carries
the fragment at about its size over its window, and with each of the ``P``
fragments in its own window the peak falls toward the period's average
(Douillard et al., 2025, count the bandwidth a fragment needs over its window
in the same way).

The pieces are the same on every rank: their number and bounds come from the
round's size alone (every rank runs the same collectives in the same order).
Only when a piece starts depends on the rank's own estimate of the window; a
collective starts when its last rank enters it, and the first piece's end,
when every rank has entered, is where each rank's schedule starts, so a rank
that pushed late does not find its pieces overdue.  A piece begins at a
multiple of ``size × 256`` values, so a quantized round's blocks of 256 values
(:mod:`tfsync.engine.wire.quantized`) are those of the whole round: a paced round
decodes to the bytes an unpaced one would.  When a worker needs the round
(its wait, a collective queued behind it, the exchange closing), the pieces
left go at once: pacing never holds a round someone is waiting for (the
``pause`` callable returns early then).
"""

import time

import numpy as np

PIECE_BYTES = 2 << 20  # a paced round goes in pieces of about this many bytes on the wire ...
MAX_PIECES = 8  # ... and at most this many (each piece is a collective of its own)
ALIGN_VALUES = 256  # a piece starts at a multiple of size x this many values (a quantized round's block)


def piece_bounds(values: int, wire_bytes: int, size: int) -> list:
    """``[(start, stop), ...]``: the pieces of a flat payload of ``values`` values whose round
    puts ``wire_bytes`` on the wire (each way), across ``size`` ranks (one piece when the
    round is small)."""
    count = min(MAX_PIECES, max(1, -(-int(wire_bytes) // PIECE_BYTES)))
    if count == 1:
        return [(0, values)]
    align = ALIGN_VALUES * max(size, 1)
    length = -(-values // count // align) * align
    return [(a, min(a + length, values)) for a in range(0, values, length)]


def payload_bytes(payload) -> int:
    """The bytes of ``payload``'s tensors: a round's bytes on the wire when nothing says otherwise."""
    import tensorflow as tf

    return sum(int(np.prod(t.shape, dtype=np.int64)) * tf.as_dtype(t.dtype).size for t in payload)


def paced_round(
    collective, payload, meta, spread_s: float, pause, size: int, wire_bytes: int, divisor=None, clock=time.monotonic
):
    """``collective(payload, meta, divisor=...)`` in pieces spread over ``spread_s`` seconds:
    ``(total, meta)`` as the collective returns them for the whole payload.

    ``wire_bytes``: what the whole round puts on the wire each way (its pieces are cut from
    that: a quantized round's are fewer).  ``pause(seconds)`` sleeps up to that long and
    returns False once the round is needed (no more pauses then).  A payload of several
    dtypes goes whole (its pieces would mix them), as does one small enough for a single
    piece.  Each piece's call gets ``part=i``, so a collective that keeps state per payload
    layout (4-bit error feedback) keeps one per piece.  ``clock``: seconds, monotonic (a test's
    own clock makes the schedule exact)."""
    import tensorflow as tf  # (here: the bounds above run without TensorFlow)

    kwargs = {} if divisor is None else {"divisor": divisor}
    dtypes = {tf.as_dtype(t.dtype) for t in payload}
    shapes = [tuple(t.shape) for t in payload]
    counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    values = sum(counts)
    if len(dtypes) != 1 or values == 0:
        return collective(payload, meta, **kwargs)
    bounds = piece_bounds(values, wire_bytes, size)
    if len(bounds) == 1:
        return collective(payload, meta, **kwargs)
    flat = tf.concat([tf.reshape(t, [-1]) for t in payload], 0)
    start, paced, outs = clock(), True, []
    for i, (a, b) in enumerate(bounds):
        if i == 1:  # (every rank has joined: the pieces left are due over what is left of the spread)
            joined = clock()
            left = spread_s - (joined - start)
        if i and paced:
            paced = pause(joined + left * i / len(bounds) - clock())
        total, meta_out = collective([flat[a:b]], meta, part=i, **kwargs)
        outs.append(tf.reshape(total[0], [-1]))
    whole = tf.concat(outs, 0)
    return [tf.reshape(p, s) for p, s in zip(tf.split(whole, counts), shapes)], meta_out


__all__ = ["MAX_PIECES", "PIECE_BYTES", "paced_round", "payload_bytes", "piece_bounds"]
