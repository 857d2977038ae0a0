// The CPU reference the standalone test program checks tfsync's CUDA kernels
// against: the formulas of the op library's CPU kernels
// (ops/cc/kernels/delay_compensation_kernels.cc, finite_kernels.cc), operation for
// operation and in the same order, in plain C++ (no CUDA, no TensorFlow), with the
// 16-bit types computed in float and rounded to nearest even once per stored value,
// as Eigen::half and Eigen::bfloat16 do in those kernels. Compiled with
// -ffp-contract=off, so no multiply-add is fused here either.
//
// Checked twice: against known values (SelfCheck in kernel_test.cu), and against the
// TensorFlow CPU kernels themselves on the cases `kernel_test --dump` writes
// (tests/build/test_cuda_kernels.py).
#ifndef TFSYNC_OPS_CUDA_TEST_REFERENCE_H_
#define TFSYNC_OPS_CUDA_TEST_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace reference {

// binary16 and bfloat16 as their bits.
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float FloatFromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float ToFloat(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu;
  const uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) return FloatFromBits(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  return FloatFromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// Round to nearest, ties to even; NaN stays NaN (quiet), overflow becomes infinity.
inline Half ToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Half{static_cast<uint16_t>(sign | 0x7e00u)};
  if (magnitude >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
    const float scaled = FloatFromBits(magnitude) * 16777216.0f;  // exact: a power of two
    return Half{static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)))};
  }
  uint32_t rebiased = magnitude - 0x38000000u;  // exponent 127 -> 15
  rebiased += 0xfffu + ((rebiased >> 13) & 1u);  // ties to even on the 13 bits dropped
  return Half{static_cast<uint16_t>(sign | (rebiased >> 13))};
}

inline float ToFloat(BFloat16 b) { return FloatFromBits(static_cast<uint32_t>(b.bits) << 16); }

// Round to nearest, ties to even; NaN becomes the quiet NaN of its sign (as Eigen does).
inline BFloat16 ToBFloat16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u & 0x80000000u) ? 0xffc0u : 0x7fc0u)};
  return BFloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

// The type an element is computed in, and the conversions to it and back.
template <typename T>
struct Acc {
  using type = T;
};
template <>
struct Acc<Half> {
  using type = float;
};
template <>
struct Acc<BFloat16> {
  using type = float;
};

inline float ToAcc(Half x) { return ToFloat(x); }
inline float ToAcc(BFloat16 x) { return ToFloat(x); }
inline float ToAcc(float x) { return x; }
inline double ToAcc(double x) { return x; }

template <typename T>
T FromAcc(typename Acc<T>::type x);
template <>
inline Half FromAcc<Half>(float x) {
  return ToHalf(x);
}
template <>
inline BFloat16 FromAcc<BFloat16>(float x) {
  return ToBFloat16(x);
}
template <>
inline float FromAcc<float>(float x) {
  return x;
}
template <>
inline double FromAcc<double>(double x) {
  return x;
}

// Whether every exponent bit is set (NaN or infinity), tested on the bits as the CPU
// kernels' FloatBits test is.
inline bool NonFinite(Half x) { return (x.bits & 0x7c00u) == 0x7c00u; }
inline bool NonFinite(BFloat16 x) { return (x.bits & 0x7f80u) == 0x7f80u; }
inline bool NonFinite(float x) { return (FloatBits(x) & 0x7f800000u) == 0x7f800000u; }
inline bool NonFinite(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

// DelayCompensateLoop: out = g + lambda * g * g * (w_now - w_stale), lambda rounded to A.
template <typename T>
void DelayCompensate(const T* g, const T* w_now, const T* w_stale, float lambda, T* out, int64_t n) {
  using A = typename Acc<T>::type;
  const A lam = static_cast<A>(lambda);
  for (int64_t i = 0; i < n; ++i) {
    const A gi = ToAcc(g[i]);
    const A delta = ToAcc(w_now[i]) - ToAcc(w_stale[i]);
    out[i] = FromAcc<T>(gi + lam * gi * gi * delta);
  }
}

// AdaptiveLoop, with DelayCompensateAdaptiveOp's parameters: each rounded to A, and
// 1 - momentum computed in A.
template <typename T>
void DelayCompensateAdaptive(typename Acc<T>::type* v, const T* g, const T* w_now, const T* w_stale,
                             float lambda0, float momentum, float epsilon, T* out, int64_t n) {
  using A = typename Acc<T>::type;
  const A l0 = static_cast<A>(lambda0), m = static_cast<A>(momentum);
  const A om = static_cast<A>(1) - static_cast<A>(momentum), eps = static_cast<A>(epsilon);
  for (int64_t i = 0; i < n; ++i) {
    const A gi = ToAcc(g[i]);
    const A gg = gi * gi;
    const A vi = m * v[i] + om * gg;
    v[i] = vi;
    const A delta = ToAcc(w_now[i]) - ToAcc(w_stale[i]);
    out[i] = FromAcc<T>(gi + l0 / std::sqrt(vi + eps) * gg * delta);
  }
}

// TensorFinite: whether no element of x[0, n) is NaN or infinite.
template <typename T>
bool AllFinite(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (NonFinite(x[i])) return false;
  }
  return true;
}

// ScaleFinite: out = scale * x with scale rounded to A; whether x was finite.
template <typename T>
bool ScaleAllFinite(const T* x, T* out, int64_t n, double scale) {
  using A = typename Acc<T>::type;
  const A s = static_cast<A>(scale);
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && !NonFinite(x[i]);
    out[i] = FromAcc<T>(s * ToAcc(x[i]));
  }
  return finite;
}

// QuantizeBlocks (quantize_kernels.cc): per block of `block` values of each row, scale =
// max|x| / qmax and codes nearest(x / scale) (ties to even) in [-qmax, qmax]; a packed row is
// the codes (int8, or 4-bit offset by 8, the even element low) then the scales.
inline void QuantizeBlocks(const float* x, int64_t rows, int64_t length, int bits, int64_t block,
                           uint8_t* packed, float* residual) {
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  const int64_t code_bytes = length * bits / 8, row_bytes = code_bytes + 4 * (length / block);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = packed + r * row_bytes;
    std::memset(row, 0, static_cast<size_t>(code_bytes));
    for (int64_t k = 0; k < length / block; ++k) {
      const float* v = x + r * length + k * block;
      float amax = 0.0f;
      for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / qmax;
      std::memcpy(row + code_bytes + 4 * k, &scale, sizeof(scale));
      for (int64_t i = 0; i < block; ++i) {
        const float q = std::min(std::max(std::nearbyint(v[i] / (scale > 0.0f ? scale : 1.0f)), -qmax), qmax);
        const int64_t at = k * block + i;
        if (bits == 8) {
          row[at] = static_cast<uint8_t>(static_cast<int8_t>(q));
        } else {
          row[at / 2] |= static_cast<uint8_t>((static_cast<int>(q) + 8) << (at % 2 ? 4 : 0));
        }
        if (residual != nullptr) residual[r * length + at] = v[i] - q * scale;
      }
    }
  }
}

// DequantizeBlocks: codes * scale; DequantizeSum: factor * the sum over rows in row order.
inline void DequantizeBlocks(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block,
                             float* out) {
  const int64_t code_bytes = length * bits / 8, row_bytes = code_bytes + 4 * (length / block);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = packed + r * row_bytes;
    for (int64_t i = 0; i < length; ++i) {
      float scale;
      std::memcpy(&scale, row + code_bytes + 4 * (i / block), sizeof(scale));
      const float code = bits == 8 ? static_cast<float>(static_cast<int8_t>(row[i]))
                                   : static_cast<float>((row[i / 2] >> (i % 2 ? 4 : 0)) & 15) - 8.0f;
      out[r * length + i] = code * scale;
    }
  }
}

inline void DequantizeSum(const uint8_t* packed, int64_t rows, int64_t length, int bits, int64_t block,
                          float factor, float* out) {
  std::vector<float> values(static_cast<size_t>(rows * length));
  DequantizeBlocks(packed, rows, length, bits, block, values.data());
  for (int64_t i = 0; i < length; ++i) {
    float total = 0.0f;
    for (int64_t r = 0; r < rows; ++r) total += values[r * length + i];
    out[i] = total * factor;
  }
}

}  // namespace reference

#endif  // TFSYNC_OPS_CUDA_TEST_REFERENCE_H_
