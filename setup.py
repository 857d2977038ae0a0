"""Builds tfsync: the TensorFlow op library from ``ops/`` and the Cython scheduler.

The op library is compiled against the *installed* TensorFlow (flags from
``tf.sysconfig``, read in exactly one place: :func:`_tensorflow_build_flags`),
so install with ``pip install --no-build-isolation .`` after TensorFlow.  The
TensorFlow version used at build time is written next to the library and
checked by the loader (``tfsync/ops/_loader.py``).

CUDA kernels (``ops/cc/kernels/cuda/*.cu``: plain CUDA, nothing of TensorFlow, also
built alone by ``ops/cuda_test/``) are compiled only when the installed TensorFlow was
built with CUDA *and* ``nvcc`` is on the PATH: as SASS for :data:`DEFAULT_CUDA_ARCHS`
(those the found ``nvcc`` can target; ``TFSYNC_CUDA_ARCHS`` overrides, e.g. ``"80;90"``)
plus PTX of the newest, so later GPUs JIT it; the kernels' ``.cc`` files then define
``GOOGLE_CUDA`` and register GPU kernels that call them. Their host compile includes
the CUDA headers TensorFlow's GPU wheel ships (Eigen's GPU device and the launchers'
header include ``cuda_runtime.h``). The library does not link the CUDA runtime itself:
it resolves ``__cudaRegisterFatBinary`` and the launch calls against
``libtensorflow_framework``, which exports them and forwards to the CUDA runtime
TensorFlow loads.

Horovod's build files (``third_party/horovod``: its script and our patch) and
``constraints.txt`` are copied into the package as ``tfsync/_horovod_build/``,
so ``python -m tfsync.install_horovod`` builds the patched Horovod from an
installed tfsync, without a checkout; ``MANIFEST.in`` puts everything the build
reads into the sdist (``tests/single/test_sdist_contents.py`` checks it).

Skipping a compiled part is opt-in and loud: ``TFSYNC_BUILD_OPS=0`` skips the op
library, ``TFSYNC_BUILD_SCHEDULER=0`` the Cython scheduler.  A compiler error is
never swallowed.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
OPS_EXT_NAME = "tfsync.ops._tfsync_ops"
# Compute capabilities compiled to SASS by default: Volta, Ampere, Hopper (PTX of the
# newest is added, so later GPUs JIT it).
DEFAULT_CUDA_ARCHS = (70, 80, 90)


def _env_flag(name):
    value = os.environ.get(name, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes"):
        raise SystemExit(f"{name}={value!r}: expected 0 or 1")
    return value in ("1", "true", "yes")


def _tensorflow_build_flags():
    """The one place that reads tf.sysconfig: compile/link flags and the version."""
    try:
        import tensorflow as tf
    except ImportError as exc:  # pragma: no cover - exercised on broken installs
        raise SystemExit(
            "tfsync's op library is compiled against the installed TensorFlow, "
            f"which failed to import ({exc}). Install TensorFlow first (tensorflow-cpu, or tensorflow "
            "for GPUs, at the version the README supports), then `pip install --no-build-isolation .`; "
            "`make install` does both."
        ) from exc
    return {
        "compile_flags": list(tf.sysconfig.get_compile_flags()),
        "link_flags": list(tf.sysconfig.get_link_flags()),
        "include_dir": tf.sysconfig.get_include(),
        "tensorflow_version": tf.__version__,
        "cuda": bool(tf.test.is_built_with_cuda()),
        "tensorflow_cuda_version": tf.sysconfig.get_build_info().get("cuda_version"),
    }


def _nvcc_version(nvcc):
    """The CUDA release of ``nvcc`` as (major, minor), from ``nvcc --version``."""
    out = subprocess.check_output([nvcc, "--version"], text=True)
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise SystemExit(f"tfsync: could not read the CUDA release from `{nvcc} --version`:\n{out}")
    return int(match.group(1)), int(match.group(2))


def _cuda_archs(nvcc):
    """The compute capabilities to compile SASS for, each one ``nvcc`` can target.

    ``TFSYNC_CUDA_ARCHS`` (e.g. ``"80;90"``) must name only targets ``nvcc`` has; the
    default drops those it lacks (CUDA 13 has no Volta, sm_70) and says so.
    """
    listed = subprocess.check_output([nvcc, "--list-gpu-code"], text=True).split()
    supported = {int(code[3:]) for code in listed if re.fullmatch(r"sm_\d+", code)}
    raw = os.environ.get("TFSYNC_CUDA_ARCHS", "").strip()
    if raw:
        parts = [p.strip() for p in re.split(r"[;,\s]+", raw) if p.strip()]
        if not parts or not all(re.fullmatch(r"\d{2,3}", p) for p in parts):
            raise SystemExit(
                f"TFSYNC_CUDA_ARCHS={raw!r}: expected compute capabilities without the dot, "
                'separated by ";" (e.g. "80;90" for A100 and H100)'
            )
        archs = sorted({int(p) for p in parts})
        missing = [a for a in archs if a not in supported]
        if missing:
            raise SystemExit(
                f"TFSYNC_CUDA_ARCHS={raw!r}: {nvcc} cannot compile for "
                f"{', '.join(f'sm_{a}' for a in missing)}; it targets "
                f"{', '.join(f'sm_{a}' for a in sorted(supported))}. Use a CUDA toolkit that has "
                "them (sm_70 needs CUDA 12 or older) or leave them out."
            )
        return archs
    archs = [a for a in DEFAULT_CUDA_ARCHS if a in supported]
    dropped = [a for a in DEFAULT_CUDA_ARCHS if a not in supported]
    if dropped:
        print(
            f"tfsync: WARNING: {nvcc} cannot compile for {', '.join(f'sm_{a}' for a in dropped)}; "
            "those GPUs get no tfsync CUDA kernels (use CUDA 12's nvcc for them)",
            file=sys.stderr,
        )
    if not archs:
        raise SystemExit(
            f"tfsync: {nvcc} targets none of sm_{', sm_'.join(map(str, DEFAULT_CUDA_ARCHS))}; "
            'set TFSYNC_CUDA_ARCHS to the ones you need (e.g. "80;90")'
        )
    return archs


def _cuda_include_dir(tf_include_dir, nvcc):
    """The CUDA headers for the host compile: those TensorFlow's GPU wheel ships, else nvcc's."""
    shipped = os.path.join(tf_include_dir, "third_party", "gpus", "cuda", "include")
    toolkit = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include")
    for candidate in (shipped, toolkit):
        if os.path.exists(os.path.join(candidate, "cuda_runtime.h")):
            return candidate
    raise SystemExit(
        f"tfsync: cuda_runtime.h is neither in {shipped} (TensorFlow's GPU wheel) nor in {toolkit} "
        f"(beside {nvcc}); the CUDA kernels' host code needs it. Install the CUDA toolkit's headers."
    )


# Package data that lives outside the package in the checkout: Horovod's build script and patch,
# and the pins its pip call reads (python -m tfsync.install_horovod runs the script from here).
HOROVOD_BUILD_PACKAGE_DIR = os.path.join("tfsync", "_horovod_build")
HOROVOD_BUILD_FILES = ("third_party/horovod/*", "constraints.txt")


class BuildPy(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, HOROVOD_BUILD_PACKAGE_DIR)
        os.makedirs(target, exist_ok=True)
        copied = []
        for pattern in HOROVOD_BUILD_FILES:
            for path in sorted(glob.glob(os.path.join(HERE, pattern))):
                if os.path.isfile(path):
                    shutil.copy(path, target)
                    copied.append(os.path.basename(path))
        if "install.sh" not in copied or not any(name.endswith(".patch") for name in copied):
            raise SystemExit(
                f"tfsync: Horovod's build files are missing from {HERE}/third_party/horovod (found: "
                f"{', '.join(copied) or 'nothing'}); build from a complete checkout or sdist"
            )


class TensorFlowOpExtension(Extension):
    """A shared library loaded with tf.load_op_library, not a Python module."""


class BuildExt(build_ext):
    def get_ext_filename(self, fullname):
        # tf.load_op_library takes a path; give the library a plain, stable name.
        if fullname == OPS_EXT_NAME:
            return os.path.join(*fullname.split(".")) + ".so"
        if fullname == OPS_EXT_NAME.rsplit(".", 1)[1]:  # the in-place / editable copy asks by leaf name
            return fullname + ".so"
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self):
        super().copy_extensions_to_source()
        # the build info lives next to the library; editable installs must see it too
        package_dir = self.get_finalized_command("build_py").get_package_dir("tfsync.ops")
        built = os.path.join(self.build_lib, "tfsync", "ops", "_build_info.json")
        if os.path.exists(built):
            shutil.copyfile(built, os.path.join(package_dir, "_build_info.json"))

    def build_extension(self, ext):
        if isinstance(ext, TensorFlowOpExtension):
            self._configure_tf_extension(ext)
        super().build_extension(ext)
        if isinstance(ext, TensorFlowOpExtension):
            self._write_build_info(ext)

    def _configure_tf_extension(self, ext):
        flags = _tensorflow_build_flags()
        ext._tf_flags = flags
        ext.extra_compile_args = flags["compile_flags"] + ["-O3", "-fPIC", "-fvisibility=hidden"]
        ext.extra_link_args = flags["link_flags"]
        ext.language = "c++"
        cuda_sources = sorted(glob.glob(os.path.join("ops", "cc", "kernels", "cuda", "*.cu")))
        nvcc = shutil.which("nvcc")
        flags.update(cuda_kernels=False, cuda_archs=[], nvcc_version=None)
        if flags["cuda"] and nvcc and cuda_sources:
            nvcc_version = _nvcc_version(nvcc)
            tf_cuda = flags["tensorflow_cuda_version"]
            if tf_cuda and int(tf_cuda.split(".")[0]) != nvcc_version[0]:
                print(
                    f"tfsync: WARNING: nvcc is CUDA {nvcc_version[0]}.{nvcc_version[1]}, TensorFlow "
                    f"{flags['tensorflow_version']} was built with CUDA {tf_cuda}: the kernels need a "
                    f"driver for CUDA {nvcc_version[0]} at run time (docs/install.md: GPU build)",
                    file=sys.stderr,
                )
            archs = _cuda_archs(nvcc)
            ext.define_macros = list(ext.define_macros or []) + [("GOOGLE_CUDA", "1")]
            ext.include_dirs = list(ext.include_dirs) + [_cuda_include_dir(flags["include_dir"], nvcc)]
            ext.extra_objects = list(ext.extra_objects or []) + [self._nvcc(nvcc, src, archs) for src in cuda_sources]
            flags.update(cuda_kernels=True, cuda_archs=archs, nvcc_version=".".join(map(str, nvcc_version)))
        elif cuda_sources:
            reason = "TensorFlow was built without CUDA" if not flags["cuda"] else "nvcc not found"
            print(f"tfsync: building CPU kernels only ({reason})")

    def _nvcc(self, nvcc, src, archs):
        obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
        os.makedirs(self.build_temp, exist_ok=True)
        gencode = []
        for arch in archs:
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]  # PTX for newer GPUs
        # Plain CUDA: no TensorFlow flag is needed (ops/cuda_test/ builds the same files alone).
        cmd = [
            nvcc,
            "-std=c++17",
            "-O3",
            "-c",
            src,
            "-o",
            obj,
            "-Xcompiler",
            "-fPIC",
            "-Xcompiler",
            "-fvisibility=hidden",
        ] + gencode
        print(" ".join(cmd))
        subprocess.check_call(cmd)
        return obj

    def _write_build_info(self, ext):
        target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "_build_info.json")
        keys = ("tensorflow_version", "cuda", "tensorflow_cuda_version", "cuda_kernels", "cuda_archs", "nvcc_version")
        info = {k: ext._tf_flags[k] for k in keys}
        with open(target, "w") as f:
            json.dump(info, f, indent=1)


def _extensions():
    exts = []
    op_sources = sorted(glob.glob(os.path.join("ops", "cc", "**", "*.cc"), recursive=True))
    if not _env_flag("TFSYNC_BUILD_OPS"):
        print(
            "tfsync: WARNING: TFSYNC_BUILD_OPS=0: the TensorFlow op library is NOT built; "
            "tfsync.ops works only with TFSYNC_OPS_IMPL=reference",
            file=sys.stderr,
        )
    elif op_sources:
        exts.append(TensorFlowOpExtension(OPS_EXT_NAME, sources=op_sources, include_dirs=["ops/cc"]))

    pyx = sorted(glob.glob(os.path.join("tfsync", "scheduler", "*.pyx")))
    if not _env_flag("TFSYNC_BUILD_SCHEDULER"):
        print(
            "tfsync: WARNING: TFSYNC_BUILD_SCHEDULER=0: the Cython scheduler is NOT built; "
            "tfsync.scheduler works only with TFSYNC_SCHEDULER_IMPL=reference",
            file=sys.stderr,
        )
    elif pyx:
        import numpy
        from Cython.Build import cythonize

        cy_exts = [
            Extension(
                "tfsync.scheduler." + os.path.splitext(os.path.basename(p))[0],
                [p],
                include_dirs=[numpy.get_include()],
                extra_compile_args=["-O3"],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            )
            for p in pyx
        ]
        exts.extend(
            cythonize(cy_exts, language_level=3, compiler_directives={"boundscheck": False, "wraparound": False})
        )
    return exts


setup(
    name="tfsync",
    version="0.1.0",
    description="Relaxed synchronization (BSP, SSP, ...) for Keras 3 / TensorFlow data-parallel training on Horovod",
    packages=find_packages(include=["tfsync", "tfsync.*"]),
    package_data={"tfsync.ops": ["*.so", "_build_info.json"], "tfsync.scheduler": ["*.pyx"]},
    # Keras >= 3.13 needs Python 3.11; verified on 3.11, 3.12 and 3.13 (docs/install.md)
    python_requires=">=3.11",
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Operating System :: POSIX :: Linux",
    ],
    # TensorFlow and Horovod are not listed: the op library and Horovod are compiled
    # against the TensorFlow already installed (CPU or GPU build), so they are installed
    # first and in that order by `make install` (see README).
    # Horovod's own runtime dependencies are here too: python -m tfsync.install_horovod (and make install)
    # installs Horovod with --no-deps, since its [tensorflow] extra would pull another TensorFlow.
    install_requires=[
        "keras>=3.12,<3.16",
        "protobuf>=6.31.1,<8",
        "numpy",
        "matplotlib",
        "grpcio",
        "cloudpickle",
        "psutil",
        "pyyaml",
        "packaging",
    ],
    ext_modules=_extensions(),
    entry_points={"console_scripts": ["tfsync-install-horovod = tfsync.install_horovod:main"]},
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
    zip_safe=False,
)
