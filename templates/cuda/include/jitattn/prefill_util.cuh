// Helpers of the cuda prefill kernel (templates/cuda/prefill.cu.jinja): the
// shared-memory tile layout, RoPE angles, ALiBi slopes.
#pragma once
#include "jitattn/cuda_common.cuh"
#include "jitattn/mma_sm80.cuh"
#include <type_traits>

namespace jitattn {
namespace pf {

// ---- shared-memory tiles ----------------------------------------------------------
//
// A tile is rows of 16-byte chunks (8 elements of a 16-bit type), ROW_CHUNKS
// chunks per row. When ROW_CHUNKS is a multiple of 8 the chunk index is XORed
// with (row % 8) (the 8 rows one ldmatrix reads then hit 8 distinct 16-byte
// bank groups); otherwise ROW_CHUNKS is odd (the row is padded by one chunk),
// which spreads the rows over the banks with no swizzle.
template <int ROW_CHUNKS, bool SWIZZLE>
__device__ __forceinline__ int chunk_index(int row, int chunk) {
  if constexpr (SWIZZLE) {
    static_assert(ROW_CHUNKS % 8 == 0, "a swizzled row is a multiple of 8 chunks");
    return row * ROW_CHUNKS + (chunk ^ (row & 7));
  } else {
    static_assert(ROW_CHUNKS % 2 == 1, "an unswizzled row is an odd number of chunks");
    return row * ROW_CHUNKS + chunk;
  }
}

// Element offset of (row, col) in such a tile.
template <int ROW_CHUNKS, bool SWIZZLE>
__device__ __forceinline__ int elem_index(int row, int col) {
  return chunk_index<ROW_CHUNKS, SWIZZLE>(row, col >> 3) * 8 + (col & 7);
}

// ---- RoPE -------------------------------------------------------------------------

// sin and cos of pos * freq: the angle and its reduction to [-pi, pi] in double
// (exact for any int32 position), then the fast intrinsic, accurate there.
__device__ __forceinline__ void rope_sincos(int pos, double freq, float* s, float* c) {
  const double angle = double(pos) * freq;
  const double k = rint(angle * 0.15915494309189535);
  const float r = float(fma(-k, 6.283185307179586, angle));
  __sincosf(r, s, c);
}

}  // namespace pf
}  // namespace jitattn
