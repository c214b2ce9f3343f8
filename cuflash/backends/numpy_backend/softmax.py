"""online_softmax on the CPU: one online pass, one normalising pass, blocked."""
import numpy as np

from ..._dtypes import accum_dtype
from .arrays import as_dtype
from .schedule import NEG_INF


def softmax(x, config):
    """Softmax of x (P, n, Q) over axis 1: one online pass (running max, running sum),
    then one normalising pass, both blocked over n (config.softmax_block elements of x
    per block); O(P·Q·block) extra memory.

    Matches scipy.special.softmax, NaN/inf included: all −inf → NaN, +inf → NaN.
    """
    P_, n, Q_ = x.shape
    acc_t = accum_dtype(x.dtype)
    nb = max(1, config.softmax_block // max(1, P_ * Q_))
    # The output first: an x too large for memory fails here at once, not after pass 1.
    out = np.empty(x.shape, x.dtype)
    # -- init --
    m = np.full((P_, 1, Q_), NEG_INF, acc_t)
    l = np.zeros((P_, 1, Q_), acc_t)
    # -- update: pass 1 --
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for a in range(0, n, nb):
            blk = as_dtype(x[:, a:a + nb], acc_t)
            m_new = np.maximum(m, blk.max(axis=1, keepdims=True))
            # −inf − (−inf) guard for the running state (only; the final pass is
            # unguarded so an all −inf slice gives NaN, as scipy does).
            m_safe = np.where(m_new == NEG_INF, 0, m_new).astype(acc_t, copy=False)
            e = blk - m_safe
            np.exp(e, out=e)
            l *= np.exp(m - m_safe)
            l += e.sum(axis=1, keepdims=True)
            m = m_new
        # -- finalize: pass 2 --
        inv_l = np.divide(1, l, dtype=acc_t)
        for a in range(0, n, nb):
            e = as_dtype(x[:, a:a + nb], acc_t) - m
            np.exp(e, out=e)
            e *= inv_l
            out[:, a:a + nb] = e
    return out
