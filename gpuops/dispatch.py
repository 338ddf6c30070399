"""From the caller's arrays to kernel launches and back.

The registry (:mod:`gpuops.registry`) generates each op's public function; that function calls
:func:`begin` with the argument values, which

* classifies every array argument (NumPy, CuPy, torch) and checks they share a framework and a
  device, with errors that name the arguments;
* checks dtypes against what the op accepts (no silent casts: mixed dtypes are an error);
* for GPU arrays, wraps them as :class:`gpuops.tensor.Tensor` views and returns a :class:`Call`
  that knows the framework, device and stream (torch's current stream or CuPy's current stream),
  and allocates outputs with the caller's framework (so they live in its allocator, and the op
  can be captured in a CUDA graph: no host sync, no device-to-host read);
* for NumPy arrays on a machine with a GPU, stages them to the device and back;
* otherwise returns no Call, and the public function runs the op's NumPy reference
  (:func:`run_reference`) in float64 and converts the result to the inputs' dtype and framework.
"""
from __future__ import annotations

import numbers
import sys

import numpy as np

from gpuops import dtypes as dt
from gpuops.runtime import config, device
from gpuops.runtime.errors import NoGPUError
from gpuops.shapes import contiguous_strides
from gpuops.tensor import Tensor

NUMPY, CUPY, TORCH = "numpy", "cupy", "torch"
_MISSING = object()
_type_kinds: dict = {}
_torch_dtypes: dict = {}
_torch_devices: dict = {}


def _classify(tp):
    if issubclass(tp, np.ndarray):
        return NUMPY
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(tp, torch.Tensor):
        return TORCH
    if tp.__module__.split(".")[0] == "cupy" and hasattr(tp, "__cuda_array_interface__"):
        return CUPY
    return None


def kind_of(x):
    """'numpy', 'cupy', 'torch', or None for anything that is not an array."""
    tp = type(x)
    k = _type_kinds.get(tp, _MISSING)
    if k is _MISSING:
        k = _type_kinds[tp] = _classify(tp)
    return k


def _device_of(kind, x, op, name) -> int:
    if kind == TORCH:
        d = x.get_device()
        if d < 0 and x.device.type != "cpu":
            raise TypeError(f"gpuops.{op.name}: {name!r} is on torch device {x.device}; gpuops "
                            "takes CPU and CUDA tensors")
        return d
    if kind == CUPY:
        return x.device.id
    return -1


def _torch_tables():
    """torch dtype <-> gpuops dtype, torch.empty and the raw current-stream getter, looked up once
    (the launch path is host-bound at decode sizes: every attribute lookup counts)."""
    global _torch_empty, _torch_stream
    torch = sys.modules["torch"]
    table = dt.torch_table()
    _torch_dtypes.update(table)
    _torch_dtype_of.update({v: k for k, v in table.items()})
    _torch_empty = torch.empty
    _torch_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
        lambda dev: torch.cuda.current_stream(dev).cuda_stream)


_torch_dtype_of: dict = {}
_numpy_dtypes: dict = {}
_torch_empty = _torch_stream = None


def _dtype_of(kind, x, op, name):
    if kind == TORCH:
        if not _torch_dtypes:
            _torch_tables()
        d = _torch_dtypes.get(x.dtype)
    else:
        d = _numpy_dtypes.get(x.dtype, _MISSING)
        if d is _MISSING:
            d = _numpy_dtypes[x.dtype] = dt.from_numpy(x.dtype)
    if d is None:
        raise TypeError(f"gpuops.{op.name}: {name!r} has dtype {x.dtype}, which gpuops does not "
                        "support")
    return d


def _check_dtypes(op, found: dict, on_gpu: bool):
    """found: param name -> DType. Returns the dtype shared by the op's main group."""
    group_dtype, group_name = None, None
    for name, d in found.items():
        allowed = op.param_dtypes.get(name)
        if allowed is not None:
            if d not in allowed:
                raise TypeError(f"gpuops.{op.name}: {name!r} has dtype {d}; expected one of "
                                f"{dt.names(allowed)}")
            continue
        if group_dtype is None:
            ok = op.dtypes if on_gpu else op.cpu_dtypes
            if d not in ok:
                note = (" (float64 runs only on the CPU reference path, for NumPy and CPU torch "
                        "inputs)" if on_gpu and d in op.cpu_dtypes else "")
                raise TypeError(f"gpuops.{op.name}: {name!r} has dtype {d}; expected one of "
                                f"{dt.names(ok)}{note}")
            group_dtype, group_name = d, name
        elif d is not group_dtype:
            raise TypeError(f"gpuops.{op.name}: {name!r} is {d} but {group_name!r} is "
                            f"{group_dtype}; gpuops does not promote dtypes, cast explicitly")
    return group_dtype


def _check_grad(op, name, x):
    if x.requires_grad:
        torch = sys.modules["torch"]
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"gpuops.{op.name}: {name!r} requires grad, and gpuops.{op.name} does not record "
                "autograd; call it under torch.no_grad(), detach the input, or use the autograd "
                "op in gpuops.torch where there is one")


class Call:
    """One GPU invocation of an op: framework, device, stream, output allocation."""

    __slots__ = ("op", "kind", "device", "stream", "restore_device", "user_out", "staged_out",
                 "result_dtype", "held")

    def __init__(self, op, kind, dev):
        self.op = op
        self.kind = kind
        self.device = dev
        self.restore_device = device.make_current(dev)
        self.user_out = None
        self.staged_out = None
        # every allocation of the call stays referenced until the call ends: an array dropped
        # after taking its pointer (a workspace) would go back to the caching allocator (torch,
        # CuPy) at once and be handed to the next allocation of the same call
        self.held = []
        if kind == TORCH:
            self.stream = _torch_stream(dev)
            if dev not in _torch_devices:
                _torch_devices[dev] = sys.modules["torch"].device("cuda", dev)
        else:
            self.stream = device.cupy_or_none().cuda.get_current_stream().ptr

    def empty(self, shape, dtype) -> Tensor:
        """A new contiguous output in the caller's framework (poisoned with NaN bytes when
        GPUOPS_DEBUG_POISON=1, so that tests see every element a kernel fails to write)."""
        if self.kind == TORCH:
            obj = _torch_empty(shape, dtype=_torch_dtype_of[dtype], device=_torch_devices[self.device])
            t = Tensor(obj.data_ptr(), obj.shape, obj.stride(), dtype, self.device, obj, obj.numel(),
                       True)
        else:
            cp = device.cupy_or_none()
            alloc = dt.storage_numpy(dtype) if self.kind == NUMPY else (
                dt.to_numpy(dtype) if dtype is dt.bfloat16 else np.dtype(dtype.name))
            obj = cp.empty(tuple(shape), dtype=alloc)
            t = Tensor(obj.data.ptr, obj.shape, contiguous_strides(obj.shape), dtype, self.device,
                       obj, obj.size, True)
        if config.settings.poison and t.numel:
            device.cupy_or_none().cuda.runtime.memsetAsync(t.ptr, 0xFF, t.nbytes, self.stream)
        self.held.append(obj)
        return t

    def finish(self, result):
        if self.kind != NUMPY:
            if type(result) is tuple:
                return tuple(r.obj for r in result)
            return result.obj
        if type(result) is tuple:
            return tuple(self._to_host(r) for r in result)
        return self._to_host(result)

    def _to_host(self, t: Tensor):
        host = t.obj.get()
        if t.dtype is dt.bfloat16:
            host = host.view(dt.to_numpy(dt.bfloat16))
        if self.staged_out is t:
            np.copyto(self.user_out, host)
            return self.user_out
        return host

    def close(self):
        self.held = None
        if self.restore_device is not None:
            device.cupy_or_none().cuda.runtime.setDevice(self.restore_device)


def _wrap_gpu(kind, x, d, dev) -> Tensor:
    if kind == TORCH:
        return Tensor(x.data_ptr(), x.shape, x.stride(), d, dev, x, x.numel(), x.is_contiguous())
    item = x.itemsize
    return Tensor(x.data.ptr, x.shape, tuple(s // item for s in x.strides), d, dev, x, x.size,
                  x.flags.c_contiguous)


def _stage(call, x, d) -> Tensor:
    cp = device.cupy_or_none()
    host = np.ascontiguousarray(x).reshape(np.shape(x)).view(dt.storage_numpy(d))  # 0-d stays 0-d
    arr = cp.asarray(host)
    return Tensor(arr.data.ptr, arr.shape, contiguous_strides(arr.shape), d, call.device, arr)


def begin(op, values: tuple):
    """(Call, converted values) for a GPU run, or (None, None) for the CPU reference path.

    This runs on every call, so it is written for speed: one pass over the array arguments that
    classifies, checks devices, grads and dtypes, then one pass that wraps them.
    """
    kind = None
    dev = -1
    first = None
    seen = []                                  # (pos, x, dtype) of every array argument
    group_dtype = group_name = None
    names = op.param_names
    param_dtypes = op.param_dtypes
    for pos in op.tensor_positions:
        x = values[pos]
        if x is None:
            if pos in op.required_tensor_positions:
                raise TypeError(f"gpuops.{op.name}: {names[pos]!r} is required, got None")
            continue
        k = _type_kinds.get(type(x), _MISSING)
        if k is _MISSING:
            k = kind_of(x)
        if k is None:
            if pos in op.scalar_positions and isinstance(x, numbers.Real) and not isinstance(x, bool):
                continue
            expected = "an array or a number" if pos in op.scalar_positions else "an array"
            raise TypeError(f"gpuops.{op.name}: {names[pos]!r} must be {expected} (NumPy, CuPy or "
                            f"torch), got {type(x).__name__}")
        if k == TORCH:
            d = x.get_device()
            if d < 0:
                d = _device_of(k, x, op, names[pos])
            if x.requires_grad:
                _check_grad(op, names[pos], x)
            xd = _torch_dtypes.get(x.dtype) if _torch_dtypes else None
            if xd is None:
                xd = _dtype_of(k, x, op, names[pos])
        else:
            d = _device_of(k, x, op, names[pos])
            xd = _dtype_of(k, x, op, names[pos])
        if kind is None:
            kind, dev, first = k, d, names[pos]
        elif k != kind:
            raise TypeError(f"gpuops.{op.name}: {first!r} is a {kind} array but {names[pos]!r} is "
                            f"a {k} array; pass arrays of one framework")
        elif d != dev:
            where = lambda i: "cpu" if i < 0 else f"cuda:{i}"  # noqa: E731
            raise ValueError(f"gpuops.{op.name}: {first!r} is on {where(dev)} but {names[pos]!r} is "
                             f"on {where(d)}; move them to one device")
        if group_dtype is None and names[pos] not in param_dtypes:
            group_dtype, group_name = xd, names[pos]
        if k == TORCH and d >= 0:     # the common case: wrap now, no second pass
            x = Tensor(x.data_ptr(), x.shape, x.stride(), xd, d, x, x.numel(), x.is_contiguous())
        seen.append((pos, x, xd))
    if kind is None:
        raise TypeError(f"gpuops.{op.name}: no array argument given")

    on_gpu = dev >= 0 or (kind == NUMPY and device.gpu_available()
                          and all(d in op.dtypes or names[pos] in param_dtypes
                                  for pos, _, d in seen))
    if len(seen) > 1 or group_dtype not in (op.dtypes if on_gpu else op.cpu_dtypes):
        _check_dtypes(op, {names[pos]: d for pos, _, d in seen}, on_gpu)
    if not on_gpu:
        return None, None

    call = Call(op, kind, dev if kind != NUMPY else device.default_device())
    call.result_dtype = group_dtype
    converted = list(values)
    try:
        for pos, x, d in seen:
            if kind == TORCH:
                converted[pos] = x                     # wrapped in the first pass
            elif kind == CUPY:
                converted[pos] = _wrap_gpu(kind, x, d, dev)
            elif pos == op.out_position:
                t = converted[pos] = call.empty(x.shape, d)
                call.user_out, call.staged_out = x, t
            else:
                converted[pos] = _stage(call, x, d)
    except BaseException:
        call.close()
        raise
    return call, converted


def _to_float64(kind, x):
    if kind == TORCH:
        x = x.detach()
        return x.double().numpy() if x.is_floating_point() else x.numpy()
    return np.asarray(x).astype(np.float64) if np.asarray(x).dtype.kind == "f" else np.asarray(x)


def _from_numpy(kind, res: np.ndarray, d):
    if kind == TORCH:
        torch = sys.modules["torch"]
        res = np.ascontiguousarray(res).reshape(res.shape)   # ascontiguousarray makes 0-d 1-d
        if res.dtype.kind == "f":
            return torch.from_numpy(res).to(dt.to_torch(d))
        return torch.from_numpy(res)
    if res.dtype.kind == "f":
        return res.astype(dt.to_numpy(d))
    return res


def run_reference(op, values: tuple):
    """The CPU path: the op's NumPy reference in float64, cast back to the inputs' dtype."""
    if config.settings.fallback == "error":
        raise NoGPUError(
            f"gpuops.{op.name}: no GPU run is possible for these inputs "
            f"({'no usable GPU' if not device.gpu_available() else 'CPU arrays or float64'}) and "
            "GPUOPS_FALLBACK=error forbids the CPU reference path")
    kind, found = None, {}
    kwargs = {}
    out = None
    for pos, name in enumerate(op.param_names):
        x = values[pos]
        k = kind_of(x) if pos in op.tensor_positions and x is not None else None
        if k is not None:
            kind = kind or k
            found[name] = _dtype_of(k, x, op, name)
        if pos == op.out_position:
            out = x
            continue
        kwargs[name] = _to_float64(k, x) if k is not None else x
    result_dtype = _check_dtypes(op, found, on_gpu=False)
    # A reference whose output dtype is not the inputs' (out_dtype=, int8 in / float out) says so
    # with a `result_dtype(values by name, array dtypes by name)` attribute: a DType for every
    # output, or a tuple with one per output (None: the inputs' dtype), e.g. (None, float32) for
    # an op that returns float32 statistics (lse, rstd) beside its result, as its kernels do.
    hook = getattr(op.reference, "result_dtype", None)
    per_output = None
    if hook is not None:
        chosen = hook(dict(zip(op.param_names, values)), found)
        if isinstance(chosen, tuple):
            per_output = tuple(result_dtype if d is None else d for d in chosen)
        elif chosen is not None:
            result_dtype = chosen
    res = op.reference(**kwargs)
    single = not isinstance(res, tuple)
    results = (res,) if single else res
    dtypes = per_output if per_output is not None else (result_dtype,) * len(results)
    if len(dtypes) != len(results):
        raise AssertionError(f"gpuops.{op.name}: result_dtype names {len(dtypes)} outputs, the "
                             f"reference returned {len(results)}")
    outs = tuple(_from_numpy(kind, np.asarray(r), d) for r, d in zip(results, dtypes))
    if out is not None:
        if tuple(out.shape) != tuple(outs[0].shape):
            raise ValueError(f"gpuops.{op.name}: 'out' has shape {tuple(out.shape)}, the result "
                             f"has {tuple(outs[0].shape)}")
        if kind == TORCH:
            out.copy_(outs[0])
        else:
            np.copyto(out, outs[0])
        outs = (out,) + outs[1:]
    return outs[0] if single else outs
