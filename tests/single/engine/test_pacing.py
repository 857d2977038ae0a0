"""Paced rounds (:mod:`tfsync.engine.wire.pacing`): DiLoCo's overlapped fragments spread their bytes
over their overlap window in pieces that are the same on every rank, decode to what an unpaced
round decodes, and go at once when the round is needed."""

import threading
import time
import types

import numpy as np
import pytest
import tensorflow as tf
from fake_cluster import FakeCluster, assert_no_errors, on_threads
from hypothesis import given, settings
from hypothesis import strategies as st

import tfsync
from tfsync.engine.exchange import RoundExchange
from tfsync.engine.protocols import outer
from tfsync.engine.protocols.outer import OuterStepProtocol
from tfsync.engine.wire import pacing
from tfsync.engine.wire.horovod import horovod_collective
from tfsync.engine.wire.layout import META_COLUMNS
from tfsync.engine.wire.quantized import quantized_collective


@settings(max_examples=200, deadline=None)
@given(values=st.integers(1, 1 << 24), itemsize=st.sampled_from([1, 2, 4, 8]), size=st.integers(1, 64))
def test_the_pieces_cover_the_payload_in_aligned_bounds(values, itemsize, size):
    bounds = pacing.piece_bounds(values, values * itemsize, size)
    assert 1 <= len(bounds) <= pacing.MAX_PIECES
    assert bounds[0][0] == 0 and bounds[-1][1] == values
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    if len(bounds) > 1:
        assert all(a % (pacing.ALIGN_VALUES * size) == 0 for a, _ in bounds)
    if values * itemsize <= pacing.PIECE_BYTES:
        assert bounds == [(0, values)]


def doubling(calls):
    """A collective that doubles its payload and records each call's piece."""

    def collective(payload, meta, divisor=None, part=None):
        calls.append((part, [tuple(t.shape) for t in payload]))
        return [t * 2 for t in payload], meta

    return collective


def test_a_paced_round_goes_in_pieces_at_their_times_and_returns_the_whole_result(monkeypatch):
    monkeypatch.setattr(pacing, "PIECE_BYTES", 4 * 1000)
    payload = [tf.reshape(tf.range(6000, dtype=tf.float32), [60, 100]), tf.range(50, dtype=tf.float32)]
    calls, pauses = [], []

    def pause(seconds):
        pauses.append(seconds)
        return True

    total, meta = pacing.paced_round(
        doubling(calls), payload, "meta", 8.0, pause, size=2, wire_bytes=4 * 6050, clock=lambda: 100.0
    )
    assert meta == "meta"
    for t, p in zip(total, payload):
        np.testing.assert_array_equal(t.numpy(), 2 * p.numpy())
    k = len(calls)
    assert k == len(pacing.piece_bounds(6050, 4 * 6050, 2)) > 1 and [part for part, _ in calls] == list(range(k))
    assert sum(shape[0][0] for _, shape in calls) == 6050
    # piece i waits until i/k of the spread after the round began (no time went by on this clock)
    assert pauses == pytest.approx([8.0 * i / k for i in range(1, k)])


def test_once_the_round_is_needed_the_pieces_left_go_without_pausing(monkeypatch):
    monkeypatch.setattr(pacing, "PIECE_BYTES", 4 * 1000)
    calls, pauses = [], []

    def pause(seconds):
        pauses.append(seconds)
        return False  # (needed now)

    pacing.paced_round(doubling(calls), [tf.zeros([10_000])], None, 60.0, pause, size=1, wire_bytes=40_000)
    assert len(calls) > 2 and len(pauses) == 1


@pytest.mark.parametrize(
    "payload", [[tf.zeros([10], tf.float32)], [tf.zeros([5000], tf.float32), tf.zeros([5000], tf.float64)]]
)
def test_a_small_payload_or_one_of_several_dtypes_goes_whole(monkeypatch, payload):
    monkeypatch.setattr(pacing, "PIECE_BYTES", 4 * 1000)
    calls = []
    pacing.paced_round(doubling(calls), payload, None, 1.0, lambda s: True, size=2, wire_bytes=80_000)
    assert calls == [(None, [tuple(t.shape) for t in payload])]


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_a_paced_round_decodes_to_the_bytes_of_an_unpaced_one(monkeypatch, quantize):
    """Pieces start at block bounds: three rounds (4-bit: error feedback carried between them)
    give every rank the same bytes, paced or not."""
    monkeypatch.setattr(pacing, "PIECE_BYTES", 4 * 2048)
    size, shapes = 2, [(70, 100), (33,)]
    rng = np.random.default_rng(0)
    data = [[[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(size)] for _ in range(3)]

    def run(paced):
        fake = FakeCluster(size, timeout_s=30)

        def rank(r):
            c = fake.rank(r)
            ops = c.wire_ops()
            collective = (
                horovod_collective(True, hvd=ops) if quantize is None else quantized_collective(quantize, True, hvd=ops)
            )
            meta = np.zeros((size, META_COLUMNS))
            meta[r, 0] = 1.0
            out = []
            for payload in data:
                tensors = [tf.constant(p) for p in payload[r]]
                if paced:
                    total, _ = pacing.paced_round(collective, tensors, meta, 0.01, lambda s: True, size, 4 * 7033)
                else:
                    total, _ = collective(tensors, meta)
                out.append([t.numpy() for t in total])
            return out

        results, errors = on_threads([lambda r=r: rank(r) for r in range(size)], 60)
        assert_no_errors(errors)
        return results

    whole, paced = run(False), run(True)
    for r in range(size):
        for a_round, b_round in zip(whole[r], paced[r]):
            for a, b in zip(a_round, b_round):
                assert a.tobytes() == b.tobytes()


def test_the_exchange_paces_a_round_until_someone_waits_for_it(monkeypatch):
    """A round spread over 60 s is taken at once when the training thread waits for it (the
    wait's 10-s bound would run out otherwise); a round nobody waits for pauses."""
    monkeypatch.setattr(pacing, "PIECE_BYTES", 4 * 1000)
    calls = []
    exchange = RoundExchange(doubling(calls), rank=0, size=1, t0=0.0)
    exchange.spread_s = lambda: 60.0
    exchange.submit(0, [tf.ones([8000])], 0.0, 0.0)
    assert exchange.wait(0, timeout_s=10), "the waited-for round was still paced"
    np.testing.assert_array_equal(exchange.pop(0).total[0].numpy(), np.full(8000, 2.0))
    assert len(calls) > 1
    exchange.submit(1, [tf.ones([8000])], 0.0, 0.0)
    time.sleep(0.5)
    assert exchange.completed == 0  # (round 1 pauses: its second piece is due 7.5 s after its first)
    done = threading.Event()
    threading.Thread(target=lambda: (exchange.wait(1, timeout_s=10), done.set()), daemon=True).start()
    assert done.wait(15) and exchange.completed == 1
    exchange.close()


def test_a_collective_queued_behind_a_paced_round_hurries_it(monkeypatch):
    monkeypatch.setattr(pacing, "PIECE_BYTES", 4 * 1000)
    exchange = RoundExchange(doubling([]), rank=0, size=1, t0=0.0)
    exchange.spread_s = lambda: 60.0
    exchange.submit(0, [tf.ones([8000])], 0.0, 0.0)
    assert exchange.call(lambda: "after", timeout_s=10) == "after"
    assert exchange.completed == 0
    exchange.close()


def test_only_overlapped_fragments_are_paced_and_their_spread_follows_the_inner_steps(monkeypatch):
    variables = [tf.Variable(tf.zeros([64, 8])), tf.Variable(tf.zeros([8]))]

    def Engine():  # noqa: N802
        return types.SimpleNamespace(wait_timeout_s=40.0, exchange=types.SimpleNamespace(spread_s=None))

    for mode, paced in [
        (tfsync.DiLoCo(inner_steps=8, fragments=4, overlap_steps=1), True),
        (tfsync.DiLoCo(inner_steps=8, fragments=4), False),
        (tfsync.DiLoCo(inner_steps=8, overlap_steps=2), False),
    ]:
        engine = Engine()
        protocol = OuterStepProtocol(variables, 2, mode)
        protocol.bind(engine)
        assert (engine.exchange.spread_s is not None) == paced

    def spreads(wait_timeout_s):
        """Each pushed round's spread, as the exchange takes them in push order."""
        clock = iter([100.0, 100.5, 101.0, 101.5, 103.5])
        monkeypatch.setattr(outer, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
        protocol = OuterStepProtocol(variables, 2, tfsync.DiLoCo(inner_steps=16, fragments=4, overlap_steps=3))
        engine = Engine()
        engine.wait_timeout_s = wait_timeout_s
        protocol.bind(engine)
        protocol.contribution([])  # (pushed before any inner step was timed: sent at once)
        for _ in range(5):
            protocol.end_inner_step(True)  # (intervals 0.5, 0.5, 0.5, 2.0: median 0.5)
        protocol.contribution([])
        protocol.push_final()
        protocol.contribution([])  # (the last round of the whole model: waited for at once)
        return [engine.exchange.spread_s() for _ in range(4)]

    assert spreads(40.0) == [None, pytest.approx(0.8 * 3 * 0.5), None, None]
    assert spreads(2.0) == [None, pytest.approx(0.5), None, None]  # (a quarter of the wait bound at most)


def test_the_pieces_after_the_first_are_due_over_what_is_left_once_every_rank_has_joined(monkeypatch):
    """A rank whose first piece waited (its peers pushed later) spreads the rest over what is left
    of its spread, from when the first piece came through."""
    monkeypatch.setattr(pacing, "PIECE_BYTES", 4 * 1000)
    pauses = []

    now = [0.0]  # the test's clock: only the first piece's wait for the peers moves it

    def late_peers(payload, meta, divisor=None, part=None):
        if part == 0:
            now[0] += 0.5
        return payload, meta

    def pause(seconds):
        pauses.append(seconds)
        return True

    pacing.paced_round(
        late_peers, [tf.zeros([8000])], None, 2.5, pause, size=1, wire_bytes=32_000, clock=lambda: now[0]
    )
    k = len(pauses) + 1
    assert k > 2
    # (the 2.0 s left once the first piece came through, 0.5 s into the 2.5)
    assert pauses == pytest.approx([2.0 * i / k for i in range(1, k)])
