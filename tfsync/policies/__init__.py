"""Synchronization policies: what a worker waits for, as a pure function of clocks.

A policy knows nothing of sockets, threads or TensorFlow.  The engine
(:mod:`tfsync.engine`) runs numbered *rounds*: in round ``r`` every worker
contributes the payload of its step ``r`` and receives the sum of all
contributions.  A policy answers two questions:

* ``payload``: what a worker contributes, i.e. which step protocol of
  :mod:`tfsync.engine.protocols` the engine builds for it.  ``"gradients"``: the raw gradient,
  exchanged *before* the optimizer runs and applied as the workers' average
  (exactly what ``hvd.allreduce`` + optimizer does).  ``"updates"``: the change
  the local optimizer made, ``Δ = U(g)``, exchanged *after* it was applied locally
  (additive updates, as in SSP's parameter-server model, Ho et al. 2013).
  ``"compensated_updates"`` (DC-S3GD, :mod:`tfsync.policies.compensation`):
  the gradient is corrected for the round it is late before the optimizer
  runs, and the change the optimizer made is averaged.
  ``"pseudo_gradients"`` (Local SGD, DiLoCo, :mod:`tfsync.policies.local`): every worker
  takes ``H`` steps on its own; every ``H``-th step (an outer step) contributes the change
  of its weights since the last one, averaged (DiLoCo: through an outer optimizer).
* ``required_round(step)``: the newest round that must be complete before the
  worker passes the synchronization point of ``step``.  For ``"gradients"``
  that point is before applying step ``step``'s gradient; for ``"updates"``
  it is before computing step ``step``.

Because every worker evaluates the same pure function on the same inputs, the
workers agree on every decision without a coordinator.

BSP and SSP close round ``r`` when every worker has contributed, a rule each
worker can apply alone: its communication thread enters round ``r`` as soon as
its own contribution is ready, and Horovod's allreduce is the barrier.  The
modes timed from measured iteration times (:mod:`tfsync.policies.dynamic`:
DSSP, ElasticBSP) close rounds the same way and decide, respectively, how far
past its bound a worker may run and where the next barrier is.  The
partial modes (:mod:`tfsync.policies.partial`: PSP, backup workers) close a
round without the slow workers; that needs one observer of every worker's
readiness, so rank 0's coordinator evaluates their third question,
``close_round``, and tells every worker which contributions round ``r``
aggregates (see :mod:`tfsync.control`).
"""

from tfsync.policies.auto import Auto
from tfsync.policies.base import Closing, Policy
from tfsync.policies.compensation import DCS3GD, DelayCompensation
from tfsync.policies.dynamic import DSSP, ElasticBSP, Grant, Schedule
from tfsync.policies.local import DiLoCo, LocalSGD, sgd_config
from tfsync.policies.partial import PSP, BackupWorkers
from tfsync.policies.registry import Option, Variant, register, register_switching
from tfsync.policies.registry import get as _registered
from tfsync.policies.registry import modes as _modes
from tfsync.policies.registry import of as _of
from tfsync.policies.sync import BSP, SSP

PAYLOADS = ("gradients", "updates", "compensated_updates", "pseudo_gradients")


def _compensation(args):
    return DelayCompensation(lam=args.dc_lambda, adaptive=args.dc_adaptive)


def _compensate(args):
    """``--compensate`` (PSP, backup workers): late contributions corrected, or None."""
    if not args.compensate:
        if args.dc_lambda is not None or args.dc_adaptive:
            raise SystemExit(
                "--dc-lambda and --dc-adaptive set delay compensation: add --compensate (with --mode psp "
                "or backup) or use --mode dcs3gd"
            )
        return None
    return _compensation(args)


_DC = (
    Option(
        "--dc-lambda",
        None,
        float,
        None,
        "delay compensation's lambda (--mode dcs3gd, --compensate; default 0.04, or 2.0 with --dc-adaptive)",
    ),
    Option("--dc-adaptive", None, bool, False, "adaptive lambda, DC-ASGD-a (--mode dcs3gd, --compensate)"),
)
_COMPENSATE = Option(
    "--compensate",
    "compensate",
    bool,
    False,
    "correct and apply late contributions instead of dropping them (--mode psp or backup)",
    build=_compensate,
)

register(
    "bsp",
    BSP,
    "BSP",
    # the rounds in 16 bits (compression=; every mode takes --compression): what they cost in accuracy
    # is measured against these (python -m tfsync.bench convergence --modes horovod bsp bsp+fp16 bsp+bf16)
    variants={
        "bsp+fp16": Variant(("--compression", "fp16"), "BSP+fp16", study=False),
        "bsp+bf16": Variant(("--compression", "bf16"), "BSP+bf16", study=False),
    },
    simulated="rounds",
)
register(
    "ssp",
    SSP,
    "SSP(s={staleness})",
    (Option("--staleness", "staleness", int, 3, "SSP bound s (--mode ssp)", "s"),),
    variants={"ssp(s=15)": Variant(("--staleness", "15"), "SSP(s=15)")},
    simulated="rounds",
)
register(
    "dssp",
    DSSP,
    "DSSP",
    (
        Option("--low", "low", int, 3, "DSSP's lower bound s_L (--mode dssp)", "s_L"),
        Option("--high", "high", int, 15, "DSSP's upper bound s_U (--mode dssp)", "s_U"),
    ),
    simulated="grants",
)
register(
    "elasticbsp",
    ElasticBSP,
    "ElasticBSP",
    (
        Option("--lookahead", "lookahead", int, 15, "ElasticBSP's R, iterations predicted (--mode elasticbsp)", "R"),
        Option(
            "--zipline",
            "algorithm",
            str,
            "optbs",
            "ElasticBSP's ZipLine variant: optbs, zipline_opt, zipline, fullgridscan, gridscan (--mode elasticbsp)",
        ),
    ),
    simulated="supersteps",
)
register(
    "psp",
    PSP,
    "PSP",
    (
        Option(
            "--min-contributions", "min_contributions", int, None, "PSP's c (--mode psp; default: workers - 1)", "c"
        ),
        Option(
            "--push-timeout-s",
            "push_timeout_s",
            float,
            None,
            "PSP's tau1 in seconds (--mode psp; default: a tenth of the round's iteration time)",
            "timeout",
        ),
        _COMPENSATE,
        *_DC,
        Option(
            "--pull-fraction",
            "pull_fraction",
            float,
            1.0,
            "PSP's b: the share of a round's parameter blocks a worker waits for (--mode psp; "
            "default 1.0, no partial pulling; the paper used 0.9)",
            "pull",
        ),
        Option(
            "--pull-timeout-s",
            "pull_timeout_s",
            float,
            None,
            "PSP's tau2: once the share of blocks arrived, wait up to this long for the others "
            "(--mode psp --pull-fraction; default 0)",
            "pull_timeout",
        ),
        Option(
            "--pull-blocks",
            "pull_blocks",
            int,
            None,
            "PSP's number of parameter blocks B (--mode psp --pull-fraction; default one per weight tensor)",
            "B",
        ),
    ),
    # partial pulling: a step goes on with 3 of its round's 4 parameter blocks (digits' weight tensors)
    variants={
        "psp+dc": Variant(("--compensate",), "PSP+DC"),
        "psp+pull": Variant(("--pull-fraction", "0.75"), "PSP+pull(b=0.75)", study=False),  # (its own scenario)
    },
    simulated="rounds",
    # a persistent straggler: 0.95 in 10.0 s against plain Horovod's 18.2 s (docs/results/convergence)
    best_for={"straggler": "psp"},
)
register(
    "backup",
    BackupWorkers,
    "backup(b={backups})",
    (Option("--backups", "backups", int, 1, "backup workers b (--mode backup)", "b"), _COMPENSATE, *_DC),
    # the backup-workers trade-off (the convergence study's sweep): "backup" is b = 1
    variants={
        "backup+dc": Variant(("--compensate",), "backup(b={backups})+DC"),
        **{f"backup(b={b})": Variant(("--backups", str(b)), f"backup(b={b})", study=False) for b in (0, 2, 3)},
    },
    simulated="rounds",
    # a persistent straggler: 0.95 in 9.5 s against plain Horovod's 16.8 s, late gradients applied
    # (docs/results/convergence-auto; uncompensated backup: 8.8 s against 18.2 s, docs/results/convergence)
    best_for={"straggler": "backup+dc"},
)
register(
    "dcs3gd",
    DCS3GD,
    "DC-S3GD",
    (
        Option("--dc-lambda", "compensation", float, None, _DC[0].help, build=_compensation),
        _DC[1],
    ),
)


def _outer_optimizer(args):
    """``--outer-lr`` and ``--outer-momentum`` (--mode diloco): the outer optimizer, SGD with
    Nesterov momentum (momentum 0: plain SGD), as its serialized configuration."""
    momentum = args.outer_momentum
    return sgd_config(args.outer_lr, momentum, nesterov=momentum > 0)


_QUANTIZE = Option(
    "--quantize",
    "quantize",
    str,
    None,
    "the outer round's codes: int8, or int4 with error feedback (--mode localsgd or diloco; default: float32)",
)
register(
    "localsgd",
    LocalSGD,
    "LocalSGD(H={period})",
    (
        Option("--period", "period", int, 8, "Local SGD's H: local steps between averagings (--mode localsgd)", "H"),
        _QUANTIZE,
    ),
    every_step=False,
)
register(
    "diloco",
    DiLoCo,
    "DiLoCo(H={inner_steps})",
    (
        Option("--inner-steps", "inner_steps", int, 8, "DiLoCo's H: inner steps per outer step (--mode diloco)", "H"),
        Option(
            "--outer-lr",
            "outer_optimizer",
            float,
            0.7,
            "DiLoCo's outer learning rate (--mode diloco; default 0.7, the paper's)",
            build=_outer_optimizer,
        ),
        Option(
            "--outer-momentum",
            None,
            float,
            0.9,
            "DiLoCo's outer Nesterov momentum (--mode diloco; default 0.9, the paper's; 0: plain SGD)",
        ),
        Option(
            "--overlap-steps",
            "overlap_steps",
            int,
            0,
            "Streaming DiLoCo's tau: inner steps the outer exchange overlaps (--mode diloco; default 0)",
            "tau",
        ),
        Option(
            "--mixing",
            "mixing",
            float,
            0.0,
            "Streaming DiLoCo's alpha: the share of a worker's weights kept when an overlapped round lands "
            "(--mode diloco --overlap-steps; default 0)",
            "alpha",
        ),
        _QUANTIZE,
        Option(
            "--fragments",
            "fragments",
            int,
            1,
            "Streaming DiLoCo's fragments: parts of the model whose outer steps are spread over the period "
            "(--mode diloco; default 1, the whole model at once)",
            "P",
        ),
    ),
    # the streaming variant: the outer exchange overlaps the last 2 inner steps of each period; the
    # quantized outer rounds
    variants={
        "diloco+overlap": Variant(("--overlap-steps", "2"), "DiLoCo(H={inner_steps}, tau=2)", study=False),
        "diloco+fragments": Variant(("--fragments", "4"), "DiLoCo(H={inner_steps}, P=4)", study=False),
        # fragments whose rounds travel quantized (paced too, given an overlap)
        "diloco+int8+fragments": Variant(
            ("--quantize", "int8", "--fragments", "4"), "DiLoCo(H={inner_steps}, int8, P=4)", study=False
        ),
        **{
            f"diloco+{q}": Variant(("--quantize", q), f"DiLoCo(H={{inner_steps}}, {q})", study=False)
            for q in ("int8", "int4")
        },
        # the quantized round overlapped with the period's last inner steps
        **{
            f"diloco+{q}+overlap": Variant(
                ("--quantize", q, "--overlap-steps", "2"), f"DiLoCo(H={{inner_steps}}, {q}, tau=2)", study=False
            )
            for q in ("int8", "int4")
        },
    },
    # a slow link: 0.95 in 17.0 s against plain Horovod's 150.1 s at 1gbit (docs/results/network)
    best_for={"slow-link": "diloco"},
    every_step=False,
)
# the modes above, picked from the measured iteration times and switched between epochs
register_switching("auto", Auto, "auto")


def resolve(mode) -> Policy:
    """Turn ``"bsp"``, ``"ssp"`` or a :class:`Policy` instance into a policy.

    Raises a ``ValueError`` naming the accepted values for anything else.
    """
    if isinstance(mode, Policy):
        return mode
    switched = switching(mode)
    if switched is not None:
        raise ValueError(
            f"mode {switched.name!r} picks and switches modes between epochs, which only "
            f"tfsync.keras.SyncCallback does; use SyncCallback(mode={switched.name!r}) with model.fit, or "
            f"pass a mode such as 'bsp' or tfsync.SSP(staleness=3) here"
        )
    if isinstance(mode, type) and issubclass(mode, Policy):
        raise TypeError(f"mode={mode.__name__}: pass an instance, e.g. mode=tfsync.{mode.__name__}()")
    if isinstance(mode, str):
        try:
            return _registered(mode.strip().lower()).cls()
        except KeyError:
            pass
    switches = ", ".join(f"{m.name!r} (SyncCallback)" for m in _modes(switching=True) if m.switches)
    raise ValueError(
        f"unknown synchronization mode {mode!r}; expected one of "
        f"{', '.join(repr(m.name) for m in _modes())}, {switches} or a policy object such as "
        f"tfsync.SSP(staleness=3)"
    )


def switching(mode):
    """The registered switching mode (:func:`~tfsync.policies.registry.register_switching`)
    ``mode`` names or is an instance of (``"auto"``, :class:`Auto`), or None."""
    if isinstance(mode, str):
        try:
            found = _registered(mode.strip().lower())
        except KeyError:
            return None
    else:
        found = _of(mode)
    return found if found is not None and found.switches else None


def resolve_mode(mode):
    """:func:`resolve`, plus a switching mode, ``"auto"`` or a :class:`Auto` (what ``SyncCallback``
    accepts)."""
    switched = switching(mode)
    if switched is not None:
        return mode if isinstance(mode, switched.cls) else switched.cls()
    return resolve(mode)


__all__ = [
    "Policy",
    "Closing",
    "BSP",
    "SSP",
    "DSSP",
    "ElasticBSP",
    "Grant",
    "Schedule",
    "PSP",
    "BackupWorkers",
    "DCS3GD",
    "DelayCompensation",
    "LocalSGD",
    "DiLoCo",
    "Auto",
    "resolve",
    "resolve_mode",
    "switching",
    "PAYLOADS",
    "register",
]
