"""Elastic training (tfsync.elastic) under horovodrun's elastic launcher, on one host.

Two workers on two host names of this machine (Horovod blacklists the host of a worker that
fails); the digits MLP for EPOCHS epochs.  A worker kills itself (SIGKILL) at a given
(epoch, batch); the survivor resets, goes on alone from the last commit (the last epoch
end) and finishes every epoch.
"""

import json
import os

import pytest

from tests.parallel.launch import read_results, run_elastic_workers
from tfsync.faults import Fault, Ledger, Schedule
from tfsync.launch import REPO_ROOT

pytestmark = pytest.mark.parallel
WORKER = os.path.join(REPO_ROOT, "tfsync", "bench", "_elastic_worker.py")  # python -m tfsync.bench elastic's
EPOCHS = 5
KILL_AT = (1, 10)  # (epoch, batch): mid-epoch, so the reset rolls back 10 steps
RESET_BOUND_S = 10.0  # from the kill to the survivor's next step (measured well under 1 s here)
# where a new process joins, the survivors' rendezvous waits for it to start TensorFlow and reach
# hvd.init(), several seconds and more on a loaded machine: Horovod's default bound, not the 10 s
# the elastic launch sets (a killed peer is still seen at once: its connection resets)
JOIN_ENV = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "30"}


def _launch(
    tmp_path,
    mode,
    victim,
    *,
    reset_limit=None,
    expect_success=True,
    epochs=EPOCHS,
    changes=None,
    env=None,
    workers=2,
    worker_options=(),
):
    out = tmp_path / f"{mode}-{victim}"
    out.mkdir()
    args = [out, mode, victim, *KILL_AT, epochs]
    hosts_file = None
    if changes is not None:
        hosts_file = str(out / "hosts")
        args += [hosts_file, changes]
    args += list(worker_options)
    code, output = run_elastic_workers(
        WORKER,
        workers,
        args,
        str(out),
        min_np=1,
        reset_limit=reset_limit,
        hosts_file=hosts_file,
        timeout_s=120,
        env=env,
    )
    if expect_success:
        assert code == 0, output[-8000:]
    killed = None
    if (out / "killed.json").exists():
        killed = json.loads((out / "killed.json").read_text())
    return code, output, read_results(str(out)), killed


def _check_counts(counts):
    settled = sum(counts[k] for k in ("applied", "compensated", "dropped", "rejected", "lost"))
    assert counts["produced"] == settled, counts


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The same job with nobody killed: its final accuracy is the target."""
    _, _, results, killed = _launch(tmp_path_factory.mktemp("undisturbed"), "bsp", -1)
    assert killed is None and sorted(results) == [0, 1], results
    for res in results.values():
        assert res["resets"] == 0 and res["epochs"] == list(range(EPOCHS)), res
        assert res["counts"]["lost"] == 0, res
        _check_counts(res["counts"])
    assert results[0]["checksum"] == results[1]["checksum"]
    return results[0]["accuracy"]


@pytest.mark.parametrize(
    "mode,victim",
    [
        ("bsp", 1),
        # the process that is rank 0 (PSP's coordinator, the control service) dies: the other
        # becomes rank 0 of the re-formed job
        ("psp", 0),
        # (SSP, with rounds in flight when a worker dies, counted lost: tests/parallel/test_bench_elastic.py)
    ],
)
def test_a_killed_worker_costs_no_epoch_and_no_accuracy(tmp_path, undisturbed, mode, victim):
    _, _, results, killed = _launch(tmp_path, mode, victim)
    assert killed is not None and killed["rank"] == victim, killed
    assert sorted(results) == [0], results  # one survivor, rank 0 of the re-formed job
    res = results[0]
    assert res["pid"] != killed["pid"]
    assert res["resets"] == 1 and res["size"] == 1, res
    assert res["memberships"] == [
        {"rank": 1 - victim, "size": 2, "epoch": 0},
        {"rank": 0, "size": 1, "epoch": KILL_AT[0]},  # from the last commit: epoch KILL_AT[0]'s start
    ], res
    # every epoch finished: the interrupted one again, from its start
    assert res["epochs"] == list(range(KILL_AT[0])) + list(range(KILL_AT[0], EPOCHS)), res
    assert res["state_epoch"] == EPOCHS
    assert res["accuracy"] >= undisturbed - 0.01, (res["accuracy"], undisturbed)
    # this worker's contributions add up, lost ones included; the job's as committed too
    _check_counts(res["counts"])
    _check_counts(res["state_counts"])
    if mode == "bsp":  # its round was under way when the peer died
        assert res["counts"]["lost"] == 1, res["counts"]
    assert res["first_step_after_reset_t"] - killed["t"] < RESET_BOUND_S, res
    traces = tmp_path / f"{mode}-{victim}" / "trace"
    trace = [json.loads(line) for line in open(traces / "reset0" / f"rank{1 - victim}.jsonl")]
    resets = [r for r in trace if r.get("event") == "reset"]
    assert len(resets) == 1 and resets[0]["lost"] == res["counts"]["lost"], resets
    assert os.path.exists(traces / "reset1" / "rank0.jsonl")  # the re-formed job's engine traces apart


def test_four_workers_lose_a_host_and_go_on_with_two(tmp_path):
    """Two host names with two slots each: rank 3 dies, Horovod takes its whole host out (rank 2
    with it), ranks 0 and 1 go on.  A survivor whose collective waits on rank 2 (alive, its own
    collective failed) would see the failure only at HOROVOD_GLOO_TIMEOUT_SECONDS (Horovod's
    default, 30 s, here): the reset interrupts Horovod's Gloo operations instead (patched
    Horovod), so the survivors go on within the reset bound."""
    gloo_s = 30
    _, output, results, killed = _launch(
        tmp_path, "bsp", 3, workers=4, env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(gloo_s)}
    )
    assert killed is not None and sorted(results) == [0, 1], results
    assert "Gloo connections interrupted" in output and "no Gloo connections" not in output, output[-4000:]
    for res in results.values():
        assert res["resets"] == 1 and res["size"] == 2 and res["epochs"] == list(range(EPOCHS)), res
        assert res["first_step_after_reset_t"] - killed["t"] < RESET_BOUND_S, res
        _check_counts(res["counts"])
    assert results[0]["checksum"] == results[1]["checksum"]
    _check_counts(results[0]["state_counts"])


COMMIT_EVERY = 4  # steps: the kill after step KILL_AT[1] + 1 = 11 of its epoch comes 3 after the commit at 8


def test_four_workers_lose_a_host_mid_epoch_and_the_two_left_resume_at_the_committed_sample(tmp_path):
    """As above, with commits every COMMIT_EVERY steps and the data resumed: the two survivors
    share the rest of the interrupted epoch from step 8's sample (of four workers), redo at most
    COMMIT_EVERY steps each, and end with identical weights."""
    gloo_s = 5
    _, _, results, killed = _launch(
        tmp_path,
        "bsp",
        3,
        workers=4,
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": str(gloo_s)},
        worker_options=["--commit-every", str(COMMIT_EVERY)],
    )
    assert killed is not None and sorted(results) == [0, 1], results
    resumed_at = 8 * 4 * 16  # step 8 of four workers, batches of 16
    for res in results.values():
        assert res["resets"] == 1 and res["size"] == 2 and res["epochs"] == list(range(EPOCHS)), res
        assert [(m["size"], m["epoch"], m["sample"]) for m in res["memberships"]] == [
            (4, 0, 0),
            (2, KILL_AT[0], resumed_at),
        ], res
        counts = res["counts"]
        assert 1 <= counts["steps_redone"] <= COMMIT_EVERY and counts["samples_redone"] == 16 * counts["steps_redone"]
        _check_counts(counts)
    assert results[0]["checksum"] == results[1]["checksum"]
    job = results[0]["state_counts"]
    _check_counts(job)
    # the job's redone work: the survivors' (the lost host's went with it)
    assert job["steps_redone"] == sum(r["counts"]["steps_redone"] for r in results.values()), job


@pytest.mark.parametrize(
    "mode,victim,interval",
    [
        ("bsp", 1, COMMIT_EVERY),
        # rank 0's process (PSP's coordinator) dies; with min_contributions 1 the survivor may be
        # a step ahead, waiting in the next commit, when it notices
        ("psp", 0, COMMIT_EVERY),
        ("localsgd", 1, 8),  # commits at outer steps: COMMIT_EVERY rounded up to period 8
    ],
)
def test_a_worker_killed_mid_epoch_costs_at_most_the_steps_since_the_last_commit(
    tmp_path, undisturbed, mode, victim, interval
):
    """Commits every COMMIT_EVERY steps, one fit per epoch on data resumed at the committed sample:
    the survivor goes on alone from the commit at step 8 of the interrupted epoch, not its start."""
    options = ["--commit-every", str(COMMIT_EVERY)]
    _, _, results, killed = _launch(tmp_path, mode, victim, worker_options=options)
    assert killed is not None and killed["rank"] == victim and sorted(results) == [0], results
    res = results[0]
    assert res["resets"] == 1 and res["size"] == 1 and res["state_epoch"] == EPOCHS, res
    committed_steps = 8  # the last commit before the kill after step 11, every 4 steps (or every outer step of 8)
    resumed_at = committed_steps * 2 * 16  # samples: every step of both workers (_elastic_worker.BATCH)
    assert res["memberships"] == [
        {"rank": 1 - victim, "size": 2, "epoch": 0, "sample": 0},
        {"rank": 0, "size": 1, "epoch": KILL_AT[0], "sample": resumed_at},  # not the epoch's start
    ], res
    assert res["epochs"] == list(range(EPOCHS)), res  # the interrupted epoch finished once, resumed
    counts, job = res["counts"], res["state_counts"]
    # the survivor redid its steps after the commit (at most to the next commit, where it waited)
    assert 1 <= counts["steps_redone"] <= interval, counts
    assert counts["samples_redone"] == counts["steps_redone"] * 16, counts
    assert (job["steps_redone"], job["samples_redone"]) == (counts["steps_redone"], counts["samples_redone"])
    _check_counts(counts)
    _check_counts(job)
    if mode == "bsp":
        # it had finished step 11 and its round 12 was lost; it produced epoch 0, those 12, the
        # rest of the interrupted epoch alone from the committed sample (whole batches of 16) and
        # the later epochs alone: none of the epoch's first 8 steps again
        assert counts["steps_redone"] == KILL_AT[1] + 1 - committed_steps and counts["lost"] == 1, counts
        train = 1437  # the digits training split
        alone = (train - resumed_at) // 16 + (EPOCHS - KILL_AT[0] - 1) * (train // 16)
        assert counts["produced"] == 44 * KILL_AT[0] + KILL_AT[1] + 2 + alone, counts
        assert res["accuracy"] >= undisturbed - 0.02, (res["accuracy"], undisturbed)
    else:
        assert res["accuracy"] >= 0.9, res
    assert res["first_step_after_reset_t"] - killed["t"] < RESET_BOUND_S, res
    trace_file = tmp_path / f"{mode}-{victim}" / "trace" / "reset0" / f"rank{1 - victim}.jsonl"
    trace = [json.loads(line) for line in open(trace_file)]
    commits = [(r["epoch"], r["steps"], r["sample"]) for r in trace if r.get("event") == "commit"]
    assert (KILL_AT[0], committed_steps, resumed_at) in commits, commits


@pytest.mark.parametrize("mode", ["dssp", "elasticbsp", "dcs3gd"])
def test_every_other_mode_goes_on_after_a_kill(tmp_path, mode):
    """The engine starts again on the survivor (clocks, supersteps, corrections, auto's
    measurements from scratch) and the job finishes every epoch, its counts adding up."""
    _, _, results, killed = _launch(tmp_path, mode, 1)
    assert killed is not None and sorted(results) == [0], results
    res = results[0]
    assert res["resets"] == 1 and res["size"] == 1 and res["state_epoch"] == EPOCHS, res
    assert res["epochs"] == list(range(EPOCHS)), res
    assert res["accuracy"] >= 0.9, res
    assert res["first_step_after_reset_t"] - killed["t"] < RESET_BOUND_S, res
    _check_counts(res["counts"])
    _check_counts(res["state_counts"])


@pytest.mark.parametrize(
    "mode,says",
    [
        ("backup", "BackupWorkers(backups=1) with 1 workers"),  # a round needs size - 1 >= 1
        ("psp:2", "PSP(min_contributions=2) with 1 workers"),  # an explicit c above the new size
        ("auto", "BackupWorkers(backups=1) with 1 workers"),  # a mode auto may switch to
    ],
)
def test_a_mode_that_cannot_run_on_the_survivors_says_so(tmp_path, mode, says):
    code, output, results, killed = _launch(tmp_path, mode, 1, expect_success=False)
    assert killed is not None and code != 0 and not results
    assert "tfsync.elastic: the job has 1 workers now" in output and "--min-np" in output, output[-4000:]
    assert says in output, output[-4000:]


def test_a_host_removed_and_added_back_by_discovery(tmp_path):
    """The discovery script drops a host after epoch 1 and lists it again after epoch 3: the job
    shrinks to one worker, then a new process joins with the committed state; no epoch is
    lost or redone (the changes take effect between epochs).  The joiner is warm: the launcher
    starts it first and tells the job of it once it has reached hvd.init()."""
    epochs = 7
    _, _, results, killed = _launch(
        tmp_path, "bsp", -1, epochs=epochs, changes="1=localhost:1;3=localhost:1+127.0.0.1:1", env=JOIN_ENV
    )
    assert killed is None and sorted(results) == [0, 1], results
    survivor = next(r for r in results.values() if len(r["memberships"]) == 3)
    joiner = next(r for r in results.values() if r is not survivor)
    assert [m["size"] for m in survivor["memberships"]] == [2, 1, 2], survivor
    assert survivor["resets"] == joiner["resets"] == 2
    assert survivor["epochs"] == list(range(epochs)), survivor  # every epoch once
    joined_at = survivor["memberships"][2]["epoch"]
    assert joiner["memberships"] == [{"rank": 1 - survivor["rank_at_end"], "size": 2, "epoch": joined_at}], joiner
    assert joiner["epochs"] == list(range(joined_at, epochs)), joiner
    assert survivor["checksum"] == joiner["checksum"]  # identical replicas at the end
    # the launcher started the joiner first and told the job only once it had reached hvd.init()
    assert survivor["notices"]["3"] > joiner["init_t"], (survivor["notices"], joiner["init_t"])
    assert survivor["state_counts"] == joiner["state_counts"]
    _check_counts(survivor["state_counts"])
    # nothing redone: the job's steps are exactly those of the memberships' epochs
    steps = {2: 44, 1: 89}  # per worker per epoch (the digits training split, batch 16)
    sizes = [m["size"] for m in survivor["memberships"]]
    starts = [m["epoch"] for m in survivor["memberships"]] + [epochs]
    expected = sum(size * steps[size] * (b - a) for size, a, b in zip(sizes, starts, starts[1:]))
    assert survivor["state_counts"]["produced"] == expected, (survivor["state_counts"], expected)


def test_with_commits_on_storage_a_job_whose_hosts_are_all_replaced_restarts_from_the_last_commit(tmp_path):
    """The discovery script drops a host after epoch 1, then after epoch 3 lists only the other
    host name: no worker of the last round is left.  With TFSYNC_COMMIT_DIR set for horovodrun,
    the launcher starts the new round (patched Horovod; as released it stops the job: "No hosts
    from previous set remaining") and its fresh rank 0 restarts from the commit on storage:
    epoch 4, counts included, the restart counted as a reset; nothing is redone."""
    epochs = 7
    commits = tmp_path / "commits"
    code, output, results, killed = _launch(
        tmp_path,
        "bsp",
        -1,
        epochs=epochs,
        changes="1=localhost:1;3=127.0.0.1:1",
        env={**JOIN_ENV, "TFSYNC_COMMIT_DIR": str(commits)},
    )
    assert killed is None and sorted(results) == [0], results
    assert "no host of the last round remains" in output, output[-4000:]
    assert "restarted from the commit in" in output, output[-4000:]
    res = results[0]
    assert res["memberships"] == [{"rank": 0, "size": 1, "epoch": 4}], res  # a fresh process, from the commit
    assert res["epochs"] == list(range(4, epochs)), res
    assert res["resets"] == 2 and res["state_epoch"] == epochs, res  # the shrink, then the restart
    job = res["state_counts"]
    _check_counts(job)
    steps = {2: 44, 1: 89}  # per worker per epoch (the digits training split, batch 16)
    assert job["produced"] == 2 * 2 * steps[2] + 5 * steps[1], job  # every epoch once, none redone
    assert os.listdir(commits) == ["tfsync-elastic-state.npz"]


def test_exceeding_the_reset_limit_fails_saying_so(tmp_path):
    code, output, results, killed = _launch(tmp_path, "bsp", 1, reset_limit=0, expect_success=False)
    assert killed is not None and code != 0 and not results
    assert "number of resets during elastic job exceeded limit: 0" in output, output[-4000:]


def _one_hangs_for_good(tmp_path, kind, rank):
    """Rank ``rank`` hangs for good mid-epoch (``kind``: ``"stop"`` or ``"hang"``), wait bound
    10 s: the other finishes every epoch alone, as rank 0 of one, its counts exact.  Returns the
    job's output, the fault's ledger record and the survivor's result."""
    schedule = tmp_path / "faults.json"
    schedule.write_text(Schedule([Fault(kind, rank=rank, step=44 + KILL_AT[1])]).to_json())
    options = ["--faults", str(schedule), "--wait-timeout-s", "10"]
    _, output, results, _ = _launch(tmp_path, "bsp", -1, worker_options=options)
    assert sorted(results) == [0], results
    res = results[0]
    assert res["resets"] == 1 and res["size"] == 1 and res["state_epoch"] == EPOCHS, res
    assert res["epochs"] == list(range(EPOCHS)), res  # (the interrupted epoch: finished once, after the reset)
    _check_counts(res["counts"])
    _check_counts(res["state_counts"])
    hung = Ledger(str(tmp_path / "bsp--1" / "faults")).records()[0]
    assert hung["rank"] == rank and hung["kind"] == kind, hung
    assert res["pid"] != hung["pid"]
    assert f"hang guard: ended rank {rank} of 2 (pid {hung['pid']}" in output, output[-6000:]
    return output, hung, res


def test_a_hung_worker_is_ended_by_its_guard_and_the_job_goes_on_without_it(tmp_path):
    """Rank 1 stops (SIGSTOP) for good mid-epoch: rank 0's round times out within the wait bound
    and it resets; the launcher would wait for the stopped process for ever, but its hang guard
    ends it once rank 0 no longer waits for it (the kernel says it is stopped: when the control
    link's keepalive drops it, 5 s, not the hang timeout of 10 s + 2); the launcher then
    blacklists its host and re-forms the job from rank 0, which finishes every epoch."""
    output, _, _ = _one_hangs_for_good(tmp_path, "stop", 1)
    assert "it was stopped by a signal (SIGSTOP): no heartbeat for 5." in output, output[-6000:]
    assert "past the 5.0 s after which its peers no longer wait for it" in output, output[-6000:]


def test_a_worker_deadlocked_in_a_step_is_ended_once_its_peers_gave_up_on_it(tmp_path):
    """Rank 0's training thread blocks for good mid-epoch (a deadlock: its other threads, its
    control service and the guard's heartbeat, go on): rank 1's round times out within the wait
    bound, it tells every worker why and resets; rank 0's guard, told by its control path that
    the job went on without it, ends it at the hang timeout rather than at twice it, and rank 1
    finishes every epoch as rank 0 of one."""
    output, _, _ = _one_hangs_for_good(tmp_path, "hang", 0)
    said = "after its control path said that the job no longer waits for it (a peer stopped or was lost)"
    assert said in output and "past its hang timeout (12.0 s" in output, output[-6000:]


def test_a_hung_worker_that_wakes_after_its_peers_reset_rejoins_from_the_commit(tmp_path):
    """Rank 1 stops for 12 s: rank 0 gives up on it at its 5 s wait bound and resets, and waits
    in the launcher, which waits for every member of the last rendezvous; rank 1 wakes (its guard,
    at 30 s, has not ended it), finds its collectives shut down, resets too, and both go on from
    the last commit with identical replicas: nothing it computed while it hung reached rank 0."""
    schedule = tmp_path / "faults.json"
    schedule.write_text(Schedule([Fault("stop", rank=1, step=44 + KILL_AT[1], duration_s=12.0)]).to_json())
    options = ["--faults", str(schedule), "--wait-timeout-s", "5", "--hang-timeout-s", "30"]
    _, output, results, _ = _launch(tmp_path, "bsp", -1, worker_options=options)
    assert sorted(results) == [0, 1], results
    assert "hang guard: ended" not in output
    for res in results.values():
        assert res["resets"] == 1 and res["size"] == 2 and res["state_epoch"] == EPOCHS, res
        _check_counts(res["counts"])
        _check_counts(res["state_counts"])
    assert results[0]["checksum"] == results[1]["checksum"], results
    stopped = Ledger(str(tmp_path / "bsp--1" / "faults")).records()[0]
    assert {r["pid"] for r in results.values()} >= {stopped["pid"]}  # (the woken process finished)
