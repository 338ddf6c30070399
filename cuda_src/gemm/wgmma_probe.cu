// Probes of the wgmma GEMM's building blocks (sm_90a), one stage each, for
// benchmarks/experiments/wgmma_bisect.py: each isolates one thing gemm/wgmma.cu relies on, so
// that a wrong GEMM on the GPU can be pinned to a stage. Not used by any op.
//  * wgmma_probe_params: the kernel parameters as the kernel sees them (two CUtensorMaps by value
//    as __grid_constant__, then GemmArgs: the GEMM's exact signature), copied byte for byte to a
//    __device__ array (not through a pointer parameter, which a misplaced parameter block would
//    corrupt too). The host compares them with what it packed.
//  * wgmma_probe_tma: TMA loads of `boxes` boxes of one tensor map into 1024-aligned shared
//    memory through the GEMM's mbarrier path (init, fence, arrive.expect_tx, complete_tx, parity
//    wait; a bounded wait, so a missing completion is reported instead of hanging), then a plain
//    copy of the shared bytes to global memory: the host compares them with the 128-byte swizzled
//    image it expects.
//  * wgmma_probe_mma: one warpgroup, shared memory filled with ordinary stores from host-made
//    images in the layout the descriptors claim (the TMA layout), then `ksteps` wgmma.m64n256k16
//    with the GEMM's own descriptors (WgOperand), accumulators stored raw (fp32) through the
//    fragment mapping the GEMM's epilogue assumes.
#include "gemm/gemm_common.cuh"
#include "common/wgmma.cuh"

// Where wgmma_probe_params copies its parameters: [0, 128) map a, [128, 256) map b, [256, 552)
// GemmArgs, then at 552 the low 6 bits of the generic address of map a (TMA needs 64-byte
// alignment) and at 556 of map b. Global scope: the host finds it by this (unmangled) name;
// aligned for the 4-byte stores at 552 and 556.
__device__ __align__(16) unsigned char gpuops_wgmma_probe_param_dump[576];

namespace gpuops {
namespace gemm {

__global__ void wgmma_probe_params(const __grid_constant__ TmaDesc map_a,
                                   const __grid_constant__ TmaDesc map_b, const GemmArgs p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const unsigned char* a = reinterpret_cast<const unsigned char*>(&map_a);
  const unsigned char* b = reinterpret_cast<const unsigned char*>(&map_b);
  const unsigned char* g = reinterpret_cast<const unsigned char*>(&p);
  for (int i = 0; i < 128; ++i) gpuops_wgmma_probe_param_dump[i] = a[i];
  for (int i = 0; i < 128; ++i) gpuops_wgmma_probe_param_dump[128 + i] = b[i];
  for (int i = 0; i < (int)sizeof(GemmArgs); ++i) gpuops_wgmma_probe_param_dump[256 + i] = g[i];
  *reinterpret_cast<unsigned int*>(gpuops_wgmma_probe_param_dump + 552) =
      (unsigned int)(reinterpret_cast<unsigned long long>(a) & 63);
  *reinterpret_cast<unsigned int*>(gpuops_wgmma_probe_param_dump + 556) =
      (unsigned int)(reinterpret_cast<unsigned long long>(b) & 63);
}

// status[0] = 1 once the barrier phase completed (0: it did not within the spin budget: bytes
// expected but never delivered, or a tensor map TMA refused), status[1] = try_wait rounds,
// status[2] = the shared address of the 1024-aligned destination modulo 1024 (must be 0).
// One block of 128 threads; dynamic shared memory: boxes * box_bytes + 1024 + 64.
__global__ void __launch_bounds__(128, 1)
    wgmma_probe_tma(const __grid_constant__ TmaDesc map, unsigned char* out, unsigned int* status,
                    int c0, int c1, int boxes, int step0, int box_bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const unsigned int raw = smem_u32(smem_raw);
  const unsigned int pad = (1024u - (raw & 1023u)) & 1023u;
  const unsigned int dst = raw + pad;
  const unsigned char* data = smem_raw + pad;
  const unsigned int total = (unsigned int)(boxes * box_bytes);
  const unsigned int bar = dst + total;          // 8-byte aligned: box_bytes is a multiple of 128
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    mbar_fence_init();
    tma_prefetch_desc(&map);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_arrive_expect_tx(bar, total);
    for (int i = 0; i < boxes; ++i)
      tma_load_2d(dst + i * box_bytes, &map, bar, c0 + i * step0, c1);
  }
  // bounded wait on phase 0 (try_wait itself suspends for a while before returning false)
  unsigned int rounds = 0;
  bool done = false;
  while (!done && rounds < 200000u) {
    done = mbar_try_wait(bar, 0);
    ++rounds;
  }
  if (threadIdx.x == 0) {
    status[0] = done ? 1u : 0u;
    status[1] = rounds;
    status[2] = dst & 1023u;
  }
  if (!done) return;
  for (unsigned int i = threadIdx.x * 16; i < total; i += blockDim.x * 16)
    *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<const uint4*>(data + i);
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

// A (64 x 16 ksteps) times B (16 ksteps x 256) with operands placed by ordinary stores: a_img /
// b_img are the shared-memory images (a_bytes, b_bytes) that TMA would write for the GEMM's A
// rows of one consumer warpgroup and its B tile; out[64][256] fp32, row-major, written through
// the accumulator fragment mapping of the GEMM's epilogue. One warpgroup (128 threads); dynamic
// shared memory a_bytes + b_bytes + 1024.
template <class T, bool AMN, bool BMN>
__global__ void __launch_bounds__(128, 1)
    wgmma_probe_mma(const unsigned char* a_img, const unsigned char* b_img, float* out,
                    int a_bytes, int b_bytes, int ksteps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const unsigned int raw = smem_u32(smem_raw);
  const unsigned int pad = (1024u - (raw & 1023u)) & 1023u;
  unsigned char* smem = smem_raw + pad;
  const unsigned int sa = raw + pad, sb = sa + (unsigned int)a_bytes;   // a_bytes: 1024 multiple
  for (int i = threadIdx.x * 16; i < a_bytes; i += blockDim.x * 16)
    *reinterpret_cast<uint4*>(smem + i) = *reinterpret_cast<const uint4*>(a_img + i);
  for (int i = threadIdx.x * 16; i < b_bytes; i += blockDim.x * 16)
    *reinterpret_cast<uint4*>(smem + a_bytes + i) = *reinterpret_cast<const uint4*>(b_img + i);
  // generic-proxy stores -> async-proxy reads (wgmma): a proxy fence, then the CTA barrier
  fence_proxy_async_smem();
  __syncthreads();

  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  reg_fence(acc);
  wgmma_fence();
  for (int kk = 0; kk < ksteps; ++kk)
    wgmma_m64n256k16<T, AMN ? 1 : 0, BMN ? 1 : 0>(acc, WgOperand<AMN>::desc(sa, kk),
                                                  WgOperand<BMN>::desc(sb, kk));
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(acc);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int r = 16 * warp + g, c = 8 * j + 2 * t;
    out[r * 256 + c] = acc[4 * j];
    out[r * 256 + c + 1] = acc[4 * j + 1];
    out[(r + 8) * 256 + c] = acc[4 * j + 2];
    out[(r + 8) * 256 + c + 1] = acc[4 * j + 3];
  }
#else
  __trap();   // not reached: the module is built for sm_90a only
#endif
}

}  // namespace gemm
}  // namespace gpuops
