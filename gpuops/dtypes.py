"""The dtypes gpuops knows, and their names in NumPy, CuPy, torch and the .cu sources."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)   # singletons: identity hash/compare (dict keys on the hot path)
class DType:
    name: str         # 'float32', 'bfloat16', ...
    itemsize: int
    kind: str         # 'f' floating, 'i' signed integer, 'u' unsigned, 'b' bool
    ctype: str        # C++ storage type in cuda_src (cuda_src/common/dtypes.cuh)

    def __repr__(self):
        return self.name

    @property
    def is_floating(self) -> bool:
        return self.kind == "f"


float32 = DType("float32", 4, "f", "float")
float16 = DType("float16", 2, "f", "gpuops::float16_t")
bfloat16 = DType("bfloat16", 2, "f", "gpuops::bfloat16_t")
float64 = DType("float64", 8, "f", "double")
int64 = DType("int64", 8, "i", "long long")
int32 = DType("int32", 4, "i", "int")
int16 = DType("int16", 2, "i", "short")
int8 = DType("int8", 1, "i", "signed char")
uint8 = DType("uint8", 1, "u", "unsigned char")
bool_ = DType("bool", 1, "b", "bool")

ALL = (float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool_)
BY_NAME = {d.name: d for d in ALL}
FLOATS = (float32, float16, bfloat16)          # what GPU kernels take unless an op says otherwise
INTEGERS = (int64, int32, int16, int8, uint8)


def _ml_bfloat16():
    try:
        import ml_dtypes  # noqa: PLC0415
        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        return None


NUMPY_BFLOAT16 = _ml_bfloat16()


def stat_dtype(d: DType | None) -> DType:
    """The dtype of statistics kernels write beside a result (lse, mean, rstd): float32, or
    float64 when the CPU path runs float64 input."""
    return float64 if d is float64 else float32


def from_numpy(dt) -> DType | None:
    """gpuops dtype of a NumPy/CuPy dtype (bfloat16 via ml_dtypes), or None if unsupported."""
    dt = np.dtype(dt)
    if dt.kind == "V" and dt.name != "bfloat16":
        return None
    return BY_NAME.get(dt.name)


def to_numpy(d: DType) -> np.dtype:
    if d is bfloat16:
        if NUMPY_BFLOAT16 is None:
            raise TypeError("bfloat16 NumPy arrays need the ml_dtypes package (pip install ml_dtypes)")
        return NUMPY_BFLOAT16
    return np.dtype(d.name)


def storage_numpy(d: DType) -> np.dtype:
    """A NumPy dtype with the same bytes, that CuPy can always allocate (uint16 for bfloat16)."""
    return np.dtype(np.uint16) if d is bfloat16 else np.dtype(d.name)


def torch_table() -> dict:
    import torch  # noqa: PLC0415
    return {torch.float32: float32, torch.float16: float16, torch.bfloat16: bfloat16,
            torch.float64: float64, torch.int64: int64, torch.int32: int32, torch.int16: int16,
            torch.int8: int8, torch.uint8: uint8, torch.bool: bool_}


def to_torch(d: DType):
    import torch  # noqa: PLC0415
    return getattr(torch, "bool" if d is bool_ else d.name)


def names(dtypes) -> str:
    return ", ".join(d.name for d in dtypes)
