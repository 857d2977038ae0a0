// Kernels for TfSync>AllFinite: whether every element of each tensor of a list is
// finite (no NaN, no infinity), one bool per tensor; and TfSync>ScaleAllFinite: the
// same answer from the pass that scales each tensor.
//
// What the sync engine checks a worker's gradients with before they go into a round
// (tfsync/engine/protocols.py): a gradient's contribution is the tensors the train
// step computed, which no other tfsync kernel reads, so this is the one pass over
// them. It only reads: each element's exponent bits are compared with the all-ones
// exponent that NaN and infinity share (FloatBits, tfsync_kernels.h), and the
// comparisons are OR-ed into an integer of the element's width. Integer OR is
// associative, so GCC vectorizes the loop (a float sum would have to keep its
// order), and no branch depends on the data. Large tensors are split over the intra-op threads as the other kernels are.
//
// ScaleAllFinite is what the engine divides a round's sum by its number of
// contributions with (tfsync/engine/exchange.py): the division Horovod's Average
// makes in its fusion buffer, in a pass that also reads each element's exponent, so
// the sum is checked without a pass of its own. It computes as Horovod's ScaleBuffer
// does (float32: the scale rounded to float32 times the element; half and bfloat16
// in float32), so a round scaled here equals one Horovod averaged. Large outputs
// reuse a released buffer of an earlier call (ReusableOutput): a round's result is
// the size of the model, and a fresh one would first be page-faulted in.
// On a GPU (GOOGLE_CUDA builds) both ops run the plain CUDA kernels of
// kernels/cuda/finite.cu on the op's stream: the flags are set to true once and each
// tensor's launch clears its own; the outputs are the inputs' buffers when TensorFlow
// can forward them (the GPU allocator hands out memory that is already mapped, so
// there is nothing to reuse buffers for).
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/cpu_parallel.h"
#include "kernels/tfsync_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tfsync {
namespace {

using ::tensorflow::DataTypeString;
using ::tensorflow::OpInputList;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

// True when no element of x[0, n) has every exponent bit set (FloatBits).
template <typename T>
bool NoneNonFinite(const typename FloatBits<T>::type* __restrict__ x, int64_t n) {
  using B = typename FloatBits<T>::type;
  constexpr B kExponent = FloatBits<T>::kExponent;
  B bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<B>((x[i] & kExponent) == kExponent);
  return bad == 0;
}

// Calls fn(T{}) with T the element type of dtype, one of the ops' four float types;
// false (fn not called) for any other.
template <typename Fn>
bool ForFloatType(tensorflow::DataType dtype, Fn&& fn) {
  switch (dtype) {
    case tensorflow::DT_HALF:
      fn(Eigen::half{});
      return true;
    case tensorflow::DT_BFLOAT16:
      fn(Eigen::bfloat16{});
      return true;
    case tensorflow::DT_FLOAT:
      fn(float{});
      return true;
    case tensorflow::DT_DOUBLE:
      fn(double{});
      return true;
    default:
      return false;
  }
}

// The error for tensors[i] of a type the ops do not take (their type constraint admits none).
absl::Status UnsupportedType(int i, const Tensor& t) {
  return errors::InvalidArgument("tensors[", i, "] must be float16, bfloat16, float32 or float64, got ",
                                 DataTypeString(t.dtype()));
}

template <typename T>
bool TensorFinite(OpKernelContext* ctx, const Tensor& t) {
  using B = typename FloatBits<T>::type;
  const B* x = reinterpret_cast<const B*>(t.tensor_data().data());
  std::atomic<bool> finite{true};
  ParallelElementwise(ctx, t.NumElements(), sizeof(B), [&](int64_t b, int64_t e) {
    if (!NoneNonFinite<T>(x + b, e - b)) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load(std::memory_order_relaxed);
}

class AllFiniteOp : public OpKernel {
 public:
  explicit AllFiniteOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({tensors.size()}), &out));
    auto finite = out->vec<bool>();
    for (int i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      const bool known = ForFloatType(t.dtype(), [&](auto tag) {
        finite(i) = TensorFinite<decltype(tag)>(ctx, t);
      });
      OP_REQUIRES(ctx, known, UnsupportedType(i, t));
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSync>AllFinite").Device(tensorflow::DEVICE_CPU), AllFiniteOp);

// out = scale * x over [0, n) (in Accumulator<T>, as Horovod's ScaleBuffer), and
// whether every element of x is finite, in one pass.
template <typename T>
bool ScaleFinite(const T* __restrict__ x, T* __restrict__ out, int64_t n,
                 typename Accumulator<T>::type scale) {
  using A = typename Accumulator<T>::type;
  using B = typename FloatBits<T>::type;
  constexpr B kExponent = FloatBits<T>::kExponent;
  const B* bits = reinterpret_cast<const B*>(x);
  B bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad |= static_cast<B>((bits[i] & kExponent) == kExponent);
    out[i] = static_cast<T>(scale * static_cast<A>(x[i]));
  }
  return bad == 0;
}

template <typename T>
bool ScaleTensor(OpKernelContext* ctx, const Tensor& in, Tensor* out, double scale) {
  using A = typename Accumulator<T>::type;
  const T* x = in.flat<T>().data();
  T* y = out->flat<T>().data();
  const A s = static_cast<A>(scale);
  std::atomic<bool> finite{true};
  ParallelElementwise(ctx, in.NumElements(), 2 * sizeof(T), [&](int64_t b, int64_t e) {
    if (!ScaleFinite<T>(x + b, y + b, e - b, s)) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load(std::memory_order_relaxed);
}

class ScaleAllFiniteOp : public OpKernel {
 public:
  // Two buffers per output: the previous round's result may still be held by the
  // optimizer step that applies it while the next one is scaled.
  static constexpr int kSlots = 2;

  explicit ScaleAllFiniteOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    const Tensor& scale_t = ctx->input(tensors.size());
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(scale_t.shape()),
                errors::InvalidArgument("scale must be a scalar, got shape ",
                                        scale_t.shape().DebugString()));
    const double scale = scale_t.scalar<double>()();
    OP_REQUIRES(ctx, std::isfinite(scale),
                errors::InvalidArgument("scale must be finite, got ", scale));
    {
      tensorflow::mutex_lock lock(mu_);
      while (static_cast<int>(outputs_.size()) < tensors.size()) {
        outputs_.push_back(std::make_unique<ReusableOutput>(kSlots));
      }
    }
    Tensor* finite_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(tensors.size(), TensorShape({tensors.size()}), &finite_out));
    auto finite = finite_out->vec<bool>();
    for (int i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, outputs_[i]->Allocate(ctx, i, t.shape(), t.dtype(), &out));
      const bool known = ForFloatType(t.dtype(), [&](auto tag) {
        finite(i) = ScaleTensor<decltype(tag)>(ctx, t, out, scale);
      });
      OP_REQUIRES(ctx, known, UnsupportedType(i, t));
    }
  }

 private:
  tensorflow::mutex mu_;
  std::vector<std::unique_ptr<ReusableOutput>> outputs_;  // one per output tensor, grown on first use
};

REGISTER_KERNEL_BUILDER(Name("TfSync>ScaleAllFinite").Device(tensorflow::DEVICE_CPU), ScaleAllFiniteOp);

#if GOOGLE_CUDA
using GPUDevice = Eigen::GpuDevice;

// The finite output (output `index`, one flag per tensor) in device memory, every flag
// set to true.
absl::Status FlagsOnDevice(OpKernelContext* ctx, int index, int count, bool** flags) {
  Tensor* out = nullptr;
  TF_RETURN_IF_ERROR(ctx->allocate_output(index, TensorShape({count}), &out));
  *flags = out->flat<bool>().data();
  return CudaLaunchStatus(cuda::SetFlags(*flags, count, ctx->eigen_device<GPUDevice>().stream()),
                          "setting the finite flags");
}

class AllFiniteGpuOp : public OpKernel {
 public:
  explicit AllFiniteGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    bool* finite = nullptr;
    OP_REQUIRES_OK(ctx, FlagsOnDevice(ctx, 0, tensors.size(), &finite));
    const auto stream = ctx->eigen_device<GPUDevice>().stream();
    for (int i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      cudaError_t err = cudaSuccess;
      const bool known = ForFloatType(t.dtype(), [&](auto tag) {
        using T = decltype(tag);
        err = cuda::AllFinite(AsCuda(t.flat<T>().data()), t.NumElements(), finite + i, stream);
      });
      OP_REQUIRES(ctx, known, UnsupportedType(i, t));
      OP_REQUIRES_OK(ctx, CudaLaunchStatus(err, "TfSync>AllFinite"));
    }
  }
};

class ScaleAllFiniteGpuOp : public OpKernel {
 public:
  explicit ScaleAllFiniteGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    OpInputList tensors;
    OP_REQUIRES_OK(ctx, ctx->input_list("tensors", &tensors));
    const Tensor& scale_t = ctx->input(tensors.size());
    OP_REQUIRES(ctx, tensorflow::TensorShapeUtils::IsScalar(scale_t.shape()),
                errors::InvalidArgument("scale must be a scalar, got shape ",
                                        scale_t.shape().DebugString()));
    const double scale = scale_t.scalar<double>()();
    OP_REQUIRES(ctx, std::isfinite(scale),
                errors::InvalidArgument("scale must be finite, got ", scale));
    bool* finite = nullptr;
    OP_REQUIRES_OK(ctx, FlagsOnDevice(ctx, tensors.size(), tensors.size(), &finite));
    const auto stream = ctx->eigen_device<GPUDevice>().stream();
    for (int i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i}, i, t.shape(), &out));
      cudaError_t err = cudaSuccess;
      const bool known = ForFloatType(t.dtype(), [&](auto tag) {
        using T = decltype(tag);
        err = cuda::ScaleAllFinite(AsCuda(t.flat<T>().data()), AsCuda(out->flat<T>().data()),
                                   t.NumElements(), scale, finite + i, stream);
      });
      OP_REQUIRES(ctx, known, UnsupportedType(i, t));
      OP_REQUIRES_OK(ctx, CudaLaunchStatus(err, "TfSync>ScaleAllFinite"));
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSync>AllFinite").Device(tensorflow::DEVICE_GPU), AllFiniteGpuOp);
// the scale is read on the host, to check it and pass it to the launch
REGISTER_KERNEL_BUILDER(Name("TfSync>ScaleAllFinite").Device(tensorflow::DEVICE_GPU).HostMemory("scale"),
                        ScaleAllFiniteGpuOp);
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tfsync
