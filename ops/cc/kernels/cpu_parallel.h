// How tfsync's CPU kernels split element-wise work over TensorFlow's intra-op
// thread pool (the worker threads of the OpKernelContext).
#ifndef TFSYNC_OPS_CC_KERNELS_CPU_PARALLEL_H_
#define TFSYNC_OPS_CC_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <functional>

#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tfsync {

// Runs fn(begin, end) over [0, n). The kernels are memory-bound streams, so the
// right split is one large contiguous block per thread (a few per thread for load
// balance), not the many small shards a compute cost model would choose: each
// block must move at least ~512 KiB so that scheduling it costs far less than
// running it, and block starts are multiples of 64 elements so that no two
// threads write the same cache line.
inline void ParallelElementwise(tensorflow::OpKernelContext* ctx, int64_t n,
                                int64_t bytes_per_element,
                                const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  constexpr int64_t kMinBlockBytes = int64_t{512} << 10;
  const int64_t min_block = std::max<int64_t>(64, kMinBlockBytes / std::max<int64_t>(1, bytes_per_element));
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  const int64_t threads = pool == nullptr ? 1 : pool->NumThreads();
  if (threads <= 1 || n < 2 * min_block) {
    fn(0, n);
    return;
  }
  const int64_t blocks = std::min<int64_t>(2 * threads, n / min_block);
  int64_t block = (n + blocks - 1) / blocks;
  block = (block + 63) / 64 * 64;
  using Pool = tsl::thread::ThreadPool;
  pool->ParallelFor(n, Pool::SchedulingParams(Pool::SchedulingStrategy::kFixedBlockSize,
                                              absl::nullopt, block),
                    fn);
}

}  // namespace tfsync

#endif  // TFSYNC_OPS_CC_KERNELS_CPU_PARALLEL_H_
