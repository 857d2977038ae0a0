"""What a mode adds to the engine's step: the :class:`StepComponent` interface and the built-in
modes' components, bound to their modes in one table.

* :mod:`~tfsync.engine.components.base`: the interface, every hook and what a component may use;
* :mod:`~tfsync.engine.components.bindings`: the one table binding the built-in modes to their
  components and rank 0's services (the only module of the engine that names a policy class);
* :mod:`~tfsync.engine.components.grants`: DSSP's grants and rank 0's controller;
* :mod:`~tfsync.engine.components.supersteps`: ElasticBSP's supersteps;
* :mod:`~tfsync.engine.components.pull`: PSP's partial pulling;
* :mod:`~tfsync.engine.components.late`: late contributions, held and offered (``compensate=``).
"""

from tfsync.engine.components.base import StepComponent

__all__ = ["StepComponent"]
