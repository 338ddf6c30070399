"""How an op is benchmarked, declared beside the op (the runner is :mod:`gpuops.bench`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BenchSpec:
    # make_inputs(shape, dtype, randn) -> (args, kwargs); randn(shape, dtype) makes a random
    # device array of the benchmark's framework.
    make_inputs: Callable
    # the same computation in torch eager, called with the same args and kwargs (None: no peer)
    torch_fn: Callable | None
    # default_shape(dtype) -> shape
    default_shape: Callable
    # bytes that must move: None = every array argument read once + every output written once
    bytes_moved: Callable | None = None
    # floating-point operations (for compute-bound ops), None = report GB/s only
    flops: Callable | None = None
