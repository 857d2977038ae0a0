"""Fault injection: a schedule of faults, injected into a running job, to try its fault tolerance.

The way torchft's ``EventInjector`` and Horovod's elastic ``exit_schedule`` tests do it: a
:class:`Schedule` of :class:`Fault` s, each at a rank and a step or at a time, and an injector
that makes them happen.

Kinds that happen inside a worker (:class:`Injector`, a Keras callback of that worker's ``fit``):

* ``"kill"``: the worker's process ends at once (SIGKILL): a lost process, as a machine loses it.
* ``"stop"``: the process stops (SIGSTOP) for ``duration_s`` seconds (then a helper process sends
  SIGCONT), or for good with ``duration_s=None``: a hung worker (``tfsync.elastic``'s hang guard
  ends it once its peers have given up on it).
* ``"hang"``: the training step's thread blocks for ``duration_s`` seconds, or for good with
  ``duration_s=None``, while the process's other threads go on: a deadlock, or a kernel that
  never returns (``tfsync.elastic``'s hang guard ends it once its peers have given up on it; the
  injector must come after the ``SyncCallback`` in ``fit``'s callbacks, so that the hang is in
  the step the guard bounds).
* ``"raise"``: the training step raises :class:`InjectedFault`: the program's own error, which
  ends the worker's process with a traceback.
* ``"nan"``: the step's loss (so its gradients, the worker's contribution) is NaN: the model's
  loss must be wrapped by :meth:`Injector.loss` when it is compiled.

Kinds that happen to a host (:class:`HostFaults`, on the machine that runs the harness, given
what acts on the hosts: :class:`tfsync.bench.hosts.Hosts` for simulated ones):

* ``"link_cut"``: the host's network link is down for ``duration_s`` seconds;
* ``"link_flap"``: down and up every ``FLAP_S`` seconds for ``duration_s`` seconds;
* ``"host_removed"``: the host is dropped from the launcher's discovery for ``duration_s``
  seconds, then listed again (Horovod's elastic launcher ends its workers and starts new ones
  when it comes back).

A fault is at ``step`` (the optimizer's iteration count, ``model.optimizer.iterations``, as a
step begins: elastic resets set it back to the commit, so a step is reached again) or at
``at_s`` (seconds after the schedule's ``start_t``); an in-process fault happens to the worker
that has ``rank`` then (``rank % size`` after the job shrank).  Each fault happens once: given a
``ledger_dir`` shared by the job's processes (one host's disk, or the simulated hosts' common
one), the worker that injects it records it there first (created exclusively), so a restarted
or re-formed worker does not repeat it; without one, once per process.

Example:

    schedule = tfsync.faults.Schedule([
        tfsync.faults.Fault("kill", rank=1, step=200),
        tfsync.faults.Fault("stop", rank=2, at_s=60, duration_s=None),   # hangs for good
        tfsync.faults.Fault("nan", rank=0, step=50),
    ])
    injector = tfsync.faults.Injector(schedule, ledger_dir="/shared/faults")
    model.compile(optimizer="sgd", loss=injector.loss("sparse_categorical_crossentropy"))
    model.fit(x, y, callbacks=[sync, injector])
"""

from tfsync.faults.schedule import (
    FLAP_S,
    HOST_KINDS,
    KINDS,
    WORKER_KINDS,
    Fault,
    HostFaults,
    InjectedFault,
    Ledger,
    Schedule,
)


def __getattr__(name):
    # the worker's side, a Keras callback, loads Keras on first use: the harness's side stays light
    if name == "Injector":
        from tfsync.faults.injector import FaultInjector

        return FaultInjector
    raise AttributeError(f"module 'tfsync.faults' has no attribute {name!r}")


__all__ = [
    "FLAP_S",
    "HOST_KINDS",
    "KINDS",
    "WORKER_KINDS",
    "Fault",
    "HostFaults",
    "InjectedFault",
    "Ledger",
    "Schedule",
]
