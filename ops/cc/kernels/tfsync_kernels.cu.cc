// CUDA kernels of tfsync's ops (see delay_compensation_kernels.cc for the semantics
// and the CPU versions they mirror: same formulas, same association order,
// half/bfloat16 computed in float).
// Compiled by setup.py with nvcc only when TensorFlow has CUDA; NOT tested: the
// machines this project is developed on have no GPU.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <algorithm>
#include <climits>

// Relative include: setup.py passes nvcc only TensorFlow's include flags.
#include "tfsync_kernels.h"
#include "tensorflow/core/util/gpu_kernel_helper.h"

namespace tfsync {
namespace {

using GPUDevice = Eigen::GpuDevice;

tensorflow::GpuLaunchConfig Config(const GPUDevice& d, int64_t n) {
  // The loops below are grid-stride over int64, so a capped grid covers any n.
  return tensorflow::GetGpuLaunchConfig(static_cast<int>(std::min<int64_t>(n, INT_MAX)), d);
}

template <typename T, typename A>
__global__ void DelayCompensateKernel(const T* g, const T* __restrict__ w_now,
                                      const T* __restrict__ w_stale, A lambda, T* out, int64_t n) {
  // g and out may be the same buffer (forwarded input): no __restrict__ on them.
  for (int64_t i : tensorflow::GpuGridRangeX<int64_t>(n)) {
    const A gi = static_cast<A>(g[i]);
    const A delta = static_cast<A>(w_now[i]) - static_cast<A>(w_stale[i]);
    out[i] = static_cast<T>(gi + lambda * gi * gi * delta);
  }
}

template <typename T, typename A>
__global__ void DelayCompensateAdaptiveKernel(A* __restrict__ v, const T* g,
                                              const T* __restrict__ w_now,
                                              const T* __restrict__ w_stale, A lambda0,
                                              A momentum, A epsilon, T* out, int64_t n) {
  const A one_minus_momentum = A(1) - momentum;
  for (int64_t i : tensorflow::GpuGridRangeX<int64_t>(n)) {
    const A gi = static_cast<A>(g[i]);
    const A gg = gi * gi;
    const A vi = momentum * v[i] + one_minus_momentum * gg;
    v[i] = vi;
    const A delta = static_cast<A>(w_now[i]) - static_cast<A>(w_stale[i]);
    out[i] = static_cast<T>(gi + lambda0 / sqrt(vi + epsilon) * gg * delta);
  }
}

}  // namespace

template <typename T>
void GpuLaunch<T>::DelayCompensate(const GPUDevice& d, const T* g, const T* w_now,
                                   const T* w_stale, float lambda, T* out, int64_t n) {
  using A = typename Accumulator<T>::type;
  if (n == 0) return;
  auto cfg = Config(d, n);
  TF_CHECK_OK(tensorflow::GpuLaunchKernel(DelayCompensateKernel<T, A>, cfg.block_count,
                                          cfg.thread_per_block, 0, d.stream(), g, w_now, w_stale,
                                          static_cast<A>(lambda), out, n));
}

template <typename T>
void GpuLaunch<T>::DelayCompensateAdaptive(const GPUDevice& d,
                                           typename Accumulator<T>::type* mean_square,
                                           const T* g, const T* w_now, const T* w_stale,
                                           float lambda0, float momentum, float epsilon, T* out,
                                           int64_t n) {
  using A = typename Accumulator<T>::type;
  if (n == 0) return;
  auto cfg = Config(d, n);
  TF_CHECK_OK(tensorflow::GpuLaunchKernel(
      DelayCompensateAdaptiveKernel<T, A>, cfg.block_count, cfg.thread_per_block, 0, d.stream(),
      mean_square, g, w_now, w_stale, static_cast<A>(lambda0), static_cast<A>(momentum),
      static_cast<A>(epsilon), out, n));
}

template struct GpuLaunch<Eigen::half>;
template struct GpuLaunch<Eigen::bfloat16>;
template struct GpuLaunch<float>;
template struct GpuLaunch<double>;

}  // namespace tfsync

#endif  // GOOGLE_CUDA
