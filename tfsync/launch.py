"""Launch a Python script on N local workers with ``horovodrun --gloo``, bounded in time.

Used by ``python -m tfsync.bench`` and ``python -m tfsync.demo``; workers print
one ``TFSYNC_RESULT {json}`` line (rank 0) that is parsed back here.  The
command-line checks those tools and the examples share are here too
(:func:`integer`, :func:`number`, :func:`stragglers_spec`,
:func:`check_mode_args`): a bad option stops at parse time, naming the option,
what it takes and the way out, before any worker is launched.
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys

RESULT_PREFIX = "TFSYNC_RESULT "
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_local_job(script, args=(), workers=4, timeout_s=600, env=None, elastic=None):
    """Run ``script`` on ``workers`` local processes; return ``(exit_code, output)``.

    ``elastic``: launch an elastic job instead of ``-H localhost:N``: a list of
    ``horovodrun`` options (``--min-np``, ``--max-np``, ``--host-discovery-script``,
    ``--reset-limit``, ...; :mod:`tfsync.elastic`).  Past ``timeout_s`` the whole
    process group is killed and ``TimeoutError`` raised with the tail of the
    output: no launch can hang its caller.
    """
    if shutil.which("horovodrun") is None:
        raise RuntimeError("horovodrun is not on PATH; install Horovod with `make install`")
    hosts = ["-H", f"localhost:{workers}"] if elastic is None else list(map(str, elastic))
    cmd = [
        "horovodrun",
        "-np",
        str(workers),
        *hosts,
        "--gloo",
        sys.executable,
        script,
        *map(str, args),
    ]
    full_env = dict(os.environ)
    full_env.update(
        {
            "PYTHONPATH": REPO_ROOT + os.pathsep + full_env.get("PYTHONPATH", ""),
            "TF_CPP_MIN_LOG_LEVEL": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    full_env.update(env or {})
    return run_bounded_command(cmd, full_env, timeout_s)


def run_bounded_command(cmd, env, timeout_s):
    """Run ``cmd`` in the repository root in its own process group; ``(exit_code, output)``
    (stdout and stderr together).  Past ``timeout_s`` the whole group is killed and
    ``TimeoutError`` raised with the tail of the output."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(map(str, cmd))} ran past {timeout_s} s; output tail:\n{out[-6000:]}") from None
    except BaseException:
        # interrupted while it runs (a test's own timeout, Ctrl-C): the launch and every process it
        # started go with it, rather than load the machine under whatever runs next
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc.returncode, out


# One machine as two hosts for Horovod's elastic driver: it blacklists the host of a worker that
# fails, and with every worker on one host name the job would stop at the first loss.
TWO_LOCAL_HOSTS = ("localhost", "127.0.0.1")


def run_elastic_job(
    script, workers, args, work_dir, min_np, reset_limit=None, timeout_s=90, env=None, hosts_file=None, options=()
):
    """Launch ``script`` on this machine as an elastic job; return ``(exit_code, output)``.

    ``--min-np min_np --max-np workers`` and a discovery script (written to ``work_dir``) that
    lists :data:`TWO_LOCAL_HOSTS` with ``workers // 2`` slots each (one host with 1), or prints
    ``hosts_file`` (which the caller or its workers may change while the job runs).
    ``options``: more ``horovodrun`` options (``--blacklist-cooldown-range 1 3`` lets a failed
    host come back).  ``HOROVOD_GLOO_TIMEOUT_SECONDS`` is 10 unless ``env`` sets it.  Bounded
    as :func:`run_local_job`.
    """
    if workers not in (1, 2) and workers % 2:
        raise ValueError(
            f"an elastic launch on one machine has 1 worker or an even number (one half per host name), got "
            f"{workers}; pass an even number"
        )
    discovery = os.path.join(work_dir, "discover_hosts.sh")
    hosts = "".join(f"{h}:{max(workers // 2, 1)}\n" for h in TWO_LOCAL_HOSTS[: min(workers, 2)])
    with open(discovery, "w") as f:
        if hosts_file is None:
            f.write("#!/bin/sh\n" + "".join(f"echo {h}\n" for h in hosts.split()))
        else:
            with open(hosts_file, "w") as hf:
                hf.write(hosts)
            f.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(discovery, 0o755)
    elastic = ["--min-np", min_np, "--max-np", workers, "--host-discovery-script", discovery]
    if reset_limit is not None:
        elastic += ["--reset-limit", reset_limit]
    elastic += list(options)
    return run_local_job(
        script,
        args,
        workers=workers,
        timeout_s=timeout_s,
        env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "10", **(env or {})},
        elastic=elastic,
    )


def horovodrun(script, args=(), workers=4, timeout_s=600, env=None):
    """Run ``script`` on ``workers`` local processes; return rank 0's result dict.

    Raises ``RuntimeError`` with the tail of the output when the job fails.
    """
    code, out = run_local_job(script, args, workers, timeout_s, env)
    results = results_in(out)
    if code != 0 or not results:
        raise RuntimeError(f"{script} on {workers} workers failed (exit {code}); " f"output tail:\n{out[-4000:]}")
    return results[-1]


def results_in(output):
    """The result dicts :func:`print_result` wrote into a job's ``output``, in order."""
    return [json.loads(line.split(RESULT_PREFIX, 1)[1]) for line in output.splitlines() if RESULT_PREFIX in line]


def print_result(result):
    """Called by rank 0 of a launched script."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def integer(minimum):
    """An argparse ``type``: a whole number ``>= minimum``, refused at parse time otherwise
    (argparse names the option: ``argument --epochs: expected ...``)."""

    def parse(raw):
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected a whole number >= {minimum}, got {raw!r}; pass one, "
                f"or leave the option out for its default"
            )
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def number(minimum=None, maximum=None, *, above=None, below=None):
    """An argparse ``type``: a finite number within the bounds (``minimum``/``maximum``
    inclusive, ``above``/``below`` exclusive), refused at parse time otherwise."""
    bounds = [(">=", minimum), (">", above), ("<=", maximum), ("<", below)]
    expected = " and ".join(f"{op} {b}" for op, b in bounds if b is not None)
    expected = f"a finite number {expected}".strip()

    def parse(raw):
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value)
        ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
        ok = ok and (above is None or value > above) and (below is None or value < below)
        if not ok:
            raise argparse.ArgumentTypeError(
                f"expected {expected}, got {raw!r}; pass one, or leave the option out for its default"
            )
        return value

    parse.__name__ = expected
    return parse


def stragglers_spec(raw):
    """An argparse ``type``: a straggler spec (:meth:`tfsync.Stragglers.parse`), checked at parse time."""
    from tfsync.stragglers import Stragglers

    try:
        Stragglers.parse(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return raw


def check_mode_args(parser, args):
    """Build the policy the parsed ``--mode`` flags describe now, at parse time, so that a bad
    setting (``--staleness -1``, ``--push-timeout-s nan``) stops with the usage line before any
    worker starts; returns the policy (:func:`mode_from_args`)."""
    try:
        return mode_from_args(args)
    except SystemExit as exc:
        parser.error(str(exc))
    except (TypeError, ValueError) as exc:
        parser.error(f"--mode {args.mode}: {exc}")


def mode_names() -> tuple:
    """Every ``--mode`` choice: the registered modes, ``auto`` included (:func:`tfsync.policies.registry.names`)."""
    from tfsync.policies import registry

    return registry.names()


def add_mode_arguments(parser, baselines=()):
    """The ``--mode`` flag and each registered mode's own flags (:mod:`tfsync.policies.registry`).

    ``baselines``: more ``--mode`` choices the caller handles itself (the bench's
    plain Horovod); with any, ``--mode`` is required.
    """
    from tfsync.policies import registry
    from tfsync.policies.base import COMPRESSIONS

    if baselines:
        parser.add_argument("--mode", required=True, choices=tuple(baselines) + mode_names())
    else:
        parser.add_argument("--mode", default="bsp", choices=mode_names())
    for o in registry.options():
        if o.type is bool:
            parser.add_argument(o.flag, action="store_true", help=o.help)
        else:
            parser.add_argument(o.flag, type=o.type, default=o.default, help=o.help)
    parser.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        default=None,
        help="every mode: send the rounds' floating tensors as fp16 or bf16 (half float32's bytes; default: "
        "their own dtype); see docs/guide/compression.md",
    )
    return parser


def mode_from_args(args):
    """The policy object the parsed ``--mode`` flags describe; a flag set that the mode does not
    take stops with the modes that take it."""
    from tfsync.policies import registry

    mode = registry.get(args.mode)
    if mode.switches:  # (auto: the profile's modes with their defaults, tfsync.policies.auto)
        return mode.from_args(args)
    taken = {o.flag for o in mode.options}
    stray = [o for o in registry.options() if o.flag not in taken and getattr(args, o.dest) != o.default]
    if stray:
        owners = sorted({m.name for m in registry.modes() for o in m.options if o.flag in {x.flag for x in stray}})
        raise SystemExit(
            f"{', '.join(o.flag for o in stray)}: mode {args.mode!r} does not take these settings; use them "
            f"with " + " or ".join(f"--mode {m}" for m in owners) + " (or leave them at their defaults)"
        )
    return mode.from_args(args)


def describe_mode(policy):
    """A short label for tables: :func:`tfsync.policies.registry.describe`."""
    from tfsync.policies import registry

    return registry.describe(policy)


def contribution_totals(hvd, counts, batch_size, wall_s, samples=None):
    """Every worker's counts summed (collective), and the samples/s whose gradients were applied.

    ``samples``: the samples every worker trained on together.  With it, the applied share of
    the contributions (each produced or skipped) scales them, which also holds where one
    contribution covers several steps (Local SGD, DiLoCo: ``H``); without it, each applied or
    compensated contribution counts one batch."""
    every = hvd.allgather_object(dict(counts), name="tfsync.example.counts")
    total = {k: sum(int(c[k]) for c in every) for k in counts}
    taken = total["applied"] + total["compensated"]
    if samples is None:
        total["effective_samples_per_s"] = taken * batch_size / wall_s
    else:
        total["effective_samples_per_s"] = taken / max(total["produced"] + total["skipped"], 1) * samples / wall_s
    return total
