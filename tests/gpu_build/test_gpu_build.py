"""The op library's GPU build, checked on a machine without a GPU.

Builds ``_tfsync_ops.so`` the way ``setup.py`` does on a GPU machine, against
TensorFlow's GPU wheel (the release installed here) in the build checks' throwaway
virtual environment (conftest.py), with the ``nvcc`` on the PATH, and checks what can be
checked without a device: the CUDA kernels are in the library as SASS for every
architecture the build chose and as PTX; every CUDA runtime symbol the library needs is
exported by the wheel's ``libtensorflow_framework`` (so it loads in a TensorFlow
process); and loaded in that environment, the ops have GPU kernels registered. Running
the kernels needs a GPU: ``tests/gpu_build/test_cuda_kernels.py`` runs them (plain CUDA,
without TensorFlow) where one is (docs/install.md, "GPU build").

The build is slow (an nvcc build, minutes on two cores): it is kept in the build cache
(``_build_tools.cached``) and made again whenever setup.py, ``ops/cc``, the environment or
the toolchain changed; the checks run every time. Needs ``nvcc``: skipped where it is
missing, except under CI, where it must run.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import textwrap

import pytest
from _build_tools import cached, cuobjdump, files_digest, nvcc_targets, require_nvcc, run

from tfsync.launch import REPO_ROOT

# every op with a GPU kernel, and the kernels' names in the device code
CUDA_OPS = (
    "TfSync>DelayCompensate",
    "TfSync>DelayCompensateAdaptive",
    "TfSync>AllFinite",
    "TfSync>ScaleAllFinite",
    "TfSync>QuantizeBlocks",
    "TfSync>DequantizeBlocks",
    "TfSync>DequantizeSum",
)
DEVICE_KERNELS = (
    "DelayCompensateOp",
    "AdaptiveOp",
    "AllFiniteOp",
    "ScaleAllFiniteOp",
    "QuantizeBlocksKernel",
    "DequantizeBlocksKernel",
    "DequantizeSumKernel",
)

pytestmark = [
    pytest.mark.skipif(
        not require_nvcc("the GPU build"), reason="nvcc is not on the PATH: the GPU build cannot be compiled here"
    ),
    pytest.mark.timeout(2400),  # the first test makes the shared environment and the build
]


@pytest.fixture(scope="module")
def gpu_build(gpu_venv):
    """The op library as setup.py builds it against the GPU wheel: made once per change of its
    sources, setup.py, the environment or the toolchain (the build cache), checked every run."""
    env = {**os.environ, "TFSYNC_BUILD_SCHEDULER": "0"}
    env.pop("TFSYNC_CUDA_ARCHS", None)  # (the default architectures: the build chooses)
    inputs = {"venv": gpu_venv["inputs"], "sources": files_digest(REPO_ROOT, ["setup.py", "ops/cc/**"])}

    def build(folder):
        cmd = [gpu_venv["python"], "setup.py", "build_ext", "--build-lib", f"{folder}/lib", "--build-temp"]
        log = run([*cmd, f"{folder}/tmp", "--force"], 1500, cwd=REPO_ROOT, env=env)
        with open(os.path.join(folder, "build.log"), "w") as f:
            f.write(log)
        shutil.rmtree(os.path.join(folder, "tmp"))  # (object files: the library is what is checked)

    folder, _ = cached("gpu-oplib", inputs, build)
    root = pathlib.Path(folder)
    ops_dir = root / "lib" / "tfsync" / "ops"
    with open(ops_dir / "_build_info.json") as f:
        info = json.load(f)
    site = gpu_venv["site"]
    return {
        "root": root,
        "python": gpu_venv["python"],
        "library": str(ops_dir / "_tfsync_ops.so"),
        "info": info,
        "framework": str(site / "tensorflow" / "libtensorflow_framework.so.2"),
        "cuobjdump": cuobjdump(site),
        "log": (root / "build.log").read_text(),
    }


def test_the_build_compiles_cuda_kernels_for_the_default_architectures(gpu_build):
    info = gpu_build["info"]
    assert info["cuda"] is True and info["cuda_kernels"] is True, info
    supported = nvcc_targets()
    assert info["cuda_archs"] == [a for a in (70, 80, 90) if a in supported], info
    assert info["cuda_archs"], "nvcc targets none of sm_70, sm_80, sm_90"
    for dropped in sorted({70, 80, 90} - supported):
        assert f"cannot compile for sm_{dropped}" in gpu_build["log"], "a dropped architecture must be reported"
    assert info["tensorflow_cuda_version"], info


def test_the_library_holds_sass_for_each_architecture_and_ptx_of_the_newest(gpu_build):
    cuobjdump = gpu_build["cuobjdump"]
    elves = run([cuobjdump, "--list-elf", gpu_build["library"]], 120)
    ptx = run([cuobjdump, "--list-ptx", gpu_build["library"]], 120)
    archs = gpu_build["info"]["cuda_archs"]
    for arch in archs:
        assert re.search(rf"\.sm_{arch}\.cubin", elves), f"no sm_{arch} code in the library:\n{elves}"
    assert re.search(rf"\.sm_{archs[-1]}\.ptx", ptx), f"no PTX for compute_{archs[-1]}:\n{ptx}"
    # the kernels themselves, not only an empty fat binary
    names = run([cuobjdump, "--dump-elf-symbols", gpu_build["library"]], 120)
    for kernel in DEVICE_KERNELS:
        assert kernel in names, f"{kernel} is not in the library's device code"


def test_every_cuda_runtime_symbol_the_library_needs_is_exported_by_tensorflow(gpu_build):
    undefined = run(["nm", "-D", "--undefined-only", gpu_build["library"]], 60).split()
    needed = {s for s in undefined if s.startswith(("__cuda", "cuda"))}
    assert "__cudaRegisterFatBinary" in needed, "the library registers no fat binary: no CUDA code was linked"
    exported = set(run(["nm", "-D", "--defined-only", gpu_build["framework"]], 300).split())
    missing = sorted(needed - exported)
    assert not missing, f"CUDA runtime symbols the library needs but libtensorflow_framework does not export: {missing}"


def test_the_library_loads_with_gpu_kernels_registered(gpu_build):
    check = textwrap.dedent(
        f"""
        import json
        import tensorflow as tf
        from tensorflow.python.framework import kernels
        tf.load_op_library({gpu_build["library"]!r})
        registered = {{op: kernels.get_registered_kernels_for_op(op).kernel for op in {CUDA_OPS!r}}}
        print("KERNELS", json.dumps({{op: sorted({{k.device_type for k in ks}}) for op, ks in registered.items()}}))
        """
    )
    out = run([gpu_build["python"], "-c", check], 300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    found = re.search(r"^KERNELS (.*)$", out, re.MULTILINE)
    assert found, f"the check printed no kernel table:\n{out[-4000:]}"
    devices = json.loads(found.group(1))
    for op in CUDA_OPS:
        assert "GPU" in devices[op] and "CPU" in devices[op], f"{op}: kernels registered for {devices[op]}"


def test_tfsync_runs_the_finiteness_kernels_of_this_library_on_gpu_tensors(gpu_build):
    """tfsync.ops's choice for all_finite and scale_all_finite with the library this GPU build
    made: tensors on a GPU go to the compiled kernels (the library has CUDA kernels), tensors
    on the CPU to the compiled kernels pinned to their CPU, and with the reference selected,
    to the reference. There is no GPU here: a GPU tensor is stood in for by its device."""
    check = textwrap.dedent(
        f"""
        import json, sys, types
        sys.path.insert(0, {REPO_ROOT!r})
        import tensorflow as tf
        from tfsync.ops import _loader
        _loader.library_dir = lambda: {os.path.dirname(gpu_build["library"])!r}
        from tfsync import ops
        ops.set_implementation("compiled")
        gpu = types.SimpleNamespace(device="/job:localhost/replica:0/task:0/device:GPU:0")
        cpu = tf.constant([1.0, float("nan")])
        on_gpu, on_cpu = ops._finite_backend([gpu]), ops._finite_backend([cpu])
        finite = ops.all_finite([cpu, tf.constant([2.0])]).numpy().tolist()
        (scaled,), scaled_finite = ops.scale_all_finite([tf.constant([3.0])], 0.5)
        ops.set_implementation("reference")
        reference = ops._finite_backend([gpu])
        print("ROUTES", json.dumps({{
            "gpu": [on_gpu[0].__name__, on_gpu[1]], "cpu": [on_cpu[0].__name__, on_cpu[1]],
            "reference": [reference[0].__name__, reference[1]], "finite": finite,
            "scaled": scaled.numpy().tolist(), "scaled_finite": scaled_finite.numpy().tolist()}}))
        """
    )
    out = run([gpu_build["python"], "-c", check], 300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    routes = json.loads(re.search(r"^ROUTES (.*)$", out, re.MULTILINE).group(1))
    assert routes["gpu"] == ["tfsync.ops._compiled", None], routes
    assert routes["cpu"][0] == "tfsync.ops._compiled" and routes["cpu"][1].endswith("device:CPU:0"), routes
    assert routes["reference"] == ["tfsync.ops._reference", None], routes
    # the GPU-built library's CPU kernels, in a TensorFlow without a GPU
    assert routes["finite"] == [False, True] and routes["scaled"] == [1.5] and routes["scaled_finite"] == [True], routes


@pytest.mark.parametrize("archs", ["8.0;9.0", "unsupported"])
def test_a_bad_architecture_list_stops_the_build_and_says_what_nvcc_has(gpu_build, archs, tmp_path):
    supported = nvcc_targets()
    if archs == "unsupported":
        archs = str(next(a for a in (35, 50, 60, 70, 75) if a not in supported))
    env = {**os.environ, "TFSYNC_BUILD_SCHEDULER": "0", "TFSYNC_CUDA_ARCHS": archs}
    out = tmp_path / "bad"
    cmd = [gpu_build["python"], "setup.py", "build_ext", "--build-lib", str(out), "--build-temp", str(out / "tmp")]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert f"TFSYNC_CUDA_ARCHS={archs!r}" in proc.stderr, proc.stderr[-3000:]
    expected = "without the dot" if "." in archs else f"cannot compile for sm_{archs}"
    assert expected in proc.stderr, proc.stderr[-3000:]
