// Kernels for TfSync>DelayCompensate and TfSync>DelayCompensateAdaptive: the
// first-order delay compensation of DC-ASGD (Zheng et al., ICML 2017), which the
// DC-S3GD paper applies to the gradient computed while the previous allreduce ran:
//   g~ = g + lambda * g (.) g (.) (w_now - w_stale)              (DC-ASGD-c)
//   v  = m * v + (1 - m) * g (.) g;  lambda = lambda0 / sqrt(v + eps)  (DC-ASGD-a)
// The op definitions are in ops/cc/ops/tfsync_ops.cc.
//
// Each is one fused pass over contiguous memory (3 reads + 1 write, or 4 reads + 2
// writes with the state): the op is memory-bound, so what matters is touching each
// byte once, writing into the gradient's buffer when TensorFlow lets us
// (forward_input) or else into the kernel's released previous output, vector loops
// (__restrict__ scalar loops for half/bfloat16, SSE2 intrinsics for float/double
// since a sqrt blocks GCC's vectorizer), and one large block per thread.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

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
using CPUDevice = Eigen::ThreadPoolDevice;
#if GOOGLE_CUDA
using GPUDevice = Eigen::GpuDevice;
#endif

// ---- CPU loops. Two variants each: out-of-place, and in place in the gradient's
// buffer (when forwarded), so that __restrict__ is always truthful. ----

template <typename T>
void DelayCompensateLoop(const T* __restrict__ g, const T* __restrict__ w_now,
                         const T* __restrict__ w_stale, typename Accumulator<T>::type lambda,
                         T* __restrict__ out, int64_t n) {
  using A = typename Accumulator<T>::type;
  for (int64_t i = 0; i < n; ++i) {
    const A gi = static_cast<A>(g[i]);
    const A delta = static_cast<A>(w_now[i]) - static_cast<A>(w_stale[i]);
    out[i] = static_cast<T>(gi + lambda * gi * gi * delta);
  }
}

template <typename T>
void DelayCompensateLoopInPlace(T* __restrict__ g, const T* __restrict__ w_now,
                                const T* __restrict__ w_stale,
                                typename Accumulator<T>::type lambda, int64_t n) {
  using A = typename Accumulator<T>::type;
  for (int64_t i = 0; i < n; ++i) {
    const A gi = static_cast<A>(g[i]);
    const A delta = static_cast<A>(w_now[i]) - static_cast<A>(w_stale[i]);
    g[i] = static_cast<T>(gi + lambda * gi * gi * delta);
  }
}

template <typename T>
struct AdaptiveParams {
  using A = typename Accumulator<T>::type;
  A lambda0, momentum, one_minus_momentum, epsilon;
};

template <typename T>
void AdaptiveLoop(const T* __restrict__ g, const T* __restrict__ w_now,
                        const T* __restrict__ w_stale, typename Accumulator<T>::type* __restrict__ v,
                                     AdaptiveParams<T> p, T* __restrict__ out, int64_t n) {
  using A = typename Accumulator<T>::type;
  for (int64_t i = 0; i < n; ++i) {
    const A gi = static_cast<A>(g[i]);
    const A gg = gi * gi;
    const A vi = p.momentum * v[i] + p.one_minus_momentum * gg;
    v[i] = vi;
    const A delta = static_cast<A>(w_now[i]) - static_cast<A>(w_stale[i]);
    out[i] = static_cast<T>(gi + p.lambda0 / std::sqrt(vi + p.epsilon) * gg * delta);
  }
}

template <typename T>
void AdaptiveLoopInPlace(T* __restrict__ g, const T* __restrict__ w_now,
                                            const T* __restrict__ w_stale,
                                            typename Accumulator<T>::type* __restrict__ v,
                                            AdaptiveParams<T> p, int64_t n) {
  using A = typename Accumulator<T>::type;
  for (int64_t i = 0; i < n; ++i) {
    const A gi = static_cast<A>(g[i]);
    const A gg = gi * gi;
    const A vi = p.momentum * v[i] + p.one_minus_momentum * gg;
    v[i] = vi;
    const A delta = static_cast<A>(w_now[i]) - static_cast<A>(w_stale[i]);
    g[i] = static_cast<T>(gi + p.lambda0 / std::sqrt(vi + p.epsilon) * gg * delta);
  }
}

#if defined(__SSE2__)
// float and double: GCC will not vectorize std::sqrt while it must set errno for a
// negative argument (impossible here: v >= 0, epsilon > 0), and the compile flags
// come from TensorFlow, so the vector loop is written with SSE2 intrinsics (the
// x86-64 baseline). Each lane computes exactly the scalar expression, in the same
// order, so results match the scalar tail and the reference bit for bit. Loads
// precede stores at every index, so out may alias g (in place) safely.
template <typename T>
struct Sse;
template <>
struct Sse<float> {
  using V = __m128;
  static constexpr int kLanes = 4;
  static V Set(float x) { return _mm_set1_ps(x); }
  static V Load(const float* p) { return _mm_loadu_ps(p); }
  static void Store(float* p, V x) { _mm_storeu_ps(p, x); }
  static void Stream(float* p, V x) { _mm_stream_ps(p, x); }
  static V Add(V a, V b) { return _mm_add_ps(a, b); }
  static V Sub(V a, V b) { return _mm_sub_ps(a, b); }
  static V Mul(V a, V b) { return _mm_mul_ps(a, b); }
  static V Div(V a, V b) { return _mm_div_ps(a, b); }
  static V Sqrt(V a) { return _mm_sqrt_ps(a); }
};
template <>
struct Sse<double> {
  using V = __m128d;
  static constexpr int kLanes = 2;
  static V Set(double x) { return _mm_set1_pd(x); }
  static V Load(const double* p) { return _mm_loadu_pd(p); }
  static void Store(double* p, V x) { _mm_storeu_pd(p, x); }
  static void Stream(double* p, V x) { _mm_stream_pd(p, x); }
  static V Add(V a, V b) { return _mm_add_pd(a, b); }
  static V Sub(V a, V b) { return _mm_sub_pd(a, b); }
  static V Mul(V a, V b) { return _mm_mul_pd(a, b); }
  static V Div(V a, V b) { return _mm_div_pd(a, b); }
  static V Sqrt(V a) { return _mm_sqrt_pd(a); }
};

// Outputs at least this large (well past what stays in cache until the consumer
// reads them) are written with non-temporal stores when they are a separate
// buffer: that skips reading each destination line before overwriting it, a fifth
// of the memory traffic. Never for a line the loop has just read (the gradient's
// buffer when forwarded, the state v): a streaming store to a cached line forces
// its eviction, and was 3-5x slower in a microbenchmark here.
constexpr int64_t kStreamMinBytes = int64_t{8} << 20;

template <typename S, bool kStream, typename T>
inline void Put(T* p, typename S::V x) {
  if (kStream) {
    S::Stream(p, x);
  } else {
    S::Store(p, x);
  }
}

// Scalar elements until `out` is 16-byte aligned (needed by the streaming stores;
// TensorFlow's buffers and the thread blocks are 64-byte aligned, so normally none).
template <typename T>
int64_t AlignedStart(const T* out, int64_t n) {
  const auto misalignment = reinterpret_cast<uintptr_t>(out) % 16;
  if (misalignment % sizeof(T) != 0) return n;  // never aligned: all scalar
  return std::min<int64_t>(n, misalignment == 0 ? 0 : (16 - misalignment) / sizeof(T));
}

template <typename T, bool kStream>
void DelayCompensateSse(const T* g, const T* w_now, const T* w_stale, T lambda, T* out,
                        int64_t n) {
  using S = Sse<T>;
  int64_t i = AlignedStart(out, n);
  for (int64_t j = 0; j < i; ++j) out[j] = g[j] + lambda * g[j] * g[j] * (w_now[j] - w_stale[j]);
  const typename S::V lam = S::Set(lambda);
  for (; i + S::kLanes <= n; i += S::kLanes) {
    const typename S::V gi = S::Load(g + i);
    const typename S::V delta = S::Sub(S::Load(w_now + i), S::Load(w_stale + i));
    Put<S, kStream>(out + i, S::Add(gi, S::Mul(S::Mul(S::Mul(lam, gi), gi), delta)));
  }
  for (; i < n; ++i) out[i] = g[i] + lambda * g[i] * g[i] * (w_now[i] - w_stale[i]);
  if (kStream) _mm_sfence();  // order the streaming stores before the op completes
}

template <typename T, bool kStream>
void AdaptiveLoopSse(const T* g, const T* w_now, const T* w_stale, T* v, AdaptiveParams<T> p,
                     T* out, int64_t n) {
  using S = Sse<T>;
  auto scalar = [&](int64_t i) {
    const T gi = g[i];
    const T gg = gi * gi;
    const T vi = p.momentum * v[i] + p.one_minus_momentum * gg;
    v[i] = vi;
    out[i] = gi + p.lambda0 / std::sqrt(vi + p.epsilon) * gg * (w_now[i] - w_stale[i]);
  };
  int64_t i = kStream ? AlignedStart(out, n) : 0;
  for (int64_t j = 0; j < i; ++j) scalar(j);
  const typename S::V m = S::Set(p.momentum), om = S::Set(p.one_minus_momentum),
                      l0 = S::Set(p.lambda0), eps = S::Set(p.epsilon);
  for (; i + S::kLanes <= n; i += S::kLanes) {
    const typename S::V gi = S::Load(g + i);
    const typename S::V gg = S::Mul(gi, gi);
    const typename S::V vi = S::Add(S::Mul(m, S::Load(v + i)), S::Mul(om, gg));
    S::Store(v + i, vi);
    const typename S::V delta = S::Sub(S::Load(w_now + i), S::Load(w_stale + i));
    const typename S::V lam = S::Div(l0, S::Sqrt(S::Add(vi, eps)));
    Put<S, kStream>(out + i, S::Add(gi, S::Mul(S::Mul(lam, gg), delta)));
  }
  for (; i < n; ++i) scalar(i);
  if (kStream) _mm_sfence();
}

// Dispatch: the SSE loops for float/double, the scalar loops for half/bfloat16
// (whose conversions dominate and do not vectorize without F16C anyway).
// `total_bytes` is the size of the whole output, which decides streaming.
template <typename T>
void AdaptiveChunk(const T* g, const T* w_now, const T* w_stale,
                   typename Accumulator<T>::type* v, AdaptiveParams<T> p, T* out, int64_t n,
                   int64_t total_bytes) {
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
    if (total_bytes >= kStreamMinBytes && out != g) {
      AdaptiveLoopSse<T, true>(g, w_now, w_stale, v, p, out, n);
    } else {
      AdaptiveLoopSse<T, false>(g, w_now, w_stale, v, p, out, n);
    }
  } else if (out == g) {
    AdaptiveLoopInPlace<T>(out, w_now, w_stale, v, p, n);
  } else {
    AdaptiveLoop<T>(g, w_now, w_stale, v, p, out, n);
  }
}

template <typename T>
void DelayCompensateChunk(const T* g, const T* w_now, const T* w_stale,
                          typename Accumulator<T>::type lambda, T* out, int64_t n,
                          int64_t total_bytes) {
  if constexpr (std::is_same<T, float>::value || std::is_same<T, double>::value) {
    if (total_bytes >= kStreamMinBytes && out != g) {
      DelayCompensateSse<T, true>(g, w_now, w_stale, lambda, out, n);
    } else {
      DelayCompensateSse<T, false>(g, w_now, w_stale, lambda, out, n);
    }
  } else if (out == g) {
    DelayCompensateLoopInPlace<T>(out, w_now, w_stale, lambda, n);
  } else {
    DelayCompensateLoop<T>(g, w_now, w_stale, lambda, out, n);
  }
}
#else
template <typename T>
void AdaptiveChunk(const T* g, const T* w_now, const T* w_stale,
                   typename Accumulator<T>::type* v, AdaptiveParams<T> p, T* out, int64_t n,
                   int64_t) {
  if (out == g) {
    AdaptiveLoopInPlace<T>(out, w_now, w_stale, v, p, n);
  } else {
    AdaptiveLoop<T>(g, w_now, w_stale, v, p, out, n);
  }
}

template <typename T>
void DelayCompensateChunk(const T* g, const T* w_now, const T* w_stale,
                          typename Accumulator<T>::type lambda, T* out, int64_t n, int64_t) {
  if (out == g) {
    DelayCompensateLoopInPlace<T>(out, w_now, w_stale, lambda, n);
  } else {
    DelayCompensateLoop<T>(g, w_now, w_stale, lambda, out, n);
  }
}
#endif  // __SSE2__

// ---- Validation shared by both ops. ----

bool ScalarFloat(OpKernelContext* ctx, int index, const char* name, float* value) {
  const Tensor& t = ctx->input(index);
  if (!TensorShapeUtils::IsScalar(t.shape())) {
    ctx->CtxFailure(errors::InvalidArgument(name, " must be a scalar, got shape ",
                                            t.shape().DebugString()));
    return false;
  }
  *value = t.scalar<float>()();
  if (!std::isfinite(*value)) {
    ctx->CtxFailure(errors::InvalidArgument(name, " must be finite, got ", *value,
                                            "; check the schedule or config that produced it"));
    return false;
  }
  return true;
}

bool SameShapes(OpKernelContext* ctx, const Tensor& g, const Tensor& w_now,
                const Tensor& w_stale) {
  if (!w_now.shape().IsSameSize(g.shape())) {
    ctx->CtxFailure(errors::InvalidArgument(
        "w_now must have the same shape as gradient: gradient has shape ",
        g.shape().DebugString(), ", w_now has shape ", w_now.shape().DebugString()));
    return false;
  }
  if (!w_stale.shape().IsSameSize(g.shape())) {
    ctx->CtxFailure(errors::InvalidArgument(
        "w_stale must have the same shape as gradient: gradient has shape ",
        g.shape().DebugString(), ", w_stale has shape ", w_stale.shape().DebugString()));
    return false;
  }
  return true;
}

// The output: the gradient's own buffer when nothing else holds it (typical inside
// a tf.function), else on CPU the previous call's buffer when released, else fresh.
template <typename Device>
absl::Status AllocateOutput(OpKernelContext* ctx, int gradient_index, ReusableOutput* reusable,
                            Tensor** out) {
  const Tensor& g = ctx->input(gradient_index);
  if (ctx->forward_input_to_output_with_shape(gradient_index, 0, g.shape(), out)) {
    return absl::OkStatus();
  }
  if (std::is_same<Device, CPUDevice>::value) {
    return reusable->Allocate(ctx, 0, g.shape(), g.dtype(), out);
  }
  return ctx->allocate_output(0, g.shape(), out);
}

template <typename Device, typename T>
struct DelayCompensateImpl;
template <typename Device, typename T>
struct DelayCompensateAdaptiveImpl;

template <typename Device, typename T>
class DelayCompensateOp : public OpKernel {
 public:
  explicit DelayCompensateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& g = ctx->input(0);
    const Tensor& w_now = ctx->input(1);
    const Tensor& w_stale = ctx->input(2);
    if (!SameShapes(ctx, g, w_now, w_stale)) return;
    float lambda;
    if (!ScalarFloat(ctx, 3, "lambda_", &lambda)) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, AllocateOutput<Device>(ctx, 0, &output_, &out));
    DelayCompensateImpl<Device, T>::Run(ctx, g, w_now, w_stale, lambda, out);
  }

 private:
  ReusableOutput output_;
};

template <typename T>
struct DelayCompensateImpl<CPUDevice, T> {
  static void Run(OpKernelContext* ctx, const Tensor& g, const Tensor& w_now,
                  const Tensor& w_stale, float lambda, Tensor* out) {
    using A = typename Accumulator<T>::type;
    const T* gp = g.flat<T>().data();
    const T* wn = w_now.flat<T>().data();
    const T* ws = w_stale.flat<T>().data();
    T* op = out->flat<T>().data();
    const A lam = static_cast<A>(lambda);
    const int64_t total_bytes = out->TotalBytes();
    ParallelElementwise(ctx, g.NumElements(), 4 * sizeof(T), [&](int64_t b, int64_t e) {
      DelayCompensateChunk<T>(gp + b, wn + b, ws + b, lam, op + b, e - b, total_bytes);
    });
  }
};

template <typename Device, typename T>
class DelayCompensateAdaptiveOp : public OpKernel {
 public:
  explicit DelayCompensateAdaptiveOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    using A = typename Accumulator<T>::type;
    const Tensor& g = ctx->input(1);
    const Tensor& w_now = ctx->input(2);
    const Tensor& w_stale = ctx->input(3);
    if (!SameShapes(ctx, g, w_now, w_stale)) return;
    float lambda0, momentum, epsilon;
    if (!ScalarFloat(ctx, 4, "lambda0", &lambda0)) return;
    if (!ScalarFloat(ctx, 5, "momentum", &momentum)) return;
    if (!ScalarFloat(ctx, 6, "epsilon", &epsilon)) return;
    OP_REQUIRES(ctx, momentum >= 0.0f && momentum <= 1.0f,
                errors::InvalidArgument("momentum must be in [0, 1], got ", momentum,
                                        " (DC-ASGD-a uses 0.95)"));
    OP_REQUIRES(ctx, epsilon > 0.0f,
                errors::InvalidArgument("epsilon must be > 0 so that lambda0 / sqrt(v + "
                                        "epsilon) stays finite, got ",
                                        epsilon));

    tensorflow::core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), &var));
    tensorflow::mutex_lock lock(*var->mu());
    Tensor* v = var->tensor();
    OP_REQUIRES(ctx, v->IsInitialized(),
                errors::InvalidArgument("mean_square is not initialized; create it with "
                                        "tf.Variable(tf.zeros_like(gradient, dtype=",
                                        DataTypeString(DataTypeToEnum<A>::value), "))"));
    OP_REQUIRES(ctx, v->dtype() == DataTypeToEnum<A>::value,
                errors::InvalidArgument(
                    "mean_square must have dtype ", DataTypeString(DataTypeToEnum<A>::value),
                    " for ", DataTypeString(DataTypeToEnum<T>::value),
                    " gradients (the state is kept in the accumulation type), got ",
                    DataTypeString(v->dtype())));
    OP_REQUIRES(ctx, v->shape().IsSameSize(g.shape()),
                errors::InvalidArgument(
                    "mean_square must have the same shape as gradient: gradient has shape ",
                    g.shape().DebugString(), ", mean_square has shape ",
                    v->shape().DebugString()));
    // Copy-on-write, as TensorFlow's own dense variable updates do: a pending read
    // may share the buffer, and it must keep seeing the old value.
    if (var->copy_on_read_mode.load() || !v->RefCountIsOne()) {
      Tensor copy;
      tensorflow::AllocatorAttributes attr;
      attr.set_gpu_compatible(true);
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(v->dtype(), v->shape(), &copy, attr));
      if (std::is_same<Device, CPUDevice>::value) AdviseHugePages(copy.data(), copy.TotalBytes());
      DelayCompensateAdaptiveImpl<Device, T>::Copy(ctx, *v, &copy);
      *v = copy;
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, AllocateOutput<Device>(ctx, 1, &output_, &out));
    AdaptiveParams<T> p{static_cast<A>(lambda0), static_cast<A>(momentum),
                        static_cast<A>(1) - static_cast<A>(momentum), static_cast<A>(epsilon)};
    DelayCompensateAdaptiveImpl<Device, T>::Run(ctx, g, w_now, w_stale, p, v, out);
  }

 private:
  ReusableOutput output_;
};

template <typename T>
struct DelayCompensateAdaptiveImpl<CPUDevice, T> {
  using A = typename Accumulator<T>::type;
  static void Copy(OpKernelContext*, const Tensor& from, Tensor* to) {
    std::memcpy(to->flat<A>().data(), from.flat<A>().data(), from.NumElements() * sizeof(A));
  }
  static void Run(OpKernelContext* ctx, const Tensor& g, const Tensor& w_now,
                  const Tensor& w_stale, AdaptiveParams<T> p, Tensor* v, Tensor* out) {
    const T* gp = g.flat<T>().data();
    const T* wn = w_now.flat<T>().data();
    const T* ws = w_stale.flat<T>().data();
    A* vp = v->flat<A>().data();
    T* op = out->flat<T>().data();
    const int64_t total_bytes = out->TotalBytes();
    ParallelElementwise(ctx, g.NumElements(), 4 * sizeof(T) + 2 * sizeof(A),
                        [&](int64_t b, int64_t e) {
                          AdaptiveChunk<T>(gp + b, wn + b, ws + b, vp + b, p, op + b, e - b,
                                           total_bytes);
                        });
  }
};

#if GOOGLE_CUDA
// The GPU kernels are plain CUDA (kernels/cuda/), launched on the op's stream.
template <typename T>
struct DelayCompensateImpl<GPUDevice, T> {
  static void Run(OpKernelContext* ctx, const Tensor& g, const Tensor& w_now,
                  const Tensor& w_stale, float lambda, Tensor* out) {
    OP_REQUIRES_OK(ctx, CudaLaunchStatus(cuda::DelayCompensate(
                                             AsCuda(g.flat<T>().data()), AsCuda(w_now.flat<T>().data()),
                                             AsCuda(w_stale.flat<T>().data()), lambda,
                                             AsCuda(out->flat<T>().data()), g.NumElements(),
                                             ctx->eigen_device<GPUDevice>().stream()),
                                         "TfSync>DelayCompensate"));
  }
};

template <typename T>
struct DelayCompensateAdaptiveImpl<GPUDevice, T> {
  using A = typename Accumulator<T>::type;
  static void Copy(OpKernelContext* ctx, const Tensor& from, Tensor* to) {
    ctx->eigen_device<GPUDevice>().memcpy(to->flat<A>().data(), from.flat<A>().data(),
                                          from.NumElements() * sizeof(A));
  }
  static void Run(OpKernelContext* ctx, const Tensor& g, const Tensor& w_now,
                  const Tensor& w_stale, AdaptiveParams<T> p, Tensor* v, Tensor* out) {
    // the launcher takes the op's float32 inputs and rounds them to A as the CPU kernel did
    OP_REQUIRES_OK(ctx, CudaLaunchStatus(cuda::DelayCompensateAdaptive(
                                             v->flat<A>().data(), AsCuda(g.flat<T>().data()),
                                             AsCuda(w_now.flat<T>().data()), AsCuda(w_stale.flat<T>().data()),
                                             static_cast<float>(p.lambda0), static_cast<float>(p.momentum),
                                             static_cast<float>(p.epsilon), AsCuda(out->flat<T>().data()),
                                             g.NumElements(), ctx->eigen_device<GPUDevice>().stream()),
                                         "TfSync>DelayCompensateAdaptive"));
  }
};
#endif  // GOOGLE_CUDA

#define TFSYNC_REGISTER_CPU(T)                                                               \
  REGISTER_KERNEL_BUILDER(                                                                   \
      Name("TfSync>DelayCompensate").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),  \
      DelayCompensateOp<CPUDevice, T>);                                                      \
  REGISTER_KERNEL_BUILDER(Name("TfSync>DelayCompensateAdaptive")                             \
                              .Device(tensorflow::DEVICE_CPU)                                \
                              .TypeConstraint<T>("T"),                                       \
                          DelayCompensateAdaptiveOp<CPUDevice, T>);
TFSYNC_REGISTER_CPU(Eigen::half)
TFSYNC_REGISTER_CPU(Eigen::bfloat16)
TFSYNC_REGISTER_CPU(float)
TFSYNC_REGISTER_CPU(double)
#undef TFSYNC_REGISTER_CPU

#if GOOGLE_CUDA
// The scalar hyperparameters are read on the host to validate them.
#define TFSYNC_REGISTER_GPU(T)                                                              \
  REGISTER_KERNEL_BUILDER(Name("TfSync>DelayCompensate")                                    \
                              .Device(tensorflow::DEVICE_GPU)                               \
                              .TypeConstraint<T>("T")                                       \
                              .HostMemory("lambda_"),                                       \
                          DelayCompensateOp<GPUDevice, T>);                                 \
  REGISTER_KERNEL_BUILDER(Name("TfSync>DelayCompensateAdaptive")                            \
                              .Device(tensorflow::DEVICE_GPU)                               \
                              .TypeConstraint<T>("T")                                       \
                              .HostMemory("mean_square")                                    \
                              .HostMemory("lambda0")                                        \
                              .HostMemory("momentum")                                       \
                              .HostMemory("epsilon"),                                       \
                          DelayCompensateAdaptiveOp<GPUDevice, T>);
TFSYNC_REGISTER_GPU(Eigen::half)
TFSYNC_REGISTER_GPU(Eigen::bfloat16)
TFSYNC_REGISTER_GPU(float)
TFSYNC_REGISTER_GPU(double)
#undef TFSYNC_REGISTER_GPU
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tfsync
