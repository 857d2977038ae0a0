// The launchers of TfSync>DelayCompensate's and TfSync>DelayCompensateAdaptive's CUDA
// kernels (DC-ASGD's delay compensation; semantics and CPU kernels:
// ../delay_compensation_kernels.cc). Bodies and launch: elementwise.cuh.
#include "gpu_exec.cuh"
#include "tfsync_cuda.h"

namespace tfsync {
namespace cuda {

template <typename T>
cudaError_t DelayCompensate(const T* g, const T* w_now, const T* w_stale, float lambda, T* out,
                            int64_t n, cudaStream_t stream) {
  return detail::DelayCompensate(detail::GpuExec{stream}, g, w_now, w_stale, lambda, out, n);
}

template <typename T>
cudaError_t DelayCompensateAdaptive(typename Accumulator<T>::type* mean_square, const T* g,
                                    const T* w_now, const T* w_stale, float lambda0,
                                    float momentum, float epsilon, T* out, int64_t n,
                                    cudaStream_t stream) {
  return detail::DelayCompensateAdaptive(detail::GpuExec{stream}, mean_square, g, w_now, w_stale,
                                         lambda0, momentum, epsilon, out, n);
}

#define TFSYNC_INSTANTIATE(T)                                                                  \
  template cudaError_t DelayCompensate<T>(const T*, const T*, const T*, float, T*, int64_t,    \
                                          cudaStream_t);                                       \
  template cudaError_t DelayCompensateAdaptive<T>(typename Accumulator<T>::type*, const T*,    \
                                                  const T*, const T*, float, float, float, T*, \
                                                  int64_t, cudaStream_t);
TFSYNC_INSTANTIATE(__half)
TFSYNC_INSTANTIATE(__nv_bfloat16)
TFSYNC_INSTANTIATE(float)
TFSYNC_INSTANTIATE(double)
#undef TFSYNC_INSTANTIATE

}  // namespace cuda
}  // namespace tfsync
