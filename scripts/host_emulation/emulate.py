"""Runs gpuops' CUDA kernels on the CPU, for checking kernel logic on a machine without a GPU.

``build(modules)`` compiles the modules' sources (as gpuops assembles them) with g++ against
``cuda_host_shim.h``: every CUDA thread of a launch becomes an OS thread, __syncthreads a
per-block barrier, warp shuffles a per-warp exchange, __shared__ variables per-block storage,
atomics and fences C++ atomics, the few inline-PTX helpers their C++ equivalents (the pre-sm_80
code paths are the ones compiled). ``EmuLoaded`` stands in for a loaded module, so that the ops'
own launch code can drive the kernels on CPU memory (e.g. torch CPU tensors).

What it cannot show: GPU memory-model effects (weak ordering, L1 incoherence), occupancy,
performance. Blocks run 16 at a time (the emulated device holds 16 blocks: a one-launch grid of
split rows must fit, as on a GPU).
"""
import ctypes
import hashlib
import os
import re
import subprocess
from pathlib import Path

from gpuops.runtime.sources import assemble

HERE = Path(__file__).resolve().parent
BUILD_DIR = os.environ.get("GPUOPS_EMU_BUILD", "/tmp/gpuops-host-emulation")

REPLACE = [
    ('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));', 'f = emu_half_to_float(v.bits);'),
    ('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));', 'h.bits = emu_float_to_half(f);'),
    ('asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));', 'y = std::exp2(x);'),
    ('asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));', 'y = 1.0f / x;'),
    ('asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));', 'v = emu_load_cg(p);'),
    ('asm volatile("st.global.cg.f32 [%0], %1;" ::"l"(p), "f"(v) : "memory");', 'emu_store_cg(p, v);'),
    ('while (*reinterpret_cast<const volatile unsigned*>(counter) < target) {',
     'while (emu_load_counter(counter) < target) { std::this_thread::yield();'),
]
VEC_F16_UNPACK = re.compile(r'asm\("\{\.reg \.b16 lo, hi;.*?: "r"\(w\[i\]\)\);', re.S)
VEC_F16_PACK = re.compile(r'asm\("\{\.reg \.b16 l, h;.*?: "f"\(lo\), "f"\(hi\)\);', re.S)
SHARED = re.compile(r'__shared__\s+(float|unsigned)\s+(\w+)((?:\[[^\]]+\])*)\s*;')


def host_source(rel):
    text = assemble(rel).text
    for a, b in REPLACE:
        text = text.replace(a, b)
    text = VEC_F16_UNPACK.sub('f[2 * i] = emu_half_to_float(w[i] & 0xffffu); '
                              'f[2 * i + 1] = emu_half_to_float(w[i] >> 16);', text)
    text = VEC_F16_PACK.sub('u = emu_float_to_half(lo) | (unsigned(emu_float_to_half(hi)) << 16);',
                            text)
    counter = [0]

    def shared(m):
        counter[0] += 1
        t, name, dims = m.group(1), m.group(2), m.group(3)
        return f"{t} (&{name}){dims} = *emu_shared<{t}{dims}>({counter[0]});" if dims else \
            f"{t}& {name} = *emu_shared<{t}>({counter[0]});"
    text = SHARED.sub(shared, text)
    return text


CTYPE = {"P": "void*", "q": "long long", "i": "int", "f": "float"}


def wrapper(idx, expr, spec):
    args = []
    for p, (off, size, align) in zip(spec.params, spec.layout):
        if p == "P":
            args.append(f"AnyPtr{{*(void* const*)(a + {off})}}")
        else:
            args.append(f"*({CTYPE[p]} const*)(a + {off})")
    return f"static void w{idx}(const char* a) {{ {expr}({', '.join(args)}); }}\n"


DRIVER = r'''
struct AnyPtr { void* p; template <class T> operator T*() const { return (T*)p; } };
typedef void (*emu_fn)(const char*);
extern emu_fn emu_table[];
struct EmuArgs { emu_fn fn; const char* args; EmuBlock* block; emu_uint3 b, t, bd, gd; int linear; };
static void* emu_thread(void* p) {
  EmuArgs* a = (EmuArgs*)p;
  blockIdx = a->b; threadIdx = a->t; blockDim = a->bd; gridDim = a->gd;
  emu_block = a->block; emu_linear = a->linear;
  a->fn(a->args);
  emu_block->warps[emu_linear / 32]->bar.arrive_and_drop();
  emu_block->bar->arrive_and_drop();
  return nullptr;
}
#include <pthread.h>
#include <cstdio>
extern "C" int emu_launch_range(int, unsigned, unsigned, unsigned, unsigned, const char*, unsigned, unsigned);
extern "C" int emu_launch(int idx, unsigned gx, unsigned gy, unsigned bx, unsigned by, const char* args) {
  const unsigned threads = bx * by;
  const unsigned blocks = gx * gy;
  // blocks run in batches of 16 (the emulated device holds 16 blocks at once: all blocks of a
  // one-launch split-row grid run concurrently, as on the GPU)
  if (blocks > 16) {
    for (unsigned first = 0; first < blocks; first += 16) {
      const unsigned count = std::min(16u, blocks - first);
      int rc = emu_launch_range(idx, gx, gy, bx, by, args, first, count);
      if (rc) return rc;
    }
    return 0;
  }
  return emu_launch_range(idx, gx, gy, bx, by, args, 0, blocks);
}
extern "C" int emu_launch_range(int idx, unsigned gx, unsigned gy, unsigned bx, unsigned by,
                                const char* args, unsigned first, unsigned count) {
  const unsigned threads = bx * by;
  std::vector<std::unique_ptr<EmuBlock>> bs;
  for (unsigned b = 0; b < count; ++b) {
    auto blk = std::make_unique<EmuBlock>();
    blk->bar = std::make_unique<std::barrier<>>(threads);
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) blk->warps.push_back(std::make_unique<EmuWarp>());
    bs.push_back(std::move(blk));
  }
  std::vector<EmuArgs> as(count * threads);
  std::vector<pthread_t> ts(count * threads);
  pthread_attr_t attr; pthread_attr_init(&attr); pthread_attr_setstacksize(&attr, 256 * 1024);
  unsigned k = 0;
  for (unsigned b = 0; b < count; ++b) {
    const unsigned lin = first + b, bx_ = lin % gx, by_ = lin / gx;
    for (unsigned ty = 0; ty < by; ++ty)
      for (unsigned tx = 0; tx < bx; ++tx, ++k) {
        as[k] = EmuArgs{emu_table[idx], args, bs[b].get(), {bx_, by_, 0}, {tx, ty, 0},
                        {bx, by, 1}, {gx, gy, 1}, (int)(ty * bx + tx)};
        if (pthread_create(&ts[k], &attr, emu_thread, &as[k]) != 0) { fprintf(stderr, "pthread_create failed\n"); abort(); }
      }
  }
  for (auto& t : ts) pthread_join(t, nullptr);
  return 0;
}
'''


def build(modules, out_dir=BUILD_DIR):
    os.makedirs(out_dir, exist_ok=True)
    srcs, names = [], []
    for m in modules:
        text = host_source(m.source)
        wrappers = []
        for expr, spec in m.kernels.items():
            wrappers.append(wrapper(len(names), expr, spec))
            names.append(expr)
        srcs.append((m.name, text, wrappers))
    code = [f'#include "{HERE / "cuda_host_shim.h"}"\n']
    # modules share headers: one namespace per module keeps their copies apart
    body = []
    for i, (name, text, wrappers) in enumerate(srcs):
        body.append(f"namespace emu_m{i} {{\n{text}\n}}\n")
    code += body
    code.append(DRIVER)
    # wrappers reference gpuops:: inside module namespaces
    idx = 0
    table = []
    for i, (name, text, wrappers) in enumerate(srcs):
        for w in wrappers:
            w = w.replace("gpuops::", f"emu_m{i}::gpuops::")
            code.append(w)
            table.append(f"w{idx}")
            idx += 1
    code.append(f"emu_fn emu_table[] = {{{', '.join(table)}}};\n")
    src = "".join(code)
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    so = Path(out_dir) / f"emu_{key}.so"
    if not so.exists():
        cpp = Path(out_dir) / f"emu_{key}.cpp"
        cpp.write_text(src)
        subprocess.run(["g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread",
                        "-ffp-contract=off", "-w", str(cpp), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.emu_launch.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.c_uint, ctypes.c_char_p]
    return lib, {n: i for i, n in enumerate(names)}


class EmuKernel:
    def __init__(self, lib, idx, name, spec):
        self.lib, self.idx, self.name, self.spec = lib, idx, name, spec
        self.ptr = idx + 1
        self.launches = 0

    def launch(self, grid, block, stream, *args, smem=0):
        buf = self.spec.struct.pack(*args)
        self.launches += 1
        rc = self.lib.emu_launch(self.idx, grid[0], grid[1], block[0], block[1], buf)
        assert rc == 0, "thread creation failed"


class EmuLoaded:
    def __init__(self, lib, table, module):
        self.lib, self.table, self.module = lib, table, module

    def kernel(self, expr):
        return EmuKernel(self.lib, self.table[expr], expr, self.module.kernels[expr])
