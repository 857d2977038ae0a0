"""The harness's side of fault injection: a schedule of faults, the ledger that makes each happen
once, and the host faults (:mod:`tfsync.faults` says what each kind does).

No Keras here: the harness that drives the hosts imports this alone; the worker's side is
:mod:`tfsync.faults.injector`.
"""

import dataclasses
import json
import math
import os
import random
import threading
import time

WORKER_KINDS = ("kill", "stop", "raise", "nan", "hang")
"""The kinds a worker injects into itself (:class:`tfsync.keras.FaultInjector`)."""
HOST_KINDS = ("link_cut", "link_flap", "host_removed")
"""The kinds the harness injects into a host (:class:`HostFaults`)."""
KINDS = WORKER_KINDS + HOST_KINDS
"""Every kind."""
FLAP_S = 1.0
"""A flapping link changes state this often (seconds)."""


class InjectedFault(RuntimeError):
    """Raised in a training step by a ``"raise"`` fault."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: what (``kind``), to whom (``rank`` or ``host``), when (``step`` or ``at_s``),
    for how long (``duration_s``).  See the module docstring for the kinds.

    Args:
        kind: one of :data:`KINDS`.
        rank: the worker (``"kill"``, ``"stop"``, ``"raise"``, ``"nan"``, ``"hang"``); taken modulo the
            job's size when the fault is due.
        host: the host's index in the harness's hosts (``"link_cut"``, ``"link_flap"``,
            ``"host_removed"``).
        step: due when a step begins at this optimizer iteration or later (worker kinds only).
        at_s: due this many seconds after the schedule's start.
        duration_s: ``"stop"``: seconds until SIGCONT, ``"hang"``: seconds until the step goes
            on, None for good; host kinds: seconds until the link or the host is back (required).
    """

    kind: str
    rank: int | None = None
    host: int | None = None
    step: int | None = None
    at_s: float | None = None
    duration_s: float | None = None

    def __post_init__(self):
        def refuse(what):
            raise ValueError(f"tfsync.faults.Fault({self.kind!r}, ...): {what}")

        if self.kind not in KINDS:
            raise ValueError(f"tfsync.faults.Fault: unknown kind {self.kind!r}; choose among {list(KINDS)}")
        if (self.step is None) == (self.at_s is None):
            refuse("give exactly one of step= (an optimizer iteration) and at_s= (seconds after the start)")
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0):
            refuse(f"step must be an integer >= 0, got {self.step!r}")
        if self.at_s is not None and not _seconds(self.at_s, zero=True):
            refuse(f"at_s must be a number of seconds >= 0, got {self.at_s!r}")
        if self.kind in WORKER_KINDS:
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
                refuse(f"a worker's fault needs rank= (an integer >= 0), got {self.rank!r}")
            if self.host is not None:
                refuse("a worker's fault takes rank=, not host=")
            if self.kind not in ("stop", "hang") and self.duration_s is not None:
                refuse("only a stop or a hang has a duration (seconds until the worker goes on)")
        else:
            if isinstance(self.host, bool) or not isinstance(self.host, int) or self.host < 0:
                refuse(f"a host's fault needs host= (the host's index, an integer >= 0), got {self.host!r}")
            if self.rank is not None or self.step is not None:
                refuse("a host's fault takes host= and at_s= (it is injected by the harness, not by a worker)")
        if self.duration_s is not None and not _seconds(self.duration_s):
            refuse(f"duration_s must be a positive number of seconds, got {self.duration_s!r}")
        if self.kind in HOST_KINDS and self.duration_s is None:
            refuse("give duration_s= (seconds until the link or the host is back)")

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.kind in WORKER_KINDS else f"host {self.host}"
        when = f"step {self.step}" if self.step is not None else f"{self.at_s:.1f} s"
        how = "" if self.duration_s is None else f" for {self.duration_s:g} s"
        for_good = " (for good)" if self.kind in ("stop", "hang") and how == "" else ""
        return f"{self.kind} of {who} at {when}{how}{for_good}"


def _seconds(value, zero=False) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return value >= 0 if zero else value > 0


class Schedule:
    """Faults to inject, in order of their index (a fault's identity in the ledger).

    Args:
        faults: :class:`Fault` s.
        start_t: the Unix time ``at_s`` counts from (default: now); give every process the same.
    """

    def __init__(self, faults, start_t=None):
        self.faults = tuple(faults)
        for fault in self.faults:
            if not isinstance(fault, Fault):
                raise TypeError(f"tfsync.faults.Schedule takes Fault objects, got {type(fault).__name__}")
        self.start_t = time.time() if start_t is None else float(start_t)

    @classmethod
    def random(
        cls, seed, minutes, every_s=(10.0, 20.0), kinds=KINDS, ranks=4, hosts=(1,), durations=None, start_t=None
    ):
        """Faults at random times, one every ``every_s`` (a uniform range of seconds) for
        ``minutes``, of ``kinds`` drawn in turn from a shuffled cycle (every kind as often),
        each on a random one of ``ranks`` workers or of ``hosts``; ``durations``:
        ``{kind: (low, high)}`` seconds (a stop without one is for good)."""
        if not kinds or any(k not in KINDS for k in kinds):
            raise ValueError(f"tfsync.faults.Schedule.random: kinds must be among {list(KINDS)}, got {list(kinds)}")
        low, high = every_s
        if not (0 < low <= high):
            raise ValueError(
                f"tfsync.faults.Schedule.random: every_s must be (low, high) with 0 < low <= high, got {every_s}"
            )
        rng = random.Random(seed)
        durations = {"link_cut": (3.0, 8.0), "link_flap": (4.0, 8.0), "host_removed": (15.0, 25.0), **(durations or {})}
        faults, t, cycle = [], rng.uniform(low, high), []
        while t < 60 * minutes:
            if not cycle:
                cycle = list(kinds)
                rng.shuffle(cycle)
            kind = cycle.pop()
            span = durations.get(kind)
            duration = None if span is None else round(rng.uniform(*span), 1)
            if kind in WORKER_KINDS:
                faults.append(Fault(kind, rank=rng.randrange(ranks), at_s=round(t, 1), duration_s=duration))
            else:
                faults.append(Fault(kind, host=rng.choice(list(hosts)), at_s=round(t, 1), duration_s=duration))
            t += rng.uniform(low, high)
        return cls(faults, start_t)

    def to_json(self) -> str:
        return json.dumps({"start_t": self.start_t, "faults": [dataclasses.asdict(f) for f in self.faults]})

    @classmethod
    def from_json(cls, text):
        raw = json.loads(text)
        return cls([Fault(**f) for f in raw["faults"]], raw["start_t"])

    def host_faults(self):
        """``[(index, fault)]`` of the host kinds, in time order."""
        return sorted(((i, f) for i, f in enumerate(self.faults) if f.kind in HOST_KINDS), key=lambda p: p[1].at_s)


class Ledger:
    """Which faults have happened: files in ``directory`` (one per fault, created exclusively, a
    JSON record of when and to whom), or this process's memory without one."""

    def __init__(self, directory=None):
        self.directory = directory
        self._taken = set()
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    def _path(self, index):
        return os.path.join(self.directory, f"fault_{index}.json")

    def taken(self, index) -> bool:
        return index in self._taken or (self.directory is not None and os.path.exists(self._path(index)))

    def take(self, index, record) -> bool:
        """Record fault ``index`` as happening (``record``: what to say of it); False if another
        process has already taken it."""
        if self.taken(index):
            return False
        self._taken.add(index)
        if self.directory is None:
            return True
        try:
            fd = os.open(self._path(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())  # (before a kill or a stop: the record outlives the process)
        return True

    def records(self):
        """Every recorded fault (with a directory), by index."""
        out = {}
        if self.directory is not None:
            for name in os.listdir(self.directory):
                if name.startswith("fault_") and name.endswith(".json"):
                    with open(os.path.join(self.directory, name)) as f:
                        out[int(name[len("fault_") : -len(".json")])] = json.load(f)
        return out


class HostFaults:
    """Injects a :class:`Schedule`'s host faults at their times, on a thread of the harness.

    Args:
        schedule: the :class:`Schedule`.
        hosts: what acts on the hosts: ``set_link(host, up)`` and, for ``"host_removed"``,
            ``list_host(host, listed)`` (the launcher's discovery).
        ledger_dir: where each injected fault is recorded (as :class:`Injector` does).
    """

    def __init__(self, schedule, hosts, ledger_dir=None):
        self.schedule, self.hosts = schedule, hosts
        self.ledger = Ledger(ledger_dir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tfsync-host-faults", daemon=True)
        self.injected = []
        self.error = None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=2 * FLAP_S + 30)

    def _wait_until(self, t) -> bool:
        return not self._stop.wait(max(0.0, t - time.time()))

    def _run(self):
        try:
            for index, fault in self.schedule.host_faults():
                if not self._wait_until(self.schedule.start_t + fault.at_s):
                    return
                record = {"kind": fault.kind, "host": fault.host, "t": time.time(), "duration_s": fault.duration_s}
                if not self.ledger.take(index, record):
                    continue
                self.injected.append(record)
                self._inject(fault)
        except Exception as exc:  # noqa: BLE001 - kept for the harness, which reports it
            self.error = exc

    def _inject(self, fault):
        end = time.time() + fault.duration_s
        if fault.kind == "host_removed":
            self.hosts.list_host(fault.host, False)
            self._wait_until(end)
            self.hosts.list_host(fault.host, True)
            return
        up = False
        try:
            while True:
                self.hosts.set_link(fault.host, up)
                if fault.kind == "link_cut":
                    self._wait_until(end)
                    break
                if not self._wait_until(min(end, time.time() + FLAP_S)) or time.time() >= end:
                    break
                up = not up
        finally:
            self.hosts.set_link(fault.host, True)  # (every fault ends with the link up)
