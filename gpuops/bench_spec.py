"""How an op is benchmarked, declared beside the op (the runner is :mod:`gpuops.bench`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BenchSpec:
    # make_inputs(shape, dtype, randn) -> (args, kwargs); randn(shape, dtype) makes a random
    # device array of the benchmark's framework (torch CUDA tensors when torch is there).
    make_inputs: Callable
    # the same computation in torch eager, called with the same args and kwargs (None: no peer)
    torch_fn: Callable | None
    # default_shape(dtype) -> shape
    default_shape: Callable
    # bytes that must move: bytes_moved(args, out) or None = every array argument read once and
    # every output written once
    bytes_moved: Callable | None = None
    # floating-point operations flops(args, out), for compute-bound ops; None = report GB/s only
    flops: Callable | None = None
    # also time torch.compile(torch_fn) (bench --compile)
    compile_peer: bool = False
    # () -> {peer name: fn(*args, **kwargs)} for other libraries (Liger-Kernel, ...), imported
    # lazily; a library that is not installed simply contributes no entry
    extra_peers: Callable | None = None
    # shape -> the smaller shape at which the output is checked against the NumPy reference
    # (None: the default shape with rows cut to ~1M elements)
    check_shape: Callable | None = None
    # further shapes `bench --all-shapes` times (e.g. long rows, decode sizes)
    extra_shapes: tuple = ()
