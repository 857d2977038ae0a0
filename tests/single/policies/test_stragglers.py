"""Straggler injection: parsing, validation, determinism."""

import pytest

from tfsync import Stragglers


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("TFSYNC_STRAGGLERS", raising=False)
    assert not Stragglers.from_env().enabled
    assert Stragglers().for_rank(0).next_delay_s() == 0.0


def test_parse_and_spec_round_trip():
    s = Stragglers.parse("base=0.02,slow=3:0.04,slow=1:0.01,rare=0.0016:4,jitter=0.005,seed=9")
    assert s.base_s == 0.02 and s.slow_ranks == ((1, 0.01), (3, 0.04))
    assert (s.rare_prob, s.rare_s, s.jitter_s, s.seed) == (0.0016, 4.0, 0.005, 9)
    assert Stragglers.parse(s.spec()) == s


def test_from_env(monkeypatch):
    monkeypatch.setenv("TFSYNC_STRAGGLERS", "slow=2:0.5")
    assert Stragglers.from_env().slow_ranks == ((2, 0.5),)


def test_fixed_delays_per_rank():
    s = Stragglers(base_s=0.02, slow_ranks={3: 0.04})
    assert s.for_rank(0).next_delay_s() == pytest.approx(0.02)
    assert s.for_rank(3).next_delay_s() == pytest.approx(0.06)


def test_same_seed_same_delays_in_every_launch():
    s = Stragglers(jitter_s=0.01, rare_prob=0.3, rare_s=1.0, seed=4)
    draw = lambda rank: [d.next_delay_s() for d in [s.for_rank(rank)] for _ in range(200)]  # noqa: E731
    a, b = draw(2), draw(2)
    assert a == b
    assert a != draw(1)  # ranks differ
    rare = sum(d >= 1.0 for d in a)
    assert 30 < rare < 90  # about 30% of 200
    assert all(0 <= d % 1.0 <= 0.01 for d in a)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("base=-1", "finite number of seconds"),
        ("slow=3", "bad straggler spec item 'slow=3'"),
        ("speed=2", "unknown key 'speed'"),
        ("base", "missing '='"),
        ("rare=2:1", "probability"),
        ("slow=-1:0.1", "negative"),
    ],
)
def test_bad_specs_explain_the_syntax(spec, match):
    with pytest.raises(ValueError, match=match):
        Stragglers.parse(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "base=0.02,seed=1",
        "base=0.02,slow=1:0.04",
        "base=0.02,jitter=0.04,seed=3",
        "base=0.02,rare=0.3:0.5,seed=2",
        "base=0.01,jitter=0.02,rare=0.2:1,slow=1:0.01,seed=5",
    ],
)
def test_delays_at_once_are_the_per_step_sequence(spec):
    # the simulator draws a rank's delays in one call: the same values, in the same order
    config = Stragglers.parse(spec)
    for rank in range(3):
        one_by_one = config.for_rank(rank)
        at_once = config.for_rank(rank)
        expected = [one_by_one.next_delay_s() for _ in range(50)]
        assert at_once.next_delays_s(20).tolist() + at_once.next_delays_s(30).tolist() == expected
