"""NumPy/SciPy references: slow, clear, float64. For teaching and testing.

Everything here computes in float64 and returns float64 arrays, whatever the
input dtype: the tests compare every other implementation against these.

- `naive_attention`   S = scale·Q Kᵀ, mask, P = softmax(S), O = P V (builds N×N).
- `fa1_attention`     FlashAttention   (Dao et al. 2022) Algorithm 1, line by line.
- `fa2_attention`     FlashAttention-2 (Dao 2023)       Algorithm 1, line by line.
- `attention_backward` the FlashAttention backward equations, from the stored lse.
- `online_softmax`    the softmax in the one-pass
  (running max, running sum) form that FlashAttention is built on.
- `attention_scores`  the variants' score chain, stated plainly (see below).

Variants (`naive_attention` and `attention_backward` take them; docs/api.md), in
this order: S = scale·Q Kᵀ → softcap·tanh(S/softcap) → + ALiBi + bias →
causal/window/mask (hidden: −inf) → P = softmax → dropout (P ∘ keep/(1 − p),
keep from `cuflash.variants`) → O = P V. lse is that of the pre-dropout P.

Shapes are (..., N, d). Leading axes broadcast; on axis -3 (heads) query head
h uses K/V head h // (Hq / Hkv) (GQA / MQA). Causal masking is aligned to the
bottom-right corner: key j is masked for query i when j > i + (Nk - Nq). A
query row that sees no key gets O = 0 and lse = -inf, never NaN.

The online-softmax state is named as in the NumPy backend and the CUDA
kernels, so they read side by side: `m_i` (running row max), `l_i` (running row sum), `acc`
(the output accumulator), with three phases init / update / finalize.
"""
import math

import numpy as np
import scipy.special

from .tiling import paper_block_sizes

__all__ = [
    "naive_attention", "fa1_attention", "fa2_attention", "attention_backward",
    "online_softmax", "causal_mask", "visible_keys", "attention_scores",
]

NEG_INF = -np.inf


# --------------------------------------------------------------------------- helpers
def causal_mask(Nq, Nk, *, row0=0, col0=0, rows=None, cols=None):
    """Boolean mask, True where key j is hidden from query i (j > i + Nk - Nq).

    With row0/col0/rows/cols it returns the (rows, cols) tile starting at
    query row0 and key col0, as the blocked loops need.
    """
    rows = Nq - row0 if rows is None else rows
    cols = Nk - col0 if cols is None else cols
    i = np.arange(row0, row0 + rows)[:, None]
    j = np.arange(col0, col0 + cols)[None, :]
    return j > i + (Nk - Nq)


def visible_keys(Nq, Nk, *, causal=False, window=None):
    """Boolean (Nq, Nk), True where query i may see key j by causal and window alone:
    i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right (−1: unbounded), j ≤ i + Nk − Nq if causal."""
    i = np.arange(Nq)[:, None] + (Nk - Nq)
    j = np.arange(Nk)[None, :]
    vis = np.ones((Nq, Nk), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            vis &= j >= i - left
        if right >= 0:
            vis &= j <= i + right
    return vis


def _batch_head_index(lead):
    """(b, h) index arrays broadcasting against scores of shape lead + (Nq, Nk):
    b the flattened batch index, h the query head (both 0 for 2-D inputs)."""
    if len(lead) == 0:
        return np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64)
    batch, hq = lead[:-1], lead[-1]
    b = np.arange(math.prod(batch), dtype=np.int64).reshape(batch + (1, 1, 1))
    h = np.arange(hq, dtype=np.int64).reshape(hq, 1, 1)
    return b, h


def _dropout_keep(lead, Nq, Nk, dropout_p, seed):
    """The keep mask (lead + (Nq, Nk)), one Philox draw per element (cuflash.variants)."""
    from . import variants
    b, h = _batch_head_index(lead)
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    keep = variants.keep_mask(seed, variants.dropout_threshold(dropout_p), b, h, i, j)
    return np.broadcast_to(keep, lead + (Nq, Nk))


def attention_scores(q, k, *, causal=False, scale=None, window=None, softcap=None,
                     alibi_slopes=None, bias=None, mask=None):
    """The score chain of every variant, float64, O(N²):

        S = scale·Q Kᵀ
        Z = softcap·tanh(S/softcap)           (Z = S without softcap)
        Z = Z − slope_h·|i + Nk − Nq − j| + bias
        Z = −inf where causal, window or mask (False) hide key j from query i

    Returns (Z, T) with T = tanh(S/softcap) (for the backward; None without softcap).
    k has q's heads already (GQA expanded). alibi_slopes is (Hq,) or (*batch, Hq).
    """
    Nq, Nk = q.shape[-2], k.shape[-2]
    S = scale * (q @ np.swapaxes(k, -1, -2))                       # S = scale·Q Kᵀ
    T = None
    if softcap is not None:
        T = np.tanh(S / softcap)
        Z = softcap * T                                            # softcap
    else:
        Z = S
    if alibi_slopes is not None:                                   # + ALiBi
        slopes = np.asarray(alibi_slopes, np.float64)
        if Z.ndim == 2:  # 2-D inputs: one head, one slope
            slopes = slopes.reshape(())
        dist = np.abs(np.arange(Nq)[:, None] + (Nk - Nq) - np.arange(Nk)[None, :])
        Z = Z - slopes[..., None, None] * dist
    if bias is not None:                                           # + bias
        Z = Z + np.asarray(bias, np.float64)
    hidden = ~visible_keys(Nq, Nk, causal=causal, window=window)   # causal / window
    if mask is not None:                                           # / mask
        hidden = hidden | ~np.asarray(mask, bool)
    Z = np.where(hidden, NEG_INF, Z)
    return Z, T


def _has_variants(window, softcap, alibi_slopes, bias, mask, dropout_p):
    return not (window is None and softcap is None and alibi_slopes is None
                and bias is None and mask is None and not dropout_p)


def _unbroadcast(x, shape):
    """Sum x down to `shape` over the axes it was broadcast along."""
    while x.ndim > len(shape):
        x = x.sum(axis=0)
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _default_scale(d, scale):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _expand_kv(q, k, v):
    """Repeat K/V heads along axis -3 so they line up with q's heads (GQA).

    The reference may copy; the backends never do.
    """
    if q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        hq, hkv = q.shape[-3], k.shape[-3]
        if hkv == 0 or hq % hkv:
            raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv})")
        g = hq // hkv
        k = np.repeat(k, g, axis=-3)
        v = np.repeat(v, g, axis=-3)
    return k, v


def _sum_to_shape(x, shape):
    """Undo broadcasting: sum x down to `shape` (used for GQA and batch broadcast)."""
    while x.ndim > len(shape):
        x = x.sum(axis=0)
    for ax, (n_x, n_s) in enumerate(zip(x.shape, shape)):
        if n_s == 1 and n_x != 1:
            x = x.sum(axis=ax, keepdims=True)
    if x.shape != tuple(shape):  # GQA: (.., Hq, N, d) -> (.., Hkv, N, d)
        hkv = shape[-3]
        x = x.reshape(x.shape[:-3] + (hkv, x.shape[-3] // hkv) + x.shape[-2:]).sum(axis=-3)
    return x


def _f64(*arrays):
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


# --------------------------------------------------------------------------- softmax
def online_softmax(x, axis=-1):
    """Softmax in the one-pass (running max, running sum) form, then one normalising pass.

    Pass 1 walks the axis once, keeping per position
        m   = max(m, x_j)
        l   = l · exp(m_old − m) + exp(x_j − m)
    so l = Σ_j exp(x_j − m) without a separate max pass (Milakov & Gimelshein 2018).
    Pass 2 writes p_j = exp(x_j − m) / l.

    Same results as scipy.special.softmax, NaN/inf included: an all −inf slice
    gives NaN (exp(−inf − (−inf))) and a +inf gives NaN (exp(inf − inf)).
    """
    x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, 0)
    # -- init --
    m = np.full(x.shape[1:], NEG_INF)
    l = np.zeros(x.shape[1:])
    # -- update: one pass over the axis --
    for x_j in x:
        m_new = np.maximum(m, x_j)
        # −inf − (−inf) would give NaN while every value so far is −inf; the
        # running state is then exactly 0, so subtract 0 instead.
        m_safe = np.where(m_new == NEG_INF, 0.0, m_new)
        with np.errstate(invalid="ignore"):  # +inf / NaN propagate as in scipy
            l = l * np.exp(m - m_safe) + np.exp(x_j - m_safe)
        m = m_new
    # -- finalize: normalising pass (unguarded, so all −inf → NaN as in scipy) --
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.exp(x - m) / l
    return np.moveaxis(p, 0, axis)


# --------------------------------------------------------------------------- naive
def naive_attention(q, k, v, *, causal=False, scale=None, return_lse=False, window=None,
                    softcap=None, alibi_slopes=None, bias=None, mask=None, dropout_p=0.0,
                    seed=None):
    """Standard attention, O(N²) memory: S = scale·Q Kᵀ, P = softmax(S), O = P V.

    With variants, S is `attention_scores`' Z and dropout multiplies P by
    keep/(1 − p) before V (lse stays that of the pre-dropout P).
    Returns float64 O (and float64 lse = logsumexp(S) per row when return_lse).
    """
    q, k, v = _f64(q, k, v)
    k, v = _expand_kv(q, k, v)
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = _default_scale(d, scale)

    if _has_variants(window, softcap, alibi_slopes, bias, mask, dropout_p):
        S, _ = attention_scores(q, k, causal=causal, scale=scale, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes, bias=bias,
                                mask=mask)
    else:
        S = scale * (q @ np.swapaxes(k, -1, -2))                   # S = scale·Q Kᵀ
        if causal:
            S = np.where(causal_mask(Nq, Nk), NEG_INF, S)
    # A row with no visible key: scipy's softmax would give NaN (−inf − (−inf));
    # the contract says O = 0 and lse = −inf, so those rows get P = 0.
    empty = np.all(S == NEG_INF, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        P = np.where(empty, 0.0, scipy.special.softmax(S, axis=-1))  # P = softmax(S)
    if dropout_p:                                                  # dropout
        P = P * _dropout_keep(S.shape[:-2], Nq, Nk, dropout_p, seed) / (1.0 - dropout_p)
    O = P @ v                                                      # O = P V
    if not return_lse:
        return O
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = scipy.special.logsumexp(S, axis=-1)
    lse = np.where(empty[..., 0], NEG_INF, lse)
    return O, lse


# --------------------------------------------------------------------------- FA1 / FA2
def _per_head(fn, q, k, v, causal, scale, M, return_lse):
    """Run a one-head (N, d) loop over every head of (..., N, d) inputs."""
    q, k, v = _f64(q, k, v)
    k, v = _expand_kv(q, k, v)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q = np.broadcast_to(q, batch + q.shape[-2:])
    k = np.broadcast_to(k, batch + k.shape[-2:])
    v = np.broadcast_to(v, batch + v.shape[-2:])
    scale = _default_scale(q.shape[-1], scale)
    O = np.empty(batch + q.shape[-2:])
    lse = np.empty(batch + q.shape[-2:-1])
    for idx in np.ndindex(*batch):
        O[idx], lse[idx] = fn(q[idx], k[idx], v[idx], causal, scale, M)
    return (O, lse) if return_lse else O


def _fa1_head(Q, K, V, causal, scale, M):
    """FlashAttention (v1) Algorithm 1 for one head. Q: (Nq, d), K, V: (Nk, d)."""
    Nq, d = Q.shape
    Nk = K.shape[0]
    # 1: set block sizes Bc = ceil(M / 4d), Br = min(ceil(M / 4d), d).
    Br, Bc = paper_block_sizes(M, d)
    # 2: initialise O = (0)_{N×d}, ℓ = (0)_N, m = (−inf)_N in HBM.
    O = np.zeros((Nq, d))
    l = np.zeros(Nq)
    m = np.full(Nq, NEG_INF)
    # 3-4: divide Q, O, ℓ, m into Tr blocks of Br rows; K, V into Tc blocks of Bc rows.
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    # 5: for 1 ≤ j ≤ Tc (K/V outer):
    for j in range(Tc):
        c0, c1 = j * Bc, min((j + 1) * Bc, Nk)
        # 6: load K_j, V_j from HBM to on-chip SRAM.
        K_j, V_j = K[c0:c1], V[c0:c1]
        # 7: for 1 ≤ i ≤ Tr:
        for i in range(Tr):
            r0, r1 = i * Br, min((i + 1) * Br, Nq)
            # 8: load Q_i, O_i, ℓ_i, m_i from HBM to on-chip SRAM.
            Q_i, O_i, l_i, m_i = Q[r0:r1], O[r0:r1], l[r0:r1], m[r0:r1]
            # 9: on chip, compute S_ij = Q_i K_jᵀ (scaled: τ·Q_i K_jᵀ).
            S_ij = scale * (Q_i @ K_j.T)
            if causal:  # masked keys get −inf, i.e. weight exactly 0.
                S_ij = np.where(causal_mask(Nq, Nk, row0=r0, col0=c0,
                                            rows=r1 - r0, cols=c1 - c0), NEG_INF, S_ij)
            # 10: m̃_ij = rowmax(S_ij), P̃_ij = exp(S_ij − m̃_ij), ℓ̃_ij = rowsum(P̃_ij).
            mt_ij = S_ij.max(axis=1)
            # guard: a fully masked row has m̃ = −inf and −inf − (−inf) = NaN; use 0.
            mt_safe = np.where(mt_ij == NEG_INF, 0.0, mt_ij)
            Pt_ij = np.exp(S_ij - mt_safe[:, None])
            lt_ij = Pt_ij.sum(axis=1)
            # 11: m_i^new = max(m_i, m̃_ij),
            #     ℓ_i^new = e^{m_i − m_i^new} ℓ_i + e^{m̃_ij − m_i^new} ℓ̃_ij.
            m_new = np.maximum(m_i, mt_ij)
            m_new_safe = np.where(m_new == NEG_INF, 0.0, m_new)  # same guard
            alpha = np.exp(m_i - m_new_safe)      # e^{m_i − m_i^new}
            beta = np.exp(mt_ij - m_new_safe)     # e^{m̃_ij − m_i^new}
            l_new = alpha * l_i + beta * lt_ij
            # 12: O_i ← diag(ℓ_i^new)⁻¹ (diag(ℓ_i) e^{m_i − m_i^new} O_i
            #                           + e^{m̃_ij − m_i^new} P̃_ij V_j), written to HBM.
            #     (ℓ_i^new = 0 only while the row has seen no key: O_i stays 0.)
            l_div = np.where(l_new == 0.0, 1.0, l_new)
            O[r0:r1] = ((l_i * alpha)[:, None] * O_i + beta[:, None] * (Pt_ij @ V_j)) / l_div[:, None]
            # 13: write ℓ_i ← ℓ_i^new, m_i ← m_i^new to HBM.
            l[r0:r1] = l_new
            m[r0:r1] = m_new
    # 16: return O (and lse = m + log ℓ, −inf for rows that saw no key).
    with np.errstate(divide="ignore"):
        lse = np.where(l == 0.0, NEG_INF, m + np.log(l))
    return O, lse


def _fa2_head(Q, K, V, causal, scale, M):
    """FlashAttention-2 Algorithm 1 for one head. Q: (Nq, d), K, V: (Nk, d)."""
    Nq, d = Q.shape
    Nk = K.shape[0]
    Br, Bc = paper_block_sizes(M, d)
    # 1: divide Q into Tr blocks of Br rows, K and V into Tc blocks of Bc rows.
    Tr, Tc = math.ceil(Nq / Br), math.ceil(Nk / Bc)
    # 2: divide O into Tr blocks, L into Tr blocks.
    O = np.zeros((Nq, d))
    L = np.full(Nq, NEG_INF)
    # 3: for 1 ≤ i ≤ Tr (Q outer):
    for i in range(Tr):
        r0, r1 = i * Br, min((i + 1) * Br, Nq)
        # 4: load Q_i from HBM to on-chip SRAM.
        Q_i = Q[r0:r1]
        # 5: on chip, init O_i^(0) = 0, ℓ_i^(0) = 0, m_i^(0) = −inf.   -- init --
        acc = np.zeros((r1 - r0, d))
        l_i = np.zeros(r1 - r0)
        m_i = np.full(r1 - r0, NEG_INF)
        # 6: for 1 ≤ j ≤ Tc:
        for j in range(Tc):
            c0, c1 = j * Bc, min((j + 1) * Bc, Nk)
            if causal and c0 > (r1 - 1) + (Nk - Nq):
                break  # every later K block lies above the diagonal: fully masked.
            # 7: load K_j, V_j from HBM to on-chip SRAM.
            K_j, V_j = K[c0:c1], V[c0:c1]
            # 8: S_ij^(j) = Q_i K_jᵀ (scaled).                       -- update --
            S_ij = scale * (Q_i @ K_j.T)
            if causal:
                S_ij = np.where(causal_mask(Nq, Nk, row0=r0, col0=c0,
                                            rows=r1 - r0, cols=c1 - c0), NEG_INF, S_ij)
            # 9: m_i^(j) = max(m_i^(j−1), rowmax(S_ij)), P̃_ij = exp(S_ij − m_i^(j)),
            #    ℓ_i^(j) = e^{m_i^(j−1) − m_i^(j)} ℓ_i^(j−1) + rowsum(P̃_ij).
            m_new = np.maximum(m_i, S_ij.max(axis=1))
            # guard: while a row has seen only −inf, m = −inf and −inf − (−inf) = NaN.
            m_safe = np.where(m_new == NEG_INF, 0.0, m_new)
            Pt_ij = np.exp(S_ij - m_safe[:, None])
            alpha = np.exp(m_i - m_safe)
            l_i = alpha * l_i + Pt_ij.sum(axis=1)
            # 10: O_i^(j) = diag(e^{m_i^(j−1) − m_i^(j)}) O_i^(j−1) + P̃_ij V_j  (unscaled).
            acc = alpha[:, None] * acc + Pt_ij @ V_j
            m_i = m_new
        # 12: O_i = diag(ℓ_i^(Tc))⁻¹ O_i^(Tc)  -- finalize: the one rescale --
        seen = l_i > 0.0
        O[r0:r1] = acc / np.where(seen, l_i, 1.0)[:, None]
        # 13: L_i = m_i^(Tc) + log(ℓ_i^(Tc))  (−inf for a row that saw no key).
        with np.errstate(divide="ignore"):
            L[r0:r1] = np.where(seen, m_i + np.log(np.where(seen, l_i, 1.0)), NEG_INF)
        # NaN anywhere in the row's scores: l_i is NaN, keep it NaN (not "unseen").
        nan_rows = np.isnan(l_i)
        L[r0:r1][nan_rows] = np.nan
        O[r0:r1][nan_rows] = np.nan
    # 16: return O and the logsumexp L.
    return O, L


def fa1_attention(q, k, v, *, causal=False, scale=None, M=4096, return_lse=False):
    """FlashAttention-1 Algorithm 1 (K/V outer; O, ℓ, m in "HBM", rescaled every step).

    M is the on-chip memory in elements; block sizes follow the paper's rule
    Bc = ceil(M / 4d), Br = min(Bc, d). The default M = 4096 gives small blocks
    so that tests walk through many of them. Returns float64 O (and lse).
    """
    return _per_head(_fa1_head, q, k, v, causal, scale, M, return_lse)


def fa2_attention(q, k, v, *, causal=False, scale=None, M=4096, return_lse=False):
    """FlashAttention-2 Algorithm 1 (Q outer; unscaled O, one final rescale, lse = m + log ℓ).

    Same block-size rule and arguments as `fa1_attention`. Returns float64 O (and lse).
    """
    return _per_head(_fa2_head, q, k, v, causal, scale, M, return_lse)


# --------------------------------------------------------------------------- backward
def attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None, window=None,
                       softcap=None, alibi_slopes=None, bias=None, mask=None,
                       dropout_p=0.0, seed=None, return_dbias=False):
    """Gradients of O = softmax(scale·Q Kᵀ) V from the stored lse (float64).

        P  = exp(S − lse)          (recomputed: no N×N is stored by the forward)
        dV = Pᵀ dO
        dP = dO Vᵀ
        D  = rowsum(dO ∘ O)
        dS = P ∘ (dP − D)
        dQ = dS K · scale
        dK = dSᵀ Q · scale

    Under GQA dK and dV sum over the query heads sharing a K/V head. Rows with
    lse = −inf (no visible key) give P = 0 and so contribute nothing.

    With variants the same chain, differentiated (S the score after softcap, ALiBi and
    bias; Z = keep/(1 − p) the dropout multiplier, 1 without dropout):

        dV = (P ∘ Z)ᵀ dO,  dP = (dO Vᵀ) ∘ Z,  dS = P ∘ (dP − D)   (D = rowsum(dO ∘ O) still)
        dbias = dS summed over bias's broadcast axes              (return_dbias)
        dS_raw = dS ∘ (1 − tanh²(S_raw/softcap))                   (softcap)
        dQ = dS_raw K · scale,  dK = dS_rawᵀ Q · scale
    """
    do, q, k, v, o, lse = _f64(do, q, k, v, o, lse)
    k_shape, v_shape = k.shape, v.shape
    k, v = _expand_kv(q, k, v)
    Nq, Nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = _default_scale(d, scale)

    T = None
    if _has_variants(window, softcap, alibi_slopes, bias, mask, dropout_p):
        S, T = attention_scores(q, k, causal=causal, scale=scale, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes, bias=bias,
                                mask=mask)
    else:
        S = scale * (q @ np.swapaxes(k, -1, -2))
        if causal:
            S = np.where(causal_mask(Nq, Nk), NEG_INF, S)
    # lse = −inf: subtract +inf instead, so exp(S − lse) = exp(−inf) = 0, not NaN.
    lse_safe = np.where(lse == NEG_INF, np.inf, lse)
    P = np.exp(S - lse_safe[..., None])                  # P = exp(S − lse)
    Z = 1.0
    if dropout_p:
        Z = _dropout_keep(S.shape[:-2], Nq, Nk, dropout_p, seed) / (1.0 - dropout_p)
    dv = np.swapaxes(P * Z, -1, -2) @ do                 # dV = (P ∘ Z)ᵀ dO
    dP = (do @ np.swapaxes(v, -1, -2)) * Z               # dP = dO Vᵀ (∘ Z)
    D = np.sum(do * o, axis=-1, keepdims=True)           # D = rowsum(dO ∘ O)
    dS = P * (dP - D)                                    # dS = P ∘ (dP − D)
    dbias = None
    if return_dbias:
        dbias = _unbroadcast(dS, np.shape(bias))         # dbias = dS, unbroadcast
    if T is not None:
        dS = dS * (1.0 - T * T)                          # through softcap·tanh(S/softcap)
    dq = (dS @ k) * scale                                # dQ = dS K · scale
    dk = (np.swapaxes(dS, -1, -2) @ q) * scale           # dK = dSᵀ Q · scale
    dq = _sum_to_shape(dq, q.shape)
    dk = _sum_to_shape(dk, k_shape)
    dv = _sum_to_shape(dv, v_shape)
    if return_dbias:
        return dq, dk, dv, dbias
    return dq, dk, dv
