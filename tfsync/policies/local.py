"""Local SGD and DiLoCo: H local steps per worker, then one outer step over the replicas.

* :class:`LocalSGD`: every worker trains ``period`` steps on its own with its
  own optimizer, then the replicas' weights are averaged (model averaging
  every H steps: Stich, *Local SGD Converges Fast and Communicates Little*,
  ICLR 2019, Algorithm 1; Lin et al., *Don't Use Large Mini-Batches, Use
  Local SGD*, ICLR 2020, Section 2).
* :class:`DiLoCo`: every worker takes ``inner_steps`` steps with its own
  (inner) optimizer; then the pseudo-gradient, the weights at the last outer
  step minus the weights now, is averaged over the workers and applied to the
  last outer weights by an outer optimizer, identically on every replica
  (Douillard et al., *DiLoCo: Distributed Low-Communication Training of
  Language Models*, 2023, Section 2 and Algorithm 1: inner AdamW, outer SGD
  with Nesterov momentum 0.9 and learning rate 0.7).

Both are one round per *outer* step: the engine's steps are the outer steps
(an inner step is not a contribution and enters no round), and each outer
step waits for its own round, as BSP's step does, except under DiLoCo's
streaming variant (``overlap_steps``: *Streaming DiLoCo with overlapping
communication*, Douillard et al., 2025), whose round lands ``overlap_steps``
inner steps after it was sent.  The step protocol
(:class:`tfsync.engine.protocols.outer.OuterStepProtocol`) keeps the weights of the
last outer step and applies the round.  Pure settings here: no TensorFlow,
no Keras (an outer optimizer given as a Keras optimizer is kept as its
serialized configuration).
"""

import dataclasses
import json

from tfsync.policies.base import Policy

# the codes an outer round can travel in (tfsync.engine.wire.quantized): None is float32
QUANTIZE = (None, "int8", "int4")
QUANTIZE_BLOCK = 256  # values sharing one float32 scale

# DiLoCo's outer optimizer (Douillard et al. 2023, Section 3, "outer optimizer"): SGD with
# Nesterov momentum 0.9 and learning rate 0.7
DEFAULT_OUTER_LEARNING_RATE = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
DEFAULT_INNER_STEPS = 8  # (the paper's 500 is for language models with tens of thousands of steps)


def _check_steps(owner, name, value, example):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}({name}={value!r}): {name} must be an int >= 1 (the local steps every worker takes "
            f"between two averagings), got {type(value).__name__}; e.g. {example}"
        )
    if value < 1:
        raise ValueError(
            f"{owner}({name}={value}): {name} must be >= 1 (1 averages after every step, as BSP does); "
            f"e.g. {example}"
        )


def sgd_config(learning_rate, momentum=0.0, nesterov=False) -> dict:
    """The serialized configuration of ``keras.optimizers.SGD(learning_rate, momentum, nesterov)``
    (what :class:`DiLoCo` keeps of an outer optimizer; built without importing Keras)."""
    return {
        "module": "keras.optimizers",
        "class_name": "SGD",
        "config": {"learning_rate": float(learning_rate), "momentum": float(momentum), "nesterov": bool(nesterov)},
        "registered_name": None,
    }


def outer_config(optimizer) -> dict:
    """A Keras optimizer as the plain data :class:`DiLoCo` keeps (``keras.optimizers.serialize``,
    less the per-process ``name``), checked: raises with what was wrong and how to fix it."""
    example = "e.g. outer_optimizer=keras.optimizers.SGD(learning_rate=0.7, momentum=0.9, nesterov=True)"
    if not (hasattr(optimizer, "get_config") and hasattr(optimizer, "apply") and hasattr(optimizer, "build")):
        raise TypeError(
            f"DiLoCo(outer_optimizer={optimizer!r}): expected a Keras optimizer instance (or None for "
            f"SGD with Nesterov momentum 0.9 and learning rate 0.7, the paper's), got {type(optimizer).__name__}; "
            f"{example}"
        )
    if hasattr(optimizer, "inner_optimizer"):
        raise ValueError(
            f"DiLoCo(outer_optimizer={type(optimizer).__name__}): a loss-scaling optimizer unscales "
            f"gradients of a scaled loss, and the outer step's pseudo-gradient is a difference of weights, "
            f"never scaled; pass the optimizer it wraps, {example}"
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            f"DiLoCo(outer_optimizer=...gradient_accumulation_steps={optimizer.gradient_accumulation_steps}): "
            f"an accumulating outer optimizer would move the weights only at every "
            f"{optimizer.gradient_accumulation_steps}th outer step and leave the others' averaged "
            f"pseudo-gradients in its accumulators; leave gradient_accumulation_steps unset and raise "
            f"inner_steps instead"
        )
    settings = [
        f"{name}={getattr(optimizer, name)!r}"
        for name in ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay", "loss_scale_factor")
        if getattr(optimizer, name, None)
    ] + (["use_ema=True"] if getattr(optimizer, "use_ema", False) else [])
    if settings:
        raise ValueError(
            f"DiLoCo(outer_optimizer={type(optimizer).__name__}(..., {', '.join(settings)})): the outer step "
            f"runs the optimizer's update rule on each weight (its update_step, identically on every replica); "
            f"clipping, weight decay, loss scaling and EMA are not part of it. Leave those settings unset on "
            f"the outer optimizer (set them on the model's, the inner, optimizer), {example}"
        )
    import keras  # (only here: the policies import no framework)

    config = keras.optimizers.serialize(optimizer)
    config["config"].pop("name", None)  # (Keras numbers unnamed optimizers per process)
    return json.loads(json.dumps(config))  # plain data: compared across ranks, written to traces


def _check_quantize(who, value, compression, example):
    if value not in QUANTIZE:
        raise ValueError(
            f"{who}(quantize={value!r}): quantize must be None (float32 outer rounds), 'int8' (int8 codes "
            f"with one scale per block of {QUANTIZE_BLOCK} values) or 'int4' (4-bit codes with error "
            f"feedback); e.g. {example}"
        )
    if value is not None and compression is not None:
        raise ValueError(
            f"{who}(quantize={value!r}, compression={compression!r}): the outer round travels either "
            f"quantized or cast to 16 bits; pass one of the two (quantize sends fewer bytes)"
        )


@dataclasses.dataclass(frozen=True)
class LocalSGD(Policy):
    """Local SGD (periodic model averaging): ``period`` local steps, then the replicas average.

    Every worker trains ``period`` steps with its own optimizer on its own
    batches; at every ``period``-th step (an *outer step*) the replicas'
    weights are averaged through the engine (one round: bounded wait,
    counted, traced) and every worker goes on from the average (Stich,
    *Local SGD Converges Fast and Communicates Little*, ICLR 2019,
    Algorithm 1; Lin et al., *Don't Use Large Mini-Batches, Use Local SGD*,
    ICLR 2020, Section 2).  The round carries the change of each worker's
    weights since the last outer step, ``w_outer - w_i``; every replica sets
    ``w_outer ← w_outer - mean``, which is the mean of the ``w_i``.

    Decisions, as the papers make them (docs/modes/localsgd.md):

    * the optimizer's state (momentum, Adam's moments, ``iterations``) stays
      local to each worker and is neither averaged nor reset (Lin et al.'s
      local momentum, Section 2); a learning-rate schedule therefore counts
      local steps, every step of the job;
    * the model's non-trainable floating-point variables (BatchNormalization's
      moving statistics) are averaged with the weights at every outer step, in
      the same round, so a replica is identical to the others after every
      outer step, statistics included;
    * steps left when training ends (fewer than ``period``) get one last outer
      step, so every replica ends identical.

    Guarantees (tested): the replicas' weights and statistics are identical
    after every outer step; ``LocalSGD(period=1)`` with plain SGD (no momentum)
    trains as BSP does, to float tolerance; an outer step's contribution is
    counted as every mode's (``produced`` = ``applied`` + ``rejected``; an inner
    step is no contribution); a worker whose gradients were not finite in any
    step of a period has that period's contribution rejected and restarts from
    the new average.

    Args:
        period: ``H``, local steps between two averagings (int ``>= 1``). Default 8.
        quantize: ``None`` (default: the outer round in float32), ``"int8"`` (int8 codes with
            one float32 scale per block of 256 values: about 0.25 of the bytes) or ``"int4"``
            (4-bit codes with error feedback: each worker keeps the error of its last
            contribution's codes and adds it to its next one; about 0.13 of the bytes).  The
            round is then an alltoall of each worker's quantized chunks, a float32 sum of its
            own chunk and an all-gather of the quantized result, so the bytes fall at any
            worker count and every replica decodes the same bytes
            (:mod:`tfsync.engine.wire.quantized`).
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.LocalSGD(period=8))   # or mode="localsgd"
    """

    period: int = DEFAULT_INNER_STEPS
    quantize: str = None
    name = "localsgd"
    payload = "pseudo_gradients"
    overlap_steps = 0  # (DiLoCo's streaming variant only: every outer step waits for its round)
    mixing = 0.0

    def __post_init__(self):
        super().__post_init__()
        _check_steps("LocalSGD", "period", self.period, "tfsync.LocalSGD(period=8)")
        _check_quantize("LocalSGD", self.quantize, self.compression, "tfsync.LocalSGD(period=8, quantize='int8')")

    @property
    def inner_steps(self) -> int:
        """Local steps per outer step (the protocol's ``H``)."""
        return self.period

    @property
    def outer_optimizer_config(self):
        """None: the outer step is the plain average."""
        return None

    def required_round(self, step: int) -> int:
        # an outer step waits for its own round: the average every replica goes on from
        return step


@dataclasses.dataclass(frozen=True)
class DiLoCo(Policy):
    """DiLoCo: ``inner_steps`` local steps, then an outer optimizer step on the averaged pseudo-gradient.

    Every worker takes ``inner_steps`` steps with the model's optimizer (the
    inner optimizer; the paper's is AdamW) on its own batches.  At every
    ``inner_steps``-th step (an *outer step*) the pseudo-gradient
    ``Δ_i = w_outer - w_i`` (the weights at the last outer step minus this
    worker's weights now) is averaged over the workers in one round through
    the engine, and every replica applies the outer optimizer to ``w_outer``
    with the mean ``Δ`` as its gradient, then goes on from the new
    ``w_outer`` (Douillard et al., *DiLoCo: Distributed Low-Communication
    Training of Language Models*, 2023, Algorithm 1).  The outer optimizer's
    state is identical on every replica (the same gradients from the same
    start), so the replicas are identical after every outer step.

    Decisions, as the paper makes them (docs/modes/diloco.md):

    * the inner optimizer's state (AdamW's moments, ``iterations``) stays on
      each worker across outer steps, neither averaged nor reset (Algorithm 1
      keeps one inner optimizer per worker); a learning-rate schedule of the
      inner optimizer counts inner steps; the outer optimizer's own schedule,
      if any, counts outer steps;
    * non-trainable floating-point variables (BatchNormalization's moving
      statistics) are averaged at every outer step in the same round, without
      the outer optimizer (they are statistics, not parameters);
    * steps left when training ends (fewer than ``inner_steps``) get one last
      outer step, so every replica ends identical (overlapped: if the period's
      round is in flight it lands instead, and the steps after its push are
      dropped, as with ``mixing=0`` during training);
    * a round in which no worker's contribution was finite moves nothing (the
      outer optimizer does not step on zeros: its momentum would).

    Guarantees (tested): replicas identical after every outer step (with ``overlap_steps``:
    when its round lands, and only with ``mixing=0``; the outer weights ``w_outer`` are identical
    on every replica in every case, and so is every replica at the end of training); with
    ``outer_optimizer=keras.optimizers.SGD(learning_rate=1.0)`` (no momentum)
    it trains as :class:`LocalSGD` with ``period=inner_steps`` does, to float
    tolerance; every outer step's contribution is counted.

    Args:
        inner_steps: ``H``, inner steps per outer step (int ``>= 1``). Default 8 (the paper
            uses 500 for language models trained tens of thousands of steps).
        outer_optimizer: a Keras optimizer whose configuration runs the outer steps (a fresh
            instance of it per training run, its state starting at zero on every replica; or
            that configuration, ``keras.optimizers.serialize``'s dict), or ``None`` (default):
            ``SGD(learning_rate=0.7, momentum=0.9, nesterov=True)``, the paper's.  Its update
            rule runs on each weight (``update_step``) at its learning rate (a schedule counts
            outer steps); a ``LossScaleOptimizer``, gradient accumulation,
            clipping, weight decay, a loss scale factor and EMA are refused.
        overlap_steps: ``τ``, the streaming variant's overlap (int, ``0 <= τ < inner_steps``).
            Default 0: the outer step waits for its round.  With ``τ > 0`` a worker sends its
            pseudo-gradient ``τ`` inner steps before the period ends and trains on while the
            round is in flight; at the period's end it waits for the round (by then usually
            complete), the outer optimizer steps, and the worker's weights become
            ``(1 - mixing)·w_outer + mixing·w_i`` (*Streaming DiLoCo with overlapping
            communication: Towards a Distributed Free Lunch*, Douillard et al., 2025: its
            overlapping of communication with computation, with torchft's
            ``fragment_sync_delay`` and ``fragment_update_alpha`` semantics for one fragment).
        mixing: ``α`` in [0, 1], the share of the worker's own weights kept when the overlapped
            round lands (default 0: the ``τ`` steps made meanwhile are dropped, and the replicas
            are identical after every outer step; above 0 they keep part of that progress and
            differ by it; only with ``overlap_steps > 0``).
        fragments: ``P``, the parts of the model whose outer steps are spread over the period
            (int from 1 to ``inner_steps``; default 1: the whole model at every ``inner_steps``-th
            step).  Streaming DiLoCo's fragments (Douillard et al., 2025): the weight tensors in
            ``P`` consecutive groups of about equal size; fragment ``p``'s outer step comes at inner
            step ``(p + 1)·H/P`` of each period (with ``overlap_steps``, its exchange sent that many
            steps before, ``overlap_steps < H/P``), so each round carries about ``1/P`` of the model
            and the bytes in flight at a time fall by about ``P``; overlapped, each fragment's
            round is paced over its window (:mod:`tfsync.engine.wire.pacing`), so the link's peak
            rate falls too where the window has room.  Each fragment still takes one
            outer step per period (one round each: a period counts ``P`` contributions); the outer
            optimizer's iterations count periods.  Training that ends mid-period ends with one
            round of the whole model.
        quantize: ``None`` (default), ``"int8"`` or ``"int4"``: the outer round's codes, as
            :class:`LocalSGD`'s (:mod:`tfsync.engine.wire.quantized`).
        compression: None (default), ``"fp16"`` or ``"bf16"``, keyword only: the rounds' floating
            tensors in 16 bits on the wire (:mod:`tfsync.engine.wire.compression`).

    Example:

        tfsync.keras.SyncCallback(mode=tfsync.DiLoCo(inner_steps=8))   # or mode="diloco"
    """

    inner_steps: int = DEFAULT_INNER_STEPS
    outer_optimizer: object = None
    overlap_steps: int = 0
    mixing: float = 0.0
    quantize: str = None
    fragments: int = 1
    name = "diloco"
    payload = "pseudo_gradients"

    def __post_init__(self):
        super().__post_init__()
        _check_steps("DiLoCo", "inner_steps", self.inner_steps, "tfsync.DiLoCo(inner_steps=8)")
        _check_quantize("DiLoCo", self.quantize, self.compression, "tfsync.DiLoCo(inner_steps=8, quantize='int4')")
        example = "e.g. tfsync.DiLoCo(inner_steps=8, overlap_steps=2)"
        fragments = self.fragments
        if isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= self.inner_steps:
            raise ValueError(
                f"DiLoCo(inner_steps={self.inner_steps}, fragments={fragments!r}): fragments must be an int from 1 "
                f"to inner_steps (the model's parts whose outer steps are spread over the period, one every "
                f"inner_steps / fragments inner steps; 1: the whole model at once); e.g. "
                f"tfsync.DiLoCo(inner_steps=8, fragments=4)"
            )
        tau = self.overlap_steps
        slot = self.inner_steps // fragments
        if isinstance(tau, bool) or not isinstance(tau, int) or not 0 <= tau < slot:
            within = "inner_steps" if fragments == 1 else f"inner_steps // fragments = {slot}"
            raise ValueError(
                f"DiLoCo(inner_steps={self.inner_steps}, fragments={fragments}, overlap_steps={tau!r}): "
                f"overlap_steps must be an int >= 0 and below {within} (the inner steps each outer exchange "
                f"overlaps, sent that many steps before its outer step; 0: the outer step waits for it); {example}"
            )
        alpha = self.mixing
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0.0 <= alpha <= 1.0:
            raise ValueError(
                f"DiLoCo(mixing={alpha!r}): mixing must be a number in [0, 1] (the share of a worker's own "
                f"weights kept when the overlapped outer step lands; 0: the outer weights alone); "
                f"e.g. tfsync.DiLoCo(overlap_steps=2, mixing=0.5)"
            )
        if alpha and not tau:
            raise ValueError(
                f"DiLoCo(mixing={alpha!r}, overlap_steps=0): mixing keeps part of the progress a worker made "
                f"while its outer exchange was in flight, and without overlap_steps there is none (the "
                f"replicas would only drift apart); set overlap_steps, {example}, or leave mixing at 0"
            )
        if self.outer_optimizer is not None and not isinstance(self.outer_optimizer, dict):
            object.__setattr__(self, "outer_optimizer", outer_config(self.outer_optimizer))
        elif isinstance(self.outer_optimizer, dict) and "class_name" not in self.outer_optimizer:
            raise ValueError(
                f"DiLoCo(outer_optimizer={self.outer_optimizer!r}): a dict must be a serialized Keras "
                f"optimizer (keras.optimizers.serialize(...)); pass the optimizer itself, e.g. "
                f"outer_optimizer=keras.optimizers.SGD(learning_rate=0.7, momentum=0.9, nesterov=True)"
            )
        if self.outer_optimizer == sgd_config(DEFAULT_OUTER_LEARNING_RATE, DEFAULT_OUTER_MOMENTUM, nesterov=True):
            object.__setattr__(self, "outer_optimizer", None)  # (the default, as the launcher spells it)

    def __hash__(self):
        outer = json.dumps(self.outer_optimizer, sort_keys=True)
        settings = (self.inner_steps, outer, self.overlap_steps, self.mixing, self.quantize, self.fragments)
        return hash((self.name, *settings, self.compression))

    @property
    def outer_optimizer_config(self) -> dict:
        """The outer optimizer's serialized configuration (the paper's Nesterov SGD by default)."""
        if self.outer_optimizer is None:
            return sgd_config(DEFAULT_OUTER_LEARNING_RATE, DEFAULT_OUTER_MOMENTUM, nesterov=True)
        return self.outer_optimizer

    def outer_label(self) -> str:
        """A short description of the outer optimizer, for tables: ``SGD(lr=0.7, nesterov 0.9)``."""
        config = self.outer_optimizer_config
        settings = config.get("config", {})
        lr = settings.get("learning_rate")
        parts = [f"lr={round(lr, 6) if isinstance(lr, float) else 'schedule'}"]
        if settings.get("momentum"):
            kind = "nesterov" if settings.get("nesterov") else "momentum"
            parts.append(f"{kind} {round(settings['momentum'], 6)}")
        return f"{config.get('class_name')}({', '.join(parts)})"

    def required_round(self, step: int) -> int:
        # overlapped: the outer step's round lands overlap_steps inner steps later (the frontend
        # waits for it then); the push itself needs only the previous round, applied already
        return step - 1 if self.overlap_steps else step

    def config(self) -> dict:
        return {
            "mode": self.name,
            "inner_steps": self.inner_steps,
            "outer_optimizer": self.outer_optimizer_config,
            "overlap_steps": self.overlap_steps,
            "mixing": self.mixing,
            "quantize": self.quantize,
            "fragments": self.fragments,
            "compression": self.compression,
        }


__all__ = ["LocalSGD", "DiLoCo"]
