"""A NumPy model of cuda_src/gemm/wgmma.cu's data movement, checked without a GPU.

What it checks (each against the PTX ISA's own description, modelled independently):
* TMA with CU_TENSOR_MAP_SWIZZLE_128B puts box element (i0 inner, i1 outer) of a box whose
  inner extent is 128 bytes at shared byte address swz(dst + i1 * 128 + i0 * 2), where
  swz(a) = a ^ (((a >> 7) & 7) << 4) (16-byte chunk index XOR row within the 1024-byte atom);
  out-of-range elements are zeros.
* wgmma reads operand element (mn, k) of one m64nNk16 at swz(start + canonical offset), with the
  canonical layouts of "Shared Memory Matrix Layout" (T = 8 bf16 per 16 bytes):
    K-major  ((8, m), (T, 2k)) : ((8T, SBO), (1, T))
    MN-major ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO))
  (strides in elements, LBO / SBO in bytes in the descriptor).
* The kernel's constants (box placement, 8192-byte offset of consumer warpgroup 1's rows, k16
  step offsets, LBO / SBO; mirrored below from wgmma.cu): for every operand layout, every k16 step
  and both consumer warpgroups, what wgmma reads must be the global element A[m0 + m][k0 + k] /
  B[k0 + k][n0 + n], including ragged M / N / K edges (zeros past them).
* The epilogue: accumulator fragments (d[4j + {0,1,2,3}] = D[16w + g (+8)][8j + 2t (+1)]), the
  per-warp 16 x 32 staging chunks with the 16-register shift per chunk, and the read-back
  mapping, write every element of the warpgroup's 64 x 256 tile exactly once; the float2 writes
  and float4 reads of the staging buffer are free of shared-memory bank conflicts.

    python scripts/wgmma_layout_sim.py        # prints one line per check, exits 1 on a mismatch
"""
from __future__ import annotations

import sys

import numpy as np

# ---- mirrored from cuda_src/gemm/wgmma.cu (LBO / SBO / k16 steps: WgOperand in wgmma_common.cuh)
BM, BN, BK = 128, 256, 64
A_BYTES = BM * BK * 2
BOX_BYTES = 64 * 64 * 2            # one M/N-major box
SBO = 1024


def lbo(mn_major):
    return BOX_BYTES if mn_major else 16


def k_step(mn_major):
    return 2048 if mn_major else 32


A_WG_OFFSET = 8192                # consumer warpgroup cg reads A rows from + cg * 8192
EPI_LD = 40                       # floats per staged epilogue row


def swz(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def tma_box(smem, dst, tensor, c_inner, c_outer, box_inner, box_outer):
    """tensor[outer][inner] (2-D, element indices) -> shared memory model (dict addr -> value)."""
    assert dst % 1024 == 0 and box_inner * 2 == 128
    rows, cols = tensor.shape
    for i1 in range(box_outer):
        for i0 in range(box_inner):
            o, i = c_outer + i1, c_inner + i0
            v = tensor[o, i] if (0 <= o < rows and 0 <= i < cols) else 0.0
            a = swz(dst + i1 * 128 + i0 * 2)
            smem[a] = v


def wgmma_read(smem, start, lbo_b, sbo_b, mn_major, rows):
    """The rows x 16 operand (rows = 64 for A, 256 for B^T) a m64nNk16 reads: X[mn][k]."""
    out = np.zeros((rows, 16))
    for mn in range(rows):
        for k in range(16):
            if mn_major:
                a0, a1, a2 = mn % 8, (mn // 8) % 8, mn // 64
                b0, b1 = k % 8, k // 8
                off = (a0 + 8 * a1) * 2 + 128 * b0 + a2 * lbo_b + b1 * sbo_b
            else:
                r0, r1 = mn % 8, mn // 8
                k0, k1 = k % 8, k // 8
                off = r0 * 128 + r1 * sbo_b + k0 * 2 + k1 * 16
            out[mn, k] = smem.get(swz(start + off), np.nan)   # never loaded: stale
    return out


def check_stage(a_mn, b_mn, M, N, K, m0, n0, k0, rng):
    A = rng.integers(-4, 5, (M, K)).astype(float)
    B = rng.integers(-4, 5, (K, N)).astype(float)
    smem = {}
    sa, sb = 0, A_BYTES
    # producer (wgmma.cu): A K-major: one box {64 k, 128 m}; M-major: boxes {64 m, 64 k} at 8192 i
    if a_mn:
        for i in range(2):
            if m0 + 64 * i < M:           # boxes wholly past M are skipped
                tma_box(smem, sa + i * BOX_BYTES, A.T, m0 + 64 * i, k0, 64, 64)
    else:
        tma_box(smem, sa, A, k0, m0, 64, BM)
    if b_mn:
        for i in range(min(4, (N - n0 + 63) // 64)):
            tma_box(smem, sb + i * BOX_BYTES, B, n0 + 64 * i, k0, 64, 64)
    else:
        tma_box(smem, sb, B.T, k0, n0, 64, BN)

    def expect(X, r0, rows, kk):
        out = np.zeros((rows, 16))
        for r in range(rows):
            for k in range(16):
                rr, kg = r0 + r, k0 + 16 * kk + k
                out[r, k] = X[rr, kg] if (rr < X.shape[0] and kg < X.shape[1]) else 0.0
        return out

    for cg in range(2):
        for kk in range(BK // 16):
            got_a = wgmma_read(smem, sa + cg * A_WG_OFFSET + kk * k_step(a_mn), lbo(a_mn), SBO,
                               a_mn, 64)
            exp_a = expect(A, m0 + 64 * cg, 64, kk)
            live = min(64, max(0, M - m0 - 64 * cg))          # rows past M are never stored
            if not np.array_equal(got_a[:live], exp_a[:live]):
                return f"A (M-major={a_mn}) warpgroup {cg} k-step {kk}"
            got_b = wgmma_read(smem, sb + kk * k_step(b_mn), lbo(b_mn), SBO, b_mn, 256)
            exp_b = expect(B.T, n0, 256, kk)
            live_n = min(256, max(0, N - n0))
            if not np.array_equal(got_b[:live_n], exp_b[:live_n]):
                return f"B (N-major={b_mn}) k-step {kk}"
    return None


def check_layouts():
    rng = np.random.default_rng(0)
    cases = [(128, 256, 64, 0, 0, 0), (300, 600, 200, 256, 512, 128), (130, 70, 65, 0, 0, 64),
             (200, 300, 100, 128, 256, 64)]
    bad = []
    for a_mn in (False, True):
        for b_mn in (False, True):
            for M, N, K, m0, n0, k0 in cases:
                why = check_stage(a_mn, b_mn, M, N, K, m0, n0, k0, rng)
                if why:
                    bad.append(f"{why} (M, N, K = {M}, {N}, {K}; tile {m0}, {n0}, {k0})")
    return bad


def check_epilogue():
    """One warpgroup's 64 x 256 tile through the fragments, the staging and the read-back."""
    D = np.arange(64 * 256, dtype=float).reshape(64, 256)
    written = np.full((64, 256), np.nan)
    count = np.zeros((64, 256), int)
    bad = []
    for w in range(4):
        # fragments: thread (w, lane) holds acc[4j + e]
        acc = {}
        for lane in range(32):
            g, t = lane // 4, lane % 4
            acc[lane] = [0.0] * 128
            for j in range(32):
                acc[lane][4 * j + 0] = D[16 * w + g, 8 * j + 2 * t]
                acc[lane][4 * j + 1] = D[16 * w + g, 8 * j + 2 * t + 1]
                acc[lane][4 * j + 2] = D[16 * w + g + 8, 8 * j + 2 * t]
                acc[lane][4 * j + 3] = D[16 * w + g + 8, 8 * j + 2 * t + 1]
        for ch in range(8):
            stage = np.full(16 * EPI_LD, np.nan)
            for half in range(2):              # 64-bit stores go in two half-warp phases
                banks = []
                for lane in range(16 * half, 16 * half + 16):
                    g, t = lane // 4, lane % 4
                    for jj in range(4):
                        for hh in range(2):
                            base = (g + 8 * hh) * EPI_LD + 8 * jj + 2 * t
                            stage[base] = acc[lane][4 * jj + 2 * hh]
                            stage[base + 1] = acc[lane][4 * jj + 2 * hh + 1]
                            if jj == 0 and hh == 0:
                                banks += [base % 32, (base + 1) % 32]
                if len(set(banks)) != 32:
                    bad.append(f"epilogue float2 staging writes conflict (warp {w}, chunk {ch})")
            for lane in range(32):
                r0, my_c = lane // 8, (lane % 8) * 4
                for i in range(4):
                    r = r0 + 4 * i
                    for j in range(4):
                        v = stage[r * EPI_LD + my_c + j]
                        written[16 * w + r, 32 * ch + my_c + j] = v
                        count[16 * w + r, 32 * ch + my_c + j] += 1
            for lane in range(32):             # the shift by 16 registers per chunk
                acc[lane] = acc[lane][16:] + acc[lane][:16]
    for phase in range(4):                     # float4 reads: quarter-warp phases of 8 lanes
        addrs = [((lane // 8) * EPI_LD + (lane % 8) * 4) * 4 for lane in range(8 * phase, 8 * phase + 8)]
        if len({(a % 128) // 16 for a in addrs}) != 8:
            bad.append("epilogue float4 staging reads conflict")
    if not (count == 1).all():
        bad.append("epilogue: some element written 0 or 2+ times")
    elif not np.array_equal(written, D):
        bad.append("epilogue: elements land in the wrong place")
    return bad


def main():
    bad = check_layouts()
    print("wgmma operand layouts (TMA 128B swizzle -> descriptors, 4 layouts x 4 tiles):",
          "OK" if not bad else "FAIL")
    epi = check_epilogue()
    print("wgmma epilogue (fragments -> staging -> rows, bank conflicts):",
          "OK" if not epi else "FAIL")
    for line in bad + epi:
        print("  ", line)
    return 1 if (bad or epi) else 0


if __name__ == "__main__":
    sys.exit(main())
