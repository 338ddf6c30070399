"""Host emulation of gpuops kernels, for checking kernels on a machine without a GPU.

The real .cu sources (as gpuops assembles them for NVRTC) are compiled with g++ against a small
shim: threadIdx/blockIdx as thread-locals, warp shuffles and __syncthreads on std::barrier with one
OS thread per CUDA thread (cooperative kernels only; the others run thread by thread), the PTX
inline assembly of common/ replaced by host equivalents (exact exp2/reciprocal instead of the MUFU
approximations, _Float16 conversions). Each kernel gets an entry point that takes the parameter
buffer exactly as gpuops packs it for cuLaunchKernel (the ArgSpec), so a test runs an op's real host
code (argument checks, kernel choice, strides, grid) against the real kernel source, with a
static_assert that every parameter struct has the size the ArgSpec says.

What it does not check: timing, warp-synchronous behaviour beyond shuffles (no races are
detected), the device arithmetic of MUFU instructions, and anything about the real compiler.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import types

import numpy as np

from gpuops import dtypes as dt
from gpuops.runtime.sources import assemble
from gpuops.tensor import Tensor

SHIM = r'''
#include <cstdint>
#include <cmath>
#include <cstring>
#include <atomic>
#include <barrier>
#include <random>
#include <thread>
#include <vector>
#include <memory>
#include <functional>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 gridDim, blockDim;
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float emu_half_to_float(unsigned short b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}
inline unsigned short emu_float_to_half(float f) {
  const _Float16 h = static_cast<_Float16>(f);     // round to nearest even, as cvt.rn.f16.f32
  unsigned short b;
  std::memcpy(&b, &h, 2);
  return b;
}
struct EmuWarp { std::barrier<> bar; float buf[32]; explicit EmuWarp(int n) : bar(n) {} };
thread_local int emu_lane = 0;
thread_local EmuWarp* emu_warp = nullptr;
thread_local std::barrier<>* emu_block = nullptr;
inline float __shfl_xor_sync(unsigned, float v, int o) {
  emu_warp->buf[emu_lane] = v;
  emu_warp->bar.arrive_and_wait();
  const float r = emu_warp->buf[emu_lane ^ o];
  emu_warp->bar.arrive_and_wait();
  return r;
}
inline void __syncthreads() { emu_block->arrive_and_wait(); }
// atomics and fences (sm_61's forms; the sm_70+ PTX of common/coherent.cuh is compiled out)
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// Block order of the next launches: blockIdx order (seed 0) or a random permutation (blocks still
// run one after another), so that "last block done" protocols meet other arrival orders.
unsigned long long emu_order_seed = 0;
extern "C" void emu_set_block_order(unsigned long long seed) { emu_order_seed = seed; }
inline std::vector<unsigned> emu_block_order(unsigned nblocks) {
  std::vector<unsigned> order(nblocks);
  for (unsigned i = 0; i < nblocks; ++i) order[i] = i;
  if (emu_order_seed != 0) {
    std::mt19937_64 gen(emu_order_seed);
    for (unsigned i = nblocks; i > 1; --i) std::swap(order[i - 1], order[gen() % i]);
  }
  return order;
}
// Dynamic shared memory (extern __shared__, rewritten by host_source to point here): one buffer
// of the launch's size, poisoned with 0xFF bytes; the blocks of a cooperative launch run one
// after another, so they can share it.
std::vector<unsigned char> emu_dynamic_smem_buf;
unsigned char* emu_dynamic_smem = nullptr;
extern "C" void emu_set_dynamic_smem(unsigned long long bytes) {
  emu_dynamic_smem_buf.assign(bytes + 16, 0xFF);
  emu_dynamic_smem = emu_dynamic_smem_buf.data() + (-reinterpret_cast<std::uintptr_t>(
      emu_dynamic_smem_buf.data()) & 15);
}
// Cooperative kernels run each block on a pool of worker threads, one per CUDA thread of the
// block, started once per launch (thread creation per block would dominate).
template <class F>
void emu_launch(unsigned gx, unsigned gy, unsigned bx, unsigned by, bool coop, F f) {
  gridDim = {gx, gy, 1};
  blockDim = {bx, by, 1};
  const unsigned n = bx * by;
  const std::vector<unsigned> order = emu_block_order(gx * gy);
  if (!coop) {
    for (unsigned blk : order)
      for (unsigned t = 0; t < n; ++t) {
        blockIdx = {blk % gx, blk / gx, 0};
        threadIdx = {t % bx, t / bx, 0};
        f();
      }
    return;
  }
  std::barrier<> block(n);
  std::vector<std::unique_ptr<EmuWarp>> warps;
  for (unsigned w = 0; w < (n + 31) / 32; ++w)
    warps.emplace_back(new EmuWarp(static_cast<int>(n - 32 * w < 32 ? n - 32 * w : 32)));
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      emu_lane = t % 32;
      emu_warp = warps[t / 32].get();
      emu_block = &block;
      for (unsigned blk : order) {
        blockIdx = {blk % gx, blk / gx, 0};
        threadIdx = {t % bx, t / bx, 0};
        f();
        // a thread that returned early still takes part in the barriers of the next block
        // (its lanes' shuffles of this block were all before its return: see the kernels)
        block.arrive_and_wait();
      }
    });
  for (auto& th : threads) th.join();
}
'''

# PTX inline assembly of the shared headers -> host equivalents (the harness only).
_ASM = [
    ('asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));', 'y = std::exp2(x);'),
    ('asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));', 'y = 1.0f / x;'),
    ('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));', 'f = emu_half_to_float(v.bits);'),
    ('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));', 'h.bits = emu_float_to_half(f);'),
    # sm_80+ branches, compiled out on the host (no __CUDA_ARCH__): their integer fallbacks run
    ('asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b.bits) : "f"(f));', ''),
    ('asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));', ''),
]
_ASM_RE = [
    # common/coherent.cuh: .cg loads and stores -> volatile accesses; its sm_70+ branches
    # (acquire/release atomics, nanosleep) are compiled out on the host
    (re.compile(r'asm volatile\("ld\.global\.cg\.f32 .*?\);', re.S),
     'v = *reinterpret_cast<const volatile float*>(p);'),
    (re.compile(r'asm volatile\("st\.global\.cg\.f32 .*?\);', re.S),
     '*reinterpret_cast<volatile float*>(p) = v;'),
    (re.compile(r'asm volatile\("(atom\.acq_rel|red\.release|nanosleep|ld\.acquire).*?\);', re.S),
     ''),
    (re.compile(r'asm\("\{\.reg \.b16 lo, hi;.*?: "r"\(w\[i\]\)\);', re.S),
     'f[2 * i] = emu_half_to_float(w[i] & 0xffffu); f[2 * i + 1] = emu_half_to_float(w[i] >> 16);'),
    (re.compile(r'asm\("\{\.reg \.b16 l, h;.*?: "f"\(lo\), "f"\(hi\)\);', re.S),
     'u = emu_float_to_half(lo) | (static_cast<unsigned int>(emu_float_to_half(hi)) << 16);'),
]


_EXTERN_SMEM = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def host_source(cu_path: str) -> str | None:
    """The module's assembled source with its PTX asm replaced; None if some asm is unknown."""
    text = assemble(cu_path).text
    text = _EXTERN_SMEM.sub(r"\1* \2 = reinterpret_cast<\1*>(emu_dynamic_smem);", text)
    for a, b in _ASM:
        text = text.replace(a, b)
    for rx, b in _ASM_RE:
        text = rx.sub(b, text)
    return None if "asm(" in text else text


def _param_types(expr: str) -> tuple[list, bool]:
    """C++ parameter types of a kernel and whether it needs cooperative threads."""
    if "rope_kernel<" in expr:
        return ["gpuops::RopeQK", "gpuops::RopeTables"], False
    if re.search(r"qk_norm_rope_(fwd|bwd)[234]?<", expr):
        return ["gpuops::RopeQK", "gpuops::RopeTables", "gpuops::NormArgs"], True
    m = re.search(r"qk_norm_dw_reduce<(.*)>$", expr)
    if m:
        tw = m.group(1)
        return ["const float*", f"{tw}*", f"{tw}*", "int", "int", "int"], True
    m = re.search(r"gated_backward_flat<[^,]*, ([^,]*), \d+>$", expr)
    if m:
        t = m.group(1)
        return [f"{t}*", f"{t}*", f"const {t}*", f"const {t}*", f"const {t}*", "long long"], False
    m = re.search(r"gated_backward_strided<[^,]*, ([^,]*)>$", expr)
    if m:
        t = m.group(1)
        return [f"{t}*", f"{t}*", f"const {t}*", f"const {t}*", f"const {t}*",
                "gpuops::StridedLayout", "long long"], False
    raise KeyError(expr)


class EmuModule:
    """One KernelModule compiled for the host; kernel(expr) gives an object with .launch()."""

    def __init__(self, module, workdir: str, start: bool = False):
        text = host_source(module.source)
        if text is None:
            raise RuntimeError(f"{module.source}: unknown inline asm")
        entries, self.names = [], {}
        for i, (expr, spec) in enumerate(module.kernels.items()):
            types_, coop = _param_types(expr)
            assert len(types_) == len(spec.layout), expr
            lines = [f'extern "C" void emu_{i}(const char* p, unsigned gx, unsigned gy, '
                     f'unsigned bx, unsigned by) {{']
            args = []
            for j, (ty, (off, size, _align)) in enumerate(zip(types_, spec.layout)):
                base = ty.replace("const ", "")
                lines.append(f"  static_assert(sizeof({ty}) == {size}, \"{base} layout\");")
                lines.append(f"  {base} a{j}; std::memcpy(&a{j}, p + {off}, {size});")
                args.append(f"a{j}")
            lines.append(f"  emu_launch(gx, gy, bx, by, {str(coop).lower()}, [&] {{ "
                         f"{expr}({', '.join(args)}); }});")
            lines.append("}")
            entries.append("\n".join(lines))
            self.names[expr] = f"emu_{i}"
        src = SHIM + text + "\n" + "\n".join(entries) + "\n"
        key = hashlib.sha256(src.encode()).hexdigest()[:16]
        so = os.path.join(workdir, f"{module.name}.{key}.so")
        self.module, self.so, self.proc = module, so, None
        self.launches = []        # (expr, grid, dynamic smem, launch attributes) per launch
        if not os.path.exists(so):
            cpp = so[:-3] + ".cpp"
            with open(cpp, "w") as f:
                f.write(src)
            self.proc = subprocess.Popen(
                ["g++", "-std=c++20", "-O0", "-shared", "-fPIC", "-pthread", "-w", cpp, "-o",
                 so + ".tmp"], stderr=subprocess.PIPE, text=True)
        if not start:
            self.finish()

    def finish(self):
        if self.proc is not None:
            _, err = self.proc.communicate()
            if self.proc.returncode:
                raise RuntimeError(f"g++ failed for {self.module.name}:\n{err[-4000:]}")
            os.replace(self.so + ".tmp", self.so)
            self.proc = None
        self.lib = ctypes.CDLL(self.so)

    def kernel(self, expr):
        fn = getattr(self.lib, self.names[expr])
        fn.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
        spec = self.module.kernels[expr]

        def launch(grid, block, stream, *args, smem=0, attrs=()):
            buf = ctypes.create_string_buffer(max(1, spec.size))
            spec.struct.pack_into(buf, 0, *args)
            self.lib.emu_set_dynamic_smem(ctypes.c_ulonglong(smem))
            self.launches.append((expr, tuple(grid), smem, tuple(attrs)))
            fn(buf, grid[0], grid[1], block[0], block[1])
        return types.SimpleNamespace(launch=launch)

    def set_block_order(self, seed: int):
        """Blocks of later launches in blockIdx order (0) or a random permutation (seed)."""
        self.lib.emu_set_block_order(ctypes.c_ulonglong(seed))


def available() -> bool:
    return shutil.which("g++") is not None


def build(modules, workdir: str) -> dict:
    """{module name: EmuModule}, compiling the modules in parallel (g++ is the slow part)."""
    pending = [EmuModule(m, workdir, start=True) for m in modules]
    for m in pending:
        m.finish()
    return {m.module.name: m for m in pending}


class Call:
    """Stands in for gpuops.dispatch.Call: outputs are NumPy arrays poisoned with NaN bytes."""

    def __init__(self, op_name, dtype):
        self.op = types.SimpleNamespace(name=op_name)
        self.device, self.stream, self.result_dtype = 0, 0, dtype

    def empty(self, shape, dtype):
        arr = np.empty(tuple(shape), dtype=dt.to_numpy(dtype))
        arr.view(np.uint8).reshape(-1)[...] = 0xFF
        return view(arr)


def view(arr: np.ndarray) -> Tensor:
    d = dt.from_numpy(arr.dtype)
    return Tensor(arr.ctypes.data, arr.shape, tuple(s // arr.itemsize for s in arr.strides), d, 0,
                  arr, arr.size, arr.flags.c_contiguous)
