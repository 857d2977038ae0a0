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

// The bits of an element type and its exponent field: every exponent bit set is
// NaN or infinity, in IEEE binary16/32/64 and bfloat16 alike. Finiteness is tested
// on the bits (an integer AND and compare, then OR-ed into a flag) so that a loop
// testing it has no branch and no order-bound float reduction, and still vectorizes.
template <typename T>
struct FloatBits;
template <>
struct FloatBits<Eigen::half> {
  using type = uint16_t;
  static constexpr type kExponent = 0x7c00u;
};
template <>
struct FloatBits<Eigen::bfloat16> {
  using type = uint16_t;
  static constexpr type kExponent = 0x7f80u;
};
template <>
struct FloatBits<float> {
  using type = uint32_t;
  static constexpr type kExponent = 0x7f800000u;
};
template <>
struct FloatBits<double> {
  using type = uint64_t;
  static constexpr type kExponent = 0x7ff0000000000000ull;
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
