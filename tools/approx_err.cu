// Error of the soft cap's two tanh forms on this GPU against float64 tanh: tanh.approx.f32 (one MUFU op; the
// sm90 prefill tier's default) and 1 - 2 / (1 + 2^(2 x log2 e)) on ex2.approx + rcp.approx (two MUFU ops,
// SM90_TUNING soft_cap_tanh 0). 2^24 points evenly over -12 < x < 12, one thread each; per range of |x| the
// largest absolute and relative error and the mean error times sign(x).
// docs/benchmarks/h100-2026-12-06-aa.txt has an H100's table.
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a tools/approx_err.cu -o /tmp/approx_err && /tmp/approx_err
#include <cstdio>
#include <cmath>
#include <vector>
__device__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__global__ void k(const float* x, float* a, float* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float t; asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x[i])); a[i] = t;
  float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + ex2(x[i] * 2.8853900817779268f)));
  b[i] = fmaf(-2.0f, r, 1.0f);
}
int main() {
  const int n = 1 << 24; std::vector<float> x(n), a(n), b(n);
  for (int i = 0; i < n; ++i) x[i] = -12.0f + 24.0f * (i + 0.5f) / n;
  float *dx, *da, *db; cudaMalloc(&dx, n * 4); cudaMalloc(&da, n * 4); cudaMalloc(&db, n * 4);
  cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice);
  k<<<n / 256, 256>>>(dx, da, db, n);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {  // e.g. not an sm_90a GPU
    printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  cudaMemcpy(a.data(), da, n * 4, cudaMemcpyDeviceToHost); cudaMemcpy(b.data(), db, n * 4, cudaMemcpyDeviceToHost);
  const double edges[] = {0, 0.25, 0.5, 1, 2, 3, 4, 6, 12.01};
  printf("|x| range      tanh.approx: max abs   max rel   mean signed abs  | ex2+rcp: max abs   max rel   mean signed\n");
  for (int r = 0; r < 8; ++r) {
    double ma = 0, mr = 0, sa = 0, mb = 0, mrb = 0, sb = 0; long c = 0;
    for (int i = 0; i < n; ++i) {
      double ax = fabs(x[i]); if (ax < edges[r] || ax >= edges[r + 1]) continue;
      double t = tanh((double)x[i]), ea = a[i] - t, eb = b[i] - t;
      ma = fmax(ma, fabs(ea)); sa += ea * (x[i] > 0 ? 1 : -1); mb = fmax(mb, fabs(eb)); sb += eb * (x[i] > 0 ? 1 : -1);
      if (t != 0) { mr = fmax(mr, fabs(ea / t)); mrb = fmax(mrb, fabs(eb / t)); }
      ++c;
    }
    printf("[%5.2f,%5.2f)  %11.3e %10.3e %12.3e      | %11.3e %10.3e %12.3e\n", edges[r], edges[r + 1], ma, mr, sa / c,
           mb, mrb, sb / c);
  }
  return 0;
}
