"""Where the time of the backward's column plan goes (norms.BACKWARD_LONG_ROWS = "columns";
notes_norms.md, "The backward's long rows by columns"): rms_norm_backward on long rows, CUDA-graph
timed, as the whole op and as its three kernels alone:
  op           go.rms_norm_backward (stats, row sums, apply)
  stats        norm_bwd_cols_stats alone (reads dy and x: 2N)
  sums         norm_bwd_row_sums alone
  apply        norm_bwd_cols_apply alone, replayed back to back: its re-read starts cold
               (the previous replay read those rows first, long before)
  stats+apply  the three kernels launched here (= op, as a check of the pieces)
  bands<B>     the three kernels per band of rows/B rows (timing only: each band's dw overwrites
               the last's): how much an apply pass gains when its rows' bytes are still in L2
Bytes per line: what the piece moves at least (stats 2N, apply 3N, op 3N; N = one tensor).
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")

import gpuops as go  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import _Framework, graph_replay_us, write_rows_json  # noqa: E402
from gpuops.ops import norms as N  # noqa: E402

SHAPES = ((16, 1048576), (8, 393216))


def _pieces(torch, x, dy, w, rstd, d, rows_range=None):
    """Launchers of the three kernels (and of all three) on rows [r0, r1) of x / dy, as the op
    launches them (a [groups, n] dw workspace where there are several groups); the buffers they
    write ride along in the dict ("keep") so that they outlive the launchers' captures."""
    rows, n = x.shape
    r0, r1 = rows_range or (0, rows)
    sub = r1 - r0
    cp = N._cols_plan(False, d, 16 // d.itemsize, n, sub, 0)
    ws = torch.empty(sub * (cp.chunks + 1), device="cuda", dtype=torch.float32)
    partials, sums = ws.data_ptr(), ws.data_ptr() + 4 * sub * cp.chunks
    dw_ws = torch.empty(cp.groups * n if cp.groups > 1 else 1, device="cuda",
                        dtype=torch.float32)
    dw_part = dw_ws.data_ptr() if cp.groups > 1 else 0
    dx = torch.empty_like(x)
    dw = torch.empty_like(w)
    es = x.element_size()
    xp, gp, dxp = (t.data_ptr() + r0 * n * es for t in (x, dy, dx))
    rp = rstd.data_ptr() + 4 * r0
    grid, block = (cp.grid_x, cp.groups, 1), (N.COLS_THREADS, 1, 1)

    def stream():
        return torch.cuda.current_stream().cuda_stream

    def stats():
        cp.stats.launch(grid, block, stream(), gp, n, xp, n, 0, rp, w.data_ptr(), partials,
                        dw_part, 0, dw.data_ptr(), 0, sub, n, cp.chunks, cp.rows_per_group)

    def sums_():
        cp.sums.launch((min(sub, 1 << 16), 1, 1), (256, 1, 1), stream(), partials, sums, sub,
                       cp.chunks)

    def apply():
        cp.apply.launch(grid, block, stream(), gp, n, xp, n, 0, 0, 0, rp, w.data_ptr(), sums,
                        dxp, n, sub, n, cp.chunks, cp.rows_per_group)

    def all3():
        stats()
        sums_()
        apply()
    return dict(stats=stats, sums=sums_, apply=apply, all3=all3, keep=(ws, dw_ws, dx, dw)), cp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    fw = _Framework()
    torch = fw.torch
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    out = []
    for shape in SHAPES:
        for d in (dt.bfloat16, dt.float32):
            x, dy = fw.randn(shape, d), fw.randn(shape, d)
            w = fw.randn(shape[-1:], d)
            _, rstd = go.rms_norm_forward(x, shape[-1:], w, 1e-6)
            N_bytes = x.numel() * d.itemsize
            fns, cp = _pieces(torch, x, dy, w, rstd, d)
            lines = [("op", lambda: go.rms_norm_backward(dy, x, rstd, shape[-1:], w),
                      3 * N_bytes),
                     ("stats", fns["stats"], 2 * N_bytes), ("sums", fns["sums"], 0),
                     ("apply", fns["apply"], 3 * N_bytes),
                     ("stats+apply", fns["all3"], 3 * N_bytes)]
            for bands in (2, 4):
                if shape[0] % bands == 0:
                    step = shape[0] // bands
                    parts = [_pieces(torch, x, dy, w, rstd, d, (b * step, (b + 1) * step))[0]
                             for b in range(bands)]
                    lines.append((f"bands{bands}",
                                  lambda parts=parts: [p["all3"]() for p in parts], 3 * N_bytes))
            for name, fn, nbytes in lines:
                fn()
                us = graph_replay_us(fn)
                pct = 100 * nbytes / (us * 1e-6) / 1e9 / copy if nbytes else None
                out.append(dict(shape=list(shape), dtype=d.name, line=name, us=us, pct_copy=pct,
                                chunks=cp.chunks, grid=[cp.grid_x, cp.groups]))
                print(f"{str(shape):<14}{d.name:<9}{name:<12}{us:8.1f} us"
                      + (f" {pct:5.1f}% of copy" if pct else ""), flush=True)
    write_rows_json(args.json, copy, out)


if __name__ == "__main__":
    main()
