// tfsync's CUDA kernels as plain CUDA: device pointers, an element count and a
// stream, nothing of TensorFlow. The op library's GPU kernels (the OpKernels in
// ops/cc/kernels/*.cc under GOOGLE_CUDA) call these launchers with the stream
// TensorFlow gives them; the standalone test program (ops/cuda_test/) calls them
// with its own, against a CPU reference, on a machine that has a GPU but no
// TensorFlow.
//
// Each launcher enqueues its work on `stream` and returns at once: the launch's
// error (cudaSuccess when it was enqueued), never the kernel's outcome, which the
// stream reports later. n == 0 enqueues nothing. Every pointer is device memory.
// The formulas are the CPU kernels' (delay_compensation_kernels.cc,
// finite_kernels.cc): the same operations in the same order, each rounded as IEEE
// prescribes (no fused multiply-add, no fast math), and __half / __nv_bfloat16
// computed in float and rounded to nearest even once per stored value.
// The elementwise launchers are instantiated for __half, __nv_bfloat16, float and double.
#ifndef TFSYNC_OPS_CC_KERNELS_CUDA_TFSYNC_CUDA_H_
#define TFSYNC_OPS_CC_KERNELS_CUDA_TFSYNC_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

// The 16-bit element types of cuda_fp16.h and cuda_bf16.h, declared only: callers pass
// pointers, and the host compile of TensorFlow's glue then needs no more of CUDA's
// headers than cuda_runtime_api.h (TensorFlow's GPU wheel ships cuda_fp16.h without the
// libcu++ headers it includes on the path).
struct __half;
struct __nv_bfloat16;

namespace tfsync {
namespace cuda {

// The type an element is computed in: float for the 16-bit types.
template <typename T>
struct Accumulator {
  using type = T;
};
template <>
struct Accumulator<__half> {
  using type = float;
};
template <>
struct Accumulator<__nv_bfloat16> {
  using type = float;
};

// DC-ASGD-c: out = g + lambda * g * g * (w_now - w_stale). out may be g (in place).
template <typename T>
cudaError_t DelayCompensate(const T* g, const T* w_now, const T* w_stale, float lambda, T* out,
                            int64_t n, cudaStream_t stream);

// DC-ASGD-a, in one pass: v = momentum * v + (1 - momentum) * g * g (mean_square, in
// place, in the accumulation type), then out = g + lambda0 / sqrt(v + epsilon) * g * g *
// (w_now - w_stale). out may be g.
template <typename T>
cudaError_t DelayCompensateAdaptive(typename Accumulator<T>::type* mean_square, const T* g,
                                    const T* w_now, const T* w_stale, float lambda0,
                                    float momentum, float epsilon, T* out, int64_t n,
                                    cudaStream_t stream);

// Sets flags[0, count) to true: what AllFinite and ScaleAllFinite expect of their flag.
cudaError_t SetFlags(bool* flags, int64_t count, cudaStream_t stream);

// Sets *finite to false when an element of x[0, n) is NaN or infinite (every exponent bit
// set), and leaves it as it is otherwise: set it to true first (SetFlags), once for a
// whole list of tensors, each with its own flag.
template <typename T>
cudaError_t AllFinite(const T* x, int64_t n, bool* finite, cudaStream_t stream);

// out = scale * x, with scale rounded to the accumulation type first (as Horovod's
// ScaleBuffer), and *finite set to false when an element of x is NaN or infinite, from
// the same pass (set it to true first, as for AllFinite). out may be x.
template <typename T>
cudaError_t ScaleAllFinite(const T* x, T* out, int64_t n, double scale, bool* finite,
                           cudaStream_t stream);

// Block quantization (the float32 only ops; ../quantize_kernels.cc): x is `rows` rows of
// `length` values (length a multiple of `block`, an even number; bits 8 or 4); packed is
// rows of length * bits / 8 code bytes then length / block float32 scales. residual (may
// be null) gets x minus what the codes decode to.
cudaError_t QuantizeBlocks(const float* x, int64_t rows, int64_t length, int bits, int64_t block, uint8_t* packed,
                           float* residual, cudaStream_t stream);
// out (rows x length) = what each packed row stands for.
cudaError_t DequantizeBlocks(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block,
                             float* out, cudaStream_t stream);
// out (length) = factor * the sum over the rows, in row order, of what they stand for.
cudaError_t DequantizeSum(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block, float factor,
                          float* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace tfsync

#endif  // TFSYNC_OPS_CC_KERNELS_CUDA_TFSYNC_CUDA_H_
