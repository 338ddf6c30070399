"""``python -m gpuops info | list | bench | build | cache`` as a user runs them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import HAS_GPU
from gpuops.runtime import nvrtc

ROOT = Path(__file__).resolve().parent.parent


def run(*args, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "gpuops", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_info():
    p = run("info")
    assert p.returncode == 0, p.stderr
    assert "gpuops:" in p.stdout and "cache dir:" in p.stdout and "nvrtc" in p.stdout


def test_list():
    p = run("list")
    assert p.returncode == 0, p.stderr
    names = [line.split()[0] for line in p.stdout.splitlines()]
    assert {"silu", "silu_mul", "gelu_mul", "bias_act", "scale_clamp"} <= set(names)


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU bench")
def test_bench_without_gpu_runs_the_references(tmp_path):
    out = tmp_path / "rows.json"
    p = run("bench", "--ops", "silu,silu_mul", "--shape", "64,256", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "no GPU found" in p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"silu", "silu_mul"}
    assert all(r["ok"] and r["rel_err"] < 1e-6 for r in rows)


def test_bench_rejects_unknown_ops():
    p = run("bench", "--ops", "nonesuch")
    assert p.returncode != 0 and "unknown op" in (p.stderr + p.stdout)


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed")
def test_build_writes_a_bundle(tmp_path):
    low = 61 if 61 in nvrtc.supported_archs() else min(nvrtc.supported_archs())
    p = run("build", "--arch", str(low), "--kind", "ptx", "--modules", "elementwise.binary",
            "--out", str(tmp_path / "b"), "-j", "1")
    assert p.returncode == 0, p.stderr
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert list(manifest["modules"]) == ["elementwise.binary"]
    assert list(manifest["modules"]["elementwise.binary"]["targets"]) == [f"compute_{low}"]
    assert "wrote 1 images" in p.stdout


def test_cache_show_and_clear(tmp_path):
    env = {"GPUOPS_CACHE_DIR": str(tmp_path)}
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "x.cubin").write_bytes(b"1234")
    p = run("cache", "show", env_extra=env)
    assert p.returncode == 0 and "1 files" in p.stdout
    p = run("cache", "clear", env_extra=env)
    assert p.returncode == 0 and "removed 1 files" in p.stdout
    assert not list((tmp_path / "kernels").iterdir())


def test_bench_tolerance_allows_only_the_storage_rounding_floor():
    """A result as good as the float64 reference rounded to fp16 passes even where that rounding
    alone exceeds the fp16 tolerance (softmax outputs of a 393,216-wide row are fp16 subnormals);
    anything clearly worse than it fails, and in the normal range the tolerance is unchanged."""
    import numpy as np

    from gpuops import bench
    from gpuops import dtypes as dt
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 393216))
    e = np.exp(x - x.max(1, keepdims=True))
    ref = e / e.sum(1, keepdims=True)
    rounded = ref.astype(np.float16)
    rel = bench._errors(rounded.astype(np.float64), ref)[0]
    assert rel > bench.TOLERANCE["float16"]                     # the floor alone is above it
    assert bench._within_tolerance(rel, dt.float16, rounded, ref)
    worse = (ref * (1 + 3 * rel)).astype(np.float16)            # a systematic 3x floor error
    rel_worse = bench._errors(worse.astype(np.float64), ref)[0]
    assert not bench._within_tolerance(rel_worse, dt.float16, worse, ref)
    normal = rng.standard_normal(4096)                          # normal range: tolerance as is
    off = (normal * (1 + 2e-3)).astype(np.float16)
    rel_off = bench._errors(off.astype(np.float64), normal)[0]
    assert not bench._within_tolerance(rel_off, dt.float16, off, normal)
    assert bench._within_tolerance(bench._errors(normal.astype(np.float16).astype(np.float64),
                                                 normal)[0], dt.float16,
                                   normal.astype(np.float16), normal)


def test_bench_compile_peer_recompiles_past_dynamos_default_limit():
    """The bench's one torch.compile peer per op is called at every shape and dtype; past dynamo's
    recompile limit (8) it would run eager and its rows would time torch eager. _peers raises the
    limit: 12 shapes through one compiled function stay 12 compiled graphs (CPU: inductor)."""
    torch = pytest.importorskip("torch")
    from gpuops import bench  # noqa: PLC0415
    from gpuops.bench_spec import BenchSpec  # noqa: PLC0415

    def twice(x):
        return x * 2 + 1

    spec = BenchSpec(make_inputs=None, torch_fn=twice, default_shape=lambda d: (4,),
                     compile_peer=True)
    fw = types.SimpleNamespace(torch=torch)
    compiled = bench._peers(spec, fw, compile_peer=True)["torch.compile"]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for n in range(1, 13):
        assert torch.equal(compiled(torch.ones(n)), torch.full((n,), 3.0))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 12


def test_kernel_time_breakdown_per_call(monkeypatch):
    """gpuops.bench.kernel_times_us / kernel_us turn the profiler's kernel records of `calls`
    calls into per-call microseconds: per kernel name, and in total with kernels per call."""
    import gpuops.bench as B  # noqa: PLC0415
    records = [("stats", 30.0), ("apply", 40.0), ("stats", 32.0), ("apply", 42.0)]
    monkeypatch.setattr(B, "_kernel_records", lambda fn, calls: records)
    assert B.kernel_times_us(None, calls=2) == {"stats": 31.0, "apply": 41.0}
    assert B.kernel_us(None, calls=2) == (72.0, 2.0)


def test_shard_summary_counts_every_dealt_test(tmp_path):
    """scripts/shard_summary.py (device_run.sh's 'shards' stage): per arch tag and file, the
    outcomes that `pytest -v` printed, and every test dealt to a shard that printed none (a shard
    cut off by its timeout) counted as not run, ids with spaces included."""
    import importlib.util  # noqa: PLC0415
    spec = importlib.util.spec_from_file_location(
        "shard_summary", Path(__file__).resolve().parents[1] / "scripts/shard_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ids = ["tests/test_a.py::test_x[1, 2]", "tests/test_a.py::test_y", "tests/test_b.py::test_z",
           "tests/test_b.py::test_w"]
    (tmp_path / "gpu_test_ids.txt").write_text("\n".join(ids) + "\n")
    (tmp_path / "native_shard0.log").write_text(
        "tests/test_a.py::test_x[1, 2] PASSED                        [ 50%]\n"
        "tests/test_b.py::test_z SKIPPED (no clusters)              [100%]\n"
        "FAILED tests/test_a.py::test_y - AssertionError\n")
    (tmp_path / "native_shard1.log").write_text(
        "tests/test_a.py::test_y FAILED                              [ 50%]\n")
    (tmp_path / "sm61_shard0.log").write_text(
        "".join(f"{i} PASSED [ 25%]\n" for i in ids))
    lines = mod.summarize(tmp_path).splitlines()
    assert "native  test_a                       1 failed, 1 passed" in lines
    assert "native  test_b                       1 not run, 1 skipped" in lines
    assert "native  ALL                          1 failed, 1 not run, 1 passed, 1 skipped" in lines
    assert "sm61    ALL                          4 passed" in lines
