"""Launch a Python script on N local workers with ``horovodrun --gloo``, bounded in time.

Used by ``python -m tfsync.bench`` and ``python -m tfsync.demo``; workers print
one ``TFSYNC_RESULT {json}`` line (rank 0) that is parsed back here.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

RESULT_PREFIX = "TFSYNC_RESULT "
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_local_job(script, args=(), workers=4, timeout_s=600, env=None):
    """Run ``script`` on ``workers`` local processes; return ``(exit_code, output)``.

    Past ``timeout_s`` the whole process group is killed and ``TimeoutError``
    raised with the tail of the output: no launch can hang its caller.
    """
    if shutil.which("horovodrun") is None:
        raise RuntimeError("horovodrun is not on PATH; install Horovod with `make install`")
    cmd = [
        "horovodrun",
        "-np",
        str(workers),
        "-H",
        f"localhost:{workers}",
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
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} ran past {timeout_s} s; output tail:\n{out[-6000:]}") from None
    return proc.returncode, out


def horovodrun(script, args=(), workers=4, timeout_s=600, env=None):
    """Run ``script`` on ``workers`` local processes; return rank 0's result dict.

    Raises ``RuntimeError`` with the tail of the output when the job fails.
    """
    code, out = run_local_job(script, args, workers, timeout_s, env)
    results = [json.loads(line.split(RESULT_PREFIX, 1)[1]) for line in out.splitlines() if RESULT_PREFIX in line]
    if code != 0 or not results:
        raise RuntimeError(f"{script} on {workers} workers failed (exit {code}); " f"output tail:\n{out[-4000:]}")
    return results[-1]


def print_result(result):
    """Called by rank 0 of a launched script."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


MODES = ("bsp", "ssp", "dssp", "elasticbsp", "psp", "backup", "dcs3gd", "auto")


def add_mode_arguments(parser, baselines=()):
    """The ``--mode`` flag and each mode's own flags, as the examples and scripts take them.

    ``baselines``: more ``--mode`` choices the caller handles itself (the bench's
    plain Horovod); with any, ``--mode`` is required.
    """
    if baselines:
        parser.add_argument("--mode", required=True, choices=tuple(baselines) + MODES)
    else:
        parser.add_argument("--mode", default="bsp", choices=MODES)
    parser.add_argument("--staleness", type=int, default=3, help="SSP bound s (--mode ssp)")
    parser.add_argument("--low", type=int, default=3, help="DSSP's lower bound s_L (--mode dssp)")
    parser.add_argument("--high", type=int, default=15, help="DSSP's upper bound s_U (--mode dssp)")
    parser.add_argument(
        "--lookahead", type=int, default=15, help="ElasticBSP's R, iterations predicted (--mode elasticbsp)"
    )
    parser.add_argument(
        "--zipline",
        default="optbs",
        help="ElasticBSP's ZipLine variant: optbs, zipline_opt, zipline, fullgridscan, gridscan (--mode elasticbsp)",
    )
    parser.add_argument(
        "--min-contributions", type=int, default=None, help="PSP's c (--mode psp; default: workers - 1)"
    )
    parser.add_argument(
        "--push-timeout-s",
        type=float,
        default=None,
        help="PSP's tau1 in seconds (--mode psp; default: a tenth of the round's " "iteration time)",
    )
    parser.add_argument(
        "--pull-fraction",
        type=float,
        default=1.0,
        help="PSP's b: the share of a round's parameter blocks a worker waits for (--mode psp; "
        "default 1.0, no partial pulling; the paper used 0.9)",
    )
    parser.add_argument(
        "--pull-timeout-s",
        type=float,
        default=None,
        help="PSP's tau2: once the share of blocks arrived, wait up to this long for the others "
        "(--mode psp --pull-fraction; default 0)",
    )
    parser.add_argument(
        "--pull-blocks",
        type=int,
        default=None,
        help="PSP's number of parameter blocks B (--mode psp --pull-fraction; default one per weight tensor)",
    )
    parser.add_argument("--backups", type=int, default=1, help="backup workers b (--mode backup)")
    parser.add_argument(
        "--compensate",
        action="store_true",
        help="correct and apply late contributions instead of dropping them (--mode psp or backup)",
    )
    parser.add_argument(
        "--dc-lambda",
        type=float,
        default=None,
        help="delay compensation's lambda (--mode dcs3gd, --compensate; default 0.04, or 2.0 with --dc-adaptive)",
    )
    parser.add_argument(
        "--dc-adaptive", action="store_true", help="adaptive lambda, DC-ASGD-a (--mode dcs3gd, --compensate)"
    )
    return parser


def mode_from_args(args):
    """The policy object the parsed ``--mode`` flags describe."""
    import tfsync

    dc_flags = args.dc_lambda is not None or args.dc_adaptive
    if args.compensate and args.mode not in ("psp", "backup"):
        raise SystemExit(
            f"--compensate: mode {args.mode!r} never applies a contribution that missed its round, so "
            f"there is nothing to compensate; use it with --mode psp or --mode backup "
            f"(--mode dcs3gd compensates always)"
        )
    if dc_flags and not (args.compensate or args.mode == "dcs3gd"):
        raise SystemExit(
            "--dc-lambda and --dc-adaptive set delay compensation: add --compensate (with --mode psp "
            "or backup) or use --mode dcs3gd"
        )
    pull = args.pull_fraction != 1.0 or args.pull_timeout_s is not None or args.pull_blocks is not None
    if pull and args.mode != "psp":
        raise SystemExit(
            f"--pull-fraction, --pull-timeout-s and --pull-blocks set PSP's partial pulling; mode "
            f"{args.mode!r} waits for every block of a round: use them with --mode psp"
        )
    compensation = tfsync.DelayCompensation(lam=args.dc_lambda, adaptive=args.dc_adaptive)
    compensate = compensation if args.compensate else None
    if args.mode == "ssp":
        return tfsync.SSP(staleness=args.staleness)
    if args.mode == "dssp":
        return tfsync.DSSP(low=args.low, high=args.high)
    if args.mode == "elasticbsp":
        return tfsync.ElasticBSP(lookahead=args.lookahead, algorithm=args.zipline)
    if args.mode == "psp":
        return tfsync.PSP(
            min_contributions=args.min_contributions,
            push_timeout_s=args.push_timeout_s,
            compensate=compensate,
            pull_fraction=args.pull_fraction,
            pull_timeout_s=args.pull_timeout_s,
            pull_blocks=args.pull_blocks,
        )
    if args.mode == "backup":
        return tfsync.BackupWorkers(backups=args.backups, compensate=compensate)
    if args.mode == "dcs3gd":
        return tfsync.DCS3GD(compensation)
    if args.mode == "auto":  # the profile's modes with their defaults (tfsync.policies.auto)
        return tfsync.Auto()
    return tfsync.BSP()


def describe_mode(policy):
    """``"ssp(s=3)"``, ``"psp(c=3)"``, ``"backup(b=1)+dc(lambda=0.04)"``, ``"dcs3gd(lambda=0.04)"``:
    a short label for tables (settings left at an adaptive default, ``None``, are not shown)."""

    def compensation(comp):
        return f"lambda={comp.strength}" + (", adaptive" if comp.adaptive else "")

    if getattr(policy, "name", None) == "auto":  # tfsync.Auto: the modes it runs are in its decisions
        return "auto"
    options, suffix = [], ""
    short = {
        "staleness": "s",
        "low": "s_L",
        "high": "s_U",
        "lookahead": "R",
        "min_contributions": "c",
        "push_timeout_s": "timeout",
        "backups": "b",
        "pull_fraction": "pull",
        "pull_timeout_s": "pull_timeout",
        "pull_blocks": "B",
    }
    for k, v in policy.config().items():
        if k == "compensation":  # DC-S3GD's own
            options.append(compensation(policy.compensation))
        elif k == "compensate":  # PSP's and backup workers' late gradients
            suffix = "" if policy.compensate is None else f"+dc({compensation(policy.compensate)})"
        elif k == "pull_fraction" and v == 1.0:  # PSP without partial pulling
            continue
        elif k != "mode" and v is not None:
            options.append(f"{short.get(k, k)}={v}")
    return policy.name + (f"({', '.join(options)})" if options else "") + suffix


def contribution_totals(hvd, counts, batch_size, wall_s):
    """Every worker's counts summed (collective), and the samples/s whose gradients were applied."""
    every = hvd.allgather_object(dict(counts), name="tfsync.example.counts")
    total = {k: sum(int(c[k]) for c in every) for k in counts}
    total["effective_samples_per_s"] = (total["applied"] + total["compensated"]) * batch_size / wall_s
    return total
