"""Linear attention: time against sequence length (issue 5: "time grows linearly in S, plot
S = 1k..64k").

For S = 1k, 2k, ..., 64k (B=1, H=16, D=Dv=64, bf16, feature map elu), causal and not: the time
of gpuops.linear_attention, of the same computation in torch (fp32 einsums, chunks of 64 for the
causal form: gpuops.ops.attention_variants.torch_linear_attention) and of dense SDPA (torch's
default backend; skipped above --sdpa-max), CUDA events, medians after warm-up. Per row also
ns per token (time / (B H S)) and, with --profile, each gpuops kernel's share (torch.profiler).
The summary fits t = a + b S by least squares over S >= 4k for each series and reports the
slope, the intercept and the largest relative deviation from the fit (linear growth: small
deviation, t(64k) / t(16k) near 4).

    python benchmarks/experiments/linear_attention_scaling.py [--json out.json] [--profile]
        [--sdpa-max 32768] [--multiscale]

--multiscale adds multiscale_attention (windows 32 x 4, dilations 1/2/4/8) against dense SDPA
at the same lengths.
"""
from __future__ import annotations

import argparse
import json
import sys

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gpuops as go  # noqa: E402
from gpuops.bench import _Framework  # noqa: E402
from gpuops.ops import attention_variants as av  # noqa: E402

LENGTHS = [1024 * 2**i for i in range(7)]          # 1k .. 64k
B, H, D = 1, 16, 64


def _fit(rows, key):
    pts = [(r["S"], r[key]) for r in rows if isinstance(r.get(key), float) and r["S"] >= 4096]
    if len(pts) < 2:
        return None
    s, t = np.array(pts, dtype=np.float64).T
    b, a = np.polyfit(s, t, 1)
    dev = float(np.max(np.abs((a + b * s) - t) / t))
    by_s = dict(pts)
    ratio = by_s.get(65536, np.nan) / by_s.get(16384, np.nan) if 16384 in by_s else None
    return {"slope_us_per_1k_tokens": float(b * 1024), "intercept_us": float(a),
            "max_rel_deviation_from_linear": dev, "t64k_over_t16k": ratio}


def _kernel_split(fn):
    """us per gpuops kernel (name -> time) over one call, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if any(k in e.key for k in ("linattn", "favor", "multiscale")):
            total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            out[e.key.split("<")[0].split("(")[0]] = total / 5
    return out


def _time(fw, fn):
    try:
        return fw.time_us(fn, budget_s=1.0)
    except Exception as exc:  # noqa: BLE001  (out of memory at long S, ...): reported
        torch.cuda.empty_cache()
        return f"failed: {type(exc).__name__}: {str(exc)[:160]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sdpa-max", type=int, default=32768)
    ap.add_argument("--multiscale", action="store_true")
    args = ap.parse_args()
    fw = _Framework()
    rows = []
    for causal in (False, True):
        for S in LENGTHS:
            q, k, v = (torch.randn(B, H, S, D, device="cuda").to(torch.bfloat16) for _ in range(3))
            ours = lambda: go.linear_attention(q, k, v, causal=causal)  # noqa: E731
            row = {"op": "linear_attention", "causal": causal, "S": S, "B": B, "H": H, "D": D,
                   "dtype": "bfloat16",
                   "gpuops_us": _time(fw, ours),
                   "torch_chunked_us": _time(fw, lambda: av.torch_linear_attention(
                       q, k, v, causal=causal))}
            if S <= args.sdpa_max:
                row["sdpa_us"] = _time(fw, lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=causal))
            if isinstance(row["gpuops_us"], float):
                row["gpuops_ns_per_token"] = row["gpuops_us"] * 1e3 / (B * H * S)
            if args.profile:
                row["gpuops_kernels_us"] = _kernel_split(ours)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    if args.multiscale:
        ws, ds = (32, 32, 32, 32), (1, 2, 4, 8)
        for causal in (False, True):
            for S in LENGTHS:
                q, k, v = (torch.randn(B, H, S, D, device="cuda").to(torch.bfloat16)
                           for _ in range(3))
                row = {"op": "multiscale_attention", "causal": causal, "S": S, "windows": ws,
                       "dilations": ds,
                       "gpuops_us": _time(fw, lambda: go.multiscale_attention(
                           q, k, v, ws, ds, causal=causal))}
                if S <= args.sdpa_max:
                    row["sdpa_us"] = _time(fw, lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal))
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v
                torch.cuda.empty_cache()
    summary = {}
    for op in sorted({r["op"] for r in rows}):
        for causal in (False, True):
            sel = [r for r in rows if r["op"] == op and r["causal"] == causal]
            for key in ("gpuops_us", "torch_chunked_us", "sdpa_us"):
                fit = _fit(sel, key)
                if fit:
                    summary[f"{op} causal={causal} {key}"] = fit
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "linear_fit": summary},
                      f, indent=1)


if __name__ == "__main__":
    main()
