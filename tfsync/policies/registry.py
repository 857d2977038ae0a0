"""The modes tfsync knows: one registry, read by every tool that names a mode.

An entry (:class:`Mode`) is a mode's name (``mode="ssp"``, ``--mode ssp``),
its policy class, a label for tables, its command-line options, its named
variants (``"psp+dc"``: PSP with ``--compensate``) and the situations it is
tfsync's answer for (``best_for={"straggler": "backup"}``: which configuration
``python -m tfsync.demo`` shows beside plain Horovod there, from the measured
studies in ``docs/results/``).  The launcher's flags
(:func:`tfsync.launch.add_mode_arguments`), :func:`tfsync.policies.resolve`,
the simulator, the bench, the demo and the convergence study all read it, so
a new mode is its policy module, its tests and one :func:`register` call
(``tfsync.register_mode`` for a mode defined outside tfsync).  The mode that switches
between the others (``"auto"``, :class:`tfsync.Auto`, ``SyncCallback`` only) is registered
here too (:func:`register_switching`): every tool that lists modes takes them from here.

Example:

    tfsync.register_mode("every2", Every2, label="BSP every other step")
    tfsync.keras.SyncCallback(mode="every2")
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Option:
    """One command-line flag of a mode: ``--flag`` sets the policy's ``field``.

    ``build(args)``: the field's value from the parsed flags, when it is not
    the flag's own (delay compensation is built from three flags); ``field``
    ``None``: a flag another option's ``build`` reads.  ``short``: the name
    :func:`tfsync.launch.describe_mode` shows the setting under.
    """

    flag: str
    field: str
    type: type = None
    default: object = None
    help: str = ""
    short: str = None
    build: object = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named variant of a mode: its extra flags, its label for tables (``{field}`` placeholders
    take the mode's settings), and whether the convergence study runs it by default (a sweep's
    points and a variant that needs its own scenario do not)."""

    flags: tuple
    label: str
    study: bool = True


@dataclasses.dataclass(frozen=True)
class Mode:
    """A registered mode (see the module docstring)."""

    name: str
    cls: type
    label: str
    options: tuple = ()
    variants: dict = dataclasses.field(default_factory=dict)  # name -> Variant
    # how python -m tfsync.simulate plays it (SIMULATIONS), or None: not simulated
    simulated: str = None
    best_for: dict = dataclasses.field(default_factory=dict)  # situation -> this mode's name or a variant's
    every_step: bool = True  # each step contributes (False: Local SGD, DiLoCo: every H-th)
    switches: bool = False  # it picks and switches between the other modes (auto; SyncCallback only)

    def from_args(self, args):
        """The policy the parsed flags describe (``--compression``, every mode's, included)."""
        kwargs = {}
        for o in self.options:
            if o.field is not None:
                kwargs[o.field] = o.build(args) if o.build is not None else getattr(args, o.dest)
        if getattr(args, "compression", None) is not None:  # (left out otherwise: a mode of a user's may not take it)
            kwargs["compression"] = args.compression
        return self.cls(**kwargs)

    def build(self, **settings):
        """The policy with ``settings`` (values by field, ``staleness=3``) for the options this
        mode takes, its defaults for the rest: the settings a tool gives every mode at once."""
        fields = {o.field for o in self.options if o.field is not None}
        return self.cls(**{k: v for k, v in settings.items() if k in fields})


# how the simulator plays a mode: rounds every worker enters after its step, each waiting for the
# round its policy's sync_round names (coordinated ones closed by close_round); DSSP's grants
# from its controller; ElasticBSP's supersteps between barriers
SIMULATIONS = ("rounds", "grants", "supersteps")

_MODES = {}
_SWITCHING = {}


def _check_name(name):
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise ValueError(f"register_mode({name!r}): a mode's name is a lowercase identifier, e.g. 'every2'")
    if name in _MODES or name in _SWITCHING:
        raise ValueError(f"register_mode({name!r}): a mode of that name is registered already; choose another name")


def register(
    name: str,
    cls: type,
    label: str,
    options=(),
    variants=None,
    simulated=None,
    best_for=None,
    every_step=True,
) -> Mode:
    """Register a mode (its name must be new; ``cls`` a :class:`tfsync.policies.Policy`
    subclass whose instances are built with no arguments, or from ``options``; ``label``: its
    name in tables, ``{field}`` placeholders taking its settings; ``variants``: name ->
    :class:`Variant`).

    ``simulated``: how ``python -m tfsync.simulate`` plays it, one of :data:`SIMULATIONS`
    (``"rounds"``: each step waits for the round its ``sync_round`` names), or None (not
    simulated).  ``best_for``: situation (``"straggler"``, ``"slow-link"``) -> the
    configuration, ``name`` or one of ``variants``, that answers it (:func:`best_for`).
    ``every_step``: each step contributes to a round (False where only every ``H``-th does)."""
    from tfsync.policies.base import Policy

    _check_name(name)
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register_mode({name!r}, {cls!r}): the class must subclass tfsync.policies.Policy")
    if cls.name != name:
        raise ValueError(
            f"register_mode({name!r}, {cls.__name__}): the class's name attribute is {cls.name!r}; "
            f"set name = {name!r} on the class"
        )
    for variant, spec in (variants or {}).items():
        if not isinstance(spec, Variant):
            raise TypeError(
                f"register_mode({name!r}): variant {variant!r} must be a Variant(flags, label), got {spec!r}"
            )
    unknown = sorted(c for c in (best_for or {}).values() if c != name and c not in (variants or {}))
    if unknown:
        raise ValueError(
            f"register_mode({name!r}, best_for=...): {', '.join(map(repr, unknown))} is neither the mode nor one "
            f"of its variants ({', '.join(map(repr, [name, *(variants or {})]))}); name one of those"
        )
    if simulated is not None and simulated not in SIMULATIONS:
        raise ValueError(f"register_mode({name!r}, simulated={simulated!r}): expected None or one of {SIMULATIONS}")
    mode = Mode(
        name, cls, label, tuple(options), dict(variants or {}), simulated, dict(best_for or {}), bool(every_step)
    )
    _MODES[name] = mode
    return mode


def register_switching(name: str, cls: type, label: str) -> Mode:
    """Register a mode that picks and switches between the registered modes as it trains
    (``"auto"``: :class:`tfsync.Auto`, built with no arguments or ``compression=``); only
    ``SyncCallback`` runs one.  It has no options of its own."""
    _check_name(name)
    mode = Mode(name, cls, label, switches=True)
    _SWITCHING[name] = mode
    return mode


def modes(switching: bool = False) -> tuple:
    """Every registered mode, in registration order; with ``switching``, the switching modes
    (``auto``) after them."""
    return tuple(_MODES.values()) + (tuple(_SWITCHING.values()) if switching else ())


def names() -> tuple:
    """Every mode name ``--mode`` and ``mode=`` take: the modes, then the switching ones."""
    return tuple(m.name for m in modes(switching=True))


def get(name: str) -> Mode:
    """The mode registered as ``name``, a switching one included (``KeyError`` if none is)."""
    return _MODES[name] if name in _MODES else _SWITCHING[name]


def of(policy):
    """The registered mode ``policy`` is an instance of (its class's, or the nearest registered
    base class's), or None."""
    for cls in type(policy).__mro__:
        for mode in (*_MODES.values(), *_SWITCHING.values()):
            if mode.cls is cls:
                return mode
    return None


def best_for(situation: str) -> list:
    """The configurations (names of :func:`configurations`) registered as the answer to
    ``situation``, in registration order: what ``python -m tfsync.demo`` shows there."""
    return [m.best_for[situation] for m in _MODES.values() if situation in m.best_for]


def situations() -> list:
    """Every situation some mode is registered as the answer to, in first-registration order."""
    return list(dict.fromkeys(s for m in _MODES.values() for s in m.best_for))


def configurations(switching: bool = False, every_step: bool = None, **settings) -> dict:
    """Every mode and named variant -> the launcher's flags that run it
    (``{"bsp": ["--mode", "bsp"], "psp+dc": ["--mode", "psp", "--compensate"], ...}``).

    ``settings``: option values by field (``staleness=5``), given to each mode that
    takes them, before a variant's own flags, which win (``ssp(s=15)``).  ``switching``: the
    switching modes (``auto``) too, last; ``every_step``: only the modes whose every step
    contributes (True) or whose steps do not all (False); None: every mode.
    """
    out = {}
    for m in modes(switching):
        if every_step is not None and m.every_step != every_step:
            continue
        given = [str(v) for o in m.options if o.field in settings for v in (o.flag, settings[o.field])]
        out[m.name] = ["--mode", m.name, *given]
        for variant, spec in m.variants.items():
            out[variant] = ["--mode", m.name, *given, *spec.flags]
    return out


def study_configurations(switching: bool = False, every_step: bool = None) -> tuple:
    """The modes and named variants the convergence study runs by default, in registration order
    (``switching``, ``every_step``: as :func:`configurations` takes them)."""
    return tuple(
        name
        for m in modes(switching)
        if every_step is None or m.every_step == every_step
        for name in (m.name, *(v for v, spec in m.variants.items() if spec.study))
    )


def label(name: str, **settings) -> str:
    """The table label of the mode or named variant ``name`` (``"SSP(s=3)"``), its placeholders
    filled with ``settings`` (values by field) where given, else with the options' defaults."""
    for m in modes(switching=True):
        text = m.label if name == m.name else m.variants[name].label if name in m.variants else None
        if text is not None:
            values = {o.field: o.default for o in m.options if o.field is not None}
            return text.format(**{**values, **settings})
    raise KeyError(name)


def options() -> list:
    """Every registered option, each flag once (the first registration's), in order."""
    seen = {}
    for m in _MODES.values():
        for o in m.options:
            seen.setdefault(o.flag, o)
    return list(seen.values())


def describe(policy) -> str:
    """``"ssp(s=3)"``, ``"psp(c=3)"``, ``"backup(b=1)+dc(lambda=0.04)"``, ``"dcs3gd(lambda=0.04)"``:
    a short label for tables (settings left at an adaptive default, ``None``, are not shown)."""

    def compensation(comp):
        return f"lambda={comp.strength}" + (", adaptive" if comp.adaptive else "")

    if policy.name in _SWITCHING:  # (tfsync.Auto: its modes are in its decisions)
        return policy.name
    parts, suffix = [], ""
    short = {o.field: o.short for o in options() if o.field and o.short}
    for k, v in policy.config().items():
        if k == "compensation":  # DC-S3GD's own
            parts.append(compensation(policy.compensation))
        elif k == "compensate":  # PSP's and backup workers' late gradients
            suffix = "" if policy.compensate is None else f"+dc({compensation(policy.compensate)})"
        elif k == "outer_optimizer":  # DiLoCo's
            parts.append(f"outer={policy.outer_label()}")
        elif k in ("overlap_steps", "mixing") and not v:  # DiLoCo without the streaming overlap
            continue
        elif k == "fragments" and v == 1:  # DiLoCo's whole model at once
            continue
        elif k == "pull_fraction" and v == 1.0:  # PSP without partial pulling
            continue
        elif k != "mode" and v is not None:
            parts.append(f"{short.get(k, k)}={v}")
    return policy.name + (f"({', '.join(parts)})" if parts else "") + suffix
