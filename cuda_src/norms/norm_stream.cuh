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
// A stage holds one row as `units` 16-byte units (add_rms_norm: then the residual's row). A row
// belongs to a team of T warps (T = 1: a warp per row); team lane t (= warp in team * 32 + lane)
// copies units t, t + 32 T, ... of the team's rows and later reads exactly those: its own
// cp.async.wait_group makes them visible to it, and it copies into a stage again only after it
// has read it, so the ring needs no barrier. Statistics: each lane keeps one accumulator per
// element of a unit (VEC independent chains, not one chain of every element: run 155's first
// kernel spent ~6500 cycles per row per warp, mostly waiting on a 128-long chain of dependent
// adds per pass), then warp shuffles, then (T > 1) the team's warps add their partials through
// shared memory after a named barrier of the team (id 1 + team index). layer_norm: exact
// two-pass statistics over the stage (the mean, then squared deviations from it). The affine
// parameters are copied into shared memory once per block, the kernel's one __syncthreads.
// Rows go to teams round-robin over the grid (team g of W: rows g, g + W, ...). Teams of
// several warps put more warps on an SM for the same shared memory: run 155 measured the rows'
// throughput following the warps per SM (bf16 [32768, 4096] layer_norm: 4 warps 206.8 us, 8
// warps 144.7-150.4), not the bytes in flight beyond ~64 KB.
//
// A team's pipeline: the first `depth` rows are issued (one commit group each, empty past the
// last row); then for each row: wait until at most depth - 1 groups are pending (this row's group
// has landed), work on it, issue the row `depth` rows on into the freed stage, commit.
//
// Below sm_80 copy16_to_shared is a load and a store through registers (complete at once): the
// same results, not a speed path (the host picks the stream plan there only when asked).
//
// Dynamic shared memory, in 16-byte units: Policy::kParams * units of parameters; per team
// depth * Policy::kSources * units of ring; then (T > 1) 2 x T floats of partials per team.
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

// This team lane's units of one row into a stage.
template <class T, int VEC>
__device__ __forceinline__ void stream_issue_row(uint4* stage, const T* row, int lane, int size,
                                                 int units) {
#pragma unroll 4
  for (int u = lane; u < units; u += size)
    copy16_to_shared(stage + u, row + static_cast<long long>(u) * VEC);
}

// A row's team: `warps` warps sharing its units (see above). sum(): every lane of the team gets
// the team's total of v, added in a fixed order (the same bits in every lane). Two sets of
// partial slots alternate: a warp can write the next exchange's partial only after the team's
// barrier of that exchange, which every warp reaches after reading the previous one's.
struct StreamTeam {
  int lane;       // team lane: member * 32 + lane of the warp
  int size;       // 32 * warps
  int warps;
  int member;     // this warp's index in the team
  unsigned bar;   // named barrier id (1 + team index in the block)
  float* slots;   // 2 x warps floats, this team's
  int set;

  __device__ __forceinline__ float sum(float v) {
    v = warp_sum(v);
    if (warps == 1) return v;
    float* s = slots + set * warps;
    set ^= 1;
    if ((lane & 31) == 0) s[member] = v;
    named_barrier(bar, static_cast<unsigned>(size));
    float t = s[0];
    for (int k = 1; k < warps; ++k) t += s[k];
    return t;
  }
};

// The sum of a lane's per-element accumulators, in a fixed tree.
template <int VEC>
__device__ __forceinline__ float sum_lanes(const float (&a)[VEC]) {
  float t[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) t[j] = a[j];
#pragma unroll
  for (int w = VEC / 2; w > 0; w /= 2) {
#pragma unroll
    for (int j = 0; j < w; ++j) t[j] += t[j + w];
  }
  return t[0];
}

// The team pipeline above (blockDim.x = 32 * team_warps * teams per block; teams per block <= 15
// where team_warps > 1). Policy: kParams, kSources; load_params(smem, units) (block-wide, no
// barrier), issue(stage, row, team, units), work(stage, params, row, team, units).
template <class Policy>
__device__ __forceinline__ void stream_rows(const Policy& pol, long long rows, int units,
                                            int depth, int team_warps, uint4* smem) {
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int teams = (static_cast<int>(blockDim.x) >> 5) / team_warps;
  const int team_index = warp / team_warps;
  const int stage_units = Policy::kSources * units;
  StreamTeam team;
  team.member = warp - team_index * team_warps;
  team.lane = team.member * 32 + (static_cast<int>(threadIdx.x) & 31);
  team.warps = team_warps;
  team.size = 32 * team_warps;
  team.bar = 1u + static_cast<unsigned>(team_index);
  team.slots = reinterpret_cast<float*>(smem + Policy::kParams * units +
                                        teams * depth * stage_units) + team_index * 2 * team_warps;
  team.set = 0;
  const long long step = static_cast<long long>(gridDim.x) * teams;
  const long long first = static_cast<long long>(blockIdx.x) * teams + team_index;
  pol.load_params(smem, units);
  __syncthreads();
  uint4* ring = smem + Policy::kParams * units + team_index * depth * stage_units;
  for (int k = 0; k < depth; ++k) {
    const long long row = first + k * step;
    if (row < rows) pol.issue(ring + k * stage_units, row, team, units);
    copy_async_commit();
  }
  int s = 0;
  for (long long row = first; row < rows; row += step) {
    copy_async_wait(depth - 1);                  // this row's group (the oldest) has landed
    uint4* stage = ring + s * stage_units;
    pol.work(stage, smem, row, team, units);
    const long long next = row + depth * step;
    if (next < rows) pol.issue(stage, next, team, units);
    copy_async_commit();
    s = s + 1 == depth ? 0 : s + 1;
  }
}

}  // namespace gpuops
