"""Programmatic dependent launch (PDL) at decode sizes: issue 3's decode rows ([16, 2048],
[16, 1, 32, 8, 128]), where a call is a launch gap plus a short kernel body.

The kernels of the modules declared pdl=True (norms, softmax, rotary, pointwise, gated backward)
start with gpuops::pdl_start() and are launched as PDL secondaries on sm_90+ (GPUOPS_PDL=1, the
default). For each op at its decode shape, per call, in one process:
- chain: GPU us from a CUDA graph of CALLS calls back to back (a model whose neighbouring kernels
  are gpuops kernels), PDL on / off, and each peer (torch, Liger where installed);
- mixed: each call preceded by a foreign torch kernel (add_ on 64 KB; it never triggers its
  dependents early), minus that kernel's own graph time: what PDL gives next to non-gpuops kernels;
- eager: host us per call back to back (PDL launches go through cuLaunchKernelEx by ctypes);
- body: the kernels' own GPU time (torch.profiler / CUPTI, eager, PDL off), kernels per call.
(Run 73 also timed the norms with their weights loaded ahead of the reduction, an A/B since
removed: benchmarks/NOTES.md.)
--variant LABEL:STATEMENT (repeatable) adds "ours" with a host setting changed while it is called
(and captured), PDL on, e.g. `--variant "two_pass:norms.WHOLE_ROWS = 'two_pass'"` or
`--variant "t128:norms.TUNING['layer_norm'] = replace(norms.TUNING['layer_norm'], target=128)"`
(the statement runs with `norms` = gpuops.ops.norms, dataclasses.replace and tune(**fields),
which replaces fields of every forward Kind of the norms; module globals it sets are restored
after each call; device_run.sh splits EXPERIMENTS on spaces: write statements without them). Its output's largest difference from the default's is kept.
Rounds alternate the variants; each figure is the median over ROUNDS rounds of a median over
REPLAYS replays. Outputs of PDL on and off are compared bit for bit first.

    python benchmarks/experiments/decode_pdl.py [--ops a,b] [--dtypes bfloat16,float32] [--json F]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
from math import prod

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402

from gpuops import dtypes as dt  # noqa: E402
from gpuops import registry  # noqa: E402
from gpuops.bench import (_Framework, _peers, back_to_back_us, graph_replay_us,  # noqa: E402
                          kernel_us, write_experiment_json)
from gpuops.runtime import config  # noqa: E402

CALLS = 50
REPLAYS = 20
ROUNDS = 3
OPS = ("rms_norm", "layer_norm", "add_rms_norm", "softmax", "log_softmax", "softmax_backward",
       "log_softmax_backward", "rms_norm_backward", "layer_norm_backward",
       "add_rms_norm_backward", "apply_rotary", "apply_rotary_backward", "qk_norm_rotary",
       "qk_norm_rotary_backward", "silu_mul", "silu_mul_backward")


def decode_shape(spec, d):
    shapes = [tuple(s) for s in spec.extra_shapes if prod(s) <= (1 << 20)]
    if shapes:
        return min(shapes, key=prod)
    default = tuple(spec.default_shape(d))
    return (16, 2048) if len(default) == 2 else None


def set_pdl(on: bool):
    os.environ["GPUOPS_PDL"] = "1" if on else "0"
    config.refresh()


def graph_us(fn):
    return graph_replay_us(fn, calls=CALLS, replays=REPLAYS)


def host_variant(statement: str, fn):
    """fn called with `statement` in force (module globals of gpuops.ops.norms restored after)."""
    from gpuops.ops import norms
    def tune(**fields):      # every forward Kind of the norms at once, e.g. tune(target=128)
        for k, v in list(norms.TUNING.items()):
            if not k.endswith("_bwd"):
                norms.TUNING[k] = dataclasses.replace(v, **fields)
    names = {"norms": norms, "replace": dataclasses.replace, "tune": tune}
    code = compile(statement, "<variant>", "exec")

    def run():
        saved = {k: copy.copy(v) for k, v in vars(norms).items() if k.isupper()}
        try:
            exec(code, names)  # noqa: S102  an experiment's own command line
            return fn()
        finally:
            for k, v in saved.items():
                setattr(norms, k, v)
    return run


def outputs(res):
    return res if isinstance(res, tuple) else (res,)


def measure(op, d, foreign, foreign_us, host_variants=()):
    shape = decode_shape(op.bench, d)
    if shape is None:
        return None
    fw = _Framework()
    args, kwargs = op.bench.make_inputs(shape, d, fw.randn)
    ours = lambda: op.function(*args, **kwargs)  # noqa: E731
    peers = {n: (lambda f=f: f(*args, **kwargs)) for n, f in _peers(op.bench, fw, False).items()}
    row = {"op": op.name, "dtype": d.name, "shape": list(shape)}
    set_pdl(True)
    on = [o.clone() for o in outputs(ours())]
    set_pdl(False)
    off = outputs(ours())
    row["pdl_equals_stream_order"] = all(torch.equal(a, b) for a, b in zip(on, off))
    variants = {"pdl": (True, ours), "no_pdl": (False, ours)}
    for label, statement in host_variants:
        fn = host_variant(statement, ours)
        variants[label] = (True, fn)
        got = outputs(fn())
        row.setdefault("variant_max_abs_diff", {})[label] = max(
            float((a.float() - b.float()).abs().max()) for a, b in zip(got, on))
    variants.update({n: (None, f) for n, f in peers.items()})
    chain = {n: [] for n in variants}
    mixed = {n: [] for n in variants}
    for _ in range(ROUNDS):
        for name, (pdl, fn) in variants.items():
            if pdl is not None:
                set_pdl(pdl)
            try:
                chain[name].append(graph_us(fn))
                mixed[name].append(graph_us(lambda fn=fn: (foreign(), fn())) - foreign_us)
            except Exception as exc:  # noqa: BLE001  a peer that cannot be captured
                row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:200]
    row["chain_us"] = {n: statistics.median(v) for n, v in chain.items() if v}
    row["mixed_us"] = {n: statistics.median(v) for n, v in mixed.items() if v}
    row["eager_us"] = {}
    for name, (pdl, fn) in variants.items():
        if pdl is not None:
            set_pdl(pdl)
        row["eager_us"][name] = back_to_back_us(fn, calls=CALLS, warmup=10)
    set_pdl(False)
    row["body_us"], row["kernels_per_call"] = {}, {}
    for name, (pdl, fn) in variants.items():
        if name == "pdl":
            continue
        try:
            row["body_us"][name], row["kernels_per_call"][name] = kernel_us(fn, CALLS)
        except Exception as exc:  # noqa: BLE001  the profiler is a diagnostic only
            row.setdefault("errors", {})[f"body {name}"] = f"{type(exc).__name__}: {exc}"[:200]
    set_pdl(True)
    return row


def fmt(v):
    return f"{v:6.2f}" if isinstance(v, float) else f"{'-':>6}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--json")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:STATEMENT, ours with a host setting changed (see the docstring)")
    a = ap.parse_args()
    host_variants = [tuple(v.split(":", 1)) for v in a.variant]
    buf = torch.zeros(16, 1024, device="cuda")
    foreign = lambda: buf.add_(1.0)  # noqa: E731
    foreign_us = statistics.median(graph_us(foreign) for _ in range(ROUNDS))
    print(f"{torch.cuda.get_device_name()}; foreign kernel (add_ of 64 KB) {foreign_us:.2f} us "
          f"per call in a graph; {CALLS} calls per graph, median of {ROUNDS} x {REPLAYS} replays")
    print(f"{'op':<26}{'dtype':<10}{'shape':<18} chain: pdl  no_pdl  peers...  | mixed: pdl "
          f"no_pdl peers... | eager: pdl no_pdl | body: ours peers (kernels/call)")
    rows = []
    for name in a.ops.split(","):
        op = registry.get(name)
        for dn in a.dtypes.split(","):
            d = dt.BY_NAME[dn]
            if op.bench is None or d not in op.dtypes:
                continue
            try:
                row = measure(op, d, foreign, foreign_us, host_variants)
            except Exception as exc:  # noqa: BLE001  report and go on
                row = {"op": name, "dtype": dn, "error": f"{type(exc).__name__}: {exc}"[:300]}
            if row is None:
                continue
            rows.append(row)
            if "error" in row:
                print(f"{name:<26}{dn:<10} error: {row['error']}", flush=True)
                continue
            peers = [n for n in row["chain_us"] if n not in ("pdl", "no_pdl")]
            if row.get("variant_max_abs_diff"):
                print(f"{'':<26}variants' largest |difference| from ours: "
                      f"{row['variant_max_abs_diff']}")
            c, m, e, b = row["chain_us"], row["mixed_us"], row["eager_us"], row["body_us"]
            k = row["kernels_per_call"]
            print(f"{name:<26}{dn:<10}{'x'.join(map(str, row['shape'])):<18}"
                  f"{fmt(c.get('pdl'))}{fmt(c.get('no_pdl'))} "
                  + " ".join(f"{p} {fmt(c.get(p))}" for p in peers)
                  + f" | {fmt(m.get('pdl'))}{fmt(m.get('no_pdl'))} "
                  + " ".join(f"{fmt(m.get(p))}" for p in peers)
                  + f" | {fmt(e.get('pdl'))}{fmt(e.get('no_pdl'))} | {fmt(b.get('no_pdl'))}"
                  f"({k.get('no_pdl', 0):.0f}) "
                  + " ".join(f"{fmt(b.get(p))}({k.get(p, 0):.0f})" for p in peers)
                  + ("" if row["pdl_equals_stream_order"] else "  PDL OUTPUT DIFFERS")
                  + (f"  errors {row['errors']}" if row.get("errors") else ""), flush=True)
            torch.cuda.empty_cache()
    if a.json:
        write_experiment_json(a.json, None, rows, foreign_us=foreign_us, calls=CALLS,
                              replays=REPLAYS, rounds=ROUNDS)


if __name__ == "__main__":
    main()
