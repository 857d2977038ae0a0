"""The digits example's launches, shared by ``python -m tfsync.demo`` and the convergence and
network benchmarks: the example's path, the flags that run each mode under it, and the
straggler scenarios (``tfsync.launch.stragglers_spec`` strings).

A leaf: the demo runs the benchmarks, and the benchmarks take the demo's modes from here.
"""

import os

from tfsync.launch import REPO_ROOT
from tfsync.policies import registry

EXAMPLE = os.path.join(REPO_ROOT, "keras_examples", "digits.py")
BASELINE = "horovod"  # plain Horovod (in-graph hvd.grouped_allreduce), not a tfsync mode
# mode -> the example's flags: plain Horovod BSP (the anchor of python -m tfsync.bench
# convergence), then every registered mode and named variant, auto included
# (tfsync.policies.registry; psp+dc, backup+dc: late gradients compensated instead of dropped)
MODES = {BASELINE: ["--plain-horovod"], **registry.configurations(switching=True)}
SCENARIOS = {
    "none": "base=0.02,seed=1",
    "straggler": "base=0.02,slow=3:0.04,seed=1",
    "heterogeneous": "base=0.02,slow=3:0.02,seed=1",
    "jitter": "base=0.02,jitter=0.04,seed=1",
    # the PSP paper's rare large delays: about 4 events per worker in a 12-epoch run of 264 steps
    "rare": "base=0.02,rare=0.015:0.5,seed=1",
    # the PSP paper's simulation itself: a block of a round's result reaches a worker 0.5 s late,
    # about 4 times per worker in a 12-epoch run (264 rounds of 4 blocks)
    "rare-pull": "base=0.02,pull=0.004:0.5,seed=1",
}
