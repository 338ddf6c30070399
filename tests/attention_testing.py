"""What the attention test files (test_attention.py, test_attention_backward.py,
test_attention_variants.py) share: the dtypes and their unit roundoffs, inputs rounded to the
storage dtype, the bound check, and the stand-in call object of the routing tests."""
from __future__ import annotations

import numpy as np

from gpuops import dtypes as dt


DTYPES = ["float32", "float16", "bfloat16"]
# unit roundoff of each output dtype, and a magnitude below which relative bounds stop
U_OUT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float64": 2.0**-53}
TINY = {"float32": 1e-30, "float16": 2.0**-24, "bfloat16": 1e-30, "float64": 1e-300}
U32 = 2.0**-24                    # fp32 math


def np_dtype(name):
    return dt.to_numpy(dt.BY_NAME[name])


def rand(rng, shape, dtype, scale=1.0):
    """Random values rounded to the storage dtype, as that dtype's NumPy array."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np_dtype(dtype))


def bhsd(x, layout):
    """x as float64 in the [B, H, S, D] layout (from 'bhsd' or 'bshd')."""
    x = np.asarray(x, np.float64)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def check(got, exp, bound, what=""):
    """|got - exp| <= bound elementwise (bound broadcast to exp's shape); NaNs at the same places
    and equal infinities where exp has them."""
    got = np.asarray(got, np.float64)
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != {exp.shape}"
    nan_g, nan_e = np.isnan(got), np.isnan(exp)
    assert np.array_equal(nan_g, nan_e), (
        f"{what}: NaN mismatch at {np.argwhere(nan_g != nan_e)[:5].tolist()}")
    inf_e = np.isinf(exp)
    assert np.array_equal(got[inf_e], exp[inf_e]), f"{what}: infinities differ"
    ok = ~nan_e & ~inf_e
    b = np.broadcast_to(bound, exp.shape)[ok]
    err = np.abs(got[ok] - exp[ok])
    if err.size and not np.all(err <= b):
        i = int(np.argmax(err - b))
        raise AssertionError(f"{what}: {int(np.sum(err > b))} of {err.size} off; worst got="
                             f"{got[ok][i]!r} ref={exp[ok][i]!r} err={err[i]:.3g} > {b[i]:.3g}")


class FakeCall:
    """What the variant-routing checks read of an op call: result dtype, device, op name."""

    def __init__(self, dtype, device=0, op="scaled_dot_product_attention"):
        self.result_dtype, self.device = dtype, device
        self.op = type("Op", (), {"name": op})()
