"""One Q tile of the FA2 forward, two ways: with the max frozen at a reference
(the default, `frozen_max_tile`) and with FlashAttention-2's running max
(`online_tile`, for the tiles the frozen max declines).

Both take the tile's [c·Q_i | −m_b_i] rows Qx (nh, G·br, d + 1) and the task's
heads of Kx = [K | 1], Vx = [V | 1] (nh, Nk, d + 1), made by `forward.prepare`,
and the tile's steps from `block_schedule`; scores are in the base of `exp`.
"""
import math

import numpy as np

from .schedule import NEG_INF, mask_block

# The frozen max is accepted when every row that sees a key keeps ℓ_i within
# [2^-30, 2^64] and acc finite; otherwise the tile is redone with the running max.
_L_MIN, _L_MAX = 2.0 ** -30, 2.0 ** 64


def reference_served(l_seen, acc):
    """Whether a tile's frozen reference served: every ℓ_i of `l_seen` (the rows that see
    a key) within [2^-30, 2^64] and `acc` finite. min/max are NaN for a NaN row, which
    fails both comparisons; the sum is finite only if acc is."""
    return (not l_seen.size or (l_seen.min() >= _L_MIN and l_seen.max() <= _L_MAX)) \
        and math.isfinite(acc.sum())


def reference_failed(l_i):
    """Whether a frozen reference has failed already: ℓ only grows along a tile's steps,
    so one past 2^64 (or NaN) now fails at the end too, and the running max can take the
    tile at once (scores spread wide fail at the first steps: q × 30 at N = 2048, the
    forward went from 2.2× to 1.4× PyTorch's time)."""
    return not l_i.max() <= _L_MAX


def _strip(X, G, br, a0, a1):
    """Rows [a0, a1) of each of the G heads stacked in X (nh, G·br, …): X itself when
    that is all rows (one matmul over the stacked heads), else a (nh, G, a1 − a0, …) view."""
    if a0 == 0 and a1 == br:
        return X
    return X.reshape(X.shape[0], G, br, *X.shape[2:])[:, :, a0:a1]


def _scores(Qx, Kx, r0, br, step, G, buf):
    """S = Qx Kxᵀ for one step (r0 is the tile's first row), not masked. Returns
    (S, rows of the tile) with S in buf, shaped like the step's view of Qx."""
    a0, a1, c0, c1, t = step
    Q = _strip(Qx, G, br, a0 - r0, a1 - r0)
    KT = Kx[:, c0:c1].transpose(0, 2, 1)
    S = np.matmul(Q, KT if Q.ndim == 3 else KT[:, None], out=buf.get(Q.shape[:-1] + (c1 - c0,)))
    return S, (a0 - r0, a1 - r0)


def online_tile(Qx, Kx, Vx, kv, *, r0, br, G, exp, lim, scratch):
    """One Q tile, FlashAttention-2's inner loop with the running max m_i, in exp's base.

    Qx's last column is overwritten with 0 (no other tile reads these rows).
    Returns the unnormalised state (acc, ℓ_i, m_b_i).
    """
    nh, rows, d1 = Qx.shape
    Qx[:, :, -1] = 0
    # -- init -- (acc and ℓ_i share one array [acc | ℓ_i], updated as one: see frozen_max_tile)
    m_i = np.full((nh, rows), NEG_INF, Qx.dtype)
    accx = np.zeros((nh, rows, d1), Qx.dtype)
    for step in kv:
        c0, c1, t = step[2:]
        # -- compute qk: S_b_ij = (c·Q_i) K_jᵀ, for the step's rows --
        S, (a0, a1) = _scores(Qx, Kx, r0, br, step, G, scratch.S)
        if t is not None:  # only the blocks the diagonal crosses
            mask_block(S, G, a1 - a0, t)
        m_s, accx_s = _strip(m_i, G, br, a0, a1), _strip(accx, G, br, a0, a1)
        # -- update m_i and l_i --
        m_new = np.maximum(m_s, S.max(axis=-1))
        # Guard: a row that has seen only −inf keeps m = −inf and
        # −inf − (−inf) would be NaN; subtracting 0 gives b^(−inf) = 0.
        m_safe = np.where(m_new == NEG_INF, 0, m_new).astype(Qx.dtype, copy=False)
        np.subtract(S, m_safe[..., None], out=S)
        # Weights below b^-lim count as b^-lim (see frozen_max_tile); hidden
        # entries, lifted from −inf with them, are zeroed after the exponential.
        np.maximum(S, -lim, out=S)
        exp(S, out=S)                                    # P̃_ij = exp(S_ij − m_i)
        if t is not None:
            mask_block(S, G, a1 - a0, t, fill=0)
        alpha = exp(m_s - m_safe)                        # e^{m_old − m_new}
        V = Vx[:, c0:c1]
        PV = np.matmul(S, V if S.ndim == 3 else V[:, None],
                       out=scratch.PV.get(S.shape[:-1] + (d1,)))
        # ℓ_i = α ℓ_i + rowsum(P̃_ij);  acc = diag(α) acc + P̃_ij V_j  (O kept unscaled)
        accx_s *= alpha[..., None]
        accx_s += PV
        m_s[...] = m_new
    return accx[..., :-1], accx[..., -1], m_i


def frozen_max_tile(Qx, Kx, Vx, kv, *, r0, br, G, first, clip, exp, lim, scratch):
    """One Q tile with the running max frozen at the reference m_b_i in Qx's last column.

    The max in exp(S − m) only guards against overflow; any fixed reference m
    near the row's largest score gives the same result to rounding. So m_i is
    the row max over the first keys (`CpuConfig.max_sample`; key 0 is visible to
    every row that sees any key, so ℓ_i ≥ 1), folded into the matmul as
    [Q_i | −m_b_i] [K_j | 1]ᵀ = S_b_ij − m_b_i: no tile needs a rowmax pass, a
    subtraction or an α rescale — Q Kᵀ, b^x, P̃ [V | 1], 3 passes instead of 5.

    `exp` is NumPy's fastest exponential on this CPU (`CpuConfig.base`) as long
    as its argument stays within ±lim (`exp_limit`). Where the norms cannot promise
    that (`clip`), S_b − m_b is clipped first: a weight below 2^-100 then counts as
    2^-100 instead, below rounding next to ℓ_i ≥ 1. Hidden (causal) entries are
    zeroed after the exponential, so −inf never reaches it.

    Returns [acc | ℓ_i] (nh, G·br, d + 1) when every row from `first` on (the
    rows that see a key) kept ℓ_i ∈ [2^-30, 2^64] and acc stayed finite;
    otherwise (a score more than ~44 above the sample's max, +inf, NaN, huge V)
    None, and the caller redoes the tile with online_tile.
    """
    nh, rows, d1 = Qx.shape
    # [acc | ℓ_i] in one array, so that one addition of P̃ [V_j | 1] updates both:
    # with two workers every NumPy call is a GIL hand-over (a context switch when
    # the other worker holds it), so calls per step count.
    accx = scratch.acc.get((nh, rows, d1))
    accx.fill(0)
    for step in kv:
        c0, c1, t = step[2:]
        # -- compute qk: S_b_ij − m_b_i = [c·Q_i | −m_b_i] [K_j | 1]ᵀ, for the step's rows --
        S, (a0, a1) = _scores(Qx, Kx, r0, br, step, G, scratch.S)
        if clip:
            np.clip(S, -lim, lim, out=S)
        exp(S, out=S)                                    # P̃_ij = exp(S_ij − m_i)
        if t is not None:  # only the blocks the diagonal crosses
            mask_block(S, G, a1 - a0, t, fill=0)
        V = Vx[:, c0:c1]
        PV = np.matmul(S, V if S.ndim == 3 else V[:, None],
                       out=scratch.PV.get(S.shape[:-1] + (d1,)))
        acc_s = _strip(accx, G, br, a0, a1)
        acc_s += PV                                      # acc += P̃_ij V_j; ℓ_i += rowsum(P̃_ij)
        if reference_failed(acc_s[..., -1]):
            return None
    # Rows before `first` see no key: ℓ = 0 there by the mask.
    return accx if reference_served(accx.reshape(nh, G, br, d1)[:, :, first:, -1], accx) \
        else None
