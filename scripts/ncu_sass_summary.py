"""Summarize the SASS page of an Nsight Compute report (device_run.sh's `ncu` stage writes it as
detail/ncu_sass.csv): per kernel, the instructions executed and the warp-stall samples by opcode,
and (--hot) the hottest loop's instructions with their stall samples, to compare one kernel's
inner loop with another's (ours against cuBLAS's, say); (--phases) the kernel's stretches of
code, consecutive instructions executed the same number of times (a phase's loop body, e.g. the
landing, the polls and the drains of norm_ring.cuh's resident_rows, runs 100-103), with their
share of the stall samples and their top stall reasons: where each phase's time goes.

    python scripts/ncu_sass_summary.py detail/ncu_sass.csv [--kernel REGEX] [--hot N]
        [--phases PCT]
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

STALLS = ("selected", "not_selected", "short_sb", "long_sb", "wait", "dispatch", "barrier",
          "mio", "math", "no_inst", "branch_resolving", "lg", "membar", "sleep", "misc")


def kernels(path):
    """Yields (kernel name, [row dicts]) for each kernel section of the CSV."""
    csv.field_size_limit(sys.maxsize)
    name, header, rows = None, None, []
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                if name is not None:
                    yield name, rows
                name, header, rows = rec[1], None, []
            elif header is None:
                header = rec
            else:
                rows.append(dict(zip(header, rec)))
    if name is not None:
        yield name, rows


def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source):
    s = source.strip()
    s = re.sub(r"^@!?U?P\w+\s+", "", s)     # predicate
    return s.split(" ")[0].rstrip(";")


def summarize(name, rows, hot):
    total = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    executed = collections.Counter()
    for r in rows:
        op = opcode(r["Source"])
        n = _num(r["Instructions Executed"])
        executed[op] += n
        for s in STALLS:
            v = _num(r.get(f"stall_{s}", 0))
            by_op[op][s] += v
            total[s] += v
    all_exec = sum(executed.values())
    samples = sum(total.values())
    print(f"\n=== {name[:150]}")
    print(f"instructions executed {all_exec:.4g}; samples {samples:.0f}; by stall: " + ", ".join(
        f"{s} {100 * total[s] / samples:.1f}%" for s in STALLS if total[s] > 0.005 * samples))
    print(f"{'opcode':<14}{'executed':>10}{'share':>7}  samples: " + " ".join(
        f"{s[:8]:>8}" for s in STALLS[:9]))
    for op, n in executed.most_common(16):
        c = by_op[op]
        print(f"{op:<14}{n:10.4g}{100 * n / all_exec:6.1f}%  " + " ".join(
            f"{c[s]:8.0f}" for s in STALLS[:9]))
    if hot:
        # the hottest stretch: instructions executed at the most common high count
        counts = collections.Counter(_num(r["Instructions Executed"]) for r in rows)
        top = max((n for n in counts if counts[n] >= 16), default=None)
        if top is None:
            return
        idx = [i for i, r in enumerate(rows) if _num(r["Instructions Executed"]) == top]
        lo, hi = idx[0], idx[-1]
        print(f"hot loop: {len(idx)} instructions executed {top:.4g} times each "
              f"(rows {lo}..{hi}); per instruction: samples " + " ".join(STALLS[:8]))
        for r in rows[lo:hi + 1][:hot]:
            print(f"  {r['Source'].strip()[:64]:<64} " + " ".join(
                f"{_num(r.get(f'stall_{s}', 0)):5.0f}" for s in STALLS[:8]))


def phases(rows, min_pct):
    """Consecutive SASS rows with one execution count, with >= min_pct % of the samples."""
    stretches = []
    for i, r in enumerate(rows):
        n = _num(r["Instructions Executed"])
        if not stretches or stretches[-1]["executed"] != n:
            stretches.append({"first": i, "executed": n, "source": r["Source"].strip()[:40],
                              "stalls": collections.Counter()})
        for s in STALLS:
            stretches[-1]["stalls"][s] += _num(r.get(f"stall_{s}", 0))
    samples = sum(sum(st["stalls"].values()) for st in stretches) or 1.0
    print(f"phases (>= {min_pct}% of {samples:.0f} samples): first row, executed, share, "
          "top stalls, first instruction")
    for st in stretches:
        n = sum(st["stalls"].values())
        if 100 * n / samples >= min_pct:
            top = ", ".join(f"{s} {v:.0f}" for s, v in st["stalls"].most_common(3) if v > 0)
            print(f"  {st['first']:6d} {st['executed']:9.0f} {100 * n / samples:5.1f}%  "
                  f"{top:<44} {st['source']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--kernel", default="", help="regex on the kernel name")
    ap.add_argument("--hot", type=int, default=0, help="print this many hot-loop instructions")
    ap.add_argument("--phases", type=float, default=None, metavar="PCT",
                    help="print the stretches of one execution count with >= PCT %% of samples")
    args = ap.parse_args()
    seen = set()
    for name, rows in kernels(args.csv):
        if re.search(args.kernel, name) and name not in seen:   # (a report may list it twice)
            seen.add(name)
            summarize(name, rows, args.hot)
            if args.phases is not None:
                phases(rows, args.phases)


if __name__ == "__main__":
    main()
