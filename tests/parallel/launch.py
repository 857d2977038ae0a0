"""Launch a worker script of ``tests/parallel/workers`` under ``horovodrun --gloo``.

Every parallel test goes through :func:`run_workers`, which uses the same
bounded launcher as the benchmarks (:func:`tfsync.launch.run_local_job`): past
``timeout_s`` the whole process group is killed and the test fails with the
output so far, so no launch can hang the suite.
"""

import json
import os

from tfsync.launch import REPO_ROOT as ROOT
from tfsync.launch import run_local_job

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


def read_results(directory):
    """Per-rank JSON results written by workers as ``result_rank<R>.json``."""
    results = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("result_rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                results[int(name[len("result_rank") : -len(".json")])] = json.load(f)
    return results


# One host as two for Horovod's elastic driver: it blacklists the host of a worker that fails,
# and with every worker on one host name the job would stop at the first loss.
TWO_LOCAL_HOSTS = ("localhost", "127.0.0.1")


def run_elastic_workers(
    script, np_, args, tmp_path, min_np, reset_limit=None, timeout_s=90, env=None, hosts_file=None, options=()
):
    """Launch ``script`` as an elastic job (``--min-np``, ``--max-np np_``, a discovery script
    that lists :data:`TWO_LOCAL_HOSTS` with ``np_ // 2`` slots each (one host with 1), or
    prints ``hosts_file``, which the test or its workers change while the job runs); returns
    ``(exit_code, output)``."""
    if np_ not in (1, 2) and np_ % 2:
        raise ValueError(f"an elastic launch here has 1 worker or an even number, one half per host name: {np_}")
    discovery = os.path.join(tmp_path, "discover_hosts.sh")
    hosts = "".join(f"{h}:{max(np_ // 2, 1)}\n" for h in TWO_LOCAL_HOSTS[: min(np_, 2)])
    with open(discovery, "w") as f:
        if hosts_file is None:
            f.write("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in hosts.split()))
        else:
            with open(hosts_file, "w") as hf:
                hf.write(hosts)
            f.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(discovery, 0o755)
    elastic = ["--min-np", min_np, "--max-np", np_, "--host-discovery-script", discovery]
    if reset_limit is not None:
        elastic += ["--reset-limit", reset_limit]
    elastic += list(options)  # (e.g. --blacklist-cooldown-range: a failed host comes back)
    return run_local_job(
        os.path.join(WORKERS, script),
        args,
        workers=np_,
        timeout_s=timeout_s,
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "10", **(env or {})},
        elastic=elastic,
    )
