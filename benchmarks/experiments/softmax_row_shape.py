"""Softmax / log_softmax rows held in registers (softmax_rows.cu): the (threads per row, packs
per thread) that row_config picks against forced ones, same inputs, same run, CUDA-graph replay
(5 calls per graph, median of 20 replays), Liger's softmax beside them.

Why (run 171, H200, fp32 [131072, 1024]): softmax 262.4 us against Liger's 255.1 (a block of 128
threads x 8 floats per row); row_config gives a row of 256 16-byte packs one warp of 8 packs per
thread (8 rows per block of 256 threads). Floor: 1074 MB / 4252 GB/s = 252.5 us.

  python benchmarks/experiments/softmax_row_shape.py --shapes 131072x1024 --dtypes float32 \\
      --configs auto,32x8,64x4,128x2,256x1
Each config "TxP" forces T threads per row (a warp or less: several rows per block of 256) and
P packs per thread (one of softmax.ROW_P); "auto" is row_config's pick. Each row prints the
largest difference from the auto output (0 or a rounding step: the sums' order differs).
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")

import gpuops as go  # noqa: E402
from gpuops import dtypes as dt  # noqa: E402
from gpuops.bench import (_Framework, add_bandwidth_row, graph_replay_us,  # noqa: E402
                          write_rows_json)
from gpuops.ops import softmax as S  # noqa: E402


class _Forced:
    """row_config returning (threads, packs) for every row of the vectorized path."""

    def __init__(self, name):
        self.shape = None if name == "auto" else tuple(int(v) for v in name.split("x"))

    def __enter__(self):
        self.saved = S.row_config
        S._PLANS.clear()
        if self.shape is not None:
            tx, p = self.shape
            saved = self.saved

            def forced(packs, choices, few_rows=False):
                if p not in choices or tx * p < packs:
                    return saved(packs, choices, few_rows)
                return tx, p
            S.row_config = forced

    def __exit__(self, *exc):
        S.row_config = self.saved
        S._PLANS.clear()
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--configs", default="auto,32x8,64x4,128x2,256x1")
    ap.add_argument("--shapes", default="131072x1024,65536x2048,32768x4096")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    fw = _Framework()
    torch = fw.torch
    copy = fw.copy_bandwidth_gbps()
    print(f"copy {copy:.0f} GB/s", flush=True)
    try:
        liger = S._liger_softmax()["liger"]
    except ImportError:
        liger = None
    rows = []
    for shape in [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]:
        for d in [dt.BY_NAME[s] for s in args.dtypes.split(",") if s]:
            x = fw.randn(shape, d)
            nbytes = 2 * x.numel() * d.itemsize
            for op in ("softmax", "log_softmax"):
                fn = getattr(go, op)
                reference = None
                for config in [c for c in args.configs.split(",") if c]:
                    with _Forced(config):
                        out = fn(x)
                        if reference is None:
                            reference = out.clone()
                        diff = float((out.float() - reference.float()).abs().max())
                        plan = S._PLANS[next(iter(S._PLANS))]
                        (_, expr, grid, block, _), = plan.steps
                        us = graph_replay_us(lambda: fn(x), calls=5)
                    add_bandwidth_row(rows, copy, op, shape, d, config, us, nbytes,
                                      f"{expr.split('::')[-1]} block {block[:2]} "
                                      f"maxdiff {diff:.3g}")
                if liger is not None and op == "softmax":
                    us = graph_replay_us(lambda: liger(x), calls=5)
                    add_bandwidth_row(rows, copy, op, shape, d, "liger", us, nbytes, "")
            del x
            torch.cuda.empty_cache()
    write_rows_json(args.json, copy, rows)



if __name__ == "__main__":
    main()
