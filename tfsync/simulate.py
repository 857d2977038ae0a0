"""``python -m tfsync.simulate``: the real policies driven by simulated workers, at any scale.

No Horovod, no TensorFlow, no sleeps: each worker's iteration times are drawn
from a straggler profile (:class:`tfsync.Stragglers`, the scenarios of
``python -m tfsync.bench``), and a discrete-event loop plays the engine's
round protocol in simulated time.  Every synchronization decision is the
policy's own pure function, the same object a training run uses:

* BSP, SSP, DSSP: after pushing step ``k`` a worker waits for round
  ``policy.sync_round(k)`` (the engine's wait, :meth:`tfsync.policies.base.Policy.sync_round`);
  a round completes when every worker has
  pushed it, plus one allreduce (rounds complete in order, one allreduce at
  a time, as on the communication thread).  DSSP asks
  :meth:`tfsync.DSSP.grant` with the coordinator's :class:`PushTable`
  exactly where the engine asks (:meth:`tfsync.DSSP.next_required`): past the
  lower bound with no grant left and room before the upper bound; a grant
  costs a control round trip.
* ElasticBSP: supersteps from :meth:`tfsync.ElasticBSP.next_schedule`
  (ZipLine on the predicted end times, from the barrier round's push times
  and each worker's median interval); each worker computes the steps
  :meth:`tfsync.policies.dynamic.Schedule.computes` gives it (the superstep's
  last ``k_p``) and skips the others, entering every round; at the barrier
  every worker waits for the barrier round.
* PSP and backup workers: a worker's ready notice reaches the coordinator
  one control latency after its push; :meth:`close_round` decides (with its
  rechecks for timeouts), the closing reaches the workers one control
  latency later and the allreduce follows.  A contribution that arrives
  after its round closed is dropped; a worker whose next rounds closed
  without it skips them.

What it does not model: the payload's size (the allreduce is a fixed
``--allreduce-ms``), the engine's own CPU time per step, delay compensation
(it changes what is applied, not when), PSP's partial pull, and the
coordinator's own service time (its decision time is measured, not charged).

Reported per mode and scenario: worker-steps per second (computed and
skipped, the analogue of the bench's samples/s), effective contributions per
second (applied), dropped, skipped, the wait fraction, and for DSSP and
ElasticBSP the decision time of the real controller on this machine: per
decision, and as a fraction of the mean iteration.
"""

import argparse
import collections
import heapq
import itertools
import json
import statistics
import sys
import time

import numpy as np

from tfsync.bench.training import DEFAULT_SCENARIOS, add_scenario_arguments, scenario_spec
from tfsync.launch import number
from tfsync.policies import Policy, registry
from tfsync.policies.base import decide_round
from tfsync.policies.dynamic import PushTable
from tfsync.stragglers import Stragglers

MODES = tuple(m.name for m in registry.modes() if m.simulated)  # (DC-S3GD changes what is applied, not when)
# the simulated workers have step times only: slow pulls (the receive side) are not simulated
SIM_SCENARIOS = DEFAULT_SCENARIOS
DEFAULT_WORKERS = (16, 1000, 10000)


def delays(stragglers: Stragglers, workers: int, steps: int) -> np.ndarray:
    """``workers x steps`` iteration times: rank ``p``'s first ``steps`` delays of ``stragglers``."""
    return np.stack([stragglers.for_rank(p).next_delays_s(steps) for p in range(workers)])


class Log:
    """What a simulated run decided, in the terms of an engine's run (``simulate(..., log=Log())``):
    ``events``, ``(time, kind, rank, step)`` with ``kind`` one of ``"compute"`` (the step's
    computation starts), ``"push"`` and ``"skip"``; ``accepted``: round -> the ranks its
    closing took (coordinated modes)."""

    enabled = True

    def __init__(self):
        self.events, self.accepted = [], {}

    def add(self, t, kind, rank, step):
        self.events.append((float(t), kind, int(rank), int(step)))


class _NoLog(Log):
    enabled = False

    def add(self, t, kind, rank, step):
        pass


def simulate(
    policy: Policy, iteration_s: np.ndarray, allreduce_s: float = 0.005, control_s: float = 0.001, log=None
) -> dict:
    """Play ``policy`` on workers whose step ``k`` on rank ``p`` takes ``iteration_s[p, k]``.

    Returns the run's figures (see the module docstring); every worker does
    ``steps`` Keras steps, computed or skipped.  ``log``: a :class:`Log` to
    record every decision in (the tests compare it with an engine's run).
    """
    workers, steps = iteration_s.shape
    policy.validate(workers)
    log = _NoLog() if log is None else log
    how = simulation(policy)
    if policy.coordinated:
        run = _coordinated(policy, iteration_s, allreduce_s, control_s, log)
    elif how == "supersteps":
        run = _elastic(policy, iteration_s, allreduce_s, log)
    else:
        run = _bounded(policy, iteration_s, allreduce_s, control_s, log, grants=how == "grants")
    wall = run.pop("wall_s")
    decisions = run.pop("decision_s")
    mean_iteration = float(iteration_s.mean())
    result = {
        "mode": policy.name,
        "workers": workers,
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": workers * steps / wall,
        "effective_per_s": run["applied"] / wall,
        "wait_fraction": float(run.pop("wait_s").sum() / (workers * wall)),
        "mean_iteration_s": mean_iteration,
        **run,
    }
    # every contribution is applied or dropped, every step computed or skipped: nothing lost silently
    applied_or_dropped = result["applied"] + result["dropped"]
    if applied_or_dropped != result["computed"] or result["computed"] + result["skipped"] != workers * steps:
        raise RuntimeError(f"tfsync.simulate: contributions lost or double-counted in {policy!r}: {result}")
    if decisions:
        result.update(
            decisions=len(decisions),
            decision_ms_median=statistics.median(decisions) * 1e3,
            decision_ms_max=max(decisions) * 1e3,
            decision_fraction_of_iteration=statistics.median(decisions) / mean_iteration,
        )
    return result


def simulation(policy) -> str:
    """How ``policy``'s rounds are played (:data:`tfsync.policies.registry.SIMULATIONS`), as its
    registered mode says: ``"rounds"`` for a policy no simulated mode registers (its
    ``sync_round`` is its rule)."""
    mode = registry.of(policy)
    return mode.simulated if mode is not None and mode.simulated else "rounds"


def _bounded(policy, d, allreduce_s, control_s, log, grants=False):
    """BSP, SSP, DSSP (``grants``): rounds that every worker enters after computing its step."""
    workers, steps = d.shape
    dssp = grants
    complete_s = np.full(steps, np.inf)  # when each round's allreduce ends; known once all pushed
    pushes = np.zeros(steps, np.int64)
    latest_push = np.zeros(steps)
    waiting = collections.defaultdict(list)  # round -> [(worker, step it pushed, push time, earliest go)]
    wait = np.zeros(workers)
    table, grant_left, decisions = (PushTable(workers), np.zeros(workers, np.int64), []) if dssp else (None,) * 3
    events = [(d[p, 0], p, 0) for p in range(workers)]  # (push time, worker, step)
    heapq.heapify(events)
    for p in range(workers):
        log.add(0.0, "compute", p, 0)

    def resume(p, k, pushed_s, at_s):
        wait[p] += at_s - pushed_s
        if k + 1 < steps:
            log.add(at_s, "compute", p, k + 1)
            heapq.heappush(events, (at_s + d[p, k + 1], p, k + 1))

    while events:
        now, p, k = heapq.heappop(events)
        log.add(now, "push", p, k)
        pushes[k] += 1
        latest_push[k] = max(latest_push[k], now)
        if pushes[k] == workers:  # the round's last contribution: its allreduce follows
            complete_s[k] = max(complete_s[k - 1] if k else 0.0, latest_push[k]) + allreduce_s
            for q, j, at, earliest in waiting.pop(k, ()):
                resume(q, j, at, max(complete_s[k], earliest))
        required, ready_s = policy.sync_round(k), now
        if dssp:
            table.record(p, k, now)
            completed = int(np.searchsorted(complete_s, now, side="right")) - 1
            required, ready_s = _dssp_required(policy, table, grant_left, decisions, p, k, completed, now, control_s)
        if required < 0 or complete_s[required] <= ready_s:
            resume(p, k, now, ready_s)
        elif np.isfinite(complete_s[required]):
            resume(p, k, now, complete_s[required])
        else:
            waiting[required].append((p, k, now, ready_s))
    return {
        "wall_s": float(complete_s[-1]),
        "computed": workers * steps,
        "applied": workers * steps,
        "dropped": 0,
        "skipped": 0,
        "wait_s": wait,
        "decision_s": decisions or [],
    }


def _dssp_required(policy, table, grant_left, decisions, p, k, completed, now, control_s):
    """DSSP after worker ``p`` pushed step ``k``, by the policy's own rule
    (:meth:`tfsync.DSSP.next_required`, as the engine's grants ask): the round its next
    step waits for, and when it may go on at the earliest."""
    required, room, asks = policy.next_required(k, policy.sync_round(k), completed, int(grant_left[p]))
    if grant_left[p] > 0:
        grant_left[p] -= 1
        return required, now
    if not asks:
        return required, now
    start = time.perf_counter()
    grant = policy.grant(table, p, room)
    decisions.append(time.perf_counter() - start)
    extra = min(grant.extra, room)
    if extra > 0:
        grant_left[p] = extra - 1
        return policy.hard_round(k + 1), now + 2 * control_s
    return required, now + 2 * control_s


def _elastic(policy, d, allreduce_s, log):
    """ElasticBSP: supersteps between ZipLine barriers; every worker computes its last ``k_p``."""
    workers, steps = d.shape
    schedule = policy.first_schedule(workers)
    complete_s, start_s = 0.0, 0.0
    computed = skipped = 0
    wait = np.zeros(workers)
    decisions = []
    while schedule.start < steps:
        barrier = min(schedule.barrier, steps - 1)
        length = barrier - schedule.start + 1
        rounds = range(schedule.start, barrier + 1)
        computes = schedule.computing(rounds)
        chosen = computes.sum(axis=1)
        work = np.where(computes, d[:, schedule.start : barrier + 1], 0.0)
        entered = start_s + np.cumsum(work, axis=1)  # when each worker enters each round
        if log.enabled:
            for w, j in np.ndindex(computes.shape):
                log.add(entered[w, j] - work[w, j], "compute" if computes[w, j] else "skip", w, rounds[j])
                if computes[w, j]:
                    log.add(entered[w, j], "push", w, rounds[j])
        for j in range(length):
            complete_s = max(complete_s, float(entered[:, j].max())) + allreduce_s
        wait += complete_s - entered[:, -1]
        computed += int(chosen.sum())
        skipped += int(workers * length - chosen.sum())
        start_s = complete_s
        if barrier == steps - 1:
            break  # the last superstep: no schedule after it
        intervals = [float(np.median(work[w, computes[w]])) for w in range(workers)]  # as the engine's
        schedule = policy.next_schedule(barrier, entered[:, -1], intervals)
        if schedule.decision_s:
            decisions.append(schedule.decision_s)
    return {
        "wall_s": complete_s,
        "computed": computed,
        "applied": computed,
        "dropped": 0,
        "skipped": skipped,
        "wait_s": wait,
        "decision_s": decisions,
    }


def _coordinated(policy, d, allreduce_s, control_s, log):
    """PSP and backup workers: the coordinator closes each round by ``policy.close_round``."""
    workers, steps = d.shape
    closed_s = np.full(steps, np.inf)  # when the coordinator closed each round
    complete_s = np.full(steps, np.inf)  # when its allreduce ended
    ready = collections.defaultdict(list)  # round -> [(rank, arrival at the coordinator)]
    waiting = collections.defaultdict(list)  # round -> [(worker, push time)]
    counts = collections.Counter()
    wait = np.zeros(workers)
    decisions = []  # every close_round call: the coordinator's decision on one ready notice
    state = {"open": 0, "opened_s": 0.0}
    events = []  # (time, sequence, kind, worker, step)
    sequence = itertools.count()  # breaks ties between events at the same time

    def compute(p, k, at_s):
        """Worker ``p`` may go on after round ``k`` at ``at_s``: skip what closed, compute the rest."""
        k += 1
        # a round closed by the time its notice reaches the worker is skipped; going on
        # needs the result of the last round skipped too
        while k < steps and closed_s[k] + control_s <= at_s:
            counts["skipped"] += 1
            log.add(at_s, "skip", p, k)
            at_s = max(at_s, complete_s[k])
            k += 1
        if k < steps:
            counts["computed"] += 1
            log.add(at_s, "compute", p, k)
            pushed = at_s + d[p, k]
            heapq.heappush(events, (pushed + control_s, next(sequence), "ready", p, k))
            heapq.heappush(events, (pushed, next(sequence), "pushed", p, k))
        return at_s

    def decide(now):
        while state["open"] < steps:
            r = state["open"]
            start = time.perf_counter()
            closing = decide_round(policy, ready[r], state["opened_s"], now, workers)
            decisions.append(time.perf_counter() - start)
            if closing.accepted is None:
                if closing.recheck_s is not None:
                    heapq.heappush(events, (closing.recheck_s, next(sequence), "recheck", -1, r))
                return
            closed_s[r] = now
            log.accepted[r] = sorted(closing.accepted)
            counts["applied"] += len(closing.accepted)
            counts["dropped"] += len(ready.pop(r)) - len(closing.accepted)  # ready, not taken (backups)
            complete_s[r] = max(complete_s[r - 1] if r else 0.0, now + control_s) + allreduce_s
            state["open"], state["opened_s"] = r + 1, now
            for p, pushed in waiting.pop(r, ()):
                wait[p] += compute(p, r, complete_s[r]) - pushed

    for p in range(workers):
        compute(p, -1, 0.0)
    now = 0.0
    while events:
        now, _, kind, p, k = heapq.heappop(events)
        if kind == "pushed":  # the worker waits for its round's result, whoever closes it
            log.add(now, "push", p, k)
            if np.isfinite(complete_s[k]):
                wait[p] += compute(p, k, max(now, complete_s[k])) - now
            else:
                waiting[k].append((p, now))
        elif kind == "ready":
            if k < state["open"]:
                counts["dropped"] += 1  # its round closed before it arrived
            else:
                ready[k].append((p, now))
                decide(now)
        elif k == state["open"]:  # a recheck of the round still open
            decide(now)
    return {
        "wall_s": max(float(complete_s[-1]), now),  # a late push may come after the last round
        "computed": counts["computed"],
        "applied": counts["applied"],
        "dropped": counts["dropped"],
        "skipped": counts["skipped"],
        "wait_s": wait,
        "decision_s": decisions,
    }


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m tfsync.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=list(DEFAULT_WORKERS))
    p.add_argument("--steps", type=int, default=100, help="Keras steps per worker")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--scenarios", nargs="+", default=list(SIM_SCENARIOS), choices=SIM_SCENARIOS)
    add_scenario_arguments(p)
    p.add_argument("--staleness", type=int, default=3, help="SSP's bound (the modes that take one)")
    p.add_argument("--allreduce-ms", type=number(minimum=0), default=5.0, help="one round's allreduce")
    p.add_argument(
        "--control-ms", type=number(minimum=0), default=1.0, help="one way on the control path (coordinator)"
    )
    p.add_argument("--json", help="write every run's figures here")
    args = p.parse_args(argv)
    for name in ("steps", "staleness"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.workers) < 2:
        p.error(f"--workers must all be >= 2 (a synchronization mode needs peers), got {args.workers}")
    return args


def profile(scenario: str, workers: int, args) -> Stragglers:
    """``scenario`` (the bench's) for ``workers`` workers, with ``args``' delays."""
    return Stragglers.parse(scenario_spec(scenario, argparse.Namespace(**{**vars(args), "workers": workers})))


def policy(mode: str, args):
    """``mode``'s policy with the command line's settings (``--staleness`` for the modes that take it)."""
    return registry.get(mode).build(staleness=args.staleness)


def main(argv=None):
    args = parse_args(argv)
    runs = []
    header = (
        f"{'workers':>7} {'scenario':<13} {'mode':<10} {'steps/s':>10} {'effective/s':>11} {'vs bsp':>6} "
        f"{'wait':>5} {'dropped':>8} {'skipped':>8} {'decision ms':>11} {'of iter':>8}"
    )
    print(header)
    for workers in args.workers:
        for scenario in args.scenarios:
            stragglers = profile(scenario, workers, args)
            iteration_s = delays(stragglers, workers, args.steps)
            bsp = None
            for mode in args.modes:
                run = simulate(
                    policy(mode, args),
                    iteration_s,
                    args.allreduce_ms / 1e3,
                    args.control_ms / 1e3,
                )
                run.update(scenario=scenario, stragglers=stragglers.spec())
                runs.append(run)
                if mode == "bsp":
                    bsp = run
                ratio = f"{run['effective_per_s'] / bsp['effective_per_s']:.2f}x" if bsp else "-"
                decision = (
                    (f"{run['decision_ms_median']:.3f}", f"{100 * run['decision_fraction_of_iteration']:.2f}%")
                    if "decisions" in run
                    else ("-", "-")
                )
                print(
                    f"{workers:>7} {scenario:<13} {mode:<10} {run['steps_per_s']:>10.0f} "
                    f"{run['effective_per_s']:>11.0f} {ratio:>6} {run['wait_fraction']:>5.2f} "
                    f"{run['dropped']:>8} {run['skipped']:>8} {decision[0]:>11} {decision[1]:>8}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else list(argv), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
