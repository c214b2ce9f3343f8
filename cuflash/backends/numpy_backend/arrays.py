"""Array helpers shared by the forward, FA1 and backward loops: GQA views, casts,
[x | 1] copies, the split of the score scale, the rescue of a huge V, and per-worker
scratch buffers."""
import math

import numpy as np


def grouped_heads(q, k, v):
    """Sizes and GQA views: the G query heads of one K/V head are axis 1 of q4
    (BH, G, Nq, d); k3 and v3 are (BH, Nk, d), with BH = B · Hkv. Views where the
    strides allow merging B and Hkv into one axis, else copies (numpy.reshape)."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BH = B * Hkv
    return (B, Hq, Nq, d, Hkv, Nk, G, BH, q.reshape(BH, G, Nq, d),
            k.reshape(BH, Nk, d), v.reshape(BH, Nk, d))


def as_dtype(x, dtype):
    """x in dtype, without a copy when it already is (the per-tile cast for 16-bit)."""
    return x if x.dtype == dtype else x.astype(dtype)


def with_ones(x, out, factor=1.0):
    """out = [factor·x | 1]: x (..., n, d) widened into out (..., n, d + 1), last column ones."""
    if factor == 1:
        np.copyto(out[..., :-1], x, casting="unsafe")
    else:
        np.multiply(x, factor, out=out[..., :-1], casting="unsafe")
    out[..., -1] = 1


def split_scale(c, dtype):
    """(c_q, c_k) with c_q·c_k = c exactly: the factors of the score scale c applied to
    q and to k, S = (c_q·q)·(c_k·k)ᵀ.

    Either order alone overflows where the score does not: c·q with c = 1e38 (float32,
    q ~ 1, k ~ 1e-6: scores ~1e33), q·k with q = k = 1e200 (float64, c = 1e-300).
    An extreme c (c = f·2^e, |e| beyond a quarter of the dtype's exponent range) is
    split evenly, c_k = 2^⌊e/2⌋: a power of two, so k's factor rounds nothing. Ordinary
    scales keep c_k = 1 (no pass over K).
    """
    e = math.frexp(c)[1]
    if abs(e) <= np.finfo(dtype).maxexp // 4:
        return c, 1.0
    c_k = math.ldexp(1.0, e // 2)
    return c / c_k, c_k


def column_shift(V, Nk, dtype):
    """Per column of V (..., n, d): 2^-s with s ≥ 0 the fewest bits that bring the
    column's largest |V| below 2^(maxexp − ⌈log2(Nk + 1)⌉ − 1), or None if no column
    needs it. Then P̃ V' (P̃ ≤ 1, at most Nk keys) cannot overflow, and o = (P̃ V'/ℓ)·2^s
    is exact: powers of two round nothing. Non-finite columns need no shift."""
    top = np.finfo(dtype).maxexp - math.ceil(math.log2(Nk + 1)) - 1
    with np.errstate(invalid="ignore"):
        peak = np.max(np.abs(V), axis=-2)
    e = np.frexp(np.where(np.isfinite(peak), peak, 0))[1]
    s = np.maximum(e - top, 0)
    if not s.any():
        return None
    return np.ldexp(np.ones((), dtype), -s).astype(dtype)


class Scratch:
    """A flat scratch buffer handing out contiguous views of any smaller shape.

    Reusing one allocation per worker avoids re-faulting fresh pages on every tile.
    """

    def __init__(self, dtype):
        self.dtype = dtype
        self.flat = np.empty(0, dtype)

    def get(self, shape):
        n = math.prod(shape)
        if self.flat.size < n:
            self.flat = np.empty(n, self.dtype)
        return self.flat[:n].reshape(shape)
