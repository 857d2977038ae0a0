"""Launch a worker script under ``horovodrun --gloo`` with a hard time limit.

Every parallel test goes through :func:`run_workers`, so no launch can hang
the suite: past ``timeout_s`` the whole process group is killed and the test
fails with the output so far.
"""
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "parallel", "workers")


def run_workers(script, np_, args=(), timeout_s=180, env=None, expect_success=True):
    cmd = ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
           sys.executable, os.path.join(WORKERS, script), *map(str, args)]
    full_env = dict(os.environ)
    full_env.update({"PYTHONPATH": ROOT + os.pathsep + full_env.get("PYTHONPATH", ""),
                     "TF_CPP_MIN_LOG_LEVEL": "2", "HOROVOD_GLOO_TIMEOUT_SECONDS": "30",
                     "PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} (np={np_}) did not finish within {timeout_s} s:\n{out[-6000:]}")
    if expect_success and proc.returncode != 0:
        raise AssertionError(f"{script} (np={np_}) failed with exit code {proc.returncode}:\n{out[-8000:]}")
    return proc.returncode, out


def read_results(directory):
    """Per-rank JSON results written by workers as ``result_rank<R>.json``."""
    results = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("result_rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                results[int(name[len("result_rank"):-len(".json")])] = json.load(f)
    return results
