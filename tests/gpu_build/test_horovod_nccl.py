"""Horovod's NCCL build against TensorFlow's GPU wheel, checked on a machine without a GPU.

Runs ``third_party/horovod/install.sh`` (what ``make install`` runs) in the build checks'
throwaway environment (conftest.py: TensorFlow's GPU wheel of the release installed here,
nvidia-nccl-cu12) with this machine's ``nvcc``: on a TensorFlow built with CUDA, with
nvcc present, it must choose the NCCL build (``HOROVOD_GPU_OPERATIONS=NCCL``), patch
and build it. Then checks what can be checked without a GPU: ``mpi_lib`` links NCCL from
the nvidia-nccl-cu12 package and finds it at run time; every symbol it needs is defined
by TensorFlow's libraries, NCCL or the system's (so nothing is left to fail at load or
at a first call); it holds CUDA code for the compute capabilities the build chose;
loaded, it reports NCCL and CUDA built and registers GPU kernels for Horovod's ops; and
two ranks under ``horovodrun --gloo`` reduce CPU tensors with it. The NCCL collectives themselves need GPUs
(docs/install.md, "GPU build").

Horovod's build with its CUDA kernels is slow (about 15 minutes on 2 cores): it is made
in the build checks' cached environment (conftest.py), and install.sh reuses it while its
stamp (the patch's and install.sh's digest, the compiler, TensorFlow's, NCCL's and nvcc's
versions, the compute capabilities) is the one it would write, and builds again otherwise;
the checks run every time. Needs ``nvcc``: skipped where it is missing, except under CI,
where it must run.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from _build_tools import cuobjdump, require_nvcc, run

from tfsync.launch import REPO_ROOT

INSTALL_SH = os.path.join(REPO_ROOT, "third_party", "horovod", "install.sh")
# The ops Horovod registers GPU kernels for (horovod/tensorflow/mpi_ops.cc under HAVE_GPU).
GPU_OPS = (
    "HorovodAllreduce",
    "HorovodGroupedAllreduce",
    "HorovodAllgather",
    "HorovodBroadcast",
    "HorovodAlltoall",
    "HorovodReducescatter",
)
# The NCCL calls Horovod's NCCL operations make (horovod/common/ops/nccl_operations.cc).
NCCL_CALLS = ("ncclCommInitRank", "ncclGetUniqueId", "ncclAllReduce", "ncclAllGather", "ncclBroadcast")

pytestmark = [
    pytest.mark.skipif(
        not require_nvcc("Horovod's NCCL build"),
        reason="nvcc is not on the PATH: the NCCL build cannot be compiled here",
    ),
    pytest.mark.timeout(3600),  # the first test makes the shared environment and the build
]


def _horovod_version():
    """The Horovod release the Makefile installs."""
    with open(os.path.join(REPO_ROOT, "Makefile")) as f:
        return re.search(r"^HOROVOD_VERSION = (\S+)$", f.read(), re.M).group(1)


def _install_env():
    # install.sh decides the build and its architectures itself, as under `make install`
    env = dict(os.environ)
    for name in ("TFSYNC_HOROVOD_NCCL", "TFSYNC_CUDA_ARCHS", "HOROVOD_BUILD_CUDA_CC_LIST", "HOROVOD_NCCL_HOME"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def horovod_nccl(gpu_venv, tmp_path_factory):
    build_dir = tmp_path_factory.mktemp("horovod_nccl")
    python = gpu_venv["python"]
    log = run(["bash", INSTALL_SH, python, _horovod_version(), str(build_dir)], 3000, cwd=REPO_ROOT, env=_install_env())
    site = gpu_venv["site"]
    found = sorted((site / "horovod" / "tensorflow").glob("mpi_lib*.so"))
    assert len(found) == 1, f"expected one horovod/tensorflow/mpi_lib*.so in {site}, found {found}:\n{log[-6000:]}"
    return {
        "log": log,
        "python": python,
        "site": site,
        "library": str(found[0]),
        "nccl_lib": site / "nvidia" / "nccl" / "lib",
        "build_dir": build_dir,
    }


def test_install_sh_chooses_the_nccl_build_where_tensorflow_has_cuda_and_nvcc_is_here(horovod_nccl):
    log = horovod_nccl["log"]
    chosen = re.search(r"^Horovod: chose NCCL \((.*)\)$", log, re.M)
    assert chosen, f"install.sh did not say it chose the NCCL build:\n{log[-6000:]}"
    assert "is built with CUDA and nvcc is at" in chosen.group(1), chosen.group(0)
    assert f"from {horovod_nccl['nccl_lib']}" in chosen.group(1), chosen.group(0)
    # built now, or reused: the build in the environment has this build's stamp (same inputs)
    done = r"^Horovod: (built and installed|installed) \(.*, inputs [0-9a-f]{16}, .*"
    done += r", nccl [\d.]+, cuda [\d.]+, cc [\d,]+\)$"
    assert re.search(done, log, re.M), log[-3000:]


def test_a_second_run_finds_the_same_nccl_build_installed(horovod_nccl):
    out = run(
        ["bash", INSTALL_SH, horovod_nccl["python"], _horovod_version(), str(horovod_nccl["build_dir"])],
        600,
        cwd=REPO_ROOT,
        env=_install_env(),
    )
    assert re.search(r"^Horovod: installed \(.*, nccl [\d.]+, cuda [\d.]+, cc [\d,]+\)$", out, re.M), out[-3000:]
    assert "building" not in out, out[-3000:]


def test_a_changed_input_makes_install_sh_build_again(horovod_nccl):
    """The stamp that lets a build be reused names every input that can change it: the patch
    and install.sh (their digest), the compiler, TensorFlow's, NCCL's and nvcc's versions and
    the compute capabilities. A stamp that differs in any of them is not reused."""
    stamp = (horovod_nccl["site"] / "horovod" / "tfsync_build.txt").read_text().strip()
    for field in (r"inputs [0-9a-f]{16}", r"tensorflow \S+,", r"nccl [\d.]+", r"cuda [\d.]+", r"cc [\d,]+"):
        assert re.search(field, stamp), (field, stamp)
    cxx = os.environ.get("CXX", "g++")
    assert subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0] in stamp, stamp


def test_mpi_lib_links_nccl_from_the_pip_package_and_finds_it_at_run_time(horovod_nccl):
    library, nccl_lib = horovod_nccl["library"], horovod_nccl["nccl_lib"]
    linked = run(["ldd", library], 60)
    resolved = re.search(r"^\s*libnccl\.so\.2 => (\S+)", linked, re.M)
    assert resolved, f"mpi_lib does not link libnccl.so.2:\n{linked}"
    assert os.path.realpath(resolved.group(1)) == os.path.realpath(nccl_lib / "libnccl.so.2"), linked
    undefined = set(run(["nm", "-D", "--undefined-only", library], 120).split())
    exported = set(run(["nm", "-D", "--defined-only", str(nccl_lib / "libnccl.so.2")], 120).split())
    for call in NCCL_CALLS:
        assert call in undefined, f"mpi_lib makes no {call} call: not an NCCL build"
        assert call in exported, f"{call} is not exported by {nccl_lib}/libnccl.so.2"


def _dynamic_symbols(path, which):
    """The names of ``path``'s defined or undefined dynamic symbols, without versions."""
    flag = "--defined-only" if which == "defined" else "--undefined-only"
    names = set()
    for line in run(["nm", "-D", flag, path], 300).splitlines():
        parts = line.split()
        if parts and (which == "defined" or parts[-2] == "U"):
            names.add(parts[-1].split("@")[0])
    return names


def test_every_symbol_mpi_lib_needs_is_defined_where_it_loads(horovod_nccl):
    """Resolved at load from TensorFlow's libraries (TensorFlow has loaded them by then, its
    Python extension with RTLD_GLOBAL), NCCL, and the system libraries ldd finds; weak
    references (``w``) may stay unresolved. This is what caught Horovod's call of an
    AsGpuStreamValue TensorFlow no longer exports."""
    library, tf_dir = horovod_nccl["library"], horovod_nccl["site"] / "tensorflow"
    providers = [
        tf_dir / "libtensorflow_framework.so.2",
        tf_dir / "libtensorflow_cc.so.2",
        tf_dir / "python" / "_pywrap_tensorflow_internal.so",
        horovod_nccl["nccl_lib"] / "libnccl.so.2",
    ]
    for line in run(["ldd", library], 60).splitlines():
        found = re.search(r"(/\S+) \(0x", line)  # "name => /path (0x...)" and the loader's "/path (0x...)"
        if found:
            providers.append(found.group(1))
    defined = set()
    for provider in providers:
        assert os.path.exists(provider), f"{provider} is missing"
        defined |= _dynamic_symbols(str(provider), "defined")
    missing = sorted(_dynamic_symbols(library, "undefined") - defined)
    assert not missing, f"{len(missing)} symbols mpi_lib needs are defined nowhere it loads: {missing[:20]}"


def test_mpi_lib_holds_cuda_code_for_the_chosen_compute_capabilities(horovod_nccl):
    chosen = re.search(r", cc ([\d,]+)\)$", horovod_nccl["log"], re.M).group(1).split(",")
    elves = run([cuobjdump(horovod_nccl["site"]), "--list-elf", horovod_nccl["library"]], 300)
    for cc in chosen:
        assert re.search(rf"\.sm_{cc}\.cubin", elves), f"no sm_{cc} code in mpi_lib:\n{elves}"


def test_it_loads_reports_nccl_and_registers_gpu_kernels_and_reduces_on_the_cpu(horovod_nccl):
    nccl_h = (horovod_nccl["nccl_lib"].parent / "include" / "nccl.h").read_text()
    version = {
        k: int(re.search(rf"^#define NCCL_{k} +(\d+)", nccl_h, re.M).group(1)) for k in ("MAJOR", "MINOR", "PATCH")
    }
    # NCCL_VERSION_CODE for NCCL >= 2.9: major * 10000 + minor * 100 + patch
    code = version["MAJOR"] * 10000 + version["MINOR"] * 100 + version["PATCH"]
    check = textwrap.dedent(
        f"""
        import json
        import horovod.tensorflow as hvd
        import tensorflow as tf
        from horovod.tensorflow.mpi_ops import _basics
        from tensorflow.python.framework import kernels
        devices = {{op: sorted({{k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}})
                   for op in {GPU_OPS!r}}}
        hvd.init()
        with tf.device("/CPU:0"):
            total = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum).numpy().tolist()
        print("REPORT", json.dumps({{"nccl": int(_basics.nccl_built()), "cuda": bool(_basics.cuda_built()),
                                    "gloo": bool(_basics.gloo_built()), "devices": devices,
                                    "size": hvd.size(), "total": total}}))
        """
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([horovod_nccl["python"], "-c", check], capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"horovod.tensorflow failed in the NCCL build's environment:\n{out[-6000:]}"
    report = json.loads(re.search(r"^REPORT (.*)$", out, re.M).group(1))
    assert report["nccl"] == code, f"horovod_nccl_built() = {report['nccl']}, expected NCCL_VERSION_CODE {code}"
    assert report["cuda"] and report["gloo"], report
    for op in GPU_OPS:
        assert report["devices"][op] == ["CPU", "GPU"], f"{op}: kernels registered for {report['devices'][op]}"
    assert report["size"] == 1 and report["total"] == [1.0, 2.0], report


def test_two_ranks_reduce_cpu_tensors_under_horovodrun(horovod_nccl, tmp_path):
    """The NCCL build's Gloo controller and CPU collectives, across processes."""
    script = tmp_path / "reduce.py"
    script.write_text(
        textwrap.dedent(
            """
            import horovod.tensorflow as hvd
            import tensorflow as tf
            hvd.init()
            with tf.device("/CPU:0"):
                total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum).numpy().tolist()
            print("RANK", hvd.rank(), hvd.size(), total)
            """
        )
    )
    bin_dir = os.path.dirname(horovod_nccl["python"])
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TF_CPP_MIN_LOG_LEVEL": "2"}
    horovodrun = os.path.join(bin_dir, "horovodrun")
    out = run([horovodrun, "-np", "2", "--gloo", horovod_nccl["python"], str(script)], 300, env=env)
    ranks = sorted(re.findall(r"RANK (\d) (\d) \[([\d.]+)\]", out))
    assert ranks == [("0", "2", "3.0"), ("1", "2", "3.0")], out[-4000:]


def test_install_sh_refuses_a_forced_nccl_build_on_tensorflow_without_cuda():
    """The interpreter running the tests has tensorflow-cpu (the default install)."""
    import tensorflow as tf

    if tf.test.is_built_with_cuda():
        pytest.skip("the interpreter's TensorFlow is built with CUDA: the forced build would go ahead")
    proc = subprocess.run(
        ["bash", INSTALL_SH, sys.executable, _horovod_version(), "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**_install_env(), "TFSYNC_HOROVOD_NCCL": "1"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "TFSYNC_HOROVOD_NCCL=1 asks for Horovod's NCCL build, but TensorFlow" in proc.stderr, proc.stderr
    assert "built without CUDA (install tensorflow[and-cuda], not tensorflow-cpu)" in proc.stderr, proc.stderr


def test_install_sh_rejects_an_unknown_choice():
    proc = subprocess.run(
        ["bash", INSTALL_SH, sys.executable, _horovod_version(), "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**_install_env(), "TFSYNC_HOROVOD_NCCL": "yes"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "TFSYNC_HOROVOD_NCCL=yes: expected 1 (NCCL build), 0 (Gloo only) or unset (decide)" in proc.stderr
