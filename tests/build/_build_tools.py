"""Helpers of the build checks (tests/build)."""

import glob
import os
import re
import shutil
import subprocess

NVCC = shutil.which("nvcc")


def require_nvcc(what):
    """Under CI a missing nvcc is an error (the machine has the CUDA toolkit); elsewhere the
    caller skips."""
    if NVCC is None and os.environ.get("CI"):
        raise RuntimeError(f"CI must check {what}, but nvcc is not on the PATH (the machine has the CUDA toolkit)")
    return NVCC is not None


def run(cmd, timeout_s, **kwargs):
    """stdout + stderr of ``cmd``, which must succeed within ``timeout_s``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{output[-8000:]}"
    return output


def nvcc_targets():
    """The compute capabilities nvcc can compile SASS for (``nvcc --list-gpu-code``)."""
    return {int(c[3:]) for c in run([NVCC, "--list-gpu-code"], 60).split() if re.fullmatch(r"sm_\d+", c)}


def cuobjdump(site):
    """The cuobjdump the nvidia-cuda-cuobjdump package installed in ``site``."""
    found = sorted(glob.glob(str(site / "nvidia" / "*" / "bin" / "cuobjdump")))
    assert found, f"the nvidia-cuda-cuobjdump package installed no cuobjdump under {site}/nvidia"
    return found[-1]
