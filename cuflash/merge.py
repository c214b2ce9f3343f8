"""merge_states: the lse merge of partial attention results over disjoint key sets.

Attention over keys K₁ ∪ K₂ ∪ … (disjoint) from the partials (o_s, lse_s) computed over
each K_s alone:

    lse = logsumexp_s lse_s
    o   = Σ_s exp(lse_s − lse) · o_s

since o_s = Σ_{j∈K_s} exp(S_j − lse_s) V_j. This is the one primitive behind split-KV,
decoding over a paged cache and key-chunked Dask arrays (docs/serving.md).
"""
import numpy as np

from . import _checks, _dtypes


def array_module(x):
    """cupy for CuPy arrays, else numpy."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def merge_states(o, lse):
    """Merge S partial attention results over disjoint key sets into one.

    o: (S, ..., N, d) partial outputs, lse: (S, ..., N) their log-sum-exps (NumPy or
    CuPy arrays). Returns (o, lse) equal to attention over the union of the key sets:
    lse = logsumexp_s lse_s, o = Σ_s exp(lse_s − lse)·o_s; o in o's dtype, lse in the
    accumulation dtype (float32, float64 for float64). Sums run in float32 (float64 for
    float64 o). A row where every lse_s is −inf (no key in any part) gives o = 0 and
    lse = −inf, never NaN. A row where some lse_s is +inf (a +inf score in that part)
    gives o = NaN and lse = +inf, as scipy.special.softmax and logsumexp do over the
    union of the keys; a NaN lse_s gives o = NaN and lse = NaN. No floating-point
    warning is raised.
    """
    xp = array_module(o)
    if array_module(lse) is not xp:
        raise TypeError(f"o and lse must live on the same device; got o "
                        f"{_checks.describe(o)}, lse {_checks.describe(lse)}")
    dtype = _checks.check_dtype("o", o)
    if o.ndim < 3:
        raise ValueError(f"o must be (S, ..., N, d): the partials stacked on axis 0, at "
                         f"least 3 dimensions; got shape {tuple(o.shape)}")
    if tuple(lse.shape) != tuple(o.shape[:-1]):
        raise ValueError(f"lse must have shape o.shape[:-1] = {tuple(o.shape[:-1])} (one "
                         f"log-sum-exp per partial and row); got {tuple(lse.shape)}")
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"lse must be a floating-point array; got dtype {lse.dtype}")
    if o.shape[0] == 0:
        raise ValueError("merge_states needs at least one partial (o.shape[0] >= 1); got 0")
    acc = _dtypes.accum_dtype(dtype)
    lse = lse.astype(acc, copy=False)
    m = lse.max(axis=0)                                     # the largest lse of each row
    # Subtract 0 instead on rows whose max is not finite: −inf − (−inf) (no part saw a
    # key) and +inf − (+inf) would be NaN; those rows are set below.
    m_safe = xp.where(xp.isfinite(m), m, 0.0).astype(acc, copy=False)
    o_out = xp.zeros(o.shape[1:], dtype=acc)
    l_sum = xp.zeros(m.shape, dtype=acc)                    # ℓ = Σ_s exp(lse_s − m)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for s in range(o.shape[0]):
            w = xp.exp(lse[s] - m_safe)                     # 0 for a part with lse = −inf
            l_sum += w
            o_out += w[..., None] * o[s].astype(acc, copy=False)
        seen = l_sum > 0
        o_out /= xp.where(seen, l_sum, 1.0)[..., None]      # o = Σ_s w_s o_s / ℓ
        lse_out = xp.where(seen, xp.log(xp.where(seen, l_sum, 1.0)) + m_safe, -np.inf)
    # A part with lse = +inf saw a +inf score: its row is NaN with lse = +inf, as
    # scipy.special.softmax and logsumexp give over the union. A NaN lse (a NaN score
    # in that part) makes its row NaN, as one call would.
    inf_rows = m == np.inf
    o_out = xp.where(inf_rows[..., None] | xp.isnan(m)[..., None], np.nan, o_out)
    lse_out = xp.where(inf_rows | xp.isnan(m), m, lse_out).astype(acc, copy=False)
    return o_out.astype(dtype, copy=False), lse_out
