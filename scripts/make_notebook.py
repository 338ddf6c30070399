"""Writes notebooks/01_quickstart.ipynb (kept as code here so that edits review as Python)."""
from pathlib import Path

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# gpuops quickstart\n\n"
        "gpuops runs hand-written CUDA kernels on NumPy, CuPy and PyTorch arrays. Kernels compile "
        "at first use with NVRTC for the GPU in hand (Pascal sm_61 to Hopper sm_90); without a GPU, "
        "every op runs its NumPy reference on the CPU. This notebook runs top to bottom either way."),
    nbf.v4.new_code_cell(
        "import time\n"
        "import numpy as np\n"
        "import gpuops as go\n"
        "from gpuops.runtime.device import gpu_available\n"
        "print(go.info())"),
    nbf.v4.new_markdown_cell("Every op, its family and the dtypes its GPU kernels take:"),
    nbf.v4.new_code_cell("for op in go.list_ops():\n    print(op)"),
    nbf.v4.new_markdown_cell(
        "## NumPy\nNumPy arrays in, NumPy arrays out. With a GPU they are copied to it, computed "
        "and copied back; without one the float64 reference runs on the CPU."),
    nbf.v4.new_code_cell(
        "rng = np.random.default_rng(0)\n"
        "gate = rng.standard_normal((4, 8)).astype(np.float32)\n"
        "up = rng.standard_normal((4, 8)).astype(np.float32)\n"
        "y = go.silu_mul(gate, up)                   # SwiGLU: silu(gate) * up\n"
        "expected = gate / (1 + np.exp(-gate)) * up\n"
        "print(y.dtype, y.shape, 'max |error|:', np.abs(y - expected).max())\n"
        "print(go.gelu(gate, approximate='tanh')[0, :4])\n"
        "print(go.bias_act(gate, up[0], 'relu')[0, :4])   # relu(gate + bias), bias broadcast"),
    nbf.v4.new_markdown_cell(
        "## CuPy\nCuPy arrays stay on their device; kernels run on CuPy's current stream."),
    nbf.v4.new_code_cell(
        "if gpu_available():\n"
        "    import cupy as cp\n"
        "    g = cp.asarray(gate); u = cp.asarray(up)\n"
        "    yc = go.silu_mul(g, u)\n"
        "    print(type(yc).__name__, yc.device, float(cp.abs(yc - cp.asarray(expected)).max()))\n"
        "else:\n"
        "    print('no GPU: skipping the CuPy example')"),
    nbf.v4.new_markdown_cell(
        "## PyTorch\nTorch tensors come back as torch tensors on the same device (bf16 "
        "included); CUDA tensors run on `torch.cuda.current_stream()` with no host sync, so ops "
        "can be captured in CUDA graphs."),
    nbf.v4.new_code_cell(
        "try:\n"
        "    import torch\n"
        "except ImportError:\n"
        "    torch = None\n"
        "if torch is not None:\n"
        "    dev = 'cuda' if torch.cuda.is_available() else 'cpu'\n"
        "    tg = torch.randn(4, 8, device=dev, dtype=torch.bfloat16)\n"
        "    tu = torch.randn(4, 8, device=dev, dtype=torch.bfloat16)\n"
        "    ty = go.silu_mul(tg, tu)\n"
        "    ref = torch.nn.functional.silu(tg.float()) * tu.float()\n"
        "    print(ty.dtype, ty.device, float((ty.float() - ref).abs().max()))\n"
        "else:\n"
        "    print('torch is not installed')"),
    nbf.v4.new_markdown_cell(
        "## Timing against torch\nSwiGLU's `silu(gate) * up` in bf16 over growing sizes. The op "
        "is memory-bound: it must read two tensors and write one, so the figure of merit is "
        "bytes moved per second. Without a GPU this times the CPU reference against NumPy."),
    nbf.v4.new_code_cell(
        "sizes = [2**k for k in range(12, 25, 2)]\n"
        "rows = []\n"
        "use_gpu = gpu_available() and torch is not None and torch.cuda.is_available()\n"
        "def timed(fn, reps=20):\n"
        "    fn()\n"
        "    if use_gpu:\n"
        "        torch.cuda.synchronize()\n"
        "        start = torch.cuda.Event(enable_timing=True); end = torch.cuda.Event(enable_timing=True)\n"
        "        start.record()\n"
        "        for _ in range(reps): fn()\n"
        "        end.record(); torch.cuda.synchronize()\n"
        "        return start.elapsed_time(end) / reps * 1e-3\n"
        "    t0 = time.perf_counter()\n"
        "    for _ in range(3): fn()\n"
        "    return (time.perf_counter() - t0) / 3\n"
        "for n in sizes:\n"
        "    if use_gpu:\n"
        "        a = torch.randn(n, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)\n"
        "        ours = timed(lambda: go.silu_mul(a, b))\n"
        "        peer = timed(lambda: torch.nn.functional.silu(a) * b)\n"
        "        nbytes = 3 * n * 2\n"
        "    else:\n"
        "        a = rng.standard_normal(n).astype(np.float32); b = rng.standard_normal(n).astype(np.float32)\n"
        "        ours = timed(lambda: go.silu_mul(a, b))\n"
        "        peer = timed(lambda: a / (1 + np.exp(-a)) * b)\n"
        "        nbytes = 3 * n * 4\n"
        "    rows.append((n, nbytes / ours / 1e9, nbytes / peer / 1e9))\n"
        "label = 'torch eager (bf16, GPU)' if use_gpu else 'NumPy (fp32, CPU)'\n"
        "for n, g_ours, g_peer in rows:\n"
        "    print(f'{n:>10}  gpuops {g_ours:8.1f} GB/s   {label} {g_peer:8.1f} GB/s')"),
    nbf.v4.new_code_cell(
        "import matplotlib\n"
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
        "ax.plot([r[0] for r in rows], [r[1] for r in rows], 'o-', label='gpuops silu_mul')\n"
        "ax.plot([r[0] for r in rows], [r[2] for r in rows], 's--', label=label)\n"
        "ax.set_xscale('log', base=2); ax.set_xlabel('elements'); ax.set_ylabel('GB/s moved')\n"
        "ax.set_title('silu(gate) * up'); ax.legend(); fig.tight_layout()\n"
        "plt.show()"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={
    "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
    "language_info": {"name": "python"}})
path = Path(__file__).resolve().parent.parent / "notebooks" / "01_quickstart.ipynb"
nbf.write(nb, path)
print("wrote", path)
