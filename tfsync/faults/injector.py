"""The worker's side of fault injection: a Keras callback that makes a schedule's faults happen
in this worker's ``fit`` (:mod:`tfsync.faults` says what each kind does; also reached as
``tfsync.faults.Injector``)."""

import os
import signal
import subprocess
import time

import keras

from tfsync.faults.schedule import WORKER_KINDS, InjectedFault, Ledger, Schedule


class FaultInjector(keras.callbacks.Callback):
    """A Keras callback that injects a :class:`Schedule`'s worker faults into this worker's ``fit``.

    At each step's begin it takes the due faults of this worker's rank (``rank % size``, the
    size and rank from Horovod, or ``rank``/``size`` given), records each in the ledger, then
    makes it happen (:mod:`tfsync.faults` says what each kind does).  A ``"nan"`` fault needs the model's loss
    wrapped by :meth:`loss`; a schedule with one is refused at ``fit``'s begin otherwise.

    Args:
        schedule: the :class:`Schedule`.
        ledger_dir: a directory every process of the job sees (default None: this process's
            memory only).
        rank: this worker's rank (default: Horovod's, read at each step).
        size: the job's size (default: Horovod's, read at each step).
    """

    def __init__(self, schedule, ledger_dir=None, rank=None, size=None):
        super().__init__()
        if not isinstance(schedule, Schedule):
            raise TypeError(
                f"tfsync.faults.Injector (tfsync.keras.FaultInjector) takes a tfsync.faults.Schedule, got "
                f"{type(schedule).__name__}; build one: tfsync.faults.Schedule([tfsync.faults.Fault(...), ...])"
            )
        self.schedule = schedule
        self.ledger = Ledger(ledger_dir)
        # the worker faults not yet taken by this process: a step looks at these only
        self._pending = [(i, f) for i, f in enumerate(schedule.faults) if f.kind in WORKER_KINDS]
        self._rank, self._size = rank, size
        self._poison = None  # the loss's factor (1, or NaN for a "nan" fault's step)
        self._poisoned = False
        self.injected = []  # the faults this process injected, as recorded

    def loss(self, loss):
        """``loss`` (a Keras loss, its name or a function ``(y_true, y_pred)``) times a factor that a
        ``"nan"`` fault sets to NaN for one step."""
        base = keras.losses.get(loss) if isinstance(loss, str) else loss
        if self._poison is None:
            self._poison = keras.Variable(1.0, trainable=False, dtype="float32", name="tfsync_fault_poison")
        poison = self._poison

        def poisoned(y_true, y_pred):
            return keras.ops.multiply(base(y_true, y_pred), poison)

        poisoned.__name__ = getattr(base, "__name__", "loss")
        return poisoned

    def _who(self):
        if self._rank is not None:
            return self._rank, self._size or 1
        from tfsync import _horovod

        hvd = _horovod.horovod()
        return hvd.rank(), hvd.size()

    def on_train_begin(self, logs=None):
        if self._poison is None and any(f.kind == "nan" for f in self.schedule.faults):
            raise ValueError(
                'tfsync.faults.Injector: the schedule has "nan" faults but the model\'s loss is not wrapped; '
                "compile the model with loss=injector.loss(your_loss)"
            )

    def on_train_batch_begin(self, batch, logs=None):
        if not self._pending:
            return
        rank, size = self._who()
        step = int(self.model.optimizer.iterations.numpy())
        elapsed = time.time() - self.schedule.start_t
        for index, fault in list(self._pending):
            if fault.rank % size != rank:
                continue
            if (step < fault.step) if fault.step is not None else (elapsed < fault.at_s):
                continue
            if self.ledger.taken(index):  # (after the cheap checks: with a directory, a file's existence)
                self._pending.remove((index, fault))
                continue
            self._pending.remove((index, fault))
            record = {
                "kind": fault.kind,
                "rank": rank,
                "size": size,
                "pid": os.getpid(),
                "t": time.time(),
                "step": step,
            }
            if self.ledger.take(index, record):
                self.injected.append(record)
                self._inject(fault, rank, step)

    def on_train_batch_end(self, batch, logs=None):
        if self._poisoned:
            self._poison.assign(1.0)
            self._poisoned = False

    def _inject(self, fault, rank, step):
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "stop":
            if fault.duration_s is not None:  # a helper wakes this process (it cannot wake itself)
                subprocess.Popen(
                    ["sh", "-c", f"sleep {fault.duration_s}; kill -CONT {os.getpid()}"],
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,  # (its kill finds no process if the hang guard ended this one)
                )
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "hang":  # (this thread only: the heartbeat, the engine's threads go on)
            if fault.duration_s is None:
                while True:
                    time.sleep(3600.0)
            time.sleep(fault.duration_s)
        elif fault.kind == "raise":
            raise InjectedFault(f"tfsync.faults: injected {fault.describe()} (rank {rank}, step {step})")
        elif fault.kind == "nan":
            self._poison.assign(float("nan"))
            self._poisoned = True


__all__ = ["FaultInjector"]
