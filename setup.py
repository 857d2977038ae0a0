"""Builds tfsync: the TensorFlow op library from ``ops/`` and the Cython scheduler.

The op library is compiled against the *installed* TensorFlow (flags from
``tf.sysconfig``, read in exactly one place: :func:`_tensorflow_build_flags`),
so install with ``pip install --no-build-isolation .`` after TensorFlow.  The
TensorFlow version used at build time is written next to the library and
checked by the loader (``tfsync/ops/_loader.py``).

CUDA kernels (``ops/cc/kernels/*.cu.cc``) are compiled only when the installed
TensorFlow was built with CUDA *and* ``nvcc`` is on the PATH.

Skipping a compiled part is opt-in and loud: ``TFSYNC_BUILD_OPS=0`` skips the op
library, ``TFSYNC_BUILD_SCHEDULER=0`` the Cython scheduler.  A compiler error is
never swallowed.
"""

import glob
import json
import os
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
OPS_EXT_NAME = "tfsync.ops._tfsync_ops"


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
            f"which failed to import ({exc}). Install tensorflow-cpu==2.18.1 first, "
            "then `pip install --no-build-isolation .` (or run `make install`)."
        ) from exc
    return {
        "compile_flags": list(tf.sysconfig.get_compile_flags()),
        "link_flags": list(tf.sysconfig.get_link_flags()),
        "tensorflow_version": tf.__version__,
        "cuda": bool(tf.test.is_built_with_cuda()),
    }


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
        cuda_sources = sorted(glob.glob(os.path.join("ops", "cc", "kernels", "*.cu.cc")))
        nvcc = shutil.which("nvcc")
        if flags["cuda"] and nvcc and cuda_sources:
            ext.define_macros = list(ext.define_macros or []) + [("GOOGLE_CUDA", "1")]
            ext.extra_objects = list(ext.extra_objects or []) + [self._nvcc(nvcc, src, flags) for src in cuda_sources]
            ext._tf_flags["cuda_kernels"] = True
        else:
            ext._tf_flags["cuda_kernels"] = False
            reason = "TensorFlow was built without CUDA" if not flags["cuda"] else "nvcc not found"
            if cuda_sources:
                print(f"tfsync: building CPU kernels only ({reason})")

    def _nvcc(self, nvcc, src, flags):
        obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
        os.makedirs(self.build_temp, exist_ok=True)
        cmd = [
            nvcc,
            "-std=c++17",
            "-c",
            src,
            "-o",
            obj,
            "-DGOOGLE_CUDA=1",
            "-x",
            "cu",
            "-Xcompiler",
            "-fPIC",
            "--expt-relaxed-constexpr",
        ] + [f for f in flags["compile_flags"] if f.startswith(("-I", "-D"))]
        print(" ".join(cmd))
        subprocess.check_call(cmd)
        return obj

    def _write_build_info(self, ext):
        target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "_build_info.json")
        info = {k: ext._tf_flags[k] for k in ("tensorflow_version", "cuda", "cuda_kernels")}
        with open(target, "w") as f:
            json.dump(info, f, indent=1)


def _extensions():
    exts = []
    op_sources = sorted(glob.glob(os.path.join("ops", "cc", "**", "*.cc"), recursive=True))
    op_sources = [s for s in op_sources if not s.endswith(".cu.cc")]
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
    python_requires=">=3.10",
    # TensorFlow and Horovod are not listed: the op library and Horovod are compiled
    # against the TensorFlow already installed (CPU or GPU build), so they are installed
    # first and in that order by `make install` (see README).
    install_requires=["keras>=3.6,<3.16", "protobuf<6", "numpy", "matplotlib", "grpcio"],
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
