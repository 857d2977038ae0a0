"""What the engine takes from the job's ranks, behind one small interface.

A :class:`~tfsync.engine.SyncEngine` talks to its peers through a *cluster*
object, injected as ``SyncEngine(..., cluster=...)``, as the conventions ask
of everything that talks to the outside world:

* ``rank()``, ``size()``: this worker's rank and the number of workers;
* ``allgather_object(obj, name)``: every rank's ``obj``, in rank order;
* ``broadcast_object(obj, root_rank, name)``: ``root_rank``'s ``obj`` on every rank;
* ``wire_ops()``: the Horovod operations the engine's rounds are built from
  (:mod:`tfsync.engine.wire`): ``size()``, ``rank()``, ``Sum``, ``Average``,
  ``grouped_allreduce(tensors, op, name, postscale_factor=...)``, ``alltoall(tensor, name)``
  and ``allgather(tensor, name)``, with Horovod's meaning;
* ``local_rank()``: this worker's index among the workers of its host;
* ``broadcast(tensor, root_rank, name)``: ``root_rank``'s tensor on every rank;
* ``broadcast_variables(variables, root_rank, name)``: set every rank's
  variables to ``root_rank``'s values, in place;
* ``average(tensors, name)``: the element-wise mean over the ranks of each
  tensor, one grouped call (the frontends' epoch logs and statistics);
* ``barrier(name)``: a function of no arguments that returns once every
  rank has called it; the engine's ``close()`` builds it on the training
  thread and runs it on the exchange thread, after every round;
* ``abort()`` (optional): make every pending and later collective of every
  rank fail at once, with an error whose message contains
  :data:`~tfsync.engine.bounded.ABORTED_MESSAGE` (Horovod's).  The engine calls it from a watchdog
  thread when a round that runs on the training thread (BSP's inline round)
  outlasts the wait bound, and :func:`~tfsync.engine.bounded.run_bounded` when any other collective
  does, so that wait ends as every other one does and no rank is left waiting;
* ``arrival_key(name)``, ``arrive(key)``, ``leave(key)``, ``missing(key)``
  (optional): the arrival record that lets a collective which reached its
  bound name the ranks that had not reached it.  ``arrival_key`` numbers the
  calls of each collective name (the same key on every rank: every rank calls
  its collectives in the same order); ``arrive(key)``: this rank is waiting in
  that call; ``leave(key)``: the call completed on this rank (its record is
  removed); ``missing(key) -> list[int] | None``: the ranks that have not
  arrived (``None``: unknown).  They are called from :func:`~tfsync.engine.bounded.run_bounded`'s
  watchdog thread too, never use the collectives, and never raise for the
  record's sake (an unreachable record makes ``missing`` return ``None``).

The engine and the frontends (:mod:`tfsync.frontend`) call the collectives from
at most one thread at a time per rank, in the same order on every rank; nothing
else in tfsync's training path calls Horovod.  In production (``cluster=None``) it is
:class:`HorovodCluster`: the same Horovod calls, with the same names and in
the same order on every rank.  The single-process tests pass N ranks on threads
(``tests/single/fake_cluster.py``),
and a simulator can do the same.

Every collective outside the engine's rounds runs bounded
(:func:`tfsync.engine.bounded.run_bounded`).
"""

import collections
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from tfsync import _horovod
from tfsync.engine._tf import tf_variable

ARRIVALS_SCOPE = "tfsync.arrivals"  # tfsync's scope in Horovod's rendezvous store
STORE_TIMEOUT_S = 1.0  # one HTTP call to Horovod's rendezvous store
MISSING_BUDGET_S = 5.0  # all of one missing()'s reads together
RENDEZVOUS_ADDR_ENV, RENDEZVOUS_PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"


class RendezvousArrivals:
    """The arrival record in Horovod's own Gloo rendezvous key-value store.

    ``horovodrun --gloo`` runs that store (an HTTP server,
    ``horovod.runner.http.http_server.RendezvousServer``) on the launcher host
    for the whole job and tells every worker where it is
    (:data:`RENDEZVOUS_ADDR_ENV`, :data:`RENDEZVOUS_PORT_ENV`), so every rank
    can reach it without a service of tfsync's own.  A rank's arrival at a
    call is one key in tfsync's scope (:data:`ARRIVALS_SCOPE`): ``PUT`` when it
    arrives, ``DELETE`` when the call completed (the store supports deleting
    from a scope of the client's own), ``GET`` answering 404 for each rank
    not arrived.  The requests are Horovod's client's
    (``horovod.runner.http.http_client``), made here with a timeout
    (:data:`STORE_TIMEOUT_S`) and no proxy, and none raises: the record only
    serves an error message.

    Args:
        addr, port: the store's address.
        rank, size: this worker's rank and the number of workers.
    """

    def __init__(self, addr, port, rank, size):
        self.base = f"http://{addr}:{int(port)}/{ARRIVALS_SCOPE}/"
        self.rank, self.size = rank, size
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def from_env(cls, rank, size, environ=None):
        """The record of a job launched by ``horovodrun --gloo``; None without the store's address
        (e.g. under MPI).  ``rank``, ``size``: functions, called only when there is a store."""
        environ = os.environ if environ is None else environ
        addr, port = environ.get(RENDEZVOUS_ADDR_ENV, "").strip(), environ.get(RENDEZVOUS_PORT_ENV, "").strip()
        if not addr or not port.isdigit():
            return None
        return cls(addr, int(port), rank(), size())

    def _url(self, key, rank):
        return self.base + urllib.parse.quote(f"{key}@{rank}", safe="")

    def _request(self, method, url, data=None, timeout_s=None):
        request = urllib.request.Request(url, data=data, method=method)
        with self._opener.open(request, timeout=STORE_TIMEOUT_S if timeout_s is None else timeout_s) as response:
            return response.read()

    def arrive(self, key):
        try:
            self._request("PUT", self._url(key, self.rank), data=b"1")
        except Exception:  # noqa: BLE001 - best effort: the record only serves a message
            pass

    def leave(self, key):
        try:
            self._request("DELETE", self._url(key, self.rank))
        except Exception:  # noqa: BLE001 - best effort
            pass

    def missing(self, key):
        """The ranks with no arrival at ``key``; None if the store did not answer every read in time."""
        deadline = time.monotonic() + MISSING_BUDGET_S
        missing = []
        for rank in range(self.size):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                self._request("GET", self._url(key, rank), timeout_s=min(STORE_TIMEOUT_S, left))
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    return None
                missing.append(rank)
            except Exception:  # noqa: BLE001 - unreachable, timed out: unknown
                return None
        return missing


class ArrivalKeys:
    """Numbers the calls of each collective name: ``name#0``, ``name#1``, ... (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._calls = collections.Counter()

    def next(self, name):
        with self._lock:
            n = self._calls[name]
            self._calls[name] += 1
        return f"{name}#{n}"


class HorovodCluster:
    """The ranks of a ``horovodrun`` job, over ``horovod.tensorflow``.

    Built when the engine starts; the constructor runs :func:`tfsync._horovod.horovod`'s
    checks (Horovod installed, initialized, the process launched by ``horovodrun``).
    Its arrival record is :class:`RendezvousArrivals` (none without Horovod's Gloo
    rendezvous store), its calls numbered per process (one process is one rank), so
    every instance of a process numbers them alike.
    """

    _keys = ArrivalKeys()  # per process
    _arrivals_lock = threading.Lock()
    _membership = 0  # per process: bumped when Horovod re-forms the job (elastic reset)

    def __init__(self):
        self.hvd = _horovod.horovod()
        self._arrivals = None
        self._arrivals_known = False
        self._membership_seen = HorovodCluster._membership

    @classmethod
    def forget_membership(cls):
        """Horovod re-formed the job (an elastic reset: ``hvd.shutdown(); hvd.init()``): every
        instance in this process reads its rank, size and arrival record anew, and the calls of
        each collective are numbered from zero again, as on a worker that joins at this reset
        (the members must number their calls alike)."""
        with cls._arrivals_lock:
            cls._keys = ArrivalKeys()
            cls._membership += 1

    def rank(self) -> int:
        return self.hvd.rank()

    def size(self) -> int:
        return self.hvd.size()

    def local_rank(self) -> int:
        return self.hvd.local_rank()

    def allgather_object(self, obj, name):
        return self.hvd.allgather_object(obj, name=name)

    def broadcast(self, tensor, root_rank, name):
        return self.hvd.broadcast(tensor, root_rank=root_rank, name=name)

    def broadcast_variables(self, variables, root_rank, name):
        """Horovod's ``broadcast_variables``: the broadcasts launched together in one compiled
        function, assigned in place (no copy of the model is assembled on the host)."""
        self.hvd.broadcast_variables([tf_variable(v) for v in variables], root_rank=root_rank)

    def average(self, tensors, name):
        return self.hvd.grouped_allreduce(list(tensors), op=self.hvd.Average, name=name)

    def broadcast_object(self, obj, root_rank, name):
        return self.hvd.broadcast_object(obj, root_rank=root_rank, name=name)

    def wire_ops(self):
        """``horovod.tensorflow`` itself, checked (:func:`tfsync._horovod.horovod`): the rounds
        are Horovod's own calls (:mod:`tfsync.engine.wire`)."""
        return _horovod.horovod()

    def abort(self):
        """``hvd.shutdown()``: a pending collective on this rank raises at once (Horovod's
        "has been shut down" error), and Horovod tells the other ranks, whose pending and
        later collectives fail too, at once."""
        self.hvd.shutdown()

    def barrier(self, name):
        """An ``hvd.allreduce`` of a scalar zero, to run later (Horovod is re-checked now)."""
        hvd = _horovod.horovod()
        import tensorflow as tf

        return lambda: hvd.allreduce(tf.constant(0.0), op=hvd.Sum, name=name)

    # the arrival record (module docstring)
    def arrival_key(self, name):
        self._record()  # found now, on the caller's thread, while Horovod still knows its rank
        return self._keys.next(name)

    def _record(self):
        with self._arrivals_lock:
            if self._membership_seen != HorovodCluster._membership:
                self._arrivals, self._arrivals_known = None, False
                self._membership_seen = HorovodCluster._membership
            if not self._arrivals_known:
                self._arrivals = RendezvousArrivals.from_env(self.hvd.rank, self.hvd.size)
                self._arrivals_known = True
            return self._arrivals

    def arrive(self, key):
        record = self._record()
        if record is not None:
            record.arrive(key)

    def leave(self, key):
        record = self._record()
        if record is not None:
            record.leave(key)

    def missing(self, key):
        record = self._record()
        return None if record is None else record.missing(key)


__all__ = ["HorovodCluster", "RendezvousArrivals"]
