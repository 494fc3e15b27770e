// Issue rate of the exponentials a softmax can use on this GPU: ex2.approx.ftz.f32 (one score an instruction) and
// ex2.approx.f16x2 (two scores, compiled to two MUFU.EX2.F16 on sm_90a), in scores per clock per SM. Each thread
// runs 8 independent chains (v <- 2^-v: each value feeds its next exponential), 8 blocks of 256 threads per SM;
// clock64() brackets the loop in every block, and an SM's cycles are its blocks' mean bracket. It decides whether
// a packed softmax frees MUFU time (docs/kernels/sm90_prefill.md, the fp8 section).
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a tools/mufu_rate.cu -o /tmp/mufu_rate && /tmp/mufu_rate
#include <cstdio>
#include <cuda_fp16.h>

constexpr int kIters = 4096, kChains = 8, kThreads = 256;

__global__ void ex2_f32(float* out, long long* cycles) {
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
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

__global__ void ex2_f16x2(float* out, long long* cycles) {
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
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <typename Kernel>
double scores_per_clock_per_sm(Kernel kernel, int scores_per_op, int sms) {
  const int blocks = sms * 8;
  float* out; long long* cycles;
  cudaMalloc(&out, sizeof(float) * blocks * kThreads);
  cudaMalloc(&cycles, sizeof(long long) * blocks);
  kernel<<<blocks, kThreads>>>(out, cycles);  // warm-up
  kernel<<<blocks, kThreads>>>(out, cycles);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("CUDA error: %s\n", cudaGetErrorString(e)); return -1; }
  long long* host = new long long[blocks];
  cudaMemcpy(host, cycles, sizeof(long long) * blocks, cudaMemcpyDeviceToHost);
  double block_cycles = 0;
  for (int b = 0; b < blocks; ++b) block_cycles += double(host[b]);
  delete[] host; cudaFree(out); cudaFree(cycles);
  // 8 resident blocks per SM run together: an SM's cycles are its blocks' mean bracket
  double sm_cycles = block_cycles / blocks;
  double scores_per_sm = double(kIters) * kChains * kThreads * scores_per_op * 8;
  return scores_per_sm / sm_cycles;
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  printf("ex2.approx.ftz.f32: %.2f scores per clock per SM\n", scores_per_clock_per_sm(ex2_f32, 1, sms));
  printf("ex2.approx.f16x2:   %.2f scores per clock per SM\n", scores_per_clock_per_sm(ex2_f16x2, 2, sms));
  return 0;
}
