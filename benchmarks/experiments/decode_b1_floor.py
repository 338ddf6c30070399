"""Decode attention at B1 S8192 (GQA 16/8, D128, bf16, one query token): what a one-launch read of
its 33.6 MB of K/V can reach on this GPU, and which part of decode_split falls short of it.

Issue 5 asks for >= 85% of copy bandwidth (<= 13.2 us at 3000 GB/s); runs 15-35 measured 19.5 us
(split kernel alone 16.2 us) and torch SDPA 18.2 us, and the cp.async-staged kernel with 6x the
bytes in flight was slower (run 34), so "too few bytes in flight" is not the whole story. Before
another design, four measurements in one process (CUDA-graph replay, 20 calls per graph, caches
rotated through > 3x the 50 MB L2, as decode_attention_plans.py):

A. stream_rows<U>: decode_split's access pattern without its math: one block per (kv head, chunk
   of keys), 128 threads, 16 lanes x 16 bytes per key row, U keys per group loaded before any is
   used; K/V in the bench's [B, S, Hkv, D] layout (a block reads 256 of every 2048 bytes) and in
   [B, Hkv, S, D] (a block reads two contiguous 32 KB runs); chunks of 64 / 128 / 256 keys. And
   stream_flat<U>: a plain grid-stride read of the same bytes, one wave of 256-thread blocks.
   The best of these is the floor this GPU gives one launch of this size.
B. decode_attention, full and split kernel only (the combine a no-op), and torch SDPA, with the
   caches in both layouts (same values).
C. decode_split rebuilt with other keys in flight per group (GPUOPS_DECODE_U) and K/V steps in
   flight ahead of the one in use (GPUOPS_DECODE_DEPTH), each as its own module; registers and
   blocks per SM printed. (Run 58: U 1/4/8 with one step ahead or none, run 60: DEPTH 2 and q
   loaded before K/V (an option since removed) all slower than the default U 2, DEPTH 1.)
D. A %globaltimer trace of the default split kernel (GPUOPS_DECODE_TRACE): per block its entry,
   the end of the q / length loads, of its first step, of its key loop and its exit, its SM, for the
   last call of a rotated graph: ramp (entry spread), block time, tail (exit spread); and the
   combine kernel alone (the split kernel a no-op).
E. The split rule (attention_decode.SPLIT waves x min_chunk): 1024 blocks of 64 keys (two waves
   of resident blocks) against the default 512 x 128, full op and split kernel alone.

    python benchmarks/experiments/decode_b1_floor.py [--json out.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import _Framework, graph_replay_us, rotating  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.ops import attention_decode as AD  # noqa: E402
from gpuops.runtime import device, loader  # noqa: E402
from gpuops.runtime.modules import KernelModule  # noqa: E402

L2_BYTES = 50 << 20

STREAM_SRC = r"""
// The loads stay alive through acc; the store happens only for a value no data here gives.
template <int U>
__global__ void __launch_bounds__(128) stream_rows(const uint4* __restrict__ k,
    const uint4* __restrict__ v, long long key_stride, long long head_stride, int chunk,
    unsigned* __restrict__ out) {
  const int lig = threadIdx.x & 15, grp = threadIdx.x >> 4;
  const long long base = blockIdx.x * head_stride + lig;
  const int start = blockIdx.y * chunk, end = start + chunk;
  unsigned acc = 0;
  for (int j = start + grp * U; j < end; j += 8 * U) {
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kr[u] = __ldg(k + base + (long long)(j + u) * key_stride);
      vr[u] = __ldg(v + base + (long long)(j + u) * key_stride);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      acc += kr[u].x ^ kr[u].y ^ kr[u].z ^ kr[u].w ^ vr[u].x ^ vr[u].y ^ vr[u].z ^ vr[u].w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.y * gridDim.x + blockIdx.x] = acc;
}

template <int U>
__global__ void __launch_bounds__(256) stream_flat(const uint4* __restrict__ p, long long n,
                                                   unsigned* __restrict__ out) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += U * stride) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = i + u * stride < n ? __ldg(p + i + u * stride)
                                                          : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc += r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}
"""
US = (1, 2, 4, 8, 16)


class _NoLaunch:
    """A kernel whose launches do nothing (its occupancy is the real kernel's)."""

    def __init__(self, real):
        self.ptr = real.ptr

    def launch(self, *a, **k):
        pass


_noops: dict = {}


def _without(module, kernel_fn):
    """kernel_fn with `module`'s kernels replaced by no-ops."""
    def pick(m, dev, expr):
        real = kernel_fn(m, dev, expr)
        if m is not module:
            return real
        return _noops.setdefault(id(real), _NoLaunch(real))
    return pick


def _launcher(fn, grid, block, args):
    def call():
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            fn(grid, block, args)
    return call


def _pct(nbytes, us, copy):
    return 100 * nbytes / (us * 1e-6) / 1e9 / copy


def rotated_caches(b, s, hkv, dim, dtype):
    """Seeded K/V caches [b, s, hkv, dim], as many pairs as rotate through > 3x the L2: (bytes of
    one K + V, the (k, v) list, the generator for the inputs that follow). Shared with
    decode_tma.py."""
    kv_bytes = 2 * b * s * hkv * dim * dtype.itemsize
    nrot = max(1, -(-3 * L2_BYTES // kv_bytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [(torch.randn(b, s, hkv, dim, device="cuda", dtype=dtype, generator=gen),
               torch.randn(b, s, hkv, dim, device="cuda", dtype=dtype, generator=gen))
              for _ in range(nrot)]
    return kv_bytes, caches, gen


def start_results(label_key, widths):
    """The copy bandwidth (printed), the results dict and record(label, what, us, nbytes,
    **extra): one row of res["rows"] with its % of copy, printed in columns of `widths`.
    Shared with decode_tma.py."""
    copy = _Framework().copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s  {device.device_info(0).name}", flush=True)
    res = {"copy_gbps": copy, "gpu": device.device_info(0).name, "rows": []}

    def record(label, what, us, nbytes, **extra):
        row = {label_key: label, "what": what, "us": us, "pct_copy": _pct(nbytes, us, copy),
               **extra}
        res["rows"].append(row)
        print(f"{label:<{widths[0]}} {what:<{widths[1]}}{us:9.2f} us {row['pct_copy']:6.1f}%",
              flush=True)
    return copy, res, record


def trace_summary(tr):
    """tr: [blocks, 6] (ns at entry, q / length loaded, first step done, key loop done, exit;
    SM id), all relative to the first entry, in us; percentiles 0 / 50 / 90 / 100."""
    t0 = tr[:, 0].min()
    rel = (tr[:, :5] - t0) / 1e3
    per_sm = np.bincount(tr[:, 5].astype(np.int64))

    def pct(x):
        return [round(float(np.percentile(x, p)), 3) for p in (0, 50, 90, 100)]
    return {
        "blocks": int(len(tr)), "sms_used": int((per_sm > 0).sum()),
        "blocks_per_sm_max": int(per_sm.max()), "span_us": float(rel[:, 4].max()),
        "entry": pct(rel[:, 0]), "q_len_done": pct(rel[:, 1]), "first_step_done": pct(rel[:, 2]),
        "loop_done": pct(rel[:, 3]), "exit": pct(rel[:, 4]),
        "loop_after_first_step": pct(rel[:, 3] - rel[:, 2]),
        "epilogue": pct(rel[:, 4] - rel[:, 3]),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="fewer stream configs")
    ap.add_argument("--sections", default="ABCDE", help="which of A B C D E to run (default all)")
    args = ap.parse_args()
    copy, res, record = start_results("section", (1, 58))

    b, s, hq, hkv, dim = 1, 8192, 16, 8, 128
    td = torch.bfloat16
    kv_bytes, bshd, gen = rotated_caches(b, s, hkv, dim, td)
    nrot = len(bshd)
    bhsd = [(k.transpose(1, 2).contiguous().transpose(1, 2),
             v.transpose(1, 2).contiguous().transpose(1, 2)) for k, v in bshd]
    q = torch.randn(b, 1, hq, dim, device="cuda", dtype=td, generator=gen)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    print(f"B{b} S{s} Hq{hq} Hkv{hkv} D{dim} bf16: {kv_bytes / 1e6:.1f} MB of K/V, "
          f"floor at copy bandwidth {kv_bytes / copy / 1e3:.2f} us, {nrot} caches rotated",
          flush=True)

    # A. the access pattern without the math
    if "A" not in args.sections:
        chunks, bps_list = (), ()
    else:
        chunks = (128,) if args.quick else (64, 128, 256)
        bps_list = (2, 4, 8)
    mod = cp.RawModule(code=STREAM_SRC, options=("-std=c++17",),
                       name_expressions=[f"stream_rows<{u}>" for u in US]
                       + [f"stream_flat<{u}>" for u in US])
    out = cp.zeros(1 << 16, cp.uint32)
    packs = dim * td.itemsize // 16                      # 16-byte packs per key row
    sms = device.sm_count(0)
    for layout, caches in (("bshd", bshd), ("bhsd", bhsd)):
        cps = [(cp.asarray(k), cp.asarray(v)) for k, v in caches]
        st = caches[0][0].stride()
        key_stride, head_stride = st[1] * td.itemsize // 16, st[2] * td.itemsize // 16
        for chunk in chunks:
            for u in US:
                if chunk % (8 * u):
                    continue
                fn = mod.get_function(f"stream_rows<{u}>")
                calls = rotating(lambda k, v, fn=fn, chunk=chunk: _launcher(
                    fn, (hkv, s // chunk), (128,),
                    (k, v, np.int64(key_stride), np.int64(head_stride), np.int32(chunk), out))(),
                    cps)
                record("A", f"stream_rows {layout} chunk={chunk} ({hkv * s // chunk} blocks) "
                       f"U={u}", graph_replay_us(calls), kv_bytes, layout=layout, chunk=chunk,
                       u=u, regs=fn.num_regs)
    flat = [cp.asarray(torch.cat([k.reshape(-1), v.reshape(-1)])) for k, v in bshd] \
        if bps_list else []
    n = kv_bytes // 16
    for bps in bps_list:
        for u in US:
            fn = mod.get_function(f"stream_flat<{u}>")
            calls = rotating(lambda p, fn=fn, bps=bps: _launcher(
                fn, (sms * bps,), (256,), (p, np.int64(n), out))(), [(p,) for p in flat])
            record("A", f"stream_flat {sms * bps} blocks x 256 U={u}", graph_replay_us(calls),
                   kv_bytes, blocks=sms * bps, u=u)
    del flat
    torch.cuda.empty_cache()

    # B. the op in both layouts, full and split kernel only; torch SDPA
    saved = AD._kernel

    split_only = _without(AD.COMBINE_MODULE, saved)
    ref = go.decode_attention(q, *bshd[0], lens).float()
    for layout, caches in (("bshd", bshd), ("bhsd", bhsd)) if "B" in args.sections else ():
        got = go.decode_attention(q, *caches[0], lens).float()
        dec = rotating(lambda k, v: go.decode_attention(q, k, v, lens), caches)
        record("B", f"decode_attention {layout}", graph_replay_us(dec), kv_bytes, layout=layout,
               max_diff_vs_bshd=float((got - ref).abs().max()))
        AD._kernel = split_only
        try:
            record("B", f"decode_attention {layout} split kernel only", graph_replay_us(dec),
                   kv_bytes, layout=layout)
        finally:
            AD._kernel = saved
        sdpa = rotating(lambda k, v: AD._sdpa(q, k, v), caches)
        record("B", f"torch SDPA {layout}", graph_replay_us(sdpa), kv_bytes, layout=layout)

    # C. keys in flight per group / prefetch (separate modules of the bench's kernel)
    expr = AD._split_expr(dt.bfloat16, dim, AD._vec(dt.bfloat16), 2, False)
    variants = []
    if "C" in args.sections:
        variants += [("default", ()), ("depth2", ("-DGPUOPS_DECODE_DEPTH=2",)),
                     ("u1_depth3", ("-DGPUOPS_DECODE_U=1", "-DGPUOPS_DECODE_DEPTH=3"))]
    if "D" in args.sections:
        variants += [("trace", ("-DGPUOPS_DECODE_TRACE=4096",))]
    dec = rotating(lambda k, v: go.decode_attention(q, k, v, lens), bshd)

    combine_only = _without(AD.SPLIT_MODULE, saved)
    for name, opts in variants:
        mod_v = AD.SPLIT_MODULE if name == "default" else KernelModule(
            f"attention.decode_split_{name}", "attention/decode_split.cu",
            {expr: AD.SPLIT_ARGS}, options=opts)

        def pick(module, dev, e, mod_v=mod_v):
            return saved(mod_v if module is AD.SPLIT_MODULE else module, dev, e)
        AD._kernel = pick
        AD._plans.clear()
        try:
            kern = pick(AD.SPLIT_MODULE, 0, expr)
            per_sm = loader.blocks_per_sm(kern, AD.DECODE_THREADS)
            ns, chunk = AD.num_splits(b, hkv, 1, s, sms * per_sm)
            got = go.decode_attention(q, *bshd[0], lens).float()
            diff = float((got - ref).abs().max())
            us_full = graph_replay_us(dec)
            record("C", f"split {name}: {kern.raw.num_regs} regs {per_sm}/SM {ns}x{chunk}",
                   us_full, kv_bytes, variant=name, regs=kern.raw.num_regs,
                   local_bytes=kern.raw.local_size_bytes, blocks_per_sm=per_sm, splits=ns,
                   chunk=chunk, max_diff=diff)
            if not name.startswith("trace"):
                continue
            # D. the trace of the last call of a graph: full op, then the split kernel alone
            g = loader.load(mod_v, 0).raw.get_global("gpuops_decode_trace")
            blocks = ns * hkv
            for what in ("full", "split only"):
                if what == "split only":
                    AD._kernel = _without(AD.COMBINE_MODULE, pick)
                us = graph_replay_us(dec)
                tr = cp.ndarray((4096, 6), cp.uint64, g)[:blocks].get().astype(np.float64)
                summary = trace_summary(tr)
                summary["graph_us_per_call"] = us
                res.setdefault("trace", {})[f"{name} {what}"] = summary
                print(f"D trace of the last call ({what}, {us:.2f} us per call):",
                      json.dumps(summary), flush=True)
        finally:
            AD._kernel = saved
            AD._plans.clear()
    if "D" in args.sections:
        AD._kernel = combine_only
        try:
            record("D", "decode_attention combine kernel only", graph_replay_us(dec), kv_bytes)
        finally:
            AD._kernel = saved

    # E. the split rule: more, shorter splits (two waves of resident blocks)
    for waves, mc in ((1, 128), (2, 64), (1, 64), (4, 32)) if "E" in args.sections else ():
        saved_split = dict(AD.SPLIT)
        AD.SPLIT.update(waves=waves, min_chunk=mc)
        AD._plans.clear()
        try:
            kern = AD._kernel(AD.SPLIT_MODULE, 0, expr)
            per_sm = loader.blocks_per_sm(kern, AD.DECODE_THREADS)
            ns, chunk = AD.num_splits(b, hkv, 1, s, sms * per_sm)
            record("E", f"waves={waves} min_chunk={mc} ({ns}x{chunk})", graph_replay_us(dec),
                   kv_bytes, waves=waves, min_chunk=mc, splits=ns, chunk=chunk)
            AD._kernel = split_only
            record("E", f"waves={waves} min_chunk={mc} ({ns}x{chunk}) split only",
                   graph_replay_us(dec), kv_bytes, waves=waves, min_chunk=mc, splits=ns,
                   chunk=chunk)
        finally:
            AD._kernel = saved
            AD.SPLIT.clear()
            AD.SPLIT.update(saved_split)
            AD._plans.clear()
    rows_a = [r for r in res["rows"] if r["section"] == "A"]
    if rows_a:
        best = min(rows_a, key=lambda r: r["us"])
        print(f"best read-only launch: {best['what']} {best['us']:.2f} us "
              f"({best['pct_copy']:.1f}% of copy)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
