"""Dispatch ``python -m tfsync.bench [training|ops|scheduler|convergence|network|elastic|faults|control|chaos|lm]
[options]``."""

import importlib
import sys

SUBCOMMANDS = {
    "training": "tfsync.bench.training",
    "ops": "tfsync.bench.ops",
    "scheduler": "tfsync.bench.scheduler",
    "convergence": "tfsync.bench.convergence",
    "network": "tfsync.bench.network",
    "elastic": "tfsync.bench.elastic",
    "faults": "tfsync.bench.faults",
    "control": "tfsync.bench.control",
    "chaos": "tfsync.bench.chaos",
    "lm": "tfsync.bench.lm",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    name = "training"
    if argv and not argv[0].startswith("-"):
        name = argv.pop(0)
    if name not in SUBCOMMANDS:
        sys.exit(
            f"python -m tfsync.bench: unknown benchmark {name!r}; expected one of "
            f"{', '.join(SUBCOMMANDS)} (default: training)"
        )
    return importlib.import_module(SUBCOMMANDS[name]).main(argv)


if __name__ == "__main__":
    sys.exit(main())
