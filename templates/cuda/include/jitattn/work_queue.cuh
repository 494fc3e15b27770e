// Dynamic work items of the persistent prefill grids (templates/cuda/prefill.cu.jinja and
// prefill_sm90.cu.jinja): blocks take item indices from a counter in device memory, so a block
// that finishes early takes the next item (a static order leaves blocks idle on uneven work).
//
// A counter pair lives in a slot: {next item, blocks done}. The last block of a launch to
// finish resets its slot, so the next launch that uses it (stream-ordered after it) starts
// from zero. A slot serves one stream for good; a launch being captured into a CUDA graph
// takes a slot of its own for good (an executable graph never runs concurrently with itself).
// No slot free, or the per-thread default stream (one handle, many streams): slot -1, and the
// kernel walks a static order instead.
#pragma once
#include <cuda_runtime.h>
#include <mutex>

namespace jitattn {
namespace work {

constexpr int kSlots = 256;
constexpr int kMaxDevices = 64;
__device__ unsigned int g_counter[kSlots][2];

// The next item of the launch using `slot`.
__device__ __forceinline__ int64_t take(int slot) { return int64_t(atomicAdd(&g_counter[slot][0], 1u)); }

// Called by one thread of every block after its last take(): the launch's last block resets
// the slot.
__device__ __forceinline__ void finish(int slot) {
  __threadfence();
  if (atomicAdd(&g_counter[slot][1], 1u) == gridDim.x - 1) {
    g_counter[slot][0] = 0u;
    g_counter[slot][1] = 0u;
    __threadfence();
  }
}

struct SlotTable {
  std::mutex mu;
  bool used[kMaxDevices][kSlots] = {};
  bool graph[kMaxDevices][kSlots] = {};
  void* stream[kMaxDevices][kSlots] = {};
};
inline SlotTable g_slots;

// The slot for a launch on `stream` of `device` (0 <= device < kMaxDevices), or -1.
inline int slot_for(int device, cudaStream_t stream) {
  if (stream == cudaStreamPerThread || device < 0 || device >= kMaxDevices) return -1;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  const bool capturing = status != cudaStreamCaptureStatusNone;
  std::lock_guard<std::mutex> lock(g_slots.mu);
  if (!capturing)
    for (int i = 0; i < kSlots; ++i)
      if (g_slots.used[device][i] && !g_slots.graph[device][i] && g_slots.stream[device][i] == stream) return i;
  for (int i = 0; i < kSlots; ++i)
    if (!g_slots.used[device][i]) {
      g_slots.used[device][i] = true;
      g_slots.graph[device][i] = capturing;
      g_slots.stream[device][i] = stream;
      return i;
    }
  return -1;
}

}  // namespace work
}  // namespace jitattn

// The work slot launches of this module on `stream` (a cudaStream_t) of the current device take:
// >= 0, or -1 (the static order). For tests; the first call for a stream claims its slot.
JITATTN_EXPORT int jitattn_work_slot(void* stream) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= jitattn::work::kMaxDevices) {
    cudaGetLastError();
    return -1;
  }
  return jitattn::work::slot_for(device, static_cast<cudaStream_t>(stream));
}
