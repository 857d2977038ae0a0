// The bodies of tfsync's CUDA kernels and their launch (how a launch is shaped,
// which parameters it gets), as __host__ __device__ code templated on an executor:
// the GPU's (GpuExec in launch.cuh: a __global__ kernel per body, launched on a
// stream) or the standalone test program's, which runs the same bodies on the CPU
// thread by thread over the very grid the GPU launch would use, so that their
// indexing, their launch decisions and their arithmetic are checked on machines
// without a GPU.
//
// The kernels are memory-bound streams. Each thread moves 16 bytes of every array
// per step (a Pack: one vector load or store, or two for the float state of the
// 16-bit types) when every pointer is 16-byte aligned, as TensorFlow's GPU buffers
// are, and one element otherwise (a slice of a buffer can start anywhere); the
// n % kPack elements left over are taken by the grid's first threads. The loops
// are grid-stride over int64, so a grid capped at kMaxBlocks covers any n.
#ifndef TFSYNC_OPS_CC_KERNELS_CUDA_ELEMENTWISE_CUH_
#define TFSYNC_OPS_CC_KERNELS_CUDA_ELEMENTWISE_CUH_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tfsync_cuda.h"

#define TFSYNC_HD __host__ __device__ __forceinline__

namespace tfsync {
namespace cuda {
namespace detail {

constexpr int kThreads = 256;          // per block: a multiple of the warp
constexpr int64_t kMaxBlocks = 65536;  // 16M threads; larger arrays are strided over
constexpr int kVectorBytes = 16;

// ---- IEEE arithmetic, each operation rounded to nearest: on the GPU the _rn
// intrinsics, which the compiler never contracts into a fused multiply-add (the CPU
// kernels make none either); on the CPU the plain operators (the test program is
// compiled with -ffp-contract=off). ----
TFSYNC_HD float Add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TFSYNC_HD double Add(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
TFSYNC_HD float Sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TFSYNC_HD double Sub(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
TFSYNC_HD float Mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TFSYNC_HD double Mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
TFSYNC_HD float Div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TFSYNC_HD double Div(double a, double b) {
#ifdef __CUDA_ARCH__
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
TFSYNC_HD float Sqrt(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}
TFSYNC_HD double Sqrt(double a) {
#ifdef __CUDA_ARCH__
  return __dsqrt_rn(a);
#else
  return __builtin_sqrt(a);
#endif
}

// ---- An element to its accumulation type and back (round to nearest even). ----
TFSYNC_HD float ToAcc(__half x) { return __half2float(x); }
TFSYNC_HD float ToAcc(__nv_bfloat16 x) { return __bfloat162float(x); }
TFSYNC_HD float ToAcc(float x) { return x; }
TFSYNC_HD double ToAcc(double x) { return x; }

template <typename T>
TFSYNC_HD T FromAcc(typename Accumulator<T>::type x) {
  if constexpr (std::is_same<T, __half>::value) {
    return __float2half_rn(x);
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __float2bfloat16_rn(x);
  } else {
    return x;
  }
}

// The bits of an element type and its exponent field: every exponent bit set is NaN or
// infinity in binary16, bfloat16, binary32 and binary64 alike (as FloatBits in
// ../tfsync_kernels.h, which the CPU kernels test).
template <typename T>
struct Bits;
template <>
struct Bits<__half> {
  using type = uint16_t;
  static constexpr type kExponent = 0x7c00u;
};
template <>
struct Bits<__nv_bfloat16> {
  using type = uint16_t;
  static constexpr type kExponent = 0x7f80u;
};
template <>
struct Bits<float> {
  using type = uint32_t;
  static constexpr type kExponent = 0x7f800000u;
};
template <>
struct Bits<double> {
  using type = uint64_t;
  static constexpr type kExponent = 0x7ff0000000000000ull;
};

template <typename T>
TFSYNC_HD typename Bits<T>::type NonFinite(typename Bits<T>::type bits) {
  using B = typename Bits<T>::type;
  return static_cast<B>((bits & Bits<T>::kExponent) == Bits<T>::kExponent);
}

// The element whose bits these are.
template <typename T>
TFSYNC_HD T FromBits(typename Bits<T>::type bits) {
  T x;
  memcpy(&x, &bits, sizeof(T));
  return x;
}

// ---- Packs: N consecutive elements, loaded and stored as one or two vectors. ----
template <typename T, int N>
struct alignas(sizeof(T) * N < kVectorBytes ? sizeof(T) * N : kVectorBytes) Pack {
  T v[N];
};

template <int N, typename T>
TFSYNC_HD Pack<T, N> Load(const T* p, int64_t pack) {
  return reinterpret_cast<const Pack<T, N>*>(p)[pack];
}
template <int N, typename T>
TFSYNC_HD void Store(T* p, int64_t pack, const Pack<T, N>& x) {
  reinterpret_cast<Pack<T, N>*>(p)[pack] = x;
}

// The elements of T that fill one vector.
template <typename T>
constexpr int VectorPack() {
  return kVectorBytes / static_cast<int>(sizeof(T));
}

inline bool Aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kVectorBytes == 0; }
template <typename... P>
bool AllAligned(const P*... p) {
  return (Aligned(p) && ...);
}

// A thread's place in the grid: its first pack and the number of threads.
struct Grid {
  int64_t first;
  int64_t stride;
};

#ifdef __CUDACC__
__device__ __forceinline__ Grid ThisThread() {
  return Grid{static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
              static_cast<int64_t>(gridDim.x) * blockDim.x};
}
#endif

// The blocks of a launch over n elements in packs of `pack`.
inline unsigned Blocks(int64_t n, int pack) {
  const int64_t items = (n + pack - 1) / pack;
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(1, (items + kThreads - 1) / kThreads),
                                                 kMaxBlocks));
}

// Calls run(std::integral_constant<int, P>{}, blocks) with P = kPack when every pointer
// is aligned for it, else P = 1, and returns what it returns; n == 0 calls nothing.
template <int kPack, typename Run>
cudaError_t Dispatch(int64_t n, bool aligned, Run&& run) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (aligned) return run(std::integral_constant<int, kPack>{}, Blocks(n, kPack));
  return run(std::integral_constant<int, 1>{}, Blocks(n, 1));
}

// ---- The element formulas: those of the CPU kernels, operation for operation. ----

// g + lambda * g * g * (w_now - w_stale), associated as written: ((lambda * g) * g) * delta.
template <typename T>
TFSYNC_HD T DelayCompensateElement(T g, T w_now, T w_stale, typename Accumulator<T>::type lambda) {
  const auto gi = ToAcc(g);
  const auto delta = Sub(ToAcc(w_now), ToAcc(w_stale));
  return FromAcc<T>(Add(gi, Mul(Mul(Mul(lambda, gi), gi), delta)));
}

template <typename A>
struct AdaptiveParams {
  A lambda0, momentum, one_minus_momentum, epsilon;
};

// v = m * v + (1 - m) * g * g; g + lambda0 / sqrt(v + epsilon) * (g * g) * delta, associated
// as written: ((lambda0 / sqrt(v + epsilon)) * gg) * delta.
template <typename T, typename A>
TFSYNC_HD T AdaptiveElement(T g, T w_now, T w_stale, A* v, const AdaptiveParams<A>& p) {
  const A gi = ToAcc(g);
  const A gg = Mul(gi, gi);
  const A vi = Add(Mul(p.momentum, *v), Mul(p.one_minus_momentum, gg));
  *v = vi;
  const A delta = Sub(ToAcc(w_now), ToAcc(w_stale));
  return FromAcc<T>(Add(gi, Mul(Mul(Div(p.lambda0, Sqrt(Add(vi, p.epsilon))), gg), delta)));
}

// ---- Kernel bodies: one thread's share of a launch. No __restrict__ on g and out,
// which may be one buffer; each pack is read before it is written, by one thread. ----

template <typename T, int N>
TFSYNC_HD void DelayCompensateBody(Grid grid, const T* g, const T* w_now, const T* w_stale,
                                   typename Accumulator<T>::type lambda, T* out, int64_t n) {
  const int64_t packs = n / N;
  for (int64_t p = grid.first; p < packs; p += grid.stride) {
    const Pack<T, N> gp = Load<N>(g, p), wn = Load<N>(w_now, p), ws = Load<N>(w_stale, p);
    Pack<T, N> o;
#pragma unroll
    for (int k = 0; k < N; ++k) o.v[k] = DelayCompensateElement(gp.v[k], wn.v[k], ws.v[k], lambda);
    Store<N>(out, p, o);
  }
  for (int64_t i = packs * N + grid.first; i < n; i += grid.stride) {
    out[i] = DelayCompensateElement(g[i], w_now[i], w_stale[i], lambda);
  }
}

template <typename T, int N>
TFSYNC_HD void AdaptiveBody(Grid grid, typename Accumulator<T>::type* v, const T* g, const T* w_now,
                            const T* w_stale, AdaptiveParams<typename Accumulator<T>::type> params,
                            T* out, int64_t n) {
  using A = typename Accumulator<T>::type;
  const int64_t packs = n / N;
  for (int64_t p = grid.first; p < packs; p += grid.stride) {
    const Pack<T, N> gp = Load<N>(g, p), wn = Load<N>(w_now, p), ws = Load<N>(w_stale, p);
    Pack<A, N> vp = Load<N>(v, p);
    Pack<T, N> o;
#pragma unroll
    for (int k = 0; k < N; ++k) o.v[k] = AdaptiveElement(gp.v[k], wn.v[k], ws.v[k], &vp.v[k], params);
    Store<N>(v, p, vp);
    Store<N>(out, p, o);
  }
  for (int64_t i = packs * N + grid.first; i < n; i += grid.stride) {
    out[i] = AdaptiveElement(g[i], w_now[i], w_stale[i], &v[i], params);
  }
}

// Whether none of this thread's elements is NaN or infinite: the exponent tests are OR-ed
// into an integer, so no branch depends on the data.
template <typename T, int N>
TFSYNC_HD bool AllFiniteBody(Grid grid, const typename Bits<T>::type* x, int64_t n) {
  using B = typename Bits<T>::type;
  B bad = 0;
  const int64_t packs = n / N;
  for (int64_t p = grid.first; p < packs; p += grid.stride) {
    const Pack<B, N> xp = Load<N>(x, p);
#pragma unroll
    for (int k = 0; k < N; ++k) bad |= NonFinite<T>(xp.v[k]);
  }
  for (int64_t i = packs * N + grid.first; i < n; i += grid.stride) bad |= NonFinite<T>(x[i]);
  return bad == 0;
}

// out = scale * x over this thread's elements, and whether none of them is NaN or infinite:
// each element is loaded once, as bits, and tested and converted from those.
template <typename T, int N>
TFSYNC_HD bool ScaleAllFiniteBody(Grid grid, const T* x, T* out, typename Accumulator<T>::type scale,
                                  int64_t n) {
  using B = typename Bits<T>::type;
  const B* xb = reinterpret_cast<const B*>(x);
  B bad = 0;
  const int64_t packs = n / N;
  for (int64_t p = grid.first; p < packs; p += grid.stride) {
    const Pack<B, N> bits = Load<N>(xb, p);
    Pack<T, N> o;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      bad |= NonFinite<T>(bits.v[k]);
      o.v[k] = FromAcc<T>(Mul(scale, ToAcc(FromBits<T>(bits.v[k]))));
    }
    Store<N>(out, p, o);
  }
  for (int64_t i = packs * N + grid.first; i < n; i += grid.stride) {
    const B bits = xb[i];
    bad |= NonFinite<T>(bits);
    out[i] = FromAcc<T>(Mul(scale, ToAcc(FromBits<T>(bits))));
  }
  return bad == 0;
}

}  // namespace detail
}  // namespace cuda
}  // namespace tfsync


namespace tfsync {
namespace cuda {
namespace detail {

// ---- The bodies as types, for the executors: Op::Body(grid, args...) is one thread's
// share; a flag op's body returns whether its elements were all finite. ----
template <typename T, int N>
struct DelayCompensateOp {
  template <typename... Args>
  TFSYNC_HD static void Body(Grid grid, Args... args) {
    DelayCompensateBody<T, N>(grid, args...);
  }
};
template <typename T, int N>
struct AdaptiveOp {
  template <typename... Args>
  TFSYNC_HD static void Body(Grid grid, Args... args) {
    AdaptiveBody<T, N>(grid, args...);
  }
};
template <typename T, int N>
struct AllFiniteOp {
  template <typename... Args>
  TFSYNC_HD static bool Body(Grid grid, Args... args) {
    return AllFiniteBody<T, N>(grid, args...);
  }
};
template <typename T, int N>
struct ScaleAllFiniteOp {
  template <typename... Args>
  TFSYNC_HD static bool Body(Grid grid, Args... args) {
    return ScaleAllFiniteBody<T, N>(grid, args...);
  }
};

// ---- The launches, on an executor with exec.Run<Op>(blocks, args...) and
// exec.RunFlag<Op>(blocks, finite, args...) (the latter clears *finite when a thread's
// body returned false). ----

template <typename Exec, typename T>
cudaError_t DelayCompensate(const Exec& exec, const T* g, const T* w_now, const T* w_stale,
                            float lambda, T* out, int64_t n) {
  using A = typename Accumulator<T>::type;
  const A lam = static_cast<A>(lambda);
  return Dispatch<VectorPack<T>()>(n, AllAligned(g, w_now, w_stale, out), [&](auto pack, unsigned blocks) {
    return exec.template Run<DelayCompensateOp<T, decltype(pack)::value>>(blocks, g, w_now, w_stale, lam,
                                                                          out, n);
  });
}

template <typename Exec, typename T>
cudaError_t DelayCompensateAdaptive(const Exec& exec, typename Accumulator<T>::type* mean_square,
                                    const T* g, const T* w_now, const T* w_stale, float lambda0,
                                    float momentum, float epsilon, T* out, int64_t n) {
  using A = typename Accumulator<T>::type;
  // as the CPU kernel: each parameter rounded to A, and 1 - momentum computed in A
  const AdaptiveParams<A> params{static_cast<A>(lambda0), static_cast<A>(momentum),
                                 static_cast<A>(1) - static_cast<A>(momentum), static_cast<A>(epsilon)};
  const bool aligned = AllAligned(mean_square, g, w_now, w_stale, out);
  return Dispatch<VectorPack<T>()>(n, aligned, [&](auto pack, unsigned blocks) {
    return exec.template Run<AdaptiveOp<T, decltype(pack)::value>>(blocks, mean_square, g, w_now, w_stale,
                                                                   params, out, n);
  });
}

template <typename Exec, typename T>
cudaError_t AllFinite(const Exec& exec, const T* x, int64_t n, bool* finite) {
  using B = typename Bits<T>::type;
  const B* bits = reinterpret_cast<const B*>(x);
  return Dispatch<VectorPack<T>()>(n, Aligned(x), [&](auto pack, unsigned blocks) {
    return exec.template RunFlag<AllFiniteOp<T, decltype(pack)::value>>(blocks, finite, bits, n);
  });
}

template <typename Exec, typename T>
cudaError_t ScaleAllFinite(const Exec& exec, const T* x, T* out, int64_t n, double scale, bool* finite) {
  using A = typename Accumulator<T>::type;
  const A s = static_cast<A>(scale);  // as Horovod's ScaleBuffer and the CPU kernel
  return Dispatch<VectorPack<T>()>(n, AllAligned(x, out), [&](auto pack, unsigned blocks) {
    return exec.template RunFlag<ScaleAllFiniteOp<T, decltype(pack)::value>>(blocks, finite, x, out, s, n);
  });
}

}  // namespace detail
}  // namespace cuda
}  // namespace tfsync

#endif  // TFSYNC_OPS_CC_KERNELS_CUDA_ELEMENTWISE_CUH_
