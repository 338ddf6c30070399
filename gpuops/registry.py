"""The op registry: an op is declared once, and its public function is generated.

An op is a Python function whose first parameter is the :class:`gpuops.dispatch.Call` and whose
array parameters are annotated ``Tensor`` (required), ``Tensor | None`` (optional) or
``Tensor | float`` (an array or a Python number)::

    @register(family="elementwise", reference=ref.silu_mul)
    def silu_mul(call, gate: Tensor, up: Tensor, *, out: Tensor | None = None) -> Tensor:
        '''silu(gate) * up ...'''
        return pointwise(call, "GatedMul<Act::kSilu>", gate=gate, up=up, out=out)

``register`` generates ``gpuops.silu_mul(gate, up, *, out=None)`` with the same signature (less
``call``) and docstring. The generated function classifies and checks its arguments, runs the
implementation on the GPU with ``Tensor`` views, or the NumPy ``reference`` (float64, same
parameters less ``out``) on the CPU, and returns arrays of the caller's framework. No dispatch glue
is written per op, and no ``inspect`` work happens per call.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from gpuops import dtypes as dt
from gpuops import dispatch

_OPS: dict = {}

_TENSOR = {"Tensor"}
_OPTIONAL = {"Tensor | None", "Optional[Tensor]", "None | Tensor"}
_SCALAR_OK = {"Tensor | float", "float | Tensor", "Union[Tensor, float]"}


@dataclass
class Op:
    name: str
    family: str
    impl: object
    reference: object
    dtypes: tuple              # dtypes of the GPU kernels (the main dtype group)
    param_dtypes: dict         # param name -> allowed dtypes, for params outside the main group
    bench: object
    param_names: tuple = ()
    tensor_positions: tuple = ()
    required_tensor_positions: frozenset = frozenset()
    scalar_positions: frozenset = frozenset()
    out_position: int = -1
    function: object = None

    @property
    def cpu_dtypes(self) -> tuple:
        """What the reference path takes: the GPU dtypes, and float64 for floating ops."""
        extra = (dt.float64,) if any(d.is_floating for d in self.dtypes) else ()
        return tuple(self.dtypes) + tuple(d for d in extra if d not in self.dtypes)

    @property
    def summary(self) -> str:
        doc = (self.impl.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


def _annotation(p) -> str:
    a = p.annotation
    if a is inspect.Parameter.empty:
        return ""
    return a if isinstance(a, str) else getattr(a, "__name__", str(a))


def _generate(op: Op, sig: inspect.Signature):
    params = list(sig.parameters.values())[1:]          # drop `call`
    defaults, header, call_args = {}, [], []
    star = False
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"op {op.name}: parameter {p.name!r} must be positional-or-keyword "
                            "or keyword-only")
        if p.kind is p.KEYWORD_ONLY and not star:
            header.append("*")
            star = True
        if p.default is p.empty:
            header.append(p.name)
        else:
            defaults[p.name] = p.default
            header.append(f"{p.name}=_defaults[{p.name!r}]")
        call_args.append(f"_a[{i}]" if p.kind is not p.KEYWORD_ONLY else f"{p.name}=_a[{i}]")
    names = ", ".join(p.name for p in params)
    src = (
        f"def {op.name}({', '.join(header)}):\n"
        f"    _v = ({names},)\n"
        f"    _call, _a = _begin(_op, _v)\n"
        f"    if _call is None:\n"
        f"        return _reference(_op, _v)\n"
        f"    try:\n"
        f"        return _call.finish(_impl(_call, {', '.join(call_args)}))\n"
        f"    finally:\n"
        f"        _call.close()\n")
    scope = {"_defaults": defaults, "_begin": dispatch.begin, "_reference": dispatch.run_reference,
             "_op": op, "_impl": op.impl}
    exec(compile(src, f"<gpuops op {op.name}>", "exec"), scope)  # noqa: S102
    fn = scope[op.name]
    fn.__doc__ = op.impl.__doc__
    fn.__module__ = "gpuops"
    fn.__qualname__ = op.name
    fn.__signature__ = sig.replace(parameters=params)
    fn.op = op
    return fn


def register(*, family: str, reference, dtypes=dt.FLOATS, param_dtypes=None, bench=None,
             name: str | None = None):
    """Declare an op (see the module docstring). Returns the generated public function."""
    def decorate(impl):
        op_name = name or impl.__name__
        if op_name in _OPS:
            raise ValueError(f"gpuops: op {op_name!r} is registered twice")
        if not (impl.__doc__ or "").strip():
            raise ValueError(f"gpuops: op {op_name!r} needs a docstring")
        sig = inspect.signature(impl)
        params = list(sig.parameters.values())[1:]
        ref_params = set(inspect.signature(reference).parameters)
        expected = {p.name for p in params if p.name != "out"}
        if ref_params != expected:
            raise TypeError(f"gpuops: the reference of {op_name!r} takes {sorted(ref_params)}, "
                            f"expected the op's parameters {sorted(expected)}")
        tensor_pos, required, scalar = [], set(), set()
        out_pos = -1
        for i, p in enumerate(params):
            ann = _annotation(p)
            if ann in _TENSOR:
                tensor_pos.append(i)
                required.add(i)
            elif ann in _OPTIONAL:
                tensor_pos.append(i)
            elif ann in _SCALAR_OK:
                tensor_pos.append(i)
                required.add(i)
                scalar.add(i)
            if p.name == "out":
                if ann not in _OPTIONAL:
                    raise TypeError(f"gpuops: op {op_name!r}: 'out' must be 'Tensor | None'")
                out_pos = i
        op = Op(name=op_name, family=family, impl=impl, reference=reference,
                dtypes=tuple(dtypes), param_dtypes=dict(param_dtypes or {}), bench=bench,
                param_names=tuple(p.name for p in params), tensor_positions=tuple(tensor_pos),
                required_tensor_positions=frozenset(required), scalar_positions=frozenset(scalar),
                out_position=out_pos)
        op.function = _generate(op, sig)
        _OPS[op_name] = op
        return op.function
    return decorate


def get(name: str) -> Op:
    try:
        return _OPS[name]
    except KeyError:
        raise KeyError(f"gpuops: no op named {name!r}; see gpuops.list_ops()") from None


def ops() -> list:
    return [_OPS[k] for k in sorted(_OPS)]


@dataclass(frozen=True)
class OpInfo:
    name: str
    family: str
    dtypes: tuple
    summary: str

    def __str__(self):
        return f"{self.name:<16} {self.family:<12} {', '.join(self.dtypes):<28} {self.summary}"


def list_ops() -> list:
    """Every registered op: name, family, GPU dtypes, one-line summary."""
    import gpuops.ops  # noqa: F401,PLC0415
    return [OpInfo(op.name, op.family, tuple(d.name for d in op.dtypes), op.summary)
            for op in ops()]
