"""What a mode adds to the engine's step: the :class:`StepComponent` interface.

The engine core (:mod:`tfsync.engine.engine`) runs rounds, waits, counts and
faults for every mode alike.  What only some modes do is a component, built
once when the engine starts: the engine binds the built-in modes to theirs
(:mod:`tfsync.engine.components.bindings`: DSSP's grants, :mod:`tfsync.engine.components.grants`;
ElasticBSP's supersteps, :mod:`tfsync.engine.components.supersteps`; PSP's partial
pulling, :mod:`tfsync.engine.components.pull`; holding and offering late contributions,
:mod:`tfsync.engine.components.late`), a step protocol adds its own (DC-S3GD's wait before
the optimizer, :class:`tfsync.engine.protocols.compensated.Corrections`), and a
mode defined outside tfsync supplies its own (:meth:`Policy.components
<tfsync.policies.Policy.components>`).  How a contribution enters its round, on
every worker's own push or on rank 0's closing, is the round entry
(:mod:`tfsync.engine.entry`), chosen by ``Policy.coordinated``.

A component overrides the hooks it needs; every hook's default leaves the
step as it is, so the engine calls each hook on every component in that order
(the protocol's, the mode's, then the non-finite check).  Hooks run on the training thread, inside the
compiled step's ``tf.py_function`` (or from the frontends' eager calls),
never concurrently with each other.

What a component may use of the engine (:meth:`StepComponent.bind` hands it
over): ``rank``, ``size``, ``policy``, ``protocol``, ``exchange``,
``control``, ``cluster``, ``wait_timeout_s``, ``now()`` (seconds since the
job's t0), ``tracing`` and ``trace(record)`` (one JSON line in the trace),
``tally`` (the contribution counters, :class:`tfsync.engine.tally.Tally`),
``last_pushed`` (the newest step this worker pushed), ``step``,
``applied_through``, ``delays`` (this rank's simulated stragglers),
``wait_and_apply(round)``, ``guard()`` (keeps an error for the frontends to
re-raise) and ``stop(error)`` (tells every worker why this one stops; raise
what it returns).
"""


class StepComponent:
    """One piece of a mode's per-step behaviour (base class: every hook does nothing).

    Example, a component that puts the step's number in every trace record::

        class StepNumbers(StepComponent):
            def end_step(self, step, wait_s, skipped):
                return {"my_step": step}
    """

    engine = None
    # whether the component keeps a worker's rounds waiting for its own step (False: it may let a
    # worker go on before its round completes, so no step is sure to leave every replica at rest)
    rests = True

    def plan(self, shapes: list, num_params: int) -> None:
        """Check the model (its weights' ``shapes``) against the mode's settings; called before
        the ranks agree on the configuration, so a bad setting stops the job before any collective."""

    def bind(self, engine) -> None:
        """Called once when the engine starts, after its exchange, control path and protocol exist."""
        self.engine = engine

    def exchange_options(self) -> dict:
        """Keyword arguments this component needs of :class:`~tfsync.engine.exchange.RoundExchange`
        (called before :meth:`bind`)."""
        return {}

    def computes(self, step: int) -> bool:
        """Whether ``step`` computes (False: the frontend skips it, :meth:`SyncEngine.skip_step`)."""
        return True

    def runs_ahead(self, step: int) -> bool:
        """Whether this worker may go on before the round of its own ``step`` completes even
        where the policy's bound says it waits for it (then the engine never runs that round
        on the training thread)."""
        return False

    def before_push(self, step: int):
        """Before ``step`` pushes: ``(seconds, rounds applied)`` that the step already waited
        (and then the simulated compute delay was slept already), or None."""
        return None

    def interval(self, step: int, compute_s: float) -> float:
        """The compute time this worker's row of round ``step`` carries (default: the measured one)."""
        return compute_s

    def required(self, step: int, required: int) -> int:
        """After pushing ``step``: the round its synchronization point waits for (``required``:
        what the policy and the components before this one said; -1: none)."""
        return required

    def skip(self, step: int):
        """A skipped ``step``: the round it waits for, or ``None`` to leave it to the policy
        (a component that enters rounds on skipped steps does so here)."""
        return None

    def before_apply(self, res) -> None:
        """Round ``res.round`` completed and is about to move the weights (``res``: its
        :class:`~tfsync.engine.rounds.RoundResult`)."""

    def apply(self, res) -> bool:
        """Apply the round; True if this component did (else the protocol applies it whole)."""
        return False

    def own_count(self, res):
        """How this worker's fresh contribution to round ``res.round`` counts now that it is
        applied: ``"compensated"``, or None for ``"applied"``."""
        return None

    def after_apply(self, res) -> None:
        """Round ``res.round`` is applied."""

    def rounds_applied(self, required: int, hand_back: bool) -> None:
        """Every completed round up to the step's is applied (``required``: the step's round;
        ``hand_back``: the step may return its own round whole to the compiled step)."""

    def result(self, result):
        """The step's return value (default: the protocol's, unchanged)."""
        return result

    def end_step(self, step: int, wait_s: float, skipped: bool) -> dict:
        """The step is over: extra fields for its trace record."""
        return {}

    def epoch_logs(self) -> dict:
        """What this component adds to the frontends' epoch logs (numbers by name, each logged as
        ``tfsync_<name>``): default none."""
        return {}

    def at_rest(self) -> bool:
        """Whether this component holds nothing that the weights will still take (a late
        contribution, a block of a round still arriving): default True."""
        return True

    def finish(self, apply_mean) -> bool:
        """Training ended and every pushed round is applied: settle what this component still
        holds (``apply_mean``: the frontend's way to apply one more mean gradient, or None).
        Returns whether it dropped contributions (the engine then records a drain)."""
        return False
