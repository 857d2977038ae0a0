// Kernels for TfSync>PartialAggregate and TfSync>MaskStale: timestamped staleness
// dropping and partial aggregation, PSP Algorithm 1 (server lines 5-13) and Sync-SGD
// with backup workers, Algorithm 4 (aggregate what is stamped with the current step,
// drop the rest). The op definitions are in ops/cc/ops/tfsync_ops.cc.
//
// The timestamp test and the counting run on the host (k is the number of workers,
// small); only the sum over the accepted rows touches the large tensors.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cpu_parallel.h"
#include "kernels/tfsync_kernels.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tfsync {
namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::TensorShapeUtils;
namespace errors = ::tensorflow::errors;
using CPUDevice = Eigen::ThreadPoolDevice;
#if GOOGLE_CUDA
using GPUDevice = Eigen::GpuDevice;
#endif

// Reads a scalar int64 input, failing with the input's name and shape otherwise.
bool ScalarInt64(OpKernelContext* ctx, int index, const char* name, int64_t* value) {
  const Tensor& t = ctx->input(index);
  if (!TensorShapeUtils::IsScalar(t.shape())) {
    ctx->CtxFailure(errors::InvalidArgument(name, " must be a scalar, got shape ",
                                            t.shape().DebugString()));
    return false;
  }
  *value = t.scalar<int64_t>()();
  return true;
}

bool NonNegativeStaleness(OpKernelContext* ctx, int64_t max_staleness) {
  if (max_staleness < 0) {
    ctx->CtxFailure(errors::InvalidArgument(
        "max_staleness must be >= 0 (0 accepts only the current step), got ", max_staleness));
    return false;
  }
  return true;
}

// Writes out[j] = acc[j] * scale for one tile. For large float/double outputs the
// stores are non-temporal: the output is a separate buffer nobody reads during the
// op, and streaming it skips reading each destination line first (a fifth of the
// traffic with k = 4).
template <typename T, typename A>
void WriteTile(const A* __restrict__ acc, A scale, int64_t len, bool stream, T* __restrict__ out) {
#if defined(__SSE2__)
  if constexpr (std::is_same<T, float>::value) {
    if (stream && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
      const __m128 s = _mm_set1_ps(scale);
      int64_t j = 0;
      for (; j + 4 <= len; j += 4) _mm_stream_ps(out + j, _mm_mul_ps(_mm_loadu_ps(acc + j), s));
      for (; j < len; ++j) out[j] = acc[j] * scale;
      return;
    }
  } else if constexpr (std::is_same<T, double>::value) {
    if (stream && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
      const __m128d s = _mm_set1_pd(scale);
      int64_t j = 0;
      for (; j + 2 <= len; j += 2) _mm_stream_pd(out + j, _mm_mul_pd(_mm_loadu_pd(acc + j), s));
      for (; j < len; ++j) out[j] = acc[j] * scale;
      return;
    }
  }
#endif
  for (int64_t j = 0; j < len; ++j) out[j] = static_cast<T>(acc[j] * scale);
}

// Sums the rows `rows[r]` (each n elements) into out[begin, end), scaled by `scale`.
// Accumulation is in Accumulator<T> (float for half/bfloat16), in tiles that stay
// in L1 so each output element is written once.
template <typename T>
void SumRows(const std::vector<const T*>& rows, typename Accumulator<T>::type scale,
             int64_t begin, int64_t end, bool stream, T* __restrict__ out) {
  using A = typename Accumulator<T>::type;
  constexpr int64_t kTile = 1024;  // 4-8 KiB of accumulators: stays in L1
  alignas(64) A acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(kTile, end - t);
    if (rows.empty()) {
      for (int64_t j = 0; j < len; ++j) out[t + j] = T(A(0));
      continue;
    }
    {
      const T* __restrict__ r = rows[0] + t;
      for (int64_t j = 0; j < len; ++j) acc[j] = static_cast<A>(r[j]);
    }
    for (size_t i = 1; i < rows.size(); ++i) {
      const T* __restrict__ r = rows[i] + t;
      for (int64_t j = 0; j < len; ++j) acc[j] += static_cast<A>(r[j]);
    }
    WriteTile<T, A>(acc, scale, len, stream, out + t);
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // order the streaming stores before the op completes
#endif
}

// Device-specific halves of the kernels below.
template <typename Device, typename T>
struct AggregateRows;
template <typename Device, typename T>
struct ZeroFill;

template <typename Device, typename T>
class PartialAggregateOp : public OpKernel {
 public:
  explicit PartialAggregateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string reduction;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduction", &reduction));
    mean_ = reduction == "mean";
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& contributions = ctx->input(0);
    const Tensor& timestamps = ctx->input(1);
    OP_REQUIRES(ctx, contributions.dims() >= 1,
                errors::InvalidArgument(
                    "contributions must have rank >= 1 (shape [k, ...], one row per "
                    "contribution), got shape ",
                    contributions.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(timestamps.shape()),
                errors::InvalidArgument("timestamps must be a vector of shape [k], got shape ",
                                        timestamps.shape().DebugString()));
    const int64_t k = contributions.dim_size(0);
    OP_REQUIRES(ctx, timestamps.dim_size(0) == k,
                errors::InvalidArgument(
                    "timestamps must have one entry per contribution: contributions has shape ",
                    contributions.shape().DebugString(), " (k = ", k,
                    "), timestamps has shape ", timestamps.shape().DebugString()));
    int64_t step, min_contributions, max_staleness;
    if (!ScalarInt64(ctx, 2, "step", &step)) return;
    if (!ScalarInt64(ctx, 3, "min_contributions", &min_contributions)) return;
    if (!ScalarInt64(ctx, 4, "max_staleness", &max_staleness)) return;
    OP_REQUIRES(ctx, min_contributions >= 0,
                errors::InvalidArgument("min_contributions must be >= 0, got ",
                                        min_contributions));
    OP_REQUIRES(ctx, min_contributions <= k,
                errors::InvalidArgument("min_contributions must be <= k = ", k,
                                        " (the number of contributions), got ",
                                        min_contributions,
                                        "; never wait for more contributions than there are "
                                        "workers"));
    if (!NonNegativeStaleness(ctx, max_staleness)) return;

    TensorShape aggregate_shape = contributions.shape();
    aggregate_shape.RemoveDim(0);
    Tensor* aggregate = nullptr;
    Tensor* num_accepted = nullptr;
    Tensor* dropped = nullptr;
    Tensor* met = nullptr;
    if (std::is_same<Device, CPUDevice>::value) {
      OP_REQUIRES_OK(ctx, output_.Allocate(ctx, 0, aggregate_shape, contributions.dtype(),
                                           &aggregate));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, aggregate_shape, &aggregate));
    }
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &num_accepted));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({k}), &dropped));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({}), &met));

    auto ts = timestamps.vec<int64_t>();
    auto dropped_v = dropped->vec<bool>();
    std::vector<int64_t> accepted;
    accepted.reserve(k);
    for (int64_t i = 0; i < k; ++i) {
      OP_REQUIRES(ctx, ts(i) <= step,
                  errors::InvalidArgument(
                      "timestamps[", i, "] = ", ts(i), " is after the current step ", step,
                      ": a contribution cannot come from the future; stamp each "
                      "contribution with the step of the weights it was computed on"));
      const bool fresh = IsFresh(ts(i), step, max_staleness);
      dropped_v(i) = !fresh;
      if (fresh) accepted.push_back(i);
    }
    const int64_t d = static_cast<int64_t>(accepted.size());
    num_accepted->scalar<int64_t>()() = d;
    met->scalar<bool>()() = d >= min_contributions;

    const int64_t n = aggregate_shape.num_elements();
    using A = typename Accumulator<T>::type;
    // Mean scales by 1/d; with nothing accepted the aggregate is zeros (a sum of
    // nothing), and min_contributions_met says whether that is acceptable.
    const int64_t divisor = (mean_ && d > 0) ? d : 1;
    AggregateRows<Device, T>::Run(ctx, contributions, accepted, n, divisor, aggregate);
  }

 private:
  bool mean_;
  ReusableOutput output_;
};

template <typename T>
struct AggregateRows<CPUDevice, T> {
  static void Run(OpKernelContext* ctx, const Tensor& contributions,
                  const std::vector<int64_t>& accepted, int64_t n, int64_t divisor,
                  Tensor* out) {
    using A = typename Accumulator<T>::type;
    if (n == 0) return;
    const A scale = A(1) / static_cast<A>(divisor);
    const T* base = contributions.flat<T>().data();
    std::vector<const T*> rows;
    rows.reserve(accepted.size());
    for (int64_t i : accepted) rows.push_back(base + i * n);
    T* dst = out->flat<T>().data();
    const int64_t bytes_per_element =
        static_cast<int64_t>(sizeof(T)) * (static_cast<int64_t>(rows.size()) + 1);
    constexpr int64_t kStreamMinBytes = int64_t{8} << 20;
    const bool stream = out->TotalBytes() >= kStreamMinBytes;
    ParallelElementwise(ctx, n, bytes_per_element, [&](int64_t begin, int64_t end) {
      SumRows<T>(rows, scale, begin, end, stream, dst);
    });
  }
};

#if GOOGLE_CUDA
template <typename T>
struct AggregateRows<GPUDevice, T> {
  static void Run(OpKernelContext* ctx, const Tensor& contributions,
                  const std::vector<int64_t>& accepted, int64_t n, int64_t divisor,
                  Tensor* out) {
    OP_REQUIRES(ctx, contributions.dim_size(0) <= kMaxGpuContributions,
                errors::InvalidArgument("on GPU, TfSync>PartialAggregate takes at most ",
                                        kMaxGpuContributions, " contributions, got ",
                                        contributions.dim_size(0),
                                        "; aggregate in groups or place the op on CPU"));
    if (n == 0) return;
    RowMask mask = {};
    for (int64_t i : accepted) mask.bits[i / 64] |= uint64_t{1} << (i % 64);
    GpuLaunch<T>::PartialAggregate(ctx->eigen_device<GPUDevice>(),
                                   contributions.flat<T>().data(), contributions.dim_size(0), n,
                                   mask, divisor, out->flat<T>().data());
  }
};
#endif  // GOOGLE_CUDA

// One worker's contribution before an allreduce: passed through unchanged (the
// same buffer, no copy) when fresh, zeros when stale, with weight 1 or 0.
template <typename Device, typename T>
class MaskStaleOp : public OpKernel {
 public:
  explicit MaskStaleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    int64_t timestamp, step, max_staleness;
    if (!ScalarInt64(ctx, 1, "timestamp", &timestamp)) return;
    if (!ScalarInt64(ctx, 2, "step", &step)) return;
    if (!ScalarInt64(ctx, 3, "max_staleness", &max_staleness)) return;
    if (!NonNegativeStaleness(ctx, max_staleness)) return;
    OP_REQUIRES(ctx, timestamp <= step,
                errors::InvalidArgument(
                    "timestamp = ", timestamp, " is after the current step ", step,
                    ": a contribution cannot come from the future; stamp each contribution "
                    "with the step of the weights it was computed on"));
    const bool fresh = IsFresh(timestamp, step, max_staleness);
    Tensor* weight = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &weight));
    weight->scalar<float>()() = fresh ? 1.0f : 0.0f;
    const Tensor& tensor = ctx->input(0);
    if (fresh) {
      ctx->set_output(0, tensor);
      return;
    }
    Tensor* masked = nullptr;
    if (!ctx->forward_input_to_output_with_shape(0, 0, tensor.shape(), &masked)) {
      if (std::is_same<Device, CPUDevice>::value) {
        OP_REQUIRES_OK(ctx, output_.Allocate(ctx, 0, tensor.shape(), tensor.dtype(), &masked));
      } else {
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensor.shape(), &masked));
      }
    }
    ZeroFill<Device, T>::Run(ctx, masked);
  }

 private:
  ReusableOutput output_;
};

template <typename T>
struct ZeroFill<CPUDevice, T> {
  static void Run(OpKernelContext* ctx, Tensor* out) {
    // All-zero bits are +0 in every supported floating-point type.
    char* dst = reinterpret_cast<char*>(out->flat<T>().data());
    ParallelElementwise(ctx, out->NumElements(), sizeof(T), [&](int64_t begin, int64_t end) {
      std::memset(dst + begin * sizeof(T), 0, (end - begin) * sizeof(T));
    });
  }
};

#if GOOGLE_CUDA
template <typename T>
struct ZeroFill<GPUDevice, T> {
  static void Run(OpKernelContext* ctx, Tensor* out) {
    GpuLaunch<T>::Zero(ctx->eigen_device<GPUDevice>(), out->flat<T>().data(),
                       out->NumElements());
  }
};
#endif  // GOOGLE_CUDA

#define TFSYNC_REGISTER_CPU(T)                                                            \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("TfSync>PartialAggregate").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      PartialAggregateOp<CPUDevice, T>);                                                  \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("TfSync>MaskStale").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),      \
      MaskStaleOp<CPUDevice, T>);
TFSYNC_REGISTER_CPU(Eigen::half)
TFSYNC_REGISTER_CPU(Eigen::bfloat16)
TFSYNC_REGISTER_CPU(float)
TFSYNC_REGISTER_CPU(double)
#undef TFSYNC_REGISTER_CPU

#if GOOGLE_CUDA
// Timestamps, counts and flags are small and consumed on the host.
#define TFSYNC_REGISTER_GPU(T)                                                            \
  REGISTER_KERNEL_BUILDER(Name("TfSync>PartialAggregate")                                 \
                              .Device(tensorflow::DEVICE_GPU)                             \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("timestamps")                                   \
                              .HostMemory("step")                                         \
                              .HostMemory("min_contributions")                            \
                              .HostMemory("max_staleness")                                \
                              .HostMemory("num_accepted")                                 \
                              .HostMemory("dropped")                                      \
                              .HostMemory("min_contributions_met"),                       \
                          PartialAggregateOp<GPUDevice, T>);                              \
  REGISTER_KERNEL_BUILDER(Name("TfSync>MaskStale")                                        \
                              .Device(tensorflow::DEVICE_GPU)                             \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("timestamp")                                    \
                              .HostMemory("step")                                         \
                              .HostMemory("max_staleness")                                \
                              .HostMemory("weight"),                                      \
                          MaskStaleOp<GPUDevice, T>);
TFSYNC_REGISTER_GPU(Eigen::half)
TFSYNC_REGISTER_GPU(Eigen::bfloat16)
TFSYNC_REGISTER_GPU(float)
TFSYNC_REGISTER_GPU(double)
#undef TFSYNC_REGISTER_GPU
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tfsync
