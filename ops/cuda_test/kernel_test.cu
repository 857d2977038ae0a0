// The standalone test of tfsync's CUDA kernels: built by nvcc alone (no TensorFlow),
// it runs each kernel (ops/cc/kernels/cuda/) against the CPU reference (reference.h:
// the CPU kernels' formulas) and, on a GPU, measures each kernel's bandwidth against a
// device-to-device cudaMemcpy of the same bytes. run.sh builds and runs it.
//
//   kernel_test                  the kernels on the GPU (device 0), then their bandwidth
//   kernel_test --host           the kernels' bodies on the CPU, thread by thread over
//                                the grids the GPU launches use (no GPU needed)
//   kernel_test --dump DIR       writes the reference's cases (inputs and outputs) to DIR
//                                for the comparison with TensorFlow's CPU kernels
//                                (tests/build/test_cuda_kernels.py), computed as those
//                                run: with subnormals flushed to zero (TensorFlow sets
//                                FTZ and DAZ on its threads; x86-64 only)
//   --max-elements N             the largest size tried (default: 33554433 on the GPU,
//                                16777221 with --host)
//
// Every mode first checks the reference against known values. Sizes run from 0 to
// the largest, around the vector width (16 bytes), the block (256 threads) and one
// past a full grid (kMaxBlocks blocks, so that threads take a second pack); every
// dtype the ops take (float16, bfloat16, float32, float64); edge values (NaN with
// several payloads, +/-infinity, +/-0, subnormals, the largest finite values) placed
// among random ones; pointers aligned (vector path) and one element off (scalar
// path); outputs apart and in place.
//
// Subnormals: the kernels keep them (IEEE, nothing is compiled with -ftz or fast math),
// as the reference does here; TensorFlow's CPU kernels see them as zero (FTZ/DAZ on
// TensorFlow's threads). So where an input or a result is subnormal in float32, float64
// or bfloat16, the GPU and CPU kernels differ, by design of the two platforms' modes.
//
// Tolerance, per dtype: 0 ulp (bit for bit; two NaNs are equal whatever their
// payload) for float16, bfloat16, float32 and float64 alike. The kernels make the
// reference's IEEE operations in its order, each rounded to nearest (the _rn
// intrinsics: no fused multiply-add; IEEE division and square root; subnormals kept,
// nothing is compiled with fast math), and round the 16-bit types once from float,
// to nearest even, as the reference does, so there is nothing left to differ.
#include <cuda_runtime.h>
#if defined(__x86_64__)
#include <pmmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <string>
#include <vector>

#include "../cc/kernels/cuda/elementwise.cuh"
#include "../cc/kernels/cuda/quantize.cuh"
#include "../cc/kernels/cuda/tfsync_cuda.h"
#include "reference.h"

namespace {

using reference::BFloat16;
using reference::Half;
namespace detail = tfsync::cuda::detail;

// ---------------------------------------------------------------------------------
// Element types: the reference's, the device's, names, bits.

template <typename R>
struct Dtype;
template <>
struct Dtype<Half> {
  using device = __half;
  using bits = uint16_t;
  static constexpr const char* name = "float16";
};
template <>
struct Dtype<BFloat16> {
  using device = __nv_bfloat16;
  using bits = uint16_t;
  static constexpr const char* name = "bfloat16";
};
template <>
struct Dtype<float> {
  using device = float;
  using bits = uint32_t;
  static constexpr const char* name = "float32";
};
template <>
struct Dtype<double> {
  using device = double;
  using bits = uint64_t;
  static constexpr const char* name = "float64";
};
template <typename R>
using Dev = typename Dtype<R>::device;
template <typename R>
using Acc = typename reference::Acc<R>::type;

static_assert(sizeof(Half) == sizeof(__half) && sizeof(BFloat16) == sizeof(__nv_bfloat16),
              "the reference's 16-bit types are the device's bits");

// The tolerance, in ulps, per dtype (see the top of this file).
template <typename R>
constexpr int kToleranceUlps = 0;

template <typename V>
typename Dtype<V>::bits BitsOf(V x) {
  typename Dtype<V>::bits b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
template <typename V>
V OfBits(uint64_t u) {
  const typename Dtype<V>::bits b = static_cast<typename Dtype<V>::bits>(u);
  V x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

template <typename V>
bool IsNaN(V x) {
  const uint64_t b = BitsOf(x);
  const int width = 8 * sizeof(V);
  const uint64_t magnitude = b & ((uint64_t{1} << (width - 1)) - 1);
  const uint64_t exponent = [] {
    if constexpr (std::is_same<V, Half>::value) return uint64_t{0x7c00};
    if constexpr (std::is_same<V, BFloat16>::value) return uint64_t{0x7f80};
    if constexpr (std::is_same<V, float>::value) return uint64_t{0x7f800000};
    return uint64_t{0x7ff0000000000000};
  }();
  return (magnitude & exponent) == exponent && (magnitude & ~exponent) != 0;
}

// Distance in ulps: 0 for equal bits and for two NaNs; a NaN against a number is "far".
template <typename V>
uint64_t Ulps(V a, V b) {
  if (IsNaN(a) || IsNaN(b)) return IsNaN(a) && IsNaN(b) ? 0 : UINT64_MAX;
  const int width = 8 * sizeof(V);
  const uint64_t sign = uint64_t{1} << (width - 1);
  auto ordered = [&](uint64_t u) {
    const int64_t magnitude = static_cast<int64_t>(u & (sign - 1));
    return (u & sign) ? -magnitude : magnitude;
  };
  const uint64_t ua = BitsOf(a), ub = BitsOf(b);
  if (ua == ub) return 0;
  const int64_t d = ordered(ua) - ordered(ub);
  return static_cast<uint64_t>(d < 0 ? -d : d) + (d == 0 ? 1 : 0);  // +0 vs -0: one apart
}

template <typename V>
double AsDouble(V x) {
  return static_cast<double>(reference::ToAcc(x));
}

// ---------------------------------------------------------------------------------
// Results.

struct Row {
  std::string kernel, dtype;
  int cases = 0;
  int64_t elements = 0;
  int64_t mismatches = 0;
  uint64_t max_ulps = 0;
};

struct Results {
  std::deque<Row> rows;  // For() hands out references: they must survive later rows
  int failures = 0;
  int printed = 0;

  Row& For(const std::string& kernel, const std::string& dtype) {
    for (Row& r : rows) {
      if (r.kernel == kernel && r.dtype == dtype) return r;
    }
    rows.push_back(Row{kernel, dtype});
    return rows.back();
  }

  void Fail(const std::string& what) {
    ++failures;
    if (printed++ < 40) std::printf("MISMATCH %s\n", what.c_str());
  }
};

std::string Describe(const std::string& kernel, const char* dtype, const std::string& variant, int64_t n) {
  return kernel + " " + dtype + " n=" + std::to_string(n) + " " + variant;
}

// Compares got with want element by element within the dtype's tolerance.
template <typename V>
void Compare(Results& results, Row& row, const std::string& where, const char* array, const V* got,
             const V* want, int64_t n, int tolerance) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t ulps = Ulps(got[i], want[i]);
    if (ulps != UINT64_MAX) row.max_ulps = std::max(row.max_ulps, ulps);
    if (ulps > static_cast<uint64_t>(tolerance)) {
      if (bad++ < 3) {
        char line[256];
        std::snprintf(line, sizeof line, "%s: %s[%" PRId64 "] = %.9g (0x%0*" PRIx64 "), expected %.9g (0x%0*" PRIx64 ")",
                      where.c_str(), array, i, AsDouble(got[i]), static_cast<int>(2 * sizeof(V)),
                      static_cast<uint64_t>(BitsOf(got[i])), AsDouble(want[i]), static_cast<int>(2 * sizeof(V)),
                      static_cast<uint64_t>(BitsOf(want[i])));
        results.Fail(line);
      }
    }
  }
  row.elements += n;
  row.mismatches += bad;
  if (bad > 3) results.Fail(where + ": " + array + ": " + std::to_string(bad) + " elements differ in all");
}

void CompareFlag(Results& results, Row& row, const std::string& where, bool got, bool want) {
  if (got != want) {
    ++row.mismatches;
    results.Fail(where + ": finite = " + (got ? "true" : "false") + ", expected " + (want ? "true" : "false"));
  }
}

// ---------------------------------------------------------------------------------
// Where the kernels run: the GPU (the public launchers, on a stream) or the CPU (the
// same launches, each thread of the grid in turn). Both hold "device" buffers.

void CheckCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::printf("FAILED: %s: %s (%s)\n", what, cudaGetErrorString(err), cudaGetErrorName(err));
    std::exit(1);
  }
}

struct Gpu {
  cudaStream_t stream = nullptr;
  static constexpr const char* kName = "GPU";

  Gpu() { CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Gpu() { cudaStreamDestroy(stream); }

  void* Alloc(size_t bytes) {
    void* p = nullptr;
    CheckCuda(cudaMalloc(&p, std::max<size_t>(bytes, 256)), "cudaMalloc");
    return p;
  }
  void Free(void* p) { cudaFree(p); }
  void Upload(void* dst, const void* src, size_t bytes) {
    CheckCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpy to the device");
  }
  void Download(void* dst, const void* src, size_t bytes) {
    CheckCuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpy from the device");
    Sync("a kernel");
  }
  void Sync(const char* what) {
    CheckCuda(cudaStreamSynchronize(stream), what);
    CheckCuda(cudaGetLastError(), what);
  }

  template <typename T>
  cudaError_t DelayCompensate(const T* g, const T* wn, const T* ws, float lambda, T* out, int64_t n) {
    return tfsync::cuda::DelayCompensate(g, wn, ws, lambda, out, n, stream);
  }
  template <typename T, typename A>
  cudaError_t Adaptive(A* v, const T* g, const T* wn, const T* ws, float l0, float m, float eps, T* out,
                       int64_t n) {
    return tfsync::cuda::DelayCompensateAdaptive(v, g, wn, ws, l0, m, eps, out, n, stream);
  }
  cudaError_t SetFlags(bool* flags, int64_t count) { return tfsync::cuda::SetFlags(flags, count, stream); }
  template <typename T>
  cudaError_t AllFinite(const T* x, int64_t n, bool* finite) {
    return tfsync::cuda::AllFinite(x, n, finite, stream);
  }
  template <typename T>
  cudaError_t ScaleAllFinite(const T* x, T* out, int64_t n, double scale, bool* finite) {
    return tfsync::cuda::ScaleAllFinite(x, out, n, scale, finite, stream);
  }
  cudaError_t Quantize(const float* x, int64_t rows, int64_t length, int bits, int64_t block, uint8_t* packed,
                       float* residual) {
    return tfsync::cuda::QuantizeBlocks(x, rows, length, bits, block, packed, residual, stream);
  }
  cudaError_t Dequantize(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block, float* out) {
    return tfsync::cuda::DequantizeBlocks(packed, rows, length, bits, block, out, stream);
  }
  cudaError_t DequantizeSum(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block,
                            float factor, float* out) {
    return tfsync::cuda::DequantizeSum(packed, rows, length, bits, block, factor, out, stream);
  }
};

// Runs a launch's bodies on the CPU: every thread of the grid, one after the other.
struct HostExec {
  template <typename Op, typename... Args>
  cudaError_t Run(unsigned blocks, Args... args) const {
    const int64_t threads = static_cast<int64_t>(blocks) * detail::kThreads;
    for (int64_t t = 0; t < threads; ++t) Op::Body(detail::Grid{t, threads}, args...);
    return cudaSuccess;
  }
  template <typename Op, typename... Args>
  cudaError_t RunFlag(unsigned blocks, bool* finite, Args... args) const {
    const int64_t threads = static_cast<int64_t>(blocks) * detail::kThreads;
    bool all = true;
    for (int64_t t = 0; t < threads; ++t) all = Op::Body(detail::Grid{t, threads}, args...) && all;
    if (!all) *finite = false;
    return cudaSuccess;
  }
};

struct Host {
  static constexpr const char* kName = "CPU (emulated grid)";

  void* Alloc(size_t bytes) {
    // 256-byte aligned, as cudaMalloc's (the vector path needs 16)
    void* p = std::aligned_alloc(256, (std::max<size_t>(bytes, 256) + 255) / 256 * 256);
    if (p == nullptr) {
      std::printf("FAILED: out of host memory (%zu bytes)\n", bytes);
      std::exit(1);
    }
    return p;
  }
  void Free(void* p) { std::free(p); }
  void Upload(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  void Download(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
  void Sync(const char*) {}

  template <typename T>
  cudaError_t DelayCompensate(const T* g, const T* wn, const T* ws, float lambda, T* out, int64_t n) {
    return detail::DelayCompensate(HostExec{}, g, wn, ws, lambda, out, n);
  }
  template <typename T, typename A>
  cudaError_t Adaptive(A* v, const T* g, const T* wn, const T* ws, float l0, float m, float eps, T* out,
                       int64_t n) {
    return detail::DelayCompensateAdaptive(HostExec{}, v, g, wn, ws, l0, m, eps, out, n);
  }
  cudaError_t SetFlags(bool* flags, int64_t count) {
    std::memset(flags, 1, static_cast<size_t>(count));
    return cudaSuccess;
  }
  template <typename T>
  cudaError_t AllFinite(const T* x, int64_t n, bool* finite) {
    return detail::AllFinite(HostExec{}, x, n, finite);
  }
  template <typename T>
  cudaError_t ScaleAllFinite(const T* x, T* out, int64_t n, double scale, bool* finite) {
    return detail::ScaleAllFinite(HostExec{}, x, out, n, scale, finite);
  }
  cudaError_t Quantize(const float* x, int64_t rows, int64_t length, int bits, int64_t block, uint8_t* packed,
                       float* residual) {
    return detail::QuantizeBlocks(HostExec{}, x, detail::QuantizeLayout{rows, length, block, bits}, packed, residual);
  }
  cudaError_t Dequantize(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block, float* out) {
    return detail::DequantizeBlocks(HostExec{}, packed, detail::QuantizeLayout{rows, length, block, bits}, out);
  }
  cudaError_t DequantizeSum(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block,
                            float factor, float* out) {
    return detail::DequantizeSum(HostExec{}, packed, detail::QuantizeLayout{rows, length, block, bits}, factor, out);
  }
};

// A device buffer of `count` elements of V, with room for one more (the misaligned view
// starts one element in).
template <typename M, typename V>
struct Buffer {
  M& mem;
  int64_t count;
  V* base;
  Buffer(M& m, int64_t n) : mem(m), count(n), base(static_cast<V*>(m.Alloc(sizeof(V) * (n + 1)))) {}
  ~Buffer() { mem.Free(base); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  V* at(int offset) { return base + offset; }
  void Put(const std::vector<V>& host, int offset) {
    mem.Upload(base + offset, host.data(), sizeof(V) * host.size());
  }
  std::vector<V> Get(int offset, int64_t n) {
    std::vector<V> host(n);
    mem.Download(host.data(), base + offset, sizeof(V) * n);
    return host;
  }
};

template <typename R>
Dev<R>* D(R* p) {
  return reinterpret_cast<Dev<R>*>(p);
}

// Flags live in uint8_t buffers (std::vector<bool> has no data()); one byte each, as bool.
bool* Flag(uint8_t* p) {
  static_assert(sizeof(bool) == 1, "a flag is one byte");
  return reinterpret_cast<bool*>(p);
}

// ---------------------------------------------------------------------------------
// Inputs: random values with edge values among them, from a fixed seed.

struct Rng {
  uint64_t state;
  uint64_t Next() {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * (static_cast<double>(Next() >> 11) * 0x1.0p-53); }
};

template <typename R>
R FromDouble(double d) {
  return reference::FromAcc<R>(static_cast<Acc<R>>(d));
}

// Bit patterns: finite edges (+/-0, smallest subnormals, largest subnormal, smallest
// normal, +/-largest finite, 1) and non-finite ones (quiet NaN, a signaling NaN's bits,
// negative NaN, +/-infinity).
template <typename R>
struct Edges;
template <>
struct Edges<Half> {
  static std::vector<uint64_t> Finite() { return {0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0xfbff, 0x3c00}; }
  static std::vector<uint64_t> NonFinite() { return {0x7e00, 0x7c01, 0xfe00, 0x7c00, 0xfc00}; }
};
template <>
struct Edges<BFloat16> {
  static std::vector<uint64_t> Finite() { return {0x0000, 0x8000, 0x0001, 0x8001, 0x007f, 0x0080, 0x7f7f, 0xff7f, 0x3f80}; }
  static std::vector<uint64_t> NonFinite() { return {0x7fc0, 0x7f81, 0xffc0, 0x7f80, 0xff80}; }
};
template <>
struct Edges<float> {
  static std::vector<uint64_t> Finite() {
    return {0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007fffff, 0x00800000, 0x7f7fffff, 0xff7fffff, 0x3f800000};
  }
  static std::vector<uint64_t> NonFinite() { return {0x7fc00000, 0x7f800001, 0xffc00000, 0x7f800000, 0xff800000}; }
};
template <>
struct Edges<double> {
  static std::vector<uint64_t> Finite() {
    return {0x0000000000000000, 0x8000000000000000, 0x0000000000000001, 0x8000000000000001, 0x000fffffffffffff,
            0x0010000000000000, 0x7fefffffffffffff, 0xffefffffffffffff, 0x3ff0000000000000};
  }
  static std::vector<uint64_t> NonFinite() {
    return {0x7ff8000000000000, 0x7ff0000000000001, 0xfff8000000000000, 0x7ff0000000000000, 0xfff0000000000000};
  }
};

// n values uniform in [lo, hi); every `every`-th one (from `first`) an edge value in turn.
template <typename R>
std::vector<R> Values(Rng& rng, int64_t n, double lo, double hi, int every, int first, bool non_finite) {
  std::vector<uint64_t> edges = Edges<R>::Finite();
  if (non_finite) {
    const std::vector<uint64_t> more = Edges<R>::NonFinite();
    edges.insert(edges.end(), more.begin(), more.end());
  }
  std::vector<R> x(n);
  size_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = (i % every == first % every) ? OfBits<R>(edges[k++ % edges.size()]) : FromDouble<R>(rng.Uniform(lo, hi));
  }
  return x;
}

// The state of DC-ASGD-a (a mean of squares, >= 0): uniform, with zeros, subnormals and
// large values among them.
template <typename A>
std::vector<A> MeanSquares(Rng& rng, int64_t n) {
  const std::vector<A> edges = {A(0), std::numeric_limits<A>::denorm_min(), std::numeric_limits<A>::min(),
                                A(1), std::numeric_limits<A>::max() / A(4)};
  std::vector<A> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = (i % 53 == 5) ? edges[(i / 53) % edges.size()] : static_cast<A>(rng.Uniform(0, 2));
  return v;
}

// Where a non-finite value is planted: the ends, the middle, the first element past the
// last whole vector (taken by the grid's first threads) and the one before it.
std::vector<int64_t> Positions(int64_t n, int pack) {
  std::vector<int64_t> p = {0, 1, n / 2, n / pack * pack, n / pack * pack - 1, n - 2, n - 1};
  std::vector<int64_t> out;
  for (int64_t i : p) {
    if (i >= 0 && i < n && std::find(out.begin(), out.end(), i) == out.end()) out.push_back(i);
  }
  return out;
}

// ---------------------------------------------------------------------------------
// The checks: each kernel on every size, aligned and one element off, apart and in place.

constexpr float kLambda = 0.37f;
constexpr float kLambda0 = 0.5f, kMomentum = 0.95f, kEpsilon = 1e-7f;
constexpr double kScale = 1.0 / 3.0;
constexpr double kOverflowScale = 2.0;  // the largest finite values overflow to infinity

template <typename M, typename R>
void CheckDelayCompensate(M& mem, Results& results, int64_t n, uint64_t seed) {
  Row& row = results.For("delay_compensate", Dtype<R>::name);
  Rng rng{seed};
  const auto g = Values<R>(rng, n, -2, 2, 61, 0, true);
  const auto wn = Values<R>(rng, n, -4, 4, 67, 3, true);
  const auto ws = Values<R>(rng, n, -4, 4, 71, 6, true);
  std::vector<R> want(n);
  reference::DelayCompensate(g.data(), wn.data(), ws.data(), kLambda, want.data(), n);
  Buffer<M, R> bg(mem, n), bwn(mem, n), bws(mem, n), bout(mem, n);
  for (int offset : {0, 1}) {
    for (bool in_place : {false, true}) {
      const std::string variant = std::string(offset ? "misaligned" : "aligned") + (in_place ? " in place" : "");
      bg.Put(g, offset);
      bwn.Put(wn, offset);
      bws.Put(ws, offset);
      R* out = in_place ? bg.at(offset) : bout.at(offset);
      CheckCuda(mem.DelayCompensate(D(bg.at(offset)), D(bwn.at(offset)), D(bws.at(offset)), kLambda, D(out), n),
                "launching DelayCompensate");
      mem.Sync("DelayCompensate");
      const auto got = (in_place ? bg : bout).Get(offset, n);
      Compare(results, row, Describe("delay_compensate", Dtype<R>::name, variant, n), "out", got.data(), want.data(),
              n, kToleranceUlps<R>);
      ++row.cases;
    }
  }
}

template <typename M, typename R>
void CheckAdaptive(M& mem, Results& results, int64_t n, uint64_t seed) {
  using A = Acc<R>;
  Row& row = results.For("delay_compensate_adaptive", Dtype<R>::name);
  Rng rng{seed};
  const auto g = Values<R>(rng, n, -2, 2, 61, 1, true);
  const auto g2 = Values<R>(rng, n, -2, 2, 89, 4, false);
  const auto wn = Values<R>(rng, n, -4, 4, 67, 2, true);
  const auto ws = Values<R>(rng, n, -4, 4, 71, 5, true);
  const auto v0 = MeanSquares<A>(rng, n);
  // two steps: the state the first leaves is the second's
  std::vector<A> v1 = v0, v2;
  std::vector<R> want1(n), want2(n);
  reference::DelayCompensateAdaptive(v1.data(), g.data(), wn.data(), ws.data(), kLambda0, kMomentum, kEpsilon,
                                     want1.data(), n);
  v2 = v1;
  reference::DelayCompensateAdaptive(v2.data(), g2.data(), wn.data(), ws.data(), kLambda0, kMomentum, kEpsilon,
                                     want2.data(), n);
  Buffer<M, R> bg(mem, n), bwn(mem, n), bws(mem, n), bout(mem, n);
  Buffer<M, A> bv(mem, n);
  for (int offset : {0, 1}) {
    for (bool in_place : {false, true}) {
      const std::string variant = std::string(offset ? "misaligned" : "aligned") + (in_place ? " in place" : "");
      bv.Put(v0, offset);
      bwn.Put(wn, offset);
      bws.Put(ws, offset);
      const std::vector<R>* grads[2] = {&g, &g2};
      const std::vector<R>* wants[2] = {&want1, &want2};
      const std::vector<A>* states[2] = {&v1, &v2};
      for (int step = 0; step < 2; ++step) {
        bg.Put(*grads[step], offset);
        R* out = in_place ? bg.at(offset) : bout.at(offset);
        CheckCuda(mem.Adaptive(bv.at(offset), D(bg.at(offset)), D(bwn.at(offset)), D(bws.at(offset)), kLambda0,
                               kMomentum, kEpsilon, D(out), n),
                  "launching DelayCompensateAdaptive");
        mem.Sync("DelayCompensateAdaptive");
        const std::string where =
            Describe("delay_compensate_adaptive", Dtype<R>::name, variant + " step " + std::to_string(step + 1), n);
        const auto got = (in_place ? bg : bout).Get(offset, n);
        Compare(results, row, where, "out", got.data(), wants[step]->data(), n, kToleranceUlps<R>);
        const auto state = bv.Get(offset, n);
        Compare(results, row, where, "mean_square", state.data(), states[step]->data(), n, kToleranceUlps<A>);
        ++row.cases;
      }
    }
  }
}

template <typename M, typename R>
void CheckFinite(M& mem, Results& results, int64_t n, uint64_t seed) {
  Row& all_row = results.For("all_finite", Dtype<R>::name);
  Row& scale_row = results.For("scale_all_finite", Dtype<R>::name);
  Rng rng{seed};
  auto x = Values<R>(rng, n, -100, 100, 59, 2, false);
  Buffer<M, R> bx(mem, n), bout(mem, n);
  Buffer<M, uint8_t> flags(mem, 4);

  // one run of both kernels on the uploaded x (with `offset`), against the reference
  auto run = [&](const std::string& variant, int offset, double scale, bool in_place) {
    std::vector<R> want(n);
    const bool want_finite = reference::AllFinite(x.data(), n);
    const bool want_scaled_finite = reference::ScaleAllFinite(x.data(), want.data(), n, scale);
    bool* f = Flag(flags.at(0));
    CheckCuda(mem.SetFlags(f, 2), "SetFlags");
    CheckCuda(mem.AllFinite(D(bx.at(offset)), n, f), "launching AllFinite");
    R* out = in_place ? bx.at(offset) : bout.at(offset);
    CheckCuda(mem.ScaleAllFinite(D(bx.at(offset)), D(out), n, scale, f + 1), "launching ScaleAllFinite");
    mem.Sync("AllFinite, ScaleAllFinite");
    const auto got_flags = flags.Get(0, 2);
    CompareFlag(results, all_row, Describe("all_finite", Dtype<R>::name, variant, n), got_flags[0], want_finite);
    const std::string where = Describe("scale_all_finite", Dtype<R>::name, variant, n);
    CompareFlag(results, scale_row, where, got_flags[1], want_scaled_finite);
    const auto got = (in_place ? bx : bout).Get(offset, n);
    Compare(results, scale_row, where, "scaled", got.data(), want.data(), n, kToleranceUlps<R>);
    ++all_row.cases;
    ++scale_row.cases;
    all_row.elements += n;
  };

  for (int offset : {0, 1}) {
    const std::string align = offset ? "misaligned" : "aligned";
    bx.Put(x, offset);
    run(align + " finite", offset, kScale, false);
    run(align + " finite, overflowing scale", offset, kOverflowScale, false);
    // a non-finite value at each position in turn (only that element uploaded and restored)
    const std::vector<uint64_t> bad = Edges<R>::NonFinite();
    const auto positions = Positions(n, offset ? 1 : detail::VectorPack<Dev<R>>());
    for (size_t k = 0; k < positions.size(); ++k) {
      const int64_t i = positions[k];
      const R saved = x[i];
      x[i] = OfBits<R>(bad[k % bad.size()]);
      mem.Upload(bx.at(offset) + i, &x[i], sizeof(R));
      run(align + " non-finite at " + std::to_string(i), offset, kScale, false);
      x[i] = saved;
      mem.Upload(bx.at(offset) + i, &x[i], sizeof(R));
    }
    run(align + " finite, in place", offset, kScale, true);  // last: it overwrites x's buffer
  }
}

// Several tensors, one flag each: SetFlags sets them all, each kernel clears its own only.
template <typename M, typename R>
void CheckFlagsApart(M& mem, Results& results, int64_t n, uint64_t seed) {
  Row& row = results.For("all_finite", Dtype<R>::name);
  if (n == 0) return;
  Rng rng{seed};
  auto finite = Values<R>(rng, n, -1, 1, 59, 0, false);
  auto poisoned = finite;
  poisoned[n - 1] = OfBits<R>(Edges<R>::NonFinite()[0]);
  Buffer<M, R> a(mem, n), b(mem, n), out(mem, n);
  Buffer<M, uint8_t> flags(mem, 4);
  a.Put(finite, 0);
  b.Put(poisoned, 0);
  CheckCuda(mem.SetFlags(Flag(flags.at(0)), 4), "SetFlags");
  CheckCuda(mem.AllFinite(D(a.at(0)), n, Flag(flags.at(0))), "launching AllFinite");
  CheckCuda(mem.AllFinite(D(b.at(0)), n, Flag(flags.at(1))), "launching AllFinite");
  CheckCuda(mem.ScaleAllFinite(D(b.at(0)), D(out.at(0)), n, kScale, Flag(flags.at(2))), "launching ScaleAllFinite");
  CheckCuda(mem.ScaleAllFinite(D(a.at(0)), D(out.at(0)), n, kScale, Flag(flags.at(3))), "launching ScaleAllFinite");
  mem.Sync("AllFinite, ScaleAllFinite");
  const auto got = flags.Get(0, 4);
  const bool want[4] = {true, false, false, true};
  for (int i = 0; i < 4; ++i) {
    CompareFlag(results, row, Describe("all_finite", Dtype<R>::name, "four flags, flag " + std::to_string(i), n),
                got[i], want[i]);
  }
  ++row.cases;
}

template <typename M, typename R>
void CheckDtype(M& mem, Results& results, const std::vector<int64_t>& sizes) {
  uint64_t seed = 1;
  for (int64_t n : sizes) {
    CheckDelayCompensate<M, R>(mem, results, n, seed++);
    CheckAdaptive<M, R>(mem, results, n, seed++);
    CheckFinite<M, R>(mem, results, n, seed++);
    CheckFlagsApart<M, R>(mem, results, n, seed++);
  }
}

// Block quantization (float32 only): codes and scales byte for byte, the residual, the
// decoded rows and their sum value for value, against the reference; `length` values per
// row in blocks of `block`, with a block of zeros and values at the codes' ties among them.
template <typename M>
void CheckQuantize(M& mem, Results& results, int64_t rows, int64_t length, int bits, int64_t block, uint64_t seed) {
  const std::string kernel = bits == 8 ? "quantize_blocks int8" : "quantize_blocks 4-bit";
  Row& row = results.For(kernel, "float32");
  Rng rng{seed};
  const int64_t n = rows * length, row_bytes = length * bits / 8 + 4 * (length / block);
  auto x = Values<float>(rng, n, -3, 3, 1 << 30, 0, false);
  for (int64_t i = 0; i < std::min<int64_t>(block, n); ++i) x[i] = 0.0f;  // a block of zeros
  if (n >= 2 * block) {  // ties: halves of the 4-bit step at scale 1
    for (int64_t i = 0; i < block; ++i) x[block + i] = static_cast<float>(i % 15) - 7.0f + (i % 2 ? 0.5f : 0.0f);
    x[block] = 7.0f;
  }
  std::vector<uint8_t> want_packed(static_cast<size_t>(rows * row_bytes));
  std::vector<float> want_residual(n), want_values(n), want_sum(length);
  reference::QuantizeBlocks(x.data(), rows, length, bits, block, want_packed.data(), want_residual.data());
  reference::DequantizeBlocks(want_packed.data(), rows, length, bits, block, want_values.data());
  reference::DequantizeSum(want_packed.data(), rows, length, bits, block, 0.25f, want_sum.data());
  Buffer<M, float> bx(mem, n), bres(mem, n), bvalues(mem, n), bsum(mem, length);
  Buffer<M, uint8_t> bpacked(mem, rows * row_bytes);
  bx.Put(x, 0);
  CheckCuda(mem.Quantize(bx.at(0), rows, length, bits, block, bpacked.at(0), bres.at(0)), "launching QuantizeBlocks");
  CheckCuda(mem.Dequantize(bpacked.at(0), rows, length, bits, block, bvalues.at(0)), "launching DequantizeBlocks");
  CheckCuda(mem.DequantizeSum(bpacked.at(0), rows, length, bits, block, 0.25f, bsum.at(0)), "launching DequantizeSum");
  mem.Sync("QuantizeBlocks, DequantizeBlocks, DequantizeSum");
  const std::string where = kernel + " rows=" + std::to_string(rows) + " length=" + std::to_string(length) +
                            " block=" + std::to_string(block);
  const auto packed = bpacked.Get(0, rows * row_bytes);
  int64_t bad = 0;
  for (size_t i = 0; i < packed.size(); ++i) bad += packed[i] != want_packed[i];
  if (bad) results.Fail(where + ": " + std::to_string(bad) + " packed bytes differ");
  row.mismatches += bad;
  const auto residual = bres.Get(0, n), values = bvalues.Get(0, n), sum = bsum.Get(0, length);
  Compare(results, row, where, "residual", residual.data(), want_residual.data(), n, 0);
  Compare(results, row, where, "values", values.data(), want_values.data(), n, 0);
  Compare(results, row, where, "sum", sum.data(), want_sum.data(), length, 0);
  ++row.cases;
}

template <typename M>
void CheckQuantizeShapes(M& mem, Results& results, int64_t largest) {
  uint64_t seed = 1000;
  for (int bits : {8, 4}) {
    for (int64_t block : {int64_t{2}, int64_t{8}, int64_t{256}}) {
      for (int64_t rows : {int64_t{1}, int64_t{3}}) {
        for (int64_t blocks : {int64_t{1}, int64_t{5}, int64_t{4099}}) {
          if (rows * blocks * block <= largest) CheckQuantize(mem, results, rows, blocks * block, bits, block, seed++);
        }
      }
    }
  }
}

std::vector<int64_t> Sizes(int64_t largest) {
  const int64_t full_grid = detail::kMaxBlocks * detail::kThreads;
  std::vector<int64_t> all = {0,    1,    2,    3,    4,    5,    7,     8,         9,        15,
                              16,   17,   31,   32,   33,   63,   64,    65,        255,      256,
                              257,  1000, 2049, 4097, 65537, (1 << 20) + 3, full_grid + 5, 33554433};
  std::vector<int64_t> sizes;
  for (int64_t n : all) {
    if (n <= largest) sizes.push_back(n);
  }
  return sizes;
}

// ---------------------------------------------------------------------------------
// Known values: the reference's conversions and formulas, worked out by hand.

int SelfCheck() {
  int failed = 0, checked = 0;
  auto expect = [&](bool ok, const std::string& what) {
    ++checked;
    if (!ok) {
      ++failed;
      std::printf("REFERENCE SELF-CHECK FAILED: %s\n", what.c_str());
    }
  };
  auto half = [](float f) { return reference::ToHalf(f).bits; };
  auto bf16 = [](float f) { return reference::ToBFloat16(f).bits; };
  // binary16: exact values, rounding to nearest even at the mantissa's last bit, the
  // largest finite, overflow at 65520 (the midpoint to 65536), subnormals, NaN, -0
  expect(half(1.0f) == 0x3c00, "half(1) = 0x3c00");
  expect(half(-2.0f) == 0xc000, "half(-2) = 0xc000");
  expect(half(65504.0f) == 0x7bff, "half(65504) = 0x7bff");
  expect(half(65519.0f) == 0x7bff, "half(65519) rounds down to 65504");
  expect(half(65520.0f) == 0x7c00, "half(65520) rounds to infinity (tie, to even)");
  expect(half(1.0f + 0x1p-11f) == 0x3c00, "half(1 + 2^-11): a tie, to even (down)");
  expect(half(1.0f + 3 * 0x1p-11f) == 0x3c02, "half(1 + 3 * 2^-11): a tie, to even (up)");
  expect(half(0x1p-24f) == 0x0001, "half(2^-24) = the smallest subnormal");
  expect(half(0x1p-25f) == 0x0000, "half(2^-25): a tie, to even (zero)");
  expect(half(3 * 0x1p-25f) == 0x0002, "half(3 * 2^-25): a tie, to even (2 * 2^-24)");
  expect(half(0x1p-14f) == 0x0400, "half(2^-14) = the smallest normal");
  expect(half(0x1p-14f - 0x1p-25f) == 0x0400, "half(2^-14 - 2^-25) rounds up to the smallest normal");
  expect(half(-0.0f) == 0x8000, "half(-0) = 0x8000");
  expect((half(std::nanf("")) & 0x7fff) > 0x7c00, "half(NaN) is a NaN");
  expect(half(-INFINITY) == 0xfc00, "half(-inf) = 0xfc00");
  expect(reference::ToFloat(Half{0x0001}) == 0x1p-24f, "float(half 0x0001) = 2^-24");
  expect(reference::ToFloat(Half{0x03ff}) == 1023 * 0x1p-24f, "float(half 0x03ff) = 1023 * 2^-24");
  expect(reference::ToFloat(Half{0xfbff}) == -65504.0f, "float(half 0xfbff) = -65504");
  expect(std::isinf(reference::ToFloat(Half{0x7c00})), "float(half 0x7c00) = inf");
  expect(std::isnan(reference::ToFloat(Half{0x7c01})), "float(half 0x7c01) is a NaN");
  // bfloat16: the top 16 bits of a float, rounded to nearest even
  expect(bf16(1.0f) == 0x3f80, "bfloat16(1) = 0x3f80");
  expect(bf16(1.0f + 0x1p-8f) == 0x3f80, "bfloat16(1 + 2^-8): a tie, to even (down)");
  expect(bf16(1.0f + 3 * 0x1p-8f) == 0x3f82, "bfloat16(1 + 3 * 2^-8): a tie, to even (up)");
  expect(bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81, "bfloat16(just above a tie) rounds up");
  expect(bf16(std::numeric_limits<float>::max()) == 0x7f80, "bfloat16(FLT_MAX) rounds to infinity");
  expect(bf16(std::nanf("")) == 0x7fc0 && bf16(-std::nanf("")) == 0xffc0, "bfloat16(+/-NaN) = 0x7fc0 / 0xffc0");
  expect(reference::ToFloat(BFloat16{0x0001}) == 0x1p-133f, "float(bfloat16 0x0001) = 2^-133");
  // the formulas, on values whose results are exact
  {
    const float g[2] = {2.0f, -1.0f}, wn[2] = {3.0f, 0.5f}, ws[2] = {1.0f, 0.25f};
    float out[2];
    reference::DelayCompensate(g, wn, ws, 0.5f, out, 2);  // 2 + 0.5*2*2*2 = 6; -1 + 0.5*1*0.25 = -0.875
    expect(out[0] == 6.0f && out[1] == -0.875f, "delay_compensate on exact values");
    float v[2] = {0.0f, 2.0f};
    reference::DelayCompensateAdaptive(v, g, wn, ws, 1.0f, 0.75f, 3.0f, out, 2);
    // v = 0.75*0 + 0.25*4 = 1; lambda = 1/sqrt(1 + 3) = 0.5; 2 + 0.5*4*2 = 6
    // v = 0.75*2 + 0.25*1 = 1.75; lambda = 1/sqrt(4.75); -1 + lambda*1*0.25
    expect(v[0] == 1.0f && out[0] == 6.0f, "delay_compensate_adaptive on exact values");
    expect(v[1] == 1.75f && out[1] == -1.0f + 1.0f / std::sqrt(4.75f) * 1.0f * 0.25f,
           "delay_compensate_adaptive's state and order of operations");
    const Half h[3] = {reference::ToHalf(3.0f), reference::ToHalf(65504.0f), reference::ToHalf(-1.5f)};
    Half hs[3];
    expect(reference::ScaleAllFinite(h, hs, 3, 0.5), "scale_all_finite: finite half values are finite");
    expect(hs[0].bits == half(1.5f) && hs[1].bits == half(32752.0f) && hs[2].bits == half(-0.75f),
           "scale_all_finite halves exact half values");
    reference::ScaleAllFinite(h, hs, 3, 2.0);
    expect(hs[1].bits == 0x7c00, "scale_all_finite: 65504 * 2 overflows to infinity in half");
    const double d[3] = {1.0, std::numeric_limits<double>::infinity(), 0.0};
    double ds[3];
    expect(!reference::ScaleAllFinite(d, ds, 3, 1.0 / 3), "scale_all_finite: an infinity is not finite");
    expect(ds[0] == 1.0 / 3, "scale_all_finite: float64 keeps the scale in float64");
    const float f1[1] = {1.0f};
    float fs[1];
    reference::ScaleAllFinite(f1, fs, 1, 1.0 / 3);
    expect(fs[0] == static_cast<float>(1.0 / 3), "scale_all_finite: float32 rounds the scale to float32 first");
    const BFloat16 b[2] = {BFloat16{0x3f80}, BFloat16{0x7f81}};
    expect(!reference::AllFinite(b, 2) && reference::AllFinite(b, 1), "all_finite: a bfloat16 NaN is not finite");
    expect(reference::AllFinite(b, 0), "all_finite: an empty tensor is finite");
  }
  std::printf("reference self-check: %d known values, %d wrong\n", checked, failed);
  return failed;
}

// ---------------------------------------------------------------------------------
// --dump: the reference's cases for the comparison with TensorFlow's CPU kernels.

struct Dump {
  std::string dir;
  std::string manifest = "[\n";
  bool first = true;
  int files = 0;

  template <typename V>
  std::string Write(const std::vector<V>& data) {
    const std::string name = "a" + std::to_string(files++) + ".bin";
    FILE* f = std::fopen((dir + "/" + name).c_str(), "wb");
    if (f == nullptr || (data.size() && std::fwrite(data.data(), sizeof(V), data.size(), f) != data.size())) {
      std::printf("FAILED: cannot write %s/%s\n", dir.c_str(), name.c_str());
      std::exit(1);
    }
    std::fclose(f);
    return name;
  }

  // One case: kernel, dtype, n, parameters, named arrays (file names), the expected flag.
  void Case(const std::string& kernel, const char* dtype, int64_t n, const std::string& params,
            const std::vector<std::pair<std::string, std::string>>& arrays, int finite) {
    std::string line = std::string(first ? "" : ",\n") + "{\"kernel\": \"" + kernel + "\", \"dtype\": \"" + dtype +
                       "\", \"n\": " + std::to_string(n) + ", \"params\": {" + params + "}, \"arrays\": {";
    for (size_t i = 0; i < arrays.size(); ++i) {
      line += (i ? ", " : "") + std::string("\"") + arrays[i].first + "\": \"" + arrays[i].second + "\"";
    }
    line += "}, \"finite\": " + std::string(finite < 0 ? "null" : (finite ? "true" : "false")) + "}";
    manifest += line;
    first = false;
  }

  void Finish() {
    FILE* f = std::fopen((dir + "/manifest.json").c_str(), "w");
    if (f == nullptr) {
      std::printf("FAILED: cannot write %s/manifest.json\n", dir.c_str());
      std::exit(1);
    }
    std::fputs((manifest + "\n]\n").c_str(), f);
    std::fclose(f);
  }
};

std::string Num(double x) {
  char s[64];
  std::snprintf(s, sizeof s, "%.17g", x);
  return s;
}

template <typename R>
void DumpDtype(Dump& dump, const std::vector<int64_t>& sizes) {
  using A = Acc<R>;
  const char* dtype = Dtype<R>::name;
  uint64_t seed = 1000;
  for (int64_t n : sizes) {
    Rng rng{seed++};
    const auto g = Values<R>(rng, n, -2, 2, 61, 0, true);
    const auto wn = Values<R>(rng, n, -4, 4, 67, 3, true);
    const auto ws = Values<R>(rng, n, -4, 4, 71, 6, true);
    std::vector<R> out(n);
    reference::DelayCompensate(g.data(), wn.data(), ws.data(), kLambda, out.data(), n);
    dump.Case("delay_compensate", dtype, n, "\"lambda\": " + Num(kLambda),
              {{"g", dump.Write(g)}, {"w_now", dump.Write(wn)}, {"w_stale", dump.Write(ws)}, {"out", dump.Write(out)}},
              -1);

    const auto v0 = MeanSquares<A>(rng, n);
    auto v = v0;
    reference::DelayCompensateAdaptive(v.data(), g.data(), wn.data(), ws.data(), kLambda0, kMomentum, kEpsilon,
                                       out.data(), n);
    dump.Case("delay_compensate_adaptive", dtype, n,
              "\"lambda0\": " + Num(kLambda0) + ", \"momentum\": " + Num(kMomentum) + ", \"epsilon\": " + Num(kEpsilon),
              {{"mean_square", dump.Write(v0)},
               {"g", dump.Write(g)},
               {"w_now", dump.Write(wn)},
               {"w_stale", dump.Write(ws)},
               {"out", dump.Write(out)},
               {"mean_square_out", dump.Write(v)}},
              -1);

    auto x = Values<R>(rng, n, -100, 100, 59, 2, false);
    for (int poisoned = 0; poisoned < 2; ++poisoned) {
      if (poisoned && n == 0) break;
      if (poisoned) x[n / 2] = OfBits<R>(Edges<R>::NonFinite()[n % 5]);
      dump.Case("all_finite", dtype, n, "", {{"x", dump.Write(x)}}, reference::AllFinite(x.data(), n));
      for (double scale : {kScale, kOverflowScale}) {
        const bool finite = reference::ScaleAllFinite(x.data(), out.data(), n, scale);
        dump.Case("scale_all_finite", dtype, n, "\"scale\": " + Num(scale), {{"x", dump.Write(x)}, {"out", dump.Write(out)}},
                  finite);
      }
    }
  }
}

// ---------------------------------------------------------------------------------
// Bandwidth on the GPU: each kernel against cudaMemcpy of the same traffic.

template <typename F>
float Milliseconds(Gpu& gpu, F&& launch, int reps) {
  cudaEvent_t start, stop;
  CheckCuda(cudaEventCreate(&start), "cudaEventCreate");
  CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) launch();  // warm-up
  CheckCuda(cudaEventRecord(start, gpu.stream), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) launch();
  CheckCuda(cudaEventRecord(stop, gpu.stream), "cudaEventRecord");
  CheckCuda(cudaEventSynchronize(stop), "timing");
  float ms = 0;
  CheckCuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}

// The traffic (bytes read + written) of one launch, timed against a device-to-device
// copy of half as many bytes (which reads them and writes them: the same traffic).
void Report(Gpu& gpu, const char* kernel, const char* dtype, int64_t n, double traffic, float kernel_ms) {
  const size_t copy_bytes = static_cast<size_t>(traffic / 2);
  void* src = gpu.Alloc(copy_bytes);
  void* dst = gpu.Alloc(copy_bytes);
  const float copy_ms = Milliseconds(
      gpu, [&] { CheckCuda(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, gpu.stream), "cudaMemcpy"); },
      20);
  gpu.Free(src);
  gpu.Free(dst);
  const double kernel_gbs = traffic / (kernel_ms * 1e6), copy_gbs = traffic / (copy_ms * 1e6);
  std::printf("%-26s %-9s %11" PRId64 " %9.1f %9.3f %10.1f %9.3f %10.1f %7.2f\n", kernel, dtype, n, traffic / 1e6,
              kernel_ms, kernel_gbs, copy_ms, copy_gbs, kernel_gbs / copy_gbs);
}

template <typename R>
void Bandwidth(Gpu& gpu, int64_t n) {
  using T = Dev<R>;
  using A = Acc<R>;
  const char* dtype = Dtype<R>::name;
  Rng rng{7};
  const auto x = Values<R>(rng, n, -1, 1, 1 << 30, 0, false);
  Buffer<Gpu, R> g(gpu, n), wn(gpu, n), ws(gpu, n), out(gpu, n);
  Buffer<Gpu, A> v(gpu, n);
  Buffer<Gpu, uint8_t> flag(gpu, 1);
  for (Buffer<Gpu, R>* b : {&g, &wn, &ws}) b->Put(x, 0);
  CheckCuda(cudaMemsetAsync(v.at(0), 0, sizeof(A) * n, gpu.stream), "cudaMemset");
  const int reps = 20;
  const double t = sizeof(T), a = sizeof(A);
  Report(gpu, "delay_compensate", dtype, n, 4 * t * n, Milliseconds(gpu, [&] {
           CheckCuda(gpu.DelayCompensate(D(g.at(0)), D(wn.at(0)), D(ws.at(0)), kLambda, D(out.at(0)), n), "launch");
         }, reps));
  Report(gpu, "delay_compensate_adaptive", dtype, n, (4 * t + 2 * a) * n, Milliseconds(gpu, [&] {
           CheckCuda(gpu.Adaptive(v.at(0), D(g.at(0)), D(wn.at(0)), D(ws.at(0)), kLambda0, kMomentum, kEpsilon,
                                  D(out.at(0)), n),
                     "launch");
         }, reps));
  Report(gpu, "all_finite", dtype, n, t * n, Milliseconds(gpu, [&] {
           CheckCuda(gpu.AllFinite(D(g.at(0)), n, Flag(flag.at(0))), "launch");
         }, reps));
  Report(gpu, "scale_all_finite", dtype, n, 2 * t * n, Milliseconds(gpu, [&] {
           CheckCuda(gpu.ScaleAllFinite(D(g.at(0)), D(out.at(0)), n, kScale, Flag(flag.at(0))), "launch");
         }, reps));
  gpu.Sync("the bandwidth runs");
}

// ---------------------------------------------------------------------------------

template <typename M>
int RunChecks(M& mem, int64_t largest) {
  const auto sizes = Sizes(largest);
  std::printf("kernels on the %s; sizes 0 to %" PRId64 " (%zu sizes); tolerance 0 ulp for every dtype\n", M::kName,
              sizes.back(), sizes.size());
  Results results;
  const auto begin = std::chrono::steady_clock::now();
  CheckDtype<M, Half>(mem, results, sizes);
  CheckDtype<M, BFloat16>(mem, results, sizes);
  CheckDtype<M, float>(mem, results, sizes);
  CheckDtype<M, double>(mem, results, sizes);
  CheckQuantizeShapes(mem, results, largest);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  std::printf("\n%-26s %-9s %6s %14s %11s %9s %s\n", "kernel", "dtype", "cases", "elements", "mismatches", "max ulp",
              "result");
  for (const Row& r : results.rows) {
    std::printf("%-26s %-9s %6d %14" PRId64 " %11" PRId64 " %9" PRIu64 " %s\n", r.kernel.c_str(), r.dtype.c_str(),
                r.cases, r.elements, r.mismatches, r.max_ulps, r.mismatches ? "FAIL" : "ok");
  }
  std::printf("%s: %d mismatching checks (%.1f s)\n", results.failures ? "FAILED" : "PASSED", results.failures,
              seconds);
  return results.failures;
}

int Usage(const char* argv0) {
  std::printf("usage: %s [--host | --dump DIR] [--max-elements N]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::string mode = "gpu", dir;
  int64_t largest = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--host") {
      mode = "host";
    } else if (arg == "--dump" && i + 1 < argc) {
      mode = "dump";
      dir = argv[++i];
    } else if (arg == "--max-elements" && i + 1 < argc) {
      largest = std::strtoll(argv[++i], nullptr, 10);
      if (largest < 0) return Usage(argv[0]);
    } else {
      return Usage(argv[0]);
    }
  }
  if (SelfCheck() != 0) return 1;

  if (mode == "dump") {
#if defined(__x86_64__)
    // after the self-check (whose known values include subnormals): TensorFlow's mode
    _MM_SET_FLUSH_ZERO_MODE(_MM_FLUSH_ZERO_ON);
    _MM_SET_DENORMALS_ZERO_MODE(_MM_DENORMALS_ZERO_ON);
#else
    std::printf("FAILED: --dump computes as TensorFlow's CPU kernels on x86-64 (FTZ/DAZ); this is another CPU\n");
    return 1;
#endif
    Dump dump{dir};
    const auto sizes = Sizes(largest < 0 ? 65537 : largest);
    DumpDtype<Half>(dump, sizes);
    DumpDtype<BFloat16>(dump, sizes);
    DumpDtype<float>(dump, sizes);
    DumpDtype<double>(dump, sizes);
    dump.Finish();
    std::printf("wrote %d arrays and %s/manifest.json\n", dump.files, dir.c_str());
    return 0;
  }
  if (mode == "host") {
    Host host;
    return RunChecks(host, largest < 0 ? detail::kMaxBlocks * detail::kThreads + 5 : largest) ? 1 : 0;
  }

  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("FAILED: no usable GPU: cudaGetDeviceCount: %s (%d devices). Run with --host to check the kernels' "
                "bodies on the CPU, or on a machine whose `nvidia-smi` lists a GPU.\n",
                err == cudaSuccess ? "no error" : cudaGetErrorString(err), devices);
    return 1;
  }
  cudaDeviceProp prop;
  CheckCuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("GPU 0: %s, compute capability %d.%d, %d SMs, %.1f GiB; driver CUDA %d.%d, runtime %d.%d\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem / double(1 << 30), driver / 1000,
              (driver % 1000) / 10, runtime / 1000, (runtime % 1000) / 10);
  Gpu gpu;
  const int64_t n = largest < 0 ? 33554433 : largest;
  const int failures = RunChecks(gpu, n);
  const int64_t bandwidth_n = std::max<int64_t>(Sizes(n).back(), 1);
  std::printf("\nbandwidth at %" PRId64 " elements, aligned, mean of 20 launches after 3 (traffic: bytes read + "
              "written; the copy is cudaMemcpyAsync device to device of half that many bytes)\n",
              bandwidth_n);
  std::printf("%-26s %-9s %11s %9s %9s %10s %9s %10s %7s\n", "kernel", "dtype", "elements", "MB", "ms", "GB/s",
              "copy ms", "copy GB/s", "of copy");
  Bandwidth<Half>(gpu, bandwidth_n);
  Bandwidth<BFloat16>(gpu, bandwidth_n);
  Bandwidth<float>(gpu, bandwidth_n);
  Bandwidth<double>(gpu, bandwidth_n);
  return failures ? 1 : 0;
}
