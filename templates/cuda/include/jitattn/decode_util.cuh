// Device helpers of the cuda decode kernels: cp.async, vector loads from
// shared memory converted to fp32, RoPE angle reduction.
#pragma once
#include "jitattn/cuda_common.cuh"

namespace jitattn {
namespace dec {

// ---- cp.async --------------------------------------------------------------

// Copies BYTES (16 or 8) from global to shared memory; when !valid the
// destination is zero-filled and nothing is read.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_size = valid ? BYTES : 0;
  if constexpr (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_size));
  } else {
    static_assert(BYTES == 8 || BYTES == 4, "cp.async moves 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem), "n"(BYTES), "r"(src_size));
  }
}

// Copies BYTES (16, 8 or 4) from global to shared memory, or writes zeros there when `zero`: then
// the source is not read at all (PTX's ignore-src operand), so it may be any address. One predicate
// instead of cp_async's source size: no size arithmetic per copy.
template <int BYTES>
__device__ __forceinline__ void cp_async_or_zero(void* smem, const void* gmem, bool zero) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (BYTES == 16) {
    asm volatile("{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
                 " cp.async.cg.shared.global.L2::128B [%0], [%1], 16, z;\n}\n" ::"r"(dst), "l"(gmem), "r"(int(zero)));
  } else {
    static_assert(BYTES == 8 || BYTES == 4, "cp.async moves 4, 8 or 16 bytes");
    asm volatile("{\n .reg .pred z;\n setp.ne.b32 z, %3, 0;\n"
                 " cp.async.ca.shared.global [%0], [%1], %2, z;\n}\n" ::"r"(dst), "l"(gmem), "n"(BYTES), "r"(int(zero)));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- shared-memory vectors to fp32 ------------------------------------------

template <int BYTES> struct RawVec;
template <> struct RawVec<16> { using type = uint4; static constexpr int words = 4; };
template <> struct RawVec<8> { using type = uint2; static constexpr int words = 2; };
template <> struct RawVec<4> { using type = uint32_t; static constexpr int words = 1; };

template <int BYTES>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[RawVec<BYTES>::words]) {
  if constexpr (BYTES == 16) {
    const uint4 v = *static_cast<const uint4*>(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (BYTES == 8) {
    const uint2 v = *static_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = *static_cast<const uint32_t*>(p);
  }
}

template <typename T> struct Unpack;

template <> struct Unpack<__nv_bfloat16> {
  // Two bf16 in a word -> two floats: bf16 is the top half of an fp32.
  static __device__ __forceinline__ void word(uint32_t w, float* out) {
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
  }
  static constexpr int per_word = 2;
};

template <> struct Unpack<__half> {
  static __device__ __forceinline__ void word(uint32_t w, float* out) {
    __half2 h;
    memcpy(&h, &w, 4);
    const float2 f = __half22float2(h);
    out[0] = f.x;
    out[1] = f.y;
  }
  static constexpr int per_word = 2;
};

template <__nv_fp8_interpretation_t KIND>
struct UnpackFp8 {
  static __device__ __forceinline__ void word(uint32_t w, float* out) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (16 * i)), KIND);
      __half2 h;
      memcpy(&h, &raw, 4);
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  static constexpr int per_word = 4;
};
template <> struct Unpack<__nv_fp8_e4m3> : UnpackFp8<__NV_E4M3> {};
template <> struct Unpack<__nv_fp8_e5m2> : UnpackFp8<__NV_E5M2> {};

// N elements of T at p (shared memory, aligned to N*sizeof(T)) -> fp32.
template <typename T, int N>
__device__ __forceinline__ void load_f32(const T* p, float (&out)[N]) {
  constexpr int bytes = N * int(sizeof(T));
  uint32_t w[RawVec<bytes>::words];
  load_words<bytes>(p, w);
#pragma unroll
  for (int i = 0; i < RawVec<bytes>::words; ++i) Unpack<T>::word(w[i], out + i * Unpack<T>::per_word);
}

// ---- misc ------------------------------------------------------------------

// A RoPE angle reduced to [-pi, pi] (Cody-Waite: 2 pi in two parts), where the fast intrinsics are
// accurate.
__device__ __forceinline__ float rope_reduce(float angle) {
  const float k = rintf(angle * 0.159154943091895336f);
  const float r = fmaf(-k, 6.28318548202514648f, angle);
  return fmaf(-k, -1.7484555314695172e-07f, r);
}

// sin and cos of a RoPE angle: reduced to [-pi, pi], then the fast intrinsics.
__device__ __forceinline__ void rope_sincos(float angle, float* s, float* c) { __sincosf(rope_reduce(angle), s, c); }

template <int WIDTH>
__device__ __forceinline__ float lane_sum(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

}  // namespace dec
}  // namespace jitattn
