"""``python -m tfsync.install_horovod`` (or ``tfsync-install-horovod``): the patched Horovod, without make.

Builds Horovod (:data:`HOROVOD_VERSION`, its last release) from its published
source distribution against the TensorFlow installed in this Python environment,
with tfsync's patch, and installs it: what ``make install`` does with
``third_party/horovod/install.sh``, for an environment that has TensorFlow and
tfsync (``pip install --no-build-isolation tfsync-*.tar.gz``) and no checkout.
It runs that same script, shipped with tfsync as package data (an installed
tfsync's ``tfsync/_horovod_build/``, copied there by ``setup.py``; a checkout's
``third_party/horovod/``), so both routes build the same Horovod and recognise
each other's build (the script skips the build when the installed Horovod was
built by it against the same TensorFlow and patch).

What the build needs is checked before it starts, each missing piece named with
the way to get it: TensorFlow importable, ``cmake``, a C++ compiler,
``patch``, ``tar``, Python's headers, pip, setuptools, wheel and Horovod's runtime
dependencies (installed with tfsync; the script installs Horovod with ``--no-deps``
and imports it once built). The build is bounded
(``--timeout-s``); past the bound its whole process group is killed.

Example:

    pip install tensorflow-cpu==2.21.0
    pip install --no-build-isolation tfsync-0.1.0.tar.gz
    python -m tfsync.install_horovod        # about 8 minutes on 2 cores
"""

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile

HOROVOD_VERSION = "0.28.1"
SCRIPT = "install.sh"
PACKAGED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_horovod_build")
CHECKOUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "third_party", "horovod")
DEFAULT_TIMEOUT_S = 3600.0  # (about 8 minutes on 2 shared cores; a slow machine gets room)


def build_files_dir():
    """``(directory of install.sh and the patch, directory of the constraints.txt the script's pip
    call reads)``: the installed package's copy, else the checkout's ``third_party/horovod`` (an
    editable install, a source tree) and the checkout's root."""
    if os.path.isfile(os.path.join(PACKAGED_DIR, SCRIPT)):
        return PACKAGED_DIR, PACKAGED_DIR
    if os.path.isfile(os.path.join(CHECKOUT_DIR, SCRIPT)):
        return CHECKOUT_DIR, os.path.dirname(os.path.dirname(CHECKOUT_DIR))
    raise SystemExit(
        f"tfsync.install_horovod: Horovod's build script is neither in {PACKAGED_DIR} (an installed tfsync) "
        f"nor in {CHECKOUT_DIR} (a checkout). Reinstall tfsync from its sdist or a checkout "
        "(`pip install --no-build-isolation .`), which ships it."
    )


def missing_requirements(python=sys.executable):
    """What the build needs and this machine lacks, each as 'what; how to get it' (empty: nothing)."""
    missing = []
    if importlib.util.find_spec("tensorflow") is None:
        missing.append(
            "TensorFlow is not installed in this environment; Horovod is compiled against it: "
            "`pip install tensorflow-cpu==2.21.0` (or tensorflow[and-cuda] for GPUs) first"
        )
    for tool, package in (("cmake", "cmake"), ("patch", "patch"), ("tar", "tar"), ("bash", "bash")):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` is not on the PATH: `apt-get install {package}`")
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX") or "g++", "c++")):
        missing.append("no C++ compiler (g++ or c++, or $CXX) on the PATH: `apt-get install g++ make`")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        missing.append(
            f"Python's headers are missing ({include}/Python.h): `apt-get install python{version}-dev` "
            "(python3-dev for the system's Python)"
        )
    # the build tools, and Horovod's runtime dependencies: the script installs Horovod with --no-deps
    # and imports it once built (tfsync's install brings them; an install with --no-deps does not)
    needed = ("pip", "setuptools", "wheel", "cloudpickle", "psutil", "yaml", "packaging")
    for module, package in ((m, "pyyaml" if m == "yaml" else m) for m in needed):
        if importlib.util.find_spec(module) is None:
            missing.append(f"the Python package {package} is not installed: `{python} -m pip install {package}`")
    return missing


def install(build_dir=None, timeout_s=DEFAULT_TIMEOUT_S, python=sys.executable):
    """Build and install the patched Horovod with ``python``; returns the script's exit code.

    ``build_dir``: where the sdist is unpacked and built (default: a temporary directory,
    removed after). Raises ``SystemExit`` naming what is missing before anything starts, and
    ``TimeoutError`` when the build runs past ``timeout_s``.
    """
    files, constraints_dir = build_files_dir()
    missing = missing_requirements(python)
    if missing:
        raise SystemExit("tfsync.install_horovod: Horovod cannot be built here yet:\n  - " + "\n  - ".join(missing))
    with tempfile.TemporaryDirectory(prefix="tfsync-horovod-") as scratch:
        work = os.path.abspath(build_dir or scratch)
        os.makedirs(work, exist_ok=True)
        # (the script runs beside the constraints.txt it passes to pip)
        cmd = ["bash", os.path.join(files, SCRIPT), python, HOROVOD_VERSION, work]
        proc = subprocess.Popen(cmd, cwd=constraints_dir, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(
                f"Horovod's build ({' '.join(cmd)}) ran past {timeout_s:.0f} s and was stopped; "
                "on a slow or busy machine give it longer with --timeout-s"
            ) from None
        except BaseException:  # Ctrl-C: the build's compilers go with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


def main(argv=None):
    from tfsync.launch import number

    p = argparse.ArgumentParser(prog="python -m tfsync.install_horovod", description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", help="where to unpack and build Horovod's sdist (default: a temporary directory)")
    p.add_argument("--timeout-s", type=number(above=0), default=DEFAULT_TIMEOUT_S, help="bound of the whole build")
    args = p.parse_args(argv)
    try:
        return install(args.build_dir, args.timeout_s)
    except TimeoutError as exc:
        print(f"tfsync.install_horovod: {exc}", file=sys.stderr)
        return 124


if __name__ == "__main__":
    sys.exit(main())
