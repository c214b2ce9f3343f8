"""The FlashAttention-1 forward: K/V tiles outer, O, ℓ, m in "HBM", rescaled every step.

Algorithm 1 of the FlashAttention paper, its line numbers in the comments. Each step
works on all heads at once, in the calling thread (no pool); the causal steps come
from the same `block_schedule` as the backward's (outer="k").
"""
import numpy as np

from ..._dtypes import accum_dtype, lse_dtype
from .arrays import as_dtype, column_shift, grouped_heads, split_scale
from .schedule import NEG_INF, block_schedule, mask_block, tile_rows


def forward(q, k, v, causal, scale, config):
    """o, lse for q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d), in FA1's loop order."""
    B, Hq, Nq, d, Hkv, Nk, G, BH, q4, k3, v3 = grouped_heads(q, k, v)
    acc_t = accum_dtype(q.dtype)
    Br = tile_rows(config.rows, G, Nq)
    Bc = min(config.block_n, Nk)
    # O, ℓ, m live in "HBM" (full arrays), normalised after every step.
    O = np.zeros((BH, G, Nq, d), acc_t)
    l = np.zeros((BH, G, Nq), acc_t)
    m = np.full((BH, G, Nq), NEG_INF, acc_t)
    # scale = s_q·s_k, split so that neither s_q·Q nor Q Kᵀ overflows alone (split_scale).
    s_q, s_k = (acc_t.type(f) for f in split_scale(scale, acc_t))
    # P̃ V with |V| near the dtype's maximum would overflow: V's big columns scaled down
    # by powers of two, O scaled back at the end (column_shift).
    V_all = as_dtype(v3, acc_t)
    shift = column_shift(V_all, Nk, acc_t)
    if shift is not None:
        V_all = V_all * shift[:, None]
    # ±inf scores, and NaN from them, propagate as the API promises (a row's own result).
    with np.errstate(over="ignore", invalid="ignore"):
        # K/V tiles outer, each with the Q rows that see it (block_schedule, outer="k").
        for c0, c1, q_tiles in block_schedule(Nq, Nk, Br, Bc, causal=causal, outer="k",
                                              diag=max(1, min(Bc, config.diag_keys))):  # 5: for j
            K_j = as_dtype(k3[:, c0:c1], acc_t)                # 6: load K_j, V_j
            if s_k != 1:
                K_j = K_j * s_k
            V_j = V_all[:, c0:c1]
            for r0, r1, b0, b1, t in q_tiles:                  # 7: for i in 1..Tr
                # (a step may cover only keys [b0, b1) of the tile: a strip of the diagonal)
                K_s, V_s = K_j[:, b0 - c0:b1 - c0], V_j[:, b0 - c0:b1 - c0]
                Q_i = np.multiply(q4[:, :, r0:r1], s_q, dtype=acc_t)  # 8: load Q_i, O_i, ℓ_i, m_i
                O_i, l_i, m_i = O[:, :, r0:r1], l[:, :, r0:r1], m[:, :, r0:r1]
                S = Q_i @ K_s[:, None].transpose(0, 1, 3, 2)   # 9: S_ij = Q_i K_jᵀ
                if t is not None:
                    mask_block(S, G, r1 - r0, t)
                # 10: m̃_ij = rowmax(S_ij), P̃_ij = exp(S_ij − m̃_ij), ℓ̃_ij = rowsum(P̃_ij)
                mt = S.max(axis=-1)
                mt_safe = np.where(mt == NEG_INF, 0, mt).astype(acc_t, copy=False)  # −inf guard
                np.subtract(S, mt_safe[..., None], out=S)
                P = np.exp(S, out=S)
                lt = P.sum(axis=-1)
                # 11: m_new = max(m_i, m̃_ij), ℓ_new = e^{m_i−m_new} ℓ_i + e^{m̃_ij−m_new} ℓ̃_ij
                m_new = np.maximum(m_i, mt)
                m_new_safe = np.where(m_new == NEG_INF, 0, m_new).astype(acc_t, copy=False)
                alpha = np.exp(m_i - m_new_safe)
                beta = np.exp(mt - m_new_safe)
                l_new = alpha * l_i + beta * lt
                # 12: O_i ← diag(ℓ_new)⁻¹ (diag(ℓ_i) e^{m_i−m_new} O_i + e^{m̃_ij−m_new} P̃_ij V_j)
                l_div = np.where(l_new == 0, 1, l_new).astype(acc_t, copy=False)
                O[:, :, r0:r1] = ((l_i * alpha)[..., None] * O_i
                                  + beta[..., None] * (P @ V_s[:, None])) / l_div[..., None]
                l[:, :, r0:r1] = l_new                          # 13: write ℓ_i, m_i
                m[:, :, r0:r1] = m_new
        lse = np.where(l == 0, NEG_INF, m + np.log(np.where(l == 0, 1, l)))
    if shift is not None:
        O /= shift.reshape(BH, 1, 1, d)
    return (O.astype(q.dtype, copy=False).reshape(B, Hq, Nq, d),
            lse.astype(lse_dtype(q.dtype), copy=False).reshape(B, Hq, Nq))
