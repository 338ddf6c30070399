// Host stand-in for cuda_src/gemm/mma_common.cuh (scripts/gemm_mma_emu/run.py): ldmatrix and
// mma.sync as warp-collective exchanges through per-warp buffers (their PTX ISA fragment
// layouts), cp.async as an immediate copy (its zero fill included), checks of the alignment and
// src-size rules; TF32 operands must arrive rounded (cvt.rna), as the real mma would truncate.
#pragma once
#include <cmath>

namespace gpuops {
namespace gemm {

inline unsigned int smem_addr(const void* p) {
  return static_cast<unsigned int>(static_cast<const unsigned char*>(p) - emu::dynamic_smem);
}

struct EmuWarpBuf { unsigned int v[32][8]; };
inline EmuWarpBuf emu_bufs[64];
inline EmuWarpBuf& emu_buf() { return emu_bufs[emu::linear / 32]; }

inline void emu_ldmatrix(unsigned int (&r)[4], unsigned int addr, bool trans) {
  EmuWarpBuf& b = emu_buf();
  const int lane = emu::linear & 31;
  if (addr % 16) emu::fail("ldmatrix: row address not 16-byte aligned");
  b.v[lane][0] = addr;
  emu::warp().bar.arrive_and_wait();
  for (int i = 0; i < 4; ++i) {
    if (!trans) {
      const unsigned int row = b.v[8 * i + lane / 4][0];
      std::memcpy(&r[i], emu::dynamic_smem + row + 4 * (lane % 4), 4);
    } else {
      unsigned short e[2];
      for (int h = 0; h < 2; ++h) {
        const unsigned int row = b.v[8 * i + 2 * (lane % 4) + h][0];
        std::memcpy(&e[h], emu::dynamic_smem + row + 2 * (lane / 4), 2);
      }
      r[i] = e[0] | (static_cast<unsigned int>(e[1]) << 16);
    }
  }
  emu::warp().bar.arrive_and_wait();
}

inline void ldmatrix_x4(unsigned int (&r)[4], unsigned int addr) { emu_ldmatrix(r, addr, false); }
inline void ldmatrix_x4_trans(unsigned int (&r)[4], unsigned int addr) { emu_ldmatrix(r, addr, true); }

inline void cp_async16(unsigned int dst, const void* src, int src_bytes) {
  if (dst % 16) emu::fail("cp.async: shared address not 16-byte aligned");
  if (src_bytes > 0 && reinterpret_cast<unsigned long long>(src) % 16 && src_bytes == 16)
    emu::fail("cp.async: global address not 16-byte aligned");
  if (src_bytes < 0 || src_bytes > 16) emu::fail("cp.async: src-size out of range");
  std::memset(emu::dynamic_smem + dst, 0, 16);
  if (src_bytes > 0) std::memcpy(emu::dynamic_smem + dst, src, src_bytes);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
inline void prefetch_l2(const void*) {}

inline float emu_b16(unsigned int w, int half, bool bf) {
  const unsigned short h = static_cast<unsigned short>(half ? w >> 16 : w & 0xffffu);
  if (bf) { bfloat16_t b; b.bits = h; return to_float(b); }
  float16_t f; f.bits = h; return to_float(f);
}

// D (16x8) += A (16xK) B (Kx8): every lane publishes a[4], b[2]; lane (g, t) computes its four.
template <class F>
inline void emu_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1,
                    int K, F elem) {
  EmuWarpBuf& w = emu_buf();
  const int lane = emu::linear & 31;
  for (int i = 0; i < 4; ++i) w.v[lane][i] = a[i];
  w.v[lane][4] = b0;
  w.v[lane][5] = b1;
  emu::warp().bar.arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  for (int q = 0; q < 4; ++q) {
    const int row = g + (q >> 1) * 8, col = 2 * t + (q & 1);
    float acc = d[q];
    for (int k = 0; k < K; ++k) acc = std::fma(elem(w, true, row, k), elem(w, false, k, col), acc);
    d[q] = acc;
  }
  emu::warp().bar.arrive_and_wait();
}

template <class T>
struct Mma;

template <bool BF>
struct MmaB16 {
  static constexpr int kK = 16;
  using Acc = float;
  static void run(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    emu_mma(d, a, b0, b1, 16, [](EmuWarpBuf& w, bool isa, int r, int c) {
      if (isa) {   // A[r][c]: lane (r % 8, (c % 8) / 2), reg (r / 8) + 2 (c / 8), half c % 2
        return emu_b16(w.v[(r % 8) * 4 + (c % 8) / 2][(r / 8) + 2 * (c / 8)], c % 2, BF);
      }            // B[k = r][n = c]: lane (c, (r % 8) / 2), b[r / 8], half r % 2
      return emu_b16(w.v[c * 4 + (r % 8) / 2][4 + r / 8], r % 2, BF);
    });
  }
};
template <> struct Mma<bfloat16_t> : MmaB16<true> {};
template <> struct Mma<float16_t> : MmaB16<false> {};

template <>
struct Mma<float> {
  static constexpr int kK = 8;
  using Acc = float;
  static void run(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    emu_mma(d, a, b0, b1, 8, [](EmuWarpBuf& w, bool isa, int r, int c) {
      if (isa) {   // a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
        const unsigned int u = w.v[(r % 8) * 4 + c % 4][(r / 8) + 2 * (c / 4)];
        if (u & 0x1fffu) emu::fail("tf32 operand not rounded (to_tf32 missing)");
        return __uint_as_float(u);
      }            // b0 = B[t][g], b1 = B[t+4][g]
      const unsigned int u = w.v[c * 4 + r % 4][4 + r / 4];
      if (u & 0x1fffu) emu::fail("tf32 operand not rounded (to_tf32 missing)");
      return __uint_as_float(u);
    });
  }
};

template <>
struct Mma<signed char> {
  static constexpr int kK = 32;
  using Acc = int;
  static void run(int (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    EmuWarpBuf& w = emu_buf();
    const int lane = emu::linear & 31;
    for (int i = 0; i < 4; ++i) w.v[lane][i] = a[i];
    w.v[lane][4] = b0;
    w.v[lane][5] = b1;
    emu::warp().bar.arrive_and_wait();
    auto byte = [](unsigned int u, int i) { return static_cast<int>(static_cast<signed char>((u >> (8 * i)) & 0xffu)); };
    const int g = lane >> 2, t = lane & 3;
    for (int q = 0; q < 4; ++q) {
      const int row = g + (q >> 1) * 8, col = 2 * t + (q & 1);
      int acc = d[q];
      for (int k = 0; k < 32; ++k) {
        // a0 = A[g][4t..4t+3], a1 = A[g+8][..], a2 = A[g][4t+16..], a3 = A[g+8][4t+16..]
        const int av = byte(w.v[(row % 8) * 4 + (k % 16) / 4][(row / 8) + 2 * (k / 16)], k % 4);
        // b0 = B[4t..4t+3][g], b1 = B[4t+16..][g]
        const int bv = byte(w.v[col * 4 + (k % 16) / 4][4 + k / 16], k % 4);
        acc += av * bv;
      }
      d[q] = acc;
    }
    emu::warp().bar.arrive_and_wait();
  }
};

inline unsigned int to_tf32(unsigned int x) {   // cvt.rna: round half away on 13 dropped bits
  if ((x & 0x7f800000u) == 0x7f800000u) return x & ~0x1fffu;
  return (x + 0x1000u) & ~0x1fffu;
}

}  // namespace gemm
}  // namespace gpuops
