"""Normalization ops: layer_norm, rms_norm and add_rms_norm (the residual add + RMSNorm of LLM
decoder layers, fused), forward and backward.

Kernels: cuda_src/norms/*.cu, on the row machinery of cuda_src/norms/norm_rows.cuh. A row
(``prod(normalized_shape)`` elements) is held in registers by one block (rows up to 8192-32768
elements: read once, written once), or by several blocks that exchange partial statistics through
global memory. Longer rows in the forward ops: one launch whose grid is resident at once; where
the rows fit on chip (e.g. [16, 2^20] bf16 on an H100), each block holds all its tiles at once
("resident": one exchange per launch), else its tiles of the rows pass through a ring of shared
memory until their rows' statistics are in (norm_ring.cuh: read once, written once;
``LONG_ROWS``); where neither fits, the split
kernels (one launch when a row's blocks fit at once, else two launches, the second reading the
row again). Long rows in the backward: blocks own column chunks over all the rows of their group
(``BACKWARD_LONG_ROWS``: a stats pass with dw / db, then one re-reading the rows for dx).
Statistics and all math are fp32 for fp32/fp16/bf16 storage; the variance is merged from (count,
mean, M2) triples (Welford/Chan), never E[x^2] - E[x]^2.

The ``*_forward`` ops also return the per-row statistics (fp32) that the ``*_backward`` ops take;
gpuops.torch builds autograd from them. Backward ops reduce grad_weight/grad_bias over rows
deterministically: in registers over a block's rows, then (where several blocks share columns)
per-block partial sums in a workspace summed by a second small kernel in a fixed order (no
atomics).
"""
from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass
from math import prod

import numpy as np

from gpuops import dispatch
from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.registry import get as _get_op
from gpuops.registry import register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.tensor import Tensor

# ---------------------------------------------------------------------------------------------
# Kernel modules

LN_FWD_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",
                      "i64", "i32", "i32", "i32", "f32")
RMS_FWD_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "ptr",
                       "ptr", "ptr", "i64", "i32", "i32", "i32", "f32")
BWD_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "ptr", "ptr", "ptr", "i64",
                   "ptr", "ptr", "ptr", "ptr", "ptr", "i64", "i32", "i32", "i32")
WGRAD_ARGS = ArgSpec("ptr", "ptr", "ptr", "ptr", "i32", "i32")
# The backward's long rows by columns (norm_backward.cu: norm_bwd_cols_stats, norm_bwd_row_sums,
# norm_bwd_cols_apply).
COLS_STATS_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "ptr", "ptr", "ptr", "ptr", "ptr",
                          "ptr", "ptr", "i64", "i32", "i32", "i64")
ROW_SUMS_ARGS = ArgSpec("ptr", "ptr", "i64", "i32")
COLS_APPLY_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "ptr", "ptr", "ptr",
                          "ptr", "i64", "i64", "i32", "i32", "i64")
# The ring2 kernels: the forward arguments with one `state` pointer for partials and counters.
LN_RING2_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "ptr", "ptr", "ptr", "ptr", "i64",
                        "i32", "i32", "i32", "f32")
# The stream kernels (norm_stream.cuh): layer_norm_stream (x, xs, y, ys, w, b, mean, rstd, rows,
# n, D, team, eps); rms_norm_stream (x, xs, r, rs, y, ys, h, hs, w, rstd, rows, n, D, team, eps).
LN_STREAM_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "ptr", "ptr", "ptr", "i64", "i32",
                         "i32", "i32", "f32")
RMS_STREAM_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "ptr",
                          "i64", "i32", "i32", "i32", "f32")
RMS_RING2_ARGS = ArgSpec("ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "i64", "ptr", "ptr",
                         "ptr", "i64", "i32", "i32", "i32", "f32")

FUSED, PARTIALS, APPLY = 0, 1, 2          # launch phases, as in norm_rows.cuh
MAX_N = (1 << 31) - (1 << 20)             # units are int32 in the kernels
WGRAD_BLOCK = (32, 16, 1)                 # norm_weight_grad: 32 columns x 16 slot lanes


@dataclass(frozen=True)
class Kind:
    """One kernel template and how rows are laid onto its blocks (see norm_rows.cuh).

    A row of ``units`` units (16-byte packs or elements) takes ``threads * packs >= units``:
    the smallest ``packs`` whose block has at most ``target`` threads, else the largest ``packs``
    with up to ``max_rows_threads`` threads; longer rows are split over blocks of
    ``split_threads`` threads. ``cap`` bounds packs * VEC (values per thread in registers, per
    array): the kernels run under __launch_bounds__(1024, 1), i.e. at most 64 registers.
    Split rows run in one launch when all their blocks fit on the device at once: with the
    pipelined ``split_template`` kernel (two buffers of ``split_cap`` values per thread) where
    there is one, else with ``template`` and phase kFused; otherwise in two launches of
    ``template`` (kPartials, kApply). The forward kinds also have a ``ring_template``
    (norm_ring.cuh), the first choice for split rows: tiles of up to ``ring_threads`` threads x
    ``ring_packs`` packs (2x as many single elements), which bounds its registers under
    __launch_bounds__(512, 2) (sm_70+; Pascal, whose tiles are 256 threads: (512, 1)).
    """
    name: str
    template: str          # format fields: t (C++ type), v (VEC), p (PACKS)
    cap: int
    target: int
    max_rows_threads: int
    split_threads: int
    warp_rows: bool        # blocks of 8 rows x 32 threads for short rows (forward kernels)
    persistent: bool       # a grid of at most one resident wave, looping over rows (backward)
    stats: int             # floats of a block's partial (row_split.cuh)
    split_template: str | None = None
    split_cap: int = 8
    ring_template: str | None = None
    ring_packs: int = 4
    ring_threads: int = 512
    ring2_template: str | None = None    # the same tiles, ring2's exchange (norm_ring.cuh)
    resident_template: str | None = None  # every tile of a block held at once (16-byte units)


LAYER_NORM = Kind("layer_norm", "gpuops::layer_norm_fwd<{t}, {v}, {p}>", 16, 256, 1024, 256,
                  True, False, 3, "gpuops::layer_norm_split<{t}, {v}, {p}>",
                  ring_template="gpuops::layer_norm_ring<{t}, {v}, {p}>",
                  ring2_template="gpuops::layer_norm_ring2<{t}, {v}, {p}>",
                  resident_template="gpuops::layer_norm_resident<{t}, {v}, {p}>")
RMS_NORM = Kind("rms_norm", "gpuops::rms_norm_fwd<{t}, {v}, {p}, false>", 16, 256, 1024, 256,
                True, False, 1, "gpuops::rms_norm_split<{t}, {v}, {p}, false>",
                ring_template="gpuops::rms_norm_ring<{t}, {v}, {p}, false>",
                ring2_template="gpuops::rms_norm_ring2<{t}, {v}, {p}, false>",
                resident_template="gpuops::rms_norm_resident<{t}, {v}, {p}>")
# (x and r in flight: half the packs per tile)
ADD_RMS_NORM = Kind("add_rms_norm", "gpuops::rms_norm_fwd<{t}, {v}, {p}, true>", 16, 256, 1024,
                    256, True, False, 1, "gpuops::rms_norm_split<{t}, {v}, {p}, true>",
                    ring_template="gpuops::rms_norm_ring<{t}, {v}, {p}, true>", ring_packs=2,
                    ring2_template="gpuops::rms_norm_ring2<{t}, {v}, {p}, true>")
LAYER_NORM_BWD = Kind("layer_norm_bwd", "gpuops::norm_bwd<{t}, {v}, {p}, true>", 8, 512, 1024,
                      512, False, True, 2)
RMS_NORM_BWD = Kind("rms_norm_bwd", "gpuops::norm_bwd<{t}, {v}, {p}, false>", 8, 512, 1024, 512,
                    False, True, 1)
# What launches use; tests replace entries (e.g. tiny split_threads) to reach every path cheaply.
TUNING = {k.name: k for k in (LAYER_NORM, RMS_NORM, ADD_RMS_NORM, LAYER_NORM_BWD, RMS_NORM_BWD)}
# Tests set this to run split rows in two launches even where one would do.
FORCE_TWO_LAUNCHES = False
# Split rows run in one launch only when all their rows fit in at most this many resident waves
# of the grid (rows <= waves * capacity // C). Past that the one-launch grid walks the rows a few
# at a time, each step a device-wide arrive/merge/release/wait chain over C blocks with little
# data in flight (run 6, [16, 1048576] bf16: C = 512, one row per step, ~5.7 us a row, 25% of
# copy); two launches (partials, then apply re-reading the rows, last-read first, from L2) keep
# the whole device streaming. None: the old rule (one launch whenever C <= capacity).
ONE_LAUNCH_MAX_WAVES = 1
# Split rows of the forward ops (one pass over memory where a ring fits, norm_ring.cuh; the split
# rules below where it does not):
#   "ring2"      self-validating partials (no memset, no atomics), tiles through registers one
#                ahead: ring2_rows. Runs 22 and 34: best where each block holds one tile
#                ([8, 393216]: bf16 rms 6.7 us vs ring 9.3, layer 10.3 vs 13.7, add 9.5 vs 12.5)
#   "ring"       counters zeroed by a memset, the row's last block merges: ring_rows. Runs 22 and
#                34: best where blocks hold several tiles ([16, 1M], 4 each: layer_norm fp32 73.4
#                us vs ring2 106.3; every draining warp of ring2 merges the row's C partials
#                itself, which costs more as C and the tiles per block grow), but for rms_norm
#                bf16 (ring2 31.1 us vs 34.8)
#   "resident"   every tile of a block held at once (resident_rows: all copies issued at the
#                start by cp.async into up to 7 slots of 32 KB, one more tile in registers; each
#                tile published as it lands, ring2's words; then every drain): one exchange per
#                launch. Where the rows fit on chip (grid * (slots + 1) tiles: [16, 1M] bf16 on
#                an H100, 128 blocks x 8 tiles), for layer_norm and rms_norm on 16-byte units;
#                elsewhere what "auto" picks. (notes_norms.md, "resident")
#   "split"      the run-6 plans only (ONE_LAUNCH_MAX_WAVES, FORCE_TWO_LAUNCHES)
#   "auto"       (default since run 34) "resident" where the rows fit on chip and the module
#                runs cp.async (sm_80+ builds): the fastest plan at every shape it covers in
#                run 102 ([8, 393216]: rms bf16 7.5 us vs ring2 7.7, fp32 9.3 vs 12.7;
#                layer_norm bf16 10.9 vs 11.7, fp32 14.7 vs ring 19.7; [16, 1M] bf16: rms 31.4
#                vs 32.3, layer_norm 42.7 vs ring 43.7); else ring2 on 16-byte units where every
#                block of its grid holds one tile, or for rms_norm / add_rms_norm (one word per
#                partial) with C <= 64 partials per row; else ring (run 34's rule, its best plan
#                at each of its 12 long-row shapes; add_rms_norm joined the C <= 64 rule after
#                runs 100-102: bf16 [8, 393216], C = 48, ring2 10.2-10.4 us vs ring 12.4-12.7).
# All stay selectable for A/B runs (benchmarks/experiments/norms_long_rows.py). (A fifth plan,
# ring2's exchange with the tiles copied into the ring by cp.async several tiles ahead, was
# slower at every shape in run 34 and was removed: benchmarks/notes_norms.md.)
LONG_ROWS = "auto"
AUTO_RING2_MAX_C = 64
# Split rows of the backward (rows longer than one block of norm_bwd holds: > 8192 elements):
#   "columns"  (default) blocks own column chunks over all the rows of their group
#              (norm_backward.cu: norm_bwd_cols_*): dw / db and the rows' partial sums in one
#              streaming pass, the rows' sums, then dx re-reading the rows last-read-first
#              (from L2 where they still are); no per-row meeting of blocks, no [slots, n]
#              workspace where one group of rows covers the device. Run 82: 2.0-4.9x faster
#              than split at [16, 1048576], [8, 393216], [64, 65536]; 1.08-1.29x at [4096, 16384]
#              (run 84: the row sums folded into the apply kernel and 3 blocks/SM were slower:
#              notes_norms.md)
#   "split"    norm_bwd with C blocks per row (one launch where they fit at once, else kPartials
#              and kApply); run 72 at [16, 1048576]: 22-35% of copy (rms_norm bf16 139.9 us)
BACKWARD_LONG_ROWS_PLANS = ("columns", "split")
BACKWARD_LONG_ROWS = "columns"
COLS_THREADS = 256          # kColsThreads of norm_backward.cu
COLS_ROWS = 4               # kColsRows: rows per step of a block
LONG_ROWS_PLANS = ("auto", "resident", "ring2", "ring", "split")
# Whole rows of layer_norm (one block per row, 16-byte units; e.g. [*, 4096]): which kernel.
#   "per_row"    layer_norm_fwd: x raw in registers, w and b loaded with it (up to 2 packs), one
#                exchange; 56 registers at 4096 bf16, 4 blocks/SM: 205.9 us in run 21 (86.8%).
#   "two_pass"   layer_norm_two_pass: the kernel of runs 11-14 (x as floats, a block sum for the
#                mean, then one of squared deviations, w and b pack by pack after them); 48
#                registers, 5 blocks/SM: ~185-189 us then (94.7%, 0.97x Liger).
#   "compact"    layer_norm_compact (at most 2 packs, <= 256 threads): x raw, one exchange, w and
#                b pack by pack after the statistics, __launch_bounds__(256, 8): 32 registers,
#                8 blocks/SM (64 KB of rows in flight per SM instead of 40).
# Where an option does not apply (warp rows, split rows, single elements, too many packs or
# threads), layer_norm_fwd runs. All stay selectable for A/B runs (benchmarks/experiments/
# norms_long_rows.py --plans per_row,two_pass,compact --skip-long); predictions:
# notes_norms.md. Run 22, [32768, 4096] bf16 (Liger 180.1 us): compact 181.9 us (98.3% of copy),
# two_pass 182.0, per_row 206.0 (and "persistent", layer_norm_rows, 214.5 / 215.9 in runs 21-22:
# removed); fp32 all within 0.3% of Liger (compact falls back to layer_norm_fwd there). compact was
# the default until run 77 ("auto" below).
# Whole rows of rms_norm / add_rms_norm whose grid fits in one wave (decode-sized calls, e.g.
# [16, 2048]): rms_norm_rows (w loaded with x and held, no row loop; bit-equal to rms_norm_fwd)
# instead of rms_norm_fwd. Tests switch it off to reach rms_norm_fwd at small sizes.
DECODE_ROWS = True
# ... for grids of at most this many waves of the plan's blocks (None: every row count; it has
# no row loop, a block per row: Liger's structure, w loaded with x); "auto": every row count
# where rows_kernel_applies, else 1.
ROWS_MAX_WAVES = "auto"
# "auto" (run 77): two_pass where the grid fits in one wave, else compact; fp32 two_pass at every
# row count (run 159, H200, [rows, n] of 537 MB: two_pass 258.4 us at n = 2048 against compact's
# 268.4, 258.2 at 8192 against layer_norm_fwd's 293.0, level at 4096). At [16, 2048] (PDL
# chain, run 76) two_pass 1.69 us bf16 / 1.91 fp32 against compact's 1.91 / 2.30 (two plain block
# sums cost less latency than compact's one exchange of Chan merges); at [32768, 4096] bf16
# (run 77) compact 180.1 us, two_pass 180.8.
#   "lean"       layer_norm_lean (at most 2 packs): Liger's structure (w and b loaded with x, no
#                row loop; run 159's ncu: compact was issue-bound), the statistics in one exchange
#                of shifted sums for 16-bit rows of two packs (lean_one_exchange; "lean_two": two
#                plain block sums, as fp32 and one pack always)
WHOLE_ROWS_PLANS = ("auto", "per_row", "two_pass", "compact", "lean", "lean_two")
# __launch_bounds__(256, 6) of layer_norm_lean's one-exchange instance (40 registers on sm_90:
# 6 blocks per SM against the two-sum instance's 5 at 47); wider blocks take the two-sum one
LEAN_ONE_EXCHANGE_MAX_THREADS = 256
# Whole rows past one wave (layer_norm_lean, which "auto" runs only there, and rms_norm_rows'
# untriggered instance): two 16-byte packs per thread in half the threads where the plan gives
# one pack to blocks of >= 128 threads (wide_rows_shape); False: the plan's shape (A/B runs).
WIDE_ROWS = True
WHOLE_ROWS = "auto"
RING_MAX_DEPTH = 8          # ring slots per block, at most
RESIDENT_MAX_DEPTH = 7      # "resident": its header holds 8 tiles' statistics (norm_ring.cuh)
RING_HEADER_BYTES = 512     # kRingHeaderBytes of norm_ring.cuh
# Whole rows of layer_norm, rms_norm and add_rms_norm on 16-byte units, streamed through shared
# memory (norm_stream.cuh: a team of warps per row, each team's next depth - 1 rows in flight by
# cp.async while it works on one; for GPUs whose bandwidth per SM outruns what register-landed
# rows keep in flight: H200 run 154, layer_norm bf16 [32768, 4096] 77% of copy, Liger 91%):
#   "auto"  where the module copies asynchronously (sm_80+), stream_auto_applies (the op,
#           dtype and width where it measured faster), a configuration fits in shared memory,
#           and every team of the grid gets at least STREAM_MIN_ROWS rows (below that the
#           per-block parameter copy and the pipeline's fill are not paid back)
#   "on"    wherever it fits (any arch; tests), "off" never.
STREAM_ROWS_PLANS = ("auto", "on", "off")
STREAM_ROWS = "auto"
STREAM_MIN_ROWS = 4


def stream_auto_applies(kind_name: str, itemsize: int, n: int) -> bool:
    """Where "auto" streams: measured on the H200 (runs 156-159, 537 MB per call at n = 1024,
    2048, 4096, 8192, against every per-block kernel; benchmarks/notes_norms.md). The stream
    kernels ran at 81-92% of copy at every width, the best per-block kernel at 72-100%: 16-bit
    layer_norm at every width but 1024-4096 (1.0-1.7x the per-block kernels; there
    layer_norm_lean was faster, runs 162-170: lean_auto_applies), fp32 layer_norm below 1024 (at
    1024 290.7 us against compact's 403.2; since run 172 layer_norm_lean at two packs per thread
    there: lean_auto_applies), 16-bit rms_norm below 1024 (at 1024 rms_norm_rows has been faster
    since it has no PDL trigger: rows_kernel_applies). Elsewhere a per-block kernel was faster
    (WHOLE_ROWS); never add_rms_norm (its per-block kernel: 96-100%). Run 186 (H200, bf16, Liger in
    the same run): at 512 the stream plan stays the fastest (layer_norm 146.4 us against lean's
    161.6 and Liger's 201.6; rms_norm 153.3 against rms_norm_rows' 161.1 and 166.7); at 768 the
    per-block kernels are (layer_norm_lean 142.8 against 152.3, Liger 168.2; rms_norm_rows 133.2
    against 144.9, Liger 145.1): 16-bit rms_norm streams below 768, layer_norm where lean does
    not apply. Run 187 (fp32, Liger in the same run): at 512 and 768 layer_norm_lean at two packs
    per thread beat the stream plan (lean_auto_applies); run 188 also at 384 (274.5 us against
    286.2, Liger 293.0), not at 256 (320.9 against 297.8): fp32 layer_norm streams below 1024
    where lean does not apply (below 384)."""
    if kind_name == "layer_norm":
        return ((itemsize == 2 or (itemsize == 4 and n < 1024))
                and not lean_auto_applies(itemsize, n))
    if kind_name == "rms_norm":
        return itemsize == 2 and n < 768
    return False


def lean_auto_applies(itemsize: int, n: int) -> bool:
    """Where WHOLE_ROWS "auto" runs layer_norm_lean past one wave: 16-bit rows of 1024 to 4096
    elements (run 162, H200, bf16 / fp16: [65536, 2048] 150.9 / 151.5 us against the stream
    plan's 157.6 / 157.8 and Liger's 148.3 / 146.1; [32768, 4096] 141.2 / 141.6 against 154.1 /
    152.9 and 140.6 / 140.2, 133.4 / 132.9 since the one-exchange instance (run 163); at 1024
    142.7 against the stream plan's 154.4 once the kernel has no PDL trigger (runs 165, 167,
    169; run 170: 142.4, Liger 141.0; at two packs per thread since run 173, wide_rows_shape:
    128.6 at 1024 and 129.7 at 2048, Liger 142.5 / 147.7); at 8192 the stream plan, 151.8
    against 173.0); fp32 rows of 1024 to 2048 (run 172: [65536, 2048] 255.3 us against
    two_pass's 260.0 and Liger's 257.8; [131072, 1024] 288.0 against the stream plan's 290.0 at
    one pack per thread, 253.3 at two (run 173), Liger 256.5); fp32 4096 and 8192 keep two_pass
    (its 4 packs: lean holds 2). 16-bit from 768 (run 186: [174763, 768] bf16 142.8 us against the
    stream plan's 152.3 and Liger's 168.2; at 512 the stream plan's 146.4 beat lean's 161.6).
    fp32 from 384 (run 187, two packs per thread: [262144, 512] 252.1 us against the stream
    plan's 296.0 and Liger's 267.9; [174763, 768] 252.6 against 295.4 and 261.7; run 188,
    [349525, 384] at one pack: 274.5 against 286.2 and 293.0; at 256 the stream plan's 297.8
    beat lean's 320.9)."""
    if itemsize == 4:
        return 384 <= n <= 2048
    return itemsize == 2 and 768 <= n <= 4096


def lean_one_exchange(option: str, itemsize: int, packs: int, threads: int) -> bool:
    """Whether layer_norm_lean runs its one-exchange instance: under "lean", for 16-bit rows of
    two packs per thread in blocks of <= 256 threads, where its 40 registers give 6 blocks per
    SM instead of 5 (run 163, H200, [32768, 4096]: 133.4 us bf16 / 132.9 fp16 against the
    two-sum instance's 139.9 / 140.5). At one pack both fit 8 blocks of 256 threads in 32
    registers and the two sums ran faster ([65536, 2048]: 148.6 / 149.9 against 151.7 / 152.8:
    x converted twice, the shifted sums' extra work), at 1024 the same (160.7-160.9); since run
    173 rows of 1024 and 2048 run at two packs too (wide_rows_shape), on this instance."""
    return (option == "lean" and itemsize == 2 and packs == 2
            and threads <= LEAN_ONE_EXCHANGE_MAX_THREADS)


def wide_rows_shape(threads: int, packs: int) -> tuple:
    """(threads, packs) of a whole-row kernel past one wave, from the plan's: under WIDE_ROWS,
    half the threads at two packs where the plan has one pack in blocks of >= 128 threads (the
    same units covered; the half stays a whole number of warps). Measured on the H200 (runs
    172-173, CUDA-graph replay, Liger in the same run): a block of one 16-byte load per thread
    spends most of its life waiting on that load and on its reductions, so the SM keeps half the
    bytes in flight that two packs give. fp32 [131072, 1024] layer_norm_lean 253.3 us against
    287.9 at 256 x 1 (Liger 256.5), rms_norm_rows 254.2 against 269.8 (Liger 256.5); bf16
    [131072, 1024] (64 x 2 against 128 x 1) layer_norm 128.6 against 144.1 (Liger 142.5),
    rms_norm 128.3 against 134.0 (133.3); bf16 [65536, 2048] (128 x 2 against 256 x 1) 129.7
    against 150.1 (147.7) and 128.9 against 139.3 (139.1)."""
    if WIDE_ROWS and packs == 1 and threads >= 128 and threads % 64 == 0:
        return threads // 2, 2
    return threads, packs


def rows_kernel_applies(kind_name: str, itemsize: int, n: int) -> bool:
    """Where ROWS_MAX_WAVES "auto" runs rms_norm_rows (a block per row, w loaded with x: Liger's
    structure) at every row count: rms_norm in 16-bit from 1024 (run 159, H200: [32768, 4096]
    bf16 127.9 us against rms_norm_fwd's 139.4 and Liger's 129.6; 2048 137.1 against 162.7;
    8192 132.2 against 173.8; 1024 133.0 against the stream plan's 142.0 once the kernel has no
    PDL trigger, runs 165-169; run 170: 132.7, Liger 132.4) and in fp32 to 1024 (266.1 against
    307.4; fp32 2048 was 2% slower than rms_norm_fwd: 261.6 against 255.2 at two packs, run 176);
    add_rms_norm above 1024 to 2048 (run 176, at two packs per thread, wide_rows_shape: [65536,
    2048] bf16 254.6 us against rms_norm_fwd's 256.6, fp32 519.7 against 527.3, Liger 255.1 /
    528.7; level at 1024, 0.4-0.5% slower at 4096 and 8192 in bf16). Run 186 (H200): 16-bit
    add_rms_norm at 512 253.5 us against rms_norm_fwd's 316.3 (Liger 260.9), level at 768
    (254.3 / 254.4): rms_norm_rows from 512 below 1024; 16-bit rms_norm from 768 (133.2 against
    the stream plan's 144.9, Liger 145.1). fp32 at 512-768 level with rms_norm_fwd (not
    changed). Run 188 (H200, Liger in the same run): 16-bit add_rms_norm at 384 253.6 us against
    rms_norm_fwd's 421.1 (Liger 283.0): from 384; fp32 at 256 504.4 against 631.1 (Liger 512.2),
    level at 384 (506.3 / 503.3): fp32 rows of 256 to 384 too (at 256 in 16-bit rms_norm_fwd ran
    at copy speed, 252.8 us)."""
    if kind_name == "add_rms_norm":
        return ((itemsize == 2 and 384 <= n < 1024) or (itemsize == 4 and 256 <= n <= 384)
                or 1024 < n <= 2048)
    if kind_name != "rms_norm":
        return False
    return n >= 768 if itemsize == 2 else n <= 1024


# (warps per row, teams per block, stages per team) of the stream plan: None picks
# (stream_config); ints force one for A/B runs (benchmarks/experiments/norms_stream.py).
STREAM_TEAM = None
STREAM_TEAMS = None
STREAM_DEPTH = None
# stream_config's aims: this many bytes of loads in flight per SM, then this many warps per SM.
STREAM_INFLIGHT = 128 * 1024
STREAM_WARPS_AIM = 32


def _vec_width(d) -> int:
    return 16 // d.itemsize


def packs_options(kind: Kind, vec: int) -> tuple:
    """The PACKS values instantiated for a kind and unit width."""
    if vec == 1:       # a unit per element costs its own address and predicate: half the cap
        return (1, min(8, kind.cap // 2))
    return tuple(p for p in (1, 2, 4, 8) if p * vec <= kind.cap)


def split_packs(kind: Kind, vec: int) -> int:
    """PACKS of the pipelined split kernel (per buffer)."""
    return max(1, kind.split_cap // vec) if vec > 1 else kind.split_cap // 2


def ring_packs(kind: Kind, vec: int) -> int:
    """PACKS of the ring kernel: 16-byte packs, or twice as many single elements."""
    return kind.ring_packs if vec > 1 else 2 * kind.ring_packs


def _exprs(kind: Kind) -> dict:
    return {(d, v, p): kind.template.format(t=d.ctype, v=v, p=p)
            for d in dt.FLOATS for v in (_vec_width(d), 1) for p in packs_options(kind, v)}


def _split_exprs(kind: Kind) -> dict:
    if kind.split_template is None:
        return {}
    return {(d, v): kind.split_template.format(t=d.ctype, v=v, p=split_packs(kind, v))
            for d in dt.FLOATS for v in (_vec_width(d), 1)}


def _ring_exprs(kind: Kind, template: str | None, widths=(None, 1)) -> dict:
    """(dtype, vec) -> the kernel of `template`, at 16-byte units (None) and single elements."""
    if template is None:
        return {}
    return {(d, v): template.format(t=d.ctype, v=v, p=ring_packs(kind, v))
            for d in dt.FLOATS for v in (w or _vec_width(d) for w in widths)}


_EXPRS = {k.name: _exprs(k) for k in TUNING.values()}
# The other whole-row kernels of WHOLE_ROWS (16-byte units): layer_norm_two_pass at every PACKS
# of layer_norm_fwd, layer_norm_compact (<= 256 threads, 8 blocks/SM) at PACKS <= 2.
_TWO_PASS_EXPRS = {(d, _vec_width(d), p):
                   f"gpuops::layer_norm_two_pass<{d.ctype}, {_vec_width(d)}, {p}>"
                   for d in dt.FLOATS for p in packs_options(LAYER_NORM, _vec_width(d))}
_COMPACT_EXPRS = {(d, _vec_width(d), p):
                  f"gpuops::layer_norm_compact<{d.ctype}, {_vec_width(d)}, {p}>"
                  for d in dt.FLOATS for p in (1, 2)}
COMPACT_MAX_THREADS = 256                 # __launch_bounds__(256, 8) of layer_norm_compact
# layer_norm_lean at (dtype, vec, packs, full, one): full when every thread's packs lie inside
# the row; one: the statistics in one exchange of shifted sums (lean_one_exchange: 16-bit at two
# packs only; "lean_two": two block sums, the run-162 kernel, for A/B runs)
_LEAN_EXPRS = {(d, _vec_width(d), p, full, one):
               f"gpuops::layer_norm_lean<{d.ctype}, {_vec_width(d)}, {p}, "
               f"{'true' if full else 'false'}, {'true' if one else 'false'}>"
               for d in dt.FLOATS for p in (1, 2) for full in (False, True)
               for one in ((False, True) if d.itemsize == 2 and p == 2 else (False,))}
# rms_norm_rows (norms/rms_norm.cu): the decode-sized whole rows of rms_norm / add_rms_norm, at the
# (dtype, vec, packs) of rms_norm_fwd's plans on 16-byte units (single elements keep rms_norm_fwd:
# an add_rms_norm fp32 instance of 8 elements per thread spilled under the 64-register cap).
# Keyed (dtype, vec, packs, trigger): PDL's trigger in the one-wave instance only (grids of many
# waves: common/pdl.cuh pdl_start_untriggered).
_ROWS_EXPRS = {k: {(*key, trig): f"gpuops::rms_norm_rows<{key[0].ctype}, {key[1]}, {key[2]}, "
                                 f"{'true' if k == 'add_rms_norm' else 'false'}, "
                                 f"{'true' if trig else 'false'}>"
                   for key in _EXPRS[k] if key[1] > 1 for trig in (False, True)}
               for k in ("rms_norm", "add_rms_norm")}
_SPLIT_EXPRS = {k.name: _split_exprs(k) for k in TUNING.values()}
_RING_EXPRS = {k.name: _ring_exprs(k, k.ring_template) for k in TUNING.values()}
_RING2_EXPRS = {k.name: _ring_exprs(k, k.ring2_template) for k in TUNING.values()}
_RESIDENT_EXPRS = {k.name: _ring_exprs(k, k.resident_template, (None,)) for k in TUNING.values()}
# The stream kernels (norm_stream.cuh: whole rows, a warp per row, landing in shared memory),
# 16-byte units only: kind -> dtype -> kernel.
_STREAM_EXPRS = {
    "layer_norm": {d: f"gpuops::layer_norm_stream<{d.ctype}, {_vec_width(d)}>" for d in dt.FLOATS},
    **{k: {d: f"gpuops::rms_norm_stream<{d.ctype}, {_vec_width(d)}, {add}>" for d in dt.FLOATS}
       for k, add in (("rms_norm", "false"), ("add_rms_norm", "true"))}}
_WGRAD_EXPRS = {d: f"gpuops::norm_weight_grad<{d.ctype}>" for d in dt.FLOATS}
_COLS_EXPRS = {(layer, d, v): tuple(f"gpuops::norm_bwd_cols_{step}<{d.ctype}, {v}, "
                                    f"{'true' if layer else 'false'}>"
                                    for step in ("stats", "apply"))
               for layer in (True, False) for d in dt.FLOATS for v in (_vec_width(d), 1)}
_ROW_SUMS_EXPRS = {K: f"gpuops::norm_bwd_row_sums<{K}>" for K in (1, 2)}

LAYER_NORM_MODULE = KernelModule(
    "norms.layer_norm", "norms/layer_norm.cu",
    {**{e: LN_FWD_ARGS for table in (_EXPRS, _SPLIT_EXPRS, _RING_EXPRS)
        for e in table["layer_norm"].values()},
     **{e: LN_FWD_ARGS for table in (_TWO_PASS_EXPRS, _COMPACT_EXPRS, _LEAN_EXPRS)
        for e in table.values()},
     **{e: LN_RING2_ARGS for table in (_RING2_EXPRS, _RESIDENT_EXPRS)
        for e in table["layer_norm"].values()},
     **{e: LN_STREAM_ARGS for e in _STREAM_EXPRS["layer_norm"].values()}}, pdl=True)
RMS_NORM_MODULE = KernelModule(
    "norms.rms_norm", "norms/rms_norm.cu",
    {**{e: RMS_FWD_ARGS for table in (_EXPRS, _SPLIT_EXPRS, _RING_EXPRS, _ROWS_EXPRS)
        for k in ("rms_norm", "add_rms_norm") for e in table[k].values()},
     **{e: RMS_RING2_ARGS for table in (_RING2_EXPRS, _RESIDENT_EXPRS)
        for k in ("rms_norm", "add_rms_norm") for e in table[k].values()},
     **{e: RMS_STREAM_ARGS for k in ("rms_norm", "add_rms_norm")
        for e in _STREAM_EXPRS[k].values()}}, pdl=True)
BACKWARD_MODULE = KernelModule(
    "norms.backward", "norms/norm_backward.cu",
    {**{e: BWD_ARGS for k in ("layer_norm_bwd", "rms_norm_bwd") for e in _EXPRS[k].values()},
     **{e: WGRAD_ARGS for e in _WGRAD_EXPRS.values()},
     **{e: COLS_STATS_ARGS for e, _ in _COLS_EXPRS.values()},
     **{e: COLS_APPLY_ARGS for _, e in _COLS_EXPRS.values()},
     **{e: ROW_SUMS_ARGS for e in _ROW_SUMS_EXPRS.values()}}, pdl=True)
_MODULE_OF = {"layer_norm": LAYER_NORM_MODULE, "rms_norm": RMS_NORM_MODULE,
              "add_rms_norm": RMS_NORM_MODULE, "layer_norm_bwd": BACKWARD_MODULE,
              "rms_norm_bwd": BACKWARD_MODULE}


# ---------------------------------------------------------------------------------------------
# Launch plans: block shape, PACKS, blocks per row, resident capacity; cached per row length.

@dataclass
class Plan:
    kernel: object
    block: tuple
    packs: int
    C: int               # blocks per row
    capacity: int        # blocks of this kernel and block size resident at once on the device
    fallback: object = None   # split rows that do not fit at once: the two-launch Plan
    kind: object = None       # the Kind it was made for


def _threads(units: int, packs: int) -> int:
    """Threads (a multiple of 32) for `units` units at `packs` per thread."""
    per_thread = -(-units // packs)
    return max(32, -(-per_thread // 32) * 32)


def plan_shape(kind: Kind, vec: int, n: int):
    """(threads, rows per block, packs, blocks per row) of `template` for rows of n elements."""
    units = n // vec
    options = packs_options(kind, vec)
    for packs in options:
        threads = _threads(units, packs)
        if threads <= kind.target:
            break
    else:
        packs = options[-1]
        threads = _threads(units, packs)
    C = 1
    if threads > kind.max_rows_threads:
        threads = kind.split_threads
        C = -(-units // (threads * packs))
    ty = 8 if kind.warp_rows and threads == 32 and C == 1 else 1
    return threads, ty, packs, C


def cols_grid(units: int, rows: int, target: int):
    """(chunks, grid_x, groups, rows_per_group) of the backward's column plan: chunks of
    COLS_THREADS units; where they fill `target` blocks (the resident capacity) on their own,
    one group of all the rows and a grid over the chunks balanced to at most `target` blocks
    (each taking the same number of chunks, but the last ones); else one block per chunk and
    groups of rows (a multiple of COLS_ROWS each) to fill the capacity."""
    chunks = -(-units // COLS_THREADS)
    if chunks >= target:
        per_block = -(-chunks // target)
        return chunks, -(-chunks // per_block), 1, rows
    steps = -(-rows // COLS_ROWS)
    groups = max(1, min(steps, target // chunks))
    rows_per_group = -(-steps // groups) * COLS_ROWS
    return chunks, chunks, -(-rows // rows_per_group), rows_per_group


def split_shape(kind: Kind, vec: int, n: int):
    """(threads, packs, blocks per row) of the pipelined `split_template` kernel."""
    packs = split_packs(kind, vec)
    return kind.split_threads, packs, -(-(n // vec) // (kind.split_threads * packs))


_plans: dict = {}
_plans_generation = -1


def _make_plan(kind_name: str, expr: str, threads: int, ty: int, packs: int, C: int, dev: int):
    kernel = loader.load(_MODULE_OF[kind_name], dev).kernel(expr)
    per_sm = loader.blocks_per_sm(kernel, threads * ty)
    return Plan(kernel, (threads, ty, 1), packs, C, per_sm * device.device_info(dev).sm_count)


def _fresh_plans():
    """Drops the cached plans (their kernels) when the loader has reloaded its modules."""
    global _plans_generation
    if _plans_generation != loader.generation:
        _plans.clear()
        _plans_generation = loader.generation


def _plan(kind_name: str, dtype, vec: int, n: int, dev: int) -> Plan:
    _fresh_plans()
    kind = TUNING[kind_name]
    key = (kind_name, dtype, vec, n, dev)
    plan = _plans.get(key)
    if plan is None or plan.kind is not kind:     # (tests replace TUNING entries)
        threads, ty, packs, C = plan_shape(kind, vec, n)
        plan = _make_plan(kind_name, _EXPRS[kind_name][(dtype, vec, packs)], threads, ty, packs,
                          C, dev)
        if C > 1 and kind.split_template is not None:
            threads, packs, C = split_shape(kind, vec, n)
            split = _make_plan(kind_name, _SPLIT_EXPRS[kind_name][(dtype, vec)], threads, 1,
                               packs, C, dev)
            split.fallback = plan
            plan = split
        plan.kind = kind
        _plans[key] = plan
    return plan


@dataclass
class ColsPlan:
    """The backward's long rows by columns: its three kernels and the launch shape."""
    stats: object
    sums: object
    apply: object
    chunks: int
    grid_x: int
    groups: int
    rows_per_group: int


def _cols_plan(layer: bool, dtype, vec: int, n: int, rows: int, dev: int) -> ColsPlan:
    _fresh_plans()
    key = ("columns", layer, dtype, vec, dev)
    hit = _plans.get(key)
    if hit is None:
        module = loader.load(BACKWARD_MODULE, dev)
        stats_expr, apply_expr = _COLS_EXPRS[(layer, dtype, vec)]
        stats = module.kernel(stats_expr)
        target = loader.blocks_per_sm(stats, COLS_THREADS) * device.device_info(dev).sm_count
        hit = _plans[key] = (stats, module.kernel(_ROW_SUMS_EXPRS[2 if layer else 1]),
                             module.kernel(apply_expr), target)
    stats, sums, apply, target = hit
    return ColsPlan(stats, sums, apply, *cols_grid(n // vec, rows, target))


def _grid(plan: Plan, rows: int, persistent: bool):
    """(plan, grid size, phases) of a launch over `rows` rows (rows >= 1)."""
    C = plan.C
    if C == 1:
        if persistent:
            return plan, min(rows, plan.capacity), (FUSED,)
        return plan, min(-(-rows // plan.block[1]), (1 << 31) - 1), (FUSED,)
    if C <= plan.capacity and not FORCE_TWO_LAUNCHES and (
            ONE_LAUNCH_MAX_WAVES is None
            or rows <= ONE_LAUNCH_MAX_WAVES * (plan.capacity // C)):
        return plan, C * min(rows, plan.capacity // C), (FUSED,)   # co-resident: one launch
    plan = plan.fallback or plan
    C = plan.C
    slots = max(1, min(rows, 4 * plan.capacity // C, ((1 << 31) - 1) // C))
    return plan, C * slots, (PARTIALS, APPLY)


@dataclass
class RingPlan:
    """A ring kernel (norm_ring.cuh) for one row length: C tiles of threads x packs units per
    row, `depth` slots of shared memory per block (`smem` bytes), `capacity` blocks resident;
    `variant` "ring", "ring2" or "resident" (the kernel)."""
    kernel: object
    threads: int
    packs: int
    C: int
    depth: int
    smem: int
    capacity: int
    kind: object = None
    variant: str = "ring"


def ring_shape(kind: Kind, vec: int, n: int, itemsize: int, max_threads: int | None = None):
    """(threads, packs, tiles per row C, bytes of a tile) of the ring kernel for rows of n: C from
    tiles of ring_threads (or max_threads) threads, then the fewest threads (a multiple of 32)
    whose C tiles still cover the row, so that a row's last tile is not mostly empty."""
    units = n // vec
    packs = ring_packs(kind, vec)
    C = max(1, -(-units // ((max_threads or kind.ring_threads) * packs)))
    threads = max(32, -(-(-(-units // (C * packs))) // 32) * 32)
    return threads, packs, C, threads * packs * (16 if vec > 1 else itemsize)


def _resident_per_sm(kernel, threads: int, smem: int) -> int:
    """Blocks of `kernel` resident per SM with `smem` bytes of dynamic shared memory each (0 where
    none fits). The kernel's limit is raised first, and its carveout preference set to the most
    shared memory: the ring's co-residency must not depend on the driver's L1/shared split."""
    raw = getattr(kernel, "raw", None)
    if raw is not None:
        if smem > 48 * 1024:
            kernel._raise_smem_limit(smem)
        try:
            raw.preferred_shared_memory_carveout = 100
        except Exception:  # noqa: BLE001  (a hint; older drivers/CuPy lack it)
            pass
    try:
        return loader.blocks_per_sm(kernel, threads, smem)
    except RuntimeError:           # (the calculator's 0: this much shared memory does not fit)
        return 0


def _ring_plan(kind_name: str, dtype, vec: int, n: int, dev: int, variant: str = "ring"):
    """The RingPlan of a row length (cached), or None where no block of 2+ slots fits: two blocks
    per SM with the most slots that allow it (one streams while the other synchronizes), else
    one; blocks of ring_threads threads, else half as many (smaller tiles: Pascal's 48 KiB).
    variant: "ring", "ring2" or "resident" (the kernel; the tiles are the same; "resident" is
    compiled for one block per SM and takes the most slots of one)."""
    kind = TUNING[kind_name]
    exprs = {"ring": _RING_EXPRS, "ring2": _RING2_EXPRS,
             "resident": _RESIDENT_EXPRS}[variant][kind_name]
    if (dtype, vec) not in exprs:
        return None
    key = (variant, kind_name, dtype, vec, n, dev, RING_MAX_DEPTH)
    hit = _plans.get(key)
    if hit is not None and hit[0] is kind:
        return hit[1]
    kernel = loader.load(_MODULE_OF[kind_name], dev).kernel(exprs[(dtype, vec)])
    plan = fit_ring_plan(kernel, kind, vec, n, dtype.itemsize, dev, variant)
    _plans[key] = (kind, plan)
    return plan


def fit_ring_plan(kernel, kind: Kind, vec: int, n: int, itemsize: int, dev: int,
                  variant: str = "ring"):
    """The RingPlan of `kernel` (a ring kernel with `kind`'s tiles) for rows of n, or None where
    no block of 2+ slots fits (see _ring_plan; also group_norm's resident kernel)."""
    info = device.device_info(dev)
    limit = max(48 * 1024, info.max_smem_per_block_optin)
    tries = [kind.ring_threads] + [t for t in (256, 128) if t < kind.ring_threads]
    for max_threads in tries:
        threads, packs, C, tile_bytes = ring_shape(kind, vec, n, itemsize, max_threads)
        for per_sm in (1,) if variant == "resident" else (2, 1):
            top = RING_MAX_DEPTH if variant != "resident" else min(RING_MAX_DEPTH,
                                                                     RESIDENT_MAX_DEPTH)
            for depth in range(top, 1, -1):
                smem = RING_HEADER_BYTES + depth * tile_bytes
                if smem > limit:
                    continue
                fit = _resident_per_sm(kernel, threads, smem)
                if fit >= per_sm:
                    return RingPlan(kernel, threads, packs, C, depth, smem, fit * info.sm_count,
                                    kind, variant)
    return None


def ring_grid(ring, rows: int):
    """Blocks of a ring launch over `rows` rows, or None when it cannot run: at most `capacity`
    (all resident), tiles spread evenly, no block holding more than `depth` tiles of one row
    (norm_ring.cuh: forward progress; "resident": no block holding more than depth + 1 tiles in
    all, its slots and one in registers), and fewer than 2^31 tiles (32-bit tile indices)."""
    if ring is None:
        return None
    tiles = rows * ring.C
    per_block = -(-tiles // ring.capacity)
    grid = -(-tiles // per_block)
    if tiles > (1 << 31) - 1:                                      # (tile indices are int32)
        return None
    if ring.variant == "resident":
        return grid if per_block <= ring.depth + 1 else None
    return None if -(-ring.C // grid) > ring.depth else grid


def _decode_rows_plan(kind_name: str, plan: Plan, dtype, vec: int, rows: int, dev: int,
                      n: int | None = None):
    """The Plan of rms_norm_rows for `rows` whole rows of the shape of `plan` (an rms_norm_fwd
    plan; n: the row length, for ROWS_MAX_WAVES "auto"), or None where rms_norm_fwd runs:
    DECODE_ROWS off, single-element units, split or warp rows, or more rows than ROWS_MAX_WAVES
    waves of the one-wave instance's blocks (the plan's shape; past one wave the instance without
    PDL's trigger runs, at wide_rows_shape)."""
    threads = plan.block[0]
    if not DECODE_ROWS or vec == 1 or plan.C != 1 or plan.block[1] != 1 or threads <= 32:
        return None
    if rows > (1 << 31) - 1:                    # (a block per row)
        return None
    one_wave = _rows_instance(kind_name, dtype, vec, plan.packs, threads, True, dev)
    if rows <= one_wave.capacity:               # (decode-sized: PDL's trigger)
        return one_wave
    waves = ROWS_MAX_WAVES
    if waves == "auto":
        waves = None if n is not None and rows_kernel_applies(kind_name, dtype.itemsize, n) else 1
    # (waves of the plan's shape: the wide instance's smaller blocks fit more per SM)
    if waves is not None and rows > waves * one_wave.capacity:
        return None
    wide_threads, wide_packs = wide_rows_shape(threads, plan.packs)
    return _rows_instance(kind_name, dtype, vec, wide_packs, wide_threads, False, dev)


def _rows_instance(kind_name: str, dtype, vec: int, packs: int, threads: int, trigger: bool,
                   dev: int) -> Plan:
    """The Plan of one rms_norm_rows instance (with or without PDL's trigger), made once."""
    key = ("rows", kind_name, dtype, vec, packs, threads, trigger, dev)
    hit = _plans.get(key)
    if hit is None:
        hit = _plans[key] = _make_plan(kind_name,
                                       _ROWS_EXPRS[kind_name][(dtype, vec, packs, trigger)],
                                       threads, 1, packs, 1, dev)
    return hit


def _whole_rows_plan(plan: Plan, dtype, vec: int, dev: int, rows: int = 1,
                     n: int | None = None):
    """The Plan of the WHOLE_ROWS kernel for `rows` rows of n elements (the length of `plan`, a
    layer_norm_fwd plan), or None where layer_norm_fwd runs: "per_row", split or warp rows,
    single-element units, or rows the option's kernel does not take (compact: more than 2 packs,
    more than COMPACT_MAX_THREADS threads, or 2^31 rows or more: one block per row, no loop).
    "auto": two_pass where its grid fits in one wave (decode-sized calls), else lean where
    lean_auto_applies (n given), else two_pass for fp32, else compact. n (lean): its bounds-free
    instance where the row fills every thread's packs (n = None: the checked one)."""
    if WHOLE_ROWS not in WHOLE_ROWS_PLANS:
        raise ValueError(f"gpuops.ops.norms.WHOLE_ROWS = {WHOLE_ROWS!r}: one of "
                         f"{WHOLE_ROWS_PLANS}")
    if WHOLE_ROWS == "auto":
        two_pass = _whole_rows_option("two_pass", plan, dtype, vec, dev, rows)
        if two_pass is not None and rows <= two_pass.capacity:
            return two_pass
        if n is not None and lean_auto_applies(dtype.itemsize, n):
            lean = _whole_rows_option("lean", plan, dtype, vec, dev, rows, n)
            if lean is not None:
                return lean
        if two_pass is not None and dtype.itemsize == 4:
            return two_pass
        return _whole_rows_option("compact", plan, dtype, vec, dev, rows)
    return _whole_rows_option(WHOLE_ROWS, plan, dtype, vec, dev, rows, n)


def _whole_rows_option(option: str, plan: Plan, dtype, vec: int, dev: int, rows: int,
                       n: int | None = None):
    threads = plan.block[0]
    if (option == "per_row" or plan.C != 1 or plan.block[1] != 1 or threads <= 32
            or vec == 1):
        return None
    if option == "compact" and (plan.packs > 2 or threads > COMPACT_MAX_THREADS
                                or rows > (1 << 31) - 1):
        return None
    lean = option in ("lean", "lean_two")
    packs = plan.packs
    if lean and (packs > 2 or rows > (1 << 31) - 1):
        return None
    exprs = _LEAN_EXPRS if lean else {"two_pass": _TWO_PASS_EXPRS,
                                      "compact": _COMPACT_EXPRS}[option]
    if lean:
        threads, packs = wide_rows_shape(threads, packs)
    expr_key = (dtype, vec, packs)
    if lean:
        expr_key += (n is not None and n == vec * threads * packs,
                     lean_one_exchange(option, dtype.itemsize, packs, threads))
    key = (option, *expr_key, threads, dev)
    hit = _plans.get(key)
    if hit is None:
        kernel = loader.load(_MODULE_OF["layer_norm"], dev).kernel(exprs[expr_key])
        per_sm = loader.blocks_per_sm(kernel, threads)
        hit = Plan(kernel, (threads, 1, 1), packs, 1,
                   per_sm * device.device_info(dev).sm_count)
        _plans[key] = hit
    return hit


@dataclass
class StreamPlan:
    """A stream kernel (norm_stream.cuh) for one row length: teams of `team` warps, `teams` per
    block, `depth` stages per team in `smem` bytes of dynamic shared memory, `capacity` blocks
    resident."""
    kernel: object
    team: int
    teams: int
    depth: int
    smem: int
    capacity: int

    @property
    def threads(self) -> int:
        return 32 * self.team * self.teams


def stream_smem(units: int, params: int, sources: int, team: int, teams: int, depth: int) -> int:
    """Bytes of dynamic shared memory of a stream block (norm_stream.cuh's layout)."""
    slots = 0 if team == 1 else -(-(8 * team * teams) // 16) * 16
    return 16 * units * (params + teams * depth * sources) + slots


def stream_config(units: int, params: int, sources: int, limit: int, per_sm,
                  teams_options=None, depth_options=range(2, 9), team_options=(1, 2, 4),
                  inflight: int = STREAM_INFLIGHT, warps_aim: int = STREAM_WARPS_AIM):
    """(team, teams, depth, smem, blocks per SM) of a stream kernel for rows of `units` 16-byte
    units (`params` parameter vectors, `sources` rows per stage), or None where none fits in
    `limit` bytes per block: the most bytes in flight per SM ((depth - 1) stages per team),
    counted up to `inflight`; then the most warps per SM, up to `warps_aim`; then the smallest
    teams, the fewest stages, the fewest blocks (one copy of the parameters per block). Blocks of
    at most 512 threads, at most 15 teams of several warps (named barriers 1..15).
    per_sm(threads, smem): the occupancy calculator's blocks per SM (0: none)."""
    best = None
    for team in team_options:
        for teams in teams_options or range(1, 17):
            if team * teams > 16 or (team > 1 and teams > 15):
                continue
            for depth in depth_options:
                smem = stream_smem(units, params, sources, team, teams, depth)
                if smem > limit:
                    continue
                blocks = per_sm(32 * team * teams, smem)
                if blocks < 1:
                    continue
                flight = blocks * teams * (depth - 1) * 16 * units * sources
                score = (min(flight, inflight), min(blocks * teams * team, warps_aim), -team,
                         -depth, -blocks)
                if best is None or score > best[0]:
                    best = (score, (team, teams, depth, smem, blocks))
    return None if best is None else best[1]


def _stream_plan(kind_name: str, plan: Plan, dtype, vec: int, n: int, rows: int, dev: int):
    """The StreamPlan for `rows` whole rows of n elements of a forward op (`plan`: its
    per-block Plan), or None where the per-block kernels run: STREAM_ROWS; single-element units;
    split rows (plan.C > 1); "auto" and rows of one warp (plan.block[1] > 1: not measured yet);
    rows too long for two stages."""
    if STREAM_ROWS not in STREAM_ROWS_PLANS:
        raise ValueError(f"gpuops.ops.norms.STREAM_ROWS = {STREAM_ROWS!r}: one of "
                         f"{STREAM_ROWS_PLANS}")
    if STREAM_ROWS == "off" or vec == 1 or n < vec or plan.C != 1:
        return None
    if STREAM_ROWS == "auto" and (plan.block[1] != 1
                                  or not stream_auto_applies(kind_name, dtype.itemsize, n)):
        return None
    module = _MODULE_OF[kind_name]
    if STREAM_ROWS == "auto" and not copies_async(module, dev):
        return None
    key = ("stream", kind_name, dtype, n, dev, STREAM_TEAM, STREAM_TEAMS, STREAM_DEPTH,
           STREAM_INFLIGHT, STREAM_WARPS_AIM)
    if key not in _plans:
        kernel = loader.load(module, dev).kernel(_STREAM_EXPRS[kind_name][dtype])
        info = device.device_info(dev)
        params, sources = {"layer_norm": (2, 1), "rms_norm": (1, 1),
                           "add_rms_norm": (1, 2)}[kind_name]
        found = stream_config(
            n // vec, params, sources, max(48 * 1024, info.max_smem_per_block_optin),
            lambda threads, smem: _resident_per_sm(kernel, threads, smem),
            (STREAM_TEAMS,) if STREAM_TEAMS else None,
            (STREAM_DEPTH,) if STREAM_DEPTH else range(2, 9),
            (STREAM_TEAM,) if STREAM_TEAM else (1, 2, 4),
            STREAM_INFLIGHT, STREAM_WARPS_AIM)
        _plans[key] = None if found is None else StreamPlan(
            kernel, found[0], found[1], found[2], found[3], found[4] * info.sm_count)
    stream = _plans[key]
    if stream is None or (STREAM_ROWS == "auto"
                          and rows < STREAM_MIN_ROWS * stream.capacity * stream.teams):
        return None
    return stream


def stream_grid(plan: StreamPlan, rows: int) -> int:
    """Blocks of a stream launch: one resident wave, or fewer where the rows leave teams idle."""
    return max(1, min(plan.capacity, -(-rows // plan.teams)))


def copies_async(module, dev: int) -> bool:
    """Whether `module` runs cp.async here: built for sm_80+ (GPUOPS_ARCH=61 on an H100 loads
    Pascal PTX, whose "resident" copies are plain loads and stores: correct, not a speed path)."""
    target = getattr(loader.load(module, dev), "target", None)
    return (target.arch if target is not None else device.device_info(dev).cc) >= 80


def _long_rows_ring(kind_name: str, plan: Plan, dtype, vec: int, n: int, rows: int, dev: int):
    """(RingPlan, grid) when split rows take a ring kernel (LONG_ROWS other than "split"; the
    plan's variant says which), else None."""
    if LONG_ROWS not in LONG_ROWS_PLANS:
        raise ValueError(f"gpuops.ops.norms.LONG_ROWS = {LONG_ROWS!r}: one of {LONG_ROWS_PLANS}")
    if plan.C == 1 or LONG_ROWS == "split":
        return None
    variant = LONG_ROWS
    if variant == "resident" or (variant == "auto" and vec > 1
                                 and copies_async(_MODULE_OF[kind_name], dev)):
        ring = _ring_plan(kind_name, dtype, vec, n, dev, "resident")
        grid = ring_grid(ring, rows)
        if grid is not None:
            return ring, grid
        variant = "auto"          # (no resident kernel here, or the rows do not fit on chip)
    if variant == "auto":
        variant = "ring"
        if vec > 1:
            ring = _ring_plan(kind_name, dtype, vec, n, dev, "ring2")
            grid = ring_grid(ring, rows)
            if grid is not None and (rows * ring.C <= grid or (
                    kind_name != "layer_norm" and ring.C <= AUTO_RING2_MAX_C)):
                return ring, grid
    ring = _ring_plan(kind_name, dtype, vec, n, dev, variant)
    grid = ring_grid(ring, rows)
    return None if grid is None else (ring, grid)


# ring2's state buffers (norm_ring.cuh): per (device, stream), [launch counter, exit counter, 2
# unused, words...] as uint32, zeroed once when allocated and never reset (the kernels keep the
# epoch themselves). A buffer that is outgrown is replaced, and kept: a captured CUDA graph may
# still launch kernels on it.
_ring2_states: dict = {}
_ring2_retired: list = []
RING2_HEADER_WORDS = 4       # uint32s before the 64-bit words (16 bytes: keeps them aligned)


def ring2_state(call, words: int) -> int:
    """Address of a ring2 state buffer with room for `words` 64-bit words, for launches on
    call.stream. A new buffer is zeroed on that stream (inside a capture, the graph zeroes it
    on every replay: equally valid, as the zero state is a valid state between launches)."""
    key = (call.device, call.stream)
    held = _ring2_states.get(key)
    if held is not None and held[1] >= words:
        return held[0].ptr
    if held is not None:
        _ring2_retired.append(held)
        words = max(words, 2 * held[1])
    buf = call.empty((RING2_HEADER_WORDS + 2 * words,), dt.float32)
    device.cupy_or_none().cuda.runtime.memsetAsync(buf.ptr, 0, buf.nbytes, call.stream)
    _ring2_states[key] = (buf, words)
    return buf.ptr


def _split_workspace(call, rows: int, C: int, K: int, extra: int):
    """One fp32 workspace: `rows` counters (zeroed here, on the op's stream), the rows' partials
    (rows * C * K floats) and `extra` floats; returns it with the three addresses."""
    ws = call.empty((rows * (1 + C * K) + extra,), dt.float32)
    device.cupy_or_none().cuda.runtime.memsetAsync(ws.ptr, 0, rows * 4, call.stream)
    partials = ws.ptr + 4 * rows
    return ws, ws.ptr, partials, partials + 4 * rows * C * K


# ---------------------------------------------------------------------------------------------
# Arguments: normalized shapes, row views of operands, outputs

def normalized_dims(op: str, normalized_shape, input_shape) -> tuple:
    """normalized_shape as a tuple of ints, checked against the trailing dims of the input."""
    tp = type(normalized_shape)
    if tp is int:
        ns = (normalized_shape,)
    elif tp is tuple and all([type(s) is int for s in normalized_shape]):
        ns = normalized_shape
    elif isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        ns = (int(normalized_shape),)
    else:
        try:
            ns = tuple(normalized_shape)
        except TypeError:
            ns = None
        if ns is None or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                 for s in ns):
            raise TypeError(f"gpuops.{op}: normalized_shape must be an int or a sequence of "
                            f"ints, got {normalized_shape!r}")
        ns = tuple(int(s) for s in ns)
    if not ns:
        raise ValueError(f"gpuops.{op}: normalized_shape must have at least one dimension")
    shape = tuple(input_shape)
    if len(ns) > len(shape) or shape[len(shape) - len(ns):] != ns:
        raise ValueError(f"gpuops.{op}: normalized_shape {list(ns)} does not match the last "
                         f"dimensions of 'input' {list(shape)}")
    return ns


def _check_param(op: str, name: str, t, ns: tuple):
    if t is not None and tuple(t.shape) != ns:
        raise ValueError(f"gpuops.{op}: {name!r} has shape {list(t.shape)}, expected the "
                         f"normalized shape {list(ns)}")


def _check_same_shape(op: str, name: str, t, shape, other: str = "input"):
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"gpuops.{op}: {name!r} has shape {list(t.shape)}, expected the shape of "
                         f"{other!r} {list(shape)}")


def _check_rows(op: str, name: str, t, lead: tuple):
    if t is not None and prod(t.shape) != prod(lead):     # (math.prod: np.prod cost ~4 us/call)
        raise ValueError(f"gpuops.{op}: {name!r} has shape {list(t.shape)}: expected one value "
                         f"per row, {prod(lead)} (shape {list(lead)})")


def row_view(shape, strides, k: int):
    """(rows, row stride) of an array whose last k dims form its rows, when those dims are
    contiguous and the leading dims merge into one stride; else None."""
    nd = len(shape)
    expected = 1
    for i in range(nd - 1, nd - k - 1, -1):
        if shape[i] != 1 and strides[i] != expected:
            return None
        expected *= shape[i]
    rows, row_stride, span = 1, None, None
    for i in range(nd - k - 1, -1, -1):
        if shape[i] == 1:
            continue
        if row_stride is None:
            row_stride = strides[i]
        elif strides[i] != span:
            return None
        span = strides[i] * shape[i]
        rows *= shape[i]
    return rows, (expected if row_stride is None else row_stride)


def _contiguous_copy(call, t: Tensor) -> Tensor:
    if call.kind == dispatch.TORCH:
        obj = t.obj.contiguous()
        return Tensor(obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), t.dtype, t.device,
                      obj, t.numel, True)
    cp = device.cupy_or_none()
    obj = cp.ascontiguousarray(t.obj)
    return Tensor(obj.data.ptr, tuple(obj.shape), tuple(s // obj.itemsize for s in obj.strides),
                  t.dtype, t.device, obj, t.numel, True)


def _rows_of(call, t: Tensor, k: int, n: int):
    """(tensor, row stride) of an input, copied to contiguous when its layout is not rows."""
    if t.contiguous:
        return t, n
    view = row_view(t.shape, t.strides, k)
    if view is None:
        t = _contiguous_copy(call, t)
        return t, n
    return t, view[1]


def _vector(call, t: Tensor | None):
    """A weight/bias vector as a contiguous Tensor (or None)."""
    if t is None or t.contiguous:
        return t
    return _contiguous_copy(call, t)


def _output(call, op: str, out: Tensor | None, shape, k: int, n: int, inputs: dict):
    """The output rows (new, or `out` checked) and their row stride."""
    if out is None:
        return call.empty(shape, call.result_dtype), n
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"gpuops.{op}: 'out' has shape {list(out.shape)}, the result has "
                         f"{list(shape)}")
    view = row_view(out.shape, out.strides, k)
    rows = prod(shape[:len(shape) - k])
    if view is None or (rows > 1 and abs(view[1]) < n):
        raise ValueError(f"gpuops.{op}: 'out' must hold rows of its last {k} dimension(s) "
                         "contiguously, without overlap (make it contiguous)")
    lo, hi = out.span()
    for name, t in inputs.items():
        if t is None or t.numel == 0:
            continue
        a, b = t.span()
        same = (t.ptr == out.ptr and tuple(t.shape) == tuple(out.shape)
                and tuple(t.strides) == tuple(out.strides))
        if a <= hi and lo <= b and not (same and name == "input"):
            raise ValueError(f"gpuops.{op}: 'out' overlaps {name!r}; in-place use must pass "
                             "'input' itself")
    return out, (n if rows <= 1 else view[1])


def _vec_ok(dtype, n: int, rows: int, row_operands, vectors) -> bool:
    """16-byte packs are possible: n divisible, every row start and vector 16-byte aligned."""
    item = dtype.itemsize
    if n % (16 // item):
        return False
    for ptr, stride in row_operands:
        if ptr % 16 or (rows > 1 and (stride * item) % 16):
            return False
    for t in vectors:
        if t is not None and t.ptr % 16:
            return False
    return True


def _stat_tensor(call, op: str, name: str, t: Tensor, lead: tuple) -> Tensor:
    if t.dtype is not dt.float32:
        raise TypeError(f"gpuops.{op}: {name!r} has dtype {t.dtype}; the GPU kernels take the "
                        "float32 statistics of the *_forward op")
    _check_rows(op, name, t, lead)
    return t if t.contiguous else _contiguous_copy(call, t)


def _ptr(t) -> int:
    return 0 if t is None else t.ptr


# ---------------------------------------------------------------------------------------------
# Launchers

def _layer_norm_launch(call, op, input, ns, weight, bias, eps, out, want_stats):
    k, n = len(ns), prod(ns)
    if n > MAX_N:
        raise ValueError(f"gpuops.{op}: rows of {n} elements; at most {MAX_N} are supported")
    _check_param(op, "weight", weight, ns)
    _check_param(op, "bias", bias, ns)
    lead = tuple(input.shape[:len(input.shape) - k])
    rows = prod(lead)
    y, ys = _output(call, op, out, input.shape, k, n, {"input": input, "weight": weight,
                                                        "bias": bias})
    mean = rstd = None
    if want_stats:
        mean, rstd = call.empty(lead, dt.float32), call.empty(lead, dt.float32)
    if rows == 0 or (n == 0 and not want_stats):
        return y, mean, rstd
    x, xs = _rows_of(call, input, k, n)
    w, b = _vector(call, weight), _vector(call, bias)
    dtype = call.result_dtype
    vec = _vec_width(dtype) if _vec_ok(dtype, n, rows, ((x.ptr, xs), (y.ptr, ys)), (w, b)) else 1
    plan = _plan("layer_norm", dtype, vec, n, call.device)
    ring = _long_rows_ring("layer_norm", plan, dtype, vec, n, rows, call.device)
    if ring is not None and ring[0].variant != "ring":
        ring, grid = ring
        state = ring2_state(call, rows * ring.C * 2)
        ring.kernel.launch((grid, 1, 1), (ring.threads, 1, 1), call.stream, x.ptr, xs, y.ptr, ys,
                           _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), state, rows, n, ring.C,
                           ring.depth, eps, smem=ring.smem)
        return y, mean, rstd
    if ring is not None:
        ring, grid = ring
        ws, counters, partials, stats = _split_workspace(call, rows, ring.C, 3,
                                                         2 * rows if mean is None else 0)
        mp, rp = (stats, stats + 4 * rows) if mean is None else (mean.ptr, rstd.ptr)
        ring.kernel.launch((grid, 1, 1), (ring.threads, 1, 1), call.stream, x.ptr, xs, y.ptr, ys,
                           _ptr(w), _ptr(b), mp, rp, partials, counters, rows, n, ring.C,
                           ring.depth, eps, smem=ring.smem)
        return y, mean, rstd
    stream = _stream_plan("layer_norm", plan, dtype, vec, n, rows, call.device)
    if stream is not None:
        stream.kernel.launch((stream_grid(stream, rows), 1, 1), (stream.threads, 1, 1),
                             call.stream, x.ptr, xs, y.ptr, ys, _ptr(w), _ptr(b), _ptr(mean),
                             _ptr(rstd), rows, n, stream.depth, stream.team, eps,
                             smem=stream.smem)
        return y, mean, rstd
    whole = _whole_rows_plan(plan, dtype, vec, call.device, rows, n)
    if whole is not None:
        whole.kernel.launch((min(rows, (1 << 31) - 1), 1, 1), whole.block, call.stream, x.ptr, xs,
                            y.ptr, ys, _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), 0, 0, rows, n, 1,
                            FUSED, eps)
        return y, mean, rstd
    plan, grid, phases = _grid(plan, rows, False)
    mp, rp, partials, counters = _ptr(mean), _ptr(rstd), 0, 0
    if plan.C > 1:     # split rows carry their statistics in mean/rstd, or in the workspace
        extra = 2 * rows if mean is None else 0
        ws, counters, partials, stats = _split_workspace(call, rows, plan.C, 3, extra)
        if extra:
            mp, rp = stats, stats + 4 * rows
    for phase in phases:
        plan.kernel.launch((grid, 1, 1), plan.block, call.stream, x.ptr, xs, y.ptr, ys, _ptr(w),
                           _ptr(b), mp, rp, partials, counters, rows, n, plan.C, phase, eps)
    return y, mean, rstd


def _rms_norm_launch(call, op, input, residual, ns, weight, eps, out, want_stats):
    k, n = len(ns), prod(ns)
    if n > MAX_N:
        raise ValueError(f"gpuops.{op}: rows of {n} elements; at most {MAX_N} are supported")
    _check_param(op, "weight", weight, ns)
    _check_same_shape(op, "residual", residual, input.shape)
    lead = tuple(input.shape[:len(input.shape) - k])
    rows = prod(lead)
    dtype = call.result_dtype
    y, ys = _output(call, op, out, input.shape, k, n, {"input": input, "weight": weight})
    h, hs = (call.empty(input.shape, dtype), n) if residual is not None else (None, 0)
    rstd = call.empty(lead, dt.float32) if want_stats else None
    if rows == 0 or (n == 0 and not want_stats):
        return y, h, rstd
    x, xs = _rows_of(call, input, k, n)
    r, rs = _rows_of(call, residual, k, n) if residual is not None else (None, 0)
    w = _vector(call, weight)
    operands = [(x.ptr, xs), (y.ptr, ys)] + ([(r.ptr, rs), (h.ptr, hs)] if r is not None else [])
    vec = _vec_width(dtype) if _vec_ok(dtype, n, rows, operands, (w,)) else 1
    kind = "add_rms_norm" if residual is not None else "rms_norm"
    plan = _plan(kind, dtype, vec, n, call.device)
    ring = _long_rows_ring(kind, plan, dtype, vec, n, rows, call.device)
    if ring is not None and ring[0].variant != "ring":
        ring, grid = ring
        state = ring2_state(call, rows * ring.C)
        ring.kernel.launch((grid, 1, 1), (ring.threads, 1, 1), call.stream, x.ptr, xs, _ptr(r),
                           rs, y.ptr, ys, _ptr(h), hs, _ptr(w), _ptr(rstd), state, rows, n,
                           ring.C, ring.depth, eps, smem=ring.smem)
        return y, h, rstd
    if ring is not None:
        ring, grid = ring
        ws, counters, partials, stats = _split_workspace(call, rows, ring.C, 1,
                                                         rows if rstd is None else 0)
        rp = stats if rstd is None else rstd.ptr
        ring.kernel.launch((grid, 1, 1), (ring.threads, 1, 1), call.stream, x.ptr, xs, _ptr(r),
                           rs, y.ptr, ys, _ptr(h), hs, _ptr(w), rp, partials, counters, rows, n,
                           ring.C, ring.depth, eps, smem=ring.smem)
        return y, h, rstd
    stream = _stream_plan(kind, plan, dtype, vec, n, rows, call.device)
    if stream is not None:
        stream.kernel.launch((stream_grid(stream, rows), 1, 1), (stream.threads, 1, 1),
                             call.stream, x.ptr, xs, _ptr(r), rs, y.ptr, ys, _ptr(h), hs, _ptr(w),
                             _ptr(rstd), rows, n, stream.depth, stream.team, eps,
                             smem=stream.smem)
        return y, h, rstd
    plan, grid, phases = _grid(plan, rows, False)
    rows_plan = _decode_rows_plan(kind, plan, dtype, vec, rows, call.device, n)
    if rows_plan is not None:
        plan, grid = rows_plan, rows
    rp, partials, counters = _ptr(rstd), 0, 0
    if plan.C > 1:
        extra = rows if rstd is None else 0
        ws, counters, partials, stats = _split_workspace(call, rows, plan.C, 1, extra)
        if extra:
            rp = stats
    for phase in phases:
        plan.kernel.launch((grid, 1, 1), plan.block, call.stream, x.ptr, xs, _ptr(r), rs, y.ptr,
                           ys, _ptr(h), hs, _ptr(w), rp, partials, counters, rows, n, plan.C,
                           phase, eps)
    return y, h, rstd


def _backward_launch(call, op, layer, grad_output, input, mean, rstd, ns, weight, dres):
    """dx, dw (and db for LayerNorm) of LayerNorm / RMSNorm (+ dres, the residual's gradient)."""
    k, n = len(ns), prod(ns)
    if n > MAX_N:
        raise ValueError(f"gpuops.{op}: rows of {n} elements; at most {MAX_N} are supported")
    _check_param(op, "weight", weight, ns)
    name_x = "input" if layer or dres is None else "residual_out"
    _check_same_shape(op, "grad_output" if layer or dres is None else "grad_normed",
                      grad_output, input.shape, name_x)
    lead = tuple(input.shape[:len(input.shape) - k])
    rows = prod(lead)
    dtype = call.result_dtype
    dx = call.empty(input.shape, dtype)
    dw = call.empty(ns, dtype)
    db = call.empty(ns, dtype) if layer else None
    if n == 0:
        return dx, dw, db
    rstd = _stat_tensor(call, op, "rstd", rstd, lead)
    if layer:
        mean = _stat_tensor(call, op, "mean", mean, lead)
    wgrad = loader.load(BACKWARD_MODULE, call.device).kernel(_WGRAD_EXPRS[dtype])
    wgrid = (-(-n // WGRAD_BLOCK[0]), 1, 1)
    if rows == 0:     # empty sums: zeros
        wgrad.launch(wgrid, WGRAD_BLOCK, call.stream, 0, 0, dw.ptr, _ptr(db), 0, n)
        return dx, dw, db
    g, gs = _rows_of(call, grad_output, k, n)
    x, xs = _rows_of(call, input, k, n)
    d, ds = _rows_of(call, dres, k, n) if dres is not None else (None, 0)
    w = _vector(call, weight)
    operands = [(g.ptr, gs), (x.ptr, xs), (dx.ptr, n)] + ([(d.ptr, ds)] if d is not None else [])
    vec = _vec_width(dtype) if _vec_ok(dtype, n, rows, operands, (w,)) else 1
    kind = "layer_norm_bwd" if layer else "rms_norm_bwd"
    if BACKWARD_LONG_ROWS not in BACKWARD_LONG_ROWS_PLANS:
        raise ValueError(f"gpuops.ops.norms.BACKWARD_LONG_ROWS = {BACKWARD_LONG_ROWS!r}: one of "
                         f"{BACKWARD_LONG_ROWS_PLANS}")
    if BACKWARD_LONG_ROWS == "columns" and plan_shape(TUNING[kind], vec, n)[3] > 1:
        cp = _cols_plan(layer, dtype, vec, n, rows, call.device)
        K = 2 if layer else 1
        per_group = K * n if cp.groups > 1 else 0
        # [groups, n] dw (and db) first: the kernel stores them 16 bytes at a time
        ws = call.empty((cp.groups * per_group + rows * K * (cp.chunks + 1),), dt.float32)
        dw_part = ws.ptr if cp.groups > 1 else 0
        db_part = ws.ptr + 4 * cp.groups * n if cp.groups > 1 and layer else 0
        partials = ws.ptr + 4 * cp.groups * per_group
        sums = partials + 4 * rows * K * cp.chunks
        mp = _ptr(mean) if layer else 0
        grid, block = (cp.grid_x, cp.groups, 1), (COLS_THREADS, 1, 1)
        cp.stats.launch(grid, block, call.stream, g.ptr, gs, x.ptr, xs, mp, rstd.ptr, _ptr(w),
                        partials, dw_part, db_part, dw.ptr, _ptr(db), rows, n, cp.chunks,
                        cp.rows_per_group)
        cp.sums.launch((min(rows, 1 << 16), 1, 1), (256, 1, 1), call.stream, partials, sums,
                       rows, cp.chunks)
        cp.apply.launch(grid, block, call.stream, g.ptr, gs, x.ptr, xs, _ptr(d), ds, mp,
                        rstd.ptr, _ptr(w), sums, dx.ptr, n, rows, n, cp.chunks,
                        cp.rows_per_group)
        if cp.groups > 1:
            wgrad.launch(wgrid, WGRAD_BLOCK, call.stream, dw_part, db_part, dw.ptr, _ptr(db),
                         cp.groups, n)
        return dx, dw, db
    plan, grid, phases = _grid(_plan(kind, dtype, vec, n, call.device), rows, True)
    slots = grid // plan.C
    K = 2 if layer else 1
    part = call.empty(((2 if layer else 1) * slots * n,), dt.float32)
    dw_part = part.ptr
    db_part = part.ptr + 4 * slots * n if layer else 0
    partials = counters = sums = 0
    if plan.C > 1:
        ws, counters, partials, sums = _split_workspace(call, rows, plan.C, K, K * rows)
    for phase in phases:
        plan.kernel.launch((grid, 1, 1), plan.block, call.stream, g.ptr, gs, x.ptr, xs, _ptr(d),
                           ds, _ptr(mean) if layer else 0, rstd.ptr, _ptr(w), dx.ptr, n, dw_part,
                           db_part, partials, counters, sums, rows, n, plan.C, phase)
    wgrad.launch(wgrid, WGRAD_BLOCK, call.stream, dw_part, db_part, dw.ptr, _ptr(db), slots, n)
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# NumPy references (float64, textbook formulas)

def _axes(x, k):
    return tuple(range(x.ndim - k, x.ndim))


def _ref_layer_norm(op, input, normalized_shape, weight, bias, eps):
    ns = normalized_dims(op, normalized_shape, input.shape)
    _check_param(op, "weight", weight, ns)
    _check_param(op, "bias", bias, ns)
    k = len(ns)
    axes = _axes(input, k)
    lead = input.shape[:input.ndim - k]
    with np.errstate(all="ignore"):
        if prod(ns) == 0:
            mean = np.zeros(lead + (1,) * k)
            rstd = np.full(lead + (1,) * k, np.nan)
        else:
            mean = input.mean(axis=axes, keepdims=True)
            var = ((input - mean) ** 2).mean(axis=axes, keepdims=True)
            rstd = 1.0 / np.sqrt(var + eps)
        y = (input - mean) * rstd
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
    return y, mean.reshape(lead), rstd.reshape(lead)


def _resolve_eps(eps, float_eps):
    return float_eps if eps is None else eps


def _ref_rms_norm(op, input, normalized_shape, weight, eps):
    ns = normalized_dims(op, normalized_shape, input.shape)
    _check_param(op, "weight", weight, ns)
    k = len(ns)
    lead = input.shape[:input.ndim - k]
    eps = _resolve_eps(eps, float(np.finfo(np.float64).eps))
    with np.errstate(all="ignore"):
        if prod(ns) == 0:
            rstd = np.full(lead + (1,) * k, np.nan)
        else:
            rstd = 1.0 / np.sqrt((input * input).mean(axis=_axes(input, k), keepdims=True) + eps)
        y = input * rstd
        if weight is not None:
            y = y * weight
    return y, rstd.reshape(lead)


def ref_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _ref_layer_norm("layer_norm", input, normalized_shape, weight, bias, eps)[0]


def ref_layer_norm_forward(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _ref_layer_norm("layer_norm_forward", input, normalized_shape, weight, bias, eps)


def ref_rms_norm(input, normalized_shape, weight=None, eps=None):
    return _ref_rms_norm("rms_norm", input, normalized_shape, weight, eps)[0]


def ref_rms_norm_forward(input, normalized_shape, weight=None, eps=None):
    return _ref_rms_norm("rms_norm_forward", input, normalized_shape, weight, eps)


def _stat_dtype(found):
    return dt.stat_dtype(found.get("input"))


# the statistics in float32, the normalized output in the input's dtype
ref_layer_norm_forward.result_dtype = lambda values, found: (None, _stat_dtype(found),
                                                            _stat_dtype(found))
ref_rms_norm_forward.result_dtype = lambda values, found: (None, _stat_dtype(found))


def _ref_add_rms_norm(op, input, residual, weight, eps):
    _check_same_shape(op, "residual", residual, input.shape)
    normalized_dims(op, weight.shape, input.shape)
    h = input + residual
    y, rstd = _ref_rms_norm(op, h, weight.shape, weight, eps)
    return y, h, rstd


def ref_add_rms_norm(input, residual, weight, eps=1e-6):
    return _ref_add_rms_norm("add_rms_norm", input, residual, weight, eps)[:2]


def ref_add_rms_norm_forward(input, residual, weight, eps=1e-6):
    return _ref_add_rms_norm("add_rms_norm_forward", input, residual, weight, eps)


ref_add_rms_norm_forward.result_dtype = lambda values, found: (None, None, _stat_dtype(found))


def _ref_backward(op, layer, grad_output, input, mean, rstd, normalized_shape, weight):
    ns = normalized_dims(op, normalized_shape, input.shape)
    _check_param(op, "weight", weight, ns)
    _check_same_shape(op, "grad_output", grad_output, input.shape)
    k = len(ns)
    lead = input.shape[:input.ndim - k]
    _check_rows(op, "rstd", rstd, lead)
    axes, lead_axes = _axes(input, k), tuple(range(input.ndim - k))
    bshape = lead + (1,) * k
    r = np.asarray(rstd, dtype=np.float64).reshape(bshape)
    if layer:
        _check_rows(op, "mean", mean, lead)
        xhat = (input - np.asarray(mean, dtype=np.float64).reshape(bshape)) * r
    else:
        xhat = input * r
    g = grad_output * weight if weight is not None else grad_output
    with np.errstate(all="ignore"):
        proj = xhat * (g * xhat).mean(axis=axes, keepdims=True)
        centre = g.mean(axis=axes, keepdims=True) if layer else 0.0
        dx = r * (g - centre - proj)
    dw = (grad_output * xhat).sum(axis=lead_axes)
    db = grad_output.sum(axis=lead_axes)
    return dx, dw, db


def ref_layer_norm_backward(grad_output, input, mean, rstd, normalized_shape, weight=None):
    return _ref_backward("layer_norm_backward", True, grad_output, input, mean, rstd,
                         normalized_shape, weight)


def ref_rms_norm_backward(grad_output, input, rstd, normalized_shape, weight=None):
    return _ref_backward("rms_norm_backward", False, grad_output, input, None, rstd,
                         normalized_shape, weight)[:2]


def ref_add_rms_norm_backward(grad_normed, grad_residual, residual_out, rstd, weight):
    op = "add_rms_norm_backward"
    _check_same_shape(op, "grad_normed", grad_normed, residual_out.shape, "residual_out")
    _check_same_shape(op, "grad_residual", grad_residual, residual_out.shape, "residual_out")
    dx, dw, _ = _ref_backward(op, False, grad_normed, residual_out, None, rstd, weight.shape,
                              weight)
    if grad_residual is not None:
        dx = dx + grad_residual
    return dx, dw


# ---------------------------------------------------------------------------------------------
# Benchmarks: [32768, 4096] (the target shape), plus a long row and a decode size.

def _default_shape(d):
    return (32768, 4096)


EXTRA_SHAPES = ((16, 1048576), (16, 2048))
_STAT = (dt.float32, dt.float64)


def _torch():
    return sys.modules.get("torch") or __import__("torch")


def _hf_rms_norm(x, w, eps):
    """HF transformers' LlamaRMSNorm / Qwen2RMSNorm forward, as their modules compute it."""
    torch = _torch()
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return w * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def _row_stats(x, eps, centered):
    """fp32 (mean, rstd) per row of a 2-D array of any framework (benchmark inputs)."""
    if type(x).__module__.startswith("torch"):
        torch = _torch()
        xf = x.float()
        m = xf.mean(-1) if centered else torch.zeros_like(xf[:, 0])
        return m, torch.rsqrt(((xf - m[:, None]) ** 2).mean(-1) + eps)
    xp = device.cupy_or_none() if type(x).__module__.startswith("cupy") else np
    xf = x.astype(xp.float32)
    m = xf.mean(-1) if centered else xp.zeros(xf.shape[:1], xp.float32)
    return m, (1.0 / xp.sqrt(((xf - m[:, None]) ** 2).mean(-1) + eps)).astype(xp.float32)


def _peers(**factories):
    """extra_peers: each factory imports its library itself; one missing drops only its peer."""
    def make():
        out = {}
        for name, factory in factories.items():
            try:
                out[name] = factory()
            except ImportError:
                pass
        return out
    return make


def _backward_peer(forward):
    """Times only the backward of `forward(*args) -> (outputs, leaves, grads)`, an autograd
    graph: the first, untimed, call with a set of inputs builds the graph; each call runs
    autograd.grad through it. One graph is kept at a time. When the runner wraps this in
    torch.compile (the compile peer), the forward is traced and compiled (a separate graph: the
    key says so) and the timed autograd.grad runs inductor's backward."""
    cache = {}

    def run(*args):
        torch = _torch()
        key = tuple(id(a) for a in args) + (torch.compiler.is_compiling(),)
        entry = cache.get(key)
        if entry is None:
            cache.clear()
            entry = cache[key] = forward(*args)
        outputs, leaves, grads = entry
        return torch.autograd.grad(outputs, leaves, grads, retain_graph=True)
    return run


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _ln_graph(fn):
    def forward(dy, x, mean, rstd, ns, weight):
        xl, wl = _leaf(x), _leaf(weight)
        bl = _leaf(_torch().zeros_like(weight))
        return fn(xl, ns, wl, bl), (xl, wl, bl), dy
    return forward


def _rms_graph(fn):
    def forward(dy, x, rstd, ns, weight):
        xl, wl = _leaf(x), _leaf(weight)
        return fn(xl, ns, wl), (xl, wl), dy
    return forward


def _add_rms_graph(fn):
    def forward(gy, gh, h, rstd, weight):
        xl, rl, wl = _leaf(h), _leaf(_torch().zeros_like(h)), _leaf(weight)
        y, hh = fn(xl, rl, wl)
        return (y, hh), (xl, rl, wl), (gy, gh)
    return forward


def _f():
    return _torch().nn.functional


_LN = lambda x, ns, w, b: _f().layer_norm(x, ns, w, b, 1e-5)        # noqa: E731
_RMS = lambda x, ns, w: _f().rms_norm(x, ns, w, 1e-6)                # noqa: E731
_HF_RMS = lambda x, ns, w: _hf_rms_norm(x, w, 1e-6)                  # noqa: E731


def _add_rms(x, r, w):
    h = x + r
    return _f().rms_norm(h, h.shape[-1:], w, 1e-6), h


def _hf_add_rms(x, r, w):
    h = x + r
    return _hf_rms_norm(h, w, 1e-6), h


def _liger_ln():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction  # noqa: PLC0415
    return LigerLayerNormFunction.apply


def _liger_rms():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: PLC0415
    # (X, W, eps, offset, casting_mode, in_place): in_place=False keeps dY intact between the
    # repeated backward calls of the benchmark.
    return lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)


def _liger_add_rms():
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction  # noqa: PLC0415
    return lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6, 0.0, "llama", False)


def _ln_inputs(shape, d, randn):
    return (randn(shape, d), tuple(shape[-1:]), randn(shape[-1:], d), randn(shape[-1:], d)), \
        {"eps": 1e-5}


def _rms_inputs(shape, d, randn):
    return (randn(shape, d), tuple(shape[-1:]), randn(shape[-1:], d)), {"eps": 1e-6}


def _add_rms_inputs(shape, d, randn):
    return (randn(shape, d), randn(shape, d), randn(shape[-1:], d)), {"eps": 1e-6}


def _ln_bwd_inputs(shape, d, randn):
    x = randn(shape, d)
    mean, rstd = _row_stats(x, 1e-5, True)
    return (randn(shape, d), x, mean, rstd, tuple(shape[-1:]), randn(shape[-1:], d)), {}


def _rms_bwd_inputs(shape, d, randn):
    x = randn(shape, d)
    return (randn(shape, d), x, _row_stats(x, 1e-6, False)[1], tuple(shape[-1:]),
            randn(shape[-1:], d)), {}


def _add_rms_bwd_inputs(shape, d, randn):
    h = randn(shape, d)
    return (randn(shape, d), randn(shape, d), h, _row_stats(h, 1e-6, False)[1],
            randn(shape[-1:], d)), {}


def _spec(make, torch_fn, peers, compile_peer=True):
    return BenchSpec(make_inputs=make, torch_fn=torch_fn, default_shape=_default_shape,
                     compile_peer=compile_peer, extra_peers=peers, extra_shapes=EXTRA_SHAPES)


LAYER_NORM_BENCH = _spec(
    _ln_inputs, lambda x, ns, w, b, eps=1e-5: _f().layer_norm(x, ns, w, b, eps),
    _peers(liger=lambda: (lambda f: lambda x, ns, w, b, eps=1e-5: f(x, w, b, eps))(_liger_ln())))
RMS_NORM_BENCH = _spec(
    _rms_inputs, lambda x, ns, w, eps=1e-6: _f().rms_norm(x, ns, w, eps),
    _peers(hf=lambda: lambda x, ns, w, eps=1e-6: _hf_rms_norm(x, w, eps),
           liger=lambda: (lambda f: lambda x, ns, w, eps=1e-6: f(x, w))(_liger_rms())))
ADD_RMS_NORM_BENCH = _spec(
    _add_rms_inputs, lambda x, r, w, eps=1e-6: _add_rms(x, r, w),
    _peers(hf=lambda: lambda x, r, w, eps=1e-6: _hf_add_rms(x, r, w),
           liger=lambda: (lambda f: lambda x, r, w, eps=1e-6: f(x, r, w))(_liger_add_rms())))
# Backward peers time torch's autograd backward of the same forward (eager; torch.compile'd, as
# the compile peer: see _backward_peer; HF's module; Liger).
LAYER_NORM_BWD_BENCH = _spec(
    _ln_bwd_inputs, _backward_peer(_ln_graph(_LN)),
    _peers(liger=lambda: (lambda f: _backward_peer(_ln_graph(
        lambda x, ns, w, b: f(x, w, b, 1e-5))))(_liger_ln())))
RMS_NORM_BWD_BENCH = _spec(
    _rms_bwd_inputs, _backward_peer(_rms_graph(_RMS)),
    _peers(hf=lambda: _backward_peer(_rms_graph(_HF_RMS)),
           liger=lambda: (lambda f: _backward_peer(_rms_graph(
               lambda x, ns, w: f(x, w))))(_liger_rms())))
ADD_RMS_NORM_BWD_BENCH = _spec(
    _add_rms_bwd_inputs, _backward_peer(_add_rms_graph(_add_rms)),
    _peers(hf=lambda: _backward_peer(_add_rms_graph(_hf_add_rms)),
           liger=lambda: _backward_peer(_add_rms_graph(_liger_add_rms()))))


# ---------------------------------------------------------------------------------------------
# The ops

@register(family="norms", reference=ref_layer_norm, bench=LAYER_NORM_BENCH)
def layer_norm(call, input: Tensor, normalized_shape, weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5, *,
               out: Tensor | None = None) -> Tensor:
    """Layer normalization over the trailing dims, as ``torch.nn.functional.layer_norm``.

    ``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``normalized_shape`` dims.
    Biased variance, computed stably (per-thread two-pass sums merged with Chan's formula, never
    E[x^2] - E[x]^2); fp32 math for every storage type, one rounding of the result. ``out`` may
    be ``input`` itself (in place). Inputs whose rows are not contiguous are copied first.
    """
    ns = normalized_dims("layer_norm", normalized_shape, input.shape)
    return _layer_norm_launch(call, "layer_norm", input, ns, weight, bias, float(eps), out,
                              False)[0]


@register(family="norms", reference=ref_layer_norm_forward)
def layer_norm_forward(call, input: Tensor, normalized_shape, weight: Tensor | None = None,
                       bias: Tensor | None = None, eps: float = 1e-5):
    """``layer_norm`` that also returns the per-row mean and rstd (float32) for the backward.

    Returns ``(y, mean, rstd)``, ``rstd = 1/sqrt(var + eps)``, the statistics of shape
    ``input.shape[:-len(normalized_shape)]``, for ``layer_norm_backward``.

    On the CPU reference path the statistics come in the input's dtype.
    """
    ns = normalized_dims("layer_norm_forward", normalized_shape, input.shape)
    return _layer_norm_launch(call, "layer_norm_forward", input, ns, weight, bias, float(eps),
                              None, True)


@register(family="norms", reference=ref_layer_norm_backward, param_dtypes={"mean": _STAT,
          "rstd": _STAT}, bench=LAYER_NORM_BWD_BENCH)
def layer_norm_backward(call, grad_output: Tensor, input: Tensor, mean: Tensor, rstd: Tensor,
                        normalized_shape, weight: Tensor | None = None):
    """Gradients of ``layer_norm``: ``(grad_input, grad_weight, grad_bias)``.

    From the forward's ``input``, ``mean`` and ``rstd`` (float32, from ``layer_norm_forward``).

    ``grad_weight = sum(grad_output * xhat)`` and ``grad_bias = sum(grad_output)`` over all rows
    are always returned (the gradients a weight/bias would have), reduced deterministically in
    fp32: per-block partial sums, then a second kernel, no atomics.
    """
    op = "layer_norm_backward"
    ns = normalized_dims(op, normalized_shape, input.shape)
    return _backward_launch(call, op, True, grad_output, input, mean, rstd, ns, weight, None)


def _float_eps(x) -> float | None:
    """torch.finfo(dtype).eps of an array's dtype (what eps=None means in torch's rms_norm)."""
    kind = dispatch.kind_of(x)
    if kind is None:
        return None
    try:
        d = dispatch._dtype_of(kind, x, _get_op("rms_norm"), "input")
    except TypeError:
        return None     # the op itself reports the dtype
    return {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7,
            "float64": 2.0 ** -52}.get(d.name)


@register(family="norms", reference=ref_rms_norm, bench=RMS_NORM_BENCH)
def rms_norm(call, input: Tensor, normalized_shape, weight: Tensor | None = None,
             eps: float | None = None, *, out: Tensor | None = None) -> Tensor:
    """RMS normalization over the trailing dims, as ``torch.nn.functional.rms_norm``.

    ``x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dims.

    ``eps=None`` is the machine epsilon of the input's dtype, as torch. fp32 math, one rounding
    of the result; ``out`` may be ``input`` itself (in place).
    """
    ns = normalized_dims("rms_norm", normalized_shape, input.shape)
    eps = _FLOAT_EPS[call.result_dtype] if eps is None else float(eps)
    return _rms_norm_launch(call, "rms_norm", input, None, ns, weight, eps, out, False)[0]


@register(family="norms", reference=ref_rms_norm_forward)
def rms_norm_forward(call, input: Tensor, normalized_shape, weight: Tensor | None = None,
                     eps: float | None = None):
    """``rms_norm`` that also returns the per-row rstd (float32) for the backward.

    Returns ``(y, rstd)``, ``rstd = 1/sqrt(mean(x^2) + eps)`` of shape
    ``input.shape[:-len(normalized_shape)]``, for ``rms_norm_backward``.

    On the CPU reference path the statistics come in the input's dtype.
    """
    ns = normalized_dims("rms_norm_forward", normalized_shape, input.shape)
    eps = _FLOAT_EPS[call.result_dtype] if eps is None else float(eps)
    y, _, rstd = _rms_norm_launch(call, "rms_norm_forward", input, None, ns, weight, eps, None,
                                  True)
    return y, rstd


@register(family="norms", reference=ref_rms_norm_backward, param_dtypes={"rstd": _STAT},
          bench=RMS_NORM_BWD_BENCH)
def rms_norm_backward(call, grad_output: Tensor, input: Tensor, rstd: Tensor, normalized_shape,
                      weight: Tensor | None = None):
    """Gradients of ``rms_norm``: ``(grad_input, grad_weight)``.

    From the forward's ``input`` and ``rstd`` (float32, from ``rms_norm_forward``).

    ``grad_weight = sum(grad_output * x * rstd)`` over all rows is always returned, reduced
    deterministically in fp32 (per-block partial sums, then a second kernel).
    """
    op = "rms_norm_backward"
    ns = normalized_dims(op, normalized_shape, input.shape)
    dx, dw, _ = _backward_launch(call, op, False, grad_output, input, None, rstd, ns, weight,
                                 None)
    return dx, dw


@register(family="norms", reference=ref_add_rms_norm, bench=ADD_RMS_NORM_BENCH)
def add_rms_norm(call, input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6):
    """Residual add + RMSNorm in one pass: ``(rms_norm(input + residual) * weight, sum)``.

    The pre-norm residual step of LLM decoder layers.

    The sum is rounded to the storage dtype, returned as the new residual, and normalized as
    rounded: what HF transformers' Llama/Qwen layers (``residual + hidden_states`` in bf16, then
    their RMSNorm) and vLLM's ``fused_add_rms_norm`` compute. The normalized value is multiplied
    by ``weight`` in fp32 and rounded once (HF rounds ``x * rstd`` to the dtype before the weight:
    within one rounding of this). ``weight`` spans the trailing dims it normalizes (usually
    ``[hidden]``). The CPU reference path normalizes the exact sum.
    """
    op = "add_rms_norm"
    ns = normalized_dims(op, weight.shape, input.shape)
    y, h, _ = _rms_norm_launch(call, op, input, residual, ns, weight, float(eps), None, False)
    return y, h


@register(family="norms", reference=ref_add_rms_norm_forward)
def add_rms_norm_forward(call, input: Tensor, residual: Tensor, weight: Tensor,
                         eps: float = 1e-6):
    """``add_rms_norm`` that also returns the per-row rstd (float32) of the sum.

    Returns ``(normed, input + residual, rstd)`` for ``add_rms_norm_backward``."""
    op = "add_rms_norm_forward"
    ns = normalized_dims(op, weight.shape, input.shape)
    return _rms_norm_launch(call, op, input, residual, ns, weight, float(eps), None, True)


@register(family="norms", reference=ref_add_rms_norm_backward, param_dtypes={"rstd": _STAT},
          bench=ADD_RMS_NORM_BWD_BENCH)
def add_rms_norm_backward(call, grad_normed: Tensor, grad_residual: Tensor | None,
                          residual_out: Tensor, rstd: Tensor, weight: Tensor):
    """Gradients of ``add_rms_norm``: ``(grad_input, grad_weight)`` (grad_residual = grad_input).

    ``grad_normed`` and ``grad_residual`` (None when the returned residual was not used) are the
    gradients of the two outputs; ``residual_out`` and ``rstd`` come from
    ``add_rms_norm_forward``. ``grad_input = rms_norm_backward(...) + grad_residual`` in fp32,
    rounded once.
    """
    op = "add_rms_norm_backward"
    ns = normalized_dims(op, weight.shape, residual_out.shape)
    _check_same_shape(op, "grad_residual", grad_residual, residual_out.shape, "residual_out")
    dx, dw, _ = _backward_launch(call, op, False, grad_normed, residual_out, None, rstd, ns,
                                 weight, grad_residual)
    return dx, dw


_FLOAT_EPS = {dt.float32: 2.0 ** -23, dt.float16: 2.0 ** -10, dt.bfloat16: 2.0 ** -7}


def _eps_from_dtype(generated):
    """Wraps a generated op whose eps=None means the input dtype's machine epsilon, so that the
    CPU reference path (which sees float64 arrays) resolves it from the caller's dtype too."""
    import functools  # noqa: PLC0415

    @functools.wraps(generated)
    def op(input, normalized_shape, weight=None, eps=None, **kw):
        if eps is None:
            eps = _float_eps(input)
        return generated(input, normalized_shape, weight, eps, **kw)
    op.op = generated.op
    op.__signature__ = generated.__signature__
    generated.op.function = op
    return op


rms_norm = _eps_from_dtype(rms_norm)
rms_norm_forward = _eps_from_dtype(rms_norm_forward)
