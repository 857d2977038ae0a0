// The launchers of the block-quantization kernels (semantics and CPU kernels:
// ../quantize_kernels.cc). Bodies and launch: quantize.cuh.
#include "gpu_exec.cuh"
#include "quantize.cuh"
#include "tfsync_cuda.h"

namespace tfsync {
namespace cuda {

cudaError_t QuantizeBlocks(const float* x, int64_t rows, int64_t length, int bits, int64_t block, uint8_t* packed,
                           float* residual, cudaStream_t stream) {
  return detail::QuantizeBlocks(detail::GpuExec{stream}, x, detail::QuantizeLayout{rows, length, block, bits},
                                packed, residual);
}

cudaError_t DequantizeBlocks(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block,
                             float* out, cudaStream_t stream) {
  return detail::DequantizeBlocks(detail::GpuExec{stream}, packed,
                                  detail::QuantizeLayout{rows, length, block, bits}, out);
}

cudaError_t DequantizeSum(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block, float factor,
                          float* out, cudaStream_t stream) {
  return detail::DequantizeSum(detail::GpuExec{stream}, packed, detail::QuantizeLayout{rows, length, block, bits},
                               factor, out);
}

}  // namespace cuda
}  // namespace tfsync
