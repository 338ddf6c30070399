"""GEMM family: matmul with fused epilogues, linear, SwiGLU linear, int8 matmul.

Kernels (cuda_src/gemm/*.cu, one file per step of the ladder, each opening with what it adds):
``naive`` -> ``smem_tiled`` -> ``register_tiled_vec4`` -> ``warp_tiled`` (the best fp32 SIMT kernel,
default for fp32 and for fp16/bf16 before sm_80) -> ``mma`` (tensor cores via mma.sync, sm_80+,
default for fp16/bf16 there); for decode-sized M (1..16) ``gemv`` (SIMT, any arch) and ``gemv_mma``
(tensor cores, sm_80+), which stream the weight once with 16-byte loads and are programmatic
dependent launches on sm_90 (their launch and ramp under the previous kernel's tail);
``int8_dp4a`` for int8_matmul; ``wgmma`` (Hopper sm_90a, fp16/bf16: warpgroup MMA fed by TMA
from a warp-specialized, persistent pipeline; operands TMA can describe, see
``_wgmma_operand``; products of few output tiles split K: ``WGMMA_SPLIT_K``). ``variant=None``
picks ``wgmma`` on sm_90 (``WGMMA_AUTO`` below: on since run 21 proved it on the GPU), for
swiglu_linear too (two products, see ``_launch_swiglu_wgmma``). Tuning switches
(``PLAN`` below): ``warp_tiled``'s tile configuration (``WARP_TILED_CONFIGS``), and the decode
plan, whose 'pipe' / 'pipe_deep' run ``gemv_mma_pipe`` (persistent, a ring of weight loads in
flight per warp) for gemv_mma's calls, gemv_mma's block size, steps of loads ahead and an L2
prefetch of the weight before the PDL wait.

Conventions: torch.matmul shapes (1-D operands, broadcast batch dims), any strides (transposed
views are read in place: every kernel takes both the M/N-contiguous and the K-contiguous layout;
other strides take a per-element path), fp32 accumulation, and the epilogue
``out = act(alpha * (a @ b) + bias) + residual`` in fp32 before the one rounding to the output
dtype. No host syncs and no allocations other than outputs/workspaces from ``call.empty``: every
call can be captured in a CUDA graph.
"""
from __future__ import annotations

from functools import lru_cache
from math import prod

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops.elementwise import ACTIVATIONS, _act_ref, _check_activation
from gpuops.registry import register
from gpuops.runtime import config, device, loader, tma
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.runtime.nvrtc import Target
from gpuops.shapes import broadcast_shapes, broadcast_strides, coalesce, contiguous_strides
from gpuops.tensor import Tensor

# ---------------------------------------------------------------------------------------------
# Kernel modules. Every kernel takes one GemmArgs struct (cuda_src/gemm/gemm_common.cuh):
# 9 pointers, 25 int64 (M, N, K, strides, batch layout, k_split, z0), alpha, act, out_f32,
# splits, flags.

GEMM_ARGS = ArgSpec("9P25qf4i")
_FLOATS = dt.FLOATS
_HALFS = (dt.float16, dt.bfloat16)
_TC_ARCHS = ("80", "86", "89", "90")          # mma.sync, ldmatrix, cp.async


@lru_cache(maxsize=4096)
def _kname(fn, *targs) -> str:
    # remembered: launchers name their kernel on every call (the host path is the decode cost)
    return f"gpuops::gemm::{fn}<{', '.join(str(t) for t in targs)}>"


def _b(v: bool) -> str:
    return "true" if v else "false"


NAIVE = KernelModule("gemm.naive", "gemm/naive.cu",
                     {_kname("gemm_naive", d.ctype): GEMM_ARGS for d in _FLOATS})
SMEM_TILED = KernelModule("gemm.smem_tiled", "gemm/smem_tiled.cu",
                          {_kname("gemm_smem_tiled", d.ctype): GEMM_ARGS for d in _FLOATS})

# The bigger variants get one module per dtype: a call compiles (first use) only its dtype's
# kernels (the tensor-core module alone has 9 per 16-bit dtype).
_SHORT = {dt.float32: "f32", dt.float16: "f16", dt.bfloat16: "bf16", dt.int8: "s8"}


def _per_dtype(variant, source, kernels_of, dtypes=_FLOATS, archs=None, pdl=False):
    kw = {"archs": archs} if archs else {}
    if pdl:
        kw["pdl"] = True
    return {d: KernelModule(f"gemm.{variant}_{_SHORT[d]}", source, kernels_of(d), **kw)
            for d in dtypes}


REGISTER_TILED = _per_dtype("register_tiled_vec4", "gemm/register_tiled_vec4.cu", lambda d: {
    _kname("gemm_register_tiled_vec4", d.ctype): GEMM_ARGS})

# warp_tiled tile configurations: (BM, BN, BK, WM, WN, MINB, PIPE) = block tile BM x BN (BN:
# columns of both B operands together in the dual kernel), BK k per shared-memory stage, warp tile
# WM x WN (a thread owns WM/8 x WN/4 outputs), MINB blocks per SM that the launch bounds ask
# registers for (65536 / (threads x MINB) registers per thread), PIPE: 0 = two shared-memory
# buffers filled through registers, S >= 3 = a ring of S stages filled by cp.async (fp32 only).
# Threads = (BM/WM) x (BN/WN) x 32; shared memory max(2, PIPE) x BK x (BM + 4 + BN + 4 (+ 4
# dual)) floats. PLAN['warp_tiled'] picks one (each is its own module per dtype: a call compiles
# only the chosen one); floors and predictions per configuration in benchmarks/notes_gemm.md
# ("warp_tiled configurations", "The cp.async ring").
WARP_TILED_CONFIGS = {
    # runs 1..15: 37.3 TFLOP/s = 74.3% of cuBLAS fp32 at 4096^3 (H100); 256 threads, 8x8 outputs
    "base": (128, 128, 8, 64, 32, 2, 0),
    # half the barriers and loop overhead per FMA; 33 KiB of shared memory
    "k16": (128, 128, 16, 64, 32, 2, 0),
    # 128 threads, 8x16 outputs: 6 LDS.128 per 128 FMAs, 255 registers per thread
    "w64x64": (128, 128, 8, 64, 64, 2, 0),
    # the same with 16-k stages (siboehm's SGEMM kernel 10: 93.7% of cuBLAS on an A6000)
    "w64x64_k16": (128, 128, 16, 64, 64, 2, 0),
    # 128 threads of 8x8 outputs, 4 blocks per SM: four independent barriers per SM
    "b128x64": (128, 64, 8, 64, 32, 4, 0),
    # what cuBLAS runs on the H100 (ncu, run 90: sm80_xmma_gemm_f32f32_..._tilesize256x128x8_stage3
    # _warpsize4x2x1_ffma, 2.67 ms at 4096^3): one block of 8 warps per SM, 8x16 outputs per
    # thread, BK = 8, a 3-stage cp.async ring (no staging registers, no STS), 37.6 KiB
    "async": (128, 256, 8, 64, 64, 1, 3),
}
# (run 97, removed: 'async4', the same ring with 4 stages, within 0.4 points of 'async' at every
# shape; 'async_256x128', cuBLAS' own tile shape, 7-8 points slower: FMAs waiting on LDS 28% of
# the samples against 11.6%)


def _wt_threads(cfg):
    bm, bn, _, wm, wn = cfg[:5]
    return (bm // wm) * (bn // wn) * 32


def _wt_smem(cfg, dual=False):
    bm, bn, bk = cfg[:3]
    nb = 2 if dual else 1
    return 4 * max(2, cfg[6]) * bk * ((bm + 4) + nb * (bn // nb + 4))


def _wt_expr(d, cfg, dual):
    return _kname("gemm_warp_tiled", d.ctype, _b(dual), *cfg)


# "base" for every dtype (it is the default path) and arch; the other configurations are tuning
# candidates for the fp32 target (issue 4): float32 only, built ahead of time for the two archs
# the project measures (sm_61, sm_90; any other GPU compiles them at first use). 16-bit inputs
# (warp_tiled is their path before sm_80) take "base" whatever PLAN['warp_tiled'] says.
WARP_TILED_MODULES = {
    name: _per_dtype("warp_tiled" if name == "base" else f"warp_tiled_{name}",
                     "gemm/warp_tiled.cu",
                     lambda d, cfg=cfg: {_wt_expr(d, cfg, dual): GEMM_ARGS for dual in (False, True)},
                     **({} if name == "base" else {"dtypes": (dt.float32,), "archs": ("61", "90")}))
    for name, cfg in WARP_TILED_CONFIGS.items()}
WARP_TILED = WARP_TILED_MODULES["base"]

GEMV_MT = (1, 4, 16)                 # rows of A a GEMV kernel is compiled for (M <= MT)
GEMV_MAX_M = GEMV_MT[-1]             # gemv and gemv_mma (one m16 tile) take M <= 16
GEMV = _per_dtype("gemv", "gemm/gemv.cu", lambda d: {
    **{_kname("gemv_kcontig", d.ctype, mt, _b(dual)): GEMM_ARGS
       for mt in GEMV_MT for dual in (False, True)},
    **{_kname("gemv_ncontig", d.ctype, mt): GEMM_ARGS for mt in GEMV_MT},
    _kname("gemv_splitk_reduce", d.ctype): GEMM_ARGS}, pdl=True)
# gemv_mma: n8 tiles of each weight per block (template NT) -> blocks per SM its launch bounds
# guarantee (registers; shared memory and threads allow more).
GEMV_MMA_NT = {False: {2: 3, 4: 2, 1: 3}, True: {1: 3, 2: 2}}
# the block sizes PLAN['gemv_rows'] = 'auto' chooses among (the others: A/B by forcing them); on
# equal fill the first listed wins, except as _gemv_mma_plan says for non-dual grids.
GEMV_MMA_NT_AUTO = {False: (2, 4), True: (1, 2)}
# AHEAD (PLAN['gemv_ahead']): whole steps whose weight loads a warp issues together before their
# multiplications (0: one step at a time, the kernel of runs 11-136). AHEAD 4 (run 137) was slower
# at every shape and spilled on sm_80-89: removed.
GEMV_MMA_AHEAD = (0, 2)
GEMV_MMA = _per_dtype("gemv_mma", "gemm/gemv_mma.cu", lambda d: {
    _kname("gemv_mma", d.ctype, nt, ahead, _b(dual)): GEMM_ARGS
    for dual in (False, True) for nt in GEMV_MMA_NT[dual] for ahead in GEMV_MMA_AHEAD},
    dtypes=_HALFS, archs=_TC_ARCHS, pdl=True)
# gemv_mma_pipe (PLAN['decode'] 'pipe' / 'pipe_deep'): per plan and dual, the (NT, U, MINB)
# instantiations: NT n8 tiles of each weight per row tile, U steps of weight loads in flight per
# warp, MINB blocks per SM of the launch bounds (2: 128 registers; the ring of U x NT x 4 words
# and ptxas' addressing do not fit 3 blocks' 80 without spills). Each warp keeps U x NT (x 2 dual)
# packs of 512 bytes in flight: 'pipe' 8 (4 KiB; 16 warps per SM: 64 KiB), 'pipe_deep' 16 (8 KiB;
# 128 KiB), against gemv_mma's one step (1 KiB at NT = 2, 3 blocks: 24 KiB per SM).
GEMV_PIPE = {
    "pipe": {False: ((1, 8, 2), (2, 4, 2), (4, 2, 2)), True: ((1, 4, 2), (2, 2, 2))},
    "pipe_deep": {False: ((1, 16, 2), (2, 8, 2)), True: ((1, 8, 2),)},
}
GEMV_PIPE_INFLIGHT = 6 << 20      # bytes of weight loads a plan must keep in flight over the grid


def _pipe_expr(d, nt, u, minb, dual):
    return _kname("gemv_mma_pipe", d.ctype, nt, u, minb, _b(dual))


GEMV_MMA_PIPE = {
    plan: _per_dtype(f"gemv_mma_{plan}", "gemm/gemv_mma.cu", lambda d, cfgs=cfgs: {
        _pipe_expr(d, *c, dual): GEMM_ARGS for dual, lst in cfgs.items() for c in lst},
        dtypes=_HALFS, archs=_TC_ARCHS, pdl=True)
    for plan, cfgs in GEMV_PIPE.items()}
# gemv_mma_tma (PLAN['decode'] 'tma', sm_90): the weight streamed by TMA (boxes of 8 rows x 256 k)
# into a shared-memory ring; persistent blocks (1 or 2 per SM) of 8 consumer warps + 1 producer.
# The configurations (PLAN['gemv_tma']): (NT 8-row groups per tile, KC k per chunk, STAGES slots,
# blocks per SM).
# Run 203 (H200, bf16 graphs, PDL): two blocks per SM of 2 slots each ("n4k512b2") against one of
# 5 ("n4k512"): [14336, 4096] M = 2..16 88.3 / 88.6 / 87.3 / 82.1% of copy against 73.0 / 71.8 /
# 70.7 / 63.0 ('balanced' 77.9 / 77.8 / 77.5 / 75.0); [151936, 2048] 98.6-99.2 / 97.7; [32768,
# 4096] 95.6-96.9 / 92.6. Below a whole tile per block ([4096, 14336]: 2 groups per block) and at
# 25 MB it lost to 'balanced'. 'balanced' takes it for weights of >= GEMV_TMA_MIN_BYTES where its
# blocks (K split over clusters where the rows are too few: _gemv_tma_split) fill >= 90% of the
# block slots with whole tiles.
GEMV_TMA_CONFIGS = {"n4k512b2": (4, 512, 2, 2), "n4k512": (4, 512, 5, 1),
                    "n2k1024": (2, 1024, 5, 1), "n4k256": (4, 256, 8, 1),
                    "n4k256b2": (4, 256, 4, 2)}
# Run 216 (H200, bf16 graphs, PDL, % of copy at M = 2 / 4 / 8 / 16, 'tma' against the former
# 'balanced' below 96 MB): [11008, 4096] (90 MB) M = 8 / 16 74.8 / 69.3 against 60.5 / 58.9;
# [8192, 4096] (67 MB) 82.7 / 82.2 / 81.7 / 79.1 against 76.9-75.3; [4096, 4096] (34 MB, KS 2)
# 65.7 / 66.0 / 65.7 / 63.4 against 58.2-50.9 (cuBLAS 59-61); at 25 MB ([6144, 2048], runs
# 201-203) the plain kernel lost (51-56 against 58-62).
GEMV_TMA_MIN_BYTES = 32 << 20
# gemv_mma_tma_split: K split over clusters of KS blocks (rank 0 adds the others' sums through
# distributed shared memory), for weights with too few 8-row groups to give every block of the
# plain kernel a whole tile ([4096, 14336]: 512 groups; the plain kernel ran 128 blocks there,
# 70-76% of copy in runs 203-204). Built for the configurations in GEMV_TMA_SPLIT_CONFIGS.
# Run 205 (H200, bf16 graphs, PDL; % of copy at M = 2 / 4 / 8 / 16): [4096, 14336] KS 2 89.0 /
# 88.6 / 88.3 / 86.1 (the plain kernel 79.8 / 76.1 / 74.0 / 62.6, cuBLAS 89.3 / 87.9 / 87.4 /
# 87.7). KS 4 ran 25-35% slower than KS 1 / 2 at every weight (runs 205-207: 55-61% there; its
# tile ends, 2-3 per block of 7 chunks each, and only 62 resident clusters of 4): not built.
GEMV_TMA_SPLITS = (2,)
GEMV_TMA_SPLIT_CONFIGS = ("n4k512b2",)
GEMV_TMA_FILL = 0.9          # the least share of the resident blocks a KS must keep busy
# 'balanced' takes gemv_mma_tma_dual for SwiGLU pairs of >= GEMV_TMA_DUAL_MIN_BYTES together with
# whole tiles for GEMV_TMA_FILL of the block slots. Run 214 (H200, bf16 graphs, PDL, % of copy
# for both weights at M = 2 / 4 / 8 / 16; torch's two GEMVs + silu * mul, and the 'pipe' plan
# 'balanced' ran before, in the same run): 2 x [14336, 4096] 90.4 / 90.5 / 91.2 / 88.0 (torch 87.0
# / 86.5 / 86.5 / 85.4, pipe 79.3-77.1); 2 x [11008, 4096] 92.9 / 93.2 / 93.2 / 88.5 (torch 76.8-
# 80.2, pipe 80.3-77.9); 2 x [6144, 2048] (50 MB) 74.6 / 74.1 / 73.3 / 69.6 (torch 55.5-56.6,
# gemv_mma 68.7-66.6).
GEMV_TMA_DUAL_MIN_BYTES = 48 << 20
# gemv_mma_tma_dual (swiglu_linear): both weights through one ring, NT / 2 groups of each per
# tile; built for these configurations.
GEMV_TMA_DUAL_CONFIGS = ("n4k512b2",)
GEMV_TMA_ARGS = ArgSpec("tensormap", "9P25qf4i")
GEMV_TMA_DUAL_ARGS = ArgSpec("tensormap", "tensormap", "9P25qf4i")
GEMV_TMA = _per_dtype("gemv_mma_tma", "gemm/gemv_tma.cu", lambda d: {
    **{_kname("gemv_mma_tma", d.ctype, *c): GEMV_TMA_ARGS for c in GEMV_TMA_CONFIGS.values()},
    **{_kname("gemv_mma_tma_split", d.ctype, *GEMV_TMA_CONFIGS[k], ks): GEMV_TMA_ARGS
       for k in GEMV_TMA_SPLIT_CONFIGS for ks in GEMV_TMA_SPLITS},
    **{_kname("gemv_mma_tma_dual", d.ctype, *GEMV_TMA_CONFIGS[k]): GEMV_TMA_DUAL_ARGS
       for k in GEMV_TMA_DUAL_CONFIGS}},
    dtypes=_HALFS, archs=("90",), pdl=True)
GEMV_TMA_BOX = (256, 8)           # k x rows of one TMA box (4 KiB of 16-bit weight)


def _gemv_tma_smem(nt, kc, stages, _blocks_per_sm=1, ks=1):   # (a GEMV_TMA_CONFIGS entry, KS)
    """Dynamic shared memory of gemv_mma_tma (GemvTmaSmem in cuda_src/gemm/gemv_tma.cu): the
    ring, the two buffers of the 8 warps' sums, and with KS > 1 rank 0's buffers of the other
    ranks' sums (two per rank)."""
    return (stages * nt * (kc // 256) * 8 * 256 * 2 + 2 * 8 * nt * 4 * 32 * 4
            + 2 * (ks - 1) * nt * 4 * 32 * 4)


def _gemv_tma_split(sms, N, K, cfg_key, want="auto", dual=False):
    """(KS, clusters, score) of the 'tma' plan: KS blocks per cluster splitting K (1: the plain
    kernel, one block per 'cluster'), clusters = min(resident blocks / KS, tiles of NT groups;
    SwiGLU (dual): NT / 2 groups of each weight, never split). 'auto': the smallest KS (1, then
    GEMV_TMA_SPLITS where built for cfg_key) whose score reaches GEMV_TMA_FILL, each rank getting
    >= 2 chunks of K; else the best score (the smaller KS on a tie). Score: the share of the
    resident block slots that hold a whole tile, and for KS > 1 times tiles / (clusters x the
    most tiles of a cluster): every tile end of a split costs a cluster round trip (run 216,
    [6144, 4096]: KS 2 with 1-2 tiles per cluster 63-68% of copy, 'balanced' 69-71). 'balanced'
    takes the plan where the score reaches GEMV_TMA_FILL. `want` (PLAN['gemv_tma_split']) forces
    a KS (where built and K has KS chunks)."""
    nt, kc, _, minb = GEMV_TMA_CONFIGS[cfg_key]
    slots = minb * sms
    tiles = max(1, _cdiv(N, 8) // (nt // 2 if dual else nt))
    chunks = _cdiv(K, kc)
    splittable = not dual and cfg_key in GEMV_TMA_SPLIT_CONFIGS

    def scored(ks):
        clusters = max(1, min(slots // ks, tiles))
        score = clusters * ks / slots
        if ks > 1:
            score *= tiles / (clusters * _cdiv(tiles, clusters))
        return ks, clusters, score

    if want != "auto":
        if want not in (1, *GEMV_TMA_SPLITS):
            raise ValueError(f"gpuops: PLAN['gemv_tma_split'] must be 'auto' or one of "
                             f"{[1, *GEMV_TMA_SPLITS]}, got {want!r}")
        return scored(want if splittable and chunks >= want else 1)
    best = None
    for ks in [1] + [ks for ks in GEMV_TMA_SPLITS if splittable and chunks >= 2 * ks]:
        got = scored(ks)
        if got[2] >= GEMV_TMA_FILL:
            return got
        if best is None or got[2] > best[2] + 1e-9:
            best = got
    return best


# Plan switches, kept so that one run can time the old paths next to the new ones:
#   "decode": "balanced" (gemv_mma for fp16/bf16 M = 2..16 with the block size and split that
#             fill whole waves; SIMT gemv split so that a split's slice of A fits in L1),
#             "legacy" (run 1: gemv_mma for M = 5..16 with 32-row blocks, splits only to fill
#             the GPU 4 times over), or "pipe" / "pipe_deep" (as "balanced", but gemv_mma's
#             M = 2..16 calls run gemv_mma_pipe: persistent blocks, a ring of 4 / 8 KiB of weight
#             loads in flight per warp, no split-K; calls with too few weight rows for that take
#             "balanced"'s plan). "tma" (sm_90): gemv_mma_tma where _gemv_tma_applies, else
#             "balanced". "balanced" itself runs "tma" for weights of at least
#             GEMV_TMA_MIN_BYTES where _gemv_tma_split's blocks fill >= GEMV_TMA_FILL of the
#             block slots with whole tiles (and TMA applies), else "pipe"
#             for weights of at least GEMV_PIPE_MIN_BYTES. Issue 4 / benchmarks/notes_gemm.md
#             "Decode GEMV";
#   "mma_tiles": "auto" (the rule of _mma_config) or a key of MMA_TILES to force one tile
#             configuration of the fp16/bf16/int8 mma kernels (A/B timing, tests); a forced
#             configuration that needs more shared memory than the device has falls back to
#             the rule;
#   "wgmma": a key of WGMMA_CONFIGS (the wgmma kernel's epilogue configuration).
#             Run 23 (H100, bf16, % of cuBLAS a @ b): "direct" (registers straight to global in
#             whole tiles) 83.8 / 82.7 / 82.5 at 8192^3 / 4096x6144x2048 / 4096x2048x6144,
#             "base" 72.1 / 55.1 / 70.7, the cluster-multicast forms 48.7-54.3 (removed after
#             run 33, still 38-62%: benchmarks/notes_gemm.md). Run 30: "tma_store" (C through
#             a tensor map, stores overlapped with the next tile) 89-100% of cuBLAS in CUDA
#             graphs (its fused calls run "direct"). "tma_fused" (the default since run 34):
#             "tma_store" for bare calls, and fused epilogues through the same tensor stores
#             (residual by TMA, bias via shared memory). Run 34 (graphs, bf16 linear,
#             4096x6144x2048 / 4096x2048x6144, us): bare 140.9 / 133.5 (tma_store 141.0 /
#             132.6), bias 148.8 / 134.8 (direct 171.1 / 142.8), bias+gelu 172.8 / 148.7
#             (direct 198.6 / 162.4), residual 163.5 / 138.5 (direct 184.8 / 145.1):
#             benchmarks/experiments/wgmma_fused_epilogue.py. "pingpong" (run 87): 128 x 128
#             tiles, one per consumer warpgroup in turns, epilogues under the other's MMAs;
#             correct but its bare product is 19-24% slower (L2 bytes per FLOP), an A/B option.
#   "warp_tiled": a key of WARP_TILED_CONFIGS (the fp32 SIMT kernel's tile configuration; "base"
#             is run 1..15's kernel, the others are candidates for issue 4's >= 90% of cuBLAS,
#             timed side by side by benchmarks/experiments/gemm_simt_sweep.py), or "auto":
#             "async" (the cp.async ring) on sm_80+, "k16" before (without cp.async the ring's
#             copies stall its 8 warps). Run 31 (H100, % of cuBLAS fp32 at 4096^3 / 2048^3 /
#             8192x8192x4096): base 75.7 / 61.4 / 76.6, k16 77.8 / 63.5 / 79.8, w64x64_k16 73.0 /
#             71.4 / 73.8; runs 93 / 96 (the same code): async 84.2 / 75.8 / 85.7 and 85.8 /
#             81.0 / 86.1, k16 79.9 / 70.9 / 81.6 and 80.0 / 75.6 / 82.1.
#   "gemv_l2_prefetch": False, True or a byte count: the K-contiguous GEMV kernels (gemv_kcontig,
#             gemv_mma) ask for their block's weight slice (True: all of each row's slice; n: its
#             first n bytes, a multiple of 256 below 65536) into L2 (one bulk prefetch per row,
#             sm_90+) before they wait for the previous kernel (PDL): benchmarks/notes_gemm.md,
#             "Decode GEMV: PDL and the weight ahead".
#   "gemv_ahead": "auto" or a value of GEMV_MMA_AHEAD: gemv_mma's whole steps of weight loads
#             issued together per warp (0: one step at a time; "auto": _gemv_mma_ahead);
#   "gemv_rows": "auto" or 8 / 16 / 32: gemv_mma's weight rows per block (8 * NT; "auto": the
#             plan of _gemv_mma_plan among GEMV_MMA_NT_AUTO).
#   "gemv_tma": a key of GEMV_TMA_CONFIGS ("tma"'s tile, chunk and ring depth);
#   "gemv_tma_split": "auto" or 1 / 2: the blocks of a cluster that split K in "tma"
#             (_gemv_tma_split; 2 only for GEMV_TMA_SPLIT_CONFIGS);
#   "gemv_simt_max_m": fp16/bf16 decode calls with M up to this many rows take the SIMT gemv,
#             above it gemv_mma (sm_80+, K-contiguous weights; the 'balanced' and pipe plans).
#             Run 142 (H100, bf16, graphs): M = 2 on a SIMT kernel (an MT = 2 instantiation, since
#             removed) was slower at [6144, 2048] and [2048, 6144], faster at [4096, 4096]
#             (14.4 vs 16.5 us) and in SwiGLU; M = 3..4 on MT = 4 slower everywhere: 1 stays.
PLAN = {"decode": "balanced", "mma_tiles": "auto", "wgmma": "tma_fused", "warp_tiled": "auto",
        "gemv_l2_prefetch": False, "gemv_ahead": "auto", "gemv_rows": "auto", "gemv_simt_max_m": 1,
        "gemv_tma": "n4k512b2", "gemv_tma_split": "auto"}

# mma tile configurations: (BM, BN per B operand, warps along M, warps along N, stages, bytes of
# K per shared-memory row and stage). Shared memory: stages * (BM + BN) * bytes.
MMA_LARGE = (128, 256, 2, 4, 3, 128)      # 8 warps of 64x64, 144 KiB (sm_80, sm_90)
MMA_LARGE_K32 = (128, 256, 2, 4, 4, 64)   # the same in 96 KiB (sm_86/89: 99 KiB per block)
MMA_SMALL = (128, 128, 2, 2, 4, 64)       # 4 warps of 64x64, 64 KiB, 2 blocks per SM
MMA_DUAL = (128, 64, 2, 2, 4, 64)         # SwiGLU: 4 warps of 64x32 per B, 64 KiB
MMA_TILES = {"large": MMA_LARGE, "large_k32": MMA_LARGE_K32, "small": MMA_SMALL}


def _mma_smem(cfg, dual=False):
    bm, bn, _, _, stages, bkb = cfg
    return stages * (bm + (2 if dual else 1) * bn) * bkb


def _mma_expr(d, cfg, ak, bk, dual=False, out=None):
    bm, bn, wm, wn, stages, bkb = cfg
    return _kname("gemm_mma", d.ctype, (out or d).ctype, bm, bn, wm, wn, stages, bkb, _b(ak),
                  _b(bk), _b(dual))


def _mma_kernels(d):
    if d is dt.float32:   # TF32: one tile configuration, no dual kernel; both operands M/N-major
        # is not instantiated (its scalar fragment loads spill 260 B on sm_90, NVRTC 12 and 13):
        # that layout takes the K-major kernel's element path
        return {_mma_expr(d, MMA_SMALL, ak, bk): GEMM_ARGS for ak in (True, False)
                for bk in (True, False) if ak or bk}
    if d is dt.int8:      # K-major operands, one kernel per output dtype and tile configuration
        return {_mma_expr(d, cfg, True, True, out=o): GEMM_ARGS for cfg in MMA_TILES.values()
                for o in _FLOATS}
    return {**{_mma_expr(d, cfg, ak, bk): GEMM_ARGS for cfg in MMA_TILES.values()
               for ak in (True, False) for bk in (True, False)},
            _mma_expr(d, MMA_DUAL, True, True, True): GEMM_ARGS}


def _mma_config(dev, M, N, batch):
    """128x256 tiles (8 warps, one block per SM) when they give every SM a block, with 128-byte K
    tiles where the device has the shared memory for them; else 128x128 (4 warps, 2 blocks per
    SM). PLAN['mma_tiles'] can force one configuration."""
    info = device.device_info(dev)
    forced = MMA_TILES.get(PLAN["mma_tiles"])
    if forced is not None and _mma_smem(forced) <= info.max_smem_per_block_optin:
        return forced
    if _cdiv(M, 128) * _cdiv(N, 256) * batch < info.sm_count:
        return MMA_SMALL
    return MMA_LARGE if _mma_smem(MMA_LARGE) <= info.max_smem_per_block_optin else MMA_LARGE_K32


MMA = _per_dtype("mma", "gemm/mma.cu", _mma_kernels, dtypes=_FLOATS + (dt.int8,), archs=_TC_ARCHS)
INT8 = KernelModule("gemm.int8_dp4a", "gemm/int8_dp4a.cu",
                    {_kname("gemm_int8_dp4a", d.ctype): GEMM_ARGS for d in _FLOATS})

# wgmma (sm_90a only): two TMA descriptors (A, B) and GemmArgs; one kernel per layout pair
# (A M-major?, B N-major?). Tile, threads and shared memory mirror cuda_src/gemm/wgmma.cu
# (tests/test_gemm.py checks the shared-memory size against its constants).
WGMMA_ARGS = ArgSpec("tensormap", "tensormap", "9P25qf4i")
WGMMA_ARCH = 90
WGMMA_BM, WGMMA_BN, WGMMA_BK, WGMMA_STAGES = 128, 256, 64, 4
WGMMA_THREADS = 384
WGMMA_SMEM = WGMMA_STAGES * (WGMMA_BM + WGMMA_BN) * WGMMA_BK * 2 + 8 * 16 * 40 * 4 \
    + 2 * WGMMA_STAGES * 8 + 1024
# 'tma_fused' (epilogue 4): 4 boxes of 1 KiB per consumer warp instead of the 20 KiB staging
# area, two bias rows of 256 16-bit values, one mbarrier per box (kWgFusedSmemBytes in wgmma.cu)
WGMMA_FUSED_BOXES = 4
WGMMA_SMEM_FUSED = WGMMA_STAGES * (WGMMA_BM + WGMMA_BN) * WGMMA_BK * 2 \
    + 8 * WGMMA_FUSED_BOXES * 1024 + 2 * WGMMA_BN * 2 + 2 * WGMMA_STAGES * 8 \
    + 8 * WGMMA_FUSED_BOXES * 8 + 1024
# 'pingpong' (epilogue 6): 128 x 128 tiles, each consumer warpgroup its own (kPpSmemBytes in
# wgmma.cu): a 6-stage ring of 32 KiB, tma_fused's boxes, a bias row pair per warpgroup, two
# order barriers
WGMMA_PP_BN, WGMMA_PP_STAGES = 128, 6
WGMMA_SMEM_PINGPONG = WGMMA_PP_STAGES * (WGMMA_BM + WGMMA_PP_BN) * WGMMA_BK * 2 \
    + 8 * WGMMA_FUSED_BOXES * 1024 + 2 * 2 * WGMMA_PP_BN * 2 + 2 * WGMMA_PP_STAGES * 8 + 2 * 8 \
    + 8 * WGMMA_FUSED_BOXES * 8 + 1024


# Kernel configurations (PLAN["wgmma"] picks one; each is its own module per dtype, so that only
# the chosen one is compiled): the epilogue. 0 'staged' (shared memory, rolled 32-column chunks),
# 1 'direct' (fragments straight to global memory, activation chosen per tile), 3 'tma_store' and
# 4 'tma_fused' (below). 'base' is the configuration run 21 measured.
WGMMA_CONFIGS = {"base": 0, "direct": 1, "tma_store": 3, "tma_fused": 4, "pingpong": 6}
# 'tma_store' (epilogue 3): C leaves through a third tensor map, one 16 x 32 box per warp and
# chunk (kernel gemm_wgmma_tmastore), so the warps start the next tile while it drains. Run 30
# (H100, CUDA graphs, bf16 linear, % of cuBLAS): 4096x6144x512 100, x1024 95.7, x2048 89.0,
# 4096x2048x6144 99.2, 8192^3 97.8 (direct: 56-70, 80-92); its fixed cost per round of tiles
# ~0 us (direct 6.6). Calls with a fused epilogue (bias, activation, residual) and calls whose C
# TMA cannot write (fp32 out, N % 8 != 0, misaligned) run 'direct' (see _wgmma_call_config).
WGMMA_TMASTORE_ARGS = ArgSpec("tensormap", "tensormap", "tensormap", "9P25qf4i")
# 'tma_fused' (epilogue 4, kernel gemm_wgmma_tmafused): 'tma_store' for bare calls, and fused
# epilogues through the same tensor stores: the residual arrives by TMA through a fourth map (C's
# box geometry on the residual) into the boxes the output leaves from, the bias through shared
# memory, so no global load is in flight at the per-chunk proxy fence (notes_gemm.md,
# "Fused epilogues through tensor stores"). Calls whose residual TMA cannot read run 'direct'.
WGMMA_TMAFUSED_ARGS = ArgSpec("tensormap", "tensormap", "tensormap", "tensormap", "9P25qf4i")
# 'pingpong' (epilogue 6, kernel gemm_wgmma_pingpong): tma_fused's epilogue and parameters on
# 128 x 128 tiles, each consumer warpgroup its own, taking the CTA's tiles in turns, so one
# warpgroup's epilogue overlaps the other's MMAs (tma_fused's warpgroups share a 128 x 256 tile
# and the tensor cores idle during its epilogue: bias+gelu +23.5% over the bare product at
# 4096x6144x2048, run 62). Its calls route as tma_fused's (_wgmma_call_config).
# Experiment switch (benchmarks/experiments/wgmma_fused_epilogue.py): True lets 'tma_store' run
# fused calls itself, with run 30's generic bias / residual loads (measured slow), for A/B.
_TMA_STORE_GENERIC_FUSED = False


def _wgmma_expr(d, a_mn, b_mn, config="base"):
    epi = WGMMA_CONFIGS[config]
    if epi == 3:
        return _kname("gemm_wgmma_tmastore", d.ctype, _b(a_mn), _b(b_mn))
    if epi == 4:
        return _kname("gemm_wgmma_tmafused", d.ctype, _b(a_mn), _b(b_mn))
    if epi == 6:
        return _kname("gemm_wgmma_pingpong", d.ctype, _b(a_mn), _b(b_mn))
    return _kname("gemm_wgmma", d.ctype, _b(a_mn), _b(b_mn), epi)


def _wgmma_spec(config):
    return {3: WGMMA_TMASTORE_ARGS, 4: WGMMA_TMAFUSED_ARGS, 6: WGMMA_TMAFUSED_ARGS}.get(
        WGMMA_CONFIGS[config], WGMMA_ARGS)


_WGMMA_SMEM_BY_EPI = {4: WGMMA_SMEM_FUSED, 6: WGMMA_SMEM_PINGPONG}


def _wgmma_smem(config):
    return _WGMMA_SMEM_BY_EPI.get(WGMMA_CONFIGS[config], WGMMA_SMEM)


def _wgmma_bn(config):
    """The output tile's width (B's box rows) of a configuration."""
    return WGMMA_PP_BN if WGMMA_CONFIGS[config] == 6 else WGMMA_BN


def _wgmma_kernels(config):
    spec = _wgmma_spec(config)
    return lambda d: {_wgmma_expr(d, a_mn, b_mn, config): spec
                      for a_mn in (False, True) for b_mn in (False, True)}


WGMMA = _per_dtype("wgmma", "gemm/wgmma.cu", _wgmma_kernels("base"), dtypes=_HALFS,
                   archs=(f"{WGMMA_ARCH}a",))
WGMMA_MODULES = {"base": WGMMA, **{
    cfg: _per_dtype(f"wgmma_{cfg}", "gemm/wgmma.cu", _wgmma_kernels(cfg), dtypes=_HALFS,
                    archs=(f"{WGMMA_ARCH}a",)) for cfg in WGMMA_CONFIGS if cfg != "base"}}
# Probes of the wgmma building blocks (parameters, TMA + mbarrier, wgmma descriptors), one kernel
# each, for benchmarks/experiments/wgmma_bisect.py; no op launches them.
WGMMA_PROBE = KernelModule("gemm.wgmma_probe", "gemm/wgmma_probe.cu", {
    "gpuops::gemm::wgmma_probe_params": WGMMA_ARGS,
    "gpuops::gemm::wgmma_probe_tma": ArgSpec("tensormap", "ptr", "ptr", "i32", "i32", "i32", "i32",
                                       "i32"),
    **{_kname("wgmma_probe_mma", d.ctype, _b(a_mn), _b(b_mn)):
       ArgSpec("ptr", "ptr", "ptr", "i32", "i32", "i32")
       for d in _HALFS for a_mn in (False, True) for b_mn in (False, True)}},
    archs=(f"{WGMMA_ARCH}a",))
# variant=None picks 'wgmma' (fp16/bf16, sm_90, M > 16, operands TMA can read, not SwiGLU) when
# this is True. Run 21 (H100): its 32 GPU tests pass and it beats 'mma' at every measured shape
# (8192^3 588.5 vs 370.9 TFLOP/s; 4096x6144x2048 288.6 vs 225.9; 4096x2048x6144 420.4 vs 277.1).
WGMMA_AUTO = True

# flags of GemmArgs (gemm_common.cuh)
A_KCONTIG, A_VEC, B_KCONTIG, B_VEC = 1, 2, 4, 8
RES_VEC = 32                         # mma: residual read in 16-byte runs of 8 columns
RES_GATE = 1 << 16                   # wgmma 'tma_fused': (alpha * acc + bias) * silu(residual)
WG_SPLIT_PAIR = 1 << 17              # wgmma split-K of swiglu_linear: partials two products apart
W_PREFETCH = 64                      # K-contiguous GEMVs: the block's weight slice into L2 first
_ACT_IDS = {"kIdentity": 0, "kRelu": 1, "kSilu": 2, "kGeluErf": 3, "kGeluTanh": 4}

DECODE_PLANS = ("balanced", "legacy", *GEMV_PIPE, "tma")
# 'balanced' runs the 'pipe' plan for weights of at least GEMV_PIPE_MIN_BYTES (SwiGLU: the two
# together) where that plan picks tiles of GEMV_PIPE_BALANCED_NT[dual] n8 tiles. bf16, graphs
# of 20 rotated weights, % of copy at M = 2 / 4 / 8 / 16 (balanced -> pipe at NT = 4), H200:
# [151936, 2048] (622 MB) 78.8 / 77.9 / 76.6 / 74.2 -> 89.3 / 87.6 / 86.2 / 81.9 (run 191);
# [32768, 4096] (268 MB) 87.5 / 87.7 / 86.9 / 83.3 -> 87.7 / 87.6 / 87.3 / 83.2 (run 194);
# [14336, 4096] (117 MB) 65.6 / 66.0 / 65.5 / 62.3 -> 76.6 / 76.4 / 75.6 / 74.1 (run 194);
# [6144, 2048] (25 MB) 58.4 / 58.1 / 57.7 / 56.1 -> 53.0 / 52.9 / 53.1 / 51.5 (run 188: no).
# At NT = 1 / 2 the pipe kernel lost everywhere ([14336, 4096] 39.0 / 55.1%, [32768, 4096] NT 2
# 63.2%; [4096, 14336] has no NT = 4 plan and stays on balanced's 76%). H100 run 31, [151936,
# 2048]: balanced 85.2-89.5, pipe 90.9-95.7.
# SwiGLU's pairs (run 211, H200, the same graphs, % of copy for both weights at M = 2 / 4 / 8 /
# 16, balanced -> pipe at NT 2; torch's two GEMVs + silu * mul in the same run):
# 2 x [14336, 4096] 69.2 / 69.3 / 68.7 / 67.2 -> 78.4 / 78.5 / 78.1 / 76.4 (torch 84.6-86.1);
# 2 x [11008, 4096] 71.2 / 70.4 / 70.2 / 68.7 -> 79.5 / 79.5 / 78.3 / 76.7 (torch 75.8-80.5);
# 2 x [6144, 2048] (50 MB together) 68.6 / 68.5 / 68.0 / 66.5 -> 63.8-60.6 (no; torch 55-56).
GEMV_PIPE_MIN_BYTES = 96 << 20
GEMV_PIPE_BALANCED_NT = {False: 4, True: 2}
VARIANTS = ("naive", "smem_tiled", "register_tiled_vec4", "warp_tiled", "mma", "gemv", "gemv_mma",
            "wgmma")
_DUAL_VARIANTS = ("warp_tiled", "mma", "gemv", "gemv_mma", "wgmma")
INT8_VARIANTS = ("dp4a", "mma")
MAX_GRID_Z = 65535


class _KernelCache:
    """Kernel objects looked up once per (module, name, device), forgotten with the loader's
    memory cache (the launch path is host-bound at decode sizes)."""

    @staticmethod
    def get(module, expr, dev):
        return loader.kernel(module, dev, expr)


_kernels = _KernelCache()
_arch_cache: dict = {}


def effective_arch(dev: int) -> int:
    """The compute capability kernels are built for: the device's, or GPUOPS_ARCH when it asks
    for an older one (Pascal PTX on a newer GPU must also take Pascal's paths)."""
    key = (dev, config.settings.arch)
    cc = _arch_cache.get(key)
    if cc is None:
        cc = device.device_info(dev).cc
        if config.settings.arch:
            cc = min(cc, Target.parse(config.settings.arch).arch)
        _arch_cache[key] = cc
    return cc


# ---------------------------------------------------------------------------------------------
# Argument checks shared by the ops and their references.

def parse_dtype(value, name="out_dtype"):
    """None, a gpuops dtype, a name ('bfloat16'), a NumPy or torch dtype -> gpuops DType."""
    if value is None or isinstance(value, dt.DType):
        return value
    text = value if isinstance(value, str) else str(value)
    text = text[6:] if text.startswith("torch.") else text
    d = dt.BY_NAME.get(text)
    if d is None:
        try:
            d = dt.from_numpy(np.dtype(value))
        except TypeError:
            d = None
    if d is None:
        raise TypeError(f"{name}={value!r} is not a dtype gpuops knows")
    return d


def _check_variant(op, variant, allowed=VARIANTS):
    if variant is not None and variant not in allowed:
        raise ValueError(f"gpuops.{op}: variant={variant!r}; expected None or one of "
                         f"{', '.join(repr(v) for v in allowed)}")


def _out_dtype(op, in_dtype, out_dtype):
    out = parse_dtype(out_dtype) or in_dtype
    if out is not in_dtype and not (out is dt.float32 and in_dtype in _HALFS):
        raise ValueError(f"gpuops.{op}: out_dtype={out} with {in_dtype} inputs; expected the "
                         "inputs' dtype, or float32 for float16/bfloat16 inputs")
    return out


def matmul_shapes(op, a_shape, b_shape):
    """torch.matmul's shape rules: (batch shape, M, N, K, out shape)."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) == 0 or len(b_shape) == 0:
        raise ValueError(f"gpuops.{op}: both operands need at least one dimension, got shapes "
                         f"{a_shape} and {b_shape}")
    am = (1,) + a_shape if len(a_shape) == 1 else a_shape
    bm = b_shape + (1,) if len(b_shape) == 1 else b_shape
    M, K = am[-2:]
    K2, N = bm[-2:]
    if K != K2:
        raise ValueError(f"gpuops.{op}: shapes {a_shape} and {b_shape} cannot be multiplied "
                         f"({M}x{K} and {K2}x{N})")
    batch = broadcast_shapes(a=am[:-2], b=bm[:-2])
    out = batch + ((M,) if len(a_shape) > 1 else ()) + ((N,) if len(b_shape) > 1 else ())
    return batch, M, N, K, out


def _check_bias(op, bias_shape, N):
    if tuple(bias_shape) not in ((N,), (1,)):
        raise ValueError(f"gpuops.{op}: 'bias' has shape {tuple(bias_shape)}; expected ({N},), "
                         "one value per output column")


def _check_residual(op, res_shape, out_shape):
    shape = broadcast_shapes(out=out_shape, residual=tuple(res_shape))
    if shape != tuple(out_shape):
        raise ValueError(f"gpuops.{op}: 'residual' of shape {tuple(res_shape)} does not broadcast "
                         f"to the output's shape {tuple(out_shape)}")


# ---------------------------------------------------------------------------------------------
# Planning a call: shapes, strides, batch layout, flags.

class _Plan:
    """One GEMM as the kernels see it (all strides in elements)."""
    __slots__ = ("M", "N", "K", "a_sm", "a_sk", "b_sk", "b_sn", "r_sm", "r_sn", "batch",
                 "bshape", "a_sb", "b_sb", "r_sb", "out_shape")


def _merge_batch(op, plan, batch, a_bs, b_bs, r_bs, max_fold_m=None):
    """Fold the batch into M where A's (batch..., M) dims are one strided run and B is shared
    (torch does the same for [B, M, K] @ [K, N]); else merge batch dims to at most 3.
    max_fold_m: fold only while the folded M stays within it (the GEMV kernels take M <= 16: an
    explicit gemv of small matrices with a shared B runs as a batch of GEMVs instead)."""
    M, N = plan.M, plan.N
    if batch and not any(b_bs) and (max_fold_m is None or prod(batch) * M <= max_fold_m):
        shape = batch + (M,)
        c = tuple(s * N for s in contiguous_strides(shape))
        lists = [a_bs + (plan.a_sm,), c] + ([r_bs + (plan.r_sm,)] if r_bs is not None else [])
        cshape, cstr = coalesce(shape, lists)
        if len(cshape) == 1:
            plan.M = cshape[0]
            plan.a_sm = cstr[0][0]
            if r_bs is not None:
                plan.r_sm = cstr[2][0]
            batch = ()
    plan.batch = prod(batch) if batch else 1
    if batch:
        c = tuple(s * plan.M * N for s in contiguous_strides(batch))
        lists = [a_bs, b_bs, c] + ([r_bs] if r_bs is not None else [])
        cshape, cstr = coalesce(batch, lists)
        if len(cshape) > 3:
            raise ValueError(f"gpuops.{op}: the operands' batch dimensions need {len(cshape)} "
                             "strides after merging contiguous ones; the kernels take 3. Make "
                             "the inputs contiguous first")
        pad = 3 - len(cshape)
        plan.bshape = (1,) * pad + tuple(cshape)
        plan.a_sb = (0,) * pad + tuple(cstr[0])
        plan.b_sb = (0,) * pad + tuple(cstr[1])
        plan.r_sb = (0,) * pad + tuple(cstr[3]) if r_bs is not None else (0, 0, 0)
    else:
        plan.bshape, plan.a_sb, plan.b_sb, plan.r_sb = (1, 1, 1), (0, 0, 0), (0, 0, 0), (0, 0, 0)


def _remembered(cache: dict, key, make, limit=4096):
    """cache[key], made by make() on a miss (an exception leaves nothing behind); the cache is
    emptied when it reaches `limit` entries (a model's GEMMs are few; a sweep's are not)."""
    hit = cache.get(key)
    if hit is None:
        hit = make()
        if len(cache) >= limit:
            cache.clear()
        cache[key] = hit
    return hit


_plan_cache: dict = {}


def _plan(op, a: Tensor, b: Tensor, residual: Tensor | None, max_fold_m=None) -> _Plan:
    """The call's _Plan, remembered per shapes and strides (a model repeats its GEMMs; planning
    is ~a quarter of a call's host time). Plans are never changed after they are made."""
    key = (op, a.shape, a.strides, b.shape, b.strides, max_fold_m,
           None if residual is None else (residual.shape, residual.strides))
    return _remembered(_plan_cache, key, lambda: _plan_uncached(op, a, b, residual, max_fold_m))


def _plan_uncached(op, a: Tensor, b: Tensor, residual: Tensor | None, max_fold_m=None) -> _Plan:
    batch, M, N, K, out_shape = matmul_shapes(op, a.shape, b.shape)
    if a.ndim == 1:
        a_str, a_bs = (0, a.strides[0]), ()
    else:
        a_str = tuple(a.strides[-2:])
        a_bs = broadcast_strides(tuple(a.shape[:-2]), tuple(a.strides[:-2]), batch)
    if b.ndim == 1:
        b_str, b_bs = (b.strides[0], 0), ()
    else:
        b_str = tuple(b.strides[-2:])
        b_bs = broadcast_strides(tuple(b.shape[:-2]), tuple(b.strides[:-2]), batch)
    a_bs = a_bs or (0,) * len(batch)
    b_bs = b_bs or (0,) * len(batch)
    p = _Plan()
    p.M, p.N, p.K = M, N, K
    p.a_sm, p.a_sk = a_str
    p.b_sk, p.b_sn = b_str
    p.out_shape = out_shape
    r_bs = None
    p.r_sm = p.r_sn = 0
    if residual is not None:
        _check_residual(op, residual.shape, out_shape)
        full = list(broadcast_strides(tuple(residual.shape), tuple(residual.strides), out_shape))
        if a.ndim == 1:
            full.insert(len(batch), 0)
        if b.ndim == 1:
            full.append(0)
        r_bs = tuple(full[:len(batch)])
        p.r_sm, p.r_sn = full[len(batch)], full[len(batch) + 1]
    _merge_batch(op, p, batch, a_bs, b_bs, r_bs, max_fold_m)
    return p


def _aligned(ptr, itemsize, width, strides) -> bool:
    """Runs of `width` elements along a unit-stride dim start on width * itemsize bytes."""
    if ptr % (width * itemsize):
        return False
    return all(s % width == 0 for s in strides)


def _operand_layout(R, K, sr, sk, batch_strides, ptr, itemsize, width):
    """(kcontig, vec) of an operand X[r][k] (A: r = m; B^T: r = n) for runs of `width` elements:
    runs go along k when k has unit stride, else along r when r has; vec when those runs are
    aligned for vector loads. Neither unit stride: element by element along the smaller stride."""
    if sk == 1 and K > 1:
        kcontig = True
    elif sr == 1 and R > 1:
        kcontig = False
    elif sk == 1 or K <= 1:
        kcontig = True
    else:
        kcontig = abs(sk) <= abs(sr)
    if kcontig:
        ok = (sk == 1 or K <= 1) and _aligned(ptr, itemsize, width,
                                             ((sr,) if R > 1 else ()) + tuple(batch_strides))
    else:
        ok = sr == 1 and _aligned(ptr, itemsize, width, ((sk,) if K > 1 else ()) + tuple(batch_strides))
    return kcontig, ok


def _flags(p: _Plan, a_ptr, b_ptrs, itemsize, a_width, b_width):
    ak, av = _operand_layout(p.M, p.K, p.a_sm, p.a_sk, p.a_sb, a_ptr, itemsize, a_width)
    bk, bv = True, True
    for ptr in b_ptrs:
        k, v = _operand_layout(p.N, p.K, p.b_sn, p.b_sk, p.b_sb, ptr, itemsize, b_width)
        bk, bv = k, bv and v
    return ((A_KCONTIG if ak else 0) | (A_VEC if av else 0) | (B_KCONTIG if bk else 0)
            | (B_VEC if bv else 0)), ak, bk


# ---------------------------------------------------------------------------------------------
# Launching.

class _Launch:
    """Pointers and epilogue of one call, packed per launch into GemmArgs."""
    __slots__ = ("a", "b", "b2", "c", "bias", "residual", "ws", "sa", "sb", "bias_s", "alpha",
                 "act", "out_f32", "k_split", "splits", "flags")

    def __init__(self):
        self.b2 = self.bias = self.residual = self.ws = self.sa = self.sb = 0
        self.bias_s = 0
        self.alpha = 1.0
        self.act = 0
        self.out_f32 = 0
        self.k_split = 0
        self.splits = 1
        self.flags = 0


def _gemm_args(p: _Plan, L: _Launch, z0: int) -> tuple:
    """The fields of GemmArgs (gemm_common.cuh), flat, in order."""
    return (L.a, L.b, L.b2, L.c, L.bias, L.residual, L.ws, L.sa, L.sb,
            p.M, p.N, p.K, p.a_sm, p.a_sk, p.b_sk, p.b_sn, p.r_sm, p.r_sn, L.bias_s,
            p.batch, *p.bshape, *p.a_sb, *p.b_sb, *p.r_sb, L.k_split or max(p.K, 1), z0,
            L.alpha, L.act, L.out_f32, L.splits, L.flags)


def _run(kernel, p: _Plan, L: _Launch, grid_xy, block, stream, smem=0):
    """Launch over the batch in chunks of 65535 matrices (grid.z), passing each chunk's z0."""
    for z0 in range(0, p.batch, MAX_GRID_Z):
        gz = min(MAX_GRID_Z, p.batch - z0)
        kernel.launch((grid_xy[0], grid_xy[1], gz), block, stream, *_gemm_args(p, L, z0),
                      smem=smem)


def _cdiv(a, b):
    return -(-a // b)


def _split_k(call, blocks, K, min_k):
    """Splits of K so that `blocks` (per split) fill the GPU about 4 times over, each split at
    least `min_k` long; returns (splits, k_split)."""
    sms = device.device_info(call.device).sm_count
    splits = 1
    if blocks < 4 * sms:
        splits = max(1, min(_cdiv(4 * sms, max(blocks, 1)), K // min_k, 64))
    if splits == 1:
        return 1, 0
    k_split = _cdiv(_cdiv(K, splits), 256) * 256       # keeps 16-byte alignment of every split
    return _cdiv(K, k_split), k_split


def _gemv_mma_plan(sms, N, K, batch, dual, rows="auto"):
    """(NT, splits, k_split) of gemv_mma: the block size and split-K whose blocks fill whole
    waves of the resident slots (a block streams up to 32 rows x K of the weight, so a partly
    empty last wave idles SMs for a whole block's time); a split costs a reduce launch and a
    workspace round trip, counted as 5% of fill. Each split keeps >= 1024 k (4 steps per warp).
    rows (PLAN['gemv_rows']): 'auto' (the block sizes of GEMV_MMA_NT_AUTO) or the weight rows
    per block to force (8 * NT). Equal fill, non-dual: the larger block where the grid is at most
    two waves, the smaller over more waves (where AHEAD 2 then applies). Runs 138-139 (H100, bf16,
    graphs, M = 2..16): [2048, 6144] NT 4 x 4 splits 13.3-13.9 us against NT 2 x 3 splits
    13.5-15.5; [4096, 4096] NT 4 x 2 16.4-18.5 against NT 2 x 3 17.3-19.0; the lm head
    [151936, 2048] (24 waves) NT 2 with AHEAD 2 210-228 against NT 4 with AHEAD 2 213-236."""
    if rows == "auto":
        nts = GEMV_MMA_NT_AUTO[dual]
    elif isinstance(rows, int) and rows % 8 == 0 and rows // 8 in GEMV_MMA_NT[dual]:
        nts = (rows // 8,)
    else:
        raise ValueError(f"gpuops: PLAN['gemv_rows'] must be 'auto' or one of "
                         f"{[8 * nt for nt in GEMV_MMA_NT[dual]]}, got {rows!r}")
    return _gemv_mma_plan_of(sms, N, K, batch, tuple((nt, GEMV_MMA_NT[dual][nt]) for nt in nts),
                             not dual)


def _gemv_mma_ahead(ahead, blocks, slots):
    """gemv_mma's AHEAD for a grid of `blocks` on `slots` resident blocks: PLAN['gemv_ahead'], or
    under 'auto' 2 for grids of more than two waves, else 0. Run 137 (H100, bf16): AHEAD 2 took
    the lm head [151936, 2048] (24 waves) from 226-240 to 210-229 us, and was slower or equal in
    the one-wave grids of [6144, 2048] and [2048, 6144]; AHEAD 4 was slower everywhere."""
    if ahead == "auto":
        return 2 if blocks > 2 * slots else 0
    if ahead not in GEMV_MMA_AHEAD:
        raise ValueError(f"gpuops: PLAN['gemv_ahead'] must be 'auto' or one of "
                         f"{list(GEMV_MMA_AHEAD)}, got {ahead!r}")
    return ahead


@lru_cache(maxsize=1024)
def _gemv_mma_plan_of(sms, N, K, batch, nt_occupancies, by_waves=False):
    # remembered per shape and table (tests swap the tables): the search is ~60 integer divisions,
    # a quarter of a decode GEMV's host time
    best = None
    for nt, occ in nt_occupancies:
        slots = occ * sms
        for s in range(1, 9):
            k_split = _cdiv(_cdiv(K, s), 256) * 256
            splits = _cdiv(K, k_split)
            if splits != s or (s > 1 and k_split < 1024):
                continue
            blocks = _cdiv(N, 8 * nt) * batch * splits
            fill = blocks / (_cdiv(blocks, slots) * slots)
            score = fill - (0.05 if splits > 1 else 0.0)
            # by_waves: on equal scores the larger block for <= 2 waves, the smaller for more
            tie = (nt if _cdiv(blocks, slots) <= 2 else -nt) if by_waves else 0
            key = (round(score, 9), tie)
            if best is None or key > best[0]:
                best = (key, nt, splits, k_split if splits > 1 else 0)
    return best[1:]


def _gemv_pipe_plan(sms, N, K, batch, dual, plan):
    """(NT, U, MINB, grid.x) of gemv_mma_pipe under PLAN['decode'] = plan, or None when the row
    tiles cannot keep GEMV_PIPE_INFLIGHT bytes of loads in flight without split-K (few weight
    rows: 'balanced' takes those) or K is too short for the ring (U > ceil(K / 256) steps).
    Blocks are persistent, grid.x = min(tiles, resident slots / batch). The largest tiles first
    (fewer reads of A per weight byte: on the H200, run 194, bf16 [14336, 4096] M = 2..16 ran at
    39% of copy with NT = 1, 55% with NT = 2, 74-77% with NT = 4; [32768, 4096] 63% with NT = 2,
    87-88% with NT = 4), then the score: 1 when the blocks still busy in the last round of tiles
    keep enough in flight (the memory stays saturated to the end), else the share of
    block-rounds that hold a tile (runs 136-141 chose on this score alone)."""
    return _gemv_pipe_plan_of(sms, N, K, batch, dual, tuple(GEMV_PIPE[plan][dual]),
                              GEMV_PIPE_INFLIGHT)


@lru_cache(maxsize=1024)
def _gemv_pipe_plan_of(sms, N, K, batch, dual, configs, inflight):
    best = None
    packs = 2 if dual else 1
    steps = max(1, _cdiv(K, 256))
    for nt, u, minb in configs:
        tiles = _cdiv(N, 8 * nt)
        if tiles >= 2 ** 31 or u > steps:
            continue
        gx = min(tiles, max(1, minb * sms // batch))
        per_block = batch * 8 * u * nt * packs * 512
        if gx * per_block < inflight:
            continue
        rounds = _cdiv(tiles, gx)
        last = tiles - gx * (rounds - 1)
        fill = 1.0 if last * per_block >= inflight else tiles / (gx * rounds)
        key = (nt, round(fill, 6))
        if best is None or key > best[0]:
            best = (key, (nt, u, minb, gx))
    return None if best is None else best[1]


def _l1_split(M, K, itemsize, splits, k_split, budget=64 * 1024):
    """Split K further so that one split's slice of A (M rows) fits in L1 (`budget` bytes): every
    block of the SIMT gemv reads its split's slice of A, which without the split comes from L2
    once per block (M=16 fp32, K=4096: 256 KB per block, 400 MB of L2 reads for a 100 MB weight).
    Resident blocks share a split (grid.x varies fastest), so the slice stays in L1."""
    cur = k_split or K
    if M * cur * itemsize <= budget:
        return splits, k_split
    k_split = max(256, budget // (M * itemsize) // 256 * 256)
    return _cdiv(K, k_split), k_split


def _gemv_flags(p, L, itemsize, dual, b_width, b_kruns):
    """Flags of the GEMV kernels: A read in 16-byte runs along k; B in runs of `b_width` along
    k (b_kruns) or along n."""
    a_vec = p.a_sk == 1 and _aligned(L.a, itemsize, 16 // itemsize,
                                     ((p.a_sm,) if p.M > 1 else ()) + tuple(p.a_sb))
    b_vec = True
    for ptr in ((L.b, L.b2) if dual else (L.b,)):
        if b_kruns:
            b_vec = b_vec and p.b_sk == 1 and _aligned(
                ptr, itemsize, b_width, ((p.b_sn,) if p.N > 1 else ()) + tuple(p.b_sb))
        else:
            b_vec = b_vec and p.b_sn == 1 and _aligned(
                ptr, itemsize, b_width, ((p.b_sk,) if p.K > 1 else ()) + tuple(p.b_sb))
    return (A_VEC if a_vec else 0) | (B_VEC if b_vec else 0) | (B_KCONTIG if b_kruns else 0)


_resident = {}     # (device, kernel name, smem) -> clusters resident at once (or None)


def _resident_clusters(dev, kernel, blocks, smem):
    """How many clusters of a cluster kernel fit the device at once (cuOccupancyMaxActiveClusters,
    asked once per kernel and shared memory; the persistent grid is cut to it: a cluster past it
    would start only when another has finished), or `blocks` where the driver cannot say."""
    key = (dev, getattr(kernel, "name", None), smem)
    if key not in _resident:
        query = getattr(kernel, "max_active_clusters", None)   # (the emulator's kernels: none)
        _resident[key] = query((blocks, 1, 1), (288, 1, 1), smem) if query else None
    return _resident[key] or blocks


def _gemv_tma_applies(call, p, L, dual):
    """gemv_mma_tma's conditions: sm_90 (TMA, mbarriers), one batch, and weights (SwiGLU: both)
    TMA can describe as [N, K] with K contiguous (16-byte aligned bases and row stride)."""
    return (effective_arch(call.device) >= 90 and p.batch == 1 and p.b_sk == 1
            and p.K > 0 and max(p.N, p.K) < 2 ** 31
            and all(tma.check_tiled(ptr, tma.DTYPE_UINT16, (p.K, p.N), (p.b_sn * 2,),
                                    GEMV_TMA_BOX, tma.SWIZZLE_NONE) is None
                    for ptr in ((L.b, L.b2) if dual else (L.b,))))


def _launch_gemv(call, p, L, dtype, dual, use_mma):
    itemsize = dtype.itemsize
    vec_w = 16 // itemsize
    plan = PLAN["decode"]
    if plan not in DECODE_PLANS:
        raise ValueError(f"gpuops: PLAN['decode'] must be one of {list(DECODE_PLANS)}, got {plan!r}")
    balanced = plan != "legacy"           # the pipe plans keep 'balanced' for what they do not take
    splits = None
    if use_mma:
        L.flags = _gemv_flags(p, L, itemsize, dual, vec_w, True)
        sms = device.device_info(call.device).sm_count
        cfg_key = PLAN["gemv_tma"]
        cfg = GEMV_TMA_CONFIGS[cfg_key]
        # 'balanced' takes 'tma' for large weights where its blocks (K split over clusters where
        # the rows are too few) fill the GPU with whole tiles (runs 203-208)
        tma_auto = plan == "balanced" and p.N * p.K * itemsize * (2 if dual else 1) >= (
            GEMV_TMA_DUAL_MIN_BYTES if dual else GEMV_TMA_MIN_BYTES)
        tma_ok = not dual or cfg_key in GEMV_TMA_DUAL_CONFIGS
        if tma_ok and (tma_auto or plan == "tma"):
            ks, clusters, score = _gemv_tma_split(sms, p.N, p.K, cfg_key,
                                                  PLAN["gemv_tma_split"], dual)
            tma_auto = tma_auto and score >= GEMV_TMA_FILL
        if (plan == "tma" or tma_auto) and tma_ok and _gemv_tma_applies(call, p, L, dual):
            desc = tma.encode_tiled(L.b, tma.DTYPE_UINT16, (p.K, p.N), (p.b_sn * itemsize,),
                                    GEMV_TMA_BOX, tma.SWIZZLE_NONE)
            L.splits, L.k_split = 1, 0
            if PLAN["gemv_l2_prefetch"]:   # the first chunks of each block into L2 first
                L.flags |= W_PREFETCH
            smem = _gemv_tma_smem(*cfg, ks)
            if dual:
                desc2 = tma.encode_tiled(L.b2, tma.DTYPE_UINT16, (p.K, p.N),
                                         (p.b_sn * itemsize,), GEMV_TMA_BOX, tma.SWIZZLE_NONE)
                kernel = _kernels.get(GEMV_TMA[dtype], _kname(
                    "gemv_mma_tma_dual", dtype.ctype, *cfg), call.device)
                kernel.launch((clusters, 1, 1), (288, 1, 1), call.stream, desc, desc2,
                              *_gemm_args(p, L, 0), smem=smem)
                return
            if ks == 1:
                kernel = _kernels.get(GEMV_TMA[dtype], _kname("gemv_mma_tma", dtype.ctype, *cfg),
                                      call.device)
            else:
                kernel = _kernels.get(GEMV_TMA[dtype], _kname(
                    "gemv_mma_tma_split", dtype.ctype, *cfg, ks), call.device)
                clusters = min(clusters, _resident_clusters(call.device, kernel, clusters * ks,
                                                            smem))
            kernel.launch((clusters * ks, 1, 1), (288, 1, 1), call.stream, desc,
                          *_gemm_args(p, L, 0), smem=smem)
            return
        pipe = plan in GEMV_PIPE and _gemv_pipe_plan(sms, p.N, p.K, p.batch, dual, plan)
        if (plan == "balanced"
                and p.N * p.K * itemsize * (2 if dual else 1) >= GEMV_PIPE_MIN_BYTES):
            # large weights: the 'pipe' plan where it runs its widest tiles (GEMV_PIPE_MIN_BYTES)
            pipe = _gemv_pipe_plan(sms, p.N, p.K, p.batch, dual, "pipe")
            if pipe and pipe[0] == GEMV_PIPE_BALANCED_NT[dual]:
                plan = "pipe"
            else:
                pipe = None
        if pipe:
            nt, u, minb, gx = pipe
            L.splits, L.k_split = 1, 0
            _run(_kernels.get(GEMV_MMA_PIPE[plan][dtype],
                              _pipe_expr(dtype, nt, u, minb, dual), call.device),
                 p, L, (gx, 1), (256, 1, 1), call.stream)
            return
        if balanced:
            nt, splits, k_split = _gemv_mma_plan(sms, p.N, p.K, p.batch, dual, PLAN["gemv_rows"])
        else:
            nt = 2 if dual else 4
        rows = 8 * nt
        module = GEMV_MMA[dtype]
        min_k = 2048
    else:
        mt = next(m for m in GEMV_MT if p.M <= m)
        kpath = dual or p.b_sn != 1 or p.b_sk == 1
        if kpath:
            # B read along k (a Linear weight; also any B without a unit stride along n)
            rows = (2 if (itemsize == 2 and mt > 4) else 4) // (2 if dual else 1)
            L.flags = _gemv_flags(p, L, itemsize, dual, vec_w, True)
            expr = _kname("gemv_kcontig", dtype.ctype, mt, _b(dual))
            min_k = 8 * 32 * vec_w
        else:
            cols = 8 if (itemsize == 2 and mt == 1) else 4
            rows = 32 * cols
            L.flags = _gemv_flags(p, L, itemsize, dual, cols, False)
            expr = _kname("gemv_ncontig", dtype.ctype, mt)
            min_k = 256
        module = GEMV[dtype]
    prefetch = PLAN["gemv_l2_prefetch"]
    if prefetch and (use_mma or kpath):
        if prefetch is not True and not (isinstance(prefetch, int) and prefetch % 256 == 0
                                         and 0 < prefetch < 65536):
            raise ValueError("gpuops: PLAN['gemv_l2_prefetch'] must be False, True or a multiple "
                             f"of 256 below 65536, got {prefetch!r}")
        # bits 8..15: the bytes of each row's slice to prefetch / 256 (0: all of it)
        L.flags |= W_PREFETCH | (0 if prefetch is True else (prefetch // 256) << 8)
    if splits is None:
        splits, k_split = _split_k(call, _cdiv(p.N, rows) * p.batch, p.K, min_k)
        # measured on the H100 (run 11, [6144, 4096] fp32 in a graph): the L1-sized split helps
        # at M = 16 (37.5% of copy against 35.6%) and hurts at M = 8 (54.4% against 61.5%)
        if balanced and not use_mma and kpath and mt > 8:
            splits, k_split = _l1_split(p.M, p.K, itemsize, splits, k_split)
    if use_mma:   # AHEAD depends on the grid, so on the split
        ahead = _gemv_mma_ahead(PLAN["gemv_ahead"], _cdiv(p.N, rows) * p.batch * splits,
                                GEMV_MMA_NT[dual][nt] * sms)
        expr = _kname("gemv_mma", dtype.ctype, nt, ahead, _b(dual))
    L.splits, L.k_split = splits, k_split
    if splits > 1:
        ws = call.empty((splits * (2 if dual else 1) * p.batch * p.M * p.N,), dt.float32)
        L.ws = ws.ptr
    _run(_kernels.get(module, expr, call.device), p, L, (_cdiv(p.N, rows), splits), (256, 1, 1),
         call.stream)
    if splits > 1:
        # one launch over every output (batch * M * N <= 16 * batch * N here)
        kernel = _kernels.get(GEMV[dtype], _kname("gemv_splitk_reduce", dtype.ctype), call.device)
        kernel.launch((_cdiv(p.batch * p.M * p.N, 256), 1, 1), (256, 1, 1), call.stream,
                      L.a, L.b, L.b2, L.c, L.bias, L.residual, L.ws, L.sa, L.sb,
                      p.M, p.N, p.K, p.a_sm, p.a_sk, p.b_sk, p.b_sn, p.r_sm, p.r_sn, L.bias_s,
                      p.batch, *p.bshape, *p.a_sb, *p.b_sb, *p.r_sb, k_split, 0,
                      L.alpha, L.act, L.out_f32, splits, L.flags)


def _residual_vec(p, L, res_itemsize) -> bool:
    """The mma epilogue may read the residual in 16-byte runs of 8 columns: unit column stride,
    16-byte aligned pointer, rows and batch offsets, and N % 8 == 0 (a run never straddles a row
    end)."""
    if p.N % 8 or p.r_sn != 1:
        return False
    return _aligned(L.residual, res_itemsize, 16 // res_itemsize, (p.r_sm,) + tuple(p.r_sb))


def _warp_tiled_config(dev, dtype, dual) -> str:
    """The key of WARP_TILED_CONFIGS a warp_tiled call runs: PLAN['warp_tiled'] ('auto': by
    arch), or 'base' for the dtypes the candidate configurations are not built for and where the
    device lacks their shared memory (sm_61: 48 KiB per block)."""
    name = PLAN["warp_tiled"]
    if name == "auto":
        name = "async" if effective_arch(dev) >= 80 else "k16"
    if name not in WARP_TILED_CONFIGS:
        raise ValueError(f"gpuops: PLAN['warp_tiled'] must be 'auto' or one of "
                         f"{sorted(WARP_TILED_CONFIGS)}, got {name!r}")
    if dtype not in WARP_TILED_MODULES[name]:
        return "base"
    if _wt_smem(WARP_TILED_CONFIGS[name], dual) > device.device_info(dev).max_smem_per_block_optin:
        return "base"
    return name


def _launch_tiled(call, p, L, dtype, variant, dual):
    itemsize = dtype.itemsize
    b_ptrs = (L.b, L.b2) if dual else (L.b,)
    if variant == "naive":
        L.flags, _, _ = _flags(p, L.a, b_ptrs, itemsize, 4, 4)
        _run(_kernels.get(NAIVE, _kname("gemm_naive", dtype.ctype), call.device), p, L,
             (_cdiv(p.N, 32), _cdiv(p.M, 8)), (32, 8, 1), call.stream)
    elif variant == "smem_tiled":
        L.flags, _, _ = _flags(p, L.a, b_ptrs, itemsize, 4, 4)
        _run(_kernels.get(SMEM_TILED, _kname("gemm_smem_tiled", dtype.ctype), call.device), p, L,
             (_cdiv(p.N, 32), _cdiv(p.M, 32)), (32, 32, 1), call.stream)
    elif variant == "register_tiled_vec4":
        L.flags, _, _ = _flags(p, L.a, b_ptrs, itemsize, 4, 4)
        tiles = _cdiv(p.M, 128) * _cdiv(p.N, 128)
        _run(_kernels.get(REGISTER_TILED[dtype], _kname("gemm_register_tiled_vec4", dtype.ctype),
                          call.device), p, L, (tiles, 1), (256, 1, 1), call.stream)
    elif variant == "warp_tiled":
        L.flags, _, _ = _flags(p, L.a, b_ptrs, itemsize, 4, 4)
        name = _warp_tiled_config(call.device, dtype, dual)
        cfg = WARP_TILED_CONFIGS[name]
        bm, bn, bk = cfg[:3]
        if _cdiv(p.K, bk) >= 2 ** 31:
            raise ValueError(f"gpuops.{call.op.name}: K = {p.K} is too long for "
                             f"variant='warp_tiled' (it counts K tiles of {bk} in 32 bits)")
        tiles = _cdiv(p.M, bm) * _cdiv(p.N, bn // 2 if dual else bn)
        _run(_kernels.get(WARP_TILED_MODULES[name][dtype], _wt_expr(dtype, cfg, dual),
                          call.device), p, L, (tiles, 1), (_wt_threads(cfg), 1, 1), call.stream,
             smem=_wt_smem(cfg, dual))
    elif variant == "mma":
        width = 16 // itemsize
        L.flags, ak, bk = _flags(p, L.a, b_ptrs, itemsize, width, width)
        if dual:
            cfg = MMA_DUAL
            ak = bk = True      # instantiated K-major only; other layouts take the element path
            if not (L.flags & A_KCONTIG):
                L.flags &= ~A_VEC
            if not (L.flags & B_KCONTIG):
                L.flags &= ~B_VEC
        elif dtype is dt.float32:
            cfg = MMA_SMALL
            if not (ak or bk):  # not instantiated (see _mma_kernels): the element path
                ak = bk = True
                L.flags &= ~(A_VEC | B_VEC)
        else:
            cfg = _mma_config(call.device, p.M, p.N, p.batch)
        if L.residual and _residual_vec(p, L, 4 if L.out_f32 else itemsize):
            L.flags |= RES_VEC
        bm, bn, wm, wn, _, _ = cfg
        tiles = _cdiv(p.M, bm) * _cdiv(p.N, bn)
        _run(_kernels.get(MMA[dtype], _mma_expr(dtype, cfg, ak, bk, dual), call.device), p, L,
             (tiles, 1), (wm * wn * 32, 1, 1), call.stream, smem=_mma_smem(cfg, dual))
    else:  # pragma: no cover
        raise AssertionError(variant)


# ---------------------------------------------------------------------------------------------
# wgmma: what TMA can read, the tensor maps, the persistent launch.

# what the user calls A and B (default 'a', 'b')
_OPERAND_NAMES = {"linear": ("x", "weight"), "swiglu_linear": ("x", "w_gate")}


def _round16(n):
    return (n + 15) // 16 * 16


def _tma_batch_dims(dims: list, strides: list, bshape, bstrides, itemsize: int) -> None:
    """Append a GEMM operand's batch dims (innermost first) to its tensor map's dims and byte
    strides: a batch dim of extent 1 or stride 0 (broadcast) gets extent 1 (the kernel then uses
    coordinate 0) and the stride that continues the layout, rounded to 16 bytes (TMA wants every
    stride a multiple of 16); the others their extent and stride."""
    prev = strides[-1] * dims[-1]
    for ext, st in zip(reversed(bshape), reversed(bstrides)):
        if st != 0 and ext > 1:
            dims.append(ext)
            strides.append(st * itemsize)
        else:
            dims.append(1)
            strides.append(_round16(prev))
        prev = strides[-1] * dims[-1]


def _wgmma_operand(R, K, sr, sk, bshape, bstrides, ptr, itemsize, rows_box, dim=None):
    """How the wgmma kernel reads an operand X[r][k] (A: r = m, 128-row box; B seen as B^T: r = n,
    256-row box) through a TMA tensor map: ``(mn_major, dims, byte strides, box)``, or
    ``(None, reason)``. K-major: dims (K, R, batch...), one box of 64 k x rows_box rows;
    M/N-major: dims (R, K, batch...), boxes of 64 r x 64 k (the kernel issues 2 or 4 per stage).
    The innermost dim needs unit stride, every other byte stride a positive multiple of 16, the
    base 16-byte alignment (tma.check_tiled). Batch dims go outermost-last; a broadcast one
    (stride 0) gets extent 1 (the kernel then uses coordinate 0)."""
    reasons = []
    candidates = []
    if sk == 1 or K <= 1:
        candidates.append(False)
    if sr == 1 or R <= 1:
        candidates.append(True)
    if not candidates:
        return None, (f"neither of its two last dims has unit stride (strides {sr} along "
                      f"{dim or ('M' if rows_box == WGMMA_BM else 'N')}, {sk} along K)")
    for mn_major in candidates:
        inner, outer, so = (R, K, sk) if mn_major else (K, R, sr)
        inner, outer = max(inner, 1), max(outer, 1)
        dims = [inner, outer]
        strides = [so * itemsize if outer > 1 else _round16(inner * itemsize)]
        if prod(bshape) > 1:
            _tma_batch_dims(dims, strides, bshape, bstrides, itemsize)
        box = [64, 64] if mn_major else [64, rows_box]
        box += [1] * (len(dims) - 2)
        why = tma.check_tiled(ptr, tma.DTYPE_UINT16, dims, strides, box, tma.SWIZZLE_128B)
        if why is None:
            return mn_major, tuple(dims), tuple(strides), tuple(box)
        reasons.append(f"{'M/N' if mn_major else 'K'}-major: {why}")
    return None, "; ".join(reasons)


_wgmma_map_cache: dict = {}


def _wgmma_config():
    cfg = PLAN["wgmma"]
    if cfg not in WGMMA_CONFIGS:
        raise ValueError(f"gpuops: PLAN['wgmma'] must be one of {sorted(WGMMA_CONFIGS)}, "
                         f"got {cfg!r}")
    return cfg


def _wgmma_maps(op, p: _Plan, L: _Launch, dtype, bn=WGMMA_BN, names=None):
    """The two tensor maps and layouts of a wgmma launch with output tiles WGMMA_BM x bn:
    ((a_mn, map_a), (b_mn, map_b)), remembered per pointers, extents and strides (a model repeats
    the same GEMMs). Raises ValueError naming the operand TMA cannot read (the caller falls back
    to 'mma' when the variant was not asked for)."""
    key = (L.a, L.b, p.M, p.N, p.K, p.a_sm, p.a_sk, p.b_sk, p.b_sn, p.bshape, p.a_sb, p.b_sb,
           dtype.itemsize, bn)
    return _remembered(_wgmma_map_cache, key,
                       lambda: _wgmma_maps_uncached(op, p, L, dtype, bn, names))


def _wgmma_maps_uncached(op, p: _Plan, L: _Launch, dtype, bn=WGMMA_BN, names=None):
    """names: what the user calls A and B (default: _OPERAND_NAMES of op, else 'a', 'b')."""
    names = names or _OPERAND_NAMES.get(op, ("a", "b"))
    tiles = _cdiv(p.M, WGMMA_BM) * _cdiv(p.N, bn) * p.batch
    if tiles >= 2 ** 31 or max(p.M, p.N, p.K) >= 2 ** 31:
        raise ValueError(f"gpuops.{op}: variant='wgmma' takes at most 2^31 - 1 output tiles and "
                         f"extents below 2^31 (M={p.M}, N={p.N}, K={p.K}, batch={p.batch})")
    plans = []
    for name, ptr, args in ((names[0], L.a, (p.M, p.K, p.a_sm, p.a_sk, p.bshape, p.a_sb, L.a,
                                            dtype.itemsize, WGMMA_BM, "M")),
                            (names[1], L.b, (p.N, p.K, p.b_sn, p.b_sk, p.bshape, p.b_sb, L.b,
                                            dtype.itemsize, bn, "N"))):
        plan = _wgmma_operand(*args)
        if plan[0] is None:
            raise ValueError(
                f"gpuops.{op}: variant='wgmma' cannot read {name!r} with TMA: {plan[1]}. It "
                "needs one unit-stride dim, 16-byte aligned data and every other stride a "
                "multiple of 8 elements (e.g. a contiguous tensor whose last dim is a multiple "
                "of 8, or a transposed view of one); variant='mma' reads any layout")
        plans.append((name, ptr, plan))
    out = []
    for name, ptr, (mn_major, dims, strides, box) in plans:
        try:
            desc = tma.encode_tiled(ptr, tma.DTYPE_UINT16, dims, strides, box)
        except tma.TensorMapError as exc:
            raise ValueError(f"gpuops.{op}: variant='wgmma': no tensor map for {name!r}: "
                             f"{exc}") from None
        out.append((mn_major, desc))
    return tuple(out)


def _wgmma_grid(p: _Plan, sms, bn=WGMMA_BN, splits=1):
    """Persistent grid: one CTA per SM at most, never more than the work items (output tiles x
    K splits)."""
    return min(_cdiv(p.M, WGMMA_BM) * _cdiv(p.N, bn) * p.batch * splits, max(sms, 1))


# Split-K for wgmma products that leave most SMs idle: a product of at most WGMMA_SPLIT_MAX_FILL x
# SMs output tiles (128 x 256) may run its K in up to SMs / tiles splits of at least
# WGMMA_SPLIT_MIN_KTILES k-tiles (64 each), every split's fp32 partial tile stored by the 'direct'
# kernel to a workspace, then gemv_splitk_reduce adds them in split order and applies the
# epilogue. Without it a product under one wave takes one tile's whole K loop. The split count is
# the one of least estimated time, taken where that beats the unsplit estimate times
# WGMMA_SPLIT_GAIN. Estimates fitted to run 183 (H200, bf16, graph replay; within 1-2 us at the
# six measured shapes): unsplit WG_EST_FIXED_US + WG_EST_KTILE_US per k-tile of a tile; split
# WG_EST_SPLIT_FIXED_US + WG_EST_KTILE_US per k-tile of a split + the partials read back by the
# reduce at WG_EST_REDUCE_GBPS (one thread per output: [128, 6144] x 5 splits took 9.6 us).
# Measured: [32, 2048, 6144] 59.5 -> 15.0 us (cuBLAS 8.9), [128, 2048, 6144] 59.8 -> 18.5 (12.5),
# [32, 6144, 2048] 23.0 -> 16.0 (6.9); [128, 6144, 2048] split 24.3 against 23.4 unsplit: not split.
WGMMA_SPLIT_K = True
WGMMA_SPLIT_MAX_FILL = 0.5
WGMMA_SPLIT_MIN_KTILES = 4
WGMMA_SPLIT_MAX = 16
WGMMA_SPLIT_GAIN = 0.9
WG_EST_FIXED_US, WG_EST_SPLIT_FIXED_US, WG_EST_KTILE_US, WG_EST_REDUCE_GBPS = 6.0, 9.0, 0.55, 1500.0


_wgmma_split_cache: dict = {}


def _wgmma_split(p: _Plan, sms: int, products: int = 1, gain: float | None = None):
    """(splits, k_split) of a wgmma launch of ``products`` products of p's shape (swiglu_linear:
    2, its partials together in one reduce): (1, 0) unless WGMMA_SPLIT_K applies and the
    estimated time of the best split count is under ``gain`` (default WGMMA_SPLIT_GAIN) times
    the unsplit estimate. Remembered per shape and switches (the search over split counts took
    ~17 us of host time per call at [32, 2048, 6144], as much as the rest of the dispatch)."""
    gain = WGMMA_SPLIT_GAIN if gain is None else gain
    key = (p.M, p.N, p.K, p.batch, sms, products, gain, WGMMA_SPLIT_K, WGMMA_SPLIT_MAX_FILL,
           WGMMA_SPLIT_MIN_KTILES, WGMMA_SPLIT_MAX)
    return _remembered(_wgmma_split_cache, key,
                       lambda: _wgmma_split_uncached(p, sms, products, gain))


def _wgmma_split_uncached(p: _Plan, sms: int, products: int, gain: float):
    tiles = _cdiv(p.M, WGMMA_BM) * _cdiv(p.N, WGMMA_BN) * p.batch
    ktiles = _cdiv(p.K, WGMMA_BK)
    if not WGMMA_SPLIT_K or tiles > WGMMA_SPLIT_MAX_FILL * sms or p.N % 2:
        return 1, 0   # (odd N: the partials are stored as float2 pairs)
    best = (products * (WG_EST_FIXED_US + WG_EST_KTILE_US * ktiles) * gain, 1, 0)
    for want in range(2, min(sms // max(tiles, 1), ktiles // WGMMA_SPLIT_MIN_KTILES,
                             WGMMA_SPLIT_MAX) + 1):
        ksteps = _cdiv(ktiles, want)
        splits = _cdiv(ktiles, ksteps)
        partial_bytes = products * splits * p.batch * p.M * p.N * 4
        est = (products * (WG_EST_SPLIT_FIXED_US + WG_EST_KTILE_US * ksteps)
               + partial_bytes / (WG_EST_REDUCE_GBPS * 1e3))
        if est < best[0]:
            best = (est, splits, ksteps * WGMMA_BK)
    return best[1], best[2]


def _launch_wgmma_split(call, p: _Plan, L: _Launch, dtype, maps, splits, k_split, b2_maps=None):
    """A wgmma product (two for swiglu_linear: b2_maps, the up product's maps) in K splits through
    an fp32 workspace from call.empty, then one gemv_splitk_reduce launch for the epilogue (bias,
    activation, residual; or silu(gate) * up)."""
    nb = 2 if b2_maps is not None else 1
    ws = call.empty((splits * nb * p.batch * p.M * p.N,), dt.float32)
    for d, m in enumerate((maps,) if b2_maps is None else (maps, b2_maps)):
        S = _Launch()
        S.a, S.b, S.c = L.a, (L.b if d == 0 else L.b2), ws.ptr + 4 * d * p.batch * p.M * p.N
        S.out_f32, S.splits, S.k_split = 1, splits, k_split
        S.flags = WG_SPLIT_PAIR if nb == 2 else 0
        _launch_wgmma(call, p, S, dtype, m, "direct")
    L.ws, L.splits, L.k_split = ws.ptr, splits, k_split
    kernel = _kernels.get(GEMV[dtype], _kname("gemv_splitk_reduce", dtype.ctype), call.device)
    kernel.launch((_cdiv(p.batch * p.M * p.N, 256), 1, 1), (256, 1, 1), call.stream,
                  *_gemm_args(p, L, 0))


def _launch_wgmma(call, p: _Plan, L: _Launch, dtype, maps, config="base"):
    """One persistent launch: min(tiles, SMs) blocks walk every output tile of the batch."""
    (a_mn, map_a), (b_mn, map_b) = maps
    kernel = _kernels.get(WGMMA_MODULES[config][dtype], _wgmma_expr(dtype, a_mn, b_mn, config),
                          call.device)
    smem = _wgmma_smem(config)
    blocks = _wgmma_grid(p, device.sm_count(call.device), _wgmma_bn(config), L.splits)
    epi = WGMMA_CONFIGS[config]
    maps_c = ()
    if epi in (3, 4, 6):
        maps_c = (_wgmma_map_c(p, L, dtype),)
    if epi in (4, 6):   # the residual's map, or C's again (unused) when the call has none
        maps_c += (_wgmma_map_r(p, L, dtype) if L.residual else maps_c[0],)
    kernel.launch((blocks, 1, 1), (WGMMA_THREADS, 1, 1), call.stream, map_a, map_b, *maps_c,
                  *_gemm_args(p, L, 0), smem=smem)


def _wgmma_map_c(p: _Plan, L: _Launch, dtype):
    """C's tensor map for the 'tma_store' epilogue: dims (N, M, batch) of the contiguous output,
    16-row x 32-column boxes in the 64-byte swizzle (cuda_src/gemm/wgmma.cu). tma.encode_tiled
    remembers it per pointer and shape."""
    return tma.encode_tiled(L.c, tma.DTYPE_UINT16, (p.N, p.M, p.batch),
                            (p.N * dtype.itemsize, p.M * p.N * dtype.itemsize), (32, 16, 1),
                            tma.SWIZZLE_64B)


def _wgmma_residual_plan(p: _Plan, L: _Launch, itemsize: int):
    """The residual's tensor map for 'tma_fused': ``(dims, byte strides, box)`` in C's geometry
    (N innermost, then M, then the batch dims innermost first when batch > 1, as A's and B's
    maps; a broadcast batch dim gets extent 1), boxes of 32 columns x 16 rows; or None where TMA
    cannot read it (a column stride other than 1, a row broadcast, a base or a row / batch stride
    not a multiple of 16 bytes)."""
    if p.r_sn != 1 and p.N > 1:
        return None
    if p.M > 1 and p.r_sm <= 0:
        return None
    dims = [p.N, p.M]
    strides = [p.r_sm * itemsize if p.M > 1 else _round16(p.N * itemsize)]
    if p.batch > 1 and any(st < 0 for ext, st in zip(p.bshape, p.r_sb) if ext > 1):
        return None
    if p.batch > 1:
        _tma_batch_dims(dims, strides, p.bshape, p.r_sb, itemsize)
    box = [32, 16] + [1] * (len(dims) - 2)
    if tma.check_tiled(L.residual, tma.DTYPE_UINT16, dims, strides, box, tma.SWIZZLE_64B):
        return None
    return tuple(dims), tuple(strides), tuple(box)


def _wgmma_map_r(p: _Plan, L: _Launch, dtype):
    """The residual's tensor map of a 'tma_fused' call (_wgmma_call_config checked that it
    exists)."""
    dims, strides, box = _wgmma_residual_plan(p, L, dtype.itemsize)
    return tma.encode_tiled(L.residual, tma.DTYPE_UINT16, dims, strides, box, tma.SWIZZLE_64B)


def _wgmma_call_config(p: _Plan, L: _Launch) -> str:
    """PLAN['wgmma'] for this call. 'tma_store' and 'tma_fused' give way to 'direct' where their
    tensor map cannot write C (fp32 out, N % 8 != 0, a C not 16-byte aligned); 'tma_store' also
    for fused epilogues (run 30: with its generic bias / residual loads, bias cost +37% and
    residual +39% over the bare product, with direct -5% and +17.5%), 'tma_fused' only for a
    residual its fourth tensor map cannot read or a bias that is not contiguous and 4-byte
    aligned (a broadcast or strided bias). 'pingpong' routes as 'tma_fused' (its epilogue)."""
    config = _wgmma_config()
    epi = WGMMA_CONFIGS[config]
    if epi not in (3, 4, 6):
        return config
    if L.out_f32 or p.N % 8 or L.c % 16 or p.batch >= 2 ** 31:
        return "direct"
    fused = bool(L.bias or L.residual or L.act)
    if epi == 3 and fused and not _TMA_STORE_GENERIC_FUSED:
        return "direct"
    if epi in (4, 6) and L.residual and _wgmma_residual_plan(p, L, 2) is None:
        return "direct"
    if epi in (4, 6) and L.bias and (L.bias_s != 1 or L.bias % 4):
        return "direct"   # the kernel copies the bias row in 4-byte pairs (cp.async)
    return config


def _choose(op, variant, dtype, cc, M, allow_tf32, b_kcontig, dual=False):
    if variant == "wgmma":
        if dtype not in _HALFS:
            raise TypeError(f"gpuops.{op}: variant='wgmma' takes float16/bfloat16 inputs, "
                            f"got {dtype}")
        if cc != WGMMA_ARCH:
            raise RuntimeError(f"gpuops.{op}: variant='wgmma' uses wgmma, TMA and setmaxnreg of "
                               f"sm_90a (Hopper); kernels here are built for sm_{cc}")
        return variant
    if variant is None:
        if M <= GEMV_MAX_M:
            m_min = 4 if PLAN["decode"] == "legacy" else PLAN["gemv_simt_max_m"]
            return ("gemv_mma" if (dtype in _HALFS and cc >= 80 and M > m_min and b_kcontig)
                    else "gemv")
        if dtype is dt.float32:
            return "mma" if (allow_tf32 and cc >= 80) else "warp_tiled"
        if WGMMA_AUTO and cc == WGMMA_ARCH:
            return "wgmma"   # gemm() falls back to 'mma' for operands TMA cannot read (and
            #                  swiglu_linear where its two products would not fill the GPU)
        return "mma" if cc >= 80 else "warp_tiled"
    if variant in ("mma", "gemv_mma") and cc < 80:
        raise RuntimeError(f"gpuops.{op}: variant={variant!r} uses tensor-core instructions of "
                           f"sm_80+; kernels here are built for sm_{cc}")
    if variant == "mma" and dtype is dt.float32 and not allow_tf32:
        raise ValueError(f"gpuops.{op}: variant='mma' on float32 inputs multiplies in TF32 "
                         "(10-bit mantissa); pass allow_tf32=True to accept that")
    if variant == "gemv_mma" and dtype not in _HALFS:
        raise TypeError(f"gpuops.{op}: variant='gemv_mma' takes float16/bfloat16 inputs, "
                        f"got {dtype}")
    if variant in ("gemv", "gemv_mma") and M > GEMV_MAX_M:
        raise ValueError(f"gpuops.{op}: variant={variant!r} is for M <= {GEMV_MAX_M} rows per "
                         f"matrix (decode); this product has M = {M}")
    return variant


def gemm(call, op, a: Tensor, b: Tensor, *, bias=None, activation=None, residual=None,
         alpha=1.0, out_dtype=None, variant=None, allow_tf32=False, b2: Tensor | None = None):
    """The launcher shared by matmul, linear and swiglu_linear (b2: the dual/SwiGLU product)."""
    dtype = call.result_dtype
    out_dt = _out_dtype(op, dtype, out_dtype)
    for name, t in (("bias", bias), ("residual", residual)):
        if t is not None and t.dtype is not out_dt:
            raise TypeError(f"gpuops.{op}: {name!r} has dtype {t.dtype}; it must have the "
                            f"output's dtype ({out_dt})")
    _check_activation(op, activation)
    dual = b2 is not None
    _check_variant(op, variant, _DUAL_VARIANTS if dual else VARIANTS)
    # an explicit GEMV variant is per matrix: fold a shared-B batch into M only up to its M limit
    p = _plan(op, a, b, residual, GEMV_MAX_M if variant in ("gemv", "gemv_mma") else None)
    if bias is not None:
        _check_bias(op, bias.shape, p.N)
    out = call.empty(p.out_shape, out_dt)
    if p.M == 0 or p.N == 0 or p.batch == 0:
        return out
    cc = effective_arch(call.device)
    b_kcontig = p.b_sk == 1 or p.K <= 1
    v = _choose(op, variant, dtype, cc, p.M, allow_tf32, b_kcontig, dual)
    L = _Launch()
    L.a, L.b, L.c = a.ptr, b.ptr, out.ptr
    if dual:
        L.b2 = b2.ptr
    if bias is not None:
        L.bias = bias.ptr
        L.bias_s = 0 if bias.shape[0] == 1 else bias.strides[0]
    if residual is not None:
        L.residual = residual.ptr
    L.alpha = float(alpha)
    L.act = _ACT_IDS[ACTIVATIONS[activation]]
    L.out_f32 = 1 if out_dt is dt.float32 else 0
    if v == "wgmma":
        if p.K == 0:    # no product, only the epilogue: any kernel gives the same; no TMA needed
            v = "mma"
        elif dual:
            if _launch_swiglu_wgmma(call, op, p, L, a, b, b2, out, dtype, out_dt, variant):
                return out
            v = "mma"
        else:
            splits, k_split = _wgmma_split(p, device.sm_count(call.device))
            # split-K launches run 'direct' (fp32 partials), whose tiles are WGMMA_BN wide
            config = "direct" if splits > 1 else _wgmma_call_config(p, L)
            try:
                maps = _wgmma_maps(op, p, L, dtype, _wgmma_bn(config))
            except ValueError:
                if variant == "wgmma":
                    raise
                v = "mma"
            else:
                if splits > 1:
                    _launch_wgmma_split(call, p, L, dtype, maps, splits, k_split)
                else:
                    _launch_wgmma(call, p, L, dtype, maps, config)
                return out
    if v in ("gemv", "gemv_mma"):
        _launch_gemv(call, p, L, dtype, dual, v == "gemv_mma")
    else:
        _launch_tiled(call, p, L, dtype, v, dual)
    return out


# swiglu_linear on Hopper: variant=None takes the two wgmma products below only where the gate
# product alone has at least this many waves of 128 x 256 tiles (one CTA per SM); smaller calls
# run the one-kernel 'mma' dual product. Runs 179-180 (H200, bf16, graph replay): [4096^3] dual
# 772-796 us, pair 392-412, torch's silu(linear) * linear 402-463; [M, 6144, 2048]: M = 512
# (0.73 waves) pair 58.1 us against dual 92.3, M = 256 (0.36) 55.9 against 47.0, M = 128 55.6
# against 35.0 (a wave or less of the pair costs one tile's whole K loop, ~27 us per product).
SWIGLU_WGMMA_MIN_WAVES = 0.5
SWIGLU_SPLIT_GAIN = 0.75


def _launch_swiglu_wgmma(call, op, p: _Plan, L: _Launch, a: Tensor, b: Tensor, b2: Tensor,
                         out: Tensor, dtype, out_dt, variant) -> bool:
    """swiglu_linear as two wgmma products: gate = x @ w_gate.T ('tma_store', written in the
    output dtype to a workspace from call.empty), then out = (x @ w_up.T) * silu(gate) ('tma_fused'
    with the gate as its residual, flag RES_GATE). The gate is rounded once to the output dtype
    before silu, as torch's ``silu(linear(x, w_gate)) * linear(x, w_up)`` rounds it. Products of
    few tiles whose K splits pay (_wgmma_split, products=2) run both in K splits instead, fp32
    partials of both, silu(gate) * up in the reduce (no rounded gate). False (the caller runs
    'mma') where variant=None and the call is small or TMA cannot take an operand; an explicit
    variant='wgmma' raises instead."""
    explicit = variant == "wgmma"
    if L.out_f32 or p.N % 8 or L.c % 16 or p.batch >= 2 ** 31:
        if explicit:
            raise ValueError(f"gpuops.{op}: variant='wgmma' writes 16-bit outputs with N a "
                             f"multiple of 8 (N={p.N})")
        return False
    sms = device.sm_count(call.device)
    # the pair in K splits only where it beats the dual 'mma' kernel (run 183, [M, 6144, 2048]:
    # split pair 32.4 us against dual 37.9 at M = 32, 43.9 against 36.0 at M = 128): a gain
    # SWIGLU_SPLIT_GAIN over the unsplit pair's estimate
    splits, k_split = _wgmma_split(p, sms, products=2, gain=SWIGLU_SPLIT_GAIN)
    if not explicit and splits == 1 and (_cdiv(p.M, WGMMA_BM) * _cdiv(p.N, WGMMA_BN) * p.batch
                                         < SWIGLU_WGMMA_MIN_WAVES * sms):
        return False
    try:
        maps_gate = _wgmma_maps(op, p, L, dtype, WGMMA_BN)
        L2 = _Launch()
        L2.a, L2.b, L2.c, L2.out_f32 = L.a, L.b2, L.c, L.out_f32
        maps_up = _wgmma_maps(op, p, L2, dtype, WGMMA_BN, names=("x", "w_up"))
    except ValueError:
        if explicit:
            raise
        return False
    if splits > 1:   # both products in K splits, silu(gate) * up in the reduce (no rounded gate)
        _launch_wgmma_split(call, p, L, dtype, maps_gate, splits, k_split, maps_up)
        return True
    gate = call.empty(p.out_shape, out_dt)
    p_up = _plan(op, a, b2, gate)
    L2.residual, L2.flags = gate.ptr, RES_GATE   # (contiguous: _wgmma_map_r can always map it)
    L1 = _Launch()
    L1.a, L1.b, L1.c, L1.out_f32 = L.a, L.b, gate.ptr, L.out_f32
    _launch_wgmma(call, p, L1, dtype, maps_gate, "tma_store")
    _launch_wgmma(call, p_up, L2, dtype, maps_up, "tma_fused")
    return True


def _transposed(t: Tensor) -> Tensor:
    """The [K, N] view of a [N, K] weight: swapped shape and strides, no copy."""
    return Tensor(t.ptr, (t.shape[1], t.shape[0]), (t.strides[1], t.strides[0]), t.dtype, t.device,
                  t.obj, t.numel, None)


# ---------------------------------------------------------------------------------------------
# NumPy references (float64), also the CPU path. `result_dtype` tells the CPU path the output
# dtype when it is not the inputs' (out_dtype).

def _result_dtype_from_out(values, dtypes):
    names = [n for n in ("a", "b", "x", "a_int8") if n in dtypes]
    in_dt = dtypes[names[0]]
    out = parse_dtype(values.get("out_dtype"))
    if in_dt is dt.int8:
        out = out or dt.float32
        if out not in _FLOATS:
            raise ValueError(f"gpuops.int8_matmul: out_dtype={out}; expected one of "
                             f"{dt.names(_FLOATS)}")
        return out
    if in_dt is dt.float64:          # the CPU path's own dtype: float64 stays float64
        if out not in (None, dt.float64):
            raise ValueError(f"gpuops.matmul: out_dtype={out} with float64 inputs")
        return in_dt
    out = _out_dtype("matmul", in_dt, out)
    for name in ("bias", "residual"):
        if name in dtypes and dtypes[name] is not out:
            raise TypeError(f"gpuops.matmul: {name!r} has dtype {dtypes[name]}; it must have the "
                            f"output's dtype ({out})")
    return out


def ref_matmul(a, b, bias=None, activation=None, residual=None, alpha=1.0, out_dtype=None,
               allow_tf32=False, variant=None):
    _check_activation("matmul", activation)
    _check_variant("matmul", variant)
    parse_dtype(out_dtype)
    _, _, N, _, out_shape = matmul_shapes("matmul", np.shape(a), np.shape(b))
    with np.errstate(all="ignore"):
        y = np.matmul(a, b) * alpha
        if bias is not None:
            _check_bias("matmul", np.shape(bias), N)
            y = y + bias
        y = _act_ref(activation, y)
        if residual is not None:
            _check_residual("matmul", np.shape(residual), out_shape)
            y = y + residual
    return y


ref_matmul.result_dtype = _result_dtype_from_out


def _check_weight(op, x_shape, w_shape, name="weight"):
    if len(w_shape) != 2:
        raise ValueError(f"gpuops.{op}: {name!r} must be 2-D [out_features, in_features], got "
                         f"shape {tuple(w_shape)}")
    if len(x_shape) == 0 or x_shape[-1] != w_shape[1]:
        raise ValueError(f"gpuops.{op}: input of shape {tuple(x_shape)} does not match {name!r} "
                         f"of shape {tuple(w_shape)} (in_features = {w_shape[1]})")


def ref_linear(x, weight, bias=None, activation=None, variant=None, allow_tf32=False):
    _check_activation("linear", activation)
    _check_variant("linear", variant)
    _check_weight("linear", np.shape(x), np.shape(weight))
    with np.errstate(all="ignore"):
        y = np.matmul(x, weight.T)
        if bias is not None:
            _check_bias("linear", np.shape(bias), weight.shape[0])
            y = y + bias
        return _act_ref(activation, y)


def ref_swiglu_linear(x, w_gate, w_up, variant=None):
    _check_variant("swiglu_linear", variant, _DUAL_VARIANTS)
    _check_weight("swiglu_linear", np.shape(x), np.shape(w_gate), "w_gate")
    _check_weight("swiglu_linear", np.shape(x), np.shape(w_up), "w_up")
    if np.shape(w_gate) != np.shape(w_up):
        raise ValueError(f"gpuops.swiglu_linear: 'w_gate' {np.shape(w_gate)} and 'w_up' "
                         f"{np.shape(w_up)} differ in shape")
    with np.errstate(all="ignore"):
        return _act_ref("silu", np.matmul(x, w_gate.T)) * np.matmul(x, w_up.T)


def _check_int8(op, a_shape, b_shape, sa_shape, sb_shape):
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise ValueError(f"gpuops.{op}: 'a_int8' and 'b_int8' must be 2-D, got {tuple(a_shape)} "
                         f"and {tuple(b_shape)}")
    M, K = a_shape
    K2, N = b_shape
    if K != K2:
        raise ValueError(f"gpuops.{op}: shapes {tuple(a_shape)} and {tuple(b_shape)} cannot be "
                         "multiplied")
    if prod(sa_shape) != M or len(sa_shape) > 2:
        raise ValueError(f"gpuops.{op}: 'scale_a' of shape {tuple(sa_shape)} must hold one scale "
                         f"per row of a ({M})")
    if prod(sb_shape) != N or len(sb_shape) > 2:
        raise ValueError(f"gpuops.{op}: 'scale_b' of shape {tuple(sb_shape)} must hold one scale "
                         f"per column of b ({N})")
    return M, N, K


def ref_int8_matmul(a_int8, b_int8, scale_a, scale_b, out_dtype=None, variant=None):
    _check_variant("int8_matmul", variant, INT8_VARIANTS)
    _check_int8("int8_matmul", np.shape(a_int8), np.shape(b_int8), np.shape(scale_a),
                np.shape(scale_b))
    parse_dtype(out_dtype)
    acc = np.asarray(a_int8, np.float64) @ np.asarray(b_int8, np.float64)   # exact below 2^53
    return acc * np.asarray(scale_a, np.float64).reshape(-1, 1) * \
        np.asarray(scale_b, np.float64).reshape(1, -1)


ref_int8_matmul.result_dtype = _result_dtype_from_out


# ---------------------------------------------------------------------------------------------
# Benchmarks (the lead's ladder script is benchmarks/experiments/gemm_ladder.py).

def _gemm_shape(d):
    return (4096, 4096, 4096) if d is dt.float32 else (8192, 8192, 8192)


def _gemm_check_shape(shape):
    return (64, min(shape[1], 1024), shape[2])


def _mnk_flops(M, N, K):
    return 2.0 * M * N * K


def _flops_matmul(args, out):
    a, b = args[0], args[1]
    return _mnk_flops(a.shape[-2], b.shape[-1], a.shape[-1])


def _flops_linear(args, out):
    x, w = args[0], args[1]
    return _mnk_flops(x.shape[-2], w.shape[0], x.shape[-1])


DECODE_SHAPES = ((1, 6144, 4096), (4, 6144, 4096), (16, 6144, 4096))
GEMM_SHAPES = ((4096, 6144, 2048), (4096, 2048, 6144))


def _matmul_inputs(shape, d, randn):
    M, N, K = shape
    return (randn((M, K), d), randn((K, N), d)), {}


def _linear_inputs(shape, d, randn):
    M, N, K = shape
    return (randn((M, K), d), randn((N, K), d), randn((N,), d)), {}


def _swiglu_inputs(shape, d, randn):
    M, N, K = shape
    return (randn((M, K), d), randn((N, K), d), randn((N, K), d)), {}


def _torch():
    import torch  # noqa: PLC0415
    return torch


def _swiglu_torch(x, wg, wu):
    F = _torch().nn.functional  # noqa: N806
    return F.silu(x @ wg.T) * (x @ wu.T)


# ---------------------------------------------------------------------------------------------
# The ops.

@register(family="gemm", reference=ref_matmul,
          param_dtypes={"bias": _FLOATS + (dt.float64,), "residual": _FLOATS + (dt.float64,)},
          bench=BenchSpec(make_inputs=_matmul_inputs, torch_fn=lambda a, b: _torch().matmul(a, b),
                          default_shape=_gemm_shape, flops=_flops_matmul,
                          check_shape=_gemm_check_shape, extra_shapes=GEMM_SHAPES + DECODE_SHAPES))
def matmul(call, a: Tensor, b: Tensor, *, bias: Tensor | None = None, activation: str | None = None,
           residual: Tensor | None = None, alpha: float = 1.0, out_dtype=None,
           allow_tf32: bool = False, variant: str | None = None) -> Tensor:
    """Matrix product with a fused epilogue: ``act(alpha * (a @ b) + bias) + residual``.

    Shapes as ``torch.matmul`` (1-D operands, batch dims broadcast); any strides, transposed views
    (``a.T``, ``b.T``) read in place. ``bias``: shape ``[N]``; ``residual``: broadcastable to the
    output; both of the output's dtype. ``activation``: None, 'relu', 'gelu', 'gelu_tanh', 'silu'.
    ``out_dtype``: the inputs' dtype (default) or float32 for float16/bfloat16 inputs.
    Accumulation and epilogue in fp32, one rounding to the output dtype. ``allow_tf32``: let fp32
    inputs use TF32 tensor cores (sm_80+; off by default, as torch). ``variant``: 'naive',
    'smem_tiled', 'register_tiled_vec4', 'warp_tiled', 'mma' (sm_80+), 'gemv' / 'gemv_mma'
    (M <= 16 rows per matrix; a batch sharing b folds into one GEMV while it stays within 16
    rows, else runs as a batch of GEMVs), 'wgmma' (Hopper sm_90a, float16/bfloat16, operands
    with a unit-stride dim, 16-byte aligned, other strides multiples of 8 elements: raises
    ValueError naming the operand otherwise), or None for the best for the device, dtype and
    shape.
    """
    return gemm(call, "matmul", a, b, bias=bias, activation=activation, residual=residual,
                alpha=alpha, out_dtype=out_dtype, variant=variant, allow_tf32=allow_tf32)


@register(family="gemm", reference=ref_linear,
          bench=BenchSpec(make_inputs=_linear_inputs,
                          torch_fn=lambda x, w, b: _torch().nn.functional.linear(x, w, b),
                          default_shape=_gemm_shape, flops=_flops_linear,
                          check_shape=_gemm_check_shape, extra_shapes=GEMM_SHAPES + DECODE_SHAPES))
def linear(call, x: Tensor, weight: Tensor, bias: Tensor | None = None,
           activation: str | None = None, *, variant: str | None = None,
           allow_tf32: bool = False) -> Tensor:
    """``act(x @ weight.T + bias)``, as ``torch.nn.functional.linear`` (+ activation), with
    torch's weight layout ``[out_features, in_features]`` read in place (no transposed copy).

    ``x``: ``[..., in_features]``; leading dims are folded into one GEMM. Decode-sized inputs
    (up to 16 rows) take the GEMV kernels, which read the weight once with 16-byte loads.
    ``variant``: as :func:`matmul`'s. Autograd: ``gpuops.torch.linear``.
    """
    _check_weight("linear", x.shape, weight.shape)
    return gemm(call, "linear", x, _transposed(weight), bias=bias, activation=activation,
                variant=variant, allow_tf32=allow_tf32)


@register(family="gemm", reference=ref_swiglu_linear,
          bench=BenchSpec(make_inputs=_swiglu_inputs, torch_fn=_swiglu_torch,
                          default_shape=lambda d: (4096, 4096, 4096),
                          flops=lambda a, o: 2 * _flops_linear(a, o),
                          compile_peer=True, check_shape=_gemm_check_shape,
                          extra_shapes=DECODE_SHAPES))
def swiglu_linear(call, x: Tensor, w_gate: Tensor, w_up: Tensor, *,
                  variant: str | None = None) -> Tensor:
    """SwiGLU's first half: ``silu(x @ w_gate.T) * (x @ w_up.T)``.

    Weights ``[hidden, in_features]`` (torch layout, same shape and strides); fp32 accumulation of
    both products. 'warp_tiled', 'mma', 'gemv' and 'gemv_mma' are one kernel that shares each tile
    of ``x`` between the two weights and never writes the products (silu and product in fp32, one
    rounding). 'wgmma' (Hopper, fp16/bf16) is two products: the gate is written once in the output
    dtype to a workspace (rounded there, as torch's ``silu(linear) * linear`` rounds it), and the
    up product's epilogue reads it and writes ``up * silu(gate)``; with few output tiles both
    products may run in K splits whose fp32 partials one reduce combines (no rounded gate).
    variant=None takes 'wgmma' on Hopper where the gate product fills half the GPU
    (SWIGLU_WGMMA_MIN_WAVES) or its K splits pay, 'gemv_mma' / 'gemv' for M <= 16, else 'mma'
    (sm_80+) or 'warp_tiled'.
    """
    _check_weight("swiglu_linear", x.shape, w_gate.shape, "w_gate")
    _check_weight("swiglu_linear", x.shape, w_up.shape, "w_up")
    if tuple(w_gate.shape) != tuple(w_up.shape) or tuple(w_gate.strides) != tuple(w_up.strides):
        raise ValueError("gpuops.swiglu_linear: 'w_gate' and 'w_up' must have the same shape and "
                         f"strides, got {tuple(w_gate.shape)}/{tuple(w_gate.strides)} and "
                         f"{tuple(w_up.shape)}/{tuple(w_up.strides)}")
    return gemm(call, "swiglu_linear", x, _transposed(w_gate), variant=variant,
                b2=_transposed(w_up))


@register(family="gemm", reference=ref_int8_matmul, dtypes=(dt.int8,),
          param_dtypes={"scale_a": (dt.float32,), "scale_b": (dt.float32,)})
def int8_matmul(call, a_int8: Tensor, b_int8: Tensor, scale_a: Tensor, scale_b: Tensor,
                out_dtype=None, *, variant: str | None = None) -> Tensor:
    """``(a_int8 @ b_int8) * scale_a[:, None] * scale_b[None, :]`` with exact int32 accumulation,
    for per-row (token) and per-column (channel) quantization.

    ``a_int8``: ``[M, K]``, ``b_int8``: ``[K, N]`` (fastest as ``W.t()`` of a ``[N, K]`` weight:
    both read along K with 16-byte loads); scales float32 with M and N elements, contiguous.
    ``out_dtype``: float32 (default), float16 or bfloat16. K must be at most 131,071 (int32 sums).
    ``variant``: 'dp4a' (``__dp4a``, sm_61+), 'mma' (int8 tensor cores, mma.m16n8k32, sm_80+),
    or None (mma where available).
    """
    M, N, K = _check_int8("int8_matmul", a_int8.shape, b_int8.shape, scale_a.shape, scale_b.shape)
    _check_variant("int8_matmul", variant, INT8_VARIANTS)
    out_dt = parse_dtype(out_dtype) or dt.float32
    if out_dt not in _FLOATS:
        raise ValueError(f"gpuops.int8_matmul: out_dtype={out_dt}; expected one of "
                         f"{dt.names(_FLOATS)}")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not t.contiguous:
            raise ValueError(f"gpuops.int8_matmul: {name!r} must be contiguous")
    if K > 131_071:     # int8 products reach (-128) * (-128) = 2^14: K * 2^14 must stay < 2^31
        raise ValueError(f"gpuops.int8_matmul: K = {K} could overflow the int32 sums "
                         "(128 * 128 * K >= 2^31)")
    cc = effective_arch(call.device)
    if variant is None:
        variant = "mma" if cc >= 80 else "dp4a"
    elif variant == "mma" and cc < 80:
        raise RuntimeError("gpuops.int8_matmul: variant='mma' uses int8 tensor cores of sm_80+; "
                           f"kernels here are built for sm_{cc}")
    out = call.empty((M, N), out_dt)
    if M == 0 or N == 0:
        return out
    p = _Plan()
    p.M, p.N, p.K = M, N, K
    p.a_sm, p.a_sk = a_int8.strides
    p.b_sk, p.b_sn = b_int8.strides
    p.r_sm = p.r_sn = 0
    p.batch, p.bshape, p.a_sb, p.b_sb, p.r_sb = 1, (1, 1, 1), (0, 0, 0), (0, 0, 0), (0, 0, 0)
    L = _Launch()
    L.a, L.b, L.c, L.sa, L.sb = a_int8.ptr, b_int8.ptr, out.ptr, scale_a.ptr, scale_b.ptr
    L.out_f32 = 1 if out_dt is dt.float32 else 0
    # both kernels read runs of 16 bytes along K; other layouts go element by element
    a_vec = (p.a_sk == 1 or K <= 1) and _aligned(a_int8.ptr, 1, 16, (p.a_sm,) if M > 1 else ())
    b_vec = (p.b_sk == 1 or K <= 1) and _aligned(b_int8.ptr, 1, 16, (p.b_sn,) if N > 1 else ())
    L.flags = A_KCONTIG | B_KCONTIG | (A_VEC if a_vec else 0) | (B_VEC if b_vec else 0)
    if variant == "mma":
        cfg = _mma_config(call.device, M, N, 1)
        bm, bn, wm, wn, _, _ = cfg
        _run(_kernels.get(MMA[dt.int8], _mma_expr(dt.int8, cfg, True, True, out=out_dt),
                          call.device), p, L, (_cdiv(M, bm) * _cdiv(N, bn), 1),
             (wm * wn * 32, 1, 1), call.stream, smem=_mma_smem(cfg))
    else:
        _run(_kernels.get(INT8, _kname("gemm_int8_dp4a", out_dt.ctype), call.device), p, L,
             (_cdiv(M, 128) * _cdiv(N, 128), 1), (256, 1, 1), call.stream)
    return out
