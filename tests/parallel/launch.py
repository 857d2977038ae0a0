"""Launch a worker script of ``tests/parallel/workers`` under ``horovodrun --gloo``.

Every parallel test goes through :func:`run_workers`, which uses the same
bounded launcher as the benchmarks (:func:`tfsync.launch.run_local_job`): past
``timeout_s`` the whole process group is killed and the test fails with the
output so far, so no launch can hang the suite.
"""

import json
import os
import sys

from tfsync.launch import REPO_ROOT as ROOT
from tfsync.launch import run_bounded_command, run_elastic_job, run_local_job

WORKERS = os.path.join(ROOT, "tests", "parallel", "workers")


def run_workers(script, np_, args=(), timeout_s=180, env=None, expect_success=True):
    code, out = run_local_job(
        os.path.join(WORKERS, script),
        args,
        workers=np_,
        timeout_s=timeout_s,
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "30", **(env or {})},
    )
    if expect_success and code != 0:
        raise AssertionError(f"{script} (np={np_}) failed with exit code {code}:\n{out[-8000:]}")
    return code, out


def results_of(script, np_, directory, args=(), timeout_s=180):
    """:func:`run_workers` with ``directory`` as the script's first argument, then every rank's
    results (:func:`read_results`), which each of the ``np_`` ranks must have written."""
    run_workers(script, np_, [directory, *args], timeout_s=timeout_s)
    results = read_results(directory)
    assert sorted(results) == list(range(np_)), results
    return results


def read_results(directory):
    """Per-rank JSON results written by workers as ``result_rank<R>.json``."""
    results = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("result_rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                results[int(name[len("result_rank") : -len(".json")])] = json.load(f)
    return results


def run_elastic_workers(
    script, np_, args, tmp_path, min_np, reset_limit=None, timeout_s=90, env=None, hosts_file=None, options=()
):
    """Launch ``script`` (a path, or a name in ``tests/parallel/workers``) as an elastic job on this
    machine under two host names (:func:`tfsync.launch.run_elastic_job`); returns ``(exit_code, output)``."""
    return run_elastic_job(
        os.path.join(WORKERS, script),
        np_,
        args,
        tmp_path,
        min_np,
        reset_limit=reset_limit,
        timeout_s=timeout_s,
        env=env,
        hosts_file=hosts_file,
        options=options,
    )


def run(cmd, timeout_s=240, env=None):
    """Run ``cmd`` (a launch script, ``horovodrun`` on an example) from the repository root as a
    user does, within ``timeout_s`` (:func:`tfsync.launch.run_bounded_command`: past it, or when the
    test is interrupted, every process it started is killed); its output, or the test fails with it."""
    full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", PYTHON=sys.executable, **(env or {}))
    code, out = run_bounded_command(cmd, full_env, timeout_s)
    assert code == 0, f"{cmd} failed:\n{out[-6000:]}"
    return out


def result_of(out):
    """The ``TFSYNC_RESULT`` record the digits example prints at its end."""
    lines = [line for line in out.splitlines() if "TFSYNC_RESULT " in line]
    assert lines, out[-4000:]
    return json.loads(lines[-1].split("TFSYNC_RESULT ", 1)[1])


def digits(script, *args, workers=4):
    """``keras_examples/<script>`` with ``args`` under ``horovodrun -np workers --gloo``: its result."""
    example = os.path.join(ROOT, "keras_examples", script)
    cmd = ["horovodrun", "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", sys.executable, example]
    return result_of(run([*cmd, *map(str, args)]))
