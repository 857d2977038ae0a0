"""tfsync.faults in one process: the schedule's checks and random draws, the ledger's once-only, the
Keras injector's faults in a fit (NaN loss, raise, kill, stop and wake, hang and go on), and the host faults'
sequence against a recording stand-in for the hosts.  The faults in elastic jobs are
tests/parallel/test_elastic_launcher.py's and the chaos bench's."""

import os
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

import tfsync
from tfsync.faults import FLAP_S, HOST_KINDS, KINDS, WORKER_KINDS, Fault, HostFaults, InjectedFault, Ledger, Schedule

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "melt", "rank": 0, "step": 1}, "unknown kind 'melt'"),
        ({"kind": "kill", "rank": 0}, "exactly one of step="),
        ({"kind": "kill", "rank": 0, "step": 1, "at_s": 2.0}, "exactly one of step="),
        ({"kind": "kill", "step": 1}, "needs rank="),
        ({"kind": "kill", "rank": 0, "step": -1}, "step must be an integer >= 0"),
        ({"kind": "kill", "rank": 0, "step": 1, "duration_s": 3}, "only a stop or a hang has a duration"),
        ({"kind": "link_cut", "host": 1, "at_s": 1.0}, "give duration_s="),
        ({"kind": "link_cut", "host": 1, "step": 3, "duration_s": 1}, "takes host= and at_s="),
        ({"kind": "host_removed", "rank": 1, "at_s": 1.0, "duration_s": 1}, "needs host="),
        ({"kind": "stop", "rank": 0, "at_s": float("nan")}, "at_s must be a number of seconds"),
        ({"kind": "stop", "rank": 0, "at_s": 1.0, "duration_s": 0}, "duration_s must be a positive number"),
    ],
)
def test_a_fault_that_cannot_happen_is_refused_saying_what_is_expected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Fault(**kwargs)


def test_a_random_schedule_spaces_its_faults_and_draws_every_kind_as_often():
    schedule = Schedule.random(seed=3, minutes=10, every_s=(10, 20), ranks=4, hosts=(1, 2), start_t=100.0)
    times = [f.at_s for f in schedule.faults]
    gaps = np.diff([0.0, *times])
    assert len(times) >= 30 and all(9.9 <= g <= 20.1 for g in gaps), gaps
    counts = {k: sum(f.kind == k for f in schedule.faults) for k in KINDS}
    assert max(counts.values()) - min(counts.values()) <= 1, counts  # (shuffled cycles of every kind)
    assert {f.rank for f in schedule.faults if f.kind in WORKER_KINDS} <= {0, 1, 2, 3}
    assert {f.host for f in schedule.faults if f.kind in HOST_KINDS} == {1, 2}
    assert all(f.duration_s is None for f in schedule.faults if f.kind == "stop")  # (hangs for good)
    again = Schedule.from_json(schedule.to_json())
    assert again.faults == schedule.faults and again.start_t == 100.0
    assert Schedule.random(seed=3, minutes=10, ranks=4, hosts=(1, 2)).faults == schedule.faults  # (the seed's)


def test_each_fault_is_taken_once_across_processes_sharing_a_ledger(tmp_path):
    first, second = Ledger(str(tmp_path)), Ledger(str(tmp_path))
    assert first.take(3, {"by": "first"}) and not second.take(3, {"by": "second"})
    assert second.taken(3) and not second.taken(4)
    assert first.records() == {3: {"by": "first"}}
    alone = Ledger()
    assert alone.take(3, {}) and not alone.take(3, {})


def _model(injector):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=injector.loss("mse"))
    return model


class Losses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def test_a_nan_fault_poisons_its_step_alone(tmp_path):
    injector = tfsync.faults.Injector(
        Schedule([Fault("nan", rank=1, step=3)]), ledger_dir=str(tmp_path), rank=1, size=2
    )
    model, losses = _model(injector), Losses()
    x, y = np.ones((32, 4), "float32"), np.zeros((32, 3), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[injector, losses])
    # (Keras' logged loss is the epoch's running mean: NaN from the poisoned step on; the step's own
    # gradients made the weights NaN, since nothing here rejects a contribution)
    assert all(np.isfinite(losses.losses[:3])) and np.isnan(losses.losses[3]), losses.losses
    assert [r["step"] for r in injector.injected] == [3]
    assert float(injector._poison.numpy()) == 1.0  # (restored after its step)


def test_a_fault_goes_to_the_rank_that_has_it_modulo_the_size_and_a_time_fault_when_due():
    injector = tfsync.faults.Injector(
        Schedule([Fault("raise", rank=5, step=2), Fault("raise", rank=0, at_s=3600)]), rank=1, size=2
    )
    model = _model(injector)
    x, y = np.ones((32, 4), "float32"), np.zeros((32, 3), "float32")
    with pytest.raises(InjectedFault, match=r"injected raise of rank 5 at step 2 \(rank 1, step 2\)"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[injector])
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[injector])  # (taken: once; the other not due)
    assert len(injector.injected) == 1


def test_a_nan_fault_needs_the_wrapped_loss():
    injector = tfsync.faults.Injector(Schedule([Fault("nan", rank=0, step=1)]), rank=0, size=1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=r"compile the model with loss=injector.loss\(your_loss\)"):
        model.fit(np.ones((8, 4)), np.zeros((8, 3)), verbose=0, callbacks=[injector])


def _fit_in_process(faults, ledger):
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {REPO!r})
        import keras, numpy as np, tfsync
        from tfsync.faults import Fault, Schedule
        injector = tfsync.faults.Injector(Schedule([{faults}]), ledger_dir={ledger!r}, rank=0, size=1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((32, 4)), np.zeros((32, 3)), batch_size=4, verbose=0, callbacks=[injector])
        print("finished", flush=True)
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def test_a_kill_ends_the_process_and_a_stop_or_a_hang_goes_on_after_its_duration(tmp_path):
    killed = _fit_in_process('Fault("kill", rank=0, step=2)', str(tmp_path / "a"))
    assert killed.returncode == -9 and "finished" not in killed.stdout, killed.stderr[-2000:]
    assert Ledger(str(tmp_path / "a")).records()[0]["step"] == 2
    t = time.monotonic()
    stopped = _fit_in_process('Fault("stop", rank=0, step=2, duration_s=2.0)', str(tmp_path / "b"))
    assert stopped.returncode == 0 and "finished" in stopped.stdout, stopped.stderr[-2000:]
    assert time.monotonic() - t >= 2.0
    t = time.monotonic()
    hung = _fit_in_process('Fault("hang", rank=0, step=2, duration_s=2.0)', str(tmp_path / "c"))
    assert hung.returncode == 0 and "finished" in hung.stdout, hung.stderr[-2000:]
    assert time.monotonic() - t >= 2.0 and Ledger(str(tmp_path / "c")).records()[0]["kind"] == "hang"


class RecordingHosts:
    def __init__(self):
        self.calls = []

    def set_link(self, host, up):
        self.calls.append(("link", host, up, time.time()))

    def list_host(self, host, listed):
        self.calls.append(("listed", host, listed, time.time()))


def test_host_faults_cut_flap_and_remove_in_time_and_always_restore(tmp_path):
    start = time.time() + 0.2
    schedule = Schedule(
        [
            Fault("link_cut", host=2, at_s=0.0, duration_s=0.5),
            Fault("link_flap", host=1, at_s=0.6, duration_s=2.5 * FLAP_S),
            Fault("host_removed", host=2, at_s=0.6 + 2.5 * FLAP_S + 0.1, duration_s=0.5),
            Fault("kill", rank=0, at_s=0.0),  # (a worker's: not the harness's)
        ],
        start_t=start,
    )
    hosts = RecordingHosts()
    with HostFaults(schedule, hosts, ledger_dir=str(tmp_path)) as injector:
        deadline = time.time() + 30
        while len(injector.injected) < 3 or hosts.calls[-1][:3] != ("listed", 2, True):
            assert time.time() < deadline and injector.error is None, (hosts.calls, injector.error)
            time.sleep(0.05)
    calls = [c[:3] for c in hosts.calls]
    assert calls == [
        ("link", 2, False),
        ("link", 2, True),
        ("link", 1, False),
        ("link", 1, True),
        ("link", 1, False),
        ("link", 1, True),  # (the flap's end: up)
        ("listed", 2, False),
        ("listed", 2, True),
    ], calls
    assert hosts.calls[0][3] >= start and hosts.calls[1][3] - hosts.calls[0][3] >= 0.5
    assert sorted(Ledger(str(tmp_path)).records()) == [0, 1, 2]
    assert not injector._thread.is_alive()
