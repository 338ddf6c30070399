"""What the "resident" long-row plan's structure can reach without its math or its exchange
(norm_ring.cuh resident_rows; notes_norms.md, runs 100-105): [16, 2^20] bf16 = 32 MiB = 1024
tiles of 32 KB, 128 blocks of 512 threads (one per SM), 8 tiles each (7 through shared memory),
CUDA-graph replay (20 calls per graph, median of 20 replays), in one process:

  copy            torch's copy_ of x into y (the DRAM reference; 2 x 32 MiB moved)
  read_flat       a grid-stride read of x (4 blocks of 256 threads per SM, 4 x 16 B per thread
                  per step): what a read-only kernel streams
  read_async      the resident plan's read phase alone: every block issues the cp.async copies of
                  its 7 slot tiles at once (one commit group per tile), then waits for each in
                  order and sums it (no exchange, nothing stored but one word per block)
  write_flat      a grid-stride write of y
  read_then_write read_async, then each block stores its 7 held tiles to y in order: the resident
                  plan's two phases without the exchange, the register tile or any math
Runs 101-105 put rms_norm_resident at 29.9 us (74.7% of copy) with half its ncu samples in the
read phase at ~2.2 TB/s; read_then_write near 29-30 us would say the structure (all reads, then
all writes, per SM) is the limit, not the exchange or the math; near the copy, that the
resident kernel's own phases are.

    python benchmarks/experiments/norms_read_phase.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import cupy as cp  # noqa: E402
import torch  # noqa: E402

SRC = r"""
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void wait_pending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;"); break;
    case 1: asm volatile("cp.async.wait_group 1;"); break;
    case 2: asm volatile("cp.async.wait_group 2;"); break;
    case 3: asm volatile("cp.async.wait_group 3;"); break;
    case 4: asm volatile("cp.async.wait_group 4;"); break;
    case 5: asm volatile("cp.async.wait_group 5;"); break;
    default: asm volatile("cp.async.wait_group 6;"); break;
  }
}
constexpr int kPacks = 4;   // 16-byte units per thread per tile (512 threads: 32 KB tiles)

// tiles t = blockIdx.x + k * gridDim.x, k < held; tile t = units [t * tile_units, +tile_units)
extern "C" __global__ void __launch_bounds__(512, 1)
read_async(const uint4* x, int tiles, int depth, uint4* y, unsigned* out) {
  extern __shared__ uint4 ring[];
  const int tile_units = blockDim.x * kPacks;
  const int K = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int held = K < depth ? K : depth;
  for (int k = 0; k < held; ++k) {
    const long long t = blockIdx.x + static_cast<long long>(k) * gridDim.x;
    for (int p = 0; p < kPacks; ++p) {
      const int u = p * blockDim.x + threadIdx.x;
      cp16(smem_u32(ring + k * tile_units + u), x + t * tile_units + u);
    }
    commit();
  }
  unsigned acc = 0;
  for (int k = 0; k < held; ++k) {
    wait_pending(held - 1 - k);
    for (int p = 0; p < kPacks; ++p) {
      const uint4 v = ring[k * tile_units + p * blockDim.x + threadIdx.x];
      acc += v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  if (y != nullptr) {               // read_then_write: the held tiles back out, in order
    for (int k = 0; k < held; ++k) {
      const long long t = blockIdx.x + static_cast<long long>(k) * gridDim.x;
      for (int p = 0; p < kPacks; ++p) {
        const int u = p * blockDim.x + threadIdx.x;
        y[t * tile_units + u] = ring[k * tile_units + u];
      }
    }
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;   // (keeps the sums; practically never true)
}

extern "C" __global__ void read_flat(const uint4* x, long long units, unsigned* out) {
  unsigned acc = 0;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x * 4;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x * 4 + threadIdx.x;
       i < units; i += stride) {
    uint4 v[4];
    for (int j = 0; j < 4; ++j) {
      const long long k = i + j * blockDim.x;
      v[j] = k < units ? x[k] : make_uint4(0, 0, 0, 0);
    }
    for (int j = 0; j < 4; ++j) acc += v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}

extern "C" __global__ void write_flat(uint4* y, long long units) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  const uint4 v = make_uint4(threadIdx.x, blockIdx.x, 1u, 2u);
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < units;
       i += stride)
    y[i] = v;
}
"""

ROWS, N = 16, 1 << 20               # bf16: 32 MiB
TILE_BYTES = 512 * 4 * 16


def graph_us(fn, calls=20, replays=20):
    """Median time per call of `fn` replayed in a CUDA graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(times[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    arch = dev.compute_capability
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    read_async, read_flat, write_flat = (mod.get_function(k) for k in
                                         ("read_async", "read_flat", "write_flat"))
    x = torch.randn(ROWS, N, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    out = torch.zeros(4096, device="cuda", dtype=torch.int32)
    nbytes = x.numel() * 2
    units = nbytes // 16
    tiles = nbytes // TILE_BYTES
    depth = 7
    smem = depth * TILE_BYTES
    read_async.max_dynamic_shared_size_bytes = smem
    grid = -(-tiles // (depth + 1))                  # 8 tiles per block, as resident's grid
    per_block = -(-tiles // grid)
    xs, ys, os_ = (cp.uint64(t.data_ptr()) for t in (x, y, out))

    def launch(k, g, b, a, shared=0):
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            k((g,), (b,), a, shared_mem=shared)

    # the held tiles only: tiles k < depth of each block (7 of its 8); the register tile of the
    # real kernel is left out, so the bytes per block are 7/8 of resident's
    held_tiles = grid * depth
    cases = {
        "copy": (lambda: y.copy_(x), 2 * nbytes),
        "read_flat": (lambda: launch(read_flat, 4 * sms, 256, (xs, cp.int64(units), os_)),
                      nbytes),
        "read_async": (lambda: launch(read_async, grid, 512, (xs, cp.int32(held_tiles),
                                                              cp.int32(depth), cp.uint64(0),
                                                              os_), smem),
                       held_tiles * TILE_BYTES),
        "write_flat": (lambda: launch(write_flat, 4 * sms, 256, (ys, cp.int64(units))), nbytes),
        "read_then_write": (lambda: launch(read_async, grid, 512, (xs, cp.int32(held_tiles),
                                                                   cp.int32(depth), ys, os_),
                                           smem),
                            2 * held_tiles * TILE_BYTES),
    }
    rows = []
    print(f"{arch=} {sms=} grid {grid} x 512 (tiles {tiles}, {per_block} per block, "
          f"{depth} held), {nbytes / 2**20:.0f} MiB", flush=True)
    copy_gbps = None
    for name, (fn, moved) in cases.items():
        us = graph_us(fn)
        gbps = moved / (us * 1e-6) / 1e9
        copy_gbps = copy_gbps or gbps
        rows.append(dict(case=name, us=us, bytes=moved, gbps=gbps, pct_copy=100 * gbps / copy_gbps))
        print(f"{name:<16}{us:8.2f} us {moved / 1e6:7.1f} MB {gbps:7.0f} GB/s "
              f"{100 * gbps / copy_gbps:5.1f}% of copy", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=arch, sms=sms, grid=grid, depth=depth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
