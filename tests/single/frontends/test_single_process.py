"""tfsync in one process: the errors a user meets before training, and a
deliberate single-worker run (TFSYNC_SINGLE_PROCESS=1) end to end.

Each case runs in a fresh interpreter, since Horovod initializes once per process.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tfsync.launch import REPO_ROOT as ROOT

LAUNCHER_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "TFSYNC_SINGLE_PROCESS")

MODEL = """
import numpy as np, keras, tfsync
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
"""


def run_python(code, env=None, timeout_s=120):
    full_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    full_env.update({"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}, **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=timeout_s,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_without_hvd_init_the_error_says_to_call_it():
    rc, out = run_python(
        MODEL
        + """
model.fit(x, y, epochs=1, verbose=0, callbacks=[tfsync.keras.SyncCallback(mode="bsp")])
"""
    )
    assert rc != 0 and "Horovod is not initialized" in out and "hvd.init()" in out, out[-2000:]


def test_without_horovodrun_the_error_says_how_to_launch():
    rc, out = run_python(
        "import horovod.tensorflow as hvd; hvd.init()\n"
        + MODEL
        + """
model.fit(x, y, epochs=1, verbose=0, callbacks=[tfsync.keras.SyncCallback(mode="bsp")])
"""
    )
    assert rc != 0 and "not started by horovodrun" in out and "TFSYNC_SINGLE_PROCESS=1" in out, out[-2000:]


def test_bad_mode_fails_when_the_callback_is_built():
    rc, out = run_python(MODEL + "tfsync.keras.SyncCallback(mode='fastest')")
    assert rc != 0 and "unknown synchronization mode 'fastest'" in out, out[-2000:]


def test_non_bool_averaging_flag_fails_when_the_callback_is_built():
    rc, out = run_python(MODEL + "tfsync.keras.SyncCallback(average_statistics='yes')")
    assert rc != 0 and "average_statistics must be True or False, got 'yes'" in out, out[-2000:]


def test_model_without_optimizer_is_refused():
    rc, out = run_python(
        """
import horovod.tensorflow as hvd; hvd.init()
import numpy as np, keras, tfsync
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
cb = tfsync.keras.SyncCallback()
cb.set_model(model); cb.set_params({"steps": 1})
cb.on_train_begin()
""",
        env={"TFSYNC_SINGLE_PROCESS": "1"},
    )
    assert rc != 0 and "has no optimizer" in out and "model.compile" in out, out[-2000:]


@pytest.mark.parametrize("mode", ["bsp", "tfsync.SSP(staleness=2)"])
def test_single_worker_trains_traces_and_draws_a_timeline(tmp_path, mode):
    trace = tmp_path / "trace"
    png = tmp_path / "timeline.png"
    rc, out = run_python(
        "import horovod.tensorflow as hvd; hvd.init()\n"
        + MODEL
        + f"""
mode = {mode if mode.startswith("tfsync") else repr(mode)}
before = model.evaluate(x, y, verbose=0)
h = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
              callbacks=[tfsync.keras.SyncCallback(mode=mode, trace_dir={str(trace)!r})])
after = model.evaluate(x, y, verbose=0)
assert after < before, (before, after)
# every contribution is counted: 8 steps per epoch, rounds in flight drained at the end
assert sum(h.history["tfsync_applied"]) == 24 and h.history["tfsync_dropped"] == [0.0] * 3, h.history
from tfsync import timeline
summary = timeline.plot_timeline(timeline.load_trace({str(trace)!r}), {str(png)!r})
assert summary["ranks"][0]["steps"] == 24, summary
print("OK")
""",
        env={"TFSYNC_SINGLE_PROCESS": "1"},
    )
    assert rc == 0 and "OK" in out, out[-3000:]
    assert png.stat().st_size > 1000


def test_strategy_trains_on_the_inputs_keras_takes():
    # tf.data (finite and repeated), NumPy with validation data, a PyDataset; evaluate and predict
    # after; the gradient protocol (BSP), the update protocol (SSP) and a skippable step (ElasticBSP)
    rc, out = run_python(
        """
import horovod.tensorflow as hvd; hvd.init()
import numpy as np, keras, tensorflow as tf, tfsync
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)

class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]

for mode in ["bsp", "ssp", "elasticbsp"]:
    strategy = tfsync.distribute.SyncStrategy(mode=mode)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    # one process, one replica: the dataset feeds the step as it is (no per-epoch distributed iterator)
    assert strategy.experimental_distribute_dataset(ds) is ds
    before = model.evaluate(x, y, verbose=0)
    h1 = model.fit(ds, epochs=2, verbose=0, validation_data=ds)
    h2 = model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y))
    model.fit(Batches(), epochs=2, verbose=0)
    model.fit(ds.repeat(), steps_per_epoch=5, epochs=2, verbose=0)
    strategy.finish()
    after = model.evaluate(ds, verbose=0)
    assert model.predict(x, batch_size=16, verbose=0).shape == (64, 1)
    assert after < 0.5 * before, (mode, before, after)
    assert len(h1.history["val_loss"]) == 2 and len(h2.history["val_loss"]) == 2, (h1.history, h2.history)
print("OK")
""",
        env={"TFSYNC_SINGLE_PROCESS": "1"},
        timeout_s=300,
    )
    assert rc == 0 and "OK" in out, out[-3000:]


@pytest.mark.parametrize("route", ["callback", "strategy"])
def test_the_process_exits_when_fit_raises_or_finish_is_forgotten(route):
    # an engine still running at exit (Keras calls no on_train_end when fit raises; a strategy
    # the user never finished) leaves on its own: its gRPC handler threads kept the process
    # alive forever before (run_python's bound fails the test)
    rc, out = run_python(
        "import horovod.tensorflow as hvd; hvd.init()\n"
        + MODEL
        + f"""
route = {route!r}
if route == "strategy":
    strategy = tfsync.distribute.SyncStrategy(mode="ssp")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)  # and no strategy.finish()
    print("FIT DONE", flush=True)
else:
    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                raise ValueError("the user's error at batch 3")

    callbacks = [tfsync.keras.SyncCallback(mode="ssp"), Boom()]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
""",
        env={"TFSYNC_SINGLE_PROCESS": "1"},
        timeout_s=90,
    )
    if route == "strategy":
        assert rc == 0 and "FIT DONE" in out, out[-3000:]
    else:
        assert rc != 0 and "the user's error at batch 3" in out, out[-3000:]
