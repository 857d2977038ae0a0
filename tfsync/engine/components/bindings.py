"""What the engine adds for each built-in mode: its step components and rank 0's service.

A policy is pure (:mod:`tfsync.policies`: no threads, no TensorFlow, nothing
of the engine); the engine binds the built-in ones to the machinery that
serves them, here, once:

* DSSP: its grants (:class:`~tfsync.engine.components.grants.Grants` on every worker, the
  synchronization controller :class:`~tfsync.engine.components.grants.GrantService` on
  rank 0);
* ElasticBSP: its supersteps (:class:`~tfsync.engine.components.supersteps.Supersteps`);
* PSP: partial pulling (:class:`~tfsync.engine.components.pull.PartialPull`) when it pulls
  partially; PSP and backup workers: late contributions held and compensated
  (:class:`~tfsync.engine.components.late.LateContributions`) with ``compensate=``.

A mode defined outside tfsync supplies its own through the policy's hooks
(:meth:`Policy.components <tfsync.policies.Policy.components>`,
:meth:`Policy.service <tfsync.policies.Policy.service>`), which the engine calls
for every policy, after these.  A subclass of a built-in policy keeps its
parent's binding.
"""

from tfsync.engine.components.grants import Grants, GrantService
from tfsync.engine.components.late import LateContributions
from tfsync.engine.components.pull import PartialPull
from tfsync.engine.components.supersteps import Supersteps
from tfsync.policies import DSSP, PSP, BackupWorkers, ElasticBSP


def _late(policy):
    return [LateContributions(policy.compensate)] if policy.compensate is not None else []


_COMPONENTS = {
    DSSP: lambda p: [Grants(p)],
    ElasticBSP: lambda p: [Supersteps(p)],
    PSP: lambda p: ([PartialPull(p)] if p.pulls_partially else []) + _late(p),
    BackupWorkers: _late,
}
_SERVICES = {DSSP: GrantService}


def _bound(table, policy):
    for cls in type(policy).__mro__:
        if cls in table:
            return table[cls]
    return None


def components(policy) -> list:
    """The step components of ``policy``'s engine: its built-in binding's, then the policy's own."""
    bound = _bound(_COMPONENTS, policy)
    return [*(bound(policy) if bound is not None else []), *policy.components()]


def service(policy, size: int):
    """What rank 0's control service runs for ``policy`` beyond closing rounds, or None."""
    bound = _bound(_SERVICES, policy)
    return bound(policy, size) if bound is not None else policy.service(size)


__all__ = ["components", "service"]
