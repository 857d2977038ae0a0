// Kernels for TfSync>UpdatePushShare and TfSync>UpdateApplyRound: the state updates
// that the "updates" protocol (SSP, DSSP, ElasticBSP; tfsync/engine/protocols.py)
// makes on every step, over three variables of one weight tensor: the model's
// variable v, the replicated sum w_bar of every complete round, and pending, the
// sum of this worker's own shares whose rounds are not complete yet. Between calls
// v == w_bar + pending (read-my-writes).
//
//   push:  share = (v - (w_bar + pending)) / size;  pending += share;
//          v = w_bar + pending                 (after the optimizer moved v by D)
//   apply: w_bar += total;  pending -= own_share;  v = w_bar + pending
//
// The push also says whether the share is finite, from the same pass: the engine
// rejects a share with a NaN or an infinity whole (it never reaches a round), and
// must then restore pending and v. So an element whose share is not finite leaves
// pending as it was (v returns to w_bar + pending there); every other element's
// share can be subtracted again. The test is a select per element, not a branch, and
// the flag an integer OR, so the loop stays one vectorized stream.
//
// The same arithmetic as the TensorFlow ops they replace (tfsync/ops/_reference.py),
// in one pass each: push reads 3 and writes 3 streams, apply reads 4 and writes 3,
// where the separate TensorFlow ops made 6 and 11 passes' worth and allocated their
// temporaries. Measured here at 17.9M float32 parameters (one process): push 64 ms
// and apply 53 ms as TensorFlow ops; see docs/ops.md for these kernels' times.
// half and bfloat16 are computed in float and rounded once per stored value.
// CPU only: on a GPU the reference's TensorFlow ops run on the device instead
// (tfsync.ops chooses by the variables' device).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "kernels/cpu_parallel.h"
#include "kernels/tfsync_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"

namespace tfsync {
namespace {

using ::tensorflow::DataTypeString;
using ::tensorflow::DataTypeToEnum;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShapeUtils;
using ::tensorflow::Var;
namespace errors = ::tensorflow::errors;

constexpr int kVariables = 3;  // inputs 0-2: variable, w_bar, pending
const char* const kNames[kVariables] = {"variable", "w_bar", "pending"};
constexpr int kShareSlots = 8;  // SSP(3) keeps s + 1 = 4 in flight; a larger bound allocates the rest

// The three variables of one weight tensor, locked (in address order, as
// TensorFlow's own multi-variable updates lock) and writable for the kernel's life.
template <typename T>
class LockedVariables {
 public:
  LockedVariables() = default;
  LockedVariables(const LockedVariables&) = delete;
  LockedVariables& operator=(const LockedVariables&) = delete;
  ~LockedVariables() {
    for (int i = kVariables - 1; i >= 0; --i) {
      if (locked_[i] != nullptr) locked_[i]->mu()->unlock();
    }
  }

  // False (with the context's status set) when a variable is missing, uninitialized,
  // of another dtype or shape than the first, or shared with another input.
  bool Acquire(OpKernelContext* ctx) {
    for (int i = 0; i < kVariables; ++i) {
      auto status = tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, i), &vars_[i]);
      if (!status.ok()) {
        ctx->CtxFailure(status);
        return false;
      }
    }
    for (int i = 0; i < kVariables; ++i) {
      for (int j = 0; j < i; ++j) {
        if (vars_[i].get() == vars_[j].get()) {
          ctx->CtxFailure(errors::InvalidArgument(
              kNames[j], " and ", kNames[i],
              " are the same variable; pass three different variables (the op updates each in place)"));
          return false;
        }
      }
    }
    Var* order[kVariables] = {vars_[0].get(), vars_[1].get(), vars_[2].get()};
    std::sort(order, order + kVariables, [](Var* a, Var* b) { return a->mu() < b->mu(); });
    for (int i = 0; i < kVariables; ++i) {
      order[i]->mu()->lock();
      locked_[i] = order[i];
    }
    for (int i = 0; i < kVariables; ++i) {
      const Tensor* t = vars_[i]->tensor();
      if (!t->IsInitialized()) {
        ctx->CtxFailure(errors::FailedPrecondition(kNames[i], " is not initialized"));
        return false;
      }
      if (t->dtype() != DataTypeToEnum<T>::value) {
        ctx->CtxFailure(errors::InvalidArgument(kNames[i], " must have dtype ",
                                                DataTypeString(DataTypeToEnum<T>::value),
                                                " (the op's T), got ", DataTypeString(t->dtype())));
        return false;
      }
      if (!t->shape().IsSameSize(vars_[0]->tensor()->shape())) {
        ctx->CtxFailure(errors::InvalidArgument(
            kNames[i], " must have the shape of variable: variable has shape ",
            vars_[0]->tensor()->shape().DebugString(), ", ", kNames[i], " has shape ",
            t->shape().DebugString()));
        return false;
      }
    }
    // Copy-on-write, as TensorFlow's own dense variable updates do: a pending read
    // may share a buffer, and it must keep seeing the old value.
    for (int i = 0; i < kVariables; ++i) {
      Tensor* t = vars_[i]->tensor();
      if (vars_[i]->copy_on_read_mode.load() || !t->RefCountIsOne()) {
        Tensor copy;
        auto status = ctx->allocate_temp(t->dtype(), t->shape(), &copy);
        if (!status.ok()) {
          ctx->CtxFailure(status);
          return false;
        }
        AdviseHugePages(copy.data(), copy.TotalBytes());
        std::memcpy(copy.data(), t->data(), t->TotalBytes());
        *t = copy;
      }
    }
    return true;
  }

  T* data(int i) { return vars_[i]->tensor()->flat<T>().data(); }
  const Tensor& tensor(int i) { return *vars_[i]->tensor(); }

 private:
  tensorflow::core::RefCountPtr<Var> vars_[kVariables];
  Var* locked_[kVariables] = {nullptr, nullptr, nullptr};
};

// Returns whether every share of [0, n) is finite.
template <typename T>
bool PushShareLoop(T* __restrict__ v, const T* __restrict__ w, T* __restrict__ p,
                   typename Accumulator<T>::type size, T* __restrict__ share, int64_t n) {
  using A = typename Accumulator<T>::type;
  using B = typename FloatBits<T>::type;
  constexpr B kExponent = FloatBits<T>::kExponent;
  B bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const A wi = static_cast<A>(w[i]);
    const T p_old = p[i];
    const A pi = static_cast<A>(p_old);
    const T s = static_cast<T>((static_cast<A>(v[i]) - (wi + pi)) / size);
    const T p_new = static_cast<T>(pi + static_cast<A>(s));
    // p_new where the share is finite, p_old where it is not: a select on the bits
    B s_bits, new_bits, old_bits;
    std::memcpy(&s_bits, &s, sizeof(B));
    std::memcpy(&new_bits, &p_new, sizeof(B));
    std::memcpy(&old_bits, &p_old, sizeof(B));
    const B nonfinite = static_cast<B>((s_bits & kExponent) == kExponent);
    const B keep_old = static_cast<B>(B{0} - nonfinite);  // all ones where not finite
    const B pn_bits = static_cast<B>((new_bits & ~keep_old) | (old_bits & keep_old));
    T pn;
    std::memcpy(&pn, &pn_bits, sizeof(B));
    bad |= nonfinite;
    share[i] = s;
    p[i] = pn;
    v[i] = static_cast<T>(wi + static_cast<A>(pn));
  }
  return bad == 0;
}

template <typename T>
void ApplyRoundLoop(T* __restrict__ v, T* __restrict__ w, T* __restrict__ p,
                    const T* __restrict__ total, const T* __restrict__ own, int64_t n) {
  using A = typename Accumulator<T>::type;
  for (int64_t i = 0; i < n; ++i) {
    const T wi = static_cast<T>(static_cast<A>(w[i]) + static_cast<A>(total[i]));
    const T pi = static_cast<T>(static_cast<A>(p[i]) - static_cast<A>(own[i]));
    w[i] = wi;
    p[i] = pi;
    v[i] = static_cast<T>(static_cast<A>(wi) + static_cast<A>(pi));
  }
}

template <typename T>
class UpdatePushShareOp : public OpKernel {
 public:
  explicit UpdatePushShareOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    using A = typename Accumulator<T>::type;
    const Tensor& size_t_ = ctx->input(3);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(size_t_.shape()),
                errors::InvalidArgument("size must be a scalar, got shape ",
                                        size_t_.shape().DebugString()));
    const float size = size_t_.scalar<float>()();
    OP_REQUIRES(ctx, size >= 1.0f,
                errors::InvalidArgument("size is the number of workers, at least 1, got ", size));
    LockedVariables<T> vars;
    if (!vars.Acquire(ctx)) return;
    Tensor* share = nullptr;
    OP_REQUIRES_OK(ctx, shares_.Allocate(ctx, 0, vars.tensor(0).shape(), DataTypeToEnum<T>::value, &share));
    T* v = vars.data(0);
    const T* w = vars.data(1);
    T* p = vars.data(2);
    T* s = share->flat<T>().data();
    const A n = static_cast<A>(size);
    std::atomic<bool> finite{true};
    ParallelElementwise(ctx, share->NumElements(), 6 * sizeof(T), [&](int64_t b, int64_t e) {
      if (!PushShareLoop<T>(v + b, w + b, p + b, n, s + b, e - b)) {
        finite.store(false, std::memory_order_relaxed);
      }
    });
    Tensor* flag = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, tensorflow::TensorShape({}), &flag));
    flag->scalar<bool>()() = finite.load(std::memory_order_relaxed);
  }

 private:
  // shares stay alive until their rounds are applied: a ring of them, reused
  ReusableOutput shares_{kShareSlots};
};

template <typename T>
class UpdateApplyRoundOp : public OpKernel {
 public:
  explicit UpdateApplyRoundOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    LockedVariables<T> vars;
    if (!vars.Acquire(ctx)) return;
    const Tensor& total = ctx->input(3);
    const Tensor& own = ctx->input(4);
    const auto& shape = vars.tensor(0).shape();
    OP_REQUIRES(ctx, total.shape().IsSameSize(shape),
                errors::InvalidArgument("total must have the shape of variable: variable has shape ",
                                        shape.DebugString(), ", total has shape ",
                                        total.shape().DebugString()));
    OP_REQUIRES(ctx, own.shape().IsSameSize(shape),
                errors::InvalidArgument("own_share must have the shape of variable: variable has shape ",
                                        shape.DebugString(), ", own_share has shape ",
                                        own.shape().DebugString()));
    T* v = vars.data(0);
    T* w = vars.data(1);
    T* p = vars.data(2);
    const T* t = total.flat<T>().data();
    const T* o = own.flat<T>().data();
    ParallelElementwise(ctx, total.NumElements(), 7 * sizeof(T), [&](int64_t b, int64_t e) {
      ApplyRoundLoop<T>(v + b, w + b, p + b, t + b, o + b, e - b);
    });
  }
};

#define TFSYNC_REGISTER_CPU(T)                                                                \
  REGISTER_KERNEL_BUILDER(                                                                    \
      Name("TfSync>UpdatePushShare").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),   \
      UpdatePushShareOp<T>);                                                                  \
  REGISTER_KERNEL_BUILDER(                                                                    \
      Name("TfSync>UpdateApplyRound").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),  \
      UpdateApplyRoundOp<T>);
TFSYNC_REGISTER_CPU(Eigen::half)
TFSYNC_REGISTER_CPU(Eigen::bfloat16)
TFSYNC_REGISTER_CPU(float)
TFSYNC_REGISTER_CPU(double)
#undef TFSYNC_REGISTER_CPU

}  // namespace
}  // namespace tfsync
