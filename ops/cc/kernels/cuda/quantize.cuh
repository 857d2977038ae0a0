// The bodies of the block-quantization kernels (TfSync>QuantizeBlocks, DequantizeBlocks,
// DequantizeSum; semantics and CPU kernels: ../quantize_kernels.cc) and their launch, as
// __host__ __device__ code templated on an executor, as elementwise.cuh's: the GPU's
// (gpu_exec.cuh) or the standalone test program's, which runs them on the CPU over the
// very grid the GPU launch uses.
//
// Quantizing: one thread per block of `block` values (the block's largest magnitude and
// then its codes, both from the thread's own reads); decoding and the sum: one thread per
// value (grid-stride), reading its block's scale and its code. The arithmetic is the CPU
// kernel's, operation for operation, each rounded to nearest (no fused multiply-add), so
// the bytes and the values are the CPU kernel's and the TensorFlow twin's.
#ifndef TFSYNC_OPS_CC_KERNELS_CUDA_QUANTIZE_CUH_
#define TFSYNC_OPS_CC_KERNELS_CUDA_QUANTIZE_CUH_

#include "elementwise.cuh"

namespace tfsync {
namespace cuda {
namespace detail {

struct QuantizeLayout {
  int64_t rows, length, block;
  int bits;
  TFSYNC_HD float Qmax() const { return bits == 8 ? 127.0f : 7.0f; }
  TFSYNC_HD int64_t CodeBytes() const { return length * bits / 8; }
  TFSYNC_HD int64_t RowBytes() const { return CodeBytes() + 4 * (length / block); }
};

TFSYNC_HD float Abs(float x) {
#ifdef __CUDA_ARCH__
  return fabsf(x);
#else
  return std::fabs(x);
#endif
}

// To the nearest integer, ties to even (the CPU kernel's std::nearbyint, TensorFlow's round).
TFSYNC_HD float RoundEven(float x) {
#ifdef __CUDA_ARCH__
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

TFSYNC_HD float BlockScale(const uint8_t* row, const QuantizeLayout& l, int64_t k) {
  float s;
  memcpy(&s, row + l.CodeBytes() + 4 * k, sizeof(s));
  return s;
}

TFSYNC_HD float CodeAt(const uint8_t* codes, int64_t i, int bits) {
  if (bits == 8) return static_cast<float>(static_cast<int8_t>(codes[i]));
  const uint8_t byte = codes[i >> 1];
  return static_cast<float>((i & 1) ? (byte >> 4) : (byte & 15)) - 8.0f;
}

TFSYNC_HD void QuantizeBody(Grid grid, const float* x, QuantizeLayout l, uint8_t* packed, float* residual) {
  const int64_t per_row = l.length / l.block, blocks = l.rows * per_row;
  const float qmax = l.Qmax();
  for (int64_t b = grid.first; b < blocks; b += grid.stride) {
    const int64_t r = b / per_row, k = b % per_row;
    const float* v = x + r * l.length + k * l.block;
    float amax = 0.0f;
    for (int64_t i = 0; i < l.block; ++i) amax = amax < Abs(v[i]) ? Abs(v[i]) : amax;
    const float scale = Div(amax, qmax);
    const float safe = scale > 0.0f ? scale : 1.0f;
    uint8_t* row = packed + r * l.RowBytes();
    memcpy(row + l.CodeBytes() + 4 * k, &scale, sizeof(scale));
    uint8_t* codes = row + k * l.block * l.bits / 8;
    float* e = residual == nullptr ? nullptr : residual + r * l.length + k * l.block;
    for (int64_t i = 0; i < l.block; ++i) {
      float q = RoundEven(Div(v[i], safe));
      q = q < -qmax ? -qmax : (q > qmax ? qmax : q);
      if (l.bits == 8) {
        codes[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else if (i & 1) {
        codes[i >> 1] |= static_cast<uint8_t>((static_cast<int>(q) + 8) << 4);
      } else {
        codes[i >> 1] = static_cast<uint8_t>(static_cast<int>(q) + 8);
      }
      if (e != nullptr) e[i] = Sub(v[i], Mul(q, scale));
    }
  }
}

TFSYNC_HD void DequantizeBody(Grid grid, const uint8_t* packed, QuantizeLayout l, float* out) {
  const int64_t n = l.rows * l.length;
  for (int64_t e = grid.first; e < n; e += grid.stride) {
    const int64_t r = e / l.length, i = e % l.length, k = i / l.block;
    const uint8_t* row = packed + r * l.RowBytes();
    out[e] = Mul(CodeAt(row + k * l.block * l.bits / 8, i % l.block, l.bits), BlockScale(row, l, k));
  }
}

TFSYNC_HD void DequantizeSumBody(Grid grid, const uint8_t* packed, QuantizeLayout l, float factor, float* out) {
  for (int64_t i = grid.first; i < l.length; i += grid.stride) {
    const int64_t k = i / l.block;
    float total = 0.0f;
    for (int64_t r = 0; r < l.rows; ++r) {  // (in row order, as the CPU kernel sums)
      const uint8_t* row = packed + r * l.RowBytes();
      total = Add(total, Mul(CodeAt(row + k * l.block * l.bits / 8, i % l.block, l.bits), BlockScale(row, l, k)));
    }
    out[i] = Mul(total, factor);
  }
}

struct QuantizeBlocksKernel {
  template <typename... Args>
  TFSYNC_HD static void Body(Grid grid, Args... args) {
    QuantizeBody(grid, args...);
  }
};
struct DequantizeBlocksKernel {
  template <typename... Args>
  TFSYNC_HD static void Body(Grid grid, Args... args) {
    DequantizeBody(grid, args...);
  }
};
struct DequantizeSumKernel {
  template <typename... Args>
  TFSYNC_HD static void Body(Grid grid, Args... args) {
    DequantizeSumBody(grid, args...);
  }
};

inline bool ValidLayout(const QuantizeLayout& l) {
  return l.rows >= 0 && l.length > 0 && l.block >= 2 && l.block % 2 == 0 && l.length % l.block == 0 &&
         (l.bits == 8 || l.bits == 4);
}

template <typename Exec>
cudaError_t QuantizeBlocks(const Exec& exec, const float* x, QuantizeLayout l, uint8_t* packed, float* residual) {
  if (!ValidLayout(l)) return cudaErrorInvalidValue;
  const int64_t blocks = l.rows * (l.length / l.block);
  if (blocks == 0) return cudaSuccess;
  return exec.template Run<QuantizeBlocksKernel>(Blocks(blocks, 1), x, l, packed, residual);
}

template <typename Exec>
cudaError_t DequantizeBlocks(const Exec& exec, const uint8_t* packed, QuantizeLayout l, float* out) {
  if (!ValidLayout(l)) return cudaErrorInvalidValue;
  if (l.rows == 0) return cudaSuccess;
  return exec.template Run<DequantizeBlocksKernel>(Blocks(l.rows * l.length, 1), packed, l, out);
}

template <typename Exec>
cudaError_t DequantizeSum(const Exec& exec, const uint8_t* packed, QuantizeLayout l, float factor, float* out) {
  if (!ValidLayout(l)) return cudaErrorInvalidValue;
  return exec.template Run<DequantizeSumKernel>(Blocks(l.length, 1), packed, l, factor, out);
}

}  // namespace detail
}  // namespace cuda
}  // namespace tfsync

#endif  // TFSYNC_OPS_CC_KERNELS_CUDA_QUANTIZE_CUH_
