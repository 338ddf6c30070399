"""Cross-entropy forward + backward at LLM vocabulary sizes: time and peak memory of
gpuops.torch.cross_entropy (default, inplace_backward=True and inplace_backward="forward")
against torch eager, torch.compile and Liger-Kernel's cross-entropy.

    python benchmarks/experiments/cross_entropy_memory.py --json ce.json [--rows 8192,4096]

Each measurement: fresh logits [N, V] (a non-leaf tensor: a clone of a leaf, made outside the
timed region), then ``loss = fn(logits, target)`` and ``torch.autograd.grad(loss, logits)`` between
two CUDA events. Peak memory is ``torch.cuda.max_memory_allocated()`` during that region minus
what was allocated before it (the logits and their source), i.e. what the loss adds. Targets have
5% of rows at ignore_index. Liger and gpuops' inplace_backward="forward" write the gradient
into the logits during the forward, gpuops' inplace_backward=True during the backward; all three
return the logits' memory as the gradient. --scale 0.25 differentiates loss * 0.25 instead of
the loss (a grad_output other than 1, as with gradient accumulation).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F  # noqa: N812


def variants():
    import gpuops.torch as gt
    out = {
        "torch": lambda x, t: F.cross_entropy(x, t),
        "torch.compile": torch.compile(lambda x, t: F.cross_entropy(x, t), dynamic=False),
        "gpuops": lambda x, t: gt.cross_entropy(x, t),
        "gpuops inplace=True": lambda x, t: gt.cross_entropy(x, t, inplace_backward=True),
        "gpuops inplace='forward'": lambda x, t: gt.cross_entropy(x, t,
                                                                  inplace_backward="forward"),
    }
    try:
        from gpuops.ops.loss import liger_cross_entropy_fn
        out["liger"] = liger_cross_entropy_fn()
    except ImportError as exc:
        print(f"(no Liger-Kernel: {exc})")
    return out


def measure(fn, leaf, target, iters, ref=None, scale=1.0):
    times, peaks = [], []
    err = None
    for i in range(iters + 2):                         # two warm-up runs (compilation, caches)
        logits = leaf.clone()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(logits, target)
        (grad,) = torch.autograd.grad(loss * scale if scale != 1.0 else loss, logits)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
            peaks.append(torch.cuda.max_memory_allocated() - base)
        if ref is not None and err is None:
            ref_loss, ref_grad = ref
            err = {"loss_abs": abs(loss.float().item() - ref_loss),
                   "grad_max_abs": (grad.float() - ref_grad * scale).abs().max().item()}
        del loss, grad, logits
    return statistics.median(times), max(peaks), err


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8192,4096")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--json")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "vocab": args.vocab, "dtype": args.dtype, "scale": args.scale, "rows": {}}
    fns = variants()
    for n in [int(r) for r in args.rows.split(",")]:
        torch.manual_seed(0)
        leaf = (torch.randn(n, args.vocab, device="cuda") * 2).to(dtype).requires_grad_()
        target = torch.randint(0, args.vocab, (n,), device="cuda")
        target[torch.rand(n, device="cuda") < 0.05] = -100
        x32 = leaf.detach().float().requires_grad_()
        ref_loss = F.cross_entropy(x32, target)
        (ref_grad,) = torch.autograd.grad(ref_loss, x32)
        ref = (ref_loss.item(), ref_grad)
        del x32
        logits_gb = leaf.numel() * leaf.element_size() / 1e9
        print(f"\nN={n} V={args.vocab} {args.dtype}: logits {logits_gb:.2f} GB; fwd+bwd floor "
              f"(read, read + write) {3 * logits_gb / 3.0:.2f} ms at 3000 GB/s")
        print(f"{'variant':<26}{'ms':>9}{'peak extra GB':>15}{'x logits':>10}{'loss err':>11}"
              f"{'grad err':>11}")
        rows = {}
        for name, fn in fns.items():
            try:
                ms, peak, err = measure(fn, leaf, target, args.iters, ref, args.scale)
            except Exception as exc:  # a peer that fails is reported, not fatal
                rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                print(f"{name:<26} failed: {rows[name]['error']}")
                torch.cuda.empty_cache()
                continue
            rows[name] = {"ms": ms, "peak_extra_bytes": peak, "peak_extra_gb": peak / 1e9,
                          "peak_over_logits": peak / 1e9 / logits_gb, **(err or {})}
            print(f"{name:<26}{ms:9.3f}{peak / 1e9:15.2f}{peak / 1e9 / logits_gb:10.2f}"
                  f"{err['loss_abs']:11.2e}{err['grad_max_abs']:11.2e}")
            torch.cuda.empty_cache()
        results["rows"][str(n)] = rows
        del leaf, ref_grad, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
