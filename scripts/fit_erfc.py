"""Fits the polynomial in gpuops' erfc approximation (cuda_src/common/activations.cuh):

    erfc(z) = t * exp(P(t) - z^2),   t = 1 / (1 + z / 2),   z >= 0

P interpolates g(t) = log(erfcx(z) / t) at Chebyshev nodes of t in [0, 1] (z from infinity down to
0). g is smooth there, so a degree-9 polynomial reaches ~1e-7 relative error in erfc everywhere,
with one exp and no division beyond 1 / (1 + z / 2). Prints the coefficients (Horner order, highest
first) and the error in float64 and in a float32 evaluation.
"""
import numpy as np
from numpy.polynomial import chebyshev as C
from scipy.special import erfc, erfcx


def g(t):
    z = 2.0 * (1.0 - t) / t
    return np.log(erfcx(z) / t)


def main(degree=9):
    nodes = 0.5 * (1 + np.cos(np.pi * (np.arange(4 * degree) + 0.5) / (4 * degree)))  # in (0, 1)
    cheb = C.chebfit(2 * nodes - 1, g(nodes), degree)         # least squares on Chebyshev nodes
    mono = C.cheb2poly(cheb)                                   # in s = 2t - 1
    # rewrite in t: P(t) = sum c_k (2t - 1)^k
    p_t = np.polynomial.polynomial.Polynomial(mono)(np.polynomial.polynomial.Polynomial([-1, 2]))
    coeffs = p_t.coef                                          # lowest first
    z = np.concatenate([np.linspace(0, 10, 200001), np.geomspace(10, 9, 2)])
    t = 1 / (1 + 0.5 * z)
    approx = t * np.exp(np.polynomial.polynomial.polyval(t, coeffs) - z * z)
    rel = np.abs(approx / erfc(z) - 1)
    print(f"degree {degree}: max relative error (float64 evaluation) {rel.max():.2e}")
    z32 = z.astype(np.float32)
    t32 = (np.float32(1) / (np.float32(1) + np.float32(0.5) * z32)).astype(np.float32)
    acc = np.float32(coeffs[-1])
    for c in coeffs[-2::-1]:
        acc = (acc * t32 + np.float32(c)).astype(np.float32)
    e32 = t32 * np.exp((acc - z32 * z32).astype(np.float32)).astype(np.float32)
    ok = erfc(z32.astype(np.float64)) > 1e-35
    rel32 = np.abs(e32[ok] / erfc(z32.astype(np.float64))[ok] - 1)
    print(f"float32 evaluation: max relative error {rel32.max():.2e} where erfc > 1e-35")
    print("Horner, highest degree first:")
    for c in coeffs[::-1]:
        print(f"  {c:.9e}f")
    # The kernel evaluates 0.5 erfc(z) = t * exp2(Q(t) - (z sqrt(log2 e))^2) with
    # Q = P * log2(e) - 1 (the 1/2 folded into the exponent): one MUFU.EX2, no expf range reduction.
    log2e = 1 / np.log(2)
    q = coeffs * log2e
    q[0] -= 1.0
    print("log2 form (0.5 erfc), Horner, highest degree first:")
    for c in q[::-1]:
        print(f"  {c:.9e}f")


if __name__ == "__main__":
    main(9)
