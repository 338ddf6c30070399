"""GroupNorm forward with a fused activation (the diffusion U-Net ResNet block's GroupNorm + SiLU).

Kernels: cuda_src/groupnorm/group_norm.cu and group_norm_resident.cu. fp32 math and statistics
for fp32/fp16/bf16 storage; statistics are numerically stable everywhere (exact two-pass over
registers, Welford, Chan's merge of partial (n, mean, M2), and sums shifted by one of the data's
own values; never E[x^2] - E[x]^2).

Layouts (how the kernel is chosen, all without a copy of the input):

* ``channels_last=False`` (default): ``input`` is [N, C, *spatial] as in torch.
  - C-contiguous (NCHW): the NCHW kernels.
  - strides of a contiguous [N, *spatial, C] (a torch tensor in ``torch.channels_last`` /
    ``channels_last_3d`` memory format, or an equivalent CuPy view): the channels-last kernels,
    and the output has the same strides (a torch result is again ``channels_last``).
* ``channels_last=True``: ``input`` is [N, *spatial, C] with the channels last in the shape (NumPy
  and CuPy arrays, which have no memory formats); C-contiguous ones take the channels-last kernels
  and the output is [N, *spatial, C].
* Any other strides: the input is first copied to C-contiguous (``gpuops.contiguous``'s kernels),
  and the output is C-contiguous.

Which kernels (NCHW):

* on chip: a group (hw a multiple of 16 bytes' worth of elements, 16-byte aligned pointers) of at
  most 8192 16-byte packs is read once into the registers of one block (8 packs per thread),
  normalized and written once. On sm_90 a group is split over a cluster of 2, 4 or 8 blocks,
  which exchange their partial statistics through distributed shared memory: so that the blocks
  fill every SM (the diffusion shape [2, 320, 64, 64] has only 64 groups: clusters of 4 make 256
  blocks of 20 KiB), slices stay at most 64 KiB (2-3 blocks per SM), and groups of up to 1 MiB
  still fit on chip.
* two passes otherwise (groups too large for the chip, unaligned rows, or clusters unavailable
  with a group too large for one block): per-chunk partial statistics into a workspace, then a
  second kernel that merges them and normalizes; x is read twice (the second time from L2 when it
  fits there).

Channels-last (auto, sm_80+ kernels):
* ``group_norm_nhwc_resident`` (groupnorm/group_norm_resident.cu) for fp32 and for 16-bit inputs
  larger than NHWC_COPY_MAX_BYTES, where the input fits in the grid's shared memory (~29 MB on an
  H100; C / VEC <= 512): each sample cut into runs of whole rows, one 512-thread block per SM
  holding its run, one-pass shifted statistics per group, the runs' (mean, M2) exchanged through
  a tagged flag per run, y written once. Runs 145-153: fp32 [2, 64, 64, 320] 13.8 us (18.1 before,
  torch.compile 15.2), fp32 [4, 32, 32, 1280] 23.6 (40.0, compile 40.0), bf16 [16, 32, 32, 640]
  24.7 (37.3, compile 30.9).
* ``group_norm_nhwc_spread`` (two blocks per SM) for 16-bit inputs of at most NHWC_COPY_MAX_BYTES
  (run 153: bf16 [2, 64, 64, 320] 12.5 us against the resident kernel's 12.4, [4, 32, 32, 1280]
  14.6 against 16.2).
* otherwise two passes (statistics per tile of rows x slab of whole groups' channels, then
  normalization), reading x twice; slabs wider than the kernels allow (more than 512 units of
  channels: 16-byte packs, or single elements when C or the pointers are not 16-byte multiples)
  are normalized through NCHW copies.

Auto (NCHW, ``AUTO_RULE`` = 4, measured in runs 116-126; benchmarks/notes_groupnorm_copy.md):
* ``group_norm_spread`` where the groups fit one wave (one block per SM, clusters of up to 8
  blocks per group on sm_90): 16-bit [2, 320, 64, 64] 7.4 us against 8.4 for the on-chip kernel;
* ``group_norm_stream`` where a group fits one block (<= 42 KiB) and there are more groups than
  one round of its persistent grid (two blocks per SM; each block's next group is copied into
  shared memory while the current one is normalized): 16-bit [16, 640, 32, 32] 15.6 us against
  18.7; with clusters it measured slower than the one-shot clusters, so auto does not use it there;
* ``group_norm_resident`` (``AUTO_RULE`` = 4, the default since run 124; its own module,
  groupnorm/group_norm_resident.cu) where neither of those applies and the whole input fits in
  the grid's shared memory (~32 MiB on an H100): the norms' "resident" plan, every group split
  into tiles over one 512-thread block per SM, x read once into shared memory, the groups'
  statistics exchanged between blocks, y written once: 16-bit [1, 256, 256, 256] 35.0 us against
  43.8 for the two-pass kernels (torch.compile 42.2-43.6), fp32 [4, 1280, 32, 32] 15.3 against
  22.8 (compile 23.1), runs 124-126; needs sm_80+ kernels (cp.async) for auto, runs anywhere
  when forced (``force_path`` = "resident");
* the on-chip kernels otherwise, except that blocks which would take a whole SM over several
  waves give way to the two-pass kernels (16-bit [1, 256, 256, 256] 43.7 us against 48.9);
* two passes for what fits none of these (shifted-sum statistics with 8 units in flight per
  thread in chunks of one round, then one tile per apply block, as a pointwise kernel): fp32
  [1, 256, 256, 256], 67 MB, 70.0 us against 86.4 for an earlier pair of kernels and
  torch.compile's 72.6 (run 131; L2 eviction hints measured slower, runs 127-129).
``AUTO_RULE`` = 3 is rule 4 without the resident kernel, 2 keeps round 2's rule (on chip wherever
a group fits; A/B timing). The spread and stream kernels run on every arch (clusters only on
sm_90) and take 16-byte aligned inputs with hw (NCHW) or C (channels-last) a multiple of 16
bytes; ``force_path`` = "spread" / "nhwc_spread" / "stream" forces them, ``spread_cluster`` sets
their cluster size (A/B timing); "nhwc_resident" forces the channels-last resident kernel (any
arch, where the input fits).
"""
from __future__ import annotations

import warnings
from math import gcd, prod

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.ops import copy as _copy
from gpuops.ops import norms as _norms
from gpuops.registry import register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

ONCHIP_PACKS = 8                    # 16-byte packs per thread of the on-chip kernels
CLUSTERS = (2, 4, 8)                # blocks per group on sm_90
ONCHIP_MAX_THREADS = 1024           # kOnchipThreads
ONCHIP_MAX_PACKS = ONCHIP_MAX_THREADS * ONCHIP_PACKS   # a whole group in one block (128 KiB)
CLUSTER_SLICE_PACKS = 4096          # slice per block when clusters split groups: 64 KiB, so that
#                                     2-3 blocks share an SM's registers
MIN_SLICE_PACKS = 128               # no cluster splits into slices smaller than 2 KiB
TWO_PASS_THREADS = 256              # kTwoPassThreads
UNROLL = 4                          # kUnroll: an NCHW apply tile is TWO_PASS_THREADS * UNROLL units
BLOCKS_PER_SM = 4                   # grid target of the channels-last two-pass kernels
NHWC_ROW_THREADS = 256              # threads of a channels-last block when a slab row is narrow
NHWC_MAX_THREADS = 512              # kNhwcMaxThreads
NHWC_SMEM_LIMIT = 32 * 1024         # per-channel statistics of one block (stats kernel)
MIN_SLAB_BYTES = 128                # channels-last slab rows of at least one 128-byte line
SPREAD_PACKS = 7                    # kSpreadPacks: 16-byte packs per thread (NCHW)
NHWC_SPREAD_ROWS = 6                # kNhwcRows: rows per thread (channels-last)
NHWC_SPREAD_THREADS = 896           # kNhwcSpreadThreads (72 registers): one block per SM
NHWC_SPREAD_PAIR_THREADS = 448      # two blocks per SM
SPREAD_MAX_THREADS = 1024           # kSpreadThreads: one block per SM
SPREAD_PAIR_THREADS = 512           # two blocks per SM (2 x 512 threads x 64 registers)
MIN_SPREAD_SLICE_PACKS = 256        # one-wave clusters do not split groups below 4 KB per block
STREAM_THREADS = 384                # kStreamThreads: group_norm_stream, two blocks per SM
STREAM_MAX_PACKS = STREAM_THREADS * SPREAD_PACKS    # a block's slice of a group (42 KiB)
SPREAD_COEF_OFFSET = 10 * 16        # kSpreadCoef (float4 units) in bytes
# Small channels-last inputs: up to this size auto takes, in 16-bit, nhwc_spread (rule 3, run
# 116) and not the resident kernel (runs 148-151), and where neither applies, NCHW copies rather
# than the two-pass NHWC kernels (run 13, [2, 64, 64, 320] bf16, 5.2 MB: 17.7 against 29.5 us:
# the copies stay in L2; every launch of the two-pass pair costs a graph node's fixed time).
NHWC_COPY_MAX_BYTES = 16 << 20

# Forcing a design (tests, A/B timing): None (auto), "onchip" (no clusters), "cluster2" /
# "cluster4" / "cluster8", "twopass" (NCHW), "nhwc" (channels-last two-pass kernels, at any
# size), "nhwc_copy" (channels-last through NCHW copies), "nhwc_resident" (below).
force_path: str | None = None
# Round 2 (group_norm_spread / group_norm_nhwc_spread; measured in run 116): force_path "spread"
# (NCHW) / "nhwc_spread" (channels-last) forces them; AUTO_SPREAD makes auto take them wherever
# they apply (A/B; AUTO_RULE 3 takes spread where it won, one wave).
# spread_cluster / spread_residency override their plan's cluster size / blocks per SM (A/B).
# "cluster2_1sm": the old cluster2 kernel with a shared-memory reservation that keeps a second
# block off each SM (tests the placement hypothesis of round 2 on the old code).
AUTO_SPREAD = False
# Round 3 (group_norm_stream, persistent; runs 117-119): force_path "stream" forces it (with
# spread_cluster as its cluster size); AUTO_STREAM makes auto take it where the groups need more
# than one round of the grid, also with clusters (A/B; AUTO_RULE 3 only without clusters).
AUTO_STREAM = False
# Auto's rule for NCHW: 2 = round 2's (the on-chip kernels wherever a group fits, else two-pass);
# 3 (default since run 119) = group_norm_stream where a group fits one block and the groups need
# more than one round of the grid, group_norm_spread where they fit one wave, two-pass instead of
# on-chip blocks that take a whole SM over several waves, else round 2's. Measured in runs
# 116-119 (benchmarks/notes_groupnorm_copy.md, "Round 3"): never slower than rule 2, and 11-16%
# faster at [2, 320, 64, 64] and [4, 1280, 32, 32] 16-bit (spread), [16, 640, 32, 32] 16-bit
# (stream) and [1, 256, 256, 256] 16-bit (two-pass). 4 (default since run 124) = rule 3 with
# group_norm_resident (round 4) taking the place of the on-chip and two-pass kernels wherever the
# input fits on chip (AUTO_RESIDENT below).
AUTO_RULE = 4
# Round 4 (group_norm_resident, groupnorm/group_norm_resident.cu: the norms' "resident" plan, x
# held on chip across the whole grid): force_path "resident" forces it where the input fits;
# AUTO_RESIDENT makes auto take it wherever it fits, also before the spread and stream kernels
# (A/B; run 124: slower there, e.g. [2, 320, 64, 64] bf16 10.9 vs 7.5 us, [16, 640, 32, 32] bf16
# 25.0 vs 15.3: its drains all run at the end of the launch, one 512-thread block per SM).
AUTO_RESIDENT = False
# Channels-last inputs that fit on chip (group_norm_nhwc_resident, groupnorm/group_norm_resident.cu:
# each sample cut into runs of whole rows over a grid of resident blocks, x read once into shared
# memory, the groups' statistics exchanged between blocks, y written once): auto takes it where it
# fits and its kernels copy asynchronously (sm_80+), except 16-bit inputs of at most
# NHWC_COPY_MAX_BYTES (nhwc_spread measured faster there); runs 145-151,
# benchmarks/notes_groupnorm_copy.md "Round 6". False keeps rule 4's channels-last choice (A/B).
# force_path "nhwc_resident" forces it (any arch); nhwc_resident_per_sm asks for more blocks per
# SM than its 1 (runs 145-146: 2 per SM slower everywhere; the kernel is now compiled for one
# 512-thread block per SM, 64-80 registers on sm_80+, so the occupancy calculator refuses 2).
AUTO_NHWC_RESIDENT = True
nhwc_resident_per_sm: int | None = None
NHWC_RESIDENT_THREADS = 512         # kNhwcResidentThreads
# group_norm_stream launches at most this many clusters (A/B; None: as many as are co-resident)
stream_clusters: int | None = None
spread_cluster: int | None = None
spread_residency: int | None = None
# Order of the two-pass apply kernels' blocks: "reverse" (the data the stats kernel read last, so
# still in L2, first) or "forward" (the stats kernel's order: over data larger than L2, LRU
# evicts each line just before the apply pass needs it). Part of the plans' key (A/B timing).
apply_order: str = "reverse"
# The NCHW two-pass pair (runs 127-131, notes_groupnorm_copy.md "Round 5" on): an earlier pair
# (Chan merges per unit, 4 units in flight; a grid-stride apply) measured 86.4 us at fp32
# [1, 256, 256, 256] against these kernels' 70.0 and was removed. Also tried and removed: L2
# eviction hints on x (a fraction kept evict_last by the stats kernel, evict_first in the apply
# kernel): plain loads measured faster at every size (68.1 against 72.1 us with the best keep).
STATS_UNROLL = 8                    # kStatsUnroll
STATS_BLOCKS_PER_SM = 4             # the NCHW stats kernel's launch bound
# The NCHW stats kernel's chunks: this many rounds of loads each (STATS_UNROLL units per thread a
# round), over as many waves as that takes, but at most STATS_MAX_CHUNKS per group (every apply
# block merges its group's partials). None: one wave of at most STATS_BLOCKS_PER_SM blocks per SM
# (A/B). Run 130: 1 round against one wave, fp32 [1, 256, 256, 256] 72.5 -> 70.3 us, fp32
# [8, 640, 64, 64] 90.4 -> 86.3, bf16 [1, 256, 256, 256] 35.5 -> 33.7.
STATS_CHUNK_ROUNDS: int | None = 1
STATS_MAX_CHUNKS = 64

ACTIVATIONS = {None: 0, "none": 0, "identity": 0, "silu": 1}

_ONCHIP_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32", "f32", "i32")
_NCHW_STATS_ARGS = ArgSpec("ptr", "ptr", "i32", "i32", "i32")
_NCHW_APPLY_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32",
                           "f32", "i32", "i32", "u32", "u32")
_NHWC_STATS_ARGS = ArgSpec("ptr", "ptr", "i32", "i32", "i32", "i32", "i32", "i32", "i32")
_NHWC_APPLY_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32",
                           "i32", "i32", "f32", "i32", "i32")
_SPREAD_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "3I", "f32", "i32")
_STREAM_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32", "3I", "f32",
                       "i32")
_RESIDENT_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32",
                         "i32", "3I", "f32", "i32")
_NHWC_RESIDENT_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32",
                              "i32", "i32", "f32", "i32")
_NHWC_SPREAD_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "i32", "i32", "i32", "i32", "i32", "i32",
                            "i32", "f32", "i32")


def _onchip_expr(d, packs, cluster):
    if cluster == 1:
        return f"gpuops::group_norm_onchip<{d.ctype}, {packs}>"
    return f"gpuops::group_norm_onchip_cluster<{d.ctype}, {packs}, {cluster}>"


def _spread_expr(kind, d, cluster):
    return f"gpuops::group_norm_{kind}<{d.ctype}, {cluster}>"


def _vecs(d):
    return (16 // d.itemsize, 1)


def _expr(kind, d, vec):
    return f"gpuops::group_norm_{kind}<{d.ctype}, {vec}>"


MODULE = KernelModule("norms.group_norm", "groupnorm/group_norm.cu", {
    **{_onchip_expr(d, ONCHIP_PACKS, s): _ONCHIP_ARGS for d in dt.FLOATS for s in (1, *CLUSTERS)},
    **{_expr("nchw_stats", d, v): _NCHW_STATS_ARGS for d in dt.FLOATS for v in _vecs(d)},
    **{_expr("nchw_apply", d, v): _NCHW_APPLY_ARGS for d in dt.FLOATS for v in _vecs(d)},
    **{_expr("nhwc_stats", d, v): _NHWC_STATS_ARGS for d in dt.FLOATS for v in _vecs(d)},
    **{_expr("nhwc_apply", d, v): _NHWC_APPLY_ARGS for d in dt.FLOATS for v in _vecs(d)},
    **{_spread_expr("spread", d, s): _SPREAD_ARGS for d in dt.FLOATS for s in (1, *CLUSTERS)},
    **{_spread_expr("nhwc_spread", d, s): _NHWC_SPREAD_ARGS for d in dt.FLOATS
       for s in (1, *CLUSTERS)},
    **{_spread_expr("stream", d, s): _STREAM_ARGS for d in dt.FLOATS for s in (1, *CLUSTERS)},
})
KERNELS = _copy.KernelCache(MODULE)


def _resident_expr(d):
    return f"gpuops::group_norm_resident<{d.ctype}, {16 // d.itemsize}, " \
           f"{_norms.ring_packs(_norms.LAYER_NORM, 16 // d.itemsize)}>"


def _nhwc_resident_expr(d):
    return f"gpuops::group_norm_nhwc_resident<{d.ctype}>"


# A module of its own: it builds on the norms' ring headers (norms/layer_norm_ring.cuh).
RESIDENT_MODULE = KernelModule("norms.group_norm_resident", "groupnorm/group_norm_resident.cu", {
    **{_resident_expr(d): _RESIDENT_ARGS for d in dt.FLOATS},
    **{_nhwc_resident_expr(d): _NHWC_RESIDENT_ARGS for d in dt.FLOATS}})
RESIDENT_KERNELS = _copy.KernelCache(RESIDENT_MODULE)
# The compiled-in cluster size of each kernel (the CPU emulator runs a cluster's blocks together).
CLUSTER_OF = {**{_onchip_expr(d, ONCHIP_PACKS, s): s for d in dt.FLOATS for s in (1, *CLUSTERS)},
              **{_spread_expr(k, d, s): s for k in ("spread", "nhwc_spread", "stream")
                 for d in dt.FLOATS for s in (1, *CLUSTERS)}}


def _cdiv(a, b):
    return -(-a // b)


_clusters_refused: dict = {}          # device -> the driver's error for a cluster launch


def _clusters_available(dev) -> bool:
    """sm_90+ and the module built for sm_90+ (GPUOPS_ARCH=61 on an H100 loads Pascal PTX), and
    the driver has not refused a cluster launch on this device."""
    return (device.device_info(dev).cc >= 90 and KERNELS.target_arch(dev) >= 90
            and dev not in _clusters_refused)


def _refuse_clusters(dev, exc):
    _clusters_refused[dev] = exc
    _plans.clear()
    warnings.warn(f"gpuops.group_norm: the driver refused a thread-block-cluster launch on "
                  f"device {dev} ({exc}); groups are no longer split over clusters there",
                  RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# Plans: which kernel and launch shape. Pure functions of sizes (tests check them on the CPU).

def plan_onchip(groups: int, group_packs: int, sms: int, clusters: bool, force=None):
    """(cluster size, slice packs, packs per thread, threads) of the on-chip kernel, or None when
    the group does not fit on chip."""
    if force == "onchip":
        clusters = False
    if force and force.startswith("cluster"):
        if not clusters:
            raise RuntimeError("gpuops.group_norm: clusters need sm_90 and kernels built for it")
        s = int(force[len("cluster"):])
        if _cdiv(group_packs, s) > ONCHIP_MAX_PACKS:
            return None
    elif clusters:
        # One wave (every group's blocks resident at once, one block per SM): the smallest
        # cluster whose slice fits one block. Measured (run 13, [2, 320, 64, 64]): 16-bit onchip
        # 8.2 us beat cluster2/4/8 (8.7-9.8), fp32 cluster2 9.5 us beat cluster4/8 (11.0 / 10.4):
        # larger clusters do not spread the work over more SMs (their blocks share SMs when the
        # registers allow, see notes_groupnorm_copy.md round 2), they only add a cluster barrier.
        s = 1
        while s < CLUSTERS[-1] and _cdiv(group_packs, s) > ONCHIP_MAX_PACKS:
            s *= 2
        if groups * s > sms:
            # Several waves: the rule measured only as auto so far ([8, 640, 64, 64], run 10):
            # slices small enough for 2-3 blocks per SM (one loads while another computes),
            # then more blocks per group while there are fewer blocks than SMs.
            s = 1
            while s < CLUSTERS[-1] and _cdiv(group_packs, s) > CLUSTER_SLICE_PACKS:
                s *= 2
            while (s < CLUSTERS[-1] and groups * s < sms
                   and _cdiv(group_packs, 2 * s) >= MIN_SLICE_PACKS):
                s *= 2
        if _cdiv(group_packs, s) > ONCHIP_MAX_PACKS:
            return None
    else:
        s = 1
        if group_packs > ONCHIP_MAX_PACKS:
            return None
    slice_packs = _cdiv(group_packs, s)
    threads = max(32, _cdiv(_cdiv(slice_packs, ONCHIP_PACKS), 32) * 32)
    return s, slice_packs, ONCHIP_PACKS, threads


def _round32(n):
    return max(32, _cdiv(n, 32) * 32)


def _spread_cluster(items, sms, clusters, fits, min_ok, cluster, residency, pair=False):
    """(cluster size, blocks per SM) of the spread kernels, or None. ``fits(S, residency)``: the
    block of cluster size S fits the threads allowed at that residency; ``min_ok(S)``: the slice
    is worth splitting S ways.

    One wave when it fits (the largest S with items * S <= SMs): one block per SM, so the grid
    covers the most SMs. Otherwise several waves: the smallest S whose block fits beside another
    (two per SM: one loads while the other computes); failing that the smallest that fits
    alone. ``pair``: the two-per-SM choice even where one wave would fit."""
    sizes = (1, *CLUSTERS) if clusters else (1,)
    if cluster is not None:
        if cluster not in sizes:
            raise RuntimeError(f"gpuops.group_norm: cluster size {cluster} unavailable here "
                               f"(clusters need sm_90 and kernels built for it)")
        return cluster, residency or (1 if items * cluster <= sms else 2)
    one_wave = [] if pair else [s for s in sizes
                                if items * s <= sms and fits(s, 1) and (s == 1 or min_ok(s))]
    if one_wave:
        return one_wave[-1], residency or 1
    for res in (2, 1):
        fitting = [s for s in sizes if fits(s, res)]
        if fitting:
            return fitting[0], residency or res
    return None


def plan_spread(groups: int, group_packs: int, sms: int, clusters: bool, cluster=None,
                residency=None):
    """(cluster size, slice packs, threads, blocks per SM) of group_norm_spread, or None when a
    group does not fit 8 clusters' blocks (_spread_cluster's rule; one-wave slices of at least
    MIN_SPREAD_SLICE_PACKS)."""
    def threads(s):
        return _round32(_cdiv(_cdiv(group_packs, s), SPREAD_PACKS))

    def fits(s, res):
        return threads(s) <= (SPREAD_MAX_THREADS if res == 1 else SPREAD_PAIR_THREADS)

    got = _spread_cluster(groups, sms, clusters, fits,
                          lambda s: _cdiv(group_packs, s) >= MIN_SPREAD_SLICE_PACKS, cluster,
                          residency)
    if got is None or not fits(*got):
        return None
    s, res = got
    return s, _cdiv(group_packs, s), threads(s), res


def plan_stream(groups: int, group_packs: int, sms: int, clusters: bool, cluster=None):
    """(cluster size, slice packs, threads, clusters launched) of group_norm_stream, or None when
    a group does not fit 8 blocks' slices. The smallest cluster size whose slice fits a block of
    STREAM_THREADS (two per SM, each with its slice in registers and the next one in shared
    memory); as many clusters as two blocks per SM allow, at most one per group."""
    sizes = (1, *CLUSTERS) if clusters else (1,)
    if cluster is not None:
        if cluster not in sizes:
            raise RuntimeError(f"gpuops.group_norm: cluster size {cluster} unavailable here "
                               f"(clusters need sm_90 and kernels built for it)")
        sizes = (cluster,)
    for s in sizes:
        slice_packs = _cdiv(group_packs, s)
        if slice_packs <= STREAM_MAX_PACKS:
            return (s, slice_packs, _round32(_cdiv(slice_packs, SPREAD_PACKS)),
                    max(1, min(groups, 2 * sms // s)))
    return None


def plan_nhwc_spread(n: int, hw: int, c: int, cg: int, vec: int, sms: int, clusters: bool,
                     cluster=None, residency=None, pair=False):
    """(slab channels, cluster size, rows per block, row phases R, threads, blocks per SM) of
    group_norm_nhwc_spread, or None. Slab = lcm(C/G, 16-byte units): the narrowest whole-group
    slab of 16-byte columns; one item = (sample, slab), its rows split over a cluster. Threads =
    columns x R (at most NHWC_SPREAD_ROWS rows each, 4 when the block has room for the threads).
    Cluster size and blocks per SM: _spread_cluster's rule."""
    sc = cg * vec // gcd(cg, vec)
    p = sc // vec
    if c % sc or p > NHWC_SPREAD_THREADS:
        return None

    def fit(s, res):
        max_threads = NHWC_SPREAD_THREADS if res == 1 else NHWC_SPREAD_PAIR_THREADS
        rpb = _cdiv(hw, s)
        r = max(_cdiv(rpb, NHWC_SPREAD_ROWS), min(max_threads // p, _cdiv(rpb, 4)))
        threads = _round32(p * r)
        return (rpb, r, threads) if threads <= max_threads else None

    got = _spread_cluster(n * (c // sc), sms, clusters, fit,
                          lambda s: _cdiv(hw, s) * p >= MIN_SPREAD_SLICE_PACKS, cluster, residency,
                          pair)
    shape = got and fit(*got)
    if not shape:
        return None
    return (sc, got[0], *shape, got[1])


def spread_smem(needed: int, residency: int, optin: int) -> int:
    """Dynamic shared memory of a spread launch: what the kernel uses, raised to just over
    1 / (residency + 1) of an SM so that no further block fits beside `residency` of them (the
    1 KB per block the driver keeps on sm_80+ counted); 0 past the opt-in limit (no launch)."""
    if needed > optin:
        return 0
    if optin < 96 * 1024:              # small shared memories (Pascal): no reservation
        return needed
    return min(optin, max(needed, (optin + 1024) // (residency + 1) + 1024))


def nhwc_resident_smem(c: int, g: int, vec: int, itemsize: int, chunk_rows: int,
                       threads: int = NHWC_RESIDENT_THREADS) -> int:
    """Dynamic shared memory of a group_norm_nhwc_resident block (the kernel's layout: channel
    means, three per-channel tables, two per-phase sums per channel, run means and per-group pairs
    as floats, rounded up to 16 bytes, then the run of chunk_rows rows)."""
    phases = threads // (c // vec)
    return 16 * _cdiv(4 * c + 2 * phases * c + 3 * g, 4) + chunk_rows * c * itemsize


def plan_nhwc_resident(n: int, hw: int, c: int, g: int, vec: int, itemsize: int, sms: int,
                       per_sm, optin: int, residency=None):
    """(chunks, chunk_rows, smem) of group_norm_nhwc_resident for [n, hw, c], or None where the
    input does not fit the grid's shared memory: every sample cut into `chunks` runs of
    `chunk_rows` whole rows (the last may be shorter), n * chunks blocks all resident at once,
    `residency` blocks per SM (None: 1). per_sm(smem): the occupancy calculator's blocks per SM of
    NHWC_RESIDENT_THREADS threads with that shared memory."""
    units = c // vec
    if units > NHWC_RESIDENT_THREADS or c % vec or hw < 1 or n < 1:
        return None
    res = residency or 1
    chunks = min(hw, sms * res // n)
    if chunks < 1:
        return None
    chunk_rows = _cdiv(hw, chunks)
    chunks = _cdiv(hw, chunk_rows)
    smem = nhwc_resident_smem(c, g, vec, itemsize, chunk_rows)
    if smem > optin or n * chunks > sms * per_sm(smem):
        return None
    return chunks, chunk_rows, smem


def plan_two_pass(groups: int, group_units: int, sms: int):
    """(chunks per group, chunk units) of group_norm_nchw_stats: chunks of STATS_CHUNK_ROUNDS
    rounds of loads, at most STATS_MAX_CHUNKS per group; with STATS_CHUNK_ROUNDS = None at most
    STATS_BLOCKS_PER_SM blocks per SM in all (one wave at its launch bound) unless the groups
    alone take more, and no chunk shorter than one round."""
    per_round = TWO_PASS_THREADS * STATS_UNROLL
    if STATS_CHUNK_ROUNDS:
        chunks = min(STATS_MAX_CHUNKS, _cdiv(group_units, STATS_CHUNK_ROUNDS * per_round))
    else:
        chunks = max(1, min((STATS_BLOCKS_PER_SM * sms) // groups,
                            _cdiv(group_units, per_round)))
    chunk_units = _cdiv(group_units, chunks)
    return _cdiv(group_units, chunk_units), chunk_units


def plan_nhwc(n: int, hw: int, c: int, cg: int, vec: int, itemsize: int, sms: int):
    """(slab channels, threads, slabs, tiles, tile rows) of the channels-last kernels, or None when
    even the narrowest slab (whole groups, a multiple of vec channels) is too wide for them."""
    limit = min(NHWC_MAX_THREADS, NHWC_SMEM_LIMIT // (8 * vec))   # units per slab row
    sc0 = cg * vec // gcd(cg, vec)
    if sc0 // vec > limit:
        return None
    sc = sc0
    k = c // sc0
    for m in range(1, k + 1):          # widen to >= one 128-byte line while the row stays short
        if k % m == 0 and sc0 * m // vec <= limit:
            sc = sc0 * m
            if sc * itemsize >= MIN_SLAB_BYTES:
                break
    p = sc // vec
    rs = max(1, NHWC_ROW_THREADS // p)
    threads = p * rs
    slabs = c // sc
    tiles = max(1, min(_cdiv(BLOCKS_PER_SM * sms, n * slabs), _cdiv(hw, rs), 1024))
    tile_rows = _cdiv(hw, tiles)
    return sc, threads, slabs, _cdiv(hw, tile_rows), tile_rows


# ---------------------------------------------------------------------------------------------
# Launchers: built once per device, dtype, sizes and alignment (cached with the op's plan), they
# take the pointers of one call and launch.

def _ptr(t):
    return 0 if t is None else t.ptr


def _with_cluster_fallback(dev, run, fallback):
    """run, or (once the driver refuses a cluster launch) fallback from then on."""
    def run_cluster(call, x, w, b, y, eps):
        try:
            run(call, x, w, b, y, eps)
        except Exception as exc:   # noqa: BLE001  (the launch itself failed: no clusters)
            _refuse_clusters(dev, exc)
            fallback(call, x, w, b, y, eps)
    return run_cluster


def _unless_clusters_refused(dev, got, refit):
    """got = (run, cluster size): run itself without clusters, else run until the driver refuses
    a cluster launch and refit() (the plan without clusters) from then on."""
    run, s = got
    return run if s == 1 else _with_cluster_fallback(dev, run, refit())


def _smem_optin(dev) -> int:
    return int(getattr(device.device_info(dev), "max_smem_per_block_optin", 0) or 0)


def _spread_launcher(dev, d, n, c, hw, g, act, clusters, one_wave=False):
    """(run, cluster size) of group_norm_spread for contiguous aligned [n, c, hw] with hw % VEC
    == 0, or None (with one_wave also where its plan takes more than one wave)."""
    vec = 16 // d.itemsize
    cg = c // g
    groups = n * g
    group_packs = cg * hw // vec
    # (a forced cluster size yields to the no-cluster fallback once clusters are refused)
    plan = plan_spread(groups, group_packs, _copy.sm_count(dev), clusters,
                       spread_cluster if clusters or spread_cluster == 1 else None,
                       spread_residency)
    if plan is None or (one_wave and (plan[3] != 1 or groups * plan[0] > _copy.sm_count(dev))):
        return None
    s, slice_packs, threads, res = plan
    ppc = hw // vec
    smem = spread_smem(SPREAD_COEF_OFFSET + 8 * (_cdiv(slice_packs, ppc) + 1), res,
                       _smem_optin(dev) or 48 * 1024)
    if smem == 0:
        return None
    expr = _spread_expr("spread", d, s)
    grid, block = (groups * s, 1, 1), (threads, 1, 1)
    tail = (g, cg, group_packs, slice_packs, *_copy.fast_divider(ppc))

    def run_spread(call, x, w, b, y, eps):
        KERNELS.get(dev, expr).launch(grid, block, call.stream, x.ptr, _ptr(w), _ptr(b), y.ptr,
                                      *tail, eps, act, smem=smem)
    return run_spread, s


def _stream_launcher(dev, d, n, c, hw, g, act, clusters):
    """(run, cluster size) of group_norm_stream for contiguous aligned [n, c, hw] with hw % VEC
    == 0, or None (no plan; under auto also when the groups fit one round of the grid, where it
    would be the spread kernel without its one-wave placement)."""
    vec = 16 // d.itemsize
    cg = c // g
    items = n * g
    group_packs = cg * hw // vec
    plan = plan_stream(items, group_packs, _copy.sm_count(dev), clusters,
                       spread_cluster if clusters or spread_cluster == 1 else None)
    if plan is None or (force_path is None and (plan[3] >= items or plan[0] > 1)):
        # auto: only where the grid takes the groups in several rounds, and only without
        # clusters (runs 117-119: with clusters of 4 / 8 it was slower than the one-shot
        # clusters, [8, 640, 64, 64] bf16 54.2 vs 43.5 us; without, faster: [16, 640, 32, 32]
        # 16-bit 15.6 vs 18.7 us)
        return None
    s, slice_packs, threads, launched = plan
    ppc = hw // vec
    needed = SPREAD_COEF_OFFSET + 16 * SPREAD_PACKS * threads + 8 * (_cdiv(slice_packs, ppc) + 1)
    smem = spread_smem(needed, 2, _smem_optin(dev) or 48 * 1024)
    if smem == 0:
        return None
    expr = _spread_expr("stream", d, s)
    block = (threads, 1, 1)
    if s > 1:
        # only as many clusters as can be resident together: a later one would start when an
        # earlier one has finished all its groups (run 117: 54 us instead of ~36 at [8, 640, 64,
        # 64] bf16 with 66 clusters of 4 asked for)
        query = getattr(KERNELS.get(dev, expr), "max_active_clusters", None)  # (emulator: none)
        resident = query and query((launched * s, 1, 1), block, smem)
        if resident:
            launched = min(launched, resident)
    if stream_clusters:
        launched = min(launched, stream_clusters)
    grid = (launched * s, 1, 1)
    tail = (g, cg, group_packs, slice_packs, items, *_copy.fast_divider(ppc))

    def run_stream(call, x, w, b, y, eps):
        KERNELS.get(dev, expr).launch(grid, block, call.stream, x.ptr, _ptr(w), _ptr(b), y.ptr,
                                      *tail, eps, act, smem=smem)
    return run_stream, s


def _resident_launcher(dev, d, n, c, hw, g, act):
    """run of group_norm_resident for contiguous aligned [n, c, hw] with hw % VEC == 0, or None
    where the input does not fit on chip (every tile of the grid held at once: norms.py
    fit_ring_plan / ring_grid with layer_norm's tiles)."""
    vec = 16 // d.itemsize
    cg = c // g
    rows, elems = n * g, cg * hw
    kernel = RESIDENT_KERNELS.get(dev, _resident_expr(d))
    ring = _norms.fit_ring_plan(kernel, _norms.LAYER_NORM, vec, elems, d.itemsize, dev,
                                "resident")
    grid = _norms.ring_grid(ring, rows)
    if grid is None:
        return None
    grid, block = (grid, 1, 1), (ring.threads, 1, 1)
    tail = (rows, elems, ring.C, ring.depth, g, cg, *_copy.fast_divider(hw // vec))
    words = rows * ring.C * 2

    def run_resident(call, x, w, b, y, eps):
        state = _norms.ring2_state(call, words)
        kernel.launch(grid, block, call.stream, x.ptr, y.ptr, _ptr(w), _ptr(b), state, *tail,
                      eps, act, smem=ring.smem)
    return run_resident


def _nchw_launcher(dev, d, n, c, hw, g, aligned, act, clusters=True):
    """run(call, x, w, b, y, eps) for x, y: contiguous [n, c, hw]."""
    vec = 16 // d.itemsize
    cg = c // g
    groups = n * g
    elems = cg * hw
    sms = _copy.sm_count(dev)
    aligned = aligned and hw % vec == 0
    rule3 = AUTO_RULE in (3, 4) and force_path is None
    # (auto takes the resident kernel only where it copies asynchronously: built for sm_80+)
    if aligned and (force_path == "resident" or (
            force_path is None and AUTO_RESIDENT and _norms.copies_async(RESIDENT_MODULE, dev))):
        run = _resident_launcher(dev, d, n, c, hw, g, act)
        if run is not None:
            return run
    if aligned and (force_path == "stream" or (force_path is None and (AUTO_STREAM or rule3))):
        got = _stream_launcher(dev, d, n, c, hw, g, act, clusters and _clusters_available(dev))
        if got is not None:
            return _unless_clusters_refused(dev, got, lambda: _nchw_launcher(
                dev, d, n, c, hw, g, aligned, act, clusters=False))
    if aligned and (force_path == "spread" or (force_path is None and (AUTO_SPREAD or rule3))):
        got = _spread_launcher(dev, d, n, c, hw, g, act, clusters and _clusters_available(dev),
                               one_wave=rule3 and not AUTO_SPREAD)
        if got is not None:
            return _unless_clusters_refused(dev, got, lambda: _nchw_launcher(
                dev, d, n, c, hw, g, aligned, act, clusters=False))
    if (aligned and AUTO_RULE == 4 and force_path is None and not AUTO_RESIDENT
            and _norms.copies_async(RESIDENT_MODULE, dev)):
        # rule 4: where neither a one-wave spread nor a multi-round stream plan exists, the
        # input held on chip by the resident kernel when it fits (run 124: [1, 256, 256, 256]
        # 16-bit 43.4 -> 34.7 us, [4, 1280, 32, 32] fp32 22.9 -> 15.3; where spread or stream
        # run it measured slower: 7.5 -> 10.9 us at [2, 320, 64, 64] bf16)
        run = _resident_launcher(dev, d, n, c, hw, g, act)
        if run is not None:
            return run
    if aligned and force_path != "twopass":
        clusters = clusters and force_path != "onchip" and _clusters_available(dev)
        onchip_force = force_path if force_path in ("onchip", "cluster2", "cluster4",
                                                    "cluster8") else None
        if force_path == "cluster2_1sm":
            onchip_force = "cluster2"
        plan = plan_onchip(groups, elems // vec, sms, clusters,
                           onchip_force if clusters or onchip_force == "onchip" else None)
        if (rule3 and plan is not None and plan[3] > ONCHIP_MAX_THREADS // 2
                and groups * plan[0] > sms):
            plan = None                # a whole SM per block over several waves: two-pass
        if plan is not None:
            s, slice_packs, packs, threads = plan
            expr = _onchip_expr(d, packs, s)
            grid, block = (groups * s, 1, 1), (threads, 1, 1)
            tail = (hw, cg, g, elems // vec, slice_packs)
            # cluster2_1sm: a reservation that keeps a second block off the SM
            smem = spread_smem(0, 1, _smem_optin(dev)) if force_path == "cluster2_1sm" else 0

            def run_onchip(call, x, w, b, y, eps):
                KERNELS.get(dev, expr).launch(grid, block, call.stream, x.ptr, _ptr(w), _ptr(b),
                                              y.ptr, *tail, eps, act, smem=smem)
            if s == 1:
                return run_onchip
            return _with_cluster_fallback(
                dev, run_onchip, _nchw_launcher(dev, d, n, c, hw, g, aligned, act, clusters=False))
    v = vec if aligned else 1
    group_units = elems // v
    chunks, chunk_units = plan_two_pass(groups, group_units, sms)
    tiles = _cdiv(group_units, TWO_PASS_THREADS * UNROLL)
    stats_expr, apply_expr = _expr("nchw_stats", d, v), _expr("nchw_apply", d, v)
    stats_grid, apply_grid = (groups * chunks, 1, 1), (groups * tiles, 1, 1)
    block = (TWO_PASS_THREADS, 1, 1)
    part_len = groups * chunks * 4
    apply_tail = (cg, g, group_units, tiles, chunks)
    reverse = int(apply_order == "reverse")
    per_channel = _copy.fast_divider(hw)[1:]        # (mul, shift): element in group -> channel

    def run_two_pass(call, x, w, b, y, eps):
        part = call.empty((part_len,), dt.float32)
        KERNELS.get(dev, stats_expr).launch(stats_grid, block, call.stream, x.ptr, part.ptr,
                                            group_units, chunk_units, chunks)
        KERNELS.get(dev, apply_expr).launch(apply_grid, block, call.stream, x.ptr, _ptr(w),
                                            _ptr(b), y.ptr, part.ptr, *apply_tail, eps, act,
                                            reverse, *per_channel)
    return run_two_pass


def _nhwc_resident_launcher(dev, d, n, c, hw, g, act):
    """run of group_norm_nhwc_resident for contiguous aligned [n, hw, c] with c % VEC == 0, or
    None where the input does not fit on chip (plan_nhwc_resident)."""
    vec = 16 // d.itemsize
    kernel = RESIDENT_KERNELS.get(dev, _nhwc_resident_expr(d))
    optin = max(48 * 1024, _smem_optin(dev))
    plan = plan_nhwc_resident(
        n, hw, c, g, vec, d.itemsize, _copy.sm_count(dev),
        lambda smem: _norms._resident_per_sm(kernel, NHWC_RESIDENT_THREADS, smem), optin,
        nhwc_resident_per_sm)
    if plan is None:
        return None
    chunks, chunk_rows, smem = plan
    grid, block = (n * chunks, 1, 1), (NHWC_RESIDENT_THREADS, 1, 1)
    tail = (hw, c, g, c // g, chunks, chunk_rows)
    words = n * chunks + n * g * chunks              # the runs' flags, then their (mean, M2) pairs

    def run_nhwc_resident(call, x, w, b, y, eps):
        state = _norms.ring2_state(call, words)
        kernel.launch(grid, block, call.stream, x.ptr, y.ptr, _ptr(w), _ptr(b), state, *tail,
                      eps, act, smem=smem)
    return run_nhwc_resident


def _nhwc_spread_launcher(dev, d, n, c, hw, g, act, clusters, pair=False):
    """group_norm_nhwc_spread for contiguous aligned [n, hw, c] with c % VEC == 0, or None
    (``pair``: plan_nhwc_spread's two-blocks-per-SM choice)."""
    vec = 16 // d.itemsize
    cg = c // g
    plan = plan_nhwc_spread(n, hw, c, cg, vec, _copy.sm_count(dev), clusters,
                            spread_cluster if clusters or spread_cluster == 1 else None,
                            spread_residency, pair)
    if plan is None:
        return None
    sc, s, rpb, rphases, threads, res = plan
    if (rpb + rphases) * c >= 1 << 31:
        return None                    # (the kernel's offsets within a block's rows are 32-bit)
    kg = sc // cg
    needed = 4 * (rphases * (sc + 1) + max(kg, threads // 32) + (4 + s) * kg)
    smem = spread_smem(needed, res, _smem_optin(dev) or 48 * 1024)
    if smem == 0:
        return None
    expr = _spread_expr("nhwc_spread", d, s)
    grid, block = (n * (c // sc) * s, 1, 1), (threads, 1, 1)
    tail = (hw, c, cg, sc, c // sc, rpb, rphases)

    def run_nhwc_spread(call, x, w, b, y, eps):
        KERNELS.get(dev, expr).launch(grid, block, call.stream, x.ptr, _ptr(w), _ptr(b), y.ptr,
                                      *tail, eps, act, smem=smem)
    if s == 1:
        return run_nhwc_spread
    return _with_cluster_fallback(dev, run_nhwc_spread,
                                  _nhwc_spread_launcher(dev, d, n, c, hw, g, act, False, pair)
                                  or _nhwc_two_pass_or_copy(dev, d, n, c, hw, g, act))


def _nhwc_two_pass_or_copy(dev, d, n, c, hw, g, act):
    return (_nhwc_launcher(dev, d, n, c, hw, g, True, act, spread=False)
            or _nhwc_via_nchw_launcher(dev, d, n, c, hw, g, act))


def _nhwc_launcher(dev, d, n, c, hw, g, aligned, act, spread=True):
    """run(call, x, w, b, y, eps) for x, y: contiguous [n, hw, c] in memory; None when the
    channels are too wide for the channels-last kernels (or small inputs go through NCHW
    copies)."""
    vec = 16 // d.itemsize
    # auto: the resident kernel where it copies asynchronously (built for sm_80+), for fp32, and
    # for 16-bit inputs larger than NHWC_COPY_MAX_BYTES: at 5-10 MB in 16-bit nhwc_spread below
    # stays faster (runs 148-150: 12.4-12.5 against 12.8-13.4 us at [2, 64, 64, 320] bf16,
    # 14.7-14.8 against 15.2-16.3 at [4, 32, 32, 1280])
    small16 = d.itemsize < 4 and n * hw * c * d.itemsize <= NHWC_COPY_MAX_BYTES
    if spread and aligned and c % vec == 0 and (force_path == "nhwc_resident" or (
            force_path is None and AUTO_NHWC_RESIDENT and AUTO_RULE == 4 and not AUTO_SPREAD
            and not small16 and _norms.copies_async(RESIDENT_MODULE, dev))):
        run = _nhwc_resident_launcher(dev, d, n, c, hw, g, act)
        if run is not None:
            return run
    if (spread and aligned and c % vec == 0
            and (force_path == "nhwc_spread" or (AUTO_SPREAD and force_path is None))):
        run = _nhwc_spread_launcher(dev, d, n, c, hw, g, act, _clusters_available(dev))
        if run is not None:
            return run
    if (spread and aligned and c % vec == 0 and AUTO_RULE in (3, 4) and force_path is None
            and n * hw * c * d.itemsize <= NHWC_COPY_MAX_BYTES):
        # small inputs: the spread kernel with two blocks of <= 448 threads per SM (run 116,
        # [2, 64, 64, 320]: bf16 12.5 us against 16.5 through NCHW copies, fp32 18.2 against
        # 25.0; its one-wave plan of 640-896 threads measured 19.6 / 21.7)
        run = _nhwc_spread_launcher(dev, d, n, c, hw, g, act, _clusters_available(dev),
                                    pair=True)
        if run is not None:
            return run
    if not (aligned and c % vec == 0):
        vec = 1
    cg = c // g
    plan = plan_nhwc(n, hw, c, cg, vec, d.itemsize, _copy.sm_count(dev))
    if plan is None or force_path == "nhwc_copy":
        return None
    if force_path is None and n * hw * c * d.itemsize <= NHWC_COPY_MAX_BYTES:
        return None                    # small: NCHW copies (see NHWC_COPY_MAX_BYTES)
    sc, threads, slabs, tiles, tile_rows = plan
    grid, block = (n * slabs * tiles, 1, 1), (threads, 1, 1)
    part_len = n * g * tiles * 4
    stats_expr, apply_expr = _expr("nhwc_stats", d, vec), _expr("nhwc_apply", d, vec)
    tail = (hw, c, cg, sc, slabs, tiles, tile_rows)
    stats_smem, apply_smem = 2 * threads * vec * 4, 2 * (sc // cg) * 4
    reverse = int(apply_order == "reverse")

    def run_nhwc(call, x, w, b, y, eps):
        part = call.empty((part_len,), dt.float32)
        KERNELS.get(dev, stats_expr).launch(grid, block, call.stream, x.ptr, part.ptr, *tail,
                                            smem=stats_smem)
        KERNELS.get(dev, apply_expr).launch(grid, block, call.stream, x.ptr, _ptr(w), _ptr(b),
                                            y.ptr, part.ptr, *tail, eps, act, reverse,
                                            smem=apply_smem)
    return run_nhwc


def _nhwc_via_nchw_launcher(dev, d, n, c, hw, g, act):
    """Channels-last through NCHW copies (slabs too wide for the channels-last kernels)."""
    inner = _nchw_launcher(dev, d, n, c, hw, g, True, act)

    def run_via_nchw(call, x, w, b, y, eps):
        xc = call.empty((n, c, hw), d)
        _copy.strided_copy(call, Tensor(x.ptr, (n, c, hw), (hw * c, 1, c), d, x.device, x.obj,
                                        x.numel, False), xc)
        yc = call.empty((n, c, hw), d)
        inner(call, xc, w, b, yc, eps)
        # y's memory is [n, hw, c]: a contiguous copy of yc seen as [n, hw, c]
        _copy.strided_copy(call, Tensor(yc.ptr, (n, hw, c), (c * hw, 1, hw), d, yc.device,
                                        yc.obj, yc.numel, False),
                           Tensor(y.ptr, (n, hw, c), (hw * c, c, 1), d, y.device, y.obj, y.numel,
                                  True))
    return run_via_nchw


# ---------------------------------------------------------------------------------------------
# Layout helpers

def _channels_last_perm(ndim):
    """Logical [N, C, *sp] -> memory order [N, *sp, C]."""
    return (0, *range(2, ndim), 1)


def _is_channels_last(shape, strides) -> bool:
    """Are these the strides of a contiguous [N, *sp, C] seen as [N, C, *sp]? (size-1 dims may
    have any stride, as in torch)"""
    expected = 1
    for axis in reversed(_channels_last_perm(len(shape))):
        if shape[axis] != 1 and strides[axis] != expected:
            return False
        expected *= shape[axis]
    return True


def _permuted(t: Tensor, perm) -> Tensor:
    """A view of t with its dimensions permuted (the framework object too)."""
    obj = t.obj.permute(*perm) if hasattr(t.obj, "permute") else t.obj.transpose(perm)
    return Tensor(t.ptr, tuple(t.shape[p] for p in perm), tuple(t.strides[p] for p in perm),
                  t.dtype, t.device, obj, t.numel, False)


def _check_activation(activation):
    try:
        return ACTIVATIONS[activation]
    except (KeyError, TypeError):
        raise ValueError(f"gpuops.group_norm: activation={activation!r}; expected one of "
                         f"{', '.join(repr(a) for a in ACTIVATIONS)}") from None


def _num_groups(num_groups) -> int:
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)):
        raise ValueError(f"gpuops.group_norm: num_groups must be a positive int, got "
                         f"{num_groups!r}")
    return int(num_groups)


def _check_args(shape, num_groups, channels_last, weight_shape, bias_shape):
    """(N, C, HW) of a valid call; errors name the argument."""
    if len(shape) < 2:
        raise ValueError(f"gpuops.group_norm: 'input' must have at least 2 dimensions "
                         f"([N, C, *spatial]), got shape {tuple(shape)}")
    if _num_groups(num_groups) < 1:
        raise ValueError(f"gpuops.group_norm: num_groups must be a positive int, got "
                         f"{num_groups!r}")
    c = shape[-1] if channels_last else shape[1]
    if c % num_groups:
        raise ValueError(f"gpuops.group_norm: the {c} channels of 'input' (dimension "
                         f"{-1 if channels_last else 1}) are not divisible by "
                         f"num_groups={num_groups}")
    for name, s in (("weight", weight_shape), ("bias", bias_shape)):
        if s is not None and tuple(s) != (c,):
            raise ValueError(f"gpuops.group_norm: {name!r} must have shape ({c},) (one value per "
                             f"channel), got {tuple(s)}")
    hw = prod(shape[1:-1]) if channels_last else prod(shape[2:])
    return shape[0], c, hw


# ---------------------------------------------------------------------------------------------
# Reference

def ref_group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, activation=None,
                   channels_last=False):
    act = _check_activation(activation)
    x = np.asarray(input, dtype=np.float64)
    _check_args(x.shape, num_groups, channels_last,
                None if weight is None else np.shape(weight), None if bias is None else np.shape(bias))
    if channels_last:
        x = np.moveaxis(x, -1, 1)
    n, c = x.shape[:2]
    g = x.reshape(n, num_groups, -1)
    mean = g.mean(axis=-1, keepdims=True)
    var = ((g - mean) ** 2).mean(axis=-1, keepdims=True)
    y = ((g - mean) / np.sqrt(var + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * np.asarray(weight, dtype=np.float64).reshape(per_channel)
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float64).reshape(per_channel)
    if act == 1:
        with np.errstate(all="ignore"):
            y = y / (1.0 + np.exp(-y))
    if channels_last:
        y = np.moveaxis(y, 1, -1)
    return y


# ---------------------------------------------------------------------------------------------
# Benchmarks. A shape whose last dimension is larger than its second is [N, H, W, C]: it is timed
# as a torch tensor in channels_last memory format (logical [N, C, H, W]).

def _is_nhwc_shape(shape):
    return len(shape) >= 3 and shape[-1] > shape[1]


def _make_group_norm(shape, d, randn):
    shape = tuple(shape)
    x = randn(shape, d)
    if _is_nhwc_shape(shape):
        perm = (0, len(shape) - 1, *range(1, len(shape) - 1))
        x = x.permute(*perm) if hasattr(x, "permute") else x.transpose(perm)
    c = x.shape[1]
    groups = 32 if c % 32 == 0 else 1
    return (x, groups, randn((c,), d), randn((c,), d)), {"activation": "silu"}


def _torch_group_norm(x, num_groups, weight, bias, activation=None):
    import torch.nn.functional as F  # noqa: PLC0415,N812
    y = F.group_norm(x, num_groups, weight, bias)
    return F.silu(y) if activation == "silu" else y


def _liger_group_norm():
    import torch.nn.functional as F  # noqa: PLC0415,N812
    from liger_kernel.ops.group_norm import LigerGroupNormFunction  # noqa: PLC0415

    def fn(x, num_groups, weight, bias, activation=None):
        y = LigerGroupNormFunction.apply(x, weight, bias, x.shape[1], num_groups, 1e-5)
        return F.silu(y) if activation == "silu" else y
    return {"liger": fn}


# ---------------------------------------------------------------------------------------------
# The op

_plans: dict = {}
MAX_CACHED_PLANS = 4096


@register(family="norms", reference=ref_group_norm,
          bench=BenchSpec(make_inputs=_make_group_norm, torch_fn=_torch_group_norm,
                          default_shape=lambda d: (2, 320, 64, 64), compile_peer=True,
                          extra_peers=_liger_group_norm,
                          extra_shapes=((8, 640, 64, 64), (4, 1280, 32, 32), (2, 64, 64, 320),
                                        (8, 64, 64, 640), (1, 256, 256, 256),
                                        (16, 640, 32, 32))))
def group_norm(call, input: Tensor, num_groups: int, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5, activation: str | None = None,
               channels_last: bool = False, *, out: Tensor | None = None) -> Tensor:
    """GroupNorm, as ``torch.nn.functional.group_norm``, with an optional fused activation:
    ``activation(((x - mean) / sqrt(var + eps)) * weight[c] + bias[c])`` with mean and biased
    variance over each sample's groups of C / num_groups channels and all spatial positions.

    ``activation``: None (or 'none') or 'silu' (diffusion ResNet blocks: GroupNorm then SiLU, in
    one pass). ``weight`` and ``bias`` have shape [C] (None: 1 and 0).

    Layout: ``input`` is [N, C, *spatial] (``channels_last=False``, the default), contiguous or in
    torch's ``channels_last`` memory format (detected from the strides, no copy; the result keeps
    the format); with ``channels_last=True`` it is [N, *spatial, C] (NumPy/CuPy NHWC arrays) and so
    is the result. Other strides are copied to contiguous first.

    fp32 statistics and math for every storage type, numerically stable (two-pass / Welford /
    Chan merges). ``out`` (optional) must have the layout the result would have; it may be
    ``input`` itself.
    """
    act = _check_activation(activation)
    if type(num_groups) is not int:
        num_groups = _num_groups(num_groups)
    key = (call.device, loader.generation, force_path, apply_order, STATS_BLOCKS_PER_SM,
           STATS_CHUNK_ROUNDS, STATS_MAX_CHUNKS, AUTO_SPREAD, AUTO_STREAM, AUTO_RULE,
           AUTO_RESIDENT, AUTO_NHWC_RESIDENT, nhwc_resident_per_sm, stream_clusters,
           spread_cluster, spread_residency, input.dtype, tuple(input.shape), tuple(input.strides), input.ptr % 16 == 0,
           num_groups, act, bool(channels_last),
           None if weight is None else (tuple(weight.shape), weight.contiguous),
           None if bias is None else (tuple(bias.shape), bias.contiguous),
           None if out is None else (tuple(out.shape), tuple(out.strides), out.ptr % 16 == 0))
    run = _plans.get(key)
    if run is None:
        run = _build(call.device, input, num_groups, weight, bias, act, bool(channels_last), out)
        if len(_plans) >= MAX_CACHED_PLANS:
            _plans.clear()
        _plans[key] = run
    return run(call, input, weight, bias, float(eps), out)


def _build(dev, input: Tensor, num_groups, weight, bias, act, channels_last, out):
    """Validate one kind of call and return run(call, input, weight, bias, eps, out) -> result."""
    d = input.dtype
    shape = tuple(input.shape)
    n, c, hw = _check_args(shape, num_groups, channels_last,
                           None if weight is None else weight.shape,
                           None if bias is None else bias.shape)
    g = int(num_groups)
    if (c // g) * hw >= 1 << 31:
        raise ValueError(f"gpuops.group_norm: a group of {(c // g) * hw} elements; at most 2^31 - 1")
    if channels_last:
        layout = "nhwc" if input.contiguous else "copy"
    elif input.contiguous:
        layout = "nchw"
    elif _is_channels_last(shape, input.strides):
        layout = "nhwc_strided"
    else:
        layout = "copy"
    if out is not None:
        _check_out_layout(out, shape, layout)
    empty = prod(shape) == 0

    # the result has the input's layout (C-contiguous after a copy)
    perm = _channels_last_perm(len(shape))
    if layout == "nhwc_strided":
        mem_shape = tuple(shape[p] for p in perm)
        inverse = tuple(perm.index(i) for i in range(len(shape)))
    x_aligned = layout == "copy" or input.ptr % 16 == 0
    y_aligned = out is None or out.ptr % 16 == 0
    nchw_memory = layout == "nchw" or (layout == "copy" and not channels_last)
    if empty:
        inner = None
    elif nchw_memory:
        inner = _nchw_launcher(dev, d, n, c, hw, g, x_aligned and y_aligned, act)
    else:
        inner = (_nhwc_launcher(dev, d, n, c, hw, g, x_aligned and y_aligned, act)
                 or _nhwc_via_nchw_launcher(dev, d, n, c, hw, g, act))
    copy_in = layout == "copy"

    def run(call, x, w, b, eps, out):
        if out is None:
            if layout == "nhwc_strided":
                y = _permuted(call.empty(mem_shape, d), inverse)
            else:
                y = call.empty(shape, d)
        else:
            _check_out_overlap(out, x, copy_in)
            y = out
        if inner is None:
            return y
        if w is not None and not w.contiguous:
            w = _contiguous_copy(call, w)
        if b is not None and not b.contiguous:
            b = _contiguous_copy(call, b)
        if copy_in:
            xc = call.empty(shape, d)
            _copy.strided_copy(call, x, xc)
            x = xc
        inner(call, x, w, b, y, eps)
        return y
    return run


def _contiguous_copy(call, t):
    dst = call.empty(tuple(t.shape), t.dtype)
    _copy.strided_copy(call, t, dst)
    return dst


def _check_out_layout(out: Tensor, shape, layout):
    if tuple(out.shape) != shape:
        raise ValueError(f"gpuops.group_norm: 'out' has shape {tuple(out.shape)}, the result has "
                         f"{shape}")
    if layout == "nhwc_strided":
        ok = _is_channels_last(shape, out.strides)
        what = "the strides of a channels-last tensor, as 'input'"
    else:
        ok = out.contiguous
        what = "C-contiguous"
    if not ok:
        raise ValueError(f"gpuops.group_norm: 'out' must be {what}")


def _check_out_overlap(out: Tensor, input: Tensor, copied: bool):
    lo, hi = out.span()
    a, b = input.span()
    if out.numel and a <= hi and lo <= b and not (
            not copied and out.ptr == input.ptr and tuple(out.strides) == tuple(input.strides)):
        raise ValueError("gpuops.group_norm: 'out' overlaps 'input' without being the same view; "
                         "in-place use must pass the identical array")
