// Issue rate of the exponentials a softmax can use on this GPU: ex2.approx.ftz.f32 (one score an instruction) and
// ex2.approx.f16x2 (two scores, compiled to two MUFU.EX2.F16 on sm_90a), in scores per clock per SM. Each thread
// runs 8 independent chains (v <- 2^-v: each value feeds its next exponential), 8 blocks of 256 threads per SM.
// Every warp records its SM and the clock64() at its loop's start and end; an SM's time is from its first warp's
// start to its last warp's end (one warp's own bracket would overstate the rate when the scheduler favours it),
// over the scores of the warps it ran. It decides whether a packed softmax frees MUFU time
// (docs/kernels/sm90_prefill.md, the fp8 section).
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/mufu_rate.cu -o /tmp/mufu_rate && /tmp/mufu_rate
#include <cstdio>
#include <vector>
#include <cuda_fp16.h>

constexpr int kIters = 4096, kChains = 8, kThreads = 256, kWarps = kThreads / 32;

struct WarpClock {
  long long t0, t1;
  int sm, pad;
};

__device__ __forceinline__ int sm_id() {
  int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

__device__ __forceinline__ void record(WarpClock* clocks, long long t0, long long t1) {
  if (threadIdx.x % 32 == 0) clocks[blockIdx.x * kWarps + threadIdx.x / 32] = {t0, t1, sm_id(), 0};
}

__global__ void ex2_f32(float* out, WarpClock* clocks) {
  float v[kChains];
  for (int c = 0; c < kChains; ++c) v[c] = 1e-3f * (threadIdx.x + c);
  long long t0 = clock64();
  for (int i = 0; i < kIters; ++i)
#pragma unroll
    for (int c = 0; c < kChains; ++c)  // 2^-v: the values stay in (0.5, 1)
      asm volatile("{ .reg .f32 t; neg.f32 t, %0; ex2.approx.ftz.f32 %0, t; }" : "+f"(v[c]));
  long long t1 = clock64();
  float s = 0;
  for (int c = 0; c < kChains; ++c) s += v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  record(clocks, t0, t1);
}

__global__ void ex2_f16x2(float* out, WarpClock* clocks) {
  unsigned v[kChains];
  for (int c = 0; c < kChains; ++c) {
    __half2 h = __floats2half2_rn(1e-3f * (threadIdx.x + c), 2e-3f * (threadIdx.x + c));
    v[c] = *reinterpret_cast<unsigned*>(&h);
  }
  long long t0 = clock64();
  for (int i = 0; i < kIters; ++i)
#pragma unroll
    for (int c = 0; c < kChains; ++c)
      asm volatile("{ .reg .b32 t; neg.f16x2 t, %0; ex2.approx.f16x2 %0, t; }" : "+r"(v[c]));
  long long t1 = clock64();
  float s = 0;
  for (int c = 0; c < kChains; ++c) s += __low2float(*reinterpret_cast<__half2*>(&v[c]));
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  record(clocks, t0, t1);
}

// scores per clock per SM (the mean over SMs), and the spread of one warp's bracket against its SM's span
template <typename Kernel>
void scores_per_clock_per_sm(const char* name, Kernel kernel, int scores_per_op, int sms) {
  const int blocks = sms * 8, warps = blocks * kWarps;
  float* out; WarpClock* clocks;
  cudaMalloc(&out, sizeof(float) * blocks * kThreads);
  cudaMalloc(&clocks, sizeof(WarpClock) * warps);
  kernel<<<blocks, kThreads>>>(out, clocks);  // warm-up
  kernel<<<blocks, kThreads>>>(out, clocks);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("CUDA error: %s\n", cudaGetErrorString(e)); return; }
  std::vector<WarpClock> host(warps);
  cudaMemcpy(host.data(), clocks, sizeof(WarpClock) * warps, cudaMemcpyDeviceToHost);
  cudaFree(out); cudaFree(clocks);
  std::vector<long long> lo(sms, -1), hi(sms, 0), n(sms, 0);
  double bracket = 0;
  for (const WarpClock& w : host) {
    if (lo[w.sm] < 0 || w.t0 < lo[w.sm]) lo[w.sm] = w.t0;
    if (w.t1 > hi[w.sm]) hi[w.sm] = w.t1;
    ++n[w.sm];
    bracket += double(w.t1 - w.t0);
  }
  const double per_warp = double(kIters) * kChains * 32 * scores_per_op;
  double rate = 0, span = 0;
  int used = 0;
  for (int s = 0; s < sms; ++s) {
    if (!n[s]) continue;
    rate += per_warp * n[s] / double(hi[s] - lo[s]);
    span += double(hi[s] - lo[s]);
    ++used;
  }
  printf("%-20s %.2f scores per clock per SM (%d SMs; a warp's own bracket is %.2f of its SM's span)\n", name,
         rate / used, used, bracket / warps / (span / used));
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  scores_per_clock_per_sm("ex2.approx.ftz.f32:", ex2_f32, 1, sms);
  scores_per_clock_per_sm("ex2.approx.f16x2:", ex2_f16x2, 2, sms);
  return 0;
}
