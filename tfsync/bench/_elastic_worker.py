"""The digits MLP under tfsync.elastic, with a worker killed mid-epoch: one kill, several, or a kill loop.

Run by ``python -m tfsync.bench elastic`` and by the elastic tests (``tests/parallel/test_elastic_launcher.py``,
``tests/multihost/test_elastic_hosts.py``), under horovodrun's elastic launcher.

Positional: ``out_dir mode victim_rank kill_epochs kill_batch epochs [hosts_file changes]``.
``mode``: a mode's name, or ``psp:C`` for ``PSP(min_contributions=C)``.  ``victim_rank`` -1:
nobody is killed (the undisturbed run).  The process that has rank ``victim_rank`` while the job
has as many workers as at launch kills itself (SIGKILL) after batch ``kill_batch`` of each epoch
in ``kill_epochs`` (``2,6,10``: several kills), once per epoch number.  ``changes``:
``EPOCH=HOST:SLOTS+HOST:SLOTS;...``: at the end of that epoch (once per job), rank 0 writes those
hosts to ``hosts_file``, which the launcher's discovery script prints, and waits (up to
``NOTICE_WAIT_S``) for the launcher's notice of the change.

``--faults FILE``: injects the worker faults of that :class:`tfsync.faults.Schedule` (its
JSON), recorded once each under ``out_dir/faults``; ``--wait-timeout-s S``: the callback's and
the state's wait bound (default 30 s for the callback, the state's own default for it);
``--hang-timeout-s S``: the state's ``hang_timeout_s`` (default ``"auto"``).

``--commit-every N``: commits every ``N`` steps within an epoch too, and the data resumes at
the committed sample (one ``fit`` per epoch on ``tfsync.shard(..., resume=state, seed=0)``);
each membership record then says the sample the call resumed at.

Options for a kill loop: ``--kill-every-s S`` kills (as above, at ``kill_batch``) in the first
epoch that begins ``S`` seconds or more after the previous kill (or ``--start-t``), instead of at
``kill_epochs``; ``--deadline-t T`` (a Unix time): no kill starts later than ``S / 2`` before
``T``, and the job stops at the first epoch end after ``T`` (rank 0 decides, by a broadcast, so
that every member stops at the same epoch).

``--repeat R``: the training split R times over (an epoch R times as long); ``--step-log``:
every step appended to ``every_step_<pid>.jsonl`` (``t``, ``pid``, ``r``: the resets so far,
``n``: the job's size).

Each process that finishes writes ``result_rank<R>.json`` (its rank at the end): its final test
accuracy, its counts and the state's, and ``init_t``, when it reached its first ``hvd.init()``.
Rank 0's ``notices``: for each epoch whose end changed the hosts, when the launcher's notice
came (None: not within ``NOTICE_WAIT_S``).  The victim writes ``killed_<epoch>.json`` and
``killed.json`` (the last kill: when, which rank and process) before it dies.  Every process
appends to ``steps_<pid>.jsonl``, at its first step after each reset (a joining process: its first
step), when that step ended, the end of its last step before, the membership, and how many
batches of the epoch the reset restarts it had finished (the steps it redoes): a process killed
later keeps these records.
"""

import argparse
import json
import logging
import os
import signal
import time

# (before TensorFlow loads: each line stamped, so a reset's line, less its "re-formed in", is when it began)
logging.basicConfig(format="%(asctime)s %(message)s")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfsync  # noqa: E402
import tfsync.elastic  # noqa: E402
from tfsync.policies import registry  # noqa: E402

# after writing the hosts file, rank 0 waits for the launcher's notice of the change, up to this
# long (below the others' 30-s wait bound: they wait in the next collective meanwhile): the
# launcher runs the discovery script every second, and holds the notice of an added host back
# until the workers it started there reach hvd.init() (their imports: seconds)
NOTICE_WAIT_S = 25.0
BATCH = 16


def _write_json(path, record):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("mode")
    p.add_argument("victim", type=int)
    p.add_argument("kill_epochs")
    p.add_argument("kill_batch", type=int)
    p.add_argument("epochs", type=int)
    p.add_argument("hosts_file", nargs="?")
    p.add_argument("changes", nargs="?", default="")
    p.add_argument("--kill-every-s", type=float, default=None)
    p.add_argument("--start-t", type=float, default=None)
    p.add_argument("--deadline-t", type=float, default=None)
    p.add_argument("--commit-every", type=int, default=None)
    p.add_argument("--faults", default=None, help="a tfsync.faults.Schedule's JSON file: inject its worker faults")
    p.add_argument("--repeat", type=int, default=1, help="the training split this many times over (longer epochs)")
    p.add_argument("--step-log", action="store_true", help="append every step to steps_<pid>.jsonl, not only resets'")
    p.add_argument("--hang-timeout-s", type=float, default=None, help="the state's hang_timeout_s (default auto)")
    p.add_argument("--wait-timeout-s", type=float, default=None, help="the callback's and the state's wait bound")
    args = p.parse_args(argv)
    args.kill_epochs = {int(e) for e in args.kill_epochs.split(",") if e}
    changes = {}
    for item in filter(None, args.changes.split(";")):
        at, hosts = item.split("=")
        changes[int(at)] = hosts.split("+")
    args.changes = changes
    return args


def _data(repeat):
    """The digits split (scikit-learn's offline ``load_digits``), the training set ``repeat`` times over."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return np.tile(x_train, (repeat, 1)), np.tile(y_train, repeat), x_test, y_test


def _model(args):
    """The MLP, compiled, and the fault injectors of ``--faults`` (whose loss it takes: a ``"nan"``
    fault needs it)."""
    injectors, loss = [], "sparse_categorical_crossentropy"
    if args.faults is not None:
        with open(args.faults) as f:
            schedule = tfsync.faults.Schedule.from_json(f.read())
        injectors.append(tfsync.faults.Injector(schedule, ledger_dir=os.path.join(args.out_dir, "faults")))
        loss = injectors[0].loss(loss)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax")]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss=loss, metrics=["accuracy"])
    return model, injectors


def _sync(args, model):
    """The elastic state and the callback that commits it (``mode``: a registered mode's name, or
    ``psp:C``)."""
    mode, _, contributions = args.mode.partition(":")
    if contributions:
        mode = registry.get(mode).build(min_contributions=int(contributions))
    state = tfsync.elastic.KerasState(
        model,
        epoch=0,
        commit_every_steps=args.commit_every or "auto",
        wait_timeout_s=args.wait_timeout_s,
        hang_timeout_s=args.hang_timeout_s or "auto",
    )  # (the state's default bound: 120 s, which a joiner's start-up may take)
    trace_dir = os.path.join(args.out_dir, "trace")
    sync = tfsync.keras.SyncCallback(mode, elastic=state, wait_timeout_s=args.wait_timeout_s or 30, trace_dir=trace_dir)
    return state, sync


class Victim(keras.callbacks.Callback):
    """Kills this process when it is due; records the steps after each reset; changes the hosts
    and stops at the deadline at epoch ends (the module docstring)."""

    def __init__(self, args, state, full, seen):
        super().__init__()
        self.args, self.state, self.full, self.seen = args, state, full, seen
        self.stopped = []  # the deadline passed (a fit per epoch: stop_training ends only the one)
        self.epoch = None
        self.batches_done = 0  # in the epoch under way
        self.last_step_t = None
        self.logged_resets, self.logged_start = 0, False
        self.rolled_back = 0  # batches of the epoch a reset restarted, finished before it
        self.redone_before = 0  # (--commit-every) the steps redone counted before this reset
        self.steps_log = os.path.join(args.out_dir, f"steps_{os.getpid()}.jsonl")
        self.every_step_log = None
        if args.step_log:  # (one open file, a line a step, flushed: a kill keeps what it wrote)
            path = os.path.join(args.out_dir, f"every_step_{os.getpid()}.jsonl")
            self.every_step_log = open(path, "a", buffering=1)  # noqa: SIM115

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.batches_done = 0

    def _kill_due(self, batch):
        args = self.args
        if hvd.rank() != args.victim or hvd.size() != self.full or batch != args.kill_batch:
            return False
        if os.path.exists(os.path.join(args.out_dir, f"killed_{self.epoch}.json")):
            return False
        if args.kill_every_s is None:
            return self.epoch in args.kill_epochs
        now = time.time()
        kills = [p for p in os.listdir(args.out_dir) if p.startswith("killed_")]
        last = max([json.load(open(os.path.join(args.out_dir, p)))["t"] for p in kills] + [args.start_t or 0.0])
        late = args.deadline_t is not None and now > args.deadline_t - args.kill_every_s / 2
        return now - last >= args.kill_every_s and not late

    def _kill(self):
        record = {"t": time.time(), "rank": hvd.rank(), "pid": os.getpid(), "epoch": self.epoch}
        for name in (f"killed_{self.epoch}.json", "killed.json"):  # (killed.json: the last)
            _write_json(os.path.join(self.args.out_dir, name), record)
        os.kill(os.getpid(), signal.SIGKILL)

    def _log_first_step(self, now):
        """This process's first step after a reset (or its first at all): recorded."""
        state = self.state
        if state.resets > 0 and self.seen["first_step_after_reset_t"] is None:
            self.seen["first_step_after_reset_t"] = now
        record = {
            "pid": os.getpid(),
            "resets": state.resets,
            "first_step_t": now,
            "last_step_before_t": self.last_step_t,
            "rank": hvd.rank(),
            "size": hvd.size(),
            "epoch": self.epoch,
            "rolled_back": self.rolled_back if self.logged_start else 0,
        }
        with open(self.steps_log, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.logged_resets, self.logged_start = state.resets, True

    def on_train_batch_end(self, batch, logs=None):
        if self._kill_due(batch):
            self._kill()
        now = time.time()
        self.batches_done = batch + 1
        if self.state.resets > self.logged_resets or not self.logged_start:
            self._log_first_step(now)
        self.last_step_t = now
        if self.every_step_log is not None:
            line = {"pid": os.getpid(), "t": now, "r": self.state.resets, "n": hvd.size()}
            self.every_step_log.write(json.dumps(line) + "\n")

    def _change_hosts(self, epoch):
        """Write the hosts this epoch's end changes to (once per job) and wait, bounded, for the
        launcher's notice of the change."""
        args = self.args
        marker = os.path.join(args.out_dir, f"hosts_changed_{epoch}")
        if os.path.exists(marker):
            return
        open(marker, "w").close()
        with open(args.hosts_file + ".tmp", "w") as f:
            f.write("".join(h + "\n" for h in args.changes[epoch]))
        os.replace(args.hosts_file + ".tmp", args.hosts_file)
        written_s, deadline = int(time.time()), time.monotonic() + NOTICE_WAIT_S

        def noticed():  # (Horovod's State queues the launcher's notices, stamped in whole
            # seconds, for its next commit to raise; one of an earlier change may be there)
            return any(stamp >= written_s for stamp, _ in list(self.state._host_messages.queue))

        while not noticed() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.seen["notices"][epoch] = time.time() if noticed() else None

    def on_epoch_end(self, epoch, logs=None):
        self.seen["epochs"].append(epoch)
        self.batches_done = 0
        if epoch in self.args.changes and hvd.rank() == 0:
            self._change_hosts(epoch)
        if self.args.deadline_t is not None:
            stop = hvd.broadcast_object(time.time() >= self.args.deadline_t, root_rank=0, name="bench.elastic.stop")
            if stop:
                self.model.stop_training = True
                self.stopped.append(epoch)


def _training(args, model, sync, victim, injectors, x_train, y_train):
    """The training function, re-entered after every reset (:func:`tfsync.elastic.run`)."""
    resume, seen = args.commit_every is not None, victim.seen

    def fit(x, y, **epochs):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[sync, victim, *injectors], **epochs)

    @tfsync.elastic.run
    def train(state):
        # a reset restarts the epoch state.epoch: the batches of it this process had finished are redone
        victim.rolled_back = victim.batches_done if victim.epoch == state.epoch else 0
        if resume:  # from the last commit, within the epoch: the callback counted them
            redone = sync.counts["steps_redone"]
            victim.rolled_back, victim.redone_before = redone - victim.redone_before, redone
        membership = {"rank": hvd.rank(), "size": hvd.size(), "epoch": state.epoch}
        seen["memberships"].append({**membership, "sample": state.sample} if resume else membership)
        seen["counts_after_resets"].append([sync.counts, state.counts])  # (each must add up)
        if resume:  # one fit per epoch, from the committed sample of the committed epoch
            while state.epoch < args.epochs and not victim.stopped:
                x_local, y_local = tfsync.shard(x_train, y_train, batch_size=BATCH, resume=state, seed=0)
                fit(x_local, y_local, epochs=state.epoch + 1, initial_epoch=state.epoch, shuffle=False)
            return
        x_local, y_local = tfsync.shard(x_train, y_train, batch_size=BATCH)
        fit(x_local, y_local, epochs=args.epochs, initial_epoch=state.epoch, shuffle=True)

    return train


def main(argv=None):
    args = parse_args(argv)
    x_train, y_train, x_test, y_test = _data(args.repeat)
    model, injectors = _model(args)
    # (everything that needs no peer is ready before hvd.init(): Horovod's launcher, as tfsync's
    # install patches it, tells the job of a joining process only once it is here)
    init_t = time.time()
    hvd.init()
    full = hvd.size()  # the job's size at launch: kills happen while it is whole
    state, sync = _sync(args, model)
    seen = {"epochs": [], "first_step_after_reset_t": None, "memberships": [], "counts_after_resets": [], "notices": {}}
    victim = Victim(args, state, full, seen)
    _training(args, model, sync, victim, injectors, x_train, y_train)(state)
    seen["end_t"] = time.time()
    accuracy = float(model.evaluate(x_test, y_test, verbose=0)[1])
    checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
    _write_json(
        os.path.join(args.out_dir, f"result_rank{hvd.rank()}.json"),
        {
            "accuracy": accuracy,
            "counts": sync.counts,
            "state_counts": state.counts,
            "resets": state.resets,
            "state_epoch": state.epoch,
            "size": hvd.size(),
            "rank_at_end": hvd.rank(),
            "pid": os.getpid(),
            "init_t": init_t,
            "checksum": checksum,
            **seen,
        },
    )


if __name__ == "__main__":
    main()
