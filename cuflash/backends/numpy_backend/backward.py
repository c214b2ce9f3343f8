"""The FA2 backward: K/V tiles outer (dK_j, dV_j accumulated in the task), Q rows inner.

Each pool task is one K/V tile of a range of K/V heads with its steps from
`block_schedule` (outer="k"); dQ is summed in one private accumulator per worker.
"""
import threading

import numpy as np

from ..._dtypes import accum_dtype
from .arrays import Scratch, as_dtype, grouped_heads, with_ones
from .expbase import exp_limit, in_exp_range
from .pool import run_tasks
from .schedule import NEG_INF, block_schedule, head_chunks, head_ranges, mask_block, tile_rows


def backward(do, q, k, v, o, lse, causal, scale, config):
    """dq, dk, dv from the seed equations, tile by tile:

        P_ij = exp(S_ij − L_i)          recomputed from the stored lse
        dV_j += P_ijᵀ dO_i
        dP_ij = dO_i V_jᵀ
        dS_ij = P_ij ∘ (dP_ij − D_i),   D_i = rowsum(dO_i ∘ O_i)
        dQ_i += dS_ij K_j · scale
        dK_j += dS_ijᵀ Q_i · scale

    P is computed in the config's base b, as in the forward (frozen_max_tile):
    S_b − L_b = (scale·log_b e) Q Kᵀ − L·log_b e, clipped into the exponential's fast
    range only where norms cannot rule out leaving it (P < 2^-100 then counts as 2^-100).
    """
    B, Hq, Nq, d, Hkv, Nk, G, BH, q4, k3, v3 = grouped_heads(q, k, v)
    acc_t = accum_dtype(q.dtype)
    workers = config.workers
    base = config.base
    exp = base.exp
    sc = acc_t.type(scale)
    c = acc_t.type(scale * base.log_e)
    lim = exp_limit(acc_t, base)
    # Prepared once per call, O(N·d) like dq: Qx = [c·Q | −L_b], dOx = [dO | −D],
    # Kx = [K | 1], Vx = [V | 1], so that the matmuls give S_b − L_b and dP − D
    # directly: two passes over every score tile saved, and no per-tile casts.
    do4, o4 = (x.reshape(BH, G, Nq, d) for x in (do, o))
    L = lse.reshape(BH, G, Nq)
    Qx = np.empty((BH, G, Nq, d + 1), acc_t)
    dOx = np.empty((BH, G, Nq, d + 1), acc_t)
    Kx = np.empty((BH, Nk, d + 1), acc_t)
    Vx = np.empty((BH, Nk, d + 1), acc_t)
    in_range = np.zeros(BH, bool)

    def prepare_heads(heads):  # a range of K/V heads (and their G query heads)
        h0, h1 = heads
        nh = h1 - h0
        np.multiply(q4[h0:h1], c, out=Qx[h0:h1, ..., :d], casting="unsafe")
        Q = Qx[h0:h1, ..., :d].reshape(nh, G * Nq, d)
        # lse = −inf (row saw no key): subtract +inf instead, so P = 0 (2^-100 once
        # clipped), not NaN. (The schedule never visits such rows: this guards a
        # user's lse.)
        L_b = Qx[h0:h1, ..., d].reshape(nh, G * Nq)
        np.multiply(np.where(L[h0:h1] == NEG_INF, np.inf, L[h0:h1]).reshape(nh, G * Nq),
                    -base.log_e, out=L_b, casting="unsafe")
        np.copyto(dOx[h0:h1, ..., :d], do4[h0:h1], casting="unsafe")
        # −D = −rowsum(dO ∘ O)
        np.negative(np.einsum("...i,...i->...", dOx[h0:h1, ..., :d], as_dtype(o4[h0:h1], acc_t)),
                    out=dOx[h0:h1, ..., d])
        with_ones(k3[h0:h1], Kx[h0:h1])
        with_ones(v3[h0:h1], Vx[h0:h1])
        in_range[h0:h1] = in_exp_range(Q, Kx[h0:h1, :, :d], L_b, lim)

    run_tasks(prepare_heads, head_ranges(BH, workers), workers)

    Br = tile_rows(config.bwd_rows, G, Nq)
    Bc = min(config.bwd_block_n, Nk)
    chunks = head_chunks(BH, G * Br * Bc, config.bwd_tile_budget, workers)
    sched = list(block_schedule(Nq, Nk, Br, Bc, causal=causal, outer="k",
                                diag=config.bwd_diag))
    tasks = [(h0, h1, c0, c1, qt) for (c0, c1, qt) in sched for (h0, h1) in chunks]
    # Biggest tiles first (causal: the first keys are seen by the most rows) balances workers.
    tasks.sort(key=lambda t: -sum((r1 - r0) * (b1 - b0) for r0, r1, b0, b1, _ in t[4]))

    dk = np.zeros((B, Hkv, Nk, d), k.dtype)
    dv = np.zeros((B, Hkv, Nk, d), v.dtype)
    dk3, dv3 = dk.reshape(BH, Nk, d), dv.reshape(BH, Nk, d)
    local = threading.local()
    dq_parts = []
    parts_lock = threading.Lock()

    def run(task):
        h0, h1, c0, c1, q_tiles = task
        nh, bc = h1 - h0, c1 - c0
        if not q_tiles:  # no row sees these keys: dK_j = dV_j = 0 (already)
            return
        if not hasattr(local, "dq"):
            # dQ is accumulated across K tiles: one private accumulator per worker,
            # summed at the end (no two workers write the same dQ rows).
            local.dq = np.zeros((BH, G, Nq, d), acc_t)
            local.S, local.dP, local.dQ = Scratch(acc_t), Scratch(acc_t), Scratch(acc_t)
            with parts_lock:
                dq_parts.append(local.dq)
        clip = not in_range[h0:h1].all()
        dK_j = np.zeros((nh, bc, d), acc_t)
        dV_j = np.zeros((nh, bc, d), acc_t)
        for r0, r1, b0, b1, t in q_tiles:
            # Keys [b0, b1) of the tile: all of it, or a strip of the diagonal triangle.
            br, w = r1 - r0, b1 - b0
            rows = G * br
            Kx_j, Vx_j = Kx[h0:h1, b0:b1], Vx[h0:h1, b0:b1]
            dK_s, dV_s = dK_j[:, b0 - c0:b1 - c0], dV_j[:, b0 - c0:b1 - c0]
            # The G query heads' rows stacked into one matrix (a copy only when G > 1).
            Qx_i = Qx[h0:h1, :, r0:r1].reshape(nh, rows, d + 1)
            dOx_i = dOx[h0:h1, :, r0:r1].reshape(nh, rows, d + 1)
            # P_ij = exp(S_ij − L_i) = b^([c·Q_i | −L_b_i] [K_j | 1]ᵀ)
            P = np.matmul(Qx_i, Kx_j.transpose(0, 2, 1), out=local.S.get((nh, rows, w)))
            if clip:
                np.clip(P, -lim, lim, out=P)
            exp(P, out=P)
            if t is not None:  # only the block the diagonal crosses
                mask_block(P, G, br, t, fill=0)
            dV_s += P.transpose(0, 2, 1) @ dOx_i[..., :d]        # dV_j += P_ijᵀ dO_i
            # dS_ij = P_ij ∘ (dP_ij − D_i),  dP_ij − D_i = [dO_i | −D_i] [V_j | 1]ᵀ
            dS = np.matmul(dOx_i, Vx_j.transpose(0, 2, 1), out=local.dP.get((nh, rows, w)))
            np.multiply(dS, P, out=dS)
            dK_s += dS.transpose(0, 2, 1) @ Qx_i[..., :d]        # dK_j += dS_ijᵀ (c·Q_i)
            dQ_i = np.matmul(dS, Kx_j[..., :d], out=local.dQ.get((nh, rows, d)))
            local.dq[h0:h1, :, r0:r1] += dQ_i.reshape(nh, G, br, d)  # dQ_i += dS_ij K_j
        np.multiply(dK_j, base.ln, out=dk3[h0:h1, c0:c1], casting="unsafe")  # c·ln b = scale
        dv3[h0:h1, c0:c1] = dV_j

    run_tasks(run, tasks, workers)
    if not dq_parts:
        return np.zeros(q.shape, q.dtype), dk, dv
    dq_acc = dq_parts[0]
    for part in dq_parts[1:]:
        dq_acc += part
    dq_acc *= sc                                                # dQ = dS K · scale
    return dq_acc.reshape(B, Hq, Nq, d).astype(q.dtype, copy=False), dk, dv
