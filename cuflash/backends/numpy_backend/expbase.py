"""The base the forward and backward carry their scores in, and the exponential's fast range.

The exponential is the one elementwise pass over every score tile, so the backend
uses whichever of NumPy's `exp2` and `exp` is vectorised on this CPU, and keeps its
argument where that loop is fast.
"""
import math
from typing import NamedTuple

import numpy as np

LN2 = math.log(2)


class ExpBase(NamedTuple):
    """The base b the scores are carried in: S_b = S·log_b(e), so exp(S − m) = b^(S_b − m_b)
    costs one call of `exp` and no extra multiply (log_b(e) is folded into Q's scale)."""

    name: str
    exp: np.ufunc      # x ↦ b^x
    log_e: float       # log_b(e): natural units → base-b units
    ln: float          # ln(b): base-b units → natural units


BASE_2 = ExpBase("2", np.exp2, math.log2(math.e), LN2)
BASE_E = ExpBase("e", np.exp, 1.0, 1.0)


def fastest_base(targets, features):
    """BASE_2 where NumPy's float32 `exp2` loop is vectorised, else BASE_E.

    NumPy vectorises `exp2` only for AVX-512 (there 30% faster than `exp`), `exp`
    also for AVX2: on an AVX2 Zen 3, `exp2` runs a scalar loop 1.9× slower than `exp`
    (2.6 against 1.35 ns per float32), and the forward took up to 1.3× as long with it.
    `targets` is NumPy's dispatch table (`__cpu_targets_info__`, newer NumPy, or
    None), `features` its CPU feature flags (`__cpu_features__`, the fallback).
    """
    if targets is not None:
        current = targets.get("exp2", {}).get("ff", {}).get("current", "baseline")
        return BASE_E if current.startswith("baseline") else BASE_2
    return BASE_2 if features.get("AVX512F") else BASE_E


def numpy_dispatch():
    """(targets, features) of this NumPy build on this CPU, for fastest_base."""
    umath = getattr(getattr(np, "_core", getattr(np, "core", None)), "_multiarray_umath", None)
    return (getattr(umath, "__cpu_targets_info__", None),
            getattr(umath, "__cpu_features__", {}))


def exp_limit(dtype, base):
    """The range |x| ≤ this, in `base`'s units, where base.exp is fast: weights down to
    2^-100 in float32 (x ≥ −100 in base 2, −69.3 in base e), 2^-996 in float64.

    Past 125 (float32), NumPy's exp2 leaves its SIMD loop for a scalar path,
    ~200× slower per element (np.exp, below −87, one ~10× slower); and a weight
    2^x < 2^-100 makes P̃·V products subnormal, which slow the BLAS kernels
    down as much. Measured with q scaled 30× (most weights underflow): with
    np.exp and no range, forward 35× and backward 22× their ordinary time.
    """
    return (np.finfo(dtype).maxexp - 28) * LN2 / base.ln


def in_exp_range(Q, K, shift, limit):
    """Per head, whether every Q_i·K_j − shift_i lies within ±limit, from norms
    alone: |Q_i·K_j − shift_i| ≤ |Q_i| max_j |K_j| + |shift_i| (Cauchy–Schwarz).
    Q (nh, n, d), K (nh, m, d), shift (nh, n); NaN or inf in a head gives False."""
    q_norm = np.sqrt(np.einsum("hij,hij->hi", Q, Q))
    k_norm = np.sqrt(np.einsum("hij,hij->hi", K, K).max(axis=1))
    return (q_norm * k_norm[:, None] + np.abs(shift)).max(axis=1) <= limit
