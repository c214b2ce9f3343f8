"""The FA2 backward: K/V tiles outer (dK_j, dV_j accumulated in the task), Q rows inner.

Each task is one K/V tile of a range of K/V heads with its steps from
`block_schedule` (outer="k"); the tasks run in fixed lanes (`pool.lanes`), dQ summed
in one accumulator per lane, so the result is bitwise the same from call to call.
Plain float32 and 16-bit calls go to the compiled kernel first (`native`,
`CpuConfig.native`), in the same order and lanes; these tiles take what it does not.
"""
import numpy as np

from ..._dtypes import accum_dtype
from . import native
from .arrays import CALL_BUFFERS, as_dtype, grouped_heads, split_scale, with_ones, worker_scratch
from .expbase import exp_limit, in_exp_range
from .pool import lanes, run_tasks
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
    do4, o4 = (x.reshape(BH, G, Nq, d) for x in (do, o))
    L = lse.reshape(BH, G, Nq)
    if acc_t == np.float32:
        done = native.backward(do4, q4, k3, v3, o4, L, causal, scale, workers, config.native)
        if done is not None:  # else: off, not available here, or a gradient to redo (native)
            dq, dk, dv = done
            return (dq.reshape(B, Hq, Nq, d).astype(q.dtype, copy=False),
                    dk.reshape(B, Hkv, Nk, d).astype(k.dtype, copy=False),
                    dv.reshape(B, Hkv, Nk, d).astype(v.dtype, copy=False))
    base = config.base
    exp = base.exp
    # c_q·c_k = scale·log_b(e) (split_scale); dQ and dK take back the other factor.
    c_q, c_k = (acc_t.type(f) for f in split_scale(scale * base.log_e, acc_t))
    sc_q = acc_t.type(scale / c_k)
    lim = exp_limit(acc_t, base)
    # Prepared once per call, O(N·d) like dq: Qx = [c_q·Q | −L_b], dOx = [dO | −D],
    # Kx = [c_k·K | 1], Vx = [V | 1], so that the matmuls give S_b − L_b and dP − D
    # directly: two passes over every score tile saved, and no per-tile casts.
    buf, (Qx, dOx, Kx, Vx) = CALL_BUFFERS.take(
        ((BH, G, Nq, d + 1), acc_t), ((BH, G, Nq, d + 1), acc_t),
        ((BH, Nk, d + 1), acc_t), ((BH, Nk, d + 1), acc_t))
    in_range = np.zeros(BH, bool)

    def prepare_heads(heads):  # a range of K/V heads (and their G query heads)
        h0, h1 = heads
        nh = h1 - h0
        np.multiply(q4[h0:h1], c_q, out=Qx[h0:h1, ..., :d], casting="unsafe")
        Q = Qx[h0:h1, ..., :d].reshape(nh, G * Nq, d)
        # lse = −inf (the row saw no key): subtract +inf instead, so P = 0 (2^-100 once
        # clipped), not NaN, and zero the row's [dO | −D], so that it adds exactly 0 to
        # dK, dV and its own dQ whatever P is. (The causal schedule never visits rows
        # before Nq − Nk: this covers a user's lse.)
        unseen = L[h0:h1] == NEG_INF
        L_b = Qx[h0:h1, ..., d].reshape(nh, G * Nq)
        np.multiply(np.where(unseen, np.inf, L[h0:h1]).reshape(nh, G * Nq),
                    -base.log_e, out=L_b, casting="unsafe")
        np.copyto(dOx[h0:h1, ..., :d], do4[h0:h1], casting="unsafe")
        # −D = −rowsum(dO ∘ O)
        np.negative(np.einsum("...i,...i->...", dOx[h0:h1, ..., :d], as_dtype(o4[h0:h1], acc_t)),
                    out=dOx[h0:h1, ..., d])
        np.copyto(dOx[h0:h1], 0, where=unseen[..., None])
        with_ones(k3[h0:h1], Kx[h0:h1], c_k)
        with_ones(v3[h0:h1], Vx[h0:h1])
        in_range[h0:h1] = in_exp_range(Q, Kx[h0:h1, :, :d], L_b, lim)

    run_tasks(prepare_heads, head_ranges(BH, workers), workers)

    Br = tile_rows(config.bwd_rows, G, Nq)
    Bc = min(config.bwd_block_n, Nk)
    chunks = head_chunks(BH, G * Br * Bc, config.bwd_tile_budget, workers)
    sched = list(block_schedule(Nq, Nk, Br, Bc, causal=causal, outer="k",
                                diag=config.bwd_diag))
    tasks = [(h0, h1, c0, c1, qt) for (c0, c1, qt) in sched for (h0, h1) in chunks if qt]

    dk = np.zeros((B, Hkv, Nk, d), k.dtype)
    dv = np.zeros((B, Hkv, Nk, d), v.dtype)
    dk3, dv3 = dk.reshape(BH, Nk, d), dv.reshape(BH, Nk, d)

    def run_lane(lane):
        # dQ is summed across K/V tiles: one accumulator per lane, its tasks in a fixed
        # order (pool.lanes), so dQ's sums have one order whatever the threads do.
        dq = np.zeros((BH, G, Nq, d), acc_t)
        scratch = worker_scratch(acc_t)
        for task in lane:
            run(task, dq, scratch.S, scratch.dP, scratch.dQ)
        return dq

    def run(task, dq, S_buf, dP_buf, dQ_buf):
        h0, h1, c0, c1, q_tiles = task
        nh, bc = h1 - h0, c1 - c0
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
            # P_ij = exp(S_ij − L_i) = b^([c_q·Q_i | −L_b_i] [c_k·K_j | 1]ᵀ)
            P = np.matmul(Qx_i, Kx_j.transpose(0, 2, 1), out=S_buf.get((nh, rows, w)))
            if clip:
                np.clip(P, -lim, lim, out=P)
            exp(P, out=P)
            if t is not None:  # only the block the diagonal crosses
                mask_block(P, G, br, t, fill=0)
            dV_s += P.transpose(0, 2, 1) @ dOx_i[..., :d]        # dV_j += P_ijᵀ dO_i
            # dS_ij = P_ij ∘ (dP_ij − D_i),  dP_ij − D_i = [dO_i | −D_i] [V_j | 1]ᵀ
            dS = np.matmul(dOx_i, Vx_j.transpose(0, 2, 1), out=dP_buf.get((nh, rows, w)))
            np.multiply(dS, P, out=dS)
            dK_s += dS.transpose(0, 2, 1) @ Qx_i[..., :d]        # dK_j += dS_ijᵀ (c_q·Q_i)
            dQ_i = np.matmul(dS, Kx_j[..., :d], out=dQ_buf.get((nh, rows, d)))
            dq[h0:h1, :, r0:r1] += dQ_i.reshape(nh, G, br, d)    # dQ_i += dS_ij (c_k·K_j)
        # c_q·c_k·ln b = scale
        np.multiply(dK_j, acc_t.type(base.ln * c_k), out=dk3[h0:h1, c0:c1], casting="unsafe")
        dv3[h0:h1, c0:c1] = dV_j

    # (A K/V tile no row sees has no task: its dK_j = dV_j = 0 already.)
    cost = lambda t: (t[1] - t[0]) * sum((r1 - r0) * (b1 - b0) for r0, r1, b0, b1, _ in t[4])
    dq_parts = run_tasks(run_lane, lanes(tasks, workers, cost), workers)
    CALL_BUFFERS.give_back(buf)
    dq_acc = dq_parts[0]
    for part in dq_parts[1:]:                                   # in lane order
        dq_acc += part
    dq_acc *= sc_q                                              # dQ = dS K · scale
    return dq_acc.reshape(B, Hq, Nq, d).astype(q.dtype, copy=False), dk, dv
