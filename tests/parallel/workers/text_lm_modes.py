"""``keras_examples/text_lm.py`` under plain Horovod and every registered mode, in one launch.

argv: corpus directory, then flags given to every run.  Each run is the example's ``main``
with ``--plain-horovod`` or one mode of :mod:`tfsync.policies.registry`, ``auto`` included (its
flags from ``registry.configurations``), one after another in this process; rank 0 prints each run's
``TFSYNC_RESULT`` line, which the test reads from the output.
"""

import os
import sys

from common import init

hvd = init()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "keras_examples"))

import text_lm  # noqa: E402

from tfsync.policies import registry  # noqa: E402

corpus, flags = sys.argv[1], sys.argv[2:]
configurations = registry.configurations(switching=True)
runs = [["--plain-horovod"], *(configurations[m.name] for m in registry.modes(switching=True))]
for run in runs:
    text_lm.main(["--corpus", corpus, *flags, *run])
