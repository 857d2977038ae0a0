"""Every configuration value a user sets, refused when it is bad, before any work starts, with
what was wrong, what was expected and how to fix it: one table.

Each entry of :data:`BAD_INPUTS` is one setting (an argument, a policy's field, an environment
variable, a straggler spec's item, a command-line option) with one bad value, the call that
meets it first (building the object, the reader of the variable, the command line's parser),
the error expected and three patterns its message must match: the value named, the
expectation, a fix.  Its ``readme`` line is what the README's errors section lists
(:func:`test_the_readme_lists_every_bad_input`).  Cases that need several ranks (ranks with
different models, optimizers or steps per epoch) stay in ``test_start_check.py`` and
``test_callback_fake.py``.
"""

import argparse
import dataclasses
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable
from unittest import mock

import keras
import numpy as np
import pytest
from fake_cluster import FakeCluster

import tfsync
from tfsync import _data, _env, _horovod, demo, launch
from tfsync.bench import __main__ as bench_main
from tfsync.bench import training as bench_training
from tfsync.launch import REPO_ROOT
from tfsync.ops import _select as ops_select
from tfsync.scheduler import _backend as scheduler_backend
from tfsync.stragglers import Stragglers

WHERE = ("arguments", "policies", "environment variables", "straggler specs", "command lines")


@dataclasses.dataclass(frozen=True)
class Bad:
    """One bad input: ``trigger()`` meets it and raises ``error``, whose message (with what the
    command line's parser wrote to stderr) matches ``value`` (the value named), ``expected``
    and ``fix``.  ``where``: one of :data:`WHERE`; ``readme``: its line in the README."""

    id: str
    where: str
    readme: str
    trigger: Callable[[], object]
    error: type
    value: str
    expected: str
    fix: str


def _env_var(name, raw, read):
    """``read()`` with the environment variable ``name`` set to ``raw`` (restored after)."""

    def trigger():
        with mock.patch.dict(os.environ, {name: raw}):
            return read()

    return trigger


def _example(name):
    """``keras_examples/<name>.py`` as a module (its ``parse_args`` is the command line; the folder
    on ``sys.path`` while it loads, as when it runs: an example may import ``digits.py``'s helpers)."""
    examples = os.path.join(REPO_ROOT, "keras_examples")
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(examples, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, examples)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(examples)
    return module


def _cli(parse, *argv):
    return lambda: parse(list(argv))


def _digits(*argv):
    return lambda: _example("digits").parse_args(list(argv))


def _demo(*argv):
    return lambda: demo.main(list(argv))


def _resnet(*argv):
    return lambda: _example("resnet_digits").parse_args(list(argv))


def _text_lm(*argv):
    return lambda: _example("text_lm").parse_args(list(argv))


def _fit_on_no_data():
    """``fit`` under ``SyncCallback`` on a shard without a batch (one rank of an in-process cluster)."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    callback = tfsync.keras.SyncCallback("bsp", cluster=FakeCluster(1).rank(0), wait_timeout_s=10)
    empty = np.zeros((0, 2), np.float32)
    model.fit(empty, empty[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[callback])


def _elastic_state(model, compile_):
    import tfsync.elastic

    if compile_:
        model.compile(optimizer="sgd", loss="mse")
    return tfsync.elastic.KerasState(model)


def _elastic_under_strategy():
    """``KerasState`` of a model built in ``SyncStrategy``'s scope (one in-process rank)."""
    import tfsync.elastic

    with tfsync.distribute.SyncStrategy("bsp", cluster=FakeCluster(1).rank(0), wait_timeout_s=10).scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    return tfsync.elastic.KerasState(model)


def _elastic_run_in_strategy_scope():
    """``tfsync.elastic.run``'s function called in ``SyncStrategy``'s scope, its model built outside."""
    import tfsync.elastic

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    state = tfsync.elastic.KerasState(model)
    train = tfsync.elastic.run(lambda state: None)
    with tfsync.distribute.SyncStrategy("bsp", cluster=FakeCluster(1).rank(0), wait_timeout_s=10).scope():
        train(state)


def _elastic_interval(**interval):
    import tfsync.elastic

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return lambda: tfsync.elastic.KerasState(model, **interval)


def _commit_dir_of_another_model():
    import tempfile

    import numpy as np

    from tfsync._commit_store import CommitStore

    directory = tempfile.mkdtemp(prefix="tfsync-commits-")
    attrs = {"epoch": 0, "sample": 0, "resets": 0, "counts": {}}
    CommitStore(directory)._write_file([np.zeros((5, 1), "float32")], attrs, (0, 0))  # another model's
    return _elastic_interval(commit_dir=directory)()


def _commit_dir_under_a_file():
    import tempfile

    with tempfile.NamedTemporaryFile() as f:
        return _elastic_interval(commit_dir=f.name + "/job")()


def _nan_fault_without_wrapped_loss():
    import tfsync.faults

    injector = tfsync.faults.Injector(tfsync.faults.Schedule([tfsync.faults.Fault("nan", rank=0, step=1)]), rank=0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.zeros((4, 2)), np.zeros((4, 1)), verbose=0, callbacks=[injector])


def _one_worker(fn):
    """``fn()`` as rank 0 of one worker for the data helpers (no Horovod needed)."""

    def trigger():
        with mock.patch.object(_data, "_membership", lambda: (0, 1)):
            return fn()

    return trigger


def _elastic_fit(mode, resume=True, **interval):
    """A fit that the state's commits within an epoch cannot run under (one in-process rank), on
    data from the state's position (``resume``) or not."""

    def trigger():
        import tfsync.elastic

        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        state = tfsync.elastic.KerasState(model, **interval)
        callback = tfsync.keras.SyncCallback(mode, cluster=FakeCluster(1).rank(0), elastic=state, wait_timeout_s=10)
        x = np.zeros((16, 2), np.float32)
        with mock.patch.object(_data, "_membership", lambda: (0, 1)):
            x_local, y_local = tfsync.shard(x, x[:, :1], batch_size=4, resume=state if resume else None)
        model.fit(x_local, y_local, batch_size=4, epochs=1, verbose=0, shuffle=False, callbacks=[callback])

    return trigger


def _strategy(mode):
    return lambda: tfsync.distribute.SyncStrategy(mode=mode, cluster=FakeCluster(1).rank(0))


A, P, E, S, C = WHERE
BAD_INPUTS = [
    # ------------------------------------------------------------------ arguments
    Bad(
        "mode-unknown",
        A,
        "`mode` not a registered mode's name, `'auto'` or a policy object",
        lambda: tfsync.keras.SyncCallback(mode="fastest"),
        ValueError,
        r"unknown synchronization mode 'fastest'",
        r"expected one of 'bsp', 'ssp'",
        r"or a policy object such as tfsync\.SSP\(staleness=3\)",
    ),
    Bad(
        "mode-class",
        A,
        "`mode` a policy class instead of an instance (`mode=tfsync.SSP`)",
        lambda: tfsync.keras.SyncCallback(mode=tfsync.SSP),
        TypeError,
        r"mode=SSP",
        r"pass an instance",
        r"e\.g\. mode=tfsync\.SSP\(\)",
    ),
    Bad(
        "strategy-auto",
        A,
        "`mode='auto'` given to `SyncStrategy` (only `SyncCallback` switches modes)",
        _strategy("auto"),
        ValueError,
        r"mode 'auto'",
        r"only tfsync\.keras\.SyncCallback does",
        r"use SyncCallback\(mode='auto'\) with model\.fit, or pass a mode such as 'bsp'",
    ),
    Bad(
        "engine-mode-name",
        A,
        "`tfsync.engine.SyncEngine` given a mode's name instead of a policy object",
        lambda: tfsync.engine.SyncEngine("ssp"),
        TypeError,
        r"got 'ssp'",
        r"policy must be a resolved mode",
        r"pass e\.g\. tfsync\.policies\.resolve\('ssp'\)",
    ),
    Bad(
        "strategy-partial-pull",
        A,
        "`SyncStrategy` with PSP's partial pulling (`pull_fraction` below 1)",
        _strategy(tfsync.PSP(pull_fraction=0.5)),
        ValueError,
        r"PSP\(pull_fraction=0\.5\)",
        r"only tfsync\.keras\.SyncCallback drives",
        r"use SyncCallback with model\.fit, or pull_fraction=1\.0 here",
    ),
    Bad(
        "wait-timeout-argument",
        A,
        "`wait_timeout_s` not a finite number of seconds > 0",
        lambda: tfsync.keras.SyncCallback(wait_timeout_s=math.inf),
        ValueError,
        r"wait_timeout_s=inf",
        r"must be a finite, positive number of seconds",
        r"pass e\.g\. 120",
    ),
    Bad(
        "on-nonfinite",
        A,
        "`on_nonfinite` not `'reject'` or `'raise'`",
        lambda: tfsync.keras.SyncCallback(on_nonfinite="ignore"),
        ValueError,
        r"on_nonfinite='ignore'",
        r"is not one of \['reject', 'raise'\]",
        r"use 'reject' .* or 'raise'",
    ),
    Bad(
        "elastic-type",
        A,
        "`elastic=` neither a `tfsync.elastic.KerasState` nor `None`",
        lambda: tfsync.keras.SyncCallback(elastic={"epoch": 0}),
        TypeError,
        r"elastic must be a tfsync\.elastic\.KerasState or None, got dict",
        r"tfsync\.elastic\.KerasState or None",
        r"pass elastic=tfsync\.elastic\.KerasState\(model\)",
    ),
    Bad(
        "elastic-state-model",
        A,
        "`tfsync.elastic.KerasState(model)` on a model not built, without an optimizer, or trained under "
        "`SyncStrategy` (which cannot re-form the job; `tfsync.elastic.run` refuses it too)",
        lambda: _elastic_state(keras.Sequential([keras.layers.Dense(2)]), compile_=True),
        ValueError,
        r"the model is not built",
        r"has no variables to keep",
        r"start it with keras\.Input\(shape\)",
    ),
    Bad(
        "stragglers-type",
        A,
        "`stragglers=` neither a `tfsync.Stragglers` nor `None` (e.g. a spec string)",
        lambda: tfsync.keras.SyncCallback(stragglers="base=0.02"),
        TypeError,
        r"stragglers must be a tfsync\.Stragglers or None, got str",
        r"tfsync\.Stragglers or None",
        r"pass e\.g\. tfsync\.Stragglers\.parse\('base=0\.02,slow=1:0\.04'\)",
    ),
    Bad(
        "trace-dir-type",
        A,
        "`trace_dir=` neither a directory path nor `None`",
        lambda: tfsync.keras.SyncCallback(trace_dir=3),
        TypeError,
        r"trace_dir must be .*got int",
        r"a directory path \(str or os\.PathLike\) or None",
        r"pass e\.g\. trace_dir='traces/run1'",
    ),
    Bad(
        "steps-per-epoch",
        A,
        "steps per epoch below 1 under `SyncCallback` (a worker's data holds no batch)",
        _fit_on_no_data,
        ValueError,
        r"steps per epoch is 0",
        r"expected an integer >= 1",
        r"Give every worker at least one batch",
    ),
    Bad(
        "elastic-commit-interval",
        A,
        '`KerasState(commit_every_steps=..., commit_every_s=...)`: not an integer >= 1, `"auto"` or '
        '`"epoch"`; seconds not > 0, or with `"epoch"`',
        _elastic_interval(commit_every_steps=0),
        ValueError,
        r"commit_every_steps=0",
        r"expected an integer >= 1",
        r'"auto" \(every 100 steps where mid-epoch commits can run\) or "epoch"',
    ),
    Bad(
        "elastic-hang-timeout",
        A,
        '`KerasState(hang_timeout_s=...)` not `"auto"`, seconds > 0 or `None`; `commit_dir=` a directory that '
        "cannot be made, or that holds another model's commit",
        _elastic_interval(hang_timeout_s=0),
        ValueError,
        r"got 0;",
        r'hang_timeout_s must be "auto", a positive number of seconds or None',
        r'pass hang_timeout_s="auto" \(the wait bound plus 2 s\), e\.g\. 60, or None \(no hang guard\)',
    ),
    Bad(
        "fault",
        A,
        "a `tfsync.faults.Fault` that cannot happen (an unknown kind, neither or both of `step=` and `at_s=`, a "
        "worker's fault without `rank=`, a host's without `host=` and `duration_s=`); a `\"nan\"` fault with the "
        "model's loss not wrapped by `injector.loss(...)`",
        lambda: tfsync.faults.Fault("melt", rank=0, step=1),
        ValueError,
        r"unknown kind 'melt'",
        r"choose among \['kill', 'stop', 'raise', 'nan', 'hang', 'link_cut', 'link_flap', 'host_removed'\]",
        r"choose among",
    ),
    Bad(
        "elastic-commits-cannot-run",
        A,
        "commits within an epoch asked of a `fit` that cannot make them (a mode without rest points, data "
        "without a position), or data not from the committed sample (checked when `fit` starts)",
        _elastic_fit("ssp", commit_every_steps=2),
        ValueError,
        r"commit_every_steps=2",
        r"lets a worker go on before its round completes",
        r'commit_every_steps="epoch"\) to commit at epoch ends only',
    ),
    Bad(
        "data-position",
        A,
        "`tfsync.shard(resume=...)` without `batch_size`, or `seed=` without `resume=`; "
        "`tfsync.shard_dataset` of unknown size without `samples=`",
        _one_worker(lambda: tfsync.shard(np.zeros(8), resume=object())),
        ValueError,
        r"resume= needs batch_size=",
        r"the data position advances by every worker's batch",
        r"pass the batch_size you give model\.fit",
    ),
    # ------------------------------------------------------------------- policies
    Bad(
        "ssp-staleness",
        P,
        "`SSP(staleness=...)` negative or not an integer",
        lambda: tfsync.SSP(staleness=-1),
        ValueError,
        r"SSP\(staleness=-1\)",
        r"must be >= 0",
        r"e\.g\. tfsync\.SSP\(staleness=3\)",
    ),
    Bad(
        "dssp-bounds",
        P,
        "`DSSP(low=..., high=...)` negative, not integers, or `low` above `high`",
        lambda: tfsync.DSSP(low=10, high=3),
        ValueError,
        r"DSSP\(low=10, high=3\)",
        r"lower staleness bound must not exceed the upper one",
        r"use low <= high",
    ),
    Bad(
        "elasticbsp-lookahead",
        P,
        "`ElasticBSP(lookahead=...)` below 1 or not an integer",
        lambda: tfsync.ElasticBSP(lookahead=0),
        ValueError,
        r"ElasticBSP\(lookahead=0\)",
        r"must be >= 1",
        r"e\.g\. tfsync\.ElasticBSP\(lookahead=15\)",
    ),
    Bad(
        "elasticbsp-algorithm",
        P,
        "`ElasticBSP(algorithm=...)` not a ZipLine variant",
        lambda: tfsync.ElasticBSP(algorithm="fast"),
        ValueError,
        r"ElasticBSP\(algorithm='fast'\)",
        r"expected one of .*'optbs'",
        r"default 'optbs'",
    ),
    Bad(
        "psp-min-contributions",
        P,
        "`PSP(min_contributions=...)` below 1 or not an integer",
        lambda: tfsync.PSP(min_contributions=0),
        ValueError,
        r"PSP\(min_contributions=0\)",
        r"must be >= 1",
        r"e\.g\. tfsync\.PSP\(min_contributions=3",
    ),
    Bad(
        "psp-min-contributions-workers",
        P,
        "`PSP(min_contributions=...)` above the number of workers (checked when training starts)",
        lambda: tfsync.PSP(min_contributions=5).validate(4),
        ValueError,
        r"PSP\(min_contributions=5\) with 4 workers",
        r"can never gather more contributions than there are workers",
        r"use min_contributions <= 4",
    ),
    Bad(
        "psp-push-timeout",
        P,
        "`PSP(push_timeout_s=...)` negative or not finite",
        lambda: tfsync.PSP(push_timeout_s=math.nan),
        ValueError,
        r"PSP\(push_timeout_s=nan\)",
        r"must be a finite number of seconds >= 0 or None",
        r"e\.g\. tfsync\.PSP\(min_contributions=3, push_timeout_s=0\.0\)",
    ),
    Bad(
        "psp-pull-fraction",
        P,
        "`PSP(pull_fraction=...)` outside (0, 1]",
        lambda: tfsync.PSP(pull_fraction=1.5),
        ValueError,
        r"PSP\(pull_fraction=1\.5\)",
        r"a number in \(0, 1\]",
        r"e\.g\. tfsync\.PSP\(pull_fraction=0\.75",
    ),
    Bad(
        "psp-pull-timeout",
        P,
        "`PSP(pull_timeout_s=...)` negative or not finite",
        lambda: tfsync.PSP(pull_fraction=0.75, pull_timeout_s=-1.0),
        ValueError,
        r"PSP\(pull_timeout_s=-1\.0\)",
        r"must be a finite number of seconds >= 0 or None",
        r"e\.g\. tfsync\.PSP\(pull_fraction=0\.75, pull_timeout_s=None",
    ),
    Bad(
        "psp-pull-blocks",
        P,
        "`PSP(pull_blocks=...)` below 1 or not an integer",
        lambda: tfsync.PSP(pull_fraction=0.75, pull_blocks=0),
        ValueError,
        r"PSP\(pull_blocks=0\)",
        r"must be >= 1",
        r"e\.g\. tfsync\.PSP\(pull_fraction=0\.75",
    ),
    Bad(
        "psp-pull-settings-without-partial-pulling",
        P,
        "`PSP(pull_timeout_s=...)` or `pull_blocks` without partial pulling (`pull_fraction=1.0`)",
        lambda: tfsync.PSP(pull_blocks=4),
        ValueError,
        r"pull_blocks=4\) with pull_fraction=1\.0",
        r"act only with partial pulling",
        r"set pull_fraction below 1 \(e\.g\. 0\.75\) or leave them out",
    ),
    Bad(
        "psp-pull-with-compensation",
        P,
        "`PSP` with both partial pulling and `compensate=`",
        lambda: tfsync.PSP(pull_fraction=0.75, compensate=tfsync.DelayCompensation()),
        ValueError,
        r"PSP\(pull_fraction=0\.75, compensate=\.\.\.\)",
        r"cannot be combined",
        r"use one of them",
    ),
    Bad(
        "backups",
        P,
        "`BackupWorkers(backups=...)` negative or not an integer",
        lambda: tfsync.BackupWorkers(backups=-1),
        ValueError,
        r"BackupWorkers\(backups=-1\)",
        r"must be >= 0",
        r"e\.g\. tfsync\.BackupWorkers\(backups=1\)",
    ),
    Bad(
        "backups-workers",
        P,
        "`BackupWorkers(backups=...)` not below the number of workers (checked when training starts)",
        lambda: tfsync.BackupWorkers(backups=2).validate(2),
        ValueError,
        r"BackupWorkers\(backups=2\) with 2 workers",
        r"at least one worker must count in every round",
        r"use backups <= 1",
    ),
    Bad(
        "compensate",
        P,
        "`compensate=` (PSP, backup workers) neither `None` nor a `tfsync.DelayCompensation`",
        lambda: tfsync.PSP(compensate=0.04),
        TypeError,
        r"PSP\(compensate=0\.04\)",
        r"must be None .* or a tfsync\.DelayCompensation",
        r"e\.g\. tfsync\.PSP\(compensate=tfsync\.DelayCompensation\(lam=0\.04\)\)",
    ),
    Bad(
        "dc-lambda",
        P,
        "`DelayCompensation(lam=...)` negative or not finite",
        lambda: tfsync.DelayCompensation(lam=-0.1),
        ValueError,
        r"DelayCompensation\(lam=-0\.1\)",
        r"must be a finite number >= 0",
        r"e\.g\. tfsync\.DelayCompensation\(lam=0\.04\)",
    ),
    Bad(
        "dc-momentum",
        P,
        "`DelayCompensation(momentum=...)` outside [0, 1)",
        lambda: tfsync.DelayCompensation(momentum=1.0),
        ValueError,
        r"DelayCompensation\(momentum=1\.0\)",
        r"must be a finite number >= 0 and < 1",
        r"momentum=0\.95\)",
    ),
    Bad(
        "dc-epsilon",
        P,
        "`DelayCompensation(epsilon=...)` not above 0",
        lambda: tfsync.DelayCompensation(epsilon=0.0),
        ValueError,
        r"DelayCompensation\(epsilon=0\.0\)",
        r"must be a finite number > 0",
        r"e\.g\. tfsync\.DelayCompensation\(lam=0\.04\)",
    ),
    Bad(
        "dc-adaptive",
        P,
        "`DelayCompensation(adaptive=...)` not `True` or `False`",
        lambda: tfsync.DelayCompensation(adaptive="yes"),
        TypeError,
        r"DelayCompensation\(adaptive='yes'\)",
        r"must be True or False",
        r"adaptive=True, momentum=0\.95\)",
    ),
    Bad(
        "dcs3gd-compensation",
        P,
        "`DCS3GD(compensation=...)` not a `tfsync.DelayCompensation`",
        lambda: tfsync.DCS3GD(compensation=0.04),
        TypeError,
        r"DCS3GD\(compensation=0\.04\)",
        r"must be a tfsync\.DelayCompensation",
        r"e\.g\. tfsync\.DCS3GD\(compensation=tfsync\.DelayCompensation\(lam=0\.04\)\)",
    ),
    Bad(
        "localsgd-period",
        P,
        "`LocalSGD(period=...)` or `DiLoCo(inner_steps=...)` below 1 or not an integer; "
        "`DiLoCo(overlap_steps=...)` not below `inner_steps`, or `mixing` outside [0, 1] or without `overlap_steps`",
        lambda: tfsync.LocalSGD(period=0),
        ValueError,
        r"LocalSGD\(period=0\)",
        r"must be >= 1",
        r"e\.g\. tfsync\.LocalSGD\(period=8\)",
    ),
    Bad(
        "diloco-outer-optimizer",
        P,
        "`DiLoCo(outer_optimizer=...)` not a Keras optimizer, or one that scales losses, accumulates, clips, "
        "decays weights or keeps an EMA",
        lambda: tfsync.DiLoCo(outer_optimizer="sgd"),
        TypeError,
        r"DiLoCo\(outer_optimizer='sgd'\)",
        r"expected a Keras optimizer instance",
        r"outer_optimizer=keras\.optimizers\.SGD\(learning_rate=0\.7, momentum=0\.9, nesterov=True\)",
    ),
    Bad(
        "auto-window-steps",
        P,
        "`Auto(window_steps=...)` or `Auto(confirm=...)` below 1 or not an integer",
        lambda: tfsync.Auto(window_steps=0),
        ValueError,
        r"window_steps=0",
        r"must be an integer >= 1",
        r"e\.g\. tfsync\.Auto\(window_steps=16\)",
    ),
    Bad(
        "auto-modes-type",
        P,
        "`Auto(modes=...)` not a dict of profiles to policies",
        lambda: tfsync.Auto(modes="bsp"),
        ValueError,
        r"modes='bsp'",
        r"must be a dict mapping profiles to policies",
        r"e\.g\. tfsync\.Auto\(modes=\{'straggler': tfsync\.PSP\(\)\}\)",
    ),
    Bad(
        "auto-modes-profile",
        P,
        "`Auto(modes=...)` keyed by an unknown profile",
        lambda: tfsync.Auto(modes={"slow": tfsync.BSP()}),
        ValueError,
        r"unknown profiles \['slow'\]",
        r"the profiles are none, straggler",
        r"key modes by those names",
    ),
    Bad(
        "auto-modes-policy",
        P,
        "`Auto(modes=...)` or `Auto(initial=...)` holding something other than a policy object, "
        "or one that pulls partially or takes local steps",
        lambda: tfsync.Auto(modes={"jitter": "ssp"}),
        ValueError,
        r"modes\['jitter'\]='ssp'",
        r"is not a synchronization mode",
        r"pass a policy object such as tfsync\.SSP\(staleness=3\)",
    ),
    # ------------------------------------------------------- environment variables
    Bad(
        "env-wait-timeout",
        E,
        "`TFSYNC_WAIT_TIMEOUT_S` not a finite number of seconds > 0",
        _env_var(_env.WAIT_TIMEOUT_S.name, "inf", _env.wait_timeout_s),
        ValueError,
        r"TFSYNC_WAIT_TIMEOUT_S='inf'",
        r"must be a finite, positive number of seconds",
        r"pass e\.g\. 120",
    ),
    Bad(
        "env-control-port",
        E,
        "`TFSYNC_CONTROL_PORT` not a TCP port number (0 to 65535)",
        _env_var(_env.CONTROL_PORT.name, "70000", _env.control_port),
        ValueError,
        r"TFSYNC_CONTROL_PORT='70000'",
        r"expected a TCP port number, 1 to 65535 \(or 0",
        r"set it to a port every worker's host may reach",
    ),
    Bad(
        "env-control-relays",
        E,
        "`TFSYNC_CONTROL_RELAYS` not `auto`, `hosts` or `off`",
        _env_var(_env.CONTROL_RELAYS.name, "on", _env.control_relays),
        ValueError,
        r"TFSYNC_CONTROL_RELAYS='on'",
        r"expected auto .* hosts .* or off",
        r"set it to one of them, or unset it",
    ),
    Bad(
        "env-single-process",
        E,
        "`TFSYNC_SINGLE_PROCESS` other than `0` or `1`",
        _env_var(_env.SINGLE_PROCESS.name, "yes", _horovod.horovod),
        ValueError,
        r"TFSYNC_SINGLE_PROCESS='yes'",
        r"expected 1 .* or 0",
        r"set it to 1 or 0, or unset it",
    ),
    Bad(
        "env-gloo-rto-max",
        E,
        "`HOROVOD_TFSYNC_TCP_RTO_MAX_MS` not `0` or 1000 to 120000",
        _env_var(_horovod.RTO_MAX_ENV, "500", _horovod.horovod),
        ValueError,
        r"HOROVOD_TFSYNC_TCP_RTO_MAX_MS='500'",
        r"expected 0 .* or a number of milliseconds from 1000 to 120000",
        r"set it in that range, or unset it for 1000",
    ),
    Bad(
        "env-stragglers",
        E,
        "`TFSYNC_STRAGGLERS` not a straggler spec",
        _env_var(_env.STRAGGLERS.name, "speed=2", Stragglers.from_env),
        ValueError,
        r"TFSYNC_STRAGGLERS: .*'speed=2'",
        r"expected comma-separated key=value items",
        r"e\.g\. 'base=0\.02,slow=3:0\.04.*or unset TFSYNC_STRAGGLERS",
    ),
    Bad(
        "env-ops-impl",
        E,
        "`TFSYNC_OPS_IMPL` not `compiled` or `reference`",
        _env_var(_env.OPS_IMPL.name, "fast", ops_select.implementation_from_env),
        ValueError,
        r"TFSYNC_OPS_IMPL='fast'",
        r"expected one of compiled, reference",
        r"unset it to run the compiled kernels, or set TFSYNC_OPS_IMPL=reference",
    ),
    Bad(
        "env-scheduler-impl",
        E,
        "`TFSYNC_SCHEDULER_IMPL` not `compiled` or `reference`",
        _env_var(_env.SCHEDULER_IMPL.name, "fast", scheduler_backend.implementation_name),
        ValueError,
        r"TFSYNC_SCHEDULER_IMPL='fast'",
        r"expected one of compiled, reference",
        r"unset it for 'compiled' \(the default\), or choose 'reference'",
    ),
    # ------------------------------------------------------------ straggler specs
    Bad(
        "spec-unknown-key",
        S,
        "a straggler spec item with an unknown key or without `=` (`speed=2`, `base`)",
        lambda: Stragglers.parse("base=0.02,speed=2"),
        ValueError,
        r"item 'speed=2' .*unknown key 'speed'",
        r"expected comma-separated key=value items: base=SECONDS",
        r"e\.g\. 'base=0\.02,slow=3:0\.04,rare=0\.0016:4,seed=1'",
    ),
    Bad(
        "spec-slow-format",
        S,
        "a straggler spec's `slow=` not `RANK:SECONDS` with a whole rank >= 0 "
        "(`slow=3`, `slow=1.5:0.1`, `slow=-1:0.1`)",
        lambda: Stragglers.parse("slow=3"),
        ValueError,
        r"item 'slow=3' .*'3' is not RANK:SECONDS",
        r"slow=RANK:SECONDS \(extra time per step on RANK",
        r"e\.g\. 'base=0\.02,slow=3:0\.04",
    ),
    Bad(
        "slow-rank",
        S,
        "`Stragglers(slow_ranks=...)` with a rank that is not an integer >= 0",
        lambda: Stragglers(slow_ranks={1.5: 0.1}),
        ValueError,
        r"slow rank 1\.5",
        r"must be an integer >= 0",
        r"e\.g\. tfsync\.Stragglers\(slow_ranks=\{3: 0\.04\}\)",
    ),
    Bad(
        "spec-seconds",
        S,
        "a delay in seconds (`base`, `slow`, `rare`, `jitter`, `pull`; `base_s`, ...) negative or not finite",
        lambda: Stragglers.parse("base=inf"),
        ValueError,
        r"base_s=inf",
        r"must be a finite number of seconds >= 0",
        r"e\.g\. tfsync\.Stragglers\(base_s=0\.02\) or the spec 'base=0\.02'",
    ),
    Bad(
        "spec-probability",
        S,
        "a probability (`rare=P:S`, `pull=P:S`; `rare_prob`, `pull_prob`) outside [0, 1]",
        lambda: Stragglers.parse("rare=2:1"),
        ValueError,
        r"rare_prob=2\.0",
        r"must be a probability, a number in \[0, 1\]",
        r"e\.g\. tfsync\.Stragglers\(rare_prob=0\.0016, rare_s=4\.0\)",
    ),
    Bad(
        "spec-seed",
        S,
        "a straggler `seed` negative or not an integer",
        lambda: Stragglers.parse("base=0.02,seed=-1"),
        ValueError,
        r"seed=-1",
        r"must be an integer >= 0",
        r"e\.g\. tfsync\.Stragglers\(base_s=0\.02, seed=1\)",
    ),
    Bad(
        "spec-key-twice",
        S,
        "a straggler spec giving a key twice (`base=0.02,base=0.04`; `slow=` twice for one rank)",
        lambda: Stragglers.parse("base=0.02,base=0.04"),
        ValueError,
        r"'base' given twice",
        r"expected comma-separated key=value items",
        r"give each key once",
    ),
    Bad(
        "spec-slow-rank-workers",
        S,
        "a slow rank the job does not have (rank >= the number of workers; checked when training starts)",
        lambda: Stragglers.parse("slow=4:0.04").validate(4),
        ValueError,
        r"slow ranks \[4\] in 'slow=4:0\.04",
        r"this job has 4 workers \(ranks 0\.\.3\)",
        r"name ranks below 4, or launch more workers",
    ),
    # -------------------------------------------------------------- command lines
    Bad(
        "cli-mode",
        C,
        "`--mode` not a registered mode or `auto`",
        _digits("--mode", "fastest"),
        SystemExit,
        r"argument --mode: invalid choice: 'fastest'",
        r"choose from .*'bsp'",
        r"choose from",
    ),
    Bad(
        "cli-mode-setting",
        C,
        "a mode's flag out of range (`--staleness -1`, `--push-timeout-s nan`, `--zipline fast`, ...)",
        _digits("--mode", "ssp", "--staleness", "-1"),
        SystemExit,
        r"--mode ssp: SSP\(staleness=-1\)",
        r"must be >= 0",
        r"e\.g\. tfsync\.SSP\(staleness=3\)",
    ),
    Bad(
        "cli-elastic-plain",
        C,
        "`--elastic` with `--plain-horovod` (digits example)",
        _digits("--elastic", "--plain-horovod"),
        SystemExit,
        r"--elastic trains with tfsync's SyncCallback",
        r"SyncCallback",
        r"leave out --plain-horovod \(or --elastic\)",
    ),
    Bad(
        "cli-stray-setting",
        C,
        "a mode's flag given with a mode that does not take it (`--mode bsp --staleness 5`)",
        _digits("--mode", "bsp", "--staleness", "5"),
        SystemExit,
        r"--staleness: mode 'bsp' does not take these settings",
        r"use them with --mode ssp",
        r"or leave them at their defaults",
    ),
    Bad(
        "cli-dc-without-compensate",
        C,
        "`--dc-lambda` or `--dc-adaptive` without `--compensate` under `--mode psp` or `backup`",
        _digits("--mode", "psp", "--dc-lambda", "0.1"),
        SystemExit,
        r"--dc-lambda and --dc-adaptive set delay compensation",
        r"add --compensate",
        r"or use --mode dcs3gd",
    ),
    Bad(
        "cli-epochs",
        C,
        "`--epochs` below 1 (examples, demo)",
        _digits("--epochs", "0"),
        SystemExit,
        r"argument --epochs: .*got '0'",
        r"expected a whole number >= 1",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-batch-size",
        C,
        "`--batch-size` below 1 (examples), or a `--hidden` width (digits example)",
        _digits("--batch-size", "-16"),
        SystemExit,
        r"argument --batch-size: .*got '-16'",
        r"expected a whole number >= 1",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-learning-rate",
        C,
        "`--lr` not a finite number > 0 (examples)",
        _digits("--lr", "nan"),
        SystemExit,
        r"argument --lr: .*got 'nan'",
        r"expected a finite number > 0",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-momentum",
        C,
        "`--momentum` outside [0, 1) (examples)",
        _digits("--momentum", "1"),
        SystemExit,
        r"argument --momentum: .*got '1'",
        r"expected a finite number >= 0 and < 1",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-target-accuracy",
        C,
        "`--target-accuracy` outside (0, 1] (examples, demo)",
        _digits("--target-accuracy", "0.9", "95"),
        SystemExit,
        r"argument --target-accuracy: .*got '95'",
        r"expected a finite number > 0 and <= 1",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-stragglers",
        C,
        "`--stragglers` not a straggler spec (examples, demo)",
        _digits("--stragglers", "base=0.02,slow=3"),
        SystemExit,
        r"argument --stragglers: .*item 'slow=3'",
        r"expected comma-separated key=value items",
        r"e\.g\. 'base=0\.02,slow=3:0\.04",
    ),
    Bad(
        "cli-seed",
        C,
        "`--seed` negative (examples)",
        _digits("--seed", "-1"),
        SystemExit,
        r"argument --seed: .*got '-1'",
        r"expected a whole number >= 0",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-resnet-image-size",
        C,
        "`--image-size` not a multiple of 4 of at least 8, or `--filters` and `--blocks` "
        "not matching positive counts (ResNet example)",
        _resnet("--image-size", "10"),
        SystemExit,
        r"--image-size 10",
        r"a multiple of 4 of at least 8",
        r"e\.g\. 32",
    ),
    Bad(
        "cli-lm-model",
        C,
        "`--width` not divided by `--heads`, `--warmup-steps` not below the run's steps, or `--corpus` not a "
        "directory (language-model example)",
        _text_lm("--width", "100", "--heads", "3"),
        SystemExit,
        r"--width 100 --heads 3",
        r"the heads split the width evenly",
        r"pass a width that --heads divides \(e\.g\. --width 99\)",
    ),
    Bad(
        "cli-workers",
        C,
        "`--workers` below 2 (`python -m tfsync.demo`, `python -m tfsync.bench`)",
        _demo("--workers", "1"),
        SystemExit,
        r"argument --workers: .*got '1'",
        r"expected a whole number >= 2",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-demo-slow-rank",
        C,
        "`--stragglers` naming a slow rank at or above `--workers` (`python -m tfsync.demo`)",
        _demo("--stragglers", "slow=4:0.04"),
        SystemExit,
        r"argument --stragglers: .*slow ranks \[4\]",
        r"this job has 4 workers",
        r"name ranks below 4, or launch more workers",
    ),
    Bad(
        "cli-staleness",
        C,
        "`--staleness` negative (`python -m tfsync.demo`, `python -m tfsync.bench`)",
        _cli(bench_training.parse_args, "--staleness", "-3"),
        SystemExit,
        r"argument --staleness: .*got '-3'",
        r"expected a whole number >= 0",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-bench-steps",
        C,
        "`--steps`, `--repeats` or `--timeout-s` below 1 (`python -m tfsync.bench`)",
        _cli(bench_training.parse_args, "--steps", "0"),
        SystemExit,
        r"argument --steps: .*got '0'",
        r"expected a whole number >= 1",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-bench-delays",
        C,
        "a scenario delay (`--base-s`, `--slow-s`, `--jitter-s`, `--rare-s`, `--pull-s`) negative or not finite, "
        "or a probability (`--rare-prob`, `--pull-prob`) outside [0, 1] (`python -m tfsync.bench`)",
        _cli(bench_training.parse_args, "--base-s", "nan", "--scenarios", "none"),
        SystemExit,
        r"argument --base-s: .*got 'nan'",
        r"expected a finite number >= 0",
        r"pass one, or leave the option out for its default",
    ),
    Bad(
        "cli-bench-subcommand",
        C,
        "an unknown benchmark (`python -m tfsync.bench NAME`)",
        _cli(bench_main.main, "speed"),
        SystemExit,
        r"unknown benchmark 'speed'",
        r"expected one of training, ops, scheduler, convergence",
        r"\(default: training\)",
    ),
]


def test_the_table_holds_distinct_settings_each_where_it_is_set():
    ids = [case.id for case in BAD_INPUTS]
    lines = [case.readme for case in BAD_INPUTS]
    assert len(BAD_INPUTS) >= 30
    assert len(set(ids)) == len(ids), [i for i in ids if ids.count(i) > 1]
    assert len(set(lines)) == len(lines), [line for line in lines if lines.count(line) > 1]
    assert all(case.where in WHERE for case in BAD_INPUTS)
    assert all("\n" not in case.readme and case.readme.strip() == case.readme for case in BAD_INPUTS)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case.id for case in BAD_INPUTS])
def test_a_bad_input_is_refused_naming_the_value_what_was_expected_and_a_fix(case, capsys):
    with pytest.raises(case.error) as info:
        case.trigger()
    if case.error is SystemExit and isinstance(info.value.code, int):
        assert info.value.code == 2, "argparse's usage error"
    message = f"{info.value}\n{capsys.readouterr().err}"
    for part in ("value", "expected", "fix"):
        assert re.search(
            getattr(case, part), message, re.DOTALL
        ), f"{case.id}: no {part} ({getattr(case, part)!r}) in:\n{message}"


# The other values a README line names, each refused as well (same line, another trigger).
VARIANTS = [
    ("elastic-commit-every-type", _elastic_interval(commit_every_steps="often"), ValueError, r"'often'; expected"),
    ("elastic-commit-every-s", _elastic_interval(commit_every_s=0), ValueError, r"commit_every_s=0; expected seconds"),
    (
        "elastic-commit-s-epoch",
        _elastic_interval(commit_every_steps="epoch", commit_every_s=5),
        ValueError,
        r"epoch ends only; pass commit_every_steps=\"auto\" or an integer",
    ),
    (
        "elastic-state-strategy",
        _elastic_under_strategy,
        ValueError,
        r"the model trains under tfsync\.distribute\.SyncStrategy.*Expected a model built without a strategy and "
        r"trained by model\.fit with callbacks=\[tfsync\.keras\.SyncCallback\(mode, elastic=state\)\]: build the "
        r"model and the state outside strategy\.scope\(\).*or keep SyncStrategy and train without tfsync\.elastic",
    ),
    (
        "elastic-run-in-strategy-scope",
        _elastic_run_in_strategy_scope,
        ValueError,
        r"tfsync\.elastic\.run \(<lambda>\): the model trains under tfsync\.distribute\.SyncStrategy",
    ),
    (
        "elastic-commit-dir-unmakeable",
        _commit_dir_under_a_file,
        ValueError,
        r"commit_dir=.* cannot be created .*; pass a directory every host of the job can write",
    ),
    (
        "elastic-commit-dir-other-model",
        _commit_dir_of_another_model,
        ValueError,
        r"holds the commit of another model or state \(1 variables, this state 4\).*remove .*or pass a directory",
    ),
    ("fault-when", lambda: tfsync.faults.Fault("kill", rank=0), ValueError, r"give exactly one of step="),
    ("fault-rank", lambda: tfsync.faults.Fault("kill", step=3), ValueError, r"needs rank= \(an integer >= 0\)"),
    ("fault-host", lambda: tfsync.faults.Fault("link_cut", host=1, at_s=2), ValueError, r"give duration_s="),
    ("fault-nan-loss", _nan_fault_without_wrapped_loss, ValueError, r"compile the model with loss=injector\.loss"),
    ("elastic-fit-no-position", _elastic_fit("bsp", False, commit_every_steps=2), ValueError, r"has no position"),
    (
        "data-seed-alone",
        _one_worker(lambda: tfsync.shard(np.zeros(8), batch_size=2, seed=0)),
        ValueError,
        r"seed= shuffles the epoch of the elastic state given as resume=",
    ),
    (
        "data-unknown-size",
        _one_worker(lambda: tfsync.shard_dataset(tf_dataset_of_unknown_size(), 2)),
        ValueError,
        r"number of samples is unknown .* pass samples=",
    ),
    (
        "elastic-state-no-optimizer",
        lambda: _elastic_state(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]), compile_=False),
        ValueError,
        r"the model has no optimizer; call model\.compile",
    ),
    ("cli-hidden-width", _digits("--hidden", "4096", "0"), SystemExit, r"argument --hidden: .*got '0'"),
    ("ssp-staleness-float", lambda: tfsync.SSP(staleness=2.5), TypeError, r"staleness must be an int >= 0.*e\.g\."),
    ("dssp-low-negative", lambda: tfsync.DSSP(low=-1), ValueError, r"DSSP\(low=-1\): low must be >= 0; e\.g\."),
    ("dssp-high-float", lambda: tfsync.DSSP(high=1.5), TypeError, r"DSSP\(high=1\.5\): high must be an int"),
    (
        "auto-modes-local-steps",
        lambda: tfsync.Auto(modes={"none": tfsync.DiLoCo()}),
        ValueError,
        r"modes\['none'\]=DiLoCo.*takes local steps.*use DiLoCo on its own",
    ),
    (
        "diloco-overlap-steps",
        lambda: tfsync.DiLoCo(inner_steps=4, overlap_steps=4),
        ValueError,
        r"overlap_steps=4\): overlap_steps must be an int >= 0 and below inner_steps.*e\.g\. tfsync\.DiLoCo",
    ),
    (
        "diloco-mixing-range",
        lambda: tfsync.DiLoCo(overlap_steps=2, mixing=1.5),
        ValueError,
        r"DiLoCo\(mixing=1\.5\): mixing must be a number in \[0, 1\].*e\.g\.",
    ),
    (
        "diloco-mixing-without-overlap",
        lambda: tfsync.DiLoCo(mixing=0.5),
        ValueError,
        r"DiLoCo\(mixing=0\.5, overlap_steps=0\).*set overlap_steps",
    ),
    ("localsgd-period-float", lambda: tfsync.LocalSGD(period=2.5), TypeError, r"period must be an int >= 1.*e\.g\."),
    ("diloco-inner-steps", lambda: tfsync.DiLoCo(inner_steps=0), ValueError, r"DiLoCo\(inner_steps=0\).*e\.g\."),
    (
        "diloco-outer-loss-scaling",
        lambda: tfsync.DiLoCo(outer_optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.7))),
        ValueError,
        r"LossScaleOptimizer.*never scaled; pass the optimizer it wraps",
    ),
    (
        "diloco-outer-accumulation",
        lambda: tfsync.DiLoCo(outer_optimizer=keras.optimizers.SGD(0.7, gradient_accumulation_steps=2)),
        ValueError,
        r"gradient_accumulation_steps=2.*leave gradient_accumulation_steps unset",
    ),
    (
        "diloco-outer-clipping",
        lambda: tfsync.DiLoCo(outer_optimizer=keras.optimizers.SGD(0.7, clipnorm=1.0, weight_decay=0.1)),
        ValueError,
        r"clipnorm=1\.0, weight_decay=0\.1.*Leave those settings unset on the outer optimizer",
    ),
    ("auto-confirm", lambda: tfsync.Auto(confirm=0), ValueError, r"confirm=0 must be .*tfsync\.Auto\(confirm=2\)"),
    (
        "auto-initial-partial-pull",
        lambda: tfsync.Auto(initial=tfsync.PSP(pull_fraction=0.5)),
        ValueError,
        r"initial=.* pulls partially.*use PSP\(pull_fraction=1\.0\)",
    ),
    (
        "env-wait-timeout-text",
        _env_var(_env.WAIT_TIMEOUT_S.name, "soon", _env.wait_timeout_s),
        ValueError,
        r"TFSYNC_WAIT_TIMEOUT_S='soon' is not a number of seconds; set it to e\.g\. 120 or unset it",
    ),
    (
        "env-gloo-rto-max-text",
        _env_var(_horovod.RTO_MAX_ENV, "1s", _horovod.horovod),
        ValueError,
        r"HOROVOD_TFSYNC_TCP_RTO_MAX_MS='1s': expected 0",
    ),
    (
        "env-gloo-rto-max-high",
        _env_var(_horovod.RTO_MAX_ENV, "130000", _horovod.horovod),
        ValueError,
        r"HOROVOD_TFSYNC_TCP_RTO_MAX_MS='130000': expected 0",
    ),
    ("spec-missing-equals", lambda: Stragglers.parse("base"), ValueError, r"item 'base' .*missing '='.*expected"),
    ("spec-slow-rank-float", lambda: Stragglers.parse("slow=1.5:0.1"), ValueError, r"item 'slow=1\.5:0\.1'.*expected"),
    ("spec-slow-rank-negative", lambda: Stragglers.parse("slow=-1:0.1"), ValueError, r"slow rank -1 is negative"),
    ("spec-slow-rank-twice", lambda: Stragglers.parse("slow=1:0.1,slow=1:0.2"), ValueError, r"rank 1 given twice"),
    (
        "spec-pull-probability",
        lambda: Stragglers.parse("pull=2:1"),
        ValueError,
        r"pull_prob=2\.0 must be a probability",
    ),
    ("spec-jitter-negative", lambda: Stragglers.parse("jitter=-1"), ValueError, r"jitter_s=-1\.0 must be a finite"),
    ("spec-seed-text", lambda: Stragglers.parse("seed=one"), ValueError, r"item 'seed=one'.*expected"),
    ("probability-text", lambda: Stragglers(pull_prob="x"), ValueError, r"pull_prob='x' must be a probability"),
    ("seed-float", lambda: Stragglers(seed=1.5), ValueError, r"seed=1\.5 must be an integer >= 0"),
    ("slow-ranks-shape", lambda: Stragglers(slow_ranks=[3]), ValueError, r"slow_ranks=\[3\] must map ranks"),
    ("cli-push-timeout", _digits("--mode", "psp", "--push-timeout-s", "nan"), SystemExit, r"push_timeout_s=nan"),
    ("cli-zipline", _digits("--mode", "elasticbsp", "--zipline", "fast"), SystemExit, r"algorithm='fast'"),
    ("cli-dc-adaptive", _digits("--mode", "backup", "--dc-adaptive"), SystemExit, r"add --compensate"),
    ("cli-resnet-blocks", _resnet("--filters", "16", "32", "--blocks", "1"), SystemExit, r"as many positive block"),
    ("cli-resnet-filters", _resnet("--filters", "0"), SystemExit, r"argument --filters: expected a whole number >= 1"),
    (
        "cli-lm-warmup",
        _text_lm("--epochs", "2", "--steps-per-epoch", "10", "--warmup-steps", "20"),
        SystemExit,
        r"--warmup-steps 20: the run has 20 steps \(--epochs × --steps-per-epoch\); warm up for fewer steps than that",
    ),
    (
        "cli-lm-corpus",
        _text_lm("--corpus", "/nonexistent/text"),
        SystemExit,
        r"--corpus /nonexistent/text: no such directory; pass a directory of text files \(or leave it out\)",
    ),
    ("cli-demo-epochs", _demo("--epochs", "0"), SystemExit, r"argument --epochs: expected a whole number >= 1"),
    ("cli-demo-staleness", _demo("--staleness", "-1"), SystemExit, r"argument --staleness: expected a whole number"),
    ("cli-demo-target", _demo("--target-accuracy", "2"), SystemExit, r"argument --target-accuracy: expected"),
    ("cli-demo-spec", _demo("--stragglers", "speed=2"), SystemExit, r"argument --stragglers: .*unknown key 'speed'"),
    ("cli-bench-workers", _cli(bench_training.parse_args, "--workers", "1"), SystemExit, r"argument --workers: .*>= 2"),
    ("cli-bench-repeats", _cli(bench_training.parse_args, "--repeats", "0"), SystemExit, r"argument --repeats: "),
    ("cli-bench-timeout", _cli(bench_training.parse_args, "--timeout-s", "0"), SystemExit, r"argument --timeout-s: "),
    (
        "cli-bench-probability",
        _cli(bench_training.parse_args, "--rare-prob", "2", "--scenarios", "rare"),
        SystemExit,
        r"argument --rare-prob: expected a finite number >= 0 and <= 1, got '2'",
    ),
]


@pytest.mark.parametrize("trigger,error,pattern", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_the_other_values_a_line_names_are_refused_too(trigger, error, pattern, capsys):
    with pytest.raises(error) as info:
        trigger()
    message = f"{info.value}\n{capsys.readouterr().err}"
    assert re.search(pattern, message, re.DOTALL), message


def tf_dataset_of_unknown_size():
    import tensorflow as tf

    return tf.data.Dataset.range(8).filter(lambda v: True)


def render(cases=BAD_INPUTS) -> str:
    """The README's errors list: one bullet per entry, grouped by where the value is set."""
    out = []
    for where in WHERE:
        out += [f"### {where.capitalize()}", ""]
        out += [f"- {case.readme}" for case in cases if case.where == where]
        out.append("")
    return "\n".join(out)


def _errors_section(readme: str):
    """The text under the README's ``## Errors`` (or ``### Errors``) heading, to the next heading
    of the same or a higher level; None when there is none."""
    match = re.search(r"^(#{2,3}) Errors[ \t]*$", readme, re.MULTILINE)
    if match is None:
        return None
    level = len(match.group(1))
    rest = readme[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def test_the_readme_lists_every_bad_input():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        section = _errors_section(f.read())
    assert section is not None, "README.md has no '## Errors' section; put render()'s list there"
    missing = [case.readme for case in BAD_INPUTS if case.readme not in section]
    assert not missing, "README.md's errors section does not list:\n" + "\n".join(missing)


def test_the_errors_page_lists_every_bad_input():
    with open(os.path.join(REPO_ROOT, "docs", "guide", "errors.md"), encoding="utf-8") as f:
        page = f.read()
    missing = [case.readme for case in BAD_INPUTS if case.readme not in page]
    assert not missing, "docs/guide/errors.md does not list:\n" + "\n".join(missing)


def test_the_section_finder_stops_at_the_next_heading_of_its_level():
    text = "# T\n## Errors\n\n### Arguments\n- a\n## Next\n- b\n"
    assert _errors_section(text) == "\n\n### Arguments\n- a\n"
    assert _errors_section("## Other\n- a\n") is None
    assert "- a" in render([Bad("x", A, "a", lambda: None, ValueError, "", "", "")])


def test_argparse_types_take_good_values():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=launch.integer(1))
    p.add_argument("--x", type=launch.number(0, below=1))
    assert vars(p.parse_args(["--n", "3", "--x", "0.5"])) == {"n": 3, "x": 0.5}
