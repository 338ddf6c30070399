// Programmatic dependent launch (PDL, sm_90+): a kernel launched with the launch attribute
// PROGRAMMATIC_STREAM_SERIALIZATION (gpuops.runtime.launch: attrs=PDL) may start while the
// previous kernel of its stream is still running, once every block of that kernel has executed
// pdl_launch_dependents() (or exited). The dependent kernel must call pdl_wait() before it touches
// any memory the previous kernel writes or reads: the wait returns when the previous grid has
// completed and its memory operations are visible. Without the attribute, or on older archs,
// both are no-ops (the ordinary stream order already holds), so one source serves every arch and
// both launch forms. PTX: griddepcontrol (ISA 7.8, sm_90).
#pragma once

namespace gpuops {

// Let the next kernel of the stream (if it was launched as a PDL secondary) be scheduled now.
// Says nothing about this kernel's memory: the secondary's pdl_wait() still waits for all of it.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Wait until the previous kernel of the stream has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A hint that [p, p + bytes) will be read soon: the SM's bulk-copy unit asks DRAM for those lines
// into L2 (sm_90+: cp.async.bulk.prefetch.L2; p and bytes multiples of 16), without waiting and
// without registers or shared memory; elsewhere nothing. The one memory operation a kernel may
// issue before pdl_wait(): it returns nothing to the thread and changes no value, and L2 is the
// point of coherence of global memory for every SM, so a line fetched early is updated in L2 by a
// write of the previous kernel like any other (the thread's own loads, after the wait, read that
// value). Lets a PDL secondary start its DRAM reads while its predecessor is still finishing.
__device__ __forceinline__ void l2_prefetch_bulk(const void* p, unsigned int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

// The first statement of every kernel of a module declared with pdl=True (gpuops.runtime.modules;
// the launcher then makes each launch a PDL secondary on sm_90+), l2_prefetch_bulk hints aside.
// The wait comes before any load or store: the previous kernel may write what this one reads, or
// still read memory that this one's outputs reuse. The trigger right after it lets the next
// kernel's blocks be scheduled into slots this grid leaves free (they wait in their own
// pdl_start); it completes only once every block of this grid has executed it, so a multi-wave
// grid releases its successor during its last wave.
// Hides most of the successor's launch gap: 0.43-0.50 us per decode-sized call in a CUDA graph
// on the H100 (runs 71, 73; benchmarks/NOTES.md).
__device__ __forceinline__ void pdl_start() {
  pdl_wait();
  pdl_launch_dependents();
}

// pdl_start() without the trigger, for kernels that run grids of many waves (the successor then
// starts when this grid completes, as in plain stream order: their launch gap is a small part of
// their time). Any trigger in a kernel's code cost those grids (H200, bf16, 5-call graphs):
// executed by every block of [131072, 1024] (128-thread blocks) it throttled their dispatch
// (run 163's Nsight Compute: achieved occupancy 52% of the theoretical 100%, Liger's kernel 92%;
// rms_norm_rows 160.0 us, 133.0 without it, Liger 132.3; layer_norm_lean 161.0 -> 142.7, run
// 165); behind a branch that large grids skip (grids of <= 4096 blocks trigger), never executed
// there, it still cost layer_norm_lean 148.8 us against 142.7 at 1024 and 156.0 against 148.9 at
// [65536, 2048] (run 169, the same NVRTC 13.0 build but for the branch; runs 166-168 alike), a
// trigger in the last 4096 blocks only 153.7 and 162.4 (run 166). The launch attribute itself
// made no difference (GPUOPS_PDL=0 against 1, run 164).
__device__ __forceinline__ void pdl_start_untriggered() {
  pdl_wait();
}

}  // namespace gpuops
