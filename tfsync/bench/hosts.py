"""Several hosts on one machine: network namespaces on one bridge, each with its own sshd and hostname.

What the multi-host tests (``tests/multihost``) and the network-bound benchmark
(:mod:`tfsync.bench.network`) run on.

Host ``i`` (1-based) is the namespace ``tfsync-h<i>``: one interface ``eth1``
with the address ``198.18.0.<i>/24`` (RFC 2544's benchmarking range, never
routed) and a second one, ``198.18.0.<100+i>`` (:meth:`Hosts.alias`), joined
to the others by a veth pair to a bridge in the namespace ``tfsync-hbr``; its
own hostname ``tfh<i>`` (``unshare --uts``), which only
it resolves (``/etc/netns/tfsync-h<i>/hosts``, which ``ip netns exec`` mounts
over ``/etc/hosts``), as in containers without cluster DNS; and its own sshd
on port 22 of both addresses, which takes a key made for this harness, so
``horovodrun -H 198.18.0.1:2,198.18.0.2:2 --ssh-identity-file KEY`` launches
remote ranks as it would on a cluster.

Everything it creates is removed on exit (namespaces, the hosts files, the
sshds, the known-hosts entries ssh adds), whatever happened: an exception, or a
SIGTERM to the process that made the hosts (in its main thread, the harness
turns it into ``SystemExit`` while the hosts exist, so ``kill`` and a launcher's
timeout clean up too; what SIGKILL leaves, the next :class:`Hosts` removes,
the processes still running in the namespaces included).  It needs root;
without root :class:`Hosts` raises, saying so (the tests using it fail loudly
rather than pass).
"""

import contextlib
import glob
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SUBNET = "198.18.0"
IFACE = "eth1"
PREFIX = "tfsync-h"
BRIDGE_NS = PREFIX + "br"
DIR_PREFIX = "tfsync-hosts-"  # the keys and sshd configs of one Hosts, under the temporary directory
SSHD = "/usr/sbin/sshd"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND_TIMEOUT_S = 20.0  # one ip/ssh-keygen call
# every host's sshd listening (it writes its pid file once its sockets are bound): a launcher
# that connects before then is refused, and its job fails at once
SSHD_READY_S = 20.0


def _run(*cmd, timeout_s=COMMAND_TIMEOUT_S, check=True):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


class Hosts:
    """``n`` simulated hosts (a context manager); ``address(i)``, ``name(i)``, ``namespace(i)``.

    ``run(i, argv, timeout_s)`` runs a command as host ``i`` (in its namespace, with its
    hostname), bounded; ``popen(i, argv)`` starts one.
    """

    def __init__(self, n=2):
        if not 2 <= n <= 9:
            raise ValueError(f"Hosts(n={n}): between 2 and 9 hosts")
        self.n = n
        self._sshd = []
        self._dir = None
        self._sigterm = None  # the SIGTERM handler before __enter__ (main thread only)

    # --------------------------------------------------------------- naming
    def address(self, i):
        return f"{SUBNET}.{i}"

    def alias(self, i):
        """Host ``i``'s second address (``198.18.0.<100+i>``, on the same interface, its sshd
        listening there too): a second name for the launcher, so that a launcher listing each
        of a host's workers under a name of its own blacklists one worker, not the host, when
        one fails."""
        return f"{SUBNET}.{100 + i}"

    def name(self, i):
        return f"tfh{i}"

    def namespace(self, i):
        return f"{PREFIX}{i}"

    @property
    def key(self):
        """The private key every host's sshd accepts (``horovodrun --ssh-identity-file``)."""
        return os.path.join(self._dir, "id_ed25519")

    # -------------------------------------------------------------- lifecycle
    def __enter__(self):
        if os.geteuid() != 0:
            raise RuntimeError(
                "the multi-host harness needs root (network namespaces, one sshd per host); "
                "run the suite as root, as CI does"
            )
        for tool in ("ip", "unshare", "ssh-keygen", SSHD):
            if shutil.which(tool) is None:
                raise RuntimeError(f"the multi-host harness needs {tool}; `make install` installs it")
        self._remove_namespaces()  # what a killed earlier run left: its namespaces, its keys
        for stale in glob.glob(os.path.join(tempfile.gettempdir(), DIR_PREFIX + "*")):
            shutil.rmtree(stale, ignore_errors=True)
        if threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self._dir = tempfile.mkdtemp(prefix=DIR_PREFIX)
        try:
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _create(self):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.key)
        shutil.copy(self.key + ".pub", os.path.join(self._dir, "authorized_keys"))
        _run("ip", "netns", "add", BRIDGE_NS)
        _run("ip", "-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", BRIDGE_NS, "link", "set", "br0", "up")
        for i in range(1, self.n + 1):
            ns, peer = self.namespace(i), f"h{i}"
            _run("ip", "netns", "add", ns)
            veth = ("ip", "link", "add", f"tfsync{i}a", "netns", ns, "type", "veth")
            _run(*veth, "peer", "name", peer, "netns", BRIDGE_NS)
            _run("ip", "-n", ns, "link", "set", f"tfsync{i}a", "name", IFACE)
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFACE)
            _run("ip", "-n", ns, "addr", "add", f"{self.alias(i)}/24", "dev", IFACE)  # (secondary: listed after)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", BRIDGE_NS, "link", "set", peer, "master", "br0")
            _run("ip", "-n", BRIDGE_NS, "link", "set", peer, "up")
            etc = f"/etc/netns/{ns}"
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(i)} {self.name(i)}\n")
            self._start_sshd(i)
        self._wait_for_sshd()

    def _start_sshd(self, i):
        host_key = os.path.join(self._dir, f"host{i}_key")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key)
        config = os.path.join(self._dir, f"sshd{i}.conf")
        with open(config, "w") as f:
            f.write(
                f"ListenAddress {self.address(i)}\nListenAddress {self.alias(i)}\nPort 22\nHostKey {host_key}\n"
                f"PidFile {self._sshd_pid_file(i)}\nAuthorizedKeysFile {self._dir}/authorized_keys\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\nUsePAM no\n"
                "AcceptEnv *\n"
            )
        os.makedirs("/run/sshd", exist_ok=True)
        self._sshd.append(self.popen(i, [SSHD, "-D", "-e", "-f", config], stderr=subprocess.DEVNULL))

    def _sshd_pid_file(self, i):
        return os.path.join(self._dir, f"sshd{i}.pid")

    def _wait_for_sshd(self):
        deadline = time.monotonic() + SSHD_READY_S
        for i, sshd in enumerate(self._sshd, start=1):
            while not os.path.exists(self._sshd_pid_file(i)):
                if sshd.poll() is not None:
                    raise RuntimeError(f"host {i}'s sshd ({SSHD}) exited with {sshd.returncode} before it listened")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"host {i}'s sshd did not listen within {SSHD_READY_S:g} s; is {SSHD} installed and the "
                        f"machine not overloaded?"
                    )
                time.sleep(0.05)

    def __exit__(self, *exc):
        self.kill_all(keep_sshd=False)
        for p in self._sshd:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=COMMAND_TIMEOUT_S)
        self._sshd = []
        self._remove_namespaces()
        for i in range(1, self.n + 1):  # what ssh added to root's known hosts for these addresses
            _run("ssh-keygen", "-R", self.address(i), check=False)
            _run("ssh-keygen", "-R", self.alias(i), check=False)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def kill_all(self, keep_sshd=True):
        """SIGKILL every process running on the hosts but their sshd listeners (``keep_sshd``):
        what ssh started for a launcher (its remote ranks) is in no process group the launcher
        holds, so a launch that ended or was killed may have left it."""
        keep = {p.pid for p in self._sshd} if keep_sshd else set()
        for i in range(1, self.n + 1):
            pids = _run("ip", "netns", "pids", self.namespace(i), check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    if int(pid) not in keep:
                        os.kill(int(pid), signal.SIGKILL)

    def _remove_namespaces(self):
        listed = _run("ip", "netns", "list").stdout.split()
        for ns in [x for x in listed if x.startswith(PREFIX)]:
            # (a process left running in it, an sshd of a killed run, would keep it alive unnamed)
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)  # (its veth ends go with it)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    # ---------------------------------------------------------------- faults
    def set_link(self, i, up):
        """Bring host ``i``'s ``eth1`` up or down (a cut cable: no reset reaches either side)."""
        _run("ip", "-n", self.namespace(i), "link", "set", IFACE, "up" if up else "down")

    def shape_link(self, i, rate):
        """Limit what host ``i`` sends over ``eth1`` to ``rate`` (a ``tc`` rate: ``"1gbit"``,
        ``"500mbit"``) with a token bucket, as a slower network would; ``None`` lifts it.
        (``tc``'s ``netem``, for latency and loss, is not available on every kernel; ``tbf`` is.)"""
        ns = self.namespace(i)
        if rate is None:
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFACE, "root", check=False)
            return
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", IFACE, "root",
             "tbf", "rate", rate, "burst", "1mbit", "latency", "50ms")  # fmt: skip

    def pids(self, i):
        """The processes running on host ``i``, its sshd listener excepted."""
        keep = {p.pid for p in self._sshd}
        out = _run("ip", "netns", "pids", self.namespace(i), check=False).stdout.split()
        return sorted(int(pid) for pid in out if int(pid) not in keep)

    def listening(self, i):
        """The TCP ports something listens on at host ``i`` (its sshd's 22 included)."""
        out = _run("ip", "netns", "exec", self.namespace(i), "ss", "-Htln", check=False).stdout
        return sorted({int(line.split()[3].rpartition(":")[2]) for line in out.splitlines() if line.strip()})

    # ------------------------------------------------------------- commands
    def horovodrun(self, per_host, argv, env=None, gloo_timeout_s=60, elastic=None):
        """The ``horovodrun`` command line that runs ``argv`` with ``per_host`` ranks on every host,
        over ``eth1``, remote ranks started over ssh with this harness's key (run it as host 1).
        ``elastic``: horovodrun's elastic options (``--min-np``, ``--max-np``,
        ``--host-discovery-script`` listing :meth:`address` ``:slots`` lines, ...) instead of
        the fixed host list."""
        slots = ",".join(f"{self.address(i)}:{per_host}" for i in range(1, self.n + 1))
        hosts = ["-H", slots] if elastic is None else list(map(str, elastic))
        return [
            "env",
            f"PYTHONPATH={REPO_ROOT}",
            "TF_CPP_MIN_LOG_LEVEL=2",
            "PYTHONUNBUFFERED=1",
            f"HOROVOD_GLOO_TIMEOUT_SECONDS={gloo_timeout_s}",
            *[f"{k}={v}" for k, v in (env or {}).items()],
            "horovodrun", "-np", str(per_host * self.n), *hosts, "--gloo",
            "--network-interfaces", IFACE, "--ssh-identity-file", self.key,
            sys.executable, *map(str, argv),
        ]  # fmt: skip

    def sample_sent(self, i, period_s=0.1):
        """A sampler of what host ``i`` sends over ``eth1``: a context manager whose value, once it
        exits, holds ``samples``, a list of ``(time.time(), tx_bytes)`` every ``period_s``
        (:class:`LinkSampler`)."""
        return LinkSampler(self, i, period_s)

    def _as_host(self, i, argv):
        quoted = " ".join(shlex.quote(str(a)) for a in argv)
        return ["ip", "netns", "exec", self.namespace(i), "unshare", "--uts", "sh", "-c",
                f"hostname {self.name(i)} && exec {quoted}"]  # fmt: skip

    def popen(self, i, argv, **kwargs):
        """Start ``argv`` as host ``i`` in a process group of its own (killed with :meth:`kill`)."""
        return subprocess.Popen(self._as_host(i, argv), start_new_session=True, **kwargs)

    def run(self, i, argv, timeout_s, env=None):
        """Run ``argv`` as host ``i``; ``(returncode, output)``; its group is killed past ``timeout_s``."""
        p = self.popen(i, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill(p)
            out, _ = p.communicate()
            return 124, out
        except BaseException:  # (interrupted: a test's own time limit, Ctrl-C) the launch goes with it
            kill(p)
            p.wait()
            raise
        return p.returncode, out


def _exit_on_sigterm(signum, _frame):
    raise SystemExit(128 + signum)  # (unwinds through Hosts.__exit__, which removes the hosts)


def kill(p):
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


class LinkSampler:
    """``eth1``'s transmitted bytes of one host, read from its namespace every ``period_s`` by a
    small process there while the ``with`` block runs (:meth:`Hosts.sample_sent`)."""

    _SCRIPT = (
        "import sys, time\n"
        "path, period = sys.argv[1], float(sys.argv[2])\n"
        "while True:\n"
        "    with open(path) as f:\n"
        "        print(time.time(), f.read().strip(), flush=True)\n"
        "    time.sleep(period)\n"
    )

    def __init__(self, hosts, i, period_s):
        self.hosts, self.i, self.period_s = hosts, i, period_s
        self.samples = []

    def __enter__(self):
        path = f"/sys/class/net/{IFACE}/statistics/tx_bytes"
        argv = ["ip", "netns", "exec", self.hosts.namespace(self.i), sys.executable, "-c", self._SCRIPT]
        self._p = subprocess.Popen([*argv, path, str(self.period_s)], stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc):
        self._p.terminate()
        out, _ = self._p.communicate(timeout=COMMAND_TIMEOUT_S)
        for line in out.splitlines():
            t, sent = line.split()
            self.samples.append((float(t), int(sent)))

    def within(self, start, end) -> dict:
        """What the samples between ``start`` and ``end`` (``time.time()``) say: the bytes sent
        then, and the most sent per sampling period (``peak_bytes_per_period``): each interval's
        bytes scaled to one period, so that a sample the busy machine took late (an interval of
        two periods, say) does not count two periods' bytes as one's."""
        inside = [(t, b) for t, b in self.samples if start <= t <= end]
        if len(inside) < 2:
            return {"bytes": None, "peak_bytes_per_period": None}
        rates = [
            (b1 - b0) * self.period_s / max(t1 - t0, self.period_s) for (t0, b0), (t1, b1) in zip(inside, inside[1:])
        ]
        return {"bytes": inside[-1][1] - inside[0][1], "peak_bytes_per_period": int(max(rates))}
