// Decode's memory side alone: blocks = (request, KV head), each streams its request's K and V rows
// (256 B: d128 bf16, NHD pages of 16 tokens, 8 KV heads) through 3 cp.async stages of 64 tokens into
// shared memory, and reads each stage back with ldmatrix as the decode kernel does (no math). Variants:
// the shared-memory row layout (pitch 272 = the decode kernel's padding, 256 with the 16-byte pieces of
// each 128-byte line permuted by the row, 256 plain) and the cp.async form (ignore-src predicate as the
// decode kernel, src-size operand, no predicate; .L2::128B or not).
// Question: which of them make the L2 requests / sectors per line Nsight Compute shows for the decode kernel
// (ours 2.6 requests and 6 sectors per 128-byte line, FlashInfer 1 and 4), and what each costs in time.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/l2_stream.cu -o /tmp/l2s
// Run: /tmp/l2s (timing, events, L2 flushed before each call); under ncu: /tmp/l2s once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>
#include <cuda_runtime.h>

constexpr int kNT = 128, kTile = 64, kStages = 3, kHeads = 8, kPageSize = 16;
constexpr int kRowBytes = 256, kPieces = kRowBytes / 16, kRowsPerPass = kNT / kPieces;

__device__ __forceinline__ unsigned smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

template <int FORM>
__device__ __forceinline__ void copy16(unsigned dst, const void* src, bool zero) {
  if constexpr (FORM == 0) {  // the decode kernel's: ignore-src predicate, L2::128B
    asm volatile("{\n .reg .pred z;\n setp.ne.b32 z, %2, 0;\n"
                 " cp.async.cg.shared.global.L2::128B [%0], [%1], 16, z;\n}\n" ::"r"(dst), "l"(src), "r"(int(zero)));
  } else if constexpr (FORM == 1) {  // src-size operand (0 = zero fill), L2::128B
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(zero ? 0 : 16));
  } else if constexpr (FORM == 2) {  // no predicate, L2::128B
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  } else {  // no predicate, no prefetch hint
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  }
}

template <bool SWZ>
__device__ __forceinline__ int piece(int row, int c) { return SWZ ? (c & ~7) | ((c ^ row) & 7) : c; }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr, bool trans) {
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <int PITCH, bool SWZ, int FORM>
__global__ void __launch_bounds__(kNT, 2) stream(const char* k, const char* v, const int* indices, int pages_per_req,
                                                   unsigned* sink) {
  extern __shared__ __align__(128) char smem[];
  char* sK = smem;
  char* sV = smem + kStages * kTile * PITCH;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int r = blockIdx.x / kHeads, h = blockIdx.x % kHeads;
  const int* ids = indices + int64_t(r) * pages_per_req;
  const int ntiles = pages_per_req * kPageSize / kTile;
  const int64_t token_bytes = int64_t(kHeads) * kRowBytes;
  auto issue = [&](int tile, int stage) {
#pragma unroll
    for (int i = 0; i < kTile / kRowsPerPass; ++i) {
      const int row = tid / kPieces + i * kRowsPerPass, col = tid % kPieces;
      const int tok = tile * kTile + row;
      const int64_t off = (int64_t(ids[tok / kPageSize]) * kPageSize + tok % kPageSize) * token_bytes + h * kRowBytes + col * 16;
      const int d = stage * kTile * PITCH + row * PITCH + piece<SWZ>(row, col) * 16;
      copy16<FORM>(smem_u32(sK + d), k + off, false);
      copy16<FORM>(smem_u32(sV + d), v + off, false);
    }
  };
  unsigned acc = 0;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ntiles) issue(s, s);
    asm volatile("cp.async.commit_group;\n" ::);
  }
#pragma unroll 1
  for (int tile = 0; tile < ntiles; ++tile) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2));
    __syncthreads();
    if (tile + kStages - 1 < ntiles) issue(tile + kStages - 1, (tile + kStages - 1) % kStages);
    asm volatile("cp.async.commit_group;\n" ::);
    const int st = tile % kStages;
    const int row = warp * 16 + lane % 8 + 8 * ((lane / 8) % 2);
#pragma unroll
    for (int kp = 0; kp < kPieces / 2; ++kp) {
      unsigned a[4], b[4];
      const int c = piece<SWZ>(row, 2 * kp + lane / 16) * 16;
      ldsm_x4(a, smem_u32(sK + st * kTile * PITCH + row * PITCH + c), false);
      ldsm_x4(b, smem_u32(sV + st * kTile * PITCH + row * PITCH + c), true);
      acc ^= a[0] ^ a[1] ^ a[2] ^ a[3] ^ b[0] ^ b[1] ^ b[2] ^ b[3];
    }
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;  // keeps the reads; practically never taken
}

struct Variant {
  const char* name;
  void (*fn)(const char*, const char*, const int*, int, unsigned*);
  int pitch;
};
#define V(P, S, F) {#P " swz" #S " form" #F, stream<P, S, F>, P}
static const Variant kVariants[] = {
    V(272, false, 0), V(256, true, 0), V(256, false, 0), V(272, false, 1), V(256, true, 1),
    V(272, false, 2), V(256, true, 2), V(272, false, 3), V(256, true, 3),
};

int main(int argc, char** argv) {
  const bool once = argc > 1 && !strcmp(argv[1], "once");
  struct Case { const char* name; int batch, pages_per_req; bool shared; };
  const Case cases[] = {{"unshared b256 x 4096", 256, 256, false}, {"shared b32 x 32768", 32, 2048, true}};
  const int64_t page_bytes = int64_t(kPageSize) * kHeads * kRowBytes;
  const int max_pages = 256 * 256;
  char *k, *v, *flush;
  unsigned* sink;
  cudaMalloc(&k, max_pages * page_bytes);
  cudaMalloc(&v, max_pages * page_bytes);
  cudaMalloc(&flush, 256 << 20);
  cudaMalloc(&sink, 1 << 20);
  cudaMemset(k, 1, max_pages * page_bytes);
  cudaMemset(v, 2, max_pages * page_bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::mt19937 rng(1);
  for (const Case& c : cases) {
    std::vector<int> ids(int64_t(c.batch) * c.pages_per_req);
    if (c.shared) {
      std::vector<int> perm(c.pages_per_req);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int r = 0; r < c.batch; ++r) std::copy(perm.begin(), perm.end(), ids.begin() + int64_t(r) * c.pages_per_req);
    } else {
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
    }
    int* d_ids;
    cudaMalloc(&d_ids, ids.size() * sizeof(int));
    cudaMemcpy(d_ids, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice);
    const double bytes = 2.0 * c.batch * c.pages_per_req * page_bytes;  // K and V of every request (shared pages counted per request)
    for (const Variant& var : kVariants) {
      const int smem = 2 * kStages * kTile * var.pitch;
      cudaFuncSetAttribute(var.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      std::vector<float> ms;
      for (int rep = 0; rep < (once ? 1 : 12); ++rep) {
        cudaMemsetAsync(flush, rep, 256 << 20);
        cudaEventRecord(e0);
        var.fn<<<c.batch * kHeads, kNT, smem>>>(k, v, d_ids, c.pages_per_req, sink);
        cudaEventRecord(e1);
        cudaEventSynchronize(e1);
        float t;
        cudaEventElapsedTime(&t, e0, e1);
        if (rep > 1 || once) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const float med = ms[ms.size() / 2];
      printf("%-22s %-20s %8.1f us  %6.0f GB/s\n", c.name, var.name, med * 1e3, bytes / (med * 1e-3) / 1e9);
    }
    cudaFree(d_ids);
  }
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) { printf("CUDA error: %s\n", cudaGetErrorString(err)); return 1; }
  return 0;
}
