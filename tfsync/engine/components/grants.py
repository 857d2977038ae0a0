"""DSSP's extra iterations: the worker's side (:class:`Grants`) and rank 0's (:class:`GrantService`).

Every worker tells the coordinator of each push (``tell("pushed")``,
fire-and-forget); a worker past DSSP's lower bound with no grant left asks
for extra iterations (``ask("grant")``), answered at once from the table of
push counts and times by the policy's own rule (:meth:`tfsync.DSSP.grant`).
A granted worker computes that many steps past the lower bound, one per push,
waiting only for the upper bound's round, and asks again when the grant is
used up.  Every decision goes into the trace (``"grant"`` events) with the
wait that followed it.

When to ask is the policy's own rule (:meth:`tfsync.DSSP.next_required`),
which the simulator (:mod:`tfsync.simulate`) plays too.
"""

import threading

from tfsync.engine.components.base import StepComponent
from tfsync.policies.dynamic import PushTable


class Grants(StepComponent):
    """DSSP's grants on a worker: ask past the lower bound, spend what is granted."""

    rests = False  # a grant lets a worker go on past its round

    def __init__(self, policy):
        self.policy = policy
        self.left = 0  # extra steps granted past the lower bound and not yet used
        self._granted = set()  # the steps they cover
        self._open = None  # the latest grant decision, until the wait it predicted is known
        self._closing = None

    def runs_ahead(self, step):
        return self.policy.extra_max > 0  # may be granted extra steps instead of waiting

    def required(self, step, required):
        engine = self.engine
        completed = engine.exchange.completed
        nxt = step + 1
        rounds, room, asks = self.policy.next_required(step, required, completed, self.left)
        if not asks:  # (a grant request carries the push itself)
            engine.control.tell("pushed", step=step)
        if self.left > 0:
            self.left -= 1
            self._granted.add(nxt)
            return rounds
        if self._open is not None:  # used up: the wait that follows is the one it predicted
            self._closing, self._open = self._open, None
        if not asks:
            return required
        t = engine.now()
        reply = engine.control.ask("grant", step=step, room=room)
        extra = min(int(reply.get("extra", 0)), room)
        decision = {
            "step": nxt,
            "t": t,
            "extra": extra,
            "room": room,
            "ahead": nxt - (completed + 1),
            "reason": reply.get("reason"),
            "slowest": None if reply.get("slowest") is None else int(reply["slowest"]),
            "predicted_wait_s": reply.get("predicted_wait_s"),
            "counts": [int(c) for c in reply.get("counts", ())],
        }
        if extra > 0:
            self.left = extra - 1
            self._granted.add(nxt)
            self._open = decision
            return self.policy.hard_round(nxt)
        self._closing = decision  # no extra steps: this step's wait is the one predicted
        return required

    def end_step(self, step, wait_s, skipped):
        granted = step in self._granted
        self._granted.discard(step)
        if self._closing is not None:
            self.engine.trace({"event": "grant", "rank": self.engine.rank, **self._closing, "actual_wait_s": wait_s})
            self._closing = None
        return {"granted": granted}


class GrantService:
    """DSSP's synchronization controller on rank 0: the push table and the policy's rule."""

    def __init__(self, policy, size: int):
        self.policy = policy
        self.pushes = PushTable(size)
        self._lock = threading.Lock()

    def tell(self, rank: int, topic: str, message: dict, now_s: float) -> None:
        if topic == "pushed":
            with self._lock:
                self.pushes.record(rank, int(message["step"]), now_s)

    def ask(self, rank: int, topic: str, message: dict, now_s: float) -> dict:
        """``grant``: a worker that pushed ``step`` and is past the lower bound asks for extra
        iterations (Algorithm 1, lines 7-16); ``room``: how many its upper bound allows."""
        if topic != "grant":
            raise ValueError(f"DSSP's coordinator answers 'grant', not {topic!r}")
        with self._lock:
            self.pushes.record(rank, int(message["step"]), now_s)
            pushes = self.pushes.copy()
        grant = self.policy.grant(pushes, rank, int(message["room"]))
        reply = {"extra": grant.extra, "reason": grant.reason, "counts": pushes.counts.tolist()}
        if grant.slowest is not None:
            reply["slowest"] = grant.slowest
        if grant.predicted_wait_s is not None:
            reply["predicted_wait_s"] = grant.predicted_wait_s
        return reply
