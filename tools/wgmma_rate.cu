// Tensor-core rate of wgmma shapes the MLA kernel and the sm90 prefill use, one CTA per SM, back-to-back GEMMs into
// one accumulator: SS (A and B from shared memory) vs RS (A from registers), N = 64 to 256, one to three warpgroups
// issuing; and the d64 P V GEMM with the row sum (m64n72k16, SUM): its rate counted over the 64 columns of O, so
// beside RS m64n64k16 it says what the 8 summing columns cost.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Itemplates/cuda/include tools/wgmma_rate.cu -o /tmp/wr
#include <cstdio>
#include <cuda_bf16.h>
#include "jitattn/sm90.cuh"
#include "jitattn/wgmma_sm90.cuh"
using namespace jitattn;

template <int N, bool RS, int WGS, bool SUM = false>
__global__ void __launch_bounds__(128 * WGS, 1) rate(int iters, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  for (int i = threadIdx.x; i < 96 * 1024 / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();
  float d[N / 2], rs[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  uint32_t a[4] = {0, 0, 0, 0};
  const uint32_t base = sm90::smem_addr(smem);
  for (int it = 0; it < iters; ++it) {
    sm90::wg_fence();
#pragma unroll
    for (int k = 0; k < 36; ++k) {
      const uint64_t da = sm90::desc_sw128(base + (k % 9) * 8192 + (k / 9) * 32, 16, 1024);
      const uint64_t db = sm90::desc_sw128(base + 73728 / 2 + (k % 4) * 32 + (k / 4 % 2) * 8192, 16, 1024);
      if constexpr (SUM) wgmma::mma_rs_row_sum<N, __nv_bfloat16>(d, rs, a, sm90::desc_sw128(base + (k % 4) * 2048, 32768, 1024));
      else if constexpr (RS) wgmma::mma_rs<N, __nv_bfloat16, 0>(d, a, db, 1);
      else wgmma::mma_ss<N, __nv_bfloat16, 0>(d, da, db, 1);
    }
    sm90::wg_commit();
    sm90::wg_wait<0>();
    sm90::reg_fence(d);
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += d[i];
  s += rs[0];
  if (s == 1.2345f) sink[threadIdx.x] = s;
}

template <int N, bool RS, int WGS, bool SUM = false>
void run(const char* name) {
  float* sink;
  cudaMalloc(&sink, 4096);
  auto k = rate<N, RS, WGS, SUM>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024);
  const int iters = 2000, blocks = 132;
  k<<<blocks, 128 * WGS, 96 * 1024>>>(10, sink);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<<<blocks, 128 * WGS, 96 * 1024>>>(iters, sink);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  const double flops = 2.0 * 64 * N * 16 * 36 * double(iters) * blocks * WGS;
  printf("%-34s %8.1f TFLOP/s  (%s)\n", name, flops / ms / 1e9, cudaGetErrorString(cudaGetLastError()));
  cudaFree(sink);
}

int main() {
  run<64, false, 1>("SS m64n64k16, 1 warpgroup");
  run<64, false, 2>("SS m64n64k16, 2 warpgroups");
  run<64, true, 1>("RS m64n64k16, 1 warpgroup");
  run<64, true, 2>("RS m64n64k16, 2 warpgroups");
  run<256, false, 1>("SS m64n256k16, 1 warpgroup");
  run<256, true, 1>("RS m64n256k16, 1 warpgroup");
  run<256, true, 2>("RS m64n256k16, 2 warpgroups");
  run<128, false, 1>("SS m64n128k16, 1 warpgroup");
  run<128, false, 2>("SS m64n128k16, 2 warpgroups");
  run<64, true, 3>("RS m64n64k16, 3 warpgroups");
  run<64, true, 2, true>("RS m64n72k16 row sum, 2 warpgroups");
  run<64, true, 3, true>("RS m64n72k16 row sum, 3 warpgroups");
  return 0;
}
