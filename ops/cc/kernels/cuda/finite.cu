// The launchers of TfSync>AllFinite's and TfSync>ScaleAllFinite's CUDA kernels
// (semantics and CPU kernels: ../finite_kernels.cc): one launch per tensor, each
// clearing its tensor's flag when one of its elements is NaN or infinite. Bodies and
// launch: elementwise.cuh.
#include "gpu_exec.cuh"
#include "tfsync_cuda.h"

namespace tfsync {
namespace cuda {

cudaError_t SetFlags(bool* flags, int64_t count, cudaStream_t stream) {
  static_assert(sizeof(bool) == 1, "flags are one byte each");
  if (count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  return cudaMemsetAsync(flags, 1, static_cast<size_t>(count), stream);
}

template <typename T>
cudaError_t AllFinite(const T* x, int64_t n, bool* finite, cudaStream_t stream) {
  return detail::AllFinite(detail::GpuExec{stream}, x, n, finite);
}

template <typename T>
cudaError_t ScaleAllFinite(const T* x, T* out, int64_t n, double scale, bool* finite,
                           cudaStream_t stream) {
  return detail::ScaleAllFinite(detail::GpuExec{stream}, x, out, n, scale, finite);
}

#define TFSYNC_INSTANTIATE(T)                                                          \
  template cudaError_t AllFinite<T>(const T*, int64_t, bool*, cudaStream_t);           \
  template cudaError_t ScaleAllFinite<T>(const T*, T*, int64_t, double, bool*, cudaStream_t);
TFSYNC_INSTANTIATE(__half)
TFSYNC_INSTANTIATE(__nv_bfloat16)
TFSYNC_INSTANTIATE(float)
TFSYNC_INSTANTIATE(double)
#undef TFSYNC_INSTANTIATE

}  // namespace cuda
}  // namespace tfsync
