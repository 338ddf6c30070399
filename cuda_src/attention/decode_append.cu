// append_paged_kv: write new tokens' K and V into a paged cache in place. Token t of sequence b
// goes to position p (positions[b] + t, or positions[b, t]): page block_table[b, p / page_size],
// row p % page_size. A negative position (padding) or a slot outside the table or the pool
// writes nothing (no out-of-bounds write without a host check).
#include "common/dtypes.cuh"

namespace gpuops {

constexpr int kAppendThreads = 256;   // APPEND_THREADS in gpuops/ops/attention_decode.py

template <class T>
__global__ void __launch_bounds__(kAppendThreads) append_paged_kv(
    const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ kp, T* __restrict__ vp,
    const int* __restrict__ block_table, const int* __restrict__ positions,
    long long k_sb, long long k_ss, long long k_sh, long long k_sd,
    long long v_sb, long long v_ss, long long v_sh, long long v_sd,
    long long kp_s0, long long kp_s1, long long kp_sh, long long kp_sd,
    long long vp_s0, long long vp_s1, long long vp_sh, long long vp_sd,
    long long table_s0, long long table_s1, long long pos_sb, long long pos_ss, int per_token,
    int page_size, int num_pages, int max_pages, int sn, int hkv, int d, long long total) {
  for (long long idx = blockIdx.x * static_cast<long long>(kAppendThreads) + threadIdx.x;
       idx < total; idx += static_cast<long long>(gridDim.x) * kAppendThreads) {
    const int c = static_cast<int>(idx % d);
    long long rest = idx / d;
    const int h = static_cast<int>(rest % hkv);
    rest /= hkv;
    const int t = static_cast<int>(rest % sn);
    const long long b = rest / sn;
    const long long p = static_cast<long long>(positions[b * pos_sb + t * pos_ss]) +
                        (per_token ? 0 : t);
    if (p < 0) continue;
    const long long pi = p / page_size;
    if (pi >= max_pages) continue;
    const int page = block_table[b * table_s0 + pi * table_s1];
    if (page < 0 || page >= num_pages) continue;
    const long long row = p - pi * page_size;
    kp[page * kp_s0 + row * kp_s1 + h * kp_sh + c * kp_sd] =
        k[b * k_sb + t * k_ss + h * k_sh + c * k_sd];
    vp[page * vp_s0 + row * vp_s1 + h * vp_sh + c * vp_sd] =
        v[b * v_sb + t * v_ss + h * v_sh + c * v_sd];
  }
}

}  // namespace gpuops
