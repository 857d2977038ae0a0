// Pieces shared by tfsync's CPU kernels (.cc) and CUDA kernels (.cu.cc): the
// accumulation type per element type, the staleness test, and the GPU launchers
// (declared here, defined in the .cu.cc files, compiled only with GOOGLE_CUDA).
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

// True when a contribution computed at `timestamp` may be applied at `step`.
// Callers have already rejected timestamp > step, so step - timestamp is in
// [0, 2^64) and the unsigned difference cannot overflow.
inline bool IsFresh(int64_t timestamp, int64_t step, int64_t max_staleness) {
  return static_cast<uint64_t>(step) - static_cast<uint64_t>(timestamp) <=
         static_cast<uint64_t>(max_staleness);
}

#if GOOGLE_CUDA
// The GPU kernels take the accepted rows as a bit mask passed by value, so the
// number of contributions per call is bounded on GPU (checked by the op).
constexpr int kMaxGpuContributions = 1024;
struct RowMask {
  uint64_t bits[kMaxGpuContributions / 64];
};

template <typename T>
struct GpuLaunch {
  // out = sum of the accepted rows, divided by `divisor` (d for a mean, else 1).
  static void PartialAggregate(const Eigen::GpuDevice& d, const T* contributions, int64_t k,
                               int64_t n, const RowMask& accepted, int64_t divisor, T* out);
  static void Zero(const Eigen::GpuDevice& d, T* out, int64_t n);
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
