// The GPU executor of elementwise.cuh's launches: each body becomes a __global__
// kernel of kThreads-thread blocks, launched on the caller's stream.
#ifndef TFSYNC_OPS_CC_KERNELS_CUDA_GPU_EXEC_CUH_
#define TFSYNC_OPS_CC_KERNELS_CUDA_GPU_EXEC_CUH_

#include "elementwise.cuh"

namespace tfsync {
namespace cuda {
namespace detail {

template <typename Op, typename... Args>
__global__ void Kernel(Args... args) {
  Op::Body(ThisThread(), args...);
}

// Clears *finite when a thread of the warp saw a NaN or an infinity: one store per such
// warp. Every thread of a block reaches the vote (blocks are whole warps, and nothing
// returns early).
template <typename Op, typename... Args>
__global__ void FlagKernel(bool* finite, Args... args) {
  const bool saw_one = !Op::Body(ThisThread(), args...);
  if (__any_sync(0xffffffffu, saw_one) && threadIdx.x % warpSize == 0) *finite = false;
}

struct GpuExec {
  cudaStream_t stream;

  template <typename Op, typename... Args>
  cudaError_t Run(unsigned blocks, Args... args) const {
    Kernel<Op, Args...><<<blocks, kThreads, 0, stream>>>(args...);
    return cudaGetLastError();
  }

  template <typename Op, typename... Args>
  cudaError_t RunFlag(unsigned blocks, bool* finite, Args... args) const {
    FlagKernel<Op, Args...><<<blocks, kThreads, 0, stream>>>(finite, args...);
    return cudaGetLastError();
  }
};

}  // namespace detail
}  // namespace cuda
}  // namespace tfsync

#endif  // TFSYNC_OPS_CC_KERNELS_CUDA_GPU_EXEC_CUH_
