// Dynamic work items of the persistent prefill grids (templates/cuda/prefill.cu.jinja and
// prefill_sm90.cu.jinja): blocks take item indices from a counter in device memory, so a block
// that finishes early takes the next item (a static order leaves blocks idle on uneven work).
//
// A counter pair lives in a slot: {next item, blocks done}. The last block of a launch to
// finish resets its slot, so the next launch that uses it (stream-ordered after it) starts
// from zero. A slot serves one stream for good. The launches captured from one stream into one
// CUDA graph share a slot (the capture orders them, and an executable graph never runs
// concurrently with itself), which the graph gives back when it is destroyed (a CUDA user
// object retained by the graph). One slot per captured launch, kept for good, ran out after
// a few graphs of a serving engine (32 layers each) and left the rest on the static order.
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
  unsigned long long capture[kMaxDevices][kSlots] = {};  // the capture a graph's slot serves
};
inline SlotTable g_slots;

struct GraphSlot {
  int device, slot;
};

// A CUDA user object's destructor (no CUDA calls allowed): the graph holding the slot is gone.
inline void give_back(void* p) {
  GraphSlot* held = static_cast<GraphSlot*>(p);
  {
    std::lock_guard<std::mutex> lock(g_slots.mu);
    g_slots.used[held->device][held->slot] = false;
    g_slots.graph[held->device][held->slot] = false;
  }
  delete held;
}

// Ties `slot` to the lifetime of `graph` (being captured); false (slot given back) when CUDA refuses.
inline bool hold_for_graph(int device, int slot, cudaGraph_t graph) {
  GraphSlot* held = new GraphSlot{device, slot};
  cudaUserObject_t object;
  if (cudaUserObjectCreate(&object, held, give_back, 1, cudaUserObjectNoDestructorSync) != cudaSuccess) {
    cudaGetLastError();
    give_back(held);
    return false;
  }
  if (cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove) != cudaSuccess) {
    cudaGetLastError();
    cudaUserObjectRelease(object, 1);  // its destructor gives the slot back
    return false;
  }
  return true;
}

// The slot for a launch on `stream` of `device` (0 <= device < kMaxDevices), or -1.
inline int slot_for(int device, cudaStream_t stream) {
  if (stream == cudaStreamPerThread || device < 0 || device >= kMaxDevices) return -1;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  cudaGraph_t graph = nullptr;
  if (cudaStreamGetCaptureInfo(stream, &status, &capture, &graph) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  if (status == cudaStreamCaptureStatusInvalidated) return -1;  // the capture fails anyway
  const bool capturing = status == cudaStreamCaptureStatusActive;
  int claimed = -1;
  {
    std::lock_guard<std::mutex> lock(g_slots.mu);
    for (int i = 0; i < kSlots; ++i)
      if (g_slots.used[device][i] && g_slots.graph[device][i] == capturing && g_slots.stream[device][i] == stream &&
          (!capturing || g_slots.capture[device][i] == capture))
        return i;
    for (int i = 0; i < kSlots && claimed < 0; ++i)
      if (!g_slots.used[device][i]) {
        g_slots.used[device][i] = true;
        g_slots.graph[device][i] = capturing;
        g_slots.stream[device][i] = stream;
        g_slots.capture[device][i] = capture;
        claimed = i;
      }
  }
  // Outside the lock: the destructor of a user object CUDA refuses takes it to give the slot back.
  if (claimed >= 0 && capturing && !hold_for_graph(device, claimed, graph)) return -1;
  return claimed;
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
