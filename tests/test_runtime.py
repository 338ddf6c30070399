"""The runtime, on a machine without a GPU: sources, NVRTC compilation of every module for every
arch it declares (no spills), kernel parameter layouts against the PTX, caches and bundles."""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import needs_torch_cuda
from gpuops.runtime import bundle, config, loader, nvrtc
from gpuops.runtime.cache import DiskCache, cache_key
from gpuops.runtime.errors import CompileError
from gpuops.runtime.launch import ArgSpec, Kernel, cubin_params, ptx_params
from gpuops.runtime.modules import DEFAULT_ARCHS, KernelModule, _MODULES, all_modules, get_module
from gpuops.runtime.nvrtc import Target
from gpuops.runtime.sources import all_source_files, assemble

ROOT = Path(__file__).resolve().parent.parent
needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed")
# The oldest arch this NVRTC compiles for: 61 with NVRTC 12 (CI), 75 with NVRTC 13 (which dropped
# Pascal and Volta; the device machine runs the Pascal path from a bundle built with NVRTC 12).
LOW = (61 if 61 in nvrtc.supported_archs() else min(nvrtc.supported_archs())) if nvrtc.available() else 61


@pytest.fixture(scope="session")
def full_bundle(tmp_path_factory):
    """Every module for every arch it declares, as cubins (ptxas -v) and compute_61 PTX."""
    if not nvrtc.available():
        pytest.skip("NVRTC not installed")
    out = tmp_path_factory.mktemp("bundle")
    archs = sorted({a for m in all_modules() for a in m.archs}, key=lambda a: (int(a.rstrip("a")), a))
    supported = nvrtc.supported_archs()
    targets = [Target.parse(a) for a in archs if Target.parse(a).arch in supported]
    targets.append(Target(LOW, "ptx"))
    manifest = bundle.build(out, targets, show_progress=False, jobs=os.cpu_count() or 1)
    return out, manifest


@pytest.fixture
def env(monkeypatch, tmp_path):
    """Set GPUOPS_* variables for one test (with a private cache dir) and refresh the settings."""
    monkeypatch.setenv("GPUOPS_CACHE_DIR", str(tmp_path / "cache"))

    def set_env(**values):
        for k, v in values.items():
            if v is None:
                monkeypatch.delenv(k, raising=False)
            else:
                monkeypatch.setenv(k, str(v))
        config.refresh()
    set_env()
    yield set_env
    monkeypatch.undo()
    config.refresh()


# ------------------------------------------------------------------------------- sources

def _tree(tmp_path, files: dict) -> Path:
    root = tmp_path / "cuda_src"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_assemble_inlines_each_header_once_with_line_directives(tmp_path):
    root = _tree(tmp_path, {
        "common/a.cuh": "#pragma once\nint a_value = 1;\n",
        "common/b.cuh": '#pragma once\n#include "common/a.cuh"\nint b_value = 2;\n',
        "fam/k.cu": '#include "common/a.cuh"\n#include "common/b.cuh"\n__global__ void k() {}\n'})
    src = assemble("fam/k.cu", root)
    assert src.text.count("int a_value") == 1
    assert src.files == ("fam/k.cu", "common/a.cuh", "common/b.cuh")
    assert '#line 1 "cuda_src/common/a.cuh"' in src.text
    assert '#line 3 "cuda_src/fam/k.cu"' in src.text      # back in k.cu after the 2nd include
    assert "#pragma once" not in src.text


def test_editing_a_header_changes_the_hash(tmp_path):
    root = _tree(tmp_path, {"common/a.cuh": "#pragma once\nint x = 1;\n",
                            "k.cu": '#include "common/a.cuh"\n'})
    before = assemble("k.cu", root).sha256
    (root / "common/a.cuh").write_text("#pragma once\nint x = 2;\n")
    assert assemble("k.cu", root).sha256 != before


def test_missing_include_names_the_includer(tmp_path):
    root = _tree(tmp_path, {"k.cu": 'int a;\n#include "nope.cuh"\n'})
    with pytest.raises(FileNotFoundError, match=r"cuda_src/k.cu:2.*nope.cuh"):
        assemble("k.cu", root)


@needs_nvrtc
def test_compile_error_names_the_file_and_line(tmp_path):
    root = _tree(tmp_path, {"common/h.cuh": "#pragma once\n\nint broken = undefined_name;\n",
                            "k.cu": '#include "common/h.cuh"\n__global__ void k() {}\n'})
    src = assemble("k.cu", root)
    with pytest.raises(CompileError) as info:
        nvrtc.compile_source(src.text, src.main_file, "test.k", Target(LOW), (), [])
    assert 'cuda_src/common/h.cuh(3)' in str(info.value)
    assert "undefined_name" in info.value.log
    assert info.value.module == "test.k" and info.value.target == f"sm_{LOW}"


def test_every_cu_file_belongs_to_a_module():
    declared = {m.source for m in all_modules()}
    assert set(all_source_files()) == declared


# ------------------------------------------------------------------------------- NVRTC, every module

@needs_nvrtc
def test_every_module_compiles_for_every_declared_arch_without_spills(full_bundle):
    _, manifest = full_bundle
    for m in all_modules():
        entry = manifest["modules"][m.name]
        for arch in m.archs:
            if Target.parse(arch).arch not in nvrtc.supported_archs():
                continue   # see test_nvrtc_can_build_every_declared_arch
            label = Target.parse(arch).label
            assert label in entry["targets"], f"{m.name} was not built for {label}"
            resources = entry["targets"][label]["resources"]
            assert set(resources) == set(entry["targets"][label]["lowered"].values())
            spilled = {k: r for k, r in resources.items() if r["spill_stores"] or r["spill_loads"]}
            assert not spilled, f"{m.name} spills on {label}: {spilled}"


@needs_nvrtc
def test_nvrtc_can_build_every_declared_arch():
    if nvrtc.version()[0] >= 13:
        pytest.skip("NVRTC 13 cannot target sm_61..sm_72; CI checks those with NVRTC 12")
    declared = {Target.parse(a).arch for m in all_modules() for a in m.archs}
    assert declared <= set(nvrtc.supported_archs())


@needs_nvrtc
def test_every_module_has_a_path_that_runs_on_sm61():
    assert any(m.supports(61) for m in all_modules())
    for m in all_modules():
        if m.arch_specific or "61" in m.archs:
            continue
        # a module for newer GPUs only (tensor cores: archs 80..90) must have a sibling in its
        # family that runs on sm_61
        family = m.name.split(".")[0]
        assert any(o.supports(61) for o in all_modules() if o.name.split(".")[0] == family), \
            f"{m.name} has no sm_61 build and its family no sm_61 path"


@needs_nvrtc
def test_kernel_argspecs_match_the_ptx_signatures(full_bundle):
    out, manifest = full_bundle
    for m in all_modules():
        info = manifest["modules"][m.name]["targets"].get(f"compute_{LOW}")
        if info is not None:
            ptx = (out / info["file"]).read_text(errors="replace")
        else:   # a module for newer archs only: PTX of the oldest it declares
            t = Target.parse(min(m.archs, key=lambda a: int(a.rstrip("a"))))
            c = nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name,
                                     Target(t.arch, "ptx", t.suffix), m.options,
                                     m.name_expressions)
            info = {"lowered": c.lowered}
            ptx = c.image.decode(errors="replace")
        for expr, spec in m.kernels.items():
            params = ptx_params(ptx, info["lowered"][expr])
            assert params == spec.layout, f"{m.name}: {expr}: PTX {params} vs ArgSpec {spec.layout}"
            last = params[-1]
            assert spec.size >= last[0] + last[1]


# A memory access in PTX: ld / st / atom / red / cp.async / prefetch in any state space but the
# kernel's parameters, shared memory, local memory and the constant bank (a generic ld.u32 counts:
# it may reach global memory). Prefetches into L2 only (prefetch[.global].L2, cp.async.bulk.
# prefetch.L2: common/pdl.cuh's l2_prefetch_bulk) are not accesses: they return nothing and change
# no value, and L2 is coherent for every SM, so they may come before griddepcontrol.wait.
_PTX_ACCESS = re.compile(r"^\s*(?:@!?%\w+\s+)?(?!cp\.async\.bulk\.prefetch\.L2\.|prefetch(?:\.global)?\.L2\b)"
                         r"(?:ld|st|atom|red|cp\.async|cp\.reduce\.async|prefetch"
                         r"|multimem)\.(?!param|shared|local|const)", re.M)


def ptx_entry_bodies(ptx: str) -> dict:
    """{mangled name: body text} of every .entry in PTX text."""
    out = {}
    for m in re.finditer(r"\.entry\s+([\w$]+)\s*\(", ptx):
        start = ptx.index("{", ptx.index(")", m.end()))
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            if depth == 0:
                break
            i += 1
        out[m.group(1)] = ptx[start:i + 1]
    return out


def test_ptx_access_scanner():
    body = ("{\n\tld.param.u64 %rd1, [p];\n\tld.shared.f32 %f1, [s];\n"
            "\tgriddepcontrol.wait;\n\t@%p1 ld.global.nc.v4.u32 {%r1}, [%rd1];\n}")
    first = _PTX_ACCESS.search(body)
    assert first is not None and body.index("griddepcontrol.wait") < first.start()
    assert _PTX_ACCESS.search("\tst.shared.u32 [a], %r1;\n\tld.const.u32 %r2, [c];") is None
    assert _PTX_ACCESS.search("\tld.u32 %r2, [%rd4];") is not None        # generic
    for hint in ("cp.async.bulk.prefetch.L2.global [%rd2], %r3;", "prefetch.global.L2 [%rd2];",
                 "@%p2 prefetch.global.L2::evict_last [%rd2];"):
        assert _PTX_ACCESS.search("\t" + hint) is None, hint
    for access in ("prefetch.global.L1 [%rd2];", "cp.async.bulk.global.shared::cta [%rd2], [%r1], 16;"):
        assert _PTX_ACCESS.search("\t" + access) is not None, access
    bodies = ptx_entry_bodies(".visible .entry _Z1kv(\n.param .u64 a\n)\n{\n{ inner }\nret;\n}\n"
                              ".visible .entry _Z1jv()\n{\nret;\n}")
    assert set(bodies) == {"_Z1kv", "_Z1jv"} and "inner" in bodies["_Z1kv"]


@needs_nvrtc
def test_pdl_modules_wait_before_their_first_memory_access():
    """A module declared pdl=True has its kernels launched as programmatic dependent launches on
    sm_90+: each may start before the previous kernel of the stream ends, so each must execute
    griddepcontrol.wait (gpuops::pdl_start()) before any load or store, or it races with that
    kernel. Reads the sm_90 PTX of one instantiation of every kernel template of those modules."""
    if 90 not in nvrtc.supported_archs():
        pytest.skip("this NVRTC cannot target sm_90")
    modules = [m for m in all_modules() if m.pdl]
    assert {m.name for m in modules} >= {"norms.layer_norm", "norms.rms_norm", "norms.backward",
                                          "softmax.rows", "softmax.split", "softmax.cols",
                                          "rotary.rope", "rotary.qk_norm_rope",
                                          "gemm.gemv_f32", "gemm.gemv_mma_bf16"}
    for m in modules:
        one_each = {}
        for expr in m.kernels:                    # one instantiation per kernel template
            one_each.setdefault(expr.split("<")[0], expr)
        exprs = list(one_each.values())
        c = nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name,
                                 Target(90, "ptx"), m.options, exprs)
        bodies = ptx_entry_bodies(c.image.decode(errors="replace"))
        for expr in exprs:
            body = bodies[c.lowered[expr]]
            wait = body.find("griddepcontrol.wait")
            first = _PTX_ACCESS.search(body)
            assert wait >= 0, f"{m.name}: {expr} has no griddepcontrol.wait (pdl_start())"
            assert first is None or wait < first.start(), \
                f"{m.name}: {expr} accesses memory before griddepcontrol.wait: {first.group(0)!r}"


def test_argspec_layout_and_packing():
    spec = ArgSpec("4f", "ptr", "i32", "i8q32q", "i64")
    assert spec.layout == [(0, 16, 4), (16, 8, 8), (24, 4, 4), (32, 328, 8), (360, 8, 8)]
    assert spec.size == 368
    values = [1.0, 2.0, 3.0, 4.0, 0xDEADBEEF00, -7, 3, *range(8), *range(32), 2**40]
    buf = bytearray(spec.size)
    spec.struct.pack_into(buf, 0, *values)
    assert struct.unpack_from("<4f", buf, 0) == (1.0, 2.0, 3.0, 4.0)
    assert struct.unpack_from("<Q", buf, 16)[0] == 0xDEADBEEF00
    assert struct.unpack_from("<i", buf, 24)[0] == -7
    assert struct.unpack_from("<i", buf, 32)[0] == 3
    assert struct.unpack_from("<8q", buf, 40) == tuple(range(8))
    assert struct.unpack_from("<q", buf, 360)[0] == 2**40
    with pytest.raises(ValueError):
        ArgSpec("bogus!")


def test_argspec_tensormap_parameters():
    """A CUtensorMap travels by value: 128 opaque bytes aligned to 64 (as `.param .align 64 .b8
    p[128]` in PTX), packed from one bytes value; "@N:" sets any struct's alignment."""
    spec = ArgSpec("tensormap", "i32", "tensormap", "9P25qf4i")
    assert spec.layout == [(0, 128, 64), (128, 4, 4), (192, 128, 64), (320, 296, 8)]
    assert spec.size == 616
    buf = bytearray(spec.size)
    spec.struct.pack_into(buf, 0, bytes(range(128)), 7, b"\xab" * 128, *range(9), *range(25),
                          1.5, 1, 2, 3, 4)
    assert bytes(buf[:128]) == bytes(range(128)) and buf[192:320] == b"\xab" * 128
    assert struct.unpack_from("<i", buf, 128)[0] == 7
    assert ArgSpec("@16:2i").layout == [(0, 16, 16)]
    for bad in ("@3:4i", "@64:", "@64"):
        with pytest.raises(ValueError):
            ArgSpec(bad)


def test_overaligned_parameters_launch_through_kernel_params():
    """A spec with a CUtensorMap (aligned to 64) launches through kernelParams: one pointer per
    parameter into the packed struct, at the parameter's offset, and no flat buffer (whose copy
    would land 48 bytes off in the cubin's parameter block: see cubin_params below). Specs
    without over-aligned parameters keep the flat buffer (CU_LAUNCH_PARAM_BUFFER_POINTER)."""
    import ctypes
    from types import SimpleNamespace
    calls = []

    def make(spec):
        raw = SimpleNamespace(kernel=SimpleNamespace(ptr=4321), max_dynamic_shared_size_bytes=49152)
        k = Kernel("k", raw, spec)
        k._launch = lambda *a: calls.append(a)
        return k

    spec = ArgSpec("tensormap", "tensormap", "9P25qf4i")
    assert spec.needs_pointers and not ArgSpec("9P25qf4i").needs_pointers
    args = (bytes(range(128)), bytes(range(128, 256)), *range(1, 10), *range(100, 125),
            0.5, 1, 2, 3, 4)
    make(spec).launch((3, 1, 1), (384, 1, 1), 77, *args, smem=1024)
    (f, gx, gy, gz, bx, by, bz, smem, stream, params, extra), = calls
    assert (f, gx, bx, smem, stream, extra) == (4321, 3, 384, 1024, 77, 0) and params != 0
    ptrs = (ctypes.c_void_p * 3).from_address(params)
    assert ctypes.string_at(ptrs[0], 128) == bytes(range(128))
    assert ctypes.string_at(ptrs[1], 128) == bytes(range(128, 256))
    assert ptrs[1] - ptrs[0] == 128 and ptrs[2] - ptrs[0] == 256
    gemm_args = ctypes.string_at(ptrs[2], 296)
    assert struct.unpack_from("<9Q", gemm_args, 0) == tuple(range(1, 10))
    assert struct.unpack_from("<f4i", gemm_args, 272) == (0.5, 1, 2, 3, 4)
    calls.clear()
    make(ArgSpec("ptr", "i32")).launch((1, 1, 1), (32, 1, 1), 5, 1 << 40, 7)
    (*_, params, extra), = calls
    assert params == 0 and extra != 0


@needs_nvrtc
def test_cubin_places_overaligned_parameters_by_absolute_bank_address():
    """What the driver goes by: the cubin's parameter records. A 64-byte aligned parameter sits
    at a 64-byte aligned *constant-bank* address; the parameter block starts at c[0x0][0x210] on
    sm_90, so the first CUtensorMap lands at offset 48 of the block, not 0 as in the PTX. The
    offsets relative to the first parameter still match the ArgSpec (which is why kernelParams,
    placed parameter by parameter by the driver, is right and a flat buffer is not)."""
    src = """struct __align__(64) Map { unsigned long long w[16]; };
extern "C" __global__ void k(const __grid_constant__ Map a, const __grid_constant__ Map b,
                             unsigned long long* out, int n) {
  out[n] = a.w[0] + b.w[1];
}
"""
    c = nvrtc.compile_source(src, "k.cu", "test.overaligned", Target(90, "cubin"))
    bank, params = cubin_params(c.image, "k")
    spec = ArgSpec("tensormap", "tensormap", "ptr", "i32")
    assert [size for _, size in params] == [size for _, size, _ in spec.layout]
    assert [off - params[0][0] for off, _ in params] == [off for off, _, _ in spec.layout]
    assert all((bank + off) % 64 == 0 for off, _ in params[:2])
    assert spec.needs_pointers
    if bank % 64:      # the case run 15 hit: the flat buffer would arrive shifted
        assert params[0][0] == -bank % 64


def test_tma_rules_are_checked_before_the_driver():
    from gpuops.runtime import tma
    ok = dict(ptr=1 << 20, dtype=tma.DTYPE_UINT16, dims=(4096, 4096), strides=(8192,),
              box=(64, 128), swizzle=tma.SWIZZLE_128B)
    assert tma.check_tiled(**ok) is None
    for change, words in (({"ptr": (1 << 20) + 8}, "16-byte aligned"),
                          ({"strides": (8194,)}, "multiple of 16"),
                          ({"strides": (0,)}, "positive"),
                          ({"box": (128, 128)}, "exceeds the 128-byte swizzle"),
                          ({"box": (64, 257)}, "outside 1..256"),
                          ({"dims": (0, 5)}, "outside 1..2^32"),
                          ({"dims": (4, 4, 4, 4, 4, 4), "strides": (16,) * 5,
                            "box": (8,) * 6}, "rank")):
        why = tma.check_tiled(**{**ok, **change})
        assert why is not None and words in why, (change, why)
    with pytest.raises(tma.TensorMapError, match="16-byte aligned"):
        tma.encode_tiled(**{**ok, "ptr": 8})


def test_ptx_param_parser():
    ptx = """.visible .entry _Z1kv(
\t.param .align 4 .b8 _Z1kv_param_0[16],
\t.param .u64 _Z1kv_param_1,
\t.param .u32 _Z1kv_param_2,
\t.param .align 8 .b8 _Z1kv_param_3[328]
)"""
    assert ptx_params(ptx, "_Z1kv") == [(0, 16, 4), (16, 8, 8), (24, 4, 4), (32, 328, 8)]


def test_ptxas_log_parser():
    log = """ptxas info    : Compiling entry function '_Zk' for 'sm_61'
ptxas info    : Function properties for _Zk
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, 1024 bytes smem, 352 bytes cmem[0]"""
    assert nvrtc.parse_ptxas_log(log) == {"_Zk": {"registers": 40, "stack": 16, "spill_stores": 8,
                                                  "spill_loads": 4, "smem": 1024}}


def test_target_parse():
    assert Target.parse("61") == Target(61, "cubin")
    assert Target.parse("compute_61") == Target(61, "ptx")
    assert Target.parse("sm_90a") == Target(90, "cubin", "a")
    assert Target.parse("90a").label == "sm_90a"
    assert Target(61, "ptx").label == "compute_61"
    with pytest.raises(ValueError, match="not a CUDA arch"):
        Target.parse("ampere")


# ------------------------------------------------------------------------------- targets

def _temp_module(name, archs):
    m = KernelModule(name, "elementwise/activations.cu",
                     {"gpuops::pointwise_flat<gpuops::ScaleShiftClamp, float, 1, 4>":
                      ArgSpec("4f", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64")},
                     archs=archs)
    return m


def test_runtime_target_follows_gpuops_arch(env):
    m = get_module("elementwise.activations")
    assert loader.runtime_target(m, 90) == Target(90, "cubin")
    env(GPUOPS_ARCH="61")
    assert loader.runtime_target(m, 90) == Target(61, "ptx")
    assert loader.runtime_target(m, 61) == Target(61, "cubin")
    env(GPUOPS_ARCH="compute_90")
    assert loader.runtime_target(m, 90) == Target(90, "ptx")
    env(GPUOPS_ARCH="100")
    with pytest.raises(ValueError, match="newer than the device"):
        loader.runtime_target(m, 90)
    env(GPUOPS_ARCH="sm_80")
    with pytest.raises(ValueError, match="machine code of another GPU"):
        loader.runtime_target(m, 90)


def test_arch_specific_module_targets_only_its_arch(env):
    m = _temp_module("test.hopper_only", ("90a",))
    try:
        assert m.supports(90) and not m.supports(89) and not m.supports(61)
        assert loader.runtime_target(m, 90) == Target(90, "cubin", "a")
        with pytest.raises(RuntimeError, match="only for sm_90a"):
            loader.runtime_target(m, 89)
        env(GPUOPS_ARCH="61")
        with pytest.raises(RuntimeError, match="cannot be honoured"):
            loader.runtime_target(m, 90)
    finally:
        _MODULES.pop(m.name)


@needs_nvrtc
def test_newer_gpu_than_nvrtc_gets_ptx_of_the_newest_arch():
    newest = max(nvrtc.supported_archs())
    assert loader._compile_target(Target(newest + 30)) == Target(newest, "ptx")
    assert loader._compile_target(Target(86)) == Target(86)


def test_declaring_a_module_twice_is_an_error():
    with pytest.raises(ValueError, match="declared twice"):
        _temp_module("elementwise.activations", DEFAULT_ARCHS)


# ------------------------------------------------------------------------------- disk cache

@needs_nvrtc
def test_disk_cache_round_trip(tmp_path):
    m = get_module("elementwise.activations")
    t = Target(LOW, "ptx")
    compiled = nvrtc.compile_source(m.assembled.text, m.assembled.main_file, m.name, t,
                                    (), m.name_expressions)
    cache = DiskCache(tmp_path)
    key = cache_key(m.identity, t, nvrtc.version())
    assert cache.lookup(key, t) is None
    path = cache.store(key, compiled, {"module": m.name})
    hit = cache.lookup(key, t)
    assert hit is not None and hit[0] == path and path.read_bytes() == compiled.image
    assert hit[1]["lowered"] == compiled.lowered
    path.write_bytes(compiled.image[:100])            # a torn write is not a hit
    assert cache.lookup(key, t) is None
    assert cache_key(m.identity, t, (99, 9)) != key   # the NVRTC version is part of the key


_LOCATE = """
import json, sys
from gpuops.runtime import loader
from gpuops.runtime.modules import get_module
from gpuops.runtime.nvrtc import Target
path, lowered, origin, target = loader._locate(get_module(sys.argv[1]), Target(int(sys.argv[2]), "ptx"), 90)
print(json.dumps({"origin": origin, "path": str(path)}))
"""


@needs_nvrtc
def test_two_processes_compiling_one_module_compile_it_once(tmp_path):
    env = dict(os.environ, GPUOPS_CACHE_DIR=str(tmp_path), GPUOPS_QUIET="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GPUOPS_KERNEL_BUNDLE", None)
    env.pop("GPUOPS_ARCH", None)
    procs = [subprocess.Popen([sys.executable, "-c", _LOCATE, "elementwise.gated", str(LOW)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["origin"] for r in results) == ["compiled", "disk cache"]
    assert results[0]["path"] == results[1]["path"]


# ------------------------------------------------------------------------------- bundles

@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory):
    if not nvrtc.available():
        pytest.skip("NVRTC not installed")
    out = tmp_path_factory.mktemp("small_bundle")
    m = get_module("elementwise.activations")
    bundle.build(out, [Target(LOW, "ptx"), Target(LOW, "cubin")], [m], show_progress=False)
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bundle_manifest(small_bundle):
    from gpuops import __version__
    manifest = json.loads((small_bundle / "manifest.json").read_text())
    m = get_module("elementwise.activations")
    assert manifest["format"] == bundle.FORMAT
    assert manifest["gpuops_version"] == __version__
    assert manifest["nvrtc_version"] == ".".join(map(str, nvrtc.version()))
    entry = manifest["modules"][m.name]
    assert entry["identity"] == m.identity and entry["source"] == m.source
    assert set(entry["targets"]) == {f"compute_{LOW}", f"sm_{LOW}"}
    for info in entry["targets"].values():
        assert set(info["lowered"]) == set(m.kernels)
        import hashlib
        assert hashlib.sha256((small_bundle / info["file"]).read_bytes()).hexdigest() == info["sha256"]


def test_bundle_lookup_prefers_exact_cubin_then_ptx(small_bundle):
    b = bundle.Bundle(small_bundle)
    m = get_module("elementwise.activations")
    assert b.find(m, LOW, "", exact_cubin=True).target == Target(LOW, "cubin")
    assert b.find(m, LOW, "", exact_cubin=False).target == Target(LOW, "ptx")
    assert b.find(m, 90, "", exact_cubin=True).target == Target(LOW, "ptx")   # PTX runs on newer


def test_bundle_rejects_tampered_file_with_a_warning(small_bundle, tmp_path):
    root = _copy(small_bundle, tmp_path / "b")
    manifest = json.loads((root / "manifest.json").read_text())
    f = root / manifest["modules"]["elementwise.activations"]["targets"][f"compute_{LOW}"]["file"]
    f.write_bytes(f.read_bytes() + b"// appended")
    with pytest.warns(RuntimeWarning, match="does not match the sha256"):
        assert bundle.Bundle(root).find(get_module("elementwise.activations"), 90, "", True) is None


def test_bundle_rejects_other_source_and_missing_modules(small_bundle, tmp_path):
    root = _copy(small_bundle, tmp_path / "b")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["modules"]["elementwise.activations"]["identity"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(manifest))
    b = bundle.Bundle(root)
    with pytest.warns(RuntimeWarning, match="different source"):
        assert b.find(get_module("elementwise.activations"), LOW, "", True) is None
    with pytest.warns(RuntimeWarning, match="has no module"):
        assert b.find(get_module("elementwise.gated"), LOW, "", True) is None


def test_bundle_rebuild_only_stale_keeps_current_images(small_bundle, tmp_path, monkeypatch):
    root = _copy(small_bundle, tmp_path / "b")
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["modules"]["elementwise.activations"]["targets"][f"sm_{LOW}"]["sha256"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(manifest))
    m = get_module("elementwise.activations")
    compiled = []
    real = nvrtc.compile_source

    def counting(*args, **kw):
        compiled.append(args[3].label)
        return real(*args, **kw)

    monkeypatch.setattr(nvrtc, "compile_source", counting)
    out = bundle.build(root, [Target(LOW, "ptx"), Target(LOW, "cubin")], [m],
                       show_progress=False, only_stale=True)
    # the PTX is current and kept; the cubin whose recorded hash no longer matches is rebuilt
    assert compiled == [f"sm_{LOW}"]
    assert set(out["modules"][m.name]["targets"]) == {f"compute_{LOW}", f"sm_{LOW}"}
    b = bundle.Bundle(root)
    assert b.find(m, LOW, "", exact_cubin=True).target == Target(LOW, "cubin")
    compiled.clear()
    bundle.build(root, [Target(LOW, "ptx"), Target(LOW, "cubin")], [m], show_progress=False,
                 only_stale=True)
    assert compiled == []


def test_bundle_without_manifest_is_an_error(tmp_path):
    from gpuops.runtime.errors import BundleError
    with pytest.raises(BundleError, match="manifest.json"):
        bundle.Bundle(tmp_path)


@needs_nvrtc
def test_loader_takes_kernels_from_the_bundle(small_bundle, env):
    env(GPUOPS_KERNEL_BUNDLE=str(small_bundle), GPUOPS_ARCH=str(LOW))
    m = get_module("elementwise.activations")
    path, lowered, origin, target = loader._locate(m, loader.runtime_target(m, 90), 90)
    assert origin == "bundle" and target == Target(LOW, "ptx")
    assert Path(path).parent == small_bundle


@needs_nvrtc
def test_loader_compiles_what_the_bundle_lacks(small_bundle, env):
    env(GPUOPS_KERNEL_BUNDLE=str(small_bundle))
    m = get_module("elementwise.gated")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path, lowered, origin, target = loader._locate(m, Target(LOW, "ptx"), 90)
    assert origin == "compiled" and set(lowered) == set(m.kernels)
    assert any("has no module" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_loaded_modules_report_their_origin_and_target():
    """Under GPUOPS_KERNEL_BUNDLE + GPUOPS_ARCH=61 (the device script's second pass) the kernels
    must really come from the bundle's compute_61 PTX."""
    import numpy as np
    import gpuops as go
    go.relu(np.ones(8, np.float32))
    m = loader.load(get_module("elementwise.activations"), 0)
    if config.settings.bundle is not None and config.settings.arch == "61":
        assert m.origin == "bundle" and m.target == Target(61, "ptx")
    elif config.settings.arch is None:
        from gpuops.runtime import device
        assert m.target.arch == device.device_info(0).cc
    assert m.load_seconds >= 0


def _pdl_chain(go, x, xl, w, wl, b, qw, kw, cos, sin, wg, wb1, wb2):
    """Ops of the pdl=True modules, each reading the one before (a kernel that did not wait for
    its predecessor would read a stale or poisoned input): whole rows, split / ring rows, the
    two-launch softmax, a backward with its weight-grad launch, pointwise, rotary, decode GEMVs
    (SIMT split-K with its reduce launch; tensor-core gemv_mma, one into the next)."""
    n = x.shape[-1]
    h1 = go.rms_norm(x, (n,), w)
    h2 = go.layer_norm(h1, (n,), w, b)
    h3 = go.softmax(h2, -1)
    h4 = go.silu_mul(h3, h2)
    h5, res = go.add_rms_norm(h4, h1, w)
    y, rstd = go.rms_norm_forward(h5, (n,), w)
    dx, dw = go.rms_norm_backward(y, h5, rstd, (n,), w)
    q = dx.reshape(2, 64, 16, 128)
    qr, kr = go.apply_rotary(q, q[:, :, :4], cos, sin)
    qn, kn = go.qk_norm_rotary(qr, kr, qw, kw, cos, sin)
    nl = xl.shape[-1]
    l1 = go.rms_norm(xl, (nl,), wl)
    l2 = go.layer_norm(l1, (nl,), wl)
    l3 = go.log_softmax(l2, -1)
    g1 = go.linear(h2[:4], wg)                       # fp32 M = 4: gemv_kcontig split-K + reduce
    g2 = go.linear(go.rms_norm(h3[:8], (n,), w).to(wb1.dtype), wb1)    # bf16: gemv_mma
    g3 = go.linear(g2, wb2)
    return h1, h2, h3, h4, h5, res, y, dx, dw, qr, kr, qn, kn, l1, l2, l3, g1, g2, g3


@pytest.mark.gpu
@needs_torch_cuda
def test_pdl_chains_equal_stream_order(monkeypatch):
    """The kernels of pdl=True modules launched as programmatic dependent launches (sm_90+, not
    under GPUOPS_ARCH=61: that PTX has no griddepcontrol) give the same bits as with GPUOPS_PDL=0,
    back to back and replayed in a CUDA graph, with every output poisoned first."""
    import torch
    import gpuops as go
    from gpuops.runtime import device
    from gpuops.runtime.launch import PDL
    monkeypatch.setenv("GPUOPS_DEBUG_POISON", "1")
    g = torch.Generator(device="cuda").manual_seed(1234)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=g)   # noqa: E731
    ang = randn(64, 64)
    args = (randn(128, 2048), randn(4, 262144), randn(2048), randn(262144), randn(2048),
            randn(128), randn(128), torch.cat([ang.cos(), ang.cos()], -1),
            torch.cat([ang.sin(), ang.sin()], -1), randn(512, 2048) / 45,
            (randn(1024, 2048) / 45).bfloat16(), (randn(2048, 1024) / 32).bfloat16())
    # the decode GEMVs' L2 prefetch ahead of the wait: on under PDL, off in stream order
    from gpuops.ops import gemm as gemm_ops

    def run(pdl: str):
        monkeypatch.setitem(gemm_ops.PLAN, "gemv_l2_prefetch", pdl == "1")
        monkeypatch.setenv("GPUOPS_PDL", pdl)
        config.refresh()
        eager = _pdl_chain(go, *args)
        m = loader.load(get_module("norms.rms_norm"), 0)
        expect = (pdl == "1" and m.target.arch >= 90 and device.device_info(0).cc >= 90)
        k = m.kernel(next(iter(m.module.kernels)))
        assert k.attrs == (PDL if expect else ()), (pdl, m.target, k.attrs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed = _pdl_chain(go, *args)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        return eager, graphed

    try:
        on_eager, on_graph = run("1")
        off_eager, off_graph = run("0")
    finally:
        monkeypatch.delenv("GPUOPS_PDL")
        config.refresh()
    names = "h1 h2 h3 h4 h5 res y dx dw qr kr qn kn l1 l2 l3 g1 g2 g3".split()
    for name, a, b, c, d in zip(names, on_eager, on_graph, off_eager, off_graph):
        assert torch.isfinite(c).all(), name
        for label, t in (("PDL eager", a), ("PDL graph", b), ("graph", d)):
            assert torch.equal(t, c), f"{name}: {label} differs from stream order"


def test_kernel_handles_cached_until_modules_are_forgotten(monkeypatch):
    """loader.kernel looks a kernel up once per (module, device, name) and looks it up again after
    clear_memory_cache (the one kernel-handle cache every launcher uses)."""
    from gpuops.runtime import loader
    calls = []

    class Loaded:
        def kernel(self, expr):
            calls.append(expr)
            return object()

    monkeypatch.setattr(loader, "load", lambda module, dev: Loaded())
    loader.clear_memory_cache()

    class Mod:
        name = "test.fake"

    first = loader.kernel(Mod, 0, "k<float>")
    assert loader.kernel(Mod, 0, "k<float>") is first and calls == ["k<float>"]
    assert loader.kernel(Mod, 1, "k<float>") is not first          # per device
    loader.clear_memory_cache()
    assert loader.kernel(Mod, 0, "k<float>") is not first and len(calls) == 3
    loader.clear_memory_cache()


def test_launch_attribute_structs_match_cuda_h(monkeypatch):
    """CUlaunchAttribute (id, 4 pad bytes, a 64-byte 8-aligned union) and CUlaunchConfig as in
    cuda.h, the PDL attribute id (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6),
    and launches with attributes go through cuLaunchKernelEx with them (a stand-in driver
    function here), or plain cuLaunchKernel where the driver has none."""
    import ctypes  # noqa: PLC0415
    from gpuops.runtime import launch as L  # noqa: PLC0415

    class CuLaunchConfig(ctypes.Structure):      # as cuda.h declares it
        _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                    ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                    ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                    ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                    ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]

    assert ctypes.sizeof(L._CuLaunchAttribute) == 72 and L._CuLaunchAttribute.value.offset == 8
    assert ctypes.sizeof(CuLaunchConfig) == 56 == L._LAUNCH_CONFIG.size
    assert L.PDL == ((6, 1),)
    seen, plain = [], []

    def fake_ex(config_addr, func, params, extra):
        cfg = CuLaunchConfig.from_address(config_addr)
        attrs = (L._CuLaunchAttribute * cfg.numAttrs).from_address(cfg.attrs)
        seen.append(((cfg.gridDimX, cfg.gridDimY, cfg.blockDimX, cfg.sharedMemBytes, cfg.hStream),
                     [(a.id, a.value[0]) for a in attrs], func, extra is not None))
        return 0

    k = Kernel.__new__(Kernel)
    k.name, k.ptr, k.spec, k._smem_limit, k._by_pointers = "k", 1234, ArgSpec("ptr", "i32"), 0, False
    k.attrs = ()
    k._launch = lambda *a: plain.append(a)
    monkeypatch.setattr(L, "_launch_ex", fake_ex)
    k.launch((3, 2, 1), (128, 1, 1), 77, 5, 6, attrs=L.PDL)
    assert seen == [((3, 2, 128, 0, 77), [(6, 1)], 1234, True)] and not plain
    k.launch((3, 2, 1), (128, 1, 1), 77, 5, 6)
    assert len(plain) == 1 and len(seen) == 1
    k.attrs = L.PDL                 # a kernel of a pdl=True module: its launches carry PDL
    k.launch((5, 1, 1), (64, 1, 1), 0, 5, 6)
    assert seen[-1] == ((5, 1, 64, 0, None), [(6, 1)], 1234, True) and len(plain) == 1
    monkeypatch.setattr(L, "_launch_ex", False)          # a driver without cuLaunchKernelEx
    k.launch((3, 2, 1), (128, 1, 1), 77, 5, 6, attrs=L.PDL)
    k.launch((3, 2, 1), (128, 1, 1), 77, 5, 6)
    assert len(plain) == 3 and len(seen) == 2
