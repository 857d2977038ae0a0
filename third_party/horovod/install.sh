#!/usr/bin/env bash
# Builds Horovod from its published source distribution against the installed TensorFlow,
# with the patch beside this script (what it changes and why: the patch's header), and
# installs it. Skipped when the installed Horovod was built by this script against the
# same TensorFlow version, with the same patch and the same kind of build; an upgraded
# TensorFlow rebuilds it.
#
# Which build (said before it starts):
#   NCCL       when the installed TensorFlow is built with CUDA (`tensorflow[and-cuda]`)
#              and nvcc is on the PATH: HOROVOD_GPU_OPERATIONS=NCCL, so collectives on
#              GPU tensors run on the GPUs, with NCCL's headers and library from the
#              nvidia-nccl-cu12 package `tensorflow[and-cuda]` installs (or from
#              HOROVOD_NCCL_HOME), CUDA kernels for the compute capabilities tfsync's
#              own kernels get (setup.py: 70, 80 and 90 where nvcc has them, or
#              TFSYNC_CUDA_ARCHS; HOROVOD_BUILD_CUDA_CC_LIST="80,90" overrides);
#   Gloo only  otherwise (TensorFlow copies GPU tensors to the host for collectives).
# TFSYNC_HOROVOD_NCCL=1 requires the NCCL build (and stops, saying what is missing, where
# it cannot be made); TFSYNC_HOROVOD_NCCL=0 makes the Gloo-only build anywhere.
#
# Usage: install.sh PYTHON HOROVOD_VERSION BUILD_DIR  (run from the repository root; the
# Makefile calls it). pip runs under constraints.txt like every pip call of `make install`.
set -euo pipefail
python=$1
version=$2
build_dir=$3
here=$(cd "$(dirname "$0")" && pwd)
patch_file="$here/horovod-$version-tf2.19.patch"
[ -f "$patch_file" ] || { echo "install.sh: no patch for Horovod $version at $patch_file" >&2; exit 2; }

tf_info=$("$python" -c "import tensorflow as tf; print(tf.__version__, int(tf.test.is_built_with_cuda()))" 2>/dev/null) || {
  echo "install.sh: TensorFlow does not import with $python; install requirements.txt first" >&2
  exit 2
}
tf_version=${tf_info% *}
tf_cuda=${tf_info#* }

# ---- which build ----
choice=${TFSYNC_HOROVOD_NCCL:-auto}
case "$choice" in
  auto | 0 | 1) ;;
  *) echo "install.sh: TFSYNC_HOROVOD_NCCL=$choice: expected 1 (NCCL build), 0 (Gloo only) or unset (decide)" >&2; exit 2 ;;
esac
nvcc=$(command -v nvcc || true)
if [ "$choice" = 0 ]; then
  gpu=none reason="TFSYNC_HOROVOD_NCCL=0"
elif [ "$tf_cuda" = 1 ] && [ -n "$nvcc" ]; then
  gpu=nccl reason="TensorFlow $tf_version is built with CUDA and nvcc is at $nvcc"
elif [ "$choice" = 1 ]; then
  missing=$([ "$tf_cuda" = 1 ] || echo "TensorFlow $tf_version is built without CUDA (install tensorflow[and-cuda], not tensorflow-cpu)")
  missing+=$([ -n "$nvcc" ] || echo "${missing:+; }nvcc is not on the PATH (install the CUDA toolkit)")
  echo "install.sh: TFSYNC_HOROVOD_NCCL=1 asks for Horovod's NCCL build, but $missing" >&2
  exit 2
else
  gpu=none reason=$([ "$tf_cuda" = 1 ] && echo "nvcc is not on the PATH" || echo "TensorFlow $tf_version is built without CUDA")
fi

build_env=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1
  HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2)
# ccache, where installed (make install installs it), keeps the compiled objects between builds,
# keyed by each file's preprocessed source, the compiler and its flags: a build after a change of
# the patch compiles only the files it changed (CMake reads these for Horovod's targets)
if command -v ccache >/dev/null; then
  build_env+=(CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
# a GPU setting left in the environment must not change the build decided here
unset_gpu=(-u HOROVOD_GPU_OPERATIONS -u HOROVOD_GPU_ALLREDUCE -u HOROVOD_GPU_ALLGATHER -u HOROVOD_GPU_BROADCAST
  -u HOROVOD_GPU_ALLTOALL -u HOROVOD_GPU_REDUCESCATTER -u HOROVOD_GPU)
kind="Gloo only ($reason)"
build="gloo"
if [ "$gpu" = nccl ]; then
  # NCCL: HOROVOD_NCCL_HOME if set, else the nvidia-nccl-cu12 package of this environment
  if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then
    nccl_include=$HOROVOD_NCCL_HOME/include nccl_lib=$HOROVOD_NCCL_HOME/lib
  else
    nccl_dir=$("$python" -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null || true)
    nccl_include=$nccl_dir/include nccl_lib=$nccl_dir/lib
  fi
  if [ ! -f "$nccl_include/nccl.h" ] || ! ls "$nccl_lib"/libnccl.so* >/dev/null 2>&1; then
    echo "install.sh: Horovod's NCCL build needs NCCL's nccl.h and libnccl.so, found neither in" \
      "${nccl_include%/include}: install nvidia-nccl-cu12 ($python -m pip install nvidia-nccl-cu12, as" \
      "tensorflow[and-cuda] does), or set HOROVOD_NCCL_HOME to an NCCL install, or TFSYNC_HOROVOD_NCCL=0" \
      "for a Gloo-only build" >&2
    exit 2
  fi
  nccl_version=$(sed -n 's/^#define NCCL_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$nccl_include/nccl.h" | paste -sd.)
  # the CUDA toolkit nvcc belongs to (nvcc may be a wrapper script elsewhere on the PATH)
  cuda_home=${HOROVOD_CUDA_HOME:-$(cd "$("$nvcc" --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p')/.." && pwd)}
  nvcc_release=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-}
  if [ -z "$cc_list" ] && [ -n "${TFSYNC_CUDA_ARCHS:-}" ]; then
    cc_list=$(echo "$TFSYNC_CUDA_ARCHS" | tr ';' ',' | tr -d ' ')
  elif [ -z "$cc_list" ]; then
    supported=$("$nvcc" --list-gpu-code)
    cc_list=$(for cc in 70 80 90; do if grep -qx "sm_$cc" <<<"$supported"; then echo "$cc"; fi; done | paste -sd,)
    [ -n "$cc_list" ] || { echo "install.sh: $nvcc targets none of sm_70, sm_80, sm_90; set HOROVOD_BUILD_CUDA_CC_LIST" >&2; exit 2; }
  fi
  kind="NCCL ($reason; NCCL $nccl_version from $nccl_lib; CUDA $nvcc_release at $cuda_home; compute capabilities $cc_list)"
  build="nccl $nccl_version, cuda $nvcc_release, cc $cc_list"
  # mpi_lib finds libnccl.so.2 through its run path, as TensorFlow's libraries find theirs
  build_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED "HOROVOD_NCCL_INCLUDE=$nccl_include"
    "HOROVOD_NCCL_LIB=$nccl_lib" "HOROVOD_CUDA_HOME=$cuda_home" "HOROVOD_BUILD_CUDA_CC_LIST=$cc_list"
    "LDFLAGS=${LDFLAGS:+$LDFLAGS }-Wl,-rpath,$nccl_lib")
fi

# what this build depends on: the Horovod version, the TensorFlow it compiles against, the
# patch and this script, the compiler, the kind of build (for NCCL: NCCL's and nvcc's versions
# and the compute capabilities); the interpreter is the environment's own. A build whose stamp
# says the same is reused, any other is rebuilt
cxx=${CXX:-g++}
cxx_version=$("$cxx" --version 2>/dev/null | head -1 || echo "$cxx: not found")
inputs=$(cat "$patch_file" "$here/install.sh" | sha256sum | cut -c1-16)
want="horovod $version, tensorflow $tf_version, inputs $inputs, $cxx_version, $build"

have=$("$python" - <<'PY' 2>/dev/null || true
import os
import horovod
import horovod.tensorflow  # noqa: F401  (loads the op library: fails when built against another TensorFlow)
stamp = os.path.join(os.path.dirname(horovod.__file__), "tfsync_build.txt")
print(open(stamp).read().strip() if os.path.exists(stamp) else "built elsewhere, horovod " + horovod.__version__)
PY
)
echo "Horovod: chose $kind"
if [ "$have" = "$want" ]; then
  echo "Horovod: installed ($have)"
  exit 0
fi
echo "Horovod: building ($want; installed: ${have:-none})"

src_root="$build_dir/horovod-src"
rm -rf "$src_root"
mkdir -p "$src_root"
"$python" -m pip download --no-deps --no-binary :all: -d "$src_root" "horovod==$version"
tar -xzf "$src_root/horovod-$version.tar.gz" -C "$src_root"
src="$src_root/horovod-$version"
patch -p1 -d "$src" < "$patch_file"

# TensorFlow only; no build isolation and no dependency resolution (Horovod's [tensorflow]
# extra would pull another TensorFlow than the one it compiles against)
env "${unset_gpu[@]}" "${build_env[@]}" \
  "$python" -m pip install -c constraints.txt --no-build-isolation --no-deps --no-cache-dir "$src"

"$python" - "$want" "$gpu" <<'PY'
import os
import sys

import horovod
import horovod.tensorflow  # noqa: F401
from horovod.tensorflow.mpi_ops import _basics

if sys.argv[2] == "nccl" and not _basics.nccl_built():
    sys.exit("install.sh: Horovod was built for NCCL but its library reports no NCCL (horovod_nccl_built() == 0); see the build log above")
with open(os.path.join(os.path.dirname(horovod.__file__), "tfsync_build.txt"), "w") as f:
    f.write(sys.argv[1] + "\n")
PY
rm -rf "$src_root"
echo "Horovod: built and installed ($want)"
