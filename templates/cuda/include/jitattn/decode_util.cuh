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

// ---- bulk copies (sm_90): one instruction per row, completion counted on an mbarrier ----------
// Compiled to nothing below sm_90, where the kernels take the cp.async path (kBulkArch false).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kBulkArch = true;
#else
constexpr bool kBulkArch = false;
#endif

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(unsigned(__cvta_generic_to_shared(bar))), "r"(count)
               : "memory");
#endif
}

// Arrives on `bar` and adds `bytes` to the transfer count its current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(unsigned(__cvta_generic_to_shared(bar))),
               "r"(bytes)
               : "memory");
#endif
}

// Waits until the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred done;\n"
      "DEC_WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra DEC_WAIT;\n}\n" ::"r"(unsigned(__cvta_generic_to_shared(bar))),
      "r"(parity)
      : "memory");
#endif
}

// BYTES (a multiple of 16, both addresses 16-byte aligned) from global to shared memory by the
// bulk-copy engine; their arrival completes on `bar`'s transfer count.
template <int BYTES>
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, uint64_t* bar) {
  static_assert(BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   unsigned(__cvta_generic_to_shared(smem))),
               "l"(gmem), "n"(BYTES), "r"(unsigned(__cvta_generic_to_shared(bar)))
               : "memory");
#endif
}

// Orders this thread's earlier generic-proxy shared-memory accesses before later bulk copies (issued
// by any thread after a barrier) into the same bytes.
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// A K or V row of the stage table: copied by the bulk engine (returns its bytes for the expected
// transfer count), or, for a padding row (the sign bit set, see the decode kernel's sTab), written
// with zeros by generic stores fenced from the bulk copies that later reuse those bytes.
template <int BYTES>
__device__ __forceinline__ unsigned bulk_row_or_zero(char* smem, int64_t gmem, uint64_t* bar) {
  if (gmem < 0) {
#pragma unroll
    for (int c = 0; c < BYTES / 16; ++c) reinterpret_cast<uint4*>(smem)[c] = make_uint4(0, 0, 0, 0);
    fence_proxy_async();
    return 0;
  }
  bulk_copy<BYTES>(smem, reinterpret_cast<const char*>(gmem), bar);
  return BYTES;
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
