"""Array helpers shared by the forward, FA1 and backward loops: GQA views, casts,
[x | 1] copies and per-worker scratch buffers."""
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


def with_ones(x, out):
    """out = [x | 1]: x (..., n, d) widened into out (..., n, d + 1), last column ones."""
    np.copyto(out[..., :-1], x, casting="unsafe")
    out[..., -1] = 1


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
