"""The step protocols a policy can name, one module each, and their registry.

A policy names its protocol by ``policy.payload``; the engine builds the
protocol object once, when it starts, as Horovod's ``DistributedOptimizer``
factory decides its exchange once, and the frontends install the protocol's
optimizer path (:mod:`~tfsync.engine.protocols.path`).  Nothing outside this
package asks a protocol what it is.

* :class:`GradientProtocol` (``"gradients"``, BSP, PSP, backup workers):
  :mod:`~tfsync.engine.protocols.gradient`;
* :class:`UpdateProtocol` (``"updates"``, SSP, DSSP, ElasticBSP):
  :mod:`~tfsync.engine.protocols.update`;
* :class:`CompensatedUpdateProtocol` (``"compensated_updates"``, DC-S3GD):
  :mod:`~tfsync.engine.protocols.compensated`;
* :class:`OuterStepProtocol` (``"pseudo_gradients"``, Local SGD, DiLoCo):
  :mod:`~tfsync.engine.protocols.outer`.

The payload never leaves TensorFlow: the optimizer paths hand the tensors to
the engine through ``tf.py_function`` (which passes the tensors themselves,
not NumPy copies), the exchange thread gives them to ``hvd.grouped_allreduce``,
and each protocol's state updates run as compiled functions over its
variables.  Every contribution comes with whether each of its tensors is
finite, found where it is built; the engine rejects one that is not
(:mod:`tfsync.engine.nonfinite`), and :meth:`StepProtocol.reject` first takes
back what it already did to this worker's weights.

A new protocol is one module (a :class:`StepProtocol` subclass and its
:class:`OptimizerPath`) and one :func:`register` call.
"""

from tfsync.engine._tf import floating_statistics, tf_variable
from tfsync.engine.protocols.base import StepProtocol
from tfsync.engine.protocols.compensated import CompensatedUpdateProtocol
from tfsync.engine.protocols.gradient import GradientProtocol
from tfsync.engine.protocols.outer import OuterStepProtocol
from tfsync.engine.protocols.path import OptimizerPath
from tfsync.engine.protocols.update import UpdateProtocol

_PROTOCOLS = {}


def register(protocol: type) -> type:
    """Register a step protocol under its ``payload`` (a new name; returns the class)."""
    if not (isinstance(protocol, type) and issubclass(protocol, StepProtocol)):
        raise TypeError(
            f"tfsync: register({protocol!r}): a step protocol subclasses tfsync.engine.protocols.StepProtocol"
        )
    name = protocol.payload
    if not isinstance(name, str) or not name:
        raise ValueError(f"tfsync: register({protocol.__name__}): set its payload, the name policies give it")
    if name in _PROTOCOLS and _PROTOCOLS[name] is not protocol:
        raise ValueError(f"tfsync: a step protocol named {name!r} is registered already ({_PROTOCOLS[name].__name__})")
    _PROTOCOLS[name] = protocol
    return protocol


def names() -> tuple:
    """Every registered protocol's name, in registration order."""
    return tuple(_PROTOCOLS)


def for_policy(policy) -> type:
    """The protocol class ``policy`` names (``policy.payload``), checked against the policy."""
    try:
        protocol = _PROTOCOLS[policy.payload]
    except KeyError:
        raise ValueError(
            f"tfsync: policy {policy.name!r} names the unknown protocol {policy.payload!r}; "
            f"expected one of {sorted(_PROTOCOLS)}"
        ) from None
    protocol.check_policy(policy)
    return protocol


def optimizer_path(policy, engine, optimizer=None, station="apply", shared=False) -> OptimizerPath:
    """The optimizer path of ``policy``'s protocol (:meth:`StepProtocol.optimizer_path`)."""
    return for_policy(policy).optimizer_path(policy, engine, optimizer, station, shared)


for _protocol in (GradientProtocol, UpdateProtocol, CompensatedUpdateProtocol, OuterStepProtocol):
    register(_protocol)

__all__ = [
    "CompensatedUpdateProtocol",
    "GradientProtocol",
    "OptimizerPath",
    "OuterStepProtocol",
    "StepProtocol",
    "UpdateProtocol",
    "floating_statistics",
    "for_policy",
    "names",
    "optimizer_path",
    "register",
    "tf_variable",
]
