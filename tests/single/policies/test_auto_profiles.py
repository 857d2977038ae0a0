"""Auto mode: the profile classifier on synthetic iteration times, and its settings."""

import numpy as np
import pytest

import tfsync
from tfsync.policies import auto
from tfsync.policies.auto import EARLY_STEPS, PROFILES, classify, early

BASE_S = 0.022  # 20 ms of simulated device time plus a little compute


def times(workers=4, steps=40, seed=0, slow=None, factor=1.0, jitter_s=0.0, rare=(), noise_s=0.001):
    """Per-worker step times: base + noise, worker ``slow`` ``factor`` times slower, uniform jitter,
    and ``rare``: (worker, step, seconds) delays."""
    rng = np.random.default_rng(seed)
    t = BASE_S + rng.normal(0.0, noise_s, size=(workers, steps)).clip(-0.002, 0.002)
    t += rng.uniform(0.0, jitter_s, size=t.shape)
    if slow is not None:
        t[slow] *= factor
    for w, k, extra in rare:
        t[w, k] += extra
    return t.tolist()


@pytest.mark.parametrize("seed", range(5))
def test_the_five_bench_scenarios_are_told_apart(seed):
    # the specs of python -m tfsync.bench convergence, as step times
    assert classify(times(seed=seed)).name == "none"
    assert classify(times(seed=seed, slow=3, factor=(0.022 + 0.04) / 0.022)).name == "straggler"
    assert classify(times(seed=seed, slow=3, factor=2.0)).name == "heterogeneous"
    assert classify(times(seed=seed, jitter_s=0.04)).name == "jitter"
    assert classify(times(seed=seed, rare=[(1, 7, 0.5), (2, 30, 0.5)])).name == "rare"


def test_the_slowest_worker_and_the_numbers_are_reported():
    p = classify(times(slow=2, factor=3.0))
    assert p.name == "straggler" and p.slowest == 2 and p.slowest_ratio == pytest.approx(3.0, rel=0.1)
    assert "worker 2" in p.reason and p.steps == 40
    r = classify(times(rare=[(0, 3, 0.5)]))
    assert r.rare_fraction == pytest.approx(1 / 160) and "1 of 160 steps" in r.reason


def test_thresholds_are_where_the_docstring_says():
    just_below = classify(times(slow=1, factor=auto.HETEROGENEOUS_RATIO * 0.97, noise_s=0.0))
    just_above = classify(times(slow=1, factor=auto.HETEROGENEOUS_RATIO * 1.03, noise_s=0.0))
    assert just_below.name == "none" and just_above.name == "heterogeneous"
    assert classify(times(slow=1, factor=auto.STRAGGLER_RATIO * 1.03, noise_s=0.0)).name == "straggler"
    # a step of 0.9 x RARE_FACTOR times the median is not a rare delay; 1.1 x is
    below, above = (f * auto.RARE_FACTOR - 1 for f in (0.9, 1.1))
    assert classify(times(rare=[(0, 3, below * BASE_S)], noise_s=0.0)).name == "none"
    assert classify(times(rare=[(0, 3, above * BASE_S)], noise_s=0.0)).name == "rare"


def test_frequent_large_delays_are_jitter_not_rare():
    delays = [(w, k, 0.4) for w in range(4) for k in range(0, 40, 5)]  # 20% of the steps
    p = classify(times(rare=delays))
    assert p.rare_fraction > auto.RARE_MAX_FRACTION and p.name == "jitter"


def test_the_slow_worker_is_measured_against_the_fastest():
    # with 2 workers a median of the medians would be their mean, and a 3x worker only 1.5x it
    assert classify(times(workers=2, slow=1, factor=3.0)).name == "straggler"
    assert classify(times(workers=2, slow=1, factor=2.0)).name == "heterogeneous"
    # half the cluster on slower devices
    assert classify(times(workers=4, slow=slice(2, 4), factor=2.0)).name == "heterogeneous"


@pytest.mark.parametrize("seed", range(5))
def test_a_persistently_slow_worker_is_found_after_the_early_steps(seed):
    n = EARLY_STEPS
    straggler = early(times(seed=seed, steps=n, slow=3, factor=(0.022 + 0.04) / 0.022))
    heterogeneous = early(times(seed=seed, steps=n, slow=3, factor=2.0))
    assert straggler.name == "straggler" and straggler.slowest == 3 and straggler.steps == n
    assert heterogeneous.name == "heterogeneous" and f"each of the first {n} measured steps" in heterogeneous.reason
    # too few steps yet, or no persistent slowness: wait for the full window
    assert early(times(seed=seed, steps=n - 1, slow=3, factor=3.0)) is None
    assert early(times(seed=seed, steps=n)) is None
    assert early(times(seed=seed, steps=n, jitter_s=0.04)) is None
    assert early(times(seed=seed, steps=n, rare=[(1, 2, 0.5)])) is None


def test_an_early_decision_needs_the_same_worker_slowest_in_every_step():
    table = times(steps=8, slow=2, factor=2.0, noise_s=0.0)
    assert early(table).slowest == 2
    table[0][5] = 0.2  # one step in which another worker was slower: not persistent yet
    assert classify(table).name == "heterogeneous" and early(table) is None
    # one worker slowest in every step by chance, but by less than HETEROGENEOUS_RATIO: none
    assert early(times(steps=8, slow=2, factor=1.1, noise_s=0.0)) is None
    assert early([[0.1] * 8]) is None and early([]) is None


def test_classify_is_a_pure_function_of_the_table():
    table = times(seed=3, jitter_s=0.03)
    assert classify(table) == classify([list(t) for t in table])


@pytest.mark.parametrize(
    "table,match",
    [
        ([[0.1, 0.1]], "at least 2 workers"),
        ([[0.1], []], "at least one step"),
        ([[0.1, -1.0], [0.1, 0.1]], "non-negative"),
        ([[0.1, float("nan")], [0.1, 0.1]], "non-negative"),
    ],
)
def test_classify_refuses_bad_tables(table, match):
    with pytest.raises(ValueError, match=match):
        classify(table)


def test_auto_defaults_cover_every_profile_with_a_real_mode():
    a = tfsync.Auto()
    assert set(a.modes) == set(PROFILES)
    assert all(isinstance(m, tfsync.Policy) for m in a.modes.values())
    assert a.initial == tfsync.BSP()
    assert tfsync.policies.resolve_mode("auto") == a and tfsync.policies.resolve_mode(" AUTO ") == a
    b = tfsync.Auto(modes={"straggler": tfsync.PSP()})
    assert b.modes["straggler"] == tfsync.PSP() and b.modes["none"] == a.modes["none"]
    assert b.config()["modes"]["straggler"]["mode"] == "psp"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(modes={"slow": tfsync.BSP()}), r"unknown profiles \['slow'\]"),
        (dict(modes={"jitter": "ssp"}), r"modes\['jitter'\]='ssp' is not a synchronization mode"),
        (dict(initial=tfsync.Auto()), "initial=.* is not a synchronization mode"),
        (dict(window_steps=0), "window_steps=0 must be an integer >= 1"),
        (dict(confirm=1.5), "confirm=1.5 must be an integer >= 1"),
    ],
)
def test_bad_auto_settings_fail_with_what_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfsync.Auto(**kwargs)


def test_auto_is_refused_where_only_a_fixed_mode_works():
    with pytest.raises(ValueError, match="only tfsync.keras.SyncCallback"):
        tfsync.policies.resolve("auto")
    with pytest.raises(ValueError, match="only tfsync.keras.SyncCallback"):
        tfsync.policies.resolve(tfsync.Auto())


def test_a_new_profile_takes_over_only_after_confirm_decisions_in_a_row():
    a = tfsync.Auto(confirm=2)
    state = (None, 0)
    current, state = a.in_force(None, state, "straggler")  # the first decision takes it at once
    assert current == "straggler"
    observed = ["jitter", "straggler", "jitter", "jitter", "jitter", "none", "jitter"]
    in_force = []
    for o in observed:
        current, state = a.in_force(current, state, o)
        in_force.append(current)
    # one odd epoch does not flip it; two in a row do; the new one holds until confirmed again
    assert in_force == ["straggler", "straggler", "straggler", "jitter", "jitter", "jitter", "jitter"]
    one = tfsync.Auto(confirm=1)
    assert one.in_force("none", ("none", 5), "rare")[0] == "rare"
