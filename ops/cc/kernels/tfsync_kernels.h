// Pieces shared by tfsync's CPU kernels (.cc) and CUDA kernels (.cu.cc): the
// accumulation type per element type and the GPU launchers (declared here,
// defined in the .cu.cc files, compiled only with GOOGLE_CUDA).
#ifndef TFSYNC_OPS_CC_KERNELS_TFSYNC_KERNELS_H_
#define TFSYNC_OPS_CC_KERNELS_TFSYNC_KERNELS_H_

#include <cstdint>

#include "tensorflow/core/framework/numeric_types.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tfsync {

// half and bfloat16 are summed and multiplied in float: their 8- and 11-bit
// mantissas would otherwise lose most of a sum over many workers.
template <typename T>
struct Accumulator {
  using type = T;
};
template <>
struct Accumulator<Eigen::half> {
  using type = float;
};
template <>
struct Accumulator<Eigen::bfloat16> {
  using type = float;
};

#if GOOGLE_CUDA
template <typename T>
struct GpuLaunch {
  static void DelayCompensate(const Eigen::GpuDevice& d, const T* g, const T* w_now,
                              const T* w_stale, float lambda, T* out, int64_t n);
  static void DelayCompensateAdaptive(const Eigen::GpuDevice& d,
                                      typename Accumulator<T>::type* mean_square, const T* g,
                                      const T* w_now, const T* w_stale, float lambda0,
                                      float momentum, float epsilon, T* out, int64_t n);
};
#endif  // GOOGLE_CUDA

}  // namespace tfsync

#endif  // TFSYNC_OPS_CC_KERNELS_TFSYNC_KERNELS_H_
