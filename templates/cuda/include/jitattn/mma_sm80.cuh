// Tensor-core and async-copy primitives of the sm80+ generic tier (mma.sync,
// ldmatrix, cp.async, fp8 -> 16-bit operands), used by the cuda prefill and decode kernels.
//
// Fragment layouts are PTX's for mma.m16n8k16 with 16-bit A/B and fp32 C/D:
// a thread (lane) of a warp holds, of C, rows lane/4 and lane/4 + 8 and
// columns 2*(lane%4) + {0, 1} of an m16n8 tile (c[0..1] the first row, c[2..3]
// the second); of A, the same rows with k = 2*(lane%4) + {0, 1} (a[0], a[1])
// and k + 8 (a[2], a[3]); of B, column n = lane/4 with k = 2*(lane%4) + {0, 1}
// (b[0]) and k + 8 (b[1]).
#pragma once
#include "jitattn/cuda_common.cuh"
#include <type_traits>

namespace jitattn {
namespace mma {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async -----------------------------------------------------------------

// Copies 16 bytes global -> shared; when !valid nothing is read and the 16
// destination bytes are zero-filled (src must still be a valid pointer value).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_size) : "memory");
}

// 8-byte variant (fp8 rows whose length is a multiple of 8 bytes only).
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, bool valid) {
  const int src_size = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_size) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- ldmatrix -----------------------------------------------------------------

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Transposes an 8x8 b16 matrix held one word per lane in the fragment layout
// above (lane l: row l/4, columns 2*(l%4) + {0, 1}): lane l gets column l/4,
// rows 2*(l%4) + {0, 1}. A C tile packed to 16 bits becomes a B operand this way.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t w) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(w));
  return r;
}

// ---- mma.sync m16n8k16, fp32 accumulate ------------------------------------------

template <typename T> struct Mma;

template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// ---- mma.sync m16n8k8 tf32, fp32 accumulate ------------------------------------------
//
// tf32 operands are fp32 words of which the tensor core reads the top 19 bits (sign, 8 exponent, 10
// mantissa bits). A (16x8, row): a[0] = (row g, k t), a[1] = (row g + 8, k t), a[2] = (row g, k t + 4),
// a[3] = (row g + 8, k t + 4); B (8x8, col): b0 = (k t, column g), b1 = (k t + 4, column g); C and D as
// for m16n8k16 above; g = lane/4, t = lane%4.

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x rounded to the nearest tf32 (truncation would bias every product the same way): on sm_90+
// cvt.rn (ties to even), one instruction (F2FP.TF32); before, cvt.rna (ties away from zero), which
// ptxas lowers to an Inf/NaN test and an integer add of half a tf32 ulp.
__device__ __forceinline__ uint32_t tf32_round(float x) {
  uint32_t r;
#if __CUDA_ARCH__ >= 900
  asm("cvt.rn.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#else
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
#endif
  return r;
}

// ---- packing ------------------------------------------------------------------

// Two floats -> one 32-bit word of two T (lo in the low half), round to nearest.
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// One word of two T -> two floats.
template <typename T> __device__ __forceinline__ float2 unpack2(uint32_t w);
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// ---- fp8 --------------------------------------------------------------------------

template <typename KV> struct Fp8Kind;
template <> struct Fp8Kind<__nv_fp8_e4m3> { static constexpr __nv_fp8_interpretation_t value = __NV_E4M3; };
template <> struct Fp8Kind<__nv_fp8_e5m2> { static constexpr __nv_fp8_interpretation_t value = __NV_E5M2; };

// Two fp8 (the low 16 bits of w) -> two floats; exact.
template <typename KV>
__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t w) {
  const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu),
                                                     Fp8Kind<KV>::value);
  return __half22float2(*reinterpret_cast<const __half2*>(&raw));
}

// Two fp8 -> one word of two T. Exact: every e4m3 / e5m2 value is an f16 and a bf16.
template <typename T, typename KV>
__device__ __forceinline__ uint32_t fp8x2_to_word(uint32_t w) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu),
                                                       Fp8Kind<KV>::value);
    return *reinterpret_cast<const uint32_t*>(&raw);
  } else {
    const float2 f = fp8x2_to_float2<KV>(w);
    return pack2<T>(f.x, f.y);
  }
}

// 2^x (MUFU.EX2); exp2(-inf) = 0.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace mma
}  // namespace jitattn
