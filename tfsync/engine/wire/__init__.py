"""What a round puts on the wire and how it is reduced, opened once per engine.

A step protocol asks for a :class:`Round` (whether it averages, whether its payload travels
quantized), not for a collective; :func:`open_wire` turns that, the policy's ``compression``
and the cluster's Horovod operations into the engine's :class:`Wire`, once, when the engine
starts, as Horovod's ``DistributedOptimizer`` factory decides its exchange once.  One module
per concern:

* :mod:`~tfsync.engine.wire.layout`: the metadata block beside the payload, and the chunks of a
  reduce-scatter;
* :mod:`~tfsync.engine.wire.horovod`: the round over ``hvd.grouped_allreduce`` (float32, or its
  floating tensors in 16 bits under ``compression=``);
* :mod:`~tfsync.engine.wire.quantized`: the quantized round (``quantize="int8" | "int4"``);
* :mod:`~tfsync.engine.wire.compression`: what ``compression=`` means: the wire type and the
  range a contribution must keep to;
* :mod:`~tfsync.engine.wire.counting`: the bytes every round puts on the wire;
* :mod:`~tfsync.engine.wire.pacing`: a round in pieces over its window (Streaming DiLoCo);
* :mod:`~tfsync.engine.wire.checked`: an open round whose sum is checked instead of each
  contribution (BSP), redone without what is not finite.
"""

import dataclasses

from tfsync.engine.wire.compression import WireFormat, wire_dtype
from tfsync.engine.wire.counting import WireBytes, counted
from tfsync.engine.wire.horovod import horovod_collective
from tfsync.engine.wire.layout import META_WIDTH
from tfsync.engine.wire.quantized import quantized_collective
from tfsync.policies.base import check_compression


@dataclasses.dataclass(frozen=True)
class Round:
    """What a step protocol asks of its rounds.

    Args:
        averages: the round's collective averages the contributions (Horovod's ``Average``);
            False: it sums them.
        quantize: ``None`` (the payload in its own dtype, or the policy's ``compression``), or
            ``"int8"`` / ``"int4"``: the payload travels quantized
            (:mod:`~tfsync.engine.wire.quantized`).
    """

    averages: bool = False
    quantize: str = None


class Wire:
    """One engine's wire: the round's collective (each call's bytes counted), what
    ``compression`` means for the job, and its bytes so far.

    Attributes:
        collective: ``collective(payload, meta, divisor=None, part=None) -> (total, meta)``,
            what the exchange runs for every round.
        compression: ``None``, ``"fp16"`` or ``"bf16"`` (checked).
        bytes: the :class:`~tfsync.engine.wire.counting.WireBytes` of every round so far.
        format: the :class:`~tfsync.engine.wire.compression.WireFormat` a contribution must keep
            to under ``compression``, or None.
    """

    def __init__(self, collective, compression, wire_bytes, wire_format):
        self.collective = counted(collective, wire_bytes)
        self.compression, self.bytes, self.format = compression, wire_bytes, wire_format

    def round_bytes(self, payload) -> float:
        """What one round of ``payload`` puts on the wire, each way (a paced round's pieces are
        cut from it)."""
        return self.bytes.per_call([t.shape for t in payload], [t.dtype for t in payload])["bytes_sent"]


def open_wire(policy, cluster, size: int, round_: Round) -> Wire:
    """The :class:`Wire` of an engine running ``policy`` on ``cluster`` (``size`` ranks), whose
    step protocol asks for ``round_``: the cluster's Horovod operations (:meth:`wire_ops
    <tfsync.engine.cluster.HorovodCluster.wire_ops>`) reduce it, quantized where ``round_`` says,
    its floating tensors in ``policy.compression``'s wire type where the policy sets one."""
    compression = check_compression(type(policy).__name__, policy.compression)
    ops = cluster.wire_ops()
    if round_.quantize is not None:
        collective = quantized_collective(round_.quantize, round_.averages, hvd=ops)
    else:
        collective = horovod_collective(round_.averages, hvd=ops, compression=compression)
    wire_bytes = WireBytes(size, compression, META_WIDTH, round_.quantize)
    per_rank = 2 if policy.compensate is not None else 1  # (a late contribution beside a fresh one)
    wire_format = WireFormat(compression, size, per_rank) if compression else None
    return Wire(collective, compression, wire_bytes, wire_format)


__all__ = ["Round", "Wire", "WireBytes", "WireFormat", "open_wire", "wire_dtype"]
