"""SASS of gpuops kernels, built here with NVRTC (no GPU needed), and the instruction mix of their
K-tile loops: instructions issued per tensor-core instruction (HMMA/IMMA) on the loop's
steady-state path.

    python scripts/gemm_sass.py [--arch 90|90a] [--module gemm.mma_bf16] [--kernel SUBSTRING] \
        [--trips N] [--dump FILE.sass]

Without --kernel, every kernel of the module is reported. Loops are backward branches; the
K-tile loops are the outermost loops holding HMMAs (a kernel may have several: one per load
path). The steady-state path through one iteration is found on the control-flow graph: all the
math (HMMA, LDSM), the global loads issued, and the fewest instructions otherwise (full tiles,
not the predicated edge/tail path nor one-off branches). A rolled inner loop (the first mma
kernel's kk loop: --trips 2) counts N times. Needs nvdisasm (pip: nvidia-cuda-nvdisasm).
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuops.runtime import nvrtc  # noqa: E402
from gpuops.runtime.modules import get_module  # noqa: E402


def _nvdisasm() -> str:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    import nvidia  # noqa: PLC0415
    for root in nvidia.__path__:
        hits = glob.glob(os.path.join(root, "**", "bin", "nvdisasm"), recursive=True)
        if hits:
            return hits[0]
    raise SystemExit("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_FUNC = re.compile(r"^\s*\.text\.(\S+):")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def _elf_padded(image: bytes) -> bytes:
    """CuPy's getCUBIN drops the image's trailing NUL bytes (a C string); nvdisasm wants the ELF
    whole: pad it back to the end of its program and section header tables."""
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    size = max(phoff + phentsize * phnum, shoff + shentsize * shnum, len(image))
    return image + b"\0" * (size - len(image))


def disassemble(image: bytes) -> dict:
    """{mangled kernel name: [(address, text), ...]}"""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(_elf_padded(image))
        out = subprocess.run([_nvdisasm(), "-c", str(path)],
                             capture_output=True, text=True, check=True).stdout
    funcs: dict = {}
    labels: dict = {}
    pending: list = []
    cur = None
    for line in out.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.search(line)
        if m and cur is not None:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            funcs[cur].append((addr, m.group(2).strip()))
    # branch targets as addresses
    def resolve(mm):
        return f"0x{labels.get(mm.group(1), 0):x}"

    for name, insns in funcs.items():
        funcs[name] = [(a, re.sub(r"`\((\.L_x_\d+)\)", resolve, t)) for a, t in insns]
    return funcs


def opcode(text: str) -> str:
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    return t.split()[0] if t else ""


def loops(insns):
    """(start, end) address ranges of backward branches, innermost first."""
    out = []
    for addr, text in insns:
        op = opcode(text)
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) <= addr:
                out.append((int(m.group(1), 16), addr))
    return sorted(out, key=lambda r: r[1] - r[0])


def _target(text):
    m = re.search(r"0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


_WORK = ("HMMA", "IMMA", "LDSM")
_LOADS = ("LDGSTS", "LDG.")   # not LDGDEPBAR (the commit, on every path)


def hot_path(insns, lo, hi, trips, cold):
    """The steady state of one iteration of the loop [lo, hi]: of the paths through it that avoid
    basic blocks holding a `cold` opcode, the one with all the math (HMMA, LDSM) that issues
    global loads and, among those, has the fewest instructions: full tiles, no per-element or
    predicated fallback, no one-off branches (prefetches). Inner loops count `trips` times."""
    body = [(a, t) for a, t in insns if lo <= a <= hi]
    addrs = [a for a, _ in body]
    index = {a: i for i, a in enumerate(addrs)}
    inner = [(l, h) for l, h in loops(body) if (l, h) != (lo, hi) and lo <= l and h < hi]
    # basic-block leaders: the loop start, branch targets, instructions after branches
    leaders = {0}
    for i, (a, t) in enumerate(body):
        if opcode(t).startswith(("BRA", "EXIT", "RET")):
            leaders.add(i + 1)
            tg = _target(t)
            if tg in index:
                leaders.add(index[tg])
    starts = sorted(x for x in leaders if x < len(body))
    block_of = {}
    for bi, st in enumerate(starts):
        en = starts[bi + 1] if bi + 1 < len(starts) else len(body)
        for i in range(st, en):
            block_of[i] = bi
    cold_blocks = {block_of[i] for i, (a, t) in enumerate(body)
                   if any(opcode(t).startswith(c) for c in cold)}

    def weight(i):
        a = body[i][0]
        return trips if any(l <= a <= h for l, h in inner) else 1

    NEG = (float("-inf"), 0, 0)
    # best (math work, issues cp.async, -instructions) from i to the loop's back edge: all the
    # math, the loads issued (not the path of a K tile past the end), the fewest instructions
    # (full tiles, not the predicated edge or tail path)
    best = [NEG] * (len(body) + 1)
    nxt = [None] * (len(body) + 1)
    best[len(body)] = (0, 0, 0)
    for i in range(len(body) - 1, -1, -1):
        if block_of[i] in cold_blocks:
            continue
        a, t = body[i]
        op = opcode(t)
        succ = []
        is_bra = op.startswith("BRA")
        tg = _target(t) if is_bra else None
        backedge = is_bra and tg is not None and tg <= a
        # BRA.DIV (a __syncwarp's divergence test) falls through on a converged warp
        conditional = t.startswith("@") or op.startswith("BRA.DIV")
        if i == len(body) - 1 and backedge and tg == lo:
            succ = [len(body)]                      # the loop's own back edge: iteration ends
        elif backedge:
            succ = [i + 1]                          # an inner loop's back edge: counted by weight
        elif is_bra:
            if tg in index and tg > a:
                succ.append(index[tg])
            if conditional:
                succ.append(i + 1)
        elif op.startswith(("EXIT", "RET")):
            succ = []
        else:
            succ = [i + 1]
        cands = [(best[j], j) for j in succ if j <= len(body) and best[j] > NEG]
        if cands:
            (work, loads, neg_n), j = max(cands)
            w = weight(i)
            best[i] = (work + (w if op.startswith(_WORK) else 0),
                       max(loads, int(op.startswith(_LOADS) or op == "LDG")), neg_n - w)
            nxt[i] = j
    path, i = [], 0
    while i is not None and i < len(body):
        path.extend([body[i][1]] * weight(i))
        i = nxt[i]
    return path


def main_loops(insns, trips, cold):
    """The k-tile loops: the outermost loops whose bodies hold HMMAs (a kernel may have several,
    e.g. one per load path). Returns [((lo, hi), hot path, opcode counts, #HMMA)]."""
    tc = ("HMMA", "IMMA")
    with_tc = []
    for lo, hi in loops(insns):
        if any(opcode(t).startswith(tc) for a, t in insns if lo <= a <= hi):
            with_tc.append((lo, hi))
    outer = [(lo, hi) for lo, hi in with_tc
             if not any((l2, h2) != (lo, hi) and l2 <= lo and hi <= h2 for l2, h2 in with_tc)]
    # not a loop: a jump back from an out-of-line path (a __syncwarp's diverged-warp path after
    # BRA.DIV) into the middle of a loop it overlaps
    outer = [(lo, hi) for lo, hi in outer
             if not any(l2 < lo < h2 < hi for l2, h2 in outer)]
    out = []
    for lo, hi in sorted(outer):
        path = hot_path(insns, lo, hi, trips, cold)
        ops = collections.Counter(opcode(t).split(".")[0] for t in path)
        out.append(((lo, hi), path, ops, sum(ops[o] for o in tc)))
    return out


def report(name, insns, resources, trips, cold):
    print(f"== {name}")
    r = resources.get(name)
    if r:
        print(f"   registers {r['registers']}, stack {r['stack']}, spills {r['spill_stores']}/"
              f"{r['spill_loads']}")
    found = main_loops(insns, trips, cold)
    if not found:
        print("   no loop with tensor-core instructions")
        return
    spills = [t for a, t in insns if opcode(t).startswith(("LDL", "STL"))]
    if spills:
        print(f"   {len(spills)} local-memory instructions (LDL/STL)")
    for (lo, hi), path, ops, n_tc in found:
        total = len(path)
        body_spills = sum(1 for a, t in insns
                          if lo <= a <= hi and opcode(t).startswith(("LDL", "STL")))
        print(f"   k-tile loop 0x{lo:x}..0x{hi:x} ({body_spills} LDL/STL in its body), hot path: "
              f"{total} instructions, {n_tc} HMMA/IMMA -> {total / max(n_tc, 1):.2f} per HMMA "
              f"({(total - n_tc) / max(n_tc, 1):.2f} besides it)")
        print("     " + ", ".join(f"{o} {c}" for o, c in ops.most_common()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--module", default="gemm.mma_bf16")
    ap.add_argument("--arch", default="90", help="90, 90a (arch-specific modules), 86, ...")
    ap.add_argument("--kernel", default=None, help="substring of the name expression")
    ap.add_argument("--dump", default=None, help="write the selected kernels' SASS here")
    ap.add_argument("--trips", type=int, default=1,
                    help="iterations of a rolled inner (kk) loop per k-tile")
    ap.add_argument("--cold", default="",
                    help="opcodes whose basic blocks are off the steady-state path")
    args = ap.parse_args(argv)
    m = get_module(args.module)
    exprs = [e for e in m.name_expressions if args.kernel is None or args.kernel in e]
    if not exprs:
        raise SystemExit(f"no kernel of {m.name} matches {args.kernel!r}")
    comp = nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name,
                                nvrtc.Target.parse(str(args.arch)), m.options, exprs, verbose=True)
    funcs = disassemble(comp.image)
    dump = open(args.dump, "w") if args.dump else None
    for expr in exprs:
        mangled = comp.lowered[expr]
        print(expr)
        report(mangled, funcs.get(mangled, []), comp.resources, args.trips,
               tuple(c for c in args.cold.split(",") if c))
        if dump:
            dump.write(f"// {expr}\n")
            for a, t in funcs.get(mangled, []):
                dump.write(f"/*{a:04x}*/ {t};\n")
    if dump:
        dump.close()


if __name__ == "__main__":
    main()
