"""ElasticBSP's supersteps in the engine's step (:class:`Supersteps`).

A superstep runs from the step after one barrier to the next barrier round
(:class:`tfsync.policies.dynamic.Schedule`).  A worker skips its first steps
and computes the last ``k_p`` (its skipped steps enter their rounds with
zeros, :class:`tfsync.engine.entry.OpenRounds`); only the barrier step waits,
for the barrier round and every round before it.  When the barrier round is
applied the replicas settle to ``w̄`` and every worker computes the next
schedule from that round's replicated metadata with the policy's own rule
(:meth:`tfsync.ElasticBSP.next_schedule`): the same decision everywhere, no
message.  The interval each worker's row carries is its median computation
over the superstep plus a moving average of its own time from a push to its
next step (the engine's work after a push), so the predictor sees push to
push, not the waits.
"""

import statistics

import numpy as np

from tfsync.engine.components.base import StepComponent

POST_PUSH_SMOOTHING = 0.2  # weight of the newest step in the post-push time's average


class Supersteps(StepComponent):
    """The current superstep, its barrier and this worker's measured interval."""

    rests = False  # a superstep's workers go on before their rounds complete

    def __init__(self, policy):
        self.policy = policy
        self.schedule = None
        self._compute = []  # this superstep's computation times
        self._post_push_s = 0.0  # moving average of the time from a push to the next step
        self._at_barrier = None  # the step whose sync waits for the barrier round
        # this worker's barriers: how many, the waits at them, the decisions' time
        self.barriers = {"count": 0, "wait_s": 0.0, "decision_s": 0.0}

    def bind(self, engine):
        super().bind(engine)
        self.schedule = self.policy.first_schedule(engine.size)

    def computes(self, step):
        return self.schedule.computes(self.engine.rank, step)

    def runs_ahead(self, step):
        return step != self.schedule.barrier  # only the barrier step waits for its own round

    def interval(self, step, compute_s):
        self._compute.append(compute_s)
        return statistics.median(self._compute) + self._post_push_s

    def required(self, step, required):
        if step != self.schedule.barrier:
            return -1
        self._at_barrier = step
        return step

    def skip(self, step):
        return self.required(step, -1)

    def after_apply(self, res):
        if res.round != self.schedule.barrier:
            return
        engine = self.engine
        engine.protocol.settle()
        # every rank pushed the barrier step: its push time counts even if its update was rejected
        present = np.flatnonzero((res.present == 1.0) | (res.rejected == 1.0))
        self.schedule = self.policy.next_schedule(
            res.round, [float(res.push_times[k]) for k in present], [float(c) for c in res.compute_s]
        )
        self._compute = []
        self.barriers["decision_s"] += self.schedule.decision_s
        engine.trace({"event": "barrier", "rank": engine.rank, "t": engine.now(), **self.schedule.record()})

    def end_step(self, step, wait_s, skipped):
        if self._at_barrier == step:
            self._at_barrier = None
            self.barriers["count"] += 1
            self.barriers["wait_s"] += wait_s
        elif not skipped:  # a moving average: recent steps count most
            self._post_push_s += POST_PUSH_SMOOTHING * (wait_s - self._post_push_s)
        return {}
