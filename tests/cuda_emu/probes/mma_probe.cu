// Probes of the tensor-core wrappers (cuda_src/common/mma.cuh) for tests/test_attention.py: one
// warp runs each wrapper on operands from the host and writes every lane's registers back, so
// the test can compare them with the PTX ISA's fragment layouts built in NumPy.
#include "common/mma.cuh"

// rows: 32 rows of 8 b16 values (16 bytes each) -> shared; lane l gives the address of shared
// row perm[l]; plain[l][i] / trans[l][i] = register i of lane l after ldmatrix.x4 (.trans).
__global__ void ldmatrix_probe(const unsigned short* rows, const int* perm, unsigned* plain,
                               unsigned* trans) {
  extern __shared__ uint4 probe_smem[];
  unsigned short* s = reinterpret_cast<unsigned short*>(probe_smem);
  const int lane = threadIdx.x;
  for (int i = lane; i < 32 * 8; i += 32) s[i] = rows[i];
  __syncthreads();
  const unsigned addr = gpuops::smem_addr(s + 8 * perm[lane]);
  unsigned r[4];
  gpuops::ldmatrix_x4(r, addr);
  for (int i = 0; i < 4; ++i) plain[4 * lane + i] = r[i];
  gpuops::ldmatrix_x4_trans(r, addr);
  for (int i = 0; i < 4; ++i) trans[4 * lane + i] = r[i];
}

// d[l] = Mma<T>::run(c[l], a[l], b[l]) for one warp: a [32][4], b [32][2], c and d [32][4] words
// (fp32 or int32 accumulators).
template <class T>
__global__ void mma_probe(const unsigned* a, const unsigned* b, const void* c, void* d) {
  using Acc = typename gpuops::Mma<T>::Acc;
  const int lane = threadIdx.x;
  const unsigned af[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
  Acc acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = static_cast<const Acc*>(c)[4 * lane + i];
  gpuops::Mma<T>::run(acc, af, b[2 * lane], b[2 * lane + 1]);
  for (int i = 0; i < 4; ++i) static_cast<Acc*>(d)[4 * lane + i] = acc[i];
}

// cp.async of 16 bytes per lane, src[l] .. (src_bytes[l] of them, the rest zero-filled) -> shared
// chunk l; before[l] = shared chunk l read after the commit but before the wait (the emulator
// defers the copy to the wait: it still holds the 0xAB fill), after[l] = after the wait.
__global__ void cp_async_probe(const uint4* src, const int* src_bytes, uint4* before, uint4* after) {
  extern __shared__ uint4 probe_smem[];
  const int lane = threadIdx.x;
  unsigned char* s = reinterpret_cast<unsigned char*>(probe_smem);
  for (int i = 0; i < 16; ++i) s[16 * lane + i] = 0xAB;
  __syncwarp();
  gpuops::cp_async16(gpuops::smem_addr(probe_smem + lane), src + lane, src_bytes[lane]);
  gpuops::cp_async_commit();
  before[lane] = probe_smem[lane];
  gpuops::cp_async_wait<0>();
  after[lane] = probe_smem[lane];
}

// cp.async of 4 bytes per lane (cp_async4: the backward's per-row statistics): src[l]
// (src_bytes[l] = 0 or 4; 0: zero-filled) -> shared word l; before / after as cp_async_probe.
__global__ void cp_async4_probe(const unsigned* src, const int* src_bytes, unsigned* before,
                                unsigned* after) {
  extern __shared__ uint4 probe_smem[];
  unsigned* s = reinterpret_cast<unsigned*>(probe_smem);
  const int lane = threadIdx.x;
  s[lane] = 0xABABABABu;
  __syncwarp();
  gpuops::cp_async4(gpuops::smem_addr(s + lane), src + lane, src_bytes[lane]);
  gpuops::cp_async_commit();
  before[lane] = s[lane];
  gpuops::cp_async_wait<0>();
  after[lane] = s[lane];
}

// pack_b16x2<T>(lo[l], hi[l]) and to_tf32(x[l]).
template <class T>
__global__ void pack_probe(const float* lo, const float* hi, unsigned* packed, const unsigned* x,
                           unsigned* tf32) {
  const int lane = threadIdx.x;
  packed[lane] = gpuops::pack_b16x2<T>(lo[lane], hi[lane]);
  tf32[lane] = gpuops::to_tf32(x[lane]);
}
