// Kernels for TfSync>QuantizeBlocks, TfSync>DequantizeBlocks and TfSync>DequantizeSum:
// the int8 and 4-bit codes of Local SGD's and DiLoCo's quantized outer rounds
// (tfsync/engine/quantized.py).
//
// A row of `length` float32 values is cut into blocks of `block_size`; each block has
// one float32 scale, its largest magnitude over the largest code (127, or 7 for 4-bit
// codes), so the block's extreme value comes back to within a rounding, and each value the code
// nearest to value / scale (ties to even, as TensorFlow's round: the reference twin in
// tfsync/ops/_reference.py gives the same codes). A packed row is the codes (an int8
// each, or two 4-bit codes per byte, offset by 8, the even element in the low nibble),
// then the scales, little-endian. The quantizer also writes the residual (value minus
// what its code decodes to) when asked: error feedback adds it to the next contribution.
//
// DequantizeSum is a worker's share of the quantized reduce-scatter: the rows its peers
// sent it, decoded and summed in float32 in row order, times the round's scale, in one
// pass (no decoded copy of every row). Blocks (and, for the sum, blocks of the output)
// are split over TensorFlow's intra-op threads; each block is written by one thread.
// On a GPU (GOOGLE_CUDA builds) the same checks run and the plain CUDA kernels of
// kernels/cuda/quantize.cu fill the outputs on the op's stream.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu_parallel.h"
#include "kernels/tfsync_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tfsync {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

// What every op of this file reads from its attributes: the codes' width and the block.
struct Layout {
  int64_t bits = 8;
  int64_t block = 256;
  float qmax() const { return bits == 8 ? 127.0f : 7.0f; }
  int64_t code_bytes(int64_t length) const { return length * bits / 8; }
  int64_t row_bytes(int64_t length) const { return code_bytes(length) + 4 * (length / block); }
};

// The layout an op's attributes give; false (with the construction's status set) if bad.
bool ReadLayout(OpKernelConstruction* ctx, Layout* layout) {
  auto status = ctx->GetAttr("bits", &layout->bits);
  if (status.ok()) status = ctx->GetAttr("block_size", &layout->block);
  if (status.ok() && layout->bits != 8 && layout->bits != 4) {
    status = errors::InvalidArgument("bits must be 8 or 4, got ", layout->bits);
  }
  if (status.ok() && (layout->block < 2 || layout->block % 2)) {
    status = errors::InvalidArgument("block_size must be an even number >= 2, got ", layout->block);
  }
  if (!status.ok()) ctx->CtxFailure(status);
  return status.ok();
}

inline float Scale(const uint8_t* row, int64_t code_bytes, int64_t block) {
  float s;
  std::memcpy(&s, row + code_bytes + 4 * block, sizeof(s));
  return s;
}

// The code of element i of a block (of a row whose codes start at `codes`), as a float.
inline float Code(const uint8_t* codes, int64_t i, int64_t bits) {
  if (bits == 8) return static_cast<float>(static_cast<int8_t>(codes[i]));
  const uint8_t byte = codes[i >> 1];
  return static_cast<float>((i & 1) ? (byte >> 4) : (byte & 15)) - 8.0f;
}

// The checks and outputs of TfSync>QuantizeBlocks; Run fills them on the op's device.
class QuantizeBlocksOp : public OpKernel {
 public:
  explicit QuantizeBlocksOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (!ReadLayout(ctx, &layout_)) return;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("with_residual", &with_residual_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() == 2,
                errors::InvalidArgument("x must be a matrix [rows, length], got shape ", x.shape().DebugString()));
    const int64_t rows = x.dim_size(0), length = x.dim_size(1), block = layout_.block;
    OP_REQUIRES(ctx, length > 0 && length % block == 0,
                errors::InvalidArgument("the row length must be a positive multiple of block_size=", block,
                                        ", got ", length, "; pad each row with zeros to a whole number of blocks"));
    Tensor* packed = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rows, layout_.row_bytes(length)}), &packed));
    Tensor* residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, with_residual_ ? x.shape() : TensorShape({0}), &residual));
    Run(ctx, x.flat<float>().data(), rows, length, packed->flat<uint8_t>().data(),
        with_residual_ ? residual->flat<float>().data() : nullptr);
  }

 protected:
  virtual void Run(OpKernelContext* ctx, const float* in, int64_t rows, int64_t length, uint8_t* out, float* rest) {
    const int64_t block = layout_.block, blocks_per_row = length / block, row_bytes = layout_.row_bytes(length);
    const int64_t code_bytes = layout_.code_bytes(length), bits = layout_.bits;
    const float qmax = layout_.qmax();
    ParallelElementwise(ctx, rows * blocks_per_row, block * 4, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t r = b / blocks_per_row, k = b % blocks_per_row;
        const float* v = in + r * length + k * block;
        float amax = 0.0f;
        for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float scale = amax / qmax;
        const float safe = scale > 0.0f ? scale : 1.0f;
        uint8_t* row = out + r * row_bytes;
        std::memcpy(row + code_bytes + 4 * k, &scale, sizeof(scale));
        uint8_t* codes = row + k * block * bits / 8;
        float* e = rest == nullptr ? nullptr : rest + r * length + k * block;
        for (int64_t i = 0; i < block; ++i) {
          const float q = std::min(std::max(std::nearbyint(v[i] / safe), -qmax), qmax);
          if (bits == 8) {
            codes[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
          } else if (i & 1) {
            codes[i >> 1] |= static_cast<uint8_t>(static_cast<int>(q) + 8) << 4;
          } else {
            codes[i >> 1] = static_cast<uint8_t>(static_cast<int>(q) + 8);
          }
          if (e != nullptr) e[i] = v[i] - q * scale;
        }
      }
    });
  }

  Layout layout_;
  bool with_residual_ = false;
};

// Shared by both decoders: the packed input checked against `length`.
class DequantizeOp : public OpKernel {
 public:
  explicit DequantizeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (!ReadLayout(ctx, &layout_)) return;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("length", &length_));
    OP_REQUIRES(ctx, length_ > 0 && length_ % layout_.block == 0,
                errors::InvalidArgument("length must be a positive multiple of block_size=", layout_.block,
                                        ", got ", length_));
  }

 protected:
  bool CheckPacked(OpKernelContext* ctx, const Tensor& packed) {
    const int64_t want = layout_.row_bytes(length_);
    if (packed.dims() == 2 && packed.dim_size(1) == want) return true;
    ctx->CtxFailure(errors::InvalidArgument("packed must have rows of ", want, " bytes (", length_, " values at ",
                                            layout_.bits, " bits in blocks of ", layout_.block, "), got shape ",
                                            packed.shape().DebugString()));
    return false;
  }

  Layout layout_;
  int64_t length_ = 0;
};

class DequantizeBlocksOp : public DequantizeOp {
 public:
  using DequantizeOp::DequantizeOp;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    if (!CheckPacked(ctx, packed)) return;
    Tensor* values = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({packed.dim_size(0), length_}), &values));
    Run(ctx, packed.flat<uint8_t>().data(), packed.dim_size(0), values->flat<float>().data());
  }

 protected:
  virtual void Run(OpKernelContext* ctx, const uint8_t* in, int64_t rows, float* out) {
    const int64_t length = length_, block = layout_.block, bits = layout_.bits;
    const int64_t blocks_per_row = length / block, row_bytes = layout_.row_bytes(length);
    const int64_t code_bytes = layout_.code_bytes(length);
    ParallelElementwise(ctx, rows * blocks_per_row, block * 4, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t r = b / blocks_per_row, k = b % blocks_per_row;
        const uint8_t* row = in + r * row_bytes;
        const float scale = Scale(row, code_bytes, k);
        const uint8_t* codes = row + k * block * bits / 8;
        float* v = out + r * length + k * block;
        for (int64_t i = 0; i < block; ++i) v[i] = Code(codes, i, bits) * scale;
      }
    });
  }
};

class DequantizeSumOp : public DequantizeOp {
 public:
  using DequantizeOp::DequantizeOp;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& packed = ctx->input(0);
    if (!CheckPacked(ctx, packed)) return;
    const Tensor& scale_t = ctx->input(1);
    OP_REQUIRES(ctx, scale_t.dims() == 0,
                errors::InvalidArgument("scale must be a scalar, got shape ", scale_t.shape().DebugString()));
    const float factor = scale_t.scalar<float>()();
    OP_REQUIRES(ctx, std::isfinite(factor), errors::InvalidArgument("scale must be finite, got ", factor));
    Tensor* total = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({length_}), &total));
    Run(ctx, packed.flat<uint8_t>().data(), packed.dim_size(0), factor, total->flat<float>().data());
  }

 protected:
  virtual void Run(OpKernelContext* ctx, const uint8_t* in, int64_t rows, float factor, float* out) {
    const int64_t length = length_, block = layout_.block, bits = layout_.bits;
    const int64_t row_bytes = layout_.row_bytes(length), code_bytes = layout_.code_bytes(length);
    ParallelElementwise(ctx, length / block, block * 4 * std::max<int64_t>(rows, 1), [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) {
        float* t = out + k * block;
        std::fill(t, t + block, 0.0f);
        for (int64_t r = 0; r < rows; ++r) {  // (in row order, as the reference sums)
          const uint8_t* row = in + r * row_bytes;
          const float scale = Scale(row, code_bytes, k);
          const uint8_t* codes = row + k * block * bits / 8;
          for (int64_t i = 0; i < block; ++i) t[i] += Code(codes, i, bits) * scale;
        }
        for (int64_t i = 0; i < block; ++i) t[i] *= factor;
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSync>QuantizeBlocks").Device(tensorflow::DEVICE_CPU), QuantizeBlocksOp);
REGISTER_KERNEL_BUILDER(Name("TfSync>DequantizeBlocks").Device(tensorflow::DEVICE_CPU), DequantizeBlocksOp);
REGISTER_KERNEL_BUILDER(Name("TfSync>DequantizeSum").Device(tensorflow::DEVICE_CPU), DequantizeSumOp);

#if GOOGLE_CUDA
// The GPU kernels: the same checks and outputs, the plain CUDA launchers of
// kernels/cuda/quantize.cu on the op's stream.
using GPUDevice = Eigen::GpuDevice;

class QuantizeBlocksGpuOp : public QuantizeBlocksOp {
 public:
  using QuantizeBlocksOp::QuantizeBlocksOp;

 protected:
  void Run(OpKernelContext* ctx, const float* in, int64_t rows, int64_t length, uint8_t* out, float* rest) override {
    const auto stream = ctx->eigen_device<GPUDevice>().stream();
    OP_REQUIRES_OK(ctx, CudaLaunchStatus(cuda::QuantizeBlocks(in, rows, length, static_cast<int>(layout_.bits),
                                                              layout_.block, out, rest, stream),
                                         "TfSync>QuantizeBlocks"));
  }
};

class DequantizeBlocksGpuOp : public DequantizeBlocksOp {
 public:
  using DequantizeBlocksOp::DequantizeBlocksOp;

 protected:
  void Run(OpKernelContext* ctx, const uint8_t* in, int64_t rows, float* out) override {
    const auto stream = ctx->eigen_device<GPUDevice>().stream();
    OP_REQUIRES_OK(ctx, CudaLaunchStatus(cuda::DequantizeBlocks(in, rows, length_, static_cast<int>(layout_.bits),
                                                                layout_.block, out, stream),
                                         "TfSync>DequantizeBlocks"));
  }
};

class DequantizeSumGpuOp : public DequantizeSumOp {
 public:
  using DequantizeSumOp::DequantizeSumOp;

 protected:
  void Run(OpKernelContext* ctx, const uint8_t* in, int64_t rows, float factor, float* out) override {
    const auto stream = ctx->eigen_device<GPUDevice>().stream();
    OP_REQUIRES_OK(ctx, CudaLaunchStatus(cuda::DequantizeSum(in, rows, length_, static_cast<int>(layout_.bits),
                                                             layout_.block, factor, out, stream),
                                         "TfSync>DequantizeSum"));
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSync>QuantizeBlocks").Device(tensorflow::DEVICE_GPU), QuantizeBlocksGpuOp);
REGISTER_KERNEL_BUILDER(Name("TfSync>DequantizeBlocks").Device(tensorflow::DEVICE_GPU), DequantizeBlocksGpuOp);
// the scale is read on the host, to check it and pass it to the launch
REGISTER_KERNEL_BUILDER(Name("TfSync>DequantizeSum").Device(tensorflow::DEVICE_GPU).HostMemory("scale"),
                        DequantizeSumGpuOp);
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tfsync
