"""The FA2 forward: Q tiles outer, K/V steps inner, one final rescale per tile.

Each pool task is one Q tile (Br rows of the G query heads of a range of K/V
heads) with its steps from `block_schedule`. It prepares its heads if no task has
yet (`prepare`), then runs `frozen_max_tile`, and `online_tile` where that declines
(see forward_tiles). Plain float32 and 16-bit calls go to the compiled kernel
first (`native`, `CpuConfig.native`); these tiles take what it does not.
"""
import math

import numpy as np

from ..._dtypes import accum_dtype, lse_dtype
from . import native
from .arrays import (CALL_BUFFERS, column_shift, grouped_heads, split_scale, with_ones,
                     worker_scratch)
from .expbase import exp_limit, in_exp_range
from .forward_tiles import frozen_max_tile, online_tile
from .pool import Once, run_tasks
from .schedule import NEG_INF, block_schedule, head_chunks, mask_block, tile_rows


def prepared_shapes(q4, k3, acc_t):
    """The (shape, dtype) of prepare's Qx, Kx, Vx and m."""
    BH, G, Nq, d = q4.shape
    Nk = k3.shape[1]
    return (((BH, G, Nq, d + 1), acc_t), ((BH, Nk, d + 1), acc_t), ((BH, Nk, d + 1), acc_t),
            ((BH, G, Nq), acc_t))


def prepare(q4, k3, v3, scale, causal, acc_t, config, out=None):
    """Qx = [c_q·Q | −m_b], Kx = [c_k·K | 1], Vx = [V | 1] in the accumulation dtype,
    made once per call by the tasks (O(N·d), like o), with c_q·c_k = c = scale·log_b(e)
    (`split_scale`): scores come out in the config's base b, S_b = c·Q Kᵀ, and
    b^(S_b − m_b) = exp(S − m).

    [Q_i | −m_b_i] [K_j | 1]ᵀ = S_b_ij − m_b_i: the column of ones lets the matmul
    subtract the frozen reference (see frozen_max_tile) for free. [V | 1] lets
    one matmul P̃ [V_j | 1] give both P̃ V_j and ℓ̃ = rowsum(P̃), saving a pass
    over every score tile. 16-bit inputs are widened here.

    With config.frozen_max, m_b is each row's max over the first config.max_sample
    keys, for all rows of a head in one matmul (done per tile, it was ~10 NumPy calls
    per tile, and with two workers every call is a GIL hand-over); else 0. Returns
    also m = m_b·ln b (natural units, for lse) and, per K/V head, whether every
    S_b − m_b is known to lie in the exponential's fast range:
    |S_b_ij − m_b_i| ≤ |c·q_i| |k_j| + |m_b_i| (Cauchy–Schwarz).

    `out`: the arrays (Qx, Kx, Vx, m) to fill (`prepared_shapes`); fresh ones when None.
    Returns (Qx, Kx, Vx, m, in_range) and `prepare_heads((h0, h1))`, which fills the K/V
    heads h0..h1−1 (and their G query heads): the forward's tasks call it for their
    heads (`pool.Once`), so that a call has one round of tasks, not two.
    """
    BH, G, Nq, d = q4.shape
    Nk = k3.shape[1]
    base = config.base
    Qx, Kx, Vx, m = out if out is not None else (
        np.empty(shape, dtype) for shape, dtype in prepared_shapes(q4, k3, acc_t))
    in_range = np.zeros(BH, bool)
    ns = min(config.max_sample, Nk)
    c_q, c_k = (acc_t.type(f) for f in split_scale(scale * base.log_e, acc_t))
    lim = exp_limit(acc_t, base)

    def prepare_heads(heads):
        h0, h1 = heads
        nh = h1 - h0
        np.multiply(q4[h0:h1], c_q, out=Qx[h0:h1, ..., :d], casting="unsafe")
        Q = Qx[h0:h1, ..., :d].reshape(nh, G * Nq, d)
        with_ones(k3[h0:h1], Kx[h0:h1], c_k)
        with_ones(v3[h0:h1], Vx[h0:h1])
        m_b = np.zeros((nh, G * Nq), acc_t)
        if config.frozen_max:
            # Keys × rows: the max over keys is then an elementwise maximum of rows
            # (a max along a short last axis measured 6× slower).
            S0T = Kx[h0:h1, :ns, :d] @ Q.transpose(0, 2, 1)
            if causal:  # row r sees key j ≤ r + Nk − Nq
                mask_block(S0T.reshape(nh, ns, G, Nq).transpose(0, 2, 3, 1), G, Nq, Nk - Nq)
            mh = S0T.max(axis=1)
            # A row that sees no sampled key sees no key at all (key 0 is sampled): it
            # subtracts 0, so that b^(−inf − 0) = 0 rather than b^(−inf + inf) = NaN.
            np.copyto(m_b, mh, where=mh != NEG_INF)
            in_range[h0:h1] = in_exp_range(Q, Kx[h0:h1, :, :d], m_b, lim)
        np.negative(m_b, out=Qx[h0:h1, ..., d].reshape(nh, G * Nq))
        np.multiply(m_b, base.ln, out=m[h0:h1].reshape(nh, G * Nq))

    return (Qx, Kx, Vx, m, in_range), prepare_heads


def forward(q, k, v, causal, scale, config):
    """o, lse for q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d); see cuflash.backends."""
    B, Hq, Nq, d, Hkv, Nk, G, BH, q4, k3, v3 = grouped_heads(q, k, v)
    acc_t = accum_dtype(q.dtype)
    workers, frozen_max = config.workers, config.frozen_max
    if acc_t == np.float32:
        done = native.forward(q4, k3, v3, causal, scale, workers, config.native)
        if done is not None:  # else: off, not available here, or a row to redo (see native)
            o4, lse3 = done
            return (o4.reshape(B, Hq, Nq, d).astype(q.dtype, copy=False),
                    lse3.reshape(B, Hq, Nq))
    exp, ln = config.base.exp, config.base.ln
    lim = exp_limit(acc_t, config.base)
    o = np.empty((B, Hq, Nq, d), q.dtype)
    lse = np.empty((B, Hq, Nq), lse_dtype(q.dtype))
    o4 = o.reshape(BH, G, Nq, d)
    lse3 = lse.reshape(BH, G, Nq)

    Br = tile_rows(config.causal_rows if causal else config.rows, G, Nq)
    Bc = min(config.block_n, Nk)
    chunks = head_chunks(BH, G * Br * Bc * acc_t.itemsize * d, config.tile_budget, workers)
    # Fewer head ranges than workers (one long sequence): shorter Q tiles, so that
    # every worker gets some.
    per_chunk = -(-workers // len(chunks))
    Br = min(Br, -(-Nq // per_chunk))
    buf, arrays = CALL_BUFFERS.take(*prepared_shapes(q4, k3, acc_t))
    (Qx, Kx, Vx, m, in_range), prepare_heads = prepare(q4, k3, v3, scale, causal, acc_t,
                                                       config, arrays)
    prepared = Once(prepare_heads)  # each head range by the first of its tasks
    sched = list(block_schedule(Nq, Nk, Br, Bc, causal=causal, diag=config.diag_keys))
    # Biggest tiles first (causal: the bottom rows see the most keys) balances workers.
    tasks = [(h0, h1, r0, r1, kv) for (r0, r1, kv) in sched for (h0, h1) in chunks]
    tasks.sort(key=lambda t: -sum((a1 - a0) * (c1 - c0) for a0, a1, c0, c1, _ in t[4]))
    # Causal rows before Nq − Nk see no key (o = 0, lse = −inf); all others see key 0.
    first_seen = max(0, Nq - Nk) if causal else 0

    def run(task):
        h0, h1, r0, r1, kv = task
        nh, br = h1 - h0, r1 - r0
        prepared((h0, h1))
        o_t, lse_t = o4[h0:h1, :, r0:r1], lse3[h0:h1, :, r0:r1]
        first = min(max(first_seen - r0, 0), br)  # the tile's first row that sees a key
        if first:
            o_t[:, :, :first] = 0
            lse_t[:, :, :first] = NEG_INF
            if first == br:
                return
        scratch = worker_scratch(acc_t)
        # -- prologue: Q_i of all G heads as one (G·br, d + 1) matrix (a copy only when G > 1) --
        Qx_i = Qx[h0:h1, :, r0:r1].reshape(nh, G * br, d + 1)
        Kx_h, Vx_h = Kx[h0:h1], Vx[h0:h1]
        accx = frozen_max_tile(Qx_i, Kx_h, Vx_h, kv, r0=r0, br=br, G=G, first=first,
                               clip=not in_range[h0:h1].all(), exp=exp, lim=lim,
                               scratch=scratch) if frozen_max else None
        if accx is not None:
            # -- epilogue (finalize): the one rescale O_i = acc / ℓ_i, lse = m_i + log ℓ_i --
            acc = accx.reshape(nh, G, br, d + 1)[:, :, first:]
            l_i = acc[..., d]
            inv_l = np.reciprocal(l_i)  # then one multiply: a tile of divisions cost 3× more
            np.multiply(acc[..., :d], inv_l[..., None], out=o_t[:, :, first:], casting="unsafe")
            np.log(l_i, out=lse_t[:, :, first:], casting="unsafe")
            lse_t[:, :, first:] += m[h0:h1, :, r0 + first:r1]
            return
        acc, l_i, m_i = online_tile(Qx_i, Kx_h, Vx_h, kv, r0=r0, br=br, G=G, exp=exp,
                                    lim=lim, scratch=scratch)
        shift = None if math.isfinite(acc.sum()) else column_shift(Vx_h[..., :d], Nk, acc_t)
        if shift is not None:
            # P̃ V overflowed: |V| near the dtype's maximum. Again with V's big columns
            # scaled down by powers of two, scaled back after the division by ℓ.
            Vs = Vx_h.copy()
            Vs[..., :d] *= shift[:, None]
            acc, l_i, m_i = online_tile(Qx_i, Kx_h, Vs, kv, r0=r0, br=br, G=G, exp=exp,
                                        lim=lim, scratch=scratch)
        # -- epilogue, for any row: ℓ = 0 (no key), NaN rows --
        seen = l_i > 0  # NaN rows compare False but keep their NaN through acc and m
        with np.errstate(divide="ignore", invalid="ignore"):
            l_div = np.where(seen, l_i, 1).astype(acc_t, copy=False)
            acc /= l_div[:, :, None]
            L = np.where(seen, m_i * ln + np.log(l_div), NEG_INF)
            L[np.isnan(l_i)] = np.nan  # a NaN score: NaN lse, in that row only
        if shift is not None:
            acc /= shift[:, None]
        o_t[...] = acc.reshape(nh, G, br, d)
        lse_t[...] = L.reshape(nh, G, br)

    run_tasks(run, tasks, workers)
    CALL_BUFFERS.give_back(buf)
    return o, lse
