"""PSP's and backup workers' ``close_round`` as pure functions (hypothesis over arrival orders,
clocks and sizes 1..16), and their argument checks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfsync.policies import BSP, PSP, SSP, BackupWorkers, Closing, DelayCompensation
from tfsync.policies.partial import ADAPTIVE_PUSH_TIMEOUT_FRACTION


@st.composite
def arrivals(draw, max_size=16):
    """``(size, ready, opened_s)``: some ranks in a random order, at non-decreasing times."""
    size = draw(st.integers(1, max_size))
    order = draw(st.permutations(range(size)))
    k = draw(st.integers(0, size))
    opened_s = draw(st.floats(0.0, 1e4, allow_nan=False))
    gaps = draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=k, max_size=k))
    ready, t = [], opened_s
    for rank, gap in zip(order[:k], gaps):
        t += gap
        ready.append((rank, t))
    return size, tuple(ready), opened_s


def _first_close(policy, ready, opened_s, size):
    """What a coordinator sees: ask on every arrival and at every recheck time;
    ``(closing, how many had arrived, now)`` of the first closing, or None."""
    for k in range(len(ready) + 1):
        now = ready[k - 1][1] if k else opened_s
        nxt = ready[k][1] if k < len(ready) else float("inf")
        while True:
            decision = policy.close_round(ready[:k], opened_s, now, size)
            if decision.accepted is not None:
                return decision, k, now
            if decision.recheck_s is None or decision.recheck_s >= nxt:
                break
            assert decision.recheck_s > now, "a recheck time must lie in the future"
            now = decision.recheck_s
    return None


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_psp_closes_iff_everyone_or_c_and_the_timeout(case, data):
    size, ready, opened_s = case
    c = data.draw(st.one_of(st.none(), st.integers(1, size)), label="min_contributions")
    timeout = data.draw(st.one_of(st.none(), st.floats(0.0, 5.0, allow_nan=False)), label="push_timeout_s")
    policy = PSP(min_contributions=c, push_timeout_s=timeout)
    policy.validate(size)
    last = ready[-1][1] if ready else opened_s
    now = last + data.draw(st.floats(0.0, 20.0, allow_nan=False), label="now - last arrival")
    decision = policy.close_round(ready, opened_s, now, size)
    assert isinstance(decision, Closing)

    need = c if c is not None else max(1, size - 1)
    assert policy.contributions_needed(size) == need
    ranks = tuple(sorted(r for r, _ in ready))
    if len(ready) == size:  # everyone's contribution is in: no reason to wait, whatever the clock
        assert decision == Closing(ranks)
        return
    if len(ready) < need:
        assert decision == Closing()  # only a new arrival can change this: no recheck
        return
    t_c = sorted(t for _, t in ready)[need - 1]
    wait = timeout if timeout is not None else ADAPTIVE_PUSH_TIMEOUT_FRACTION * (t_c - opened_s)
    if now >= t_c + wait:
        assert decision.accepted == ranks and len(decision.accepted) >= need
    else:
        assert decision.accepted is None
        assert decision.recheck_s == pytest.approx(t_c + wait, rel=1e-12, abs=1e-9)
        # asked again at the recheck time, with nobody new: it closes with the same ranks
        again = policy.close_round(ready, opened_s, decision.recheck_s, size)
        assert again.accepted == ranks


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_psp_as_a_coordinator_runs_it_accepts_everything_ready_and_at_least_c(case, data):
    size, ready, opened_s = case
    c = data.draw(st.integers(1, size), label="min_contributions")
    timeout = data.draw(st.one_of(st.none(), st.floats(0.0, 5.0, allow_nan=False)), label="push_timeout_s")
    found = _first_close(PSP(min_contributions=c, push_timeout_s=timeout), ready, opened_s, size)
    if len(ready) < c:
        assert found is None  # fewer than c contributions never close a round
        return
    assert found is not None  # c contributions and the clock always close it eventually
    decision, k, now = found
    assert decision.accepted == tuple(sorted(r for r, _ in ready[:k]))  # every one ready by then
    assert c <= len(decision.accepted) <= size and k >= c
    if timeout == 0.0:  # push_timeout_s=0: exactly at the c-th contribution, with exactly c
        assert (k, len(decision.accepted)) == (c, c)


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_psp_with_zero_timeout_closes_at_the_cth_arrival_exactly(case, data):
    size, ready, opened_s = case
    c = data.draw(st.integers(1, size))
    policy = PSP(min_contributions=c, push_timeout_s=0.0)
    for k in range(len(ready) + 1):
        now = ready[k - 1][1] if k else opened_s
        decision = policy.close_round(ready[:k], opened_s, now, size)
        assert (decision.accepted is not None) == (k >= c)


def test_psp_adaptive_timeout_is_a_tenth_of_the_rounds_own_iteration_time():
    policy = PSP(min_contributions=2)  # push_timeout_s=None: adaptive
    ready = ((3, 11.0), (1, 12.0))  # the 2nd contribution 2 s after the round opened at 10 s
    decision = policy.close_round(ready, 10.0, 12.0, 4)
    assert decision.accepted is None and decision.recheck_s == pytest.approx(12.2)
    assert policy.close_round(ready, 10.0, 12.19, 4).accepted is None
    assert policy.close_round(ready, 10.0, 12.2, 4).accepted == (1, 3)
    late = ready + ((0, 12.1),)  # arrives within the timeout: it counts
    assert policy.close_round(late, 10.0, 12.2, 4).accepted == (0, 1, 3)
    # everyone ready: closes at once, no timeout
    assert policy.close_round(late + ((2, 12.15),), 10.0, 12.15, 4).accepted == (0, 1, 2, 3)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 16), st.data())
def test_psp_adaptive_recheck_time(size, data):
    # PSP() defaults: c = size - 1 and the adaptive timeout, asked at the c-th arrival
    order = data.draw(st.permutations(range(size)))
    opened_s = data.draw(st.floats(0.0, 1e4, allow_nan=False))
    times = sorted(
        data.draw(
            st.lists(st.floats(opened_s, opened_s + 100.0, allow_nan=False), min_size=size - 1, max_size=size - 1)
        )
    )
    ready = tuple(zip(order, times))
    t_c = times[-1]
    decision = PSP().close_round(ready, opened_s, t_c, size)
    wait = 0.1 * (t_c - opened_s)
    accepted = tuple(sorted(order[:-1]))
    if t_c + wait > t_c:
        assert decision.accepted is None
        assert decision.recheck_s == pytest.approx(t_c + wait, rel=1e-12, abs=1e-9)
        assert PSP().close_round(ready, opened_s, decision.recheck_s, size).accepted == accepted
    else:  # the c-th came as the round opened: nothing to wait for
        assert decision.accepted == accepted


@pytest.mark.parametrize("size,need", [(1, 1), (2, 1), (3, 2), (16, 15)])
def test_psp_default_leaves_out_one_slow_worker(size, need):
    policy = PSP(push_timeout_s=0.0)
    assert policy.contributions_needed(size) == need
    ready = tuple((r, float(r)) for r in range(need))
    assert policy.close_round(ready[:-1], 0.0, 100.0, size).accepted is None
    assert policy.close_round(ready, 0.0, 100.0, size).accepted == tuple(range(need))


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.data())
def test_backup_workers_accept_the_first_size_minus_b_arrivals(case, data):
    size, ready, opened_s = case
    b = data.draw(st.integers(0, size - 1), label="backups")
    policy = BackupWorkers(backups=b)
    policy.validate(size)
    n = size - b
    for k in range(len(ready) + 1):
        now = ready[k - 1][1] if k else opened_s
        decision = policy.close_round(ready[:k], opened_s, now + 1e6, size)  # the clock never matters
        assert decision.recheck_s is None
        if k < n:
            assert decision.accepted is None
        else:  # arrival order, not rank order: the first n to arrive, whoever they are
            assert decision.accepted == tuple(sorted(r for r, _ in ready[:n]))


def test_backup_workers_go_by_arrival_not_by_rank():
    ready = ((2, 0.5), (0, 0.7), (1, 0.71))
    assert BackupWorkers(backups=1).close_round(ready, 0.0, 1.0, 3).accepted == (0, 2)
    assert BackupWorkers(backups=2).close_round(ready, 0.0, 1.0, 3).accepted == (2,)


@settings(max_examples=200, deadline=None)
@given(arrivals(), st.floats(0.0, 1e6, allow_nan=False))
def test_full_psp_and_zero_backups_close_only_when_all_are_ready(case, later):
    size, ready, opened_s = case
    last = ready[-1][1] if ready else opened_s
    for policy in (
        PSP(min_contributions=size),
        PSP(min_contributions=size, push_timeout_s=0.0),
        BackupWorkers(backups=0),
    ):
        decision = policy.close_round(ready, opened_s, last + later, size)
        if len(ready) == size:  # BSP's rule: every worker, all of them accepted
            assert decision.accepted == tuple(range(size))
        else:
            assert decision == Closing()


def test_partial_policies_describe_themselves():
    assert PSP(min_contributions=3).config() == {
        "mode": "psp",
        "min_contributions": 3,
        "push_timeout_s": None,
        "compensate": None,
        "pull_fraction": 1.0,
        "pull_timeout_s": None,
        "pull_blocks": None,
        "compression": None,
    }
    assert BackupWorkers().config() == {"mode": "backup", "backups": 1, "compensate": None, "compression": None}
    assert BackupWorkers(compensate=DelayCompensation(lam=0.1)).config()["compensate"] == {
        "lam": 0.1,
        "adaptive": False,
        "momentum": 0.95,
        "epsilon": 1e-7,
    }
    for policy in (PSP(), BackupWorkers()):
        assert (policy.payload, policy.coordinated, policy.skips) == ("gradients", True, True)
        assert [policy.required_round(s) for s in range(3)] == [0, 1, 2]
    assert not BSP().coordinated and not SSP().coordinated
    with pytest.raises(NotImplementedError, match="every worker contributed"):
        BSP().close_round((), 0.0, 0.0, 2)


@pytest.mark.parametrize(
    "bad,error,message",
    [
        (0, ValueError, r"PSP\(min_contributions=0\): min_contributions must be >= 1"),
        (-3, ValueError, r"min_contributions must be >= 1"),
        (1.5, TypeError, r"PSP\(min_contributions=1.5\): min_contributions must be an int >= 1, got float"),
        (True, TypeError, r"min_contributions must be an int >= 1, got bool"),
        ("2", TypeError, r"min_contributions must be an int >= 1, got str"),
    ],
)
def test_psp_refuses_a_bad_min_contributions(bad, error, message):
    with pytest.raises(error, match=message) as info:
        PSP(min_contributions=bad)
    assert "tfsync.PSP(min_contributions=3" in str(info.value)  # says how to write it


@pytest.mark.parametrize(
    "bad,error",
    [
        (-0.5, ValueError),
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("1", TypeError),
        (True, TypeError),
        ([1.0], TypeError),
    ],
)
def test_psp_refuses_a_bad_push_timeout(bad, error):
    with pytest.raises(error, match=r"push_timeout_s must be a (finite )?number of seconds >= 0 or None"):
        PSP(push_timeout_s=bad)


def test_psp_accepts_integer_and_zero_timeouts():
    assert PSP(push_timeout_s=0).push_timeout_s == 0
    assert PSP(min_contributions=1, push_timeout_s=2).push_timeout_s == 2


def test_psp_validate_refuses_more_contributions_than_workers():
    PSP(min_contributions=4).validate(4)
    PSP().validate(1)
    with pytest.raises(ValueError, match=r"PSP\(min_contributions=5\) with 4 workers.*min_contributions <= 4"):
        PSP(min_contributions=5).validate(4)


@pytest.mark.parametrize(
    "bad,error,message",
    [
        (-1, ValueError, r"BackupWorkers\(backups=-1\): backups must be >= 0"),
        (2.0, TypeError, r"BackupWorkers\(backups=2.0\): backups must be an int >= 0, got float"),
        (None, TypeError, r"backups must be an int >= 0, got NoneType"),
        (False, TypeError, r"backups must be an int >= 0, got bool"),
    ],
)
def test_backup_workers_refuse_a_bad_count(bad, error, message):
    with pytest.raises(error, match=message):
        BackupWorkers(backups=bad)


def test_backup_workers_validate_keeps_at_least_one_worker_per_round():
    BackupWorkers(backups=0).validate(1)
    BackupWorkers(backups=3).validate(4)
    for backups, size in ((1, 1), (4, 4), (5, 4)):
        with pytest.raises(
            ValueError, match=rf"BackupWorkers\(backups={backups}\) with {size} workers" rf".*backups <= {size - 1}"
        ):
            BackupWorkers(backups=backups).validate(size)
