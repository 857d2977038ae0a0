"""What the engine takes from the job's ranks, behind one small interface.

A :class:`~tfsync.engine.SyncEngine` talks to its peers through a *cluster*
object, injected as ``SyncEngine(..., cluster=...)``, as the conventions ask
of everything that talks to the outside world:

* ``rank()``, ``size()``: this worker's rank and the number of workers;
* ``allgather_object(obj, name)``: every rank's ``obj``, in rank order;
* ``broadcast_object(obj, root_rank, name)``: ``root_rank``'s ``obj`` on every rank;
* ``collective(average)``: the round collective the
  :class:`~tfsync.engine.exchange.RoundExchange` runs,
  ``collective(payload, meta, divisor=None) -> (total, meta)``;
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
  rank fail at once.  The engine calls it from a watchdog thread when a
  round that runs on the training thread (BSP's inline round) outlasts the
  wait bound, so that wait ends as every other one does.

The engine and the frontends (:mod:`tfsync.frontend`) call them from at most
one thread at a time per rank, in the same order on every rank; nothing else
in tfsync's training path calls Horovod.  In production (``cluster=None``) it is
:class:`HorovodCluster`: the same Horovod calls, with the same names and in
the same order, as the engine made before this interface existed.  The
single-process tests pass N ranks on threads (``tests/single/fake_cluster.py``),
and a simulator can do the same.
"""

from tfsync import _horovod
from tfsync.engine import protocols


class HorovodCluster:
    """The ranks of a ``horovodrun`` job, over ``horovod.tensorflow``.

    Built when the engine starts; the constructor runs :func:`tfsync._horovod.horovod`'s
    checks (Horovod installed, initialized, the process launched by ``horovodrun``).
    """

    def __init__(self):
        self.hvd = _horovod.horovod()

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
        self.hvd.broadcast_variables([protocols.tf_variable(v) for v in variables], root_rank=root_rank)

    def average(self, tensors, name):
        return self.hvd.grouped_allreduce(list(tensors), op=self.hvd.Average, name=name)

    def broadcast_object(self, obj, root_rank, name):
        return self.hvd.broadcast_object(obj, root_rank=root_rank, name=name)

    def collective(self, average: bool):
        """One ``hvd.grouped_allreduce`` per round: :func:`tfsync.engine.protocols.horovod_collective`."""
        return protocols.horovod_collective(average)

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


__all__ = ["HorovodCluster"]
