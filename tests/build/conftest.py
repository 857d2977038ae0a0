"""What the build checks share: one throwaway virtual environment with TensorFlow's GPU
wheel (the release installed here), made once per session for the op library's GPU
build (test_gpu_build.py) and Horovod's NCCL build (test_horovod_nccl.py)."""

import sys

import pytest
from _build_tools import run

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
def gpu_venv(tmp_path_factory):
    """``{"root", "python", "site", "tensorflow_version"}`` of the environment."""
    import tensorflow as tf

    root = tmp_path_factory.mktemp("gpu_venv")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", str(venv)], 120)
    python = str(venv / "bin" / "python")
    version = tf.__version__  # the GPU wheel of the release this install compiled against
    run(
        [python, "-m", "pip", "install", "-q", "-c", "constraints.txt", f"tensorflow=={version}", *GPU_VENV_PACKAGES],
        1200,
        cwd=REPO_ROOT,
    )
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    return {"root": root, "python": python, "site": site, "tensorflow_version": version}
