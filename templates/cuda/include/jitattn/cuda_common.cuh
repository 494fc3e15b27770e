// Types, conversions and error reporting shared by the cuda-target kernels.
#pragma once
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <math_constants.h>
#include <stdint.h>
#include <stdio.h>
#include <stdarg.h>

namespace jitattn {

// max that propagates NaN (fmaxf drops it): softmax maxima use it so that a NaN logit (a NaN
// query) makes its row NaN instead of looking like a row with no visible key. On sm_80+ it is
// PTX max.NaN.f32, one max instruction like fmaxf: no extra work per score.
__device__ __forceinline__ float fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return float(x); }
__device__ __forceinline__ float to_float(__nv_fp8_e5m2 x) { return float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

inline int report_error(char* err, int err_len, const char* fmt, ...) {
  if (err && err_len > 0) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err, size_t(err_len), fmt, args);
    va_end(args);
  }
  return 1;
}

// Turns a launch failure into the caller's error message.
inline int check_launch(char* err, int err_len, const char* what) {
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return report_error(err, err_len, "%s: %s", what, cudaGetErrorString(status));
  return 0;
}

// The standard slope of head `head` of `num_heads` (as jitattn.reference.alibi_slopes).
__device__ __forceinline__ float alibi_slope(int64_t head, int64_t num_heads) {
  int64_t m = 1;
  while (m * 2 <= num_heads) m *= 2;
  if (head < m) return float(exp2(-8.0 / double(m) * double(head + 1)));
  return float(exp2(-4.0 / double(m) * double(1 + 2 * (head - m))));
}

}  // namespace jitattn
