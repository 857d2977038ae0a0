#!/usr/bin/env bash
# Builds ops/cuda_test/kernel_test with nvcc alone (no TensorFlow) and runs it: on the
# GPU where `nvidia-smi` lists one, and says it skipped the GPU run (exit 0) where none
# is. Without a GPU it still builds the program (when nvcc is here) and runs the kernels'
# bodies on the CPU over the GPU launches' grids (`kernel_test --host`).
#
# Usage: ops/cuda_test/run.sh [kernel_test arguments...]   (`make cuda-test` runs it)
# Environment: NVCC (default: nvcc on the PATH), CUDA_TEST_BUILD_DIR (default:
# build/cuda_test; a program there built from the same inputs is reused), CUDA_TEST_ARCH (default: native on a GPU, else sm_80 and sm_90
# with PTX), CUDA_TEST_TIMEOUT_S (bound on each build and run, default 900).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build_dir=${CUDA_TEST_BUILD_DIR:-$root/build/cuda_test}
timeout_s=${CUDA_TEST_TIMEOUT_S:-900}
nvcc=${NVCC:-$(command -v nvcc || true)}

gpu=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu=$(timeout 60 nvidia-smi -L 2>/dev/null | grep -m1 '^GPU ' || true)
fi

if [ -z "$nvcc" ]; then
  if [ -z "$gpu" ]; then
    echo "cuda-test: SKIPPED: no GPU (nvidia-smi lists none) and no nvcc: nothing to build or run"
    exit 0
  fi
  echo "cuda-test: a GPU is here ($gpu) but nvcc is not on the PATH; install the CUDA toolkit or set NVCC" >&2
  exit 2
fi

if [ -n "$gpu" ]; then
  arch=(-arch="${CUDA_TEST_ARCH:-native}")
elif [ -n "${CUDA_TEST_ARCH:-}" ]; then
  arch=(-arch="$CUDA_TEST_ARCH")
else
  arch=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=[sm_90,compute_90])
fi

mkdir -p "$build_dir"
binary=$build_dir/kernel_test
# -ffp-contract=off: the CPU reference and the emulated grid must not fuse a multiply-add
# (the kernels do not: they use the _rn intrinsics); -fno-strict-aliasing: the emulated
# grid reads the host buffers through the kernels' 16-byte packs, as the GPU does.
flags=(-std=c++17 -O2 "${arch[@]}" -Xcompiler -ffp-contract=off -Xcompiler -fno-strict-aliasing)
sources=("$here/kernel_test.cu" "$root"/ops/cc/kernels/cuda/*.cu)
# a program built from the same sources, headers, script, flags and nvcc is reused
inputs=$( (cat "$0" "${sources[@]}" "$root"/ops/cc/kernels/cuda/*.h* "$here"/*.h* 2>/dev/null; "$nvcc" --version; echo "${flags[*]}") |
  sha256sum | cut -c1-16)
if [ -x "$binary" ] && [ "$(cat "$binary.inputs" 2>/dev/null)" = "$inputs" ]; then
  echo "cuda-test: reusing $binary (built from the same inputs, $inputs)"
else
  echo "cuda-test: building $binary with $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*'))"
  rm -f "$binary.inputs"
  timeout "$timeout_s" "$nvcc" "${flags[@]}" -o "$binary" "${sources[@]}"
  echo "$inputs" >"$binary.inputs"
fi

if [ -z "$gpu" ]; then
  timeout "$timeout_s" "$binary" --host "$@"
  echo "cuda-test: SKIPPED the GPU run: no GPU here (nvidia-smi lists none); built $binary and checked the kernels' bodies on the CPU"
  exit 0
fi
echo "cuda-test: running on $gpu"
timeout "$timeout_s" "$binary" "$@"
