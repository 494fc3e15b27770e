// Numerics and memory helpers of the cpu-target attention kernel
// (templates/cpu/attention.cpp.jinja).
//
// The kernel is built with -O3 and no -march, so everything here is written as
// plain loops that the compiler vectorises for the baseline ISA: no intrinsics,
// `#pragma omp simd` where a reduction or a select must be allowed to reorder.
#pragma once
#include <math.h>
#include <stdint.h>
#include "jitattn/cpu_common.h"

namespace jitattn {

// Keys per online-softmax block: the K and V rows of one block stay in L1.
constexpr int kKeyBlock = 32;
// Rows (query x query head) per work item, the queries of a tile times a GQA
// group (times several kv heads' groups in decode): every KV row converted to
// float is reused by a head's share of them.
constexpr int kRowBudget = 32;
// Work items per thread below which decode items stop merging kv heads, so a
// dynamic schedule still has something to balance.
constexpr int kItemsPerThread = 4;

// ---------------------------------------------------------------------------
// Element conversion
// ---------------------------------------------------------------------------

// fp8 -> float through a 256-entry table: exact (it is built from to_float)
// and much cheaper than the bit-fiddling conversion per element.
template <typename T>
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) value[b] = to_float(T{uint8_t(b)});
  }
};

template <typename T>
inline const float* fp8_table() {
  static const Fp8Table<T> table;  // thread-safe static init (C++11)
  return table.value;
}

// dst[0:n] = float(src[0:n]).
template <typename T>
inline void convert_row(float* dst, const T* src, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}
inline void convert_row(float* dst, const e4m3_t* src, int64_t n) {
  const float* table = fp8_table<e4m3_t>();
  for (int64_t d = 0; d < n; ++d) dst[d] = table[src[d].bits];
}
inline void convert_row(float* dst, const e5m2_t* src, int64_t n) {
  const float* table = fp8_table<e5m2_t>();
  for (int64_t d = 0; d < n; ++d) dst[d] = table[src[d].bits];
}

// A row as float: converted into `scratch`, or read in place when it already is
// float (saves a copy per KV element on the f32 path).
template <typename T>
inline const float* row_as_float(const T* src, float* scratch, int64_t n) {
  convert_row(scratch, src, n);
  return scratch;
}
inline const float* row_as_float(const float* src, float*, int64_t) { return src; }

// Asks for the cache lines of [row, row + bytes) ahead of use. KV rows of one
// head are short runs scattered over pages (and, for NHD, strided by the other
// heads), so the hardware prefetcher alone leaves each block waiting on DRAM.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* begin = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(begin + offset, 0, 3);
}

// ---------------------------------------------------------------------------
// Vector math
// ---------------------------------------------------------------------------

// exp(x) for x <= 0 (softmax arguments are always logit - running max), with
// exp(-inf) = 0. Cephes' expf: range reduction by ln2 (split in two so the
// reduction is exact) and a degree-5 polynomial, ~1 ulp. Unlike libm's expf it
// is plain arithmetic, so a loop over it vectorises.
inline float exp_nonpositive(float x) {
  const float lo = -87.0f;  // below: exp underflows to (almost) 0
  const float xc = x < lo ? lo : x;
  // n = round(xc / ln2) by the 1.5 * 2^23 trick (no SSE4.1 round needed).
  const float shifter = 12582912.0f;
  const float n = (xc * 1.44269504088896341f + shifter) - shifter;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float y = poly * (r * r) + r + 1.0f;
  const int32_t e = (int32_t(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  memcpy(&scale, &e, 4);
  return x < lo ? 0.0f : y * scale;
}

// out[c] = q . keys[c] for c < num_keys. Four keys share each load of q.
// (`omp simd reduction` lets the compiler split each sum over vector lanes.)
inline void dot_keys(const float* q, const float* const* keys, int num_keys, int64_t dim, float* out) {
  int c = 0;
  for (; c + 4 <= num_keys; c += 4) {
    const float* k0 = keys[c];
    const float* k1 = keys[c + 1];
    const float* k2 = keys[c + 2];
    const float* k3 = keys[c + 3];
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t d = 0; d < dim; ++d) {
      const float x = q[d];
      s0 += x * k0[d];
      s1 += x * k1[d];
      s2 += x * k2[d];
      s3 += x * k3[d];
    }
    out[c] = s0;
    out[c + 1] = s1;
    out[c + 2] = s2;
    out[c + 3] = s3;
  }
  for (; c < num_keys; ++c) {
    const float* k0 = keys[c];
    float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
    for (int64_t d = 0; d < dim; ++d) s0 += q[d] * k0[d];
    out[c] = s0;
  }
}

// out0[c] = q0 . keys[c] and out1[c] = q1 . keys[c]: two query rows by four
// keys per pass, eight independent sums, 0.75 loads per multiply-add.
inline void dot_keys2(const float* q0, const float* q1, const float* const* keys, int num_keys, int64_t dim,
                      float* out0, float* out1) {
  int c = 0;
  for (; c + 4 <= num_keys; c += 4) {
    const float* k0 = keys[c];
    const float* k1 = keys[c + 1];
    const float* k2 = keys[c + 2];
    const float* k3 = keys[c + 3];
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, b0 = 0.0f, b1 = 0.0f, b2 = 0.0f, b3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, b0, b1, b2, b3)
    for (int64_t d = 0; d < dim; ++d) {
      const float x = q0[d], y = q1[d];
      const float e0 = k0[d], e1 = k1[d], e2 = k2[d], e3 = k3[d];
      a0 += x * e0;
      a1 += x * e1;
      a2 += x * e2;
      a3 += x * e3;
      b0 += y * e0;
      b1 += y * e1;
      b2 += y * e2;
      b3 += y * e3;
    }
    out0[c] = a0;
    out0[c + 1] = a1;
    out0[c + 2] = a2;
    out0[c + 3] = a3;
    out1[c] = b0;
    out1[c + 1] = b1;
    out1[c + 2] = b2;
    out1[c + 3] = b3;
  }
  for (; c < num_keys; ++c) {
    const float* k0 = keys[c];
    float a0 = 0.0f, b0 = 0.0f;
#pragma omp simd reduction(+ : a0, b0)
    for (int64_t d = 0; d < dim; ++d) {
      a0 += q0[d] * k0[d];
      b0 += q1[d] * k0[d];
    }
    out0[c] = a0;
    out1[c] = b0;
  }
}

// acc += sum_c weight[c] * values[c]. Eight values per pass over acc, so each
// accumulator element is loaded and stored once per eight keys.
inline void accumulate_values(float* acc, const float* weight, const float* const* values, int num_values,
                              int64_t dim) {
  int c = 0;
  for (; c + 8 <= num_values; c += 8) {
    const float w0 = weight[c], w1 = weight[c + 1], w2 = weight[c + 2], w3 = weight[c + 3];
    const float w4 = weight[c + 4], w5 = weight[c + 5], w6 = weight[c + 6], w7 = weight[c + 7];
    const float* v0 = values[c];
    const float* v1 = values[c + 1];
    const float* v2 = values[c + 2];
    const float* v3 = values[c + 3];
    const float* v4 = values[c + 4];
    const float* v5 = values[c + 5];
    const float* v6 = values[c + 6];
    const float* v7 = values[c + 7];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d)
      acc[d] += ((w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d])) +
                ((w4 * v4[d] + w5 * v5[d]) + (w6 * v6[d] + w7 * v7[d]));
  }
  for (; c < num_values; ++c) {
    const float w0 = weight[c];
    const float* v0 = values[c];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += w0 * v0[d];
  }
}

// ---------------------------------------------------------------------------
// Position encodings
// ---------------------------------------------------------------------------

// RoPE table row of one position: cos_sin[i] = cos(angle_i), cos_sin[half + i]
// = sin(angle_i), angle_i = pos * rcp_scale * rcp_theta^(2i / dim). Angles in
// double so long positions stay exact; the table is filled once per launch.
inline void rope_fill(float* cos_sin, int64_t dim, int64_t pos, float rcp_scale, float rcp_theta) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double angle = double(pos) * double(rcp_scale) * pow(double(rcp_theta), 2.0 * double(i) / double(dim));
    cos_sin[i] = float(cos(angle));
    cos_sin[half + i] = float(sin(angle));
  }
}

// Llama rotate-half RoPE of x[0:dim] (in place) by one table row (rope_fill).
inline void rope_rotate(float* x, int64_t dim, const float* cos_sin) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float c = cos_sin[i], s = cos_sin[half + i];
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

// The standard ALiBi slope of head `head` of `num_heads` (ALiBi paper, HF
// get_alibi_slopes): with m = 2^floor(log2(num_heads)), heads below m get
// 2^(-8/m)^(head+1), the rest 2^(-4/m)^(1 + 2*(head-m)).
inline float alibi_slope(int64_t head, int64_t num_heads) {
  int64_t m = 1;
  while (m * 2 <= num_heads) m *= 2;
  if (head < m) return float(pow(2.0, -8.0 / double(m) * double(head + 1)));
  return float(pow(2.0, -4.0 / double(m) * double(1 + 2 * (head - m))));
}

}  // namespace jitattn
