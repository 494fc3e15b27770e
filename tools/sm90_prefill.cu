// Standalone development program for the sm_90a prefill tier.
// Kernel: warp-specialised (1 producer warpgroup issuing TMA, 2 consumer warpgroups
// issuing wgmma), 128 query rows x BN keys per step, K/V 2-stage mbarrier pipeline,
// 128-byte swizzled shared memory, online softmax in registers (exp2).
// Checks against a naive fp32 kernel and times with cudaEvents.
//
// nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I../templates/cuda/include sm90_prefill.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "jitattn/sm90.cuh"
#include "jitattn/wgmma_sm90.cuh"

using namespace jitattn;
using bf16 = __nv_bfloat16;

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

struct Params {
  void* o;
  float* lse;
  const int* qo_indptr;
  const int* kv_indptr;
  int batch, num_qo_heads, group;
  long long o_stride_n, o_stride_h, lse_stride_n, lse_stride_h;
  float scale_log2;
};

#ifndef OVERLAP
#define OVERLAP 1  // 1: the next block's S = Q K^T is issued before this block's softmax
#endif
#ifndef PINGPONG
#define PINGPONG 0  // 1: the consumer warpgroups take turns issuing GEMMs (needs OVERLAP)
#endif
#ifndef BN128
#define BN128 128  // KV block of head_dim 128
#endif
#ifndef BN64
#define BN64 128  // KV block of head_dim 64
#endif
#ifndef PV_SPLIT
#define PV_SPLIT 0  // 1: P.V as D/64 wgmmas of N=64 (no LBO), a hedge against a wrong MN-major LBO
#endif

template <int D, int BN>
struct Cfg {
  static constexpr int kBM = 128;  // query rows per tile: 2 consumer warpgroups x 64
  static constexpr int kStages = 2;
  static constexpr int kChunks = D / 64;  // 64-column (128-byte) blocks of a row
  static constexpr int kQChunkBytes = kBM * 128;
  static constexpr int kKVChunkBytes = BN * 128;
  static constexpr int kQBytes = kChunks * kQChunkBytes;
  static constexpr int kKVBytes = kChunks * kKVChunkBytes;  // one stage of K (or of V)
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKVBytes;
  static constexpr int kOffBar = kOffV + kStages * kKVBytes;
  static constexpr int kSmem = kOffBar + 128 + 1024;  // barriers + alignment slack
  static_assert(D % 64 == 0 && BN % 16 == 0 && BN <= 256, "tile");
};

struct TileInfo {
  int qo_begin, qo_len, m0, kv_begin, kv_len, delta, nblk, head;
};

template <int BM>
__device__ __forceinline__ long long num_vtiles(const Params& p) {
  return p.batch + p.qo_indptr[p.batch] / BM;
}

// Virtual tile vt of request r: base(r) = r + qo_indptr[r] / BM <= vt < base(r + 1).
template <int BM, int BN, bool CAUSAL>
__device__ __forceinline__ bool decode_item(const Params& p, long long item, TileInfo& t) {
  const long long vt = item / p.num_qo_heads;
  t.head = int(item % p.num_qo_heads);
  int lo = 0, hi = p.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (mid + p.qo_indptr[mid] / BM <= vt) lo = mid; else hi = mid - 1;
  }
  const int r = lo;
  t.qo_begin = p.qo_indptr[r];
  t.qo_len = p.qo_indptr[r + 1] - t.qo_begin;
  const int ntiles = (t.qo_len + BM - 1) / BM;
  const long long local = vt - (r + t.qo_begin / BM);
  if (local >= ntiles) return false;
  t.m0 = (ntiles - 1 - int(local)) * BM;  // the heaviest (last) tiles of a request first
  t.kv_begin = p.kv_indptr[r];
  t.kv_len = p.kv_indptr[r + 1] - t.kv_begin;
  t.delta = t.kv_len - t.qo_len;
  const int kv_end = CAUSAL ? min(t.kv_len, t.delta + min(t.m0 + BM, t.qo_len)) : t.kv_len;
  t.nblk = kv_end > 0 ? (kv_end + BN - 1) / BN : 0;
  return true;
}

__device__ __forceinline__ uint32_t pack2(float a, float b, bf16*) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack2(float a, float b, __half*) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <typename T, int D, int BN, bool CAUSAL>
__global__ void __launch_bounds__(384, 1)
    prefill_sm90(const __grid_constant__ CUtensorMap tmq, const __grid_constant__ CUtensorMap tmk,
                 const __grid_constant__ CUtensorMap tmv, const Params p) {
  using C = Cfg<D, BN>;
  constexpr int kBM = C::kBM;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kOffBar);
  uint64_t* q_full = bars;
  uint64_t* q_empty = bars + 1;
  uint64_t* k_full = bars + 2;
  uint64_t* v_full = bars + 4;
  uint64_t* k_empty = bars + 6;
  uint64_t* v_empty = bars + 8;
  const int tid = int(threadIdx.x);
  const int wg = tid / 128;
  if (tid == 0) {
    sm90::mbar_init(q_full, 1);
    sm90::mbar_init(q_empty, 256);
    for (int s = 0; s < C::kStages; ++s) {
      sm90::mbar_init(k_full + s, 1);
      sm90::mbar_init(v_full + s, 1);
      sm90::mbar_init(k_empty + s, 256);
      sm90::mbar_init(v_empty + s, 256);
    }
    sm90::mbar_init_fence();
  }
  __syncthreads();
  const long long num_items = num_vtiles<kBM>(p) * p.num_qo_heads;
  const long long grid = gridDim.x;

  if (wg == 0) {  // producer: one thread issues every TMA load
    sm90::reg_dealloc<24>();
    if (tid == 0) {
      sm90::tma_prefetch_map(&tmq);
      sm90::tma_prefetch_map(&tmk);
      sm90::tma_prefetch_map(&tmv);
      int it = 0, tiles = 0;
      for (long long k = 0;; ++k) {
        const long long item = k * grid + ((k & 1) ? grid - 1 - blockIdx.x : blockIdx.x);
        if (item >= num_items) break;
        TileInfo t;
        if (!decode_item<kBM, BN, CAUSAL>(p, item, t) || t.nblk == 0) continue;
        sm90::mbar_wait(q_empty, (tiles & 1) ^ 1);
        sm90::mbar_arrive_expect_tx(q_full, C::kQBytes);
#pragma unroll
        for (int c = 0; c < C::kChunks; ++c)
          sm90::tma_load_3d(smem + C::kOffQ + c * C::kQChunkBytes, &tmq, q_full, c * 64, t.head, t.qo_begin + t.m0);
        ++tiles;
        const int kvh = t.head / p.group;
        for (int j = 0; j < t.nblk; ++j, ++it) {
          const int s = it % C::kStages;
          const uint32_t par = ((it / C::kStages) & 1) ^ 1;
          const int row = t.kv_begin + j * BN;
          sm90::mbar_wait(k_empty + s, par);
          sm90::mbar_arrive_expect_tx(k_full + s, C::kKVBytes);
#pragma unroll
          for (int c = 0; c < C::kChunks; ++c)
            sm90::tma_load_3d(smem + C::kOffK + s * C::kKVBytes + c * C::kKVChunkBytes, &tmk, k_full + s, c * 64, kvh, row);
          sm90::mbar_wait(v_empty + s, par);
          sm90::mbar_arrive_expect_tx(v_full + s, C::kKVBytes);
#pragma unroll
          for (int c = 0; c < C::kChunks; ++c)
            sm90::tma_load_3d(smem + C::kOffV + s * C::kKVBytes + c * C::kKVChunkBytes, &tmv, v_full + s, c * 64, kvh, row);
        }
      }
    }
    return;
  }

  // consumers: warpgroup cw owns rows [64 cw, 64 cw + 64) of the tile
  sm90::reg_alloc<240>();
  const int cw = wg - 1;
  const int t128 = tid - 128 * wg;
  const int warp = t128 / 32, lane = tid % 32;
  const int rq = lane / 4, cq = lane % 4;
  const float scale = p.scale_log2;
  constexpr float kNegInf = -INFINITY;
  int it = 0, tiles = 0;
  for (long long k = 0;; ++k) {
    const long long item = k * grid + ((k & 1) ? grid - 1 - blockIdx.x : blockIdx.x);
    if (item >= num_items) break;
    TileInfo t;
    if (!decode_item<kBM, BN, CAUSAL>(p, item, t)) continue;
    const int row_a = t.m0 + 64 * cw + 16 * warp + rq;  // this thread's rows: row_a, row_a + 8
    const int row_b = row_a + 8;
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float m_a = kNegInf, m_b = kNegInf, l_a = 0.0f, l_b = 0.0f;
    if (t.nblk > 0) {
      sm90::mbar_wait(q_full, tiles & 1);
      ++tiles;
      const uint32_t q_base = sm90::smem_addr(smem + C::kOffQ) + cw * 64 * 128;
      const int lim_a = CAUSAL ? min(t.kv_len, t.delta + row_a + 1) : t.kv_len;  // keys [0, lim) visible
      const int lim_b = CAUSAL ? min(t.kv_len, t.delta + row_b + 1) : t.kv_len;
      const int wg_row0 = t.m0 + 64 * cw;
      float sc[BN / 2];
      uint32_t pa[BN / 16][4];
      // S = Q K^T of stage s (issued and committed, not waited for)
      auto gemm_s = [&](int s) {
        const uint32_t k_base = sm90::smem_addr(smem + C::kOffK + s * C::kKVBytes);
        sm90::wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint64_t da = sm90::desc_sw128(q_base + (kk / 4) * C::kQChunkBytes + (kk % 4) * 32, 16, 1024);
          const uint64_t db = sm90::desc_sw128(k_base + (kk / 4) * C::kKVChunkBytes + (kk % 4) * 32, 16, 1024);
          wgmma::mma_ss<BN, T, 0>(sc, da, db, kk > 0 ? 1 : 0);
        }
        sm90::wg_commit();
      };
      // O += P V of stage s (issued and committed)
      auto gemm_pv = [&](int s) {
        const uint32_t v_base = sm90::smem_addr(smem + C::kOffV + s * C::kKVBytes);
        sm90::reg_fence(o);
        sm90::wg_fence();
#if PV_SPLIT
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
          for (int c = 0; c < D / 64; ++c) {
            float(&oc)[32] = *reinterpret_cast<float(*)[32]>(o + 32 * c);
            const uint64_t db = sm90::desc_sw128(v_base + c * C::kKVChunkBytes + kk * 16 * 128, 16, 1024);
            wgmma::mma_rs<64, T, 1>(oc, pa[kk], db, 1);
          }
#else
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          const uint64_t db = sm90::desc_sw128(v_base + kk * 16 * 128, C::kKVChunkBytes, 1024);
          wgmma::mma_rs<D, T, 1>(o, pa[kk], db, 1);
        }
#endif
        sm90::wg_commit();
      };
      // masks block j, updates the running max / sum, turns sc into probabilities; returns the rescale factors
      auto softmax = [&](int j, float& alpha_a, float& alpha_b) {
        const int n0 = j * BN;
        const bool need_mask = n0 + BN > t.kv_len || (CAUSAL && n0 + BN - 1 > t.delta + wg_row0);
        if (need_mask) {
#pragma unroll
          for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int kv = n0 + 8 * i + 2 * cq + e;
              if (kv >= lim_a) sc[4 * i + e] = kNegInf;
              if (kv >= lim_b) sc[4 * i + 2 + e] = kNegInf;
            }
        }
        float mx_a = kNegInf, mx_b = kNegInf;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          mx_a = fmax_nan(mx_a, fmax_nan(sc[4 * i], sc[4 * i + 1]));
          mx_b = fmax_nan(mx_b, fmax_nan(sc[4 * i + 2], sc[4 * i + 3]));
        }
        mx_a = fmax_nan(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_b = fmax_nan(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_a = fmax_nan(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmax_nan(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        const float mn_a = fmax_nan(m_a, mx_a * scale), mn_b = fmax_nan(m_b, mx_b * scale);
        const float ms_a = mn_a == kNegInf ? 0.0f : mn_a, ms_b = mn_b == kNegInf ? 0.0f : mn_b;
        alpha_a = sm90::ex2(m_a - ms_a);
        alpha_b = sm90::ex2(m_b - ms_b);
        m_a = mn_a;
        m_b = mn_b;
        float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) {
          sc[4 * i + 0] = sm90::ex2(fmaf(sc[4 * i + 0], scale, -ms_a));
          sc[4 * i + 1] = sm90::ex2(fmaf(sc[4 * i + 1], scale, -ms_a));
          sc[4 * i + 2] = sm90::ex2(fmaf(sc[4 * i + 2], scale, -ms_b));
          sc[4 * i + 3] = sm90::ex2(fmaf(sc[4 * i + 3], scale, -ms_b));
          sum_a += sc[4 * i] + sc[4 * i + 1];
          sum_b += sc[4 * i + 2] + sc[4 * i + 3];
        }
        l_a = l_a * alpha_a + sum_a;
        l_b = l_b * alpha_b + sum_b;
      };
      auto rescale = [&](float alpha_a, float alpha_b) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          o[4 * i + 0] *= alpha_a;
          o[4 * i + 1] *= alpha_a;
          o[4 * i + 2] *= alpha_b;
          o[4 * i + 3] *= alpha_b;
        }
      };
      auto to_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          pa[kk][0] = pack2(sc[8 * kk + 0], sc[8 * kk + 1], (T*)nullptr);
          pa[kk][1] = pack2(sc[8 * kk + 2], sc[8 * kk + 3], (T*)nullptr);
          pa[kk][2] = pack2(sc[8 * kk + 4], sc[8 * kk + 5], (T*)nullptr);
          pa[kk][3] = pack2(sc[8 * kk + 6], sc[8 * kk + 7], (T*)nullptr);
        }
      };
      // V rows past the request's keys (the next request's, or memory past the tensor) are zeroed
      // in shared memory before P V reads them: P is 0 there, but 0 * NaN would not be.
      auto zero_v_tail = [&](int s, int j) {
        const int nvalid = t.kv_len - j * BN;
        if (nvalid >= BN) return;
        uint8_t* vs = smem + C::kOffV + s * C::kKVBytes;
        const int per_chunk = (BN - nvalid) * 8;  // 16-byte pieces of the tail rows of one 64-column block
        for (int idx = tid - 128; idx < C::kChunks * per_chunk; idx += 256) {
          const int c = idx / per_chunk, rem = idx - c * per_chunk;
          *reinterpret_cast<uint4*>(vs + c * C::kKVChunkBytes + (nvalid + rem / 8) * 128 + (rem % 8) * 16) =
              make_uint4(0, 0, 0, 0);
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        sm90::named_barrier(1, 256);
      };
#if OVERLAP
      // S of block j is computed while P V of block j - 1 runs (intra-warpgroup overlap)
      int s = it % C::kStages;
      uint32_t par = (it / C::kStages) & 1;
      // Ping-pong: the two consumer warpgroups take turns issuing their GEMMs (named barriers
      // 2 + cw), so one's softmax runs while the other's GEMMs do. Warpgroup 1 lets 0 go first.
      if (PINGPONG && cw == 1) sm90::named_barrier_arrive(2, 256);
      sm90::mbar_wait(k_full + s, par);
      if (PINGPONG) sm90::named_barrier(2 + cw, 256);
      gemm_s(s);
      if (PINGPONG) sm90::named_barrier_arrive(3 - cw, 256);
      sm90::wg_wait<0>();
      sm90::reg_fence(sc);
      sm90::mbar_arrive(k_empty + s);
      if (t.nblk == 1) sm90::mbar_arrive(q_empty);
      float alpha_a, alpha_b;
      softmax(0, alpha_a, alpha_b);
      to_p();
      for (int j = 1; j < t.nblk; ++j) {
        const int sp = s;
        const uint32_t parp = par;
        ++it;
        s = it % C::kStages;
        par = (it / C::kStages) & 1;
        sm90::mbar_wait(k_full + s, par);
        sm90::mbar_wait(v_full + sp, parp);
        zero_v_tail(sp, j - 1);
        if (PINGPONG) sm90::named_barrier(2 + cw, 256);
        gemm_s(s);
        gemm_pv(sp);
        if (PINGPONG) sm90::named_barrier_arrive(3 - cw, 256);
        sm90::wg_wait<1>();
        sm90::reg_fence(sc);
        sm90::mbar_arrive(k_empty + s);
        if (j == t.nblk - 1) sm90::mbar_arrive(q_empty);
        softmax(j, alpha_a, alpha_b);
        sm90::wg_wait<0>();
        sm90::reg_fence(o);
        sm90::mbar_arrive(v_empty + sp);
        rescale(alpha_a, alpha_b);
        to_p();
      }
      sm90::mbar_wait(v_full + s, par);
      zero_v_tail(s, t.nblk - 1);
      if (PINGPONG) sm90::named_barrier(2 + cw, 256);
      gemm_pv(s);
      if (PINGPONG) sm90::named_barrier_arrive(3 - cw, 256);
      if (PINGPONG && cw == 0) sm90::named_barrier(2, 256);  // takes warpgroup 1's last turn back
      sm90::wg_wait<0>();
      sm90::reg_fence(o);
      sm90::mbar_arrive(v_empty + s);
      ++it;
#else
      for (int j = 0; j < t.nblk; ++j, ++it) {
        const int s = it % C::kStages;
        const uint32_t par = (it / C::kStages) & 1;
        sm90::mbar_wait(k_full + s, par);
        gemm_s(s);
        sm90::wg_wait<0>();
        sm90::reg_fence(sc);
        sm90::mbar_arrive(k_empty + s);
        if (j == t.nblk - 1) sm90::mbar_arrive(q_empty);
        float alpha_a, alpha_b;
        softmax(j, alpha_a, alpha_b);
        rescale(alpha_a, alpha_b);
        to_p();
        sm90::mbar_wait(v_full + s, par);
        zero_v_tail(s, j);
        gemm_pv(s);
        sm90::wg_wait<0>();
        sm90::reg_fence(o);
        sm90::mbar_arrive(v_empty + s);
      }
#endif
    }
    // epilogue: full row sums, normalise, store (rows past the request are not stored)
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = h ? row_b : row_a;
      if (row >= t.qo_len) continue;
      const float l = h ? l_b : l_a, m = h ? m_b : m_a;
      const float inv = l != 0.0f ? 1.0f / l : 0.0f;
      T* orow = static_cast<T*>(p.o) + (long long)(t.qo_begin + row) * p.o_stride_n + (long long)t.head * p.o_stride_h;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const uint32_t v = pack2(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv, (T*)nullptr);
        *reinterpret_cast<uint32_t*>(orow + 8 * i + 2 * cq) = v;
      }
      if (p.lse && cq == 0)
        p.lse[(long long)(t.qo_begin + row) * p.lse_stride_n + (long long)t.head * p.lse_stride_h] =
            l != 0.0f ? (m + log2f(l)) * kLn2 : kNegInf;
    }
  }
}

// ---- reference and checks -------------------------------------------------------------

// One warp per sampled (token, head) row: fp32 online softmax over every visible key.
__global__ void ref_kernel(const bf16* q, const bf16* k, const bf16* v, float* o_ref, float* lse_ref,
                           const int* qo_indptr, const int* kv_indptr, int batch, int hq, int hkv, int d,
                           long long total_rows, int sample, int causal, float sm_scale) {
  const long long w = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const long long row = w * sample;
  if (row >= total_rows) return;
  const int token = int(row / hq), head = int(row % hq), kvh = head / (hq / hkv);
  int r = 0;
  while (r + 1 < batch && qo_indptr[r + 1] <= token) ++r;
  const int i = token - qo_indptr[r], qo_len = qo_indptr[r + 1] - qo_indptr[r];
  const int kv_len = kv_indptr[r + 1] - kv_indptr[r];
  const int lim = causal ? min(kv_len, kv_len - qo_len + i + 1) : kv_len;
  float qv[8], acc[8];
  const int per = d / 32;
  for (int e = 0; e < per; ++e) {
    qv[e] = __bfloat162float(q[(long long)token * hq * d + head * d + lane * per + e]);
    acc[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int j = 0; j < lim; ++j) {
    const long long kr = ((long long)(kv_indptr[r] + j) * hkv + kvh) * d + lane * per;
    float dot = 0.0f;
    for (int e = 0; e < per; ++e) dot += qv[e] * __bfloat162float(k[kr + e]);
    for (int off = 16; off; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float s = dot * sm_scale;
    const float mn = fmaxf(m, s);
    const float corr = expf(m - mn), pj = expf(s - mn);
    l = l * corr + pj;
    for (int e = 0; e < per; ++e) acc[e] = acc[e] * corr + pj * __bfloat162float(v[kr + e]);
    m = mn;
  }
  for (int e = 0; e < per; ++e) o_ref[w * d + lane * per + e] = l > 0 ? acc[e] / l : 0.0f;
  if (lane == 0) lse_ref[w] = l > 0 ? m + logf(l) : -INFINITY;
}

// stats: [0] sum (o-ref)^2, [1] sum ref^2, [2] max |o-ref|, [3] max |lse-ref|, [4] bad (non-finite where ref is finite)
__global__ void compare_kernel(const bf16* o, const float* lse, const float* o_ref, const float* lse_ref,
                               long long total_rows, int sample, int d, double* stats) {
  const long long w = blockIdx.x;
  const long long row = w * sample;
  if (row >= total_rows) return;
  double se = 0, sr = 0, mx = 0;
  int bad = 0;
  for (int e = threadIdx.x; e < d; e += blockDim.x) {
    const float a = __bfloat162float(o[row * d + e]), b = o_ref[w * d + e];
    if (!isfinite(a)) ++bad;
    const double diff = double(a) - double(b);
    se += diff * diff;
    sr += double(b) * double(b);
    mx = fmax(mx, fabs(diff));
  }
  atomicAdd(&stats[0], se);
  atomicAdd(&stats[1], sr);
  unsigned long long* mxp = reinterpret_cast<unsigned long long*>(&stats[2]);
  atomicMax(mxp, __double_as_longlong(isfinite(mx) ? mx : 1e30));
  if (threadIdx.x == 0) {
    const float a = lse[row], b = lse_ref[w];
    double dl = (isinf(b) && a == b) ? 0.0 : fabs(double(a) - double(b));
    if (!(dl == dl)) dl = 1e30, ++bad;
    atomicMax(reinterpret_cast<unsigned long long*>(&stats[3]), __double_as_longlong(dl));
  }
  if (bad) atomicAdd(&stats[4], double(bad));
}

__global__ void fill_random(bf16* x, long long n, unsigned long long seed, float amp) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    unsigned long long z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = float(z >> 40) * (1.0f / 16777216.0f);  // [0,1)
    x[i] = __float2bfloat16((2.0f * u - 1.0f) * amp);
  }
}

// ---- host -----------------------------------------------------------------------------

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiled get_encode() {
  static EncodeTiled fn = nullptr;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    void* ptr = nullptr;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !ptr) {
      fprintf(stderr, "no cuTensorMapEncodeTiled\n");
      exit(1);
    }
    fn = reinterpret_cast<EncodeTiled>(ptr);
  }
  return fn;
}

// [tokens, heads, d] with element strides (stride_n, stride_h); boxes of 64 columns x 1 head x rows.
static CUtensorMap make_map(const void* base, int d, long long heads, long long tokens, long long stride_n,
                            long long stride_h, int rows) {
  CUtensorMap map;
  cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(heads), cuuint64_t(tokens)};
  cuuint64_t strides[2] = {cuuint64_t(stride_h * 2), cuuint64_t(stride_n * 2)};
  cuuint32_t box[3] = {64, 1, cuuint32_t(rows)};
  cuuint32_t es[3] = {1, 1, 1};
  CUresult r = get_encode()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, es,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(r));
    exit(1);
  }
  return map;
}

struct Problem {
  std::string name;
  std::vector<int> qo, kv;
  int hq, hkv, d;
  bool causal;
  int sample;  // check every sample-th row
  bool time;
};

template <int D, int BN, bool CAUSAL>
static void launch(const CUtensorMap& mq, const CUtensorMap& mk, const CUtensorMap& mv, const Params& p, int sms,
                   cudaStream_t st) {
  using C = Cfg<D, BN>;
  auto kern = prefill_sm90<bf16, D, BN, CAUSAL>;
  static bool set = false;
  if (!set) {
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem));
    set = true;
  }
  kern<<<sms, 384, C::kSmem, st>>>(mq, mk, mv, p);
}

template <int D, int BN>
static bool run_problem(const Problem& pr, int sms, unsigned long long seed) {
  const int batch = int(pr.qo.size());
  std::vector<int> qi(batch + 1, 0), ki(batch + 1, 0);
  for (int r = 0; r < batch; ++r) qi[r + 1] = qi[r] + pr.qo[r], ki[r + 1] = ki[r] + pr.kv[r];
  const long long nq = qi[batch], nk = ki[batch];
  const int d = pr.d;
  bf16 *q, *k, *v, *o;
  float *lse, *o_ref, *lse_ref;
  int *dqi, *dki;
  double* stats;
  CK(cudaMalloc(&q, std::max(1LL, nq) * pr.hq * d * 2));
  CK(cudaMalloc(&o, std::max(1LL, nq) * pr.hq * d * 2));
  CK(cudaMalloc(&lse, std::max(1LL, nq) * pr.hq * 4));
  const long long kv_alloc = nk + 256;  // the tail past the keys holds NaN: it must never reach the output
  CK(cudaMalloc(&k, kv_alloc * pr.hkv * d * 2));
  CK(cudaMalloc(&v, kv_alloc * pr.hkv * d * 2));
  CK(cudaMemset(k, 0xFF, kv_alloc * pr.hkv * d * 2));
  CK(cudaMemset(v, 0xFF, kv_alloc * pr.hkv * d * 2));
  const long long total_rows = nq * pr.hq;
  const long long nsamp = (total_rows + pr.sample - 1) / pr.sample;
  CK(cudaMalloc(&o_ref, std::max(1LL, nsamp) * d * 4));
  CK(cudaMalloc(&lse_ref, std::max(1LL, nsamp) * 4));
  CK(cudaMalloc(&dqi, (batch + 1) * 4));
  CK(cudaMalloc(&dki, (batch + 1) * 4));
  CK(cudaMalloc(&stats, 8 * 8));
  CK(cudaMemcpy(dqi, qi.data(), (batch + 1) * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dki, ki.data(), (batch + 1) * 4, cudaMemcpyHostToDevice));
  fill_random<<<1024, 256>>>(q, nq * pr.hq * d, seed * 3 + 1, 1.5f);
  fill_random<<<1024, 256>>>(k, nk * pr.hkv * d, seed * 3 + 2, 1.5f);
  fill_random<<<1024, 256>>>(v, nk * pr.hkv * d, seed * 3 + 3, 1.5f);
  CK(cudaMemset(o, 0xFF, std::max(1LL, nq) * pr.hq * d * 2));  // NaN poison
  CK(cudaMemset(lse, 0xFF, std::max(1LL, nq) * pr.hq * 4));
  CK(cudaGetLastError());

  Params p;
  p.o = o;
  p.lse = lse;
  p.qo_indptr = dqi;
  p.kv_indptr = dki;
  p.batch = batch;
  p.num_qo_heads = pr.hq;
  p.group = pr.hq / pr.hkv;
  p.o_stride_n = (long long)pr.hq * d;
  p.o_stride_h = d;
  p.lse_stride_n = pr.hq;
  p.lse_stride_h = 1;
  const float sm_scale = 1.0f / sqrtf(float(d));
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  const CUtensorMap mq = make_map(q, d, pr.hq, std::max(1LL, nq), (long long)pr.hq * d, d, 128);
  const CUtensorMap mk = make_map(k, d, pr.hkv, kv_alloc, (long long)pr.hkv * d, d, BN);
  const CUtensorMap mv = make_map(v, d, pr.hkv, kv_alloc, (long long)pr.hkv * d, d, BN);
  auto go = [&](cudaStream_t st) {
    if (pr.causal) launch<D, BN, true>(mq, mk, mv, p, sms, st);
    else launch<D, BN, false>(mq, mk, mv, p, sms, st);
  };
  go(0);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());

  ref_kernel<<<int((nsamp * 32 + 255) / 256), 256>>>(q, k, v, o_ref, lse_ref, dqi, dki, batch, pr.hq, pr.hkv, d,
                                                       total_rows, pr.sample, pr.causal, sm_scale);
  CK(cudaGetLastError());
  CK(cudaMemset(stats, 0, 64));
  if (nsamp > 0) compare_kernel<<<int(nsamp), 128>>>(o, lse, o_ref, lse_ref, total_rows, pr.sample, d, stats);
  CK(cudaGetLastError());
  double h[8];
  CK(cudaMemcpy(h, stats, 64, cudaMemcpyDeviceToHost));
  const double rel = h[1] > 0 ? sqrt(h[0] / h[1]) : sqrt(h[0]);
  const bool ok = rel < 1e-2 && h[2] < 3e-2 && h[3] < 2e-3 && h[4] == 0;
  double tflops = 0, ms = 0;
  if (pr.time) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) go(0);
    std::vector<float> ts;
    for (int i = 0; i < 20; ++i) {
      CK(cudaEventRecord(e0));
      go(0);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float t;
      CK(cudaEventElapsedTime(&t, e0, e1));
      ts.push_back(t);
    }
    CK(cudaGetLastError());
    std::sort(ts.begin(), ts.end());
    ms = ts[ts.size() / 2];
    double flops = 0;
    for (int r = 0; r < batch; ++r) flops += 4.0 * pr.hq * double(pr.qo[r]) * pr.kv[r] * d * (pr.causal ? 0.5 : 1.0);
    tflops = flops / (ms * 1e-3) / 1e12;
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
  printf("%-34s d%-3d BN%-3d %-6s rel_l2 %.2e max_abs %.2e lse_max %.2e bad %g %s", pr.name.c_str(), d, BN,
         pr.causal ? "causal" : "full", rel, h[2], h[3], h[4], ok ? "OK  " : "FAIL");
  if (pr.time) printf("  %.3f ms  %.1f TFLOP/s", ms, tflops);
  printf("\n");
  fflush(stdout);
  cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse); cudaFree(o_ref); cudaFree(lse_ref);
  cudaFree(dqi); cudaFree(dki); cudaFree(stats);
  return ok;
}

template <int D, int BN>
static int run_all(int sms, bool big) {
  int fails = 0;
  std::vector<Problem> probs;
  for (int c = 0; c < 2; ++c) {
    const bool causal = c == 1;
    probs.push_back({"equal b2x1024", {1024, 1024}, {1024, 1024}, 32, 8, D, causal, 1, false});
    probs.push_back({"ragged edges", {1, 129, 256, 5, 0, 700, 300, 64}, {1, 300, 256, 0, 10, 1500, 100, 64}, 32, 8, D,
                     causal, 1, false});
    probs.push_back({"ragged 16 lens", {128, 4000, 777, 2048, 130, 3333, 1, 8192, 256, 1500, 640, 5000, 99, 3000, 2222, 512},
                     {128, 4000, 777, 2048, 130, 3333, 1, 8192, 256, 1500, 640, 5000, 99, 3000, 2222, 512}, 32, 8, D,
                     causal, 3, big});
    probs.push_back({"mha 8/8 b1x777", {777}, {900}, 8, 8, D, causal, 1, false});
    if (big) probs.push_back({"llama8b b8x4096", std::vector<int>(8, 4096), std::vector<int>(8, 4096), 32, 8, D, causal,
                              7, true});
  }
  unsigned long long seed = 1234;
  for (auto& pr : probs) fails += run_problem<D, BN>(pr, sms, seed++) ? 0 : 1;
  return fails;
}

int main(int argc, char** argv) {
  int dev = 0, sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("device %s, %d SMs, OVERLAP=%d PV_SPLIT=%d PINGPONG=%d BN128=%d\n", prop.name, sms, OVERLAP, PV_SPLIT, PINGPONG, BN128);
  const bool big = argc < 2 || strcmp(argv[1], "small") != 0;
  int fails = 0;
#ifndef SKIP_D128
  fails += run_all<128, BN128>(sms, big);
#endif
#ifdef WITH_D64
  fails += run_all<64, BN64>(sms, big);
#endif
#ifdef WITH_D256
  fails += run_all<256, 64>(sms, big);
#endif
  printf("%s: %d failing\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
