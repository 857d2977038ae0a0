"""The digits MLP under tfsync.elastic, with a worker killed at a given (epoch, batch).

Args: out_dir mode victim_rank kill_epoch kill_batch epochs [hosts_file changes].
``mode``: a mode's name, or ``psp:C`` for ``PSP(min_contributions=C)``.  ``victim_rank`` -1:
nobody is killed (the undisturbed run); ``kill_epoch`` may list several (``2,6,10``: a kill loop,
each while the job has as many workers as at launch).  ``changes``: ``EPOCH=HOST:SLOTS+HOST:SLOTS;...``:
at the end of that epoch (once per job), rank 0 writes those hosts to ``hosts_file``, which
the launcher's discovery script prints, and waits for the launcher to see it.  The victim
kills itself (SIGKILL) after that batch, in the first membership only.  Each process that
finishes writes ``result_rank<R>.json`` (its rank at the end) with its final test accuracy,
its counts and the state's; the victim writes ``killed.json`` (when it died) first.
"""

import json
import os
import signal
import sys
import time

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import init, write_result  # noqa: E402

out_dir, mode, victim = sys.argv[1], sys.argv[2], int(sys.argv[3])
kill_epochs, kill_batch = {int(e) for e in sys.argv[4].split(",")}, int(sys.argv[5])
epochs = int(sys.argv[6])
hosts_file = sys.argv[7] if len(sys.argv) > 7 else None
changes = {}
for item in filter(None, (sys.argv[8] if len(sys.argv) > 8 else "").split(";")):
    at, hosts = item.split("=")
    changes[int(at)] = hosts.split("+")
DISCOVERY_WAIT_S = 3.0  # the launcher runs the discovery script every second
BATCH = 16

hvd = init()
FULL = hvd.size()  # the job's size at launch: kills happen while it is whole
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import tfsync  # noqa: E402
import tfsync.elastic  # noqa: E402

x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax")]
)
model.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])

if mode.startswith("psp:"):
    mode = tfsync.PSP(min_contributions=int(mode.split(":")[1]))
state = tfsync.elastic.KerasState(model, epoch=0)
sync = tfsync.keras.SyncCallback(mode, elastic=state, wait_timeout_s=30, trace_dir=os.path.join(out_dir, "trace"))
seen = {"epochs": [], "first_step_after_reset_t": None, "memberships": []}


class Victim(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        marker = os.path.join(out_dir, f"killed_{self.epoch}.json")
        kill = hvd.rank() == victim and hvd.size() == FULL and self.epoch in kill_epochs and batch == kill_batch
        if kill and not os.path.exists(marker):
            record = json.dumps({"t": time.time(), "rank": hvd.rank(), "pid": os.getpid(), "epoch": self.epoch})
            for path in (marker, os.path.join(out_dir, "killed.json")):  # (killed.json: the last)
                with open(path, "w") as f:
                    f.write(record)
            os.kill(os.getpid(), signal.SIGKILL)
        if state.resets > 0 and seen["first_step_after_reset_t"] is None:
            seen["first_step_after_reset_t"] = time.time()

    def on_epoch_end(self, epoch, logs=None):
        seen["epochs"].append(epoch)
        marker = os.path.join(out_dir, f"hosts_changed_{epoch}")
        if epoch in changes and hvd.rank() == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            with open(hosts_file + ".tmp", "w") as f:
                f.write("".join(h + "\n" for h in changes[epoch]))
            os.replace(hosts_file + ".tmp", hosts_file)
            time.sleep(DISCOVERY_WAIT_S)  # (the others wait in the next collective meanwhile)


@tfsync.elastic.run
def train(state):
    seen["memberships"].append({"rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch})
    x_local, y_local = tfsync.shard(x_train, y_train, batch_size=BATCH)
    model.fit(
        x_local,
        y_local,
        batch_size=BATCH,
        epochs=epochs,
        initial_epoch=state.epoch,
        shuffle=True,
        verbose=0,
        callbacks=[sync, Victim()],
    )


train(state)
accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
write_result(
    out_dir,
    hvd.rank(),
    {
        "accuracy": accuracy,
        "counts": sync.counts,
        "state_counts": state.counts,
        "resets": state.resets,
        "state_epoch": state.epoch,
        "size": hvd.size(),
        "rank_at_end": hvd.rank(),
        "pid": os.getpid(),
        "checksum": checksum,
        **seen,
    },
)
