"""Helpers of the build checks (tests/gpu_build): running a build step, and keeping what a
build made outside the clone, keyed by everything that can change it.

A build check has two halves: making the product (a virtual environment with TensorFlow's
GPU wheel, the op library's GPU build, Horovod's NCCL build, the CUDA test program: minutes
each on two cores) and checking it (linked, loaded, its symbols and device code, a two-rank
run). CI runs every check every time; it makes a product again only when an input changed.
:func:`cached` keeps each product in ``TFSYNC_BUILD_CACHE`` (default ``~/.cache/tfsync``)
under a name and a hash of its inputs: the same inputs find it there, any change makes it
anew in a new folder, and the folders of the same product with other inputs are removed once
the new one is made (a GPU environment is gigabytes). A product is used only once its
``inputs.json`` is written, which is the last thing its build does, so a build that was
interrupted is made again.
"""

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

NVCC = shutil.which("nvcc")
CACHE_ENV = "TFSYNC_BUILD_CACHE"
DONE = "inputs.json"  # written last: a product folder without it is an interrupted build


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


# ------------------------------------------------------------------ the cache
def cache_root():
    """Where built products are kept: ``TFSYNC_BUILD_CACHE``, else ``~/.cache/tfsync``."""
    return os.path.abspath(os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tfsync"))


def toolchain():
    """What every build here depends on beside its own sources: the interpreter (its version,
    ABI and path: a virtual environment points at it), the machine, nvcc's and the C++
    compiler's versions."""
    cxx = os.environ.get("CXX", "g++")
    return {
        "python": sys.version,
        "abi": sysconfig.get_config_var("SOABI"),
        "executable": os.path.realpath(sys.executable),
        "machine": sysconfig.get_platform(),
        "nvcc": run([NVCC, "--version"], 60).strip().splitlines()[-2:] if NVCC else None,
        "cxx": run([cxx, "--version"], 60).splitlines()[0] if shutil.which(cxx) else None,
    }


def files_digest(root, patterns):
    """A digest of the files ``patterns`` (globs under ``root``, ``**`` recursive) match: their
    paths and contents."""
    digest = hashlib.sha256()
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            if os.path.isfile(path):
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # (a second session building the same product waits for it)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached(name, inputs, build):
    """The folder of product ``name`` made from ``inputs`` (a JSON-able dict of everything it
    depends on): found in the cache when a build with the same inputs finished, else made by
    ``build(folder)`` (which must succeed) into a fresh folder. Returns ``(folder, reused)``."""
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    text = json.dumps(inputs, sort_keys=True, indent=1)
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    folder = os.path.join(root, f"{name}-{key}")
    with _locked(folder + ".lock"):
        if os.path.exists(os.path.join(folder, DONE)):
            return folder, True
        shutil.rmtree(folder, ignore_errors=True)  # (an interrupted build)
        os.makedirs(folder)
        build(folder)
        with open(os.path.join(folder, DONE), "w") as f:
            f.write(text)
    _remove_others(root, name, key)
    return folder, False


def _remove_others(root, name, key):
    """The folders of ``name`` made from other inputs, each unless a build holds its lock."""
    for lock_path in glob.glob(os.path.join(root, f"{name}-*.lock")):
        folder = lock_path[: -len(".lock")]
        if folder.endswith(key) or not re.fullmatch(r"[0-9a-f]{16}", folder.rsplit("-", 1)[-1]):
            continue
        with open(lock_path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            os.unlink(lock_path)
