// Scalar types and helpers shared by the cpu-target kernels.
// 16-bit and 8-bit float types are stored as raw bits and converted to float
// in software, so the cpu target needs nothing beyond a C++17 compiler.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdarg.h>

namespace jitattn {

struct half_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };
struct e4m3_t { uint8_t bits; };
struct e5m2_t { uint8_t bits; };

inline float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// max that propagates NaN (std::max and fmaxf drop it): softmax maxima use it so that a NaN
// logit (a NaN query) makes its row NaN instead of looking like a row with no visible key.
inline float fmax_nan(float a, float b) { return (b > a || b != b) ? b : a; }
inline uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) { return bits_to_float(uint32_t(x.bits) << 16); }

inline float to_float(half_t x) {
  uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t man = x.bits & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    float v = float(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// fp8 e4m3 (fn variant: no inf, 0x7f/0xff are NaN), bias 7.
inline float to_float(e4m3_t x) {
  uint32_t sign = x.bits & 0x80u;
  uint32_t exp = (x.bits >> 3) & 0xfu;
  uint32_t man = x.bits & 0x7u;
  float v;
  if (exp == 0xf && man == 0x7) return NAN;
  if (exp == 0) v = float(man) * 0.001953125f;  // man * 2^-9
  else v = ldexpf(1.0f + float(man) / 8.0f, int(exp) - 7);
  return sign ? -v : v;
}

// fp8 e5m2: the top byte of an IEEE half.
inline float to_float(e5m2_t x) { half_t h{uint16_t(uint16_t(x.bits) << 8)}; return to_float(h); }

template <typename T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline bf16_t from_float<bf16_t>(float x) {
  uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40u)};  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{uint16_t(u >> 16)};
}
template <> inline half_t from_float<half_t>(float x) {
  uint32_t u = float_to_bits(x);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return half_t{uint16_t(sign | 0x7e00u)};
  if (absu >= 0x477ff000u) return half_t{uint16_t(sign | 0x7c00u)};  // rounds to inf
  if (absu < 0x38800000u) {
    // subnormal half (or zero): round(|x| * 2^24) with ties to even
    float a = bits_to_float(absu) * 16777216.0f;
    float r = nearbyintf(a);
    return half_t{uint16_t(sign | uint16_t(r))};
  }
  uint32_t mant_round = absu + 0xfffu + ((absu >> 13) & 1u);
  return half_t{uint16_t(sign | uint16_t(((mant_round >> 13) - (112u << 10)) & 0x7fffu))};
}

// Writes a message into the caller's error buffer; returns the error code to return.
inline int report_error(char* err, int err_len, const char* fmt, ...) {
  if (err && err_len > 0) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, size_t(err_len), fmt, args);
    va_end(args);
  }
  return 1;
}

}  // namespace jitattn
