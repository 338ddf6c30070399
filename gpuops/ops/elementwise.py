"""Fused elementwise ops: activations, gated activations (SwiGLU/GeGLU), bias+activation, arithmetic.

Kernels: cuda_src/elementwise/*.cu, all built on the generic pointwise kernels of
cuda_src/elementwise/pointwise.cuh (16-byte vector loads with a scalar tail for contiguous
operands, a strided kernel for any other layout). Math is fp32 for fp32/fp16/bf16 storage.
Broadcasting follows torch; dtypes are never promoted (mixed dtypes raise TypeError).
"""
from __future__ import annotations

import math
from math import prod

import numpy as np

from gpuops import dtypes as dt
from gpuops.bench_spec import BenchSpec
from gpuops.registry import register
from gpuops.runtime import device, loader
from gpuops.runtime.launch import ArgSpec
from gpuops.runtime.modules import KernelModule
from gpuops.shapes import broadcast_shapes, broadcast_strides, coalesce
from gpuops.tensor import Tensor

# ---------------------------------------------------------------------------------------------
# Kernel modules: one per .cu file, every (functor, dtype, variant) instantiated by name.

FLAT_ARGS = ArgSpec("4f", "ptr", "ptr", "ptr", "ptr", "i64", "i64", "i64", "i64")
STRIDED_ARGS = ArgSpec("4f", "ptr", "ptr", "ptr", "ptr", "i8q32q", "i64")
MAX_DIMS, THREADS = 8, 256          # as in strided.cuh / pointwise.cuh
ILP = 1                             # GPUOPS_POINTWISE_ILP in pointwise.cuh (16-byte packs per thread)
STRIDED_BLOCKS_PER_SM = 8           # the strided kernel's grid-stride loop: one wave of blocks

# activation name (torch's spelling) -> gpuops::Act enumerator
ACTIVATIONS = {None: "kIdentity", "none": "kIdentity", "identity": "kIdentity", "relu": "kRelu",
               "silu": "kSilu", "gelu": "kGeluErf", "gelu_tanh": "kGeluTanh"}
_GELU_APPROX = {"none": "kGeluErf", "tanh": "kGeluTanh"}


def _flat_expr(functor, dtype, nin, vec):
    return f"gpuops::pointwise_flat<gpuops::{functor}, {dtype.ctype}, {nin}, {vec}>"


def _strided_expr(functor, dtype, nin):
    return f"gpuops::pointwise_strided<gpuops::{functor}, {dtype.ctype}, {nin}>"


class Pointwise:
    """One functor of a pointwise module with its kernels for every dtype: the flat kernel with
    16-byte packs, the flat kernel with one element per step, and the strided kernel. Kernel
    names are computed once here, not per call."""

    def __init__(self, module_name: str, functor: str, nin: int):
        self.module_name, self.functor, self.nin = module_name, functor, nin
        self.module = None
        self.exprs = {}
        for d in dt.FLOATS:
            self.exprs[(d, True)] = _flat_expr(functor, d, nin, 16 // d.itemsize)
            self.exprs[(d, False)] = _flat_expr(functor, d, nin, 1)
            self.exprs[(d, None)] = _strided_expr(functor, d, nin)
        self._kernels: dict = {}
        self._generation = -1

    def kernel(self, dev: int, dtype, variant):
        """variant: True = flat 16-byte packs, False = flat one element, None = strided."""
        if self._generation != loader.generation:
            self._kernels.clear()
            self._generation = loader.generation
        key = (dev, dtype, variant)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = loader.load(self.module, dev).kernel(self.exprs[(dtype, variant)])
        return k


def _pointwise_module(name, source, functors: dict) -> dict:
    """Declare the module and return {functor: Pointwise}."""
    ops = {f: Pointwise(name, f, nin) for f, nin in functors.items()}
    kernels = {e: (STRIDED_ARGS if v is None else FLAT_ARGS)
               for p in ops.values() for (d, v), e in p.exprs.items()}
    module = KernelModule(name, source, kernels, pdl=True)
    for p in ops.values():
        p.module = module
    return ops


ACTIVATION_OPS = _pointwise_module("elementwise.activations", "elementwise/activations.cu", {
    **{f"Activation<gpuops::Act::{a}>": 1 for a in ("kRelu", "kSilu", "kGeluErf", "kGeluTanh")},
    "ScaleShiftClamp": 1})
GATED_OPS = _pointwise_module("elementwise.gated", "elementwise/gated.cu", {
    **{f"GatedMul<gpuops::Act::{a}>": 2 for a in ("kSilu", "kGeluErf", "kGeluTanh")},
    "SiluAddMul": 3})
BINARY_OPS = _pointwise_module("elementwise.binary", "elementwise/binary.cu", {
    "AddScaled": 2, "Mul": 2,
    **{f"BiasAct<gpuops::Act::{a}>": 2 for a in ("kIdentity", "kRelu", "kSilu", "kGeluErf",
                                                 "kGeluTanh")}})
_ALL = {**ACTIVATION_OPS, **GATED_OPS, **BINARY_OPS}


def _op(functor: str) -> Pointwise:
    return _ALL[functor]


# ---------------------------------------------------------------------------------------------
# The launcher shared by every op of the family.

def _check_out(op, out: Tensor, shape, inputs, names):
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"gpuops.{op}: 'out' has shape {tuple(out.shape)}, the result has "
                         f"{tuple(shape)}")
    if any(st == 0 for st, n in zip(out.strides, out.shape) if n > 1):
        raise ValueError(f"gpuops.{op}: 'out' has overlapping elements (a stride of 0)")
    lo, hi = out.span()
    for name, t in zip(names, inputs):
        a, b = t.span()
        if a <= hi and lo <= b and not (t.ptr == out.ptr and tuple(t.shape) == tuple(out.shape)
                                        and tuple(t.strides) == tuple(out.strides)):
            raise ValueError(f"gpuops.{op}: 'out' overlaps {name!r} without being the same view; "
                             "in-place use must pass the identical array")


def _period(t: Tensor, shape) -> int | None:
    """How a contiguous input maps onto the flat output: 0 = same shape, 1 = one value,
    k = a trailing block of k elements repeated; None = needs the strided kernel."""
    if t.numel == 1:
        return 1
    if not t.contiguous:
        return None
    padded = (1,) * (len(shape) - len(t.shape)) + tuple(t.shape)
    k = 0
    while k < len(shape) and padded[k] == 1 and shape[k] != 1:
        k += 1
    if padded[k:] != tuple(shape[k:]):
        return None
    return 0 if k == 0 or all(s == 1 for s in shape[:k]) else prod(shape[k:])


_strided_blocks: dict = {}
_PADS = {1: (0, 0), 2: (0,), 3: ()}
_ZEROS = {1: (0,), 2: (0, 0), 3: (0, 0, 0)}


def pointwise(call, kernels: Pointwise, inputs: tuple, names: tuple, out: Tensor | None,
              params=(0.0, 0.0, 0.0, 0.0)) -> Tensor:
    """out = functor(*inputs) with torch broadcasting, into ``out`` or a new array.

    Inputs that are contiguous and either of the output's shape, a single value, or a trailing
    block repeated (a bias) take the flat kernel; anything else the strided kernel.
    """
    first = inputs[0]
    shape = first.shape
    same = True
    for t in inputs[1:]:
        if t.shape != shape:
            same = False
            break
    if not same:
        shape = broadcast_shapes(**{n: t.shape for n, t in zip(names, inputs)})
    dtype = call.result_dtype
    if out is None:
        out = call.empty(shape, dtype)
    else:
        _check_out(call.op.name, out, shape, inputs, names)
    n = out.numel
    if n == 0:
        return out
    nin = len(inputs)
    pad = _PADS[nin]
    if nin == 1:
        ptrs = (first.ptr, 0, 0)
        contiguous = first.contiguous
    else:
        ptrs = tuple([t.ptr for t in inputs]) + pad
        contiguous = all([t.contiguous for t in inputs])

    if same and contiguous and out.contiguous:
        periods = _ZEROS[nin]
    else:
        periods = tuple([_period(t, shape) for t in inputs]) if out.contiguous else (None,)
    if None not in periods:
        vec = 16 // dtype.itemsize
        packed = out.ptr % 16 == 0
        if packed:
            for t, p in zip(inputs, periods):
                if p != 1 and (t.ptr % 16 or p % vec):
                    packed = False
                    break
        # One 16-byte pack (or element) per thread and ILP step, grid covering the array once:
        # measured faster on the H100 than a one-wave grid-stride grid (results 2026-11-22 run1).
        units = n // vec if packed else n
        grid = max(1, -(-units // (THREADS * ILP)))
        kernels.kernel(call.device, dtype, packed).launch(
            (grid, 1, 1), (THREADS, 1, 1), call.stream, *params, out.ptr, *ptrs, *periods, *pad, n)
        return out

    strides = [out.strides] + [broadcast_strides(t.shape, t.strides, shape) for t in inputs]
    cshape, cstrides = coalesce(tuple(shape), strides)
    if len(cshape) > MAX_DIMS:
        raise ValueError(f"gpuops.{call.op.name}: the operands' layouts need {len(cshape)} "
                         f"dimensions after merging contiguous ones; the strided kernel handles "
                         f"{MAX_DIMS}. Make the inputs contiguous first")
    dpad = MAX_DIMS - len(cshape)
    layout = [len(cshape), *cshape, *[1] * dpad]
    for k in range(4):
        st = cstrides[k] if k < len(cstrides) else (0,) * len(cshape)
        layout += [*st, *[0] * dpad]
    blocks = _strided_blocks.get(call.device)
    if blocks is None:
        blocks = _strided_blocks[call.device] = (
            device.device_info(call.device).sm_count * STRIDED_BLOCKS_PER_SM)
    grid = max(1, min(-(-n // THREADS), blocks))
    kernels.kernel(call.device, dtype, None).launch(
        (grid, 1, 1), (THREADS, 1, 1), call.stream, *params, out.ptr, *ptrs, *layout, n)
    return out


# ---------------------------------------------------------------------------------------------
# NumPy references, float64, textbook formulas (independent of the kernels' rearrangements).

def _erf(x):
    try:
        from scipy.special import erf  # noqa: PLC0415
        return erf(x)
    except ImportError:
        return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)


def _act_ref(name, x):
    with np.errstate(all="ignore"):
        if name == "relu":
            return np.where(x < 0, 0.0, x)
        if name == "silu":
            return x / (1.0 + np.exp(-x))
        if name == "gelu":
            return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
        if name == "gelu_tanh":
            u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
            return 0.5 * x * (1.0 + np.tanh(u))
        return x + 0.0


def _check_activation(op, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"gpuops.{op}: activation={activation!r}; expected one of "
                         f"{', '.join(repr(a) for a in ACTIVATIONS)}")


def _check_approximate(op, approximate):
    if approximate not in _GELU_APPROX:
        raise ValueError(f"gpuops.{op}: approximate={approximate!r}; expected 'none' or 'tanh'")


def ref_silu(input):
    return _act_ref("silu", input)


def ref_relu(input):
    return _act_ref("relu", input)


def ref_gelu(input, approximate="none"):
    _check_approximate("gelu", approximate)
    return _act_ref("gelu" if approximate == "none" else "gelu_tanh", input)


def ref_silu_mul(gate, up):
    broadcast_shapes(gate=gate.shape, up=up.shape)
    return _act_ref("silu", gate) * up


def ref_gelu_mul(gate, up, approximate="none"):
    _check_approximate("gelu_mul", approximate)
    broadcast_shapes(gate=gate.shape, up=up.shape)
    return _act_ref("gelu" if approximate == "none" else "gelu_tanh", gate) * up


def ref_bias_act(input, bias, activation):
    _check_activation("bias_act", activation)
    broadcast_shapes(input=input.shape, bias=bias.shape)
    return _act_ref(activation, input + bias)


def ref_silu_add_mul(a, b, c):
    broadcast_shapes(a=a.shape, b=b.shape, c=c.shape)
    return _act_ref("silu", a + b * c)


def ref_add(input, other, alpha=1.0):
    if not np.isscalar(other):
        broadcast_shapes(input=input.shape, other=other.shape)
    with np.errstate(all="ignore"):
        return input + alpha * np.asarray(other, dtype=np.float64)


def ref_mul(input, other):
    if not np.isscalar(other):
        broadcast_shapes(input=input.shape, other=other.shape)
    with np.errstate(all="ignore"):
        return input * np.asarray(other, dtype=np.float64)


def ref_scale_clamp(input, scale=1.0, min=None, max=None):  # noqa: A002 (torch's names)
    with np.errstate(all="ignore"):
        v = input * scale
    if min is not None:
        v = np.where(v < min, min, v)
    if max is not None:
        v = np.where(v > max, max, v)
    return v


# ---------------------------------------------------------------------------------------------
# Benchmarks: 256 MiB per tensor, rows of 4096.

def _rows_shape(d):
    return ((256 << 20) // d.itemsize // 4096, 4096)


def _liger_swiglu():
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # noqa: PLC0415
    return {"liger": lambda g, u: LigerSiLUMulFunction.apply(g, u)}


def _bench(n_inputs, torch_fn, kwargs=None, bias=False, extra_peers=None):
    def make(shape, d, randn):
        args = [randn(shape, d) for _ in range(n_inputs)]
        if bias:
            args.append(randn(shape[-1:], d))
        return tuple(args), dict(kwargs or {})
    return BenchSpec(make_inputs=make, torch_fn=torch_fn, default_shape=_rows_shape,
                     compile_peer=True, extra_peers=extra_peers)


def _torch_f():
    import torch.nn.functional as F  # noqa: PLC0415,N812
    return F


# ---------------------------------------------------------------------------------------------
# The ops.

_SILU, _RELU = _op("Activation<gpuops::Act::kSilu>"), _op("Activation<gpuops::Act::kRelu>")
_SILU_MUL, _SCALE_CLAMP = _op("GatedMul<gpuops::Act::kSilu>"), _op("ScaleShiftClamp")
_INPUT, _GATE_UP, _INPUT_OTHER = ("input",), ("gate", "up"), ("input", "other")

@register(family="elementwise", reference=ref_silu,
          bench=_bench(1, lambda x: _torch_f().silu(x)))
def silu(call, input: Tensor, *, out: Tensor | None = None) -> Tensor:
    """SiLU (swish): ``input * sigmoid(input)``, as ``torch.nn.functional.silu``.

    Computed in fp32 for fp32/fp16/bf16 storage; ``out`` may be ``input`` itself (in place).
    """
    return pointwise(call, _SILU, (input,), _INPUT, out)


@register(family="elementwise", reference=ref_gelu,
          bench=_bench(1, lambda x, approximate="none": _torch_f().gelu(x, approximate=approximate)))
def gelu(call, input: Tensor, approximate: str = "none", *, out: Tensor | None = None) -> Tensor:
    """GELU, as ``torch.nn.functional.gelu``: ``approximate='none'`` is
    ``0.5 x (1 + erf(x / sqrt 2))``, ``'tanh'`` is ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    Evaluated as ``0.5 x erfc(-x / sqrt 2)`` and ``x * sigmoid(2u)``, which keep full relative
    precision for large negative x where torch's ``1 + ...`` forms cancel.
    """
    _check_approximate("gelu", approximate)
    return pointwise(call, _op(f"Activation<gpuops::Act::{_GELU_APPROX[approximate]}>"), (input,),
                     _INPUT, out)


@register(family="elementwise", reference=ref_relu,
          bench=_bench(1, lambda x: _torch_f().relu(x)))
def relu(call, input: Tensor, *, out: Tensor | None = None) -> Tensor:
    """ReLU: ``max(input, 0)``; NaN stays NaN, as in ``torch.relu``."""
    return pointwise(call, _RELU, (input,), _INPUT, out)


@register(family="elementwise", reference=ref_silu_mul,
          bench=_bench(2, lambda g, u: _torch_f().silu(g) * u, extra_peers=_liger_swiglu))
def silu_mul(call, gate: Tensor, up: Tensor, *, out: Tensor | None = None) -> Tensor:
    """SwiGLU's gate: ``silu(gate) * up`` in one pass (broadcasting like torch).

    Equivalent to ``F.silu(gate) * up`` without the intermediate tensor (and without rounding
    ``silu(gate)`` to the storage dtype before the product).
    """
    return pointwise(call, _SILU_MUL, (gate, up), _GATE_UP, out)


@register(family="elementwise", reference=ref_gelu_mul,
          bench=_bench(2, lambda g, u, approximate="none":
                       _torch_f().gelu(g, approximate=approximate) * u))
def gelu_mul(call, gate: Tensor, up: Tensor, approximate: str = "none", *,
             out: Tensor | None = None) -> Tensor:
    """GeGLU's gate: ``gelu(gate, approximate) * up`` in one pass."""
    _check_approximate("gelu_mul", approximate)
    return pointwise(call, _op(f"GatedMul<gpuops::Act::{_GELU_APPROX[approximate]}>"), (gate, up),
                     _GATE_UP, out)


@register(family="elementwise", reference=ref_bias_act,
          bench=_bench(1, lambda x, b, activation="gelu": _torch_f().gelu(x + b),
                       kwargs={"activation": "gelu"}, bias=True))
def bias_act(call, input: Tensor, bias: Tensor, activation: str | None, *,
             out: Tensor | None = None) -> Tensor:
    """``activation(input + bias)``, the epilogue of a linear layer, in one pass.

    ``bias`` broadcasts against ``input`` (usually shape ``[features]``); ``activation`` is one of
    None/'none'/'identity', 'relu', 'silu', 'gelu', 'gelu_tanh'.
    """
    _check_activation("bias_act", activation)
    return pointwise(call, _op(f"BiasAct<gpuops::Act::{ACTIVATIONS[activation]}>"), (input, bias),
                     ("input", "bias"), out)


@register(family="elementwise", reference=ref_silu_add_mul,
          bench=_bench(3, lambda a, b, c: _torch_f().silu(a + b * c)))
def silu_add_mul(call, a: Tensor, b: Tensor, c: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``silu(a + b * c)`` in one pass (``b * c + a`` is one fused multiply-add)."""
    return pointwise(call, _op("SiluAddMul"), (a, b, c), ("a", "b", "c"), out)


_INF = float("inf")


@register(family="elementwise", reference=ref_add,
          bench=_bench(2, lambda x, y: x + y))
def add(call, input: Tensor, other: Tensor | float, *, alpha: float = 1.0,
        out: Tensor | None = None) -> Tensor:
    """``input + alpha * other``, as ``torch.add``; ``other`` is an array (broadcast) or a number.

    The result has ``input``'s dtype; ``alpha * other + input`` is one fused multiply-add in fp32.
    """
    if not isinstance(other, Tensor):
        return pointwise(call, _SCALE_CLAMP, (input,), _INPUT, out,
                         (1.0, float(alpha) * float(other), -_INF, _INF))
    return pointwise(call, _op("AddScaled"), (input, other), _INPUT_OTHER, out,
                     (float(alpha), 0.0, 0.0, 0.0))


@register(family="elementwise", reference=ref_mul,
          bench=_bench(2, lambda x, y: x * y))
def mul(call, input: Tensor, other: Tensor | float, *, out: Tensor | None = None) -> Tensor:
    """``input * other``, as ``torch.mul``; ``other`` is an array (broadcast) or a number."""
    if not isinstance(other, Tensor):
        return pointwise(call, _SCALE_CLAMP, (input,), _INPUT, out,
                         (float(other), -0.0, -_INF, _INF))
    return pointwise(call, _op("Mul"), (input, other), _INPUT_OTHER, out)


@register(family="elementwise", reference=ref_scale_clamp,
          bench=_bench(1, lambda x, scale=0.5, min=-1.0, max=1.0:   # noqa: A006
                       (x * scale).clamp_(min, max), kwargs={"scale": 0.5, "min": -1.0, "max": 1.0}))
def scale_clamp(call, input: Tensor, scale: float = 1.0, min: float | None = None,  # noqa: A002
                max: float | None = None, *, out: Tensor | None = None) -> Tensor:  # noqa: A002
    """``clamp(input * scale, min, max)`` in one pass; a None bound is open. NaN stays NaN, and
    ``min > max`` gives ``max`` everywhere, as ``torch.clamp``."""
    lo = -_INF if min is None else float(min)
    hi = _INF if max is None else float(max)
    return pointwise(call, _SCALE_CLAMP, (input,), _INPUT, out, (float(scale), -0.0, lo, hi))
