"""The CUDA kernels' standalone test program (``ops/cuda_test``), built by nvcc alone.

``ops/cuda_test/run.sh`` builds ``kernel_test`` from the kernels' plain CUDA sources
(``ops/cc/kernels/cuda``) without TensorFlow and runs it: on the GPU where
``nvidia-smi`` lists one (every kernel against the CPU reference, then bandwidth),
elsewhere the kernels' bodies on the CPU over the GPU launches' grids, saying that the
GPU run was skipped. Its CPU reference is checked here against TensorFlow's CPU
kernels (the op library's, through ``tfsync.ops``) on the cases ``kernel_test --dump``
writes, and the program is shown to fail when a kernel is wrong (a copy of the sources
with two planted faults).

run.sh reuses a program built from the same inputs (the build cache: ``_build_tools``);
the program runs every time. Needs ``nvcc``: skipped where it is missing, except under CI,
where it must run.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
from _build_tools import cache_root, require_nvcc

from tfsync.launch import REPO_ROOT

RUN_SH = os.path.join(REPO_ROOT, "ops", "cuda_test", "run.sh")

pytestmark = [
    pytest.mark.skipif(
        not require_nvcc("the CUDA kernels' test program"),
        reason="nvcc is not on the PATH: the CUDA test program cannot be built here",
    ),
    pytest.mark.timeout(1800),
]


def _gpu_listed():
    """What `nvidia-smi -L` lists (empty where there is no nvidia-smi or no GPU)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return proc.stdout if proc.returncode == 0 and re.search(r"^GPU \d", proc.stdout, re.M) else ""


def _run_sh(build_dir, *args, env=None, timeout_s=1500):
    env = {**os.environ, "CUDA_TEST_BUILD_DIR": str(build_dir), **(env or {})}
    return subprocess.run(["bash", RUN_SH, *args], capture_output=True, text=True, timeout=timeout_s, env=env)


@pytest.fixture(scope="module")
def kernel_test():
    """run.sh's build and run, once: the process and the program it built (in the build cache,
    where run.sh reuses a program built from the same inputs)."""
    build_dir = pathlib.Path(cache_root()) / "cuda-test"
    proc = _run_sh(build_dir)
    return {"proc": proc, "binary": build_dir / "kernel_test", "output": proc.stdout + proc.stderr}


def test_the_program_is_built_by_nvcc_alone(kernel_test):
    assert kernel_test["binary"].exists(), f"run.sh built no program:\n{kernel_test['output'][-6000:]}"
    linked = subprocess.run(["ldd", str(kernel_test["binary"])], capture_output=True, text=True, timeout=60).stdout
    assert "tensorflow" not in linked, f"the standalone test must not link TensorFlow:\n{linked}"


def test_run_sh_runs_every_kernel_on_the_gpu_or_says_it_skipped(kernel_test):
    out = kernel_test["output"]
    assert kernel_test["proc"].returncode == 0, f"run.sh failed ({kernel_test['proc'].returncode}):\n{out[-6000:]}"
    assert re.search(r"reference self-check: \d+ known values, 0 wrong", out), out[-6000:]
    # every kernel in every dtype, each with a result row that passed
    for kernel in ("delay_compensate", "delay_compensate_adaptive", "all_finite", "scale_all_finite"):
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            assert re.search(rf"^{kernel} +{dtype} +\d+ +\d+ +0 +0 ok$", out, re.M), f"{kernel} {dtype}:\n{out[-6000:]}"
    assert re.search(r"^PASSED: 0 mismatching checks", out, re.M), out[-6000:]
    if _gpu_listed():
        assert "cuda-test: running on GPU" in out, out[-6000:]
        assert "bandwidth at" in out and "of copy" in out, out[-6000:]
    else:
        assert "kernels on the CPU (emulated grid)" in out, out[-6000:]
        assert "cuda-test: SKIPPED the GPU run: no GPU here" in out, out[-6000:]


def _mutated_tree(root):
    """A copy of the kernels and the test program with two faults planted: delay
    compensation drops a factor of the gradient, and all_finite skips the first element
    of each tensor's tail (the elements past its last whole vector)."""
    for sub in ("ops/cc/kernels/cuda", "ops/cuda_test"):
        shutil.copytree(os.path.join(REPO_ROOT, sub), root / sub)
    body = root / "ops/cc/kernels/cuda/elementwise.cuh"
    text = body.read_text()
    faults = {
        "Add(gi, Mul(Mul(Mul(lambda, gi), gi), delta))": "Add(gi, Mul(Mul(lambda, gi), delta))",
        "for (int64_t i = packs * N + grid.first; i < n; i += grid.stride) bad |= NonFinite<T>(x[i]);": (
            "for (int64_t i = packs * N + grid.first + (N > 1); i < n; i += grid.stride) bad |= NonFinite<T>(x[i]);"
        ),
    }
    for right, wrong in faults.items():
        assert text.count(right) == 1, f"the fault's site is gone from {body}: {right}"
        text = text.replace(right, wrong)
    body.write_text(text)
    return root / "ops/cuda_test/run.sh"


def test_the_program_fails_when_a_kernel_is_wrong(tmp_path):
    run_sh = _mutated_tree(tmp_path / "tree")
    # (the planted faults' program is kept in the cache too: run.sh rebuilds it when its sources change)
    build_dir = pathlib.Path(cache_root()) / "cuda-test-faults"
    env = {**os.environ, "CUDA_TEST_BUILD_DIR": str(build_dir), "CUDA_TEST_ARCH": "sm_90"}
    # the emulated grid (no GPU needed), up to a size past one block of vectors
    proc = subprocess.run(
        ["bash", str(run_sh), "--host", "--max-elements", "65537"] if not _gpu_listed() else ["bash", str(run_sh)],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the program passed kernels with planted faults:\n{out[-6000:]}"
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert re.search(rf"^delay_compensate +{dtype} .* FAIL$", out, re.M), out[-6000:]
        assert re.search(rf"^all_finite +{dtype} .* FAIL$", out, re.M), out[-6000:]
        # the kernels without a fault still pass
        assert re.search(rf"^scale_all_finite +{dtype} .* ok$", out, re.M), out[-6000:]
        assert re.search(rf"^delay_compensate_adaptive +{dtype} .* ok$", out, re.M), out[-6000:]
    assert "MISMATCH delay_compensate" in out and "MISMATCH all_finite" in out, out[-6000:]


# ---- the reference against TensorFlow's CPU kernels ----

_NUMPY = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def _array(directory, name, dtype, tf):
    if dtype == "bfloat16":
        bits = np.fromfile(directory / name, dtype=np.uint16)
        return tf.bitcast(tf.constant(bits), tf.bfloat16)
    return tf.constant(np.fromfile(directory / name, dtype=_NUMPY[dtype]))


def _state(directory, name, dtype):
    return np.fromfile(directory / name, dtype=np.float64 if dtype == "float64" else np.float32)


def _bits(tensor, tf):
    """Bits of a float tensor, NaNs made one pattern (payloads may differ; a NaN is a NaN)."""
    t = tf.convert_to_tensor(tensor)
    width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[t.dtype.size]
    nan = tf.math.is_nan(tf.cast(t, tf.float64)).numpy()
    return np.where(nan, np.iinfo(width).max, tf.bitcast(t, tf.as_dtype(width)).numpy())


def _differences(got, want, tf):
    a, b = _bits(got, tf), _bits(want, tf)
    bad = np.flatnonzero(a != b)
    if not bad.size:
        return ""
    return f"{bad.size} of {a.size} differ, first at {bad[:5].tolist()}: {a[bad[:5]]} != {b[bad[:5]]}"


def test_the_reference_computes_what_tensorflows_cpu_kernels_compute(kernel_test, tmp_path):
    """Every case `kernel_test --dump` writes (each kernel, dtype and size to 65537, edge
    values among random ones) through the op library's CPU kernels: bit for bit, as the
    GPU kernels are held to the reference."""
    import tensorflow as tf

    from tfsync import ops

    assert kernel_test["binary"].exists(), kernel_test["output"][-6000:]
    proc = subprocess.run(
        [str(kernel_test["binary"]), "--dump", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = json.loads((tmp_path / "manifest.json").read_text())
    assert {c["kernel"] for c in cases} == {
        "delay_compensate",
        "delay_compensate_adaptive",
        "all_finite",
        "scale_all_finite",
    }
    assert {c["dtype"] for c in cases} == {"float16", "bfloat16", "float32", "float64"}
    previous = ops.get_implementation()
    ops.set_implementation("compiled")
    failures = []
    try:
        with tf.device("/CPU:0"):
            for case in cases:
                dtype, arrays, params = case["dtype"], case["arrays"], case["params"]
                where = f"{case['kernel']} {dtype} n={case['n']} {params}"
                if case["kernel"] == "delay_compensate":
                    g, wn, ws = (_array(tmp_path, arrays[k], dtype, tf) for k in ("g", "w_now", "w_stale"))
                    got = ops.delay_compensate(g, wn, ws, params["lambda"])
                    diff = _differences(got, _array(tmp_path, arrays["out"], dtype, tf), tf)
                elif case["kernel"] == "delay_compensate_adaptive":
                    g, wn, ws = (_array(tmp_path, arrays[k], dtype, tf) for k in ("g", "w_now", "w_stale"))
                    v = tf.Variable(_state(tmp_path, arrays["mean_square"], dtype))
                    got = ops.delay_compensate_adaptive(
                        g, wn, ws, v, params["lambda0"], params["momentum"], params["epsilon"]
                    )
                    diff = _differences(got, _array(tmp_path, arrays["out"], dtype, tf), tf)
                    diff += _differences(v, _state(tmp_path, arrays["mean_square_out"], dtype), tf)
                elif case["kernel"] == "all_finite":
                    finite = ops.all_finite([_array(tmp_path, arrays["x"], dtype, tf)])
                    diff = "" if bool(finite[0]) == case["finite"] else f"finite = {bool(finite[0])}"
                else:
                    x = _array(tmp_path, arrays["x"], dtype, tf)
                    (scaled,), finite = ops.scale_all_finite([x], params["scale"])
                    diff = _differences(scaled, _array(tmp_path, arrays["out"], dtype, tf), tf)
                    diff += "" if bool(finite[0]) == case["finite"] else f" finite = {bool(finite[0])}"
                if diff:
                    failures.append(f"{where}: {diff}")
    finally:
        ops.set_implementation(previous)
    assert not failures, f"{len(failures)} of {len(cases)} cases differ:\n" + "\n".join(failures[:20])
