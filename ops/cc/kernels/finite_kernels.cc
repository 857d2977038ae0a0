// Kernel for TfSync>AllFinite: whether every element of each tensor of a list is
// finite (no NaN, no infinity), one bool per tensor.
//
// What the sync engine checks a worker's gradients with before they go into a round
// (tfsync/engine/protocols.py): a gradient's contribution is the tensors the train
// step computed, which no other tfsync kernel reads, so this is the one pass over
// them. It only reads: each element's exponent bits are compared with the all-ones
// exponent that NaN and infinity share (FloatBits, tfsync_kernels.h), and the
// comparisons are OR-ed into an integer of the element's width. Integer OR is
// associative, so GCC vectorizes the loop (a float sum would have to keep its
// order), and no branch depends on the data. Large tensors are split over the intra-op threads as the other kernels are.
// CPU only: on a GPU the reference's TensorFlow ops run on the device instead
// (tfsync.ops chooses by the tensors' device).
#define EIGEN_USE_THREADS

#include <atomic>
#include <cstdint>

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
      switch (t.dtype()) {
        case tensorflow::DT_HALF:
          finite(i) = TensorFinite<Eigen::half>(ctx, t);
          break;
        case tensorflow::DT_BFLOAT16:
          finite(i) = TensorFinite<Eigen::bfloat16>(ctx, t);
          break;
        case tensorflow::DT_FLOAT:
          finite(i) = TensorFinite<float>(ctx, t);
          break;
        case tensorflow::DT_DOUBLE:
          finite(i) = TensorFinite<double>(ctx, t);
          break;
        default:  // (the op's type constraint admits no other)
          ctx->CtxFailure(errors::InvalidArgument("tensors[", i,
                                                  "] must be float16, bfloat16, float32 or float64, got ",
                                                  DataTypeString(t.dtype())));
          return;
      }
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("TfSync>AllFinite").Device(tensorflow::DEVICE_CPU), AllFiniteOp);

}  // namespace
}  // namespace tfsync
