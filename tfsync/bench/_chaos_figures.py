"""The chaos bench's figures, from the step records and the fault ledger (:mod:`tfsync.bench.chaos`
says what each measures): the time from a fault to the next step and to the re-formed job's
first step, the goodput a fault cost, the steps stalled by kind, the goodput ceiling, and the
records' timeline."""

import bisect
import collections
import statistics

from tfsync.control.transport import SILENT_LINK_S

PER_HOST = 2
FULL = 2 * PER_HOST
STALL_S = 1.0  # a gap between steps this long counts as stalled
TIMELINE_BIN_S = 5.0  # the records' timeline: samples per second in bins this long
BATCH = 16  # the worker's batch (_elastic_worker): the samples one step trains


def to_next_step(steps, fault, window_s, next_t=None):
    """Seconds from ``fault`` (a ledger record: ``t``, and ``pid`` for a worker's) to the next step
    of the workers it did not take, past the stall it caused: the end of the first stall (no
    step of theirs for ``STALL_S`` or more) that began within ``window_s`` after it and before
    ``next_t`` (the next fault's injection: a stall that begins after it is that fault's), else
    their next step; None if none followed."""
    t0, victim = fault["t"], fault.get("pid")
    until = t0 + window_s if next_t is None else min(t0 + window_s, next_t)
    times = [s["t"] for s in steps if s["pid"] != victim]
    last = max([t for t in times if t <= t0], default=t0)
    after = [t for t in times if t > t0]
    for a, b in zip([last, *after], after, strict=False):
        if a > until:
            break
        if b - a >= STALL_S:
            return b - t0
    return after[0] - t0 if after else None


def to_reformed_step(steps, fault, next_t=None):
    """Seconds from ``fault`` to the first step of the workers it did not take in a job re-formed
    after it (a step whose resets ``r`` are past the last they had made before it), before
    ``next_t`` (the next fault's injection); None when none came: a cut or a flap that healed
    before the peers gave up on it, a NaN the job rejected.  For a worker lost, the survivors'
    own recovery, apart from the wait for its replacement (:func:`to_next_step` counts the
    replacement's join when the survivors' re-form took under ``STALL_S``)."""
    t0, victim = fault["t"], fault.get("pid")
    others = [s for s in steps if s["pid"] != victim]
    before = max((s["r"] for s in others if s["t"] <= t0), default=None)
    if before is None:
        return None
    for s in others:
        if s["t"] > t0 and s["r"] > before:
            return s["t"] - t0 if next_t is None or s["t"] < next_t else None
    return None


def _kind_before(injected, at, t):
    """The kind of the last fault in ``injected`` (``[(t, kind), ...]`` sorted, ``at`` their
    times) injected before ``t``; ``"none"`` before the first."""
    last = bisect.bisect_left(at, t)
    return injected[last - 1][1] if last else "none"


def goodput_lost(steps, injected, lost_s, calm_rate, samples_redone):
    """Where the soak's lost goodput went: ``lost_s`` (the soak's seconds times one minus its
    goodput: the seconds the undisturbed run would have needed for nothing) split by what the job
    was doing, each interval between two of its steps (``steps``, in time order) costing its
    length less the undisturbed time of the step that ends it:

    * ``stalled_by_kind``: intervals of ``STALL_S`` or more (no step anywhere), by the kind of
      the last fault injected before each ended, as :func:`stalled_by_kind`;
    * ``fewer_workers_by_kind``: the shorter ones whose step ran with fewer than all the workers
      (a host removed, a lost worker's replacement not yet joined), by the same kind;
    * ``slower_steps``: the shorter ones with every worker (a replacement's or a returning host's
      start-up beside them, a commit to storage, the machine's noise; negative when faster);
    * ``steps_redone``: ``samples_redone`` at the undisturbed rate;
    * ``other``: the rest of ``lost_s`` (a finished job's last partial epoch, the end's wait).

    ``injected``: ``[(t, kind), ...]``; ``calm_rate``: the undisturbed useful samples per
    second.  The values are seconds and add up to ``lost_s``."""
    injected = sorted(injected)
    at = [t for t, _ in injected]
    stalled, fewer = collections.Counter(), collections.Counter()
    slower = 0.0
    for a, b in zip(steps, steps[1:], strict=False):
        kind = _kind_before(injected, at, b["t"])
        cost = b["t"] - a["t"] - BATCH / calm_rate
        if b["t"] - a["t"] >= STALL_S:
            stalled[kind] += cost
        elif b["n"] < FULL:
            fewer[kind] += cost
        else:
            slower += cost
    redone = samples_redone / calm_rate
    other = lost_s - sum(stalled.values()) - sum(fewer.values()) - slower - redone
    rounded = lambda counter: {k: round(v, 1) for k, v in sorted(counter.items())}  # noqa: E731
    return {
        "stalled_by_kind": rounded(stalled),
        "fewer_workers_by_kind": rounded(fewer),
        "slower_steps": round(slower, 1),
        "steps_redone": round(redone, 1),
        "other": round(other, 1),
    }


def stalled_by_kind(steps, injected):
    """Seconds with no step anywhere (gaps of ``STALL_S`` or more between the job's steps, which
    come in time order), by the kind of the last fault injected before each ended (``injected``:
    ``[(t, kind), ...]``); ``"none"`` for those that ended before the first.  What the soak's
    stalls went to: a stall that ends after an injection is that fault's or a later consequence
    of it (a replacement's join, a host's return), as long as no other fault came meanwhile."""
    injected = sorted(injected)
    at = [t for t, _ in injected]
    out = collections.Counter()
    for a, b in zip(steps, steps[1:], strict=False):
        if b["t"] - a["t"] >= STALL_S:
            out[_kind_before(injected, at, b["t"])] += b["t"] - a["t"]
    return dict(sorted(out.items()))


def goodput_ceiling(injected, soak_s, rows, calm_rate, wait_timeout_s):
    """The goodput the soak's faults leave a mode whose every round needs every member (the
    soak's three: a host's link holds two of the four workers, backup workers tolerate one) if
    nothing but the faults themselves took time, and what each kind takes, in seconds at the
    undisturbed rate ``calm_rate``:

    * ``host_removed``: its workers are gone for ``duration_s``, the other host's train on at
      the rate the soak had with them alone: the median of ``rows``' bins (the soak's timeline,
      :func:`timeline`) with two workers, inside a removal, 2 s or more from its ends and from
      any other fault;
    * ``link_cut``: no round closes while the link is down, ``duration_s``;
    * ``link_flap``: down half of ``duration_s`` (down and up every ``FLAP_S``);
    * ``stop``: the peers cannot tell a stopped worker from a link that flaps before its links
      are silent for ``SILENT_LINK_S``;
    * ``hang``: a blocked step is a slow one until the wait bound;
    * ``kill``, ``raise``, ``nan``: nothing: a re-form, a replacement's start-up and the steps
      redone are the implementation's cost, not the fault's.

    ``injected``: ``[(seconds after the schedule's start, fault), ...]``.  Returns ``(ceiling,
    {kind: seconds})``; the ceiling is None when a host was removed but the soak has no such
    stretch of two workers to measure their rate on."""
    removals = [(t, f.duration_s) for t, f in injected if f.kind == "host_removed"]
    others = [t for t, f in injected if f.kind != "host_removed"]
    bin_s = TIMELINE_BIN_S
    two = [
        rate
        for t, rate, n in rows
        if n == FULL - PER_HOST
        and any(a + 2 <= t and t + bin_s <= a + d - 2 for a, d in removals)
        and not any(t - 2 < o < t + bin_s + 2 for o in others)
    ]
    two_rate = statistics.median(two) if two else None
    taken = collections.Counter()
    for _, fault in injected:
        d = fault.duration_s or 0.0
        seconds = {
            "host_removed": d * (1 - (two_rate or 0.0) / calm_rate),
            "link_cut": d,
            "link_flap": d / 2,  # (down FLAP_S, up FLAP_S)
            "stop": SILENT_LINK_S,
            "hang": wait_timeout_s,
        }.get(fault.kind, 0.0)
        taken[fault.kind] += seconds
    ceiling = None if removals and two_rate is None else 1.0 - sum(taken.values()) / soak_s
    return ceiling, {k: round(v, 1) for k, v in sorted(taken.items())}


def fault_outcomes(steps, faults, schedule, window_s, lost):
    """Per kind of fault: how many were injected and survived (a step followed, before the job
    was lost if it was), and each one's seconds to the next step (within ``window_s``) and to the
    re-formed job's first step (``faults``: the ledger's records by schedule index)."""
    survived, injected = collections.Counter(), collections.Counter()
    next_step, reformed = collections.defaultdict(list), collections.defaultdict(list)
    injected_at = sorted(record["t"] for record in faults.values())
    for index, record in sorted(faults.items()):
        kind = schedule.faults[index].kind
        injected[kind] += 1
        next_t = next((t for t in injected_at if t > record["t"]), None)
        s = to_next_step(steps, record, window_s, next_t)
        next_step[kind].append(s)
        reformed[kind].append(to_reformed_step(steps, record, next_t))
        if s is not None and (lost is None or record["t"] + s <= steps[-1]["t"]):
            survived[kind] += 1
    return injected, survived, next_step, reformed


def timeline(steps, start, bin_s=TIMELINE_BIN_S):
    """``[[seconds since start, samples trained per second (redone ones too), workers], ...]`` in
    bins of ``bin_s`` from ``start`` (earlier steps left out)."""
    if not steps:
        return []
    bins = {}
    for s in steps:
        b = int((s["t"] - start) // bin_s)
        count, size = bins.get(b, (0, 0))
        bins[b] = (count + 1, max(size, s["n"]))
    out, size = [], 0
    for b in range(max(bins) + 1):
        count, seen = bins.get(b, (0, 0))
        size = seen or size  # (a bin without steps: the size the job last had)
        out.append([b * bin_s, BATCH * count / bin_s, size])
    return out


__all__ = [
    "fault_outcomes",
    "goodput_ceiling",
    "goodput_lost",
    "stalled_by_kind",
    "timeline",
    "to_next_step",
    "to_reformed_step",
]
