// Pieces shared by tfsync's kernels: the accumulation type per element type, the
// bits that mark NaN and infinity, and (with GOOGLE_CUDA) what the TensorFlow glue of
// the GPU kernels needs to call the plain CUDA launchers of kernels/cuda/tfsync_cuda.h.
#ifndef TFSYNC_OPS_CC_KERNELS_TFSYNC_KERNELS_H_
#define TFSYNC_OPS_CC_KERNELS_TFSYNC_KERNELS_H_

#include <cstdint>

#include "tensorflow/core/framework/numeric_types.h"
#include "unsupported/Eigen/CXX11/Tensor"
#if GOOGLE_CUDA
#include "kernels/cuda/tfsync_cuda.h"
#include "tensorflow/core/platform/errors.h"
#endif

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
// TensorFlow's element types as the CUDA launchers take them: Eigen::half and
// Eigen::bfloat16 are binary16 and bfloat16 bits, as __half and __nv_bfloat16 are.
template <typename T>
struct CudaType {
  using type = T;
};
template <>
struct CudaType<Eigen::half> {
  using type = __half;
};
template <>
struct CudaType<Eigen::bfloat16> {
  using type = __nv_bfloat16;
};

// (__half and __nv_bfloat16 are only declared here: their bits are the same 16 as
// Eigen's types, which the kernels' own compile sees in full.)
template <typename T>
typename CudaType<T>::type* AsCuda(T* p) {
  return reinterpret_cast<typename CudaType<T>::type*>(p);
}
template <typename T>
const typename CudaType<T>::type* AsCuda(const T* p) {
  return reinterpret_cast<const typename CudaType<T>::type*>(p);
}

// What a launcher's error means for the op that launched it.
inline absl::Status CudaLaunchStatus(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return absl::OkStatus();
  return tensorflow::errors::Internal(
      op, ": its CUDA kernel did not launch: ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
      "). tfsync's kernels run on the GPU architectures and need the CUDA driver that "
      "tfsync/ops/_build_info.json records (cuda_archs, nvcc_version); rebuild tfsync with an nvcc "
      "that targets this GPU and that its driver supports (docs/install.md, \"GPU build\").");
}
#endif  // GOOGLE_CUDA

}  // namespace tfsync

#endif  // TFSYNC_OPS_CC_KERNELS_TFSYNC_KERNELS_H_
