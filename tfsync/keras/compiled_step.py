"""The train step a ``fit`` compiled, kept for the next ``fit`` of the same model.

``SyncCallback`` builds its optimizer path into the model's train step and has Keras compile
it again (:meth:`tfsync.frontend.Frontend.install`); the step is traced at the fit's first
batch (0.1 s for a two-layer MLP on an idle core here, more for a deeper model), and every
rank of the job waits for the slowest rank's trace in the first exchange.  Keras itself keeps a
model's train function from one ``fit`` to the next; a job that calls ``fit`` once per epoch
(mid-epoch resume does: ``docs/guide/elastic.md``), or again after every elastic reset, would
otherwise pay a trace each time.  The compiled step needs no new trace for a new engine:
its hooks reach the engine through a lookup at every step
(:class:`tfsync.engine.protocols.path.OptimizerPath`).

:class:`KeptStep` keeps the compiled step when a fit ends (or a reset abandons it) and gives
it to the next fit when nothing it was traced against has changed: Keras's train function is
still the one the callback left (``model.compile`` and ``make_train_function(force=True)``
replace it), the optimizer and the model's variables are the same objects (a layer frozen or
unfrozen changes them), and the path it was compiled on serves the next fit's mode
(:meth:`~tfsync.engine.protocols.path.OptimizerPath.serves`: the same mode, or under auto
mode one its shared step serves; DC-S3GD's and PSP's partial-pull paths hold their engine's
state in the step and serve none).  Otherwise the step is compiled again.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class _Kept:
    path: object  # the optimizer path the step was compiled on
    optimizer: object
    variables: tuple  # the model's variables when it was compiled (trainable ones first)
    train_function: object  # the compiled step, as installed (before the fit's own wrappers)
    left: object = None  # the train function the model had once the callback unhooked it


class KeptStep:
    """The compiled train step installed for a fit, then kept for the next."""

    def __init__(self):
        self._installed = None  # the step of the fit under way
        self._kept = None  # the last fit's, for the next

    def installed(self, model, path, optimizer, train_function) -> None:
        """``train_function`` was compiled on ``path`` for ``model`` and ``optimizer`` as they are
        now, and installed for a fit."""
        self._installed = _Kept(path, optimizer, _variables(model), train_function)

    def keep(self, model) -> None:
        """The fit's hooks are off ``model``: keep its step, with the train function ``model``
        has now (the next fit must still find it)."""
        if self._installed is not None:
            self._kept = dataclasses.replace(self._installed, left=model.train_function)
            self._installed = None

    def take(self, model, policy, shared):
        """``(path, train_function)`` kept for ``model`` if they serve a fit of ``policy``
        (``shared``: auto mode's path, one step for every gradient mode), else None; either way
        nothing is kept after."""
        kept, self._kept = self._kept, None
        if kept is None:
            return None
        same = (
            kept.left is model.train_function
            and kept.optimizer is model.optimizer
            and _same_objects(kept.variables, _variables(model))
            and kept.path.shared == shared
            and kept.path.serves(policy)
            and (shared or kept.path.policy == policy)
        )
        return (kept.path, kept.train_function) if same else None


def _variables(model) -> tuple:
    return (*model.trainable_variables, *model.non_trainable_variables)


def _same_objects(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
