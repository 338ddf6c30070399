// Whole rows streamed through shared memory, one warp per row (the "stream" plan of
// gpuops.ops.norms.STREAM_ROWS, for layer_norm, rms_norm and add_rms_norm).
//
// Why: the one-block-per-row kernels (layer_norm_compact, rms_norm_fwd) land a row in registers,
// so an SM holds at most ~64 KB of loads in flight (8 blocks x 256 threads x 32 bytes), and a
// block has nothing in flight from the moment its row lands until it starts the next one. That
// was enough for the H100's 3.0 TB/s; on an H200 (4.2 TB/s, 132 SMs: 32 GB/s per SM) Little's law
// at ~2-3 us of loaded DRAM latency asks for 64-96 KB per SM all the time, and run 154 measured
// layer_norm bf16 [32768, 4096] at 77% of copy (Liger 91%), rms_norm at 90.5% (Liger 97%). Here
// the landing buffer is shared memory: each warp keeps a ring of `depth` stages, the next
// depth - 1 of its rows always in flight (cp.async, L2 only) while it works on one: ~128 KB per
// SM whatever the reductions cost.
//
// A stage holds one row as `units` 16-byte units (add_rms_norm: then the residual's row). Lane l
// copies units l, l + 32, ... of its warp's rows and later reads exactly those: its own
// cp.async.wait_group makes them visible to it, and it copies into a stage again only after it
// has read it, so the ring needs no barrier. Statistics reduce over the warp with shuffles only
// (a warp holds the whole row: plain two-pass statistics for layer_norm). The affine parameters
// are copied into shared memory once per block, the kernel's one __syncthreads. Rows go to warps
// round-robin over the grid (warp g of W: rows g, g + W, ...).
//
// A warp's pipeline: the first `depth` rows are issued (one commit group each, empty past the
// last row); then for each row: wait until at most depth - 1 groups are pending (this row's group
// has landed), work on it, issue the row `depth` rows on into the freed stage, commit.
//
// Below sm_80 copy16_to_shared is a load and a store through registers (complete at once): the
// same results, not a speed path (the host picks the stream plan there only when asked).
//
// Dynamic shared memory (16-byte units): Policy::kParams * units of parameters, then per warp
// depth * Policy::kSources * units of ring.
#pragma once
#include "norms/norm_rows.cuh"
#include "common/mma.cuh"     // copy16_to_shared, copy_async_commit / wait
#include "common/reduce.cuh"

namespace gpuops {

// Copies the `units` units of a parameter vector (null: nothing) into shared memory, block-wide.
template <class T, int VEC>
__device__ __forceinline__ void stream_params(uint4* dst, const T* src, int units) {
  if (src == nullptr) return;
  for (int u = threadIdx.x; u < units; u += blockDim.x)
    dst[u] = load16(src + static_cast<long long>(u) * VEC);
}

// This lane's units of one row into a stage.
template <class T, int VEC>
__device__ __forceinline__ void stream_issue_row(uint4* stage, const T* row, int lane, int units) {
#pragma unroll 4
  for (int u = lane; u < units; u += 32)
    copy16_to_shared(stage + u, row + static_cast<long long>(u) * VEC);
}

// The warp pipeline above. Policy: kParams, kSources; load_params(smem, units) (block-wide, no
// barrier), issue(stage, row, lane, units), work(stage, params, row, lane, units).
template <class Policy>
__device__ __forceinline__ void stream_rows(const Policy& pol, long long rows, int units,
                                            int depth, uint4* smem) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = static_cast<int>(blockDim.x) >> 5;
  const long long step = static_cast<long long>(gridDim.x) * warps;
  const long long first = static_cast<long long>(blockIdx.x) * warps + warp;
  pol.load_params(smem, units);
  __syncthreads();
  const int stage_units = Policy::kSources * units;
  uint4* ring = smem + Policy::kParams * units + warp * depth * stage_units;
  for (int k = 0; k < depth; ++k) {
    const long long row = first + k * step;
    if (row < rows) pol.issue(ring + k * stage_units, row, lane, units);
    copy_async_commit();
  }
  int s = 0;
  for (long long row = first; row < rows; row += step) {
    copy_async_wait(depth - 1);                  // this row's group (the oldest) has landed
    uint4* stage = ring + s * stage_units;
    pol.work(stage, smem, row, lane, units);
    const long long next = row + depth * step;
    if (next < rows) pol.issue(stage, next, lane, units);
    copy_async_commit();
    s = s + 1 == depth ? 0 : s + 1;
  }
}

}  // namespace gpuops
