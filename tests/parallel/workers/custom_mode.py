"""A mode defined outside tfsync, in this one file, against the public API only.

``lagone``: every worker applies its own update at once and may run one step
ahead of the slowest (SSP's update protocol with staleness 1); its component
records, in every step's trace record, how many steps this worker ran ahead
of the newest complete round.
"""

import dataclasses
import sys

import numpy as np
from common import build_regression_model, init, regression_shard, write_result

hvd = init()
import keras  # noqa: E402

import tfsync  # noqa: E402
from tfsync.engine import StepComponent  # noqa: E402


class Ahead(StepComponent):
    """Steps this worker is ahead of the newest complete round, in its trace."""

    def end_step(self, step, wait_s, skipped):
        return {"ahead": step - self.engine.exchange.completed}


@dataclasses.dataclass(frozen=True)
class LagOne(tfsync.Policy):
    name = "lagone"
    payload = "updates"

    def required_round(self, step):
        return step - 2

    def components(self):
        return [Ahead()]


tfsync.register_mode("lagone", LagOne, label="lag one")

out_dir = sys.argv[1]
rank = hvd.rank()
x, y = regression_shard(256)
model = build_regression_model()
model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
sync = tfsync.keras.SyncCallback(
    mode="lagone", trace_dir=f"{out_dir}/trace", stragglers=tfsync.Stragglers(jitter_s=0.02, seed=3)
)
model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[sync])
weights = np.concatenate([w.reshape(-1) for w in model.get_weights()]).tolist()
write_result(out_dir, rank, {"weights": weights, "counts": dict(sync.engine.counts), "mode": sync.policy.name})
