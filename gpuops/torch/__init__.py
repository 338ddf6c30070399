"""The torch-facing layer: gpuops kernels as torch custom ops (``torch.ops.gpuops.*``) with
autograd and fake (meta) implementations, so they work in training and inside ``torch.compile``
graphs without graph breaks.

    import gpuops.torch as gt
    y = gt.softmax(x, dim=-1)        # differentiable; x on CUDA runs gpuops' kernels, on CPU the
    y.sum().backward()               # NumPy references

Each family adds ``gpuops/torch/<family>.py`` (imported automatically) defining its ops with
``torch.library.custom_op("gpuops::<name>", mutates_args=())`` around the plain ``gpuops.<name>``
function, a ``register_fake`` shape function, and ``register_autograd`` whose backward calls the
family's backward op. The plain ``gpuops.<op>`` functions stay framework-neutral and refuse
tensors that require grad; this layer is where gradients flow.
"""
from __future__ import annotations

import importlib
import pkgutil

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover
    raise ImportError("gpuops.torch needs PyTorch (pip install torch)") from exc

__all__: list = []
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _info.name.startswith("_"):
        _mod = importlib.import_module(f"{__name__}.{_info.name}")
        for _name in getattr(_mod, "__all__", ()):
            globals()[_name] = getattr(_mod, _name)
            __all__.append(_name)
