"""What the build checks share: one virtual environment with TensorFlow's GPU wheel (the
release installed here), for the op library's GPU build (test_gpu_build.py) and Horovod's
NCCL build (test_horovod_nccl.py), kept in the build cache (:func:`_build_tools.cached`)
between runs while its inputs stay the same."""

import os
import pathlib
import sys

import pytest
from _build_tools import cached, files_digest, run, toolchain

from tfsync.launch import REPO_ROOT

# What the GPU builds need beside TensorFlow: NCCL's headers and library (what
# tensorflow[and-cuda] installs), Horovod's own dependencies (its build installs with
# --no-deps), and cuobjdump, which reads device code (this machine's CUDA toolkit ships
# nvcc without it).
GPU_VENV_PACKAGES = ("setuptools", "wheel", "nvidia-nccl-cu12", "nvidia-cuda-cuobjdump") + (
    "cloudpickle",
    "psutil",
    "pyyaml",
    "packaging",
)


@pytest.fixture(scope="session")
def gpu_venv():
    """``{"root", "python", "site", "tensorflow_version", "reused", "inputs"}`` of the environment
    (``inputs``: what it was made from, for the builds made in it to key on)."""
    import tensorflow as tf

    version = tf.__version__  # the GPU wheel of the release this install compiled against
    inputs = {
        "toolchain": toolchain(),
        "tensorflow": version,
        "packages": GPU_VENV_PACKAGES,
        "constraints": files_digest(REPO_ROOT, ["constraints.txt"]),
    }

    def build(folder):
        venv = os.path.join(folder, "venv")
        run([sys.executable, "-m", "venv", venv], 120)
        python = os.path.join(venv, "bin", "python")
        packages = [f"tensorflow=={version}", *GPU_VENV_PACKAGES]
        run([python, "-m", "pip", "install", "-q", "-c", "constraints.txt", *packages], 1200, cwd=REPO_ROOT)

    folder, reused = cached("gpu-venv", inputs, build)
    root = pathlib.Path(folder)
    venv = root / "venv"
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    return {
        "root": root,
        "python": str(venv / "bin" / "python"),
        "site": site,
        "tensorflow_version": version,
        "reused": reused,
        "inputs": inputs,
    }
