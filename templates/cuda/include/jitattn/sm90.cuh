// Hopper (sm_90a) building blocks as inline PTX: mbarriers, TMA tile loads, wgmma
// shared-memory descriptors and fences, register reallocation. No CUTLASS/CuTe.
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the module does not link libcuda)
#include <cuda_runtime.h>
#include <stdint.h>

namespace jitattn {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ---- mbarrier -------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Waits until the phase of parity `parity` has completed (a fresh barrier counts its
// phase "-1", parity 1, as complete: producers wait for parity (round & 1) ^ 1).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ------------------------------------------------------------------------------

__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// A 3-d tile of `map` at coordinates (c0, c1, c2) (innermost first) into shared memory;
// completion is counted in bytes on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::
          "r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// The 4-d box at (c0, c1, c2, c3) of `map` into shared memory; completes on `bar` (its tx bytes).
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// ---- cp.async gathers (paged KV, repeated query rows) -----------------------------------

// 16 bytes global -> shared; when !valid nothing is read and the 16 bytes are zero-filled.
// L2_PREFETCH (0, 64, 128, 256): the L2 prefetch size hint of the load.
template <int L2_PREFETCH = 0>
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  if constexpr (L2_PREFETCH == 0)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
  else if constexpr (L2_PREFETCH == 64)
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
  else if constexpr (L2_PREFETCH == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One arrival on `bar` (counted among its expected arrivals) once every cp.async this thread
// has issued so far has landed.
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Orders this thread's view of shared memory written through the generic proxy (stores,
// cp.async) before its later async-proxy reads (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The acquire half of that ordering only, after an mbarrier wait (PTX ISA 8.6): generic-proxy
// writes released through the barrier become visible to this thread's async-proxy reads. On
// sm_90a ptxas emits no instruction for it (seen with nvcc 13).
__device__ __forceinline__ void fence_proxy_async_acquire() {
  asm volatile("fence.proxy.async::generic.acquire.sync_restrict::shared::cluster.cluster;" ::: "memory");
}

// Byte offset of 16-byte piece `piece` (0..7) of row `row` of a 128-byte-swizzled tile of
// 128-byte rows whose base is 1 KiB aligned: where a SWIZZLE_128B TMA box puts it.
__device__ __forceinline__ uint32_t sw128_offset(int row, int piece) {
  return uint32_t(row) * 128u + (uint32_t(piece ^ (row & 7)) << 4);
}

// ---- wgmma ----------------------------------------------------------------------------

// Descriptor of a 128-byte-swizzled operand in shared memory (swizzle atoms 1024-byte aligned).
// K-major (rows of 64 16-bit elements, 128 B apart): sbo = 1024 (8-row groups), lbo unused.
// MN-major: lbo = bytes between 64-element column blocks, sbo = 1024 (8-row groups along K).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
}

// desc_sw128(addr + bytes, lbo, sbo) from d = desc_sw128(addr, lbo, sbo): one 32-bit add on the start-address
// field (bytes a multiple of 16; the sum stays below 256 KiB, as every shared-memory address does, so it never
// carries into the lbo field). The k-steps of a GEMM advance one descriptor instead of each building its own.
__device__ __forceinline__ uint64_t desc_advance(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4));
}

// desc_sw128(addr + bytes, lbo - bytes, sbo) from d = desc_sw128(addr, lbo, sbo), lbo > bytes: the start address
// moves and the second column block (at addr + lbo: a block every k-step reads) stays where it is.
__device__ __forceinline__ uint64_t desc_advance_pinned(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | uint32_t(uint32_t(d) + (bytes >> 4) - ((bytes >> 4) << 16));
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Keeps the compiler from moving reads/writes of accumulator registers across wgmma issue/wait.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int REGS>
__device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}

// Named barrier among `threads` threads (a multiple of 32), id 1..15 (0 is __syncthreads):
// named_barrier waits for all of them; named_barrier_arrive counts this warp in without waiting.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Whether `pred` holds for any of the `threads` threads meeting at named barrier `id` (they all wait for it).
__device__ __forceinline__ bool barrier_any(bool pred, int id, int threads) {
  uint32_t any;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, %3, p;\nselp.u32 %0, 1, 0, q;\n}"
               : "=r"(any) : "r"(uint32_t(pred)), "r"(id), "r"(threads) : "memory");
  return any != 0;
}

// Shared memory by its 32-bit address: one word stored, one or four words loaded.
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
  return v;
}

// Four words to global memory in one 16-byte store (`ptr` 16-byte aligned) when `pred` holds (a predicated store,
// no branch): a plain uint4 assignment through a reinterpret_cast pointer compiled to four 4-byte stores.
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}"
               ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(uint32_t(pred)) : "memory");
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace sm90
}  // namespace jitattn
