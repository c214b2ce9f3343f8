"""Attention with variants on the CPU: window, softcap, ALiBi, bias, bool mask, dropout.

The FA2 loops with FlashAttention-2's running max (as `online_tile`), in natural units,
with the score chain of `cuflash.variants` applied to every score tile:

    S = scale·Q_i K_jᵀ → softcap → + ALiBi + bias → causal/window/mask (−inf)
      → online softmax (m_i, ℓ_i on the undropped P̃) → P̃ ∘ keep/(1 − p) → acc += P̃ V_j

The default forward's frozen max needs |S| bounded by the norms of Q and K (Cauchy–
Schwarz), which a bias or ALiBi breaks, so the variants run the running max throughout.
Each pool task is one Q tile (forward) or one K/V tile (backward) of one K/V head and its
G query heads; the block schedule (`variant_schedule`) visits only the blocks the causal
and window bands reach, a band's whole span in one step per tile (`_tile_sizes`): at
N = 8192 with a causal window of 256 keys (3.1% of the square), 4.6% of the scores, in
5.5% of the full square's time (the rest: the band's mask pass and each tile's fixed
cost; CPU time, medians of interleaved runs on 2 shared cores, bench_variants.py).

bias and mask are read tile by tile from their compact 4-D form (a size-1 axis
broadcast as a stride-0 view): nothing of size Nq × Nk is made. dbias is summed in one
accumulator of the bias's own compact shape (under a lock: tasks of other heads or key
tiles may add to the same entries when the bias is broadcast).
"""
import functools
import threading

import numpy as np

from ... import variants as _var
from ..._dtypes import accum_dtype, lse_dtype
from .arrays import as_dtype
from .pool import run_tasks
from .schedule import NEG_INF

# Rows (per query head) and keys of a score tile. Smaller than the default forward's: the
# chain adds several passes per tile, and a window's band is visited in these steps.
_ROWS, _KEYS, _WINDOW_BLOCK = 128, 256, 128
# The widest band a tile takes whole across (keys of a Q tile, rows of a K/V tile): a
# 128 × 1024 float32 tile is 512 KB, in L2 with its exp.
_BAND_SPAN = 1024


def _bounds(Nq, Nk, causal, window):
    """(L, R): row i sees keys i + Nk − Nq − L ≤ j ≤ i + Nk − Nq + R (big = unbounded)."""
    lo, hi = _var.key_bounds(0, Nq, Nk, causal, window)
    off = Nk - Nq
    return off - lo, hi - off


def variant_schedule(Nq, Nk, Br, Bc, *, causal, window, outer="q"):
    """The blocks a loop visits under causal and window: outer="q" yields (r0, r1,
    [(c0, c1, pred)]) per Q tile, outer="k" yields (c0, c1, [(r0, r1, pred)]) per K/V
    tile; only blocks some row sees; pred is False where every row of the block sees
    every key of it by the index predicates (no per-element test needed)."""
    off = Nk - Nq
    L, R = _bounds(Nq, Nk, causal, window)

    def full(a0, a1, b0, b1):  # rows [a0, a1) all see keys [b0, b1)
        return b0 >= a1 - 1 + off - L and b1 - 1 <= a0 + off + R

    if outer == "q":
        for r0 in range(0, Nq, Br):
            r1 = min(r0 + Br, Nq)
            lo, hi = max(0, r0 + off - L), min(Nk, r1 - 1 + off + R + 1)
            yield r0, r1, [(c0, min(c0 + Bc, hi), not full(r0, r1, c0, min(c0 + Bc, hi)))
                           for c0 in range(lo, hi, Bc)]
    else:
        for c0 in range(0, Nk, Bc):
            c1 = min(c0 + Bc, Nk)
            lo, hi = max(0, c0 - off - R), min(Nq, c1 - 1 - off + L + 1)
            yield c0, c1, [(r0, min(r0 + Br, hi), not full(r0, min(r0 + Br, hi), c0, c1))
                           for r0 in range(lo, hi, Br)]


# A block's index predicates depend only on its shape and its offset t from the diagonal,
# and a loop meets a few (shape, t) over and over: cached, read-only.
@functools.lru_cache(maxsize=512)
def _outside_band(rows, cols, t, L, R):
    """True where key y of the block is outside row x's band: y − x < t − L or > t + R."""
    d = np.arange(cols)[None, :] - np.arange(rows)[:, None]
    out = (d < t - L) | (d > t + R)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=512)
def _distance(rows, cols, t, dtype):
    """|i + Nk − Nq − j| over the block: |t + x − y|."""
    d = np.abs(t + np.arange(rows)[:, None] - np.arange(cols)[None, :]).astype(dtype)
    d.flags.writeable = False
    return d


class ScoreChain:
    """The score chain of one call, applied tile by tile (see module docstring)."""

    def __init__(self, var, B, Hq, Hkv, Nq, Nk, causal, acc_t):
        self.var, self.causal, self.acc_t = var, causal, acc_t
        self.G, self.Hkv, self.Nq, self.Nk = Hq // Hkv, Hkv, Nq, Nk
        self.L, self.R = _bounds(Nq, Nk, causal, var.window)
        full = (B, Hq, Nq, Nk)
        # Stride-0 views of the compact arrays: indexing them reads the bias's own memory.
        self.bias = None if var.bias is None else np.broadcast_to(var.bias, full)
        self.mask = None if var.mask is None else np.broadcast_to(var.mask, full)
        self.alibi = None if var.alibi is None else np.broadcast_to(var.alibi, (B, Hq))
        self.threshold = var.threshold

    def heads(self, bh):
        """(batch index, slice of the G query heads) of K/V head bh."""
        b, hkv = divmod(bh, self.Hkv)
        return b, slice(hkv * self.G, (hkv + 1) * self.G)

    def apply(self, S, bh, a0, a1, c0, c1, pred):
        """S (G, a1 − a0, c1 − c0) = scale·Q Kᵀ → (the masked, biased score, and
        tanh(S/softcap), the backward's softcap factor, or None). S is overwritten."""
        var = self.var
        b, hs = self.heads(bh)
        T = None
        if var.softcap is not None:                          # softcap·tanh(s/softcap)
            T = np.tanh(np.multiply(S, 1.0 / var.softcap, out=S), out=S)
            S = np.multiply(T, var.softcap, out=np.empty_like(T))
        t = a0 + self.Nk - self.Nq - c0  # key c0 + y sits t + x − y from row a0 + x's diagonal
        if self.alibi is not None:                           # − slope·|i + Nk − Nq − j|
            slopes = self.alibi[b, hs].astype(self.acc_t)[:, None, None]
            S -= slopes * _distance(a1 - a0, c1 - c0, t, self.acc_t)
        if self.bias is not None:                            # + bias
            S += self.bias[b, hs, a0:a1, c0:c1]
        hidden = None
        if pred:                                             # causal / window
            hidden = _outside_band(a1 - a0, c1 - c0, t, self.L, self.R)
        if self.mask is not None:                            # / mask (True = may attend)
            m = ~self.mask[b, hs, a0:a1, c0:c1]
            hidden = m if hidden is None else hidden | m
        if hidden is not None:
            np.copyto(S, NEG_INF, where=hidden)
        return S, T

    def keep(self, bh, a0, a1, c0, c1):
        """keep/(1 − p) for the tile, or None without dropout."""
        if not self.var.dropout_p:
            return None
        b, hs = self.heads(bh)
        keep = _var.keep_tile(self.var.seed, self.threshold, b + self.var.batch0,
                              np.arange(hs.start, hs.stop), a0, a1, c0, c1)
        return keep * self.acc_t.type(self.var.keep_scale)


def _tile_sizes(Nq, Nk, G, causal, window, *, outer="q"):
    """(Br rows per query head, Bc keys) of a score tile.

    A band (a window bounded on both sides, or on the left with causal) takes blocks of
    _WINDOW_BLOCK on the loop's own axis and, across, the whole span that block reaches
    (Br + L + R keys of a Q tile, Bc + L + R rows of a K/V tile) while it is at most
    _BAND_SPAN: one step per tile, so a tile computes only the scores of its band's
    parallelogram (at N = 8192, window 256: 384 of 8192 keys per Q tile of 128 rows) and
    pays one step's fixed cost — the NumPy calls of the online softmax — instead of three
    (128-wide steps took 1.6× the CPU time, 2 shared cores). Wider bands take
    _WINDOW_BLOCK steps across too, so that few hidden scores are computed."""
    rows = max(1, min(Nq, _ROWS // G if G <= _ROWS else 1))
    keys = min(Nk, _KEYS)
    if window is not None and window[0] >= 0 and (window[1] >= 0 or causal):
        L, R = _bounds(Nq, Nk, causal, window)
        rows, keys = min(rows, _WINDOW_BLOCK), min(keys, _WINDOW_BLOCK)
        if outer == "q" and rows + L + R <= _BAND_SPAN:
            keys = min(Nk, rows + L + R)
        elif outer == "k" and G * (keys + L + R) <= _BAND_SPAN:  # G heads' rows
            rows = min(Nq, keys + L + R)
    return rows, keys


def forward(q, k, v, causal, scale, config, var):
    """o, lse for q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) with the variants `var`."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, BH = Hq // Hkv, B * Hkv
    acc_t = accum_dtype(q.dtype)
    chain = ScoreChain(var, B, Hq, Hkv, Nq, Nk, causal, acc_t)
    Br, Bc = _tile_sizes(Nq, Nk, G, causal, var.window)
    o = np.empty((B, Hq, Nq, d), q.dtype)
    lse = np.empty((B, Hq, Nq), lse_dtype(q.dtype))
    sched = list(variant_schedule(Nq, Nk, Br, Bc, causal=causal, window=var.window))
    tasks = [(bh, r0, r1, steps) for bh in range(BH) for (r0, r1, steps) in sched]
    sc = acc_t.type(scale)

    def run(task):
        bh, r0, r1, steps = task
        b, hs = chain.heads(bh)
        hkv = bh % Hkv
        Q = np.multiply(q[b, hs, r0:r1], sc, dtype=acc_t)            # (G, br, d)
        # -- init --
        m_i = np.full((G, r1 - r0), NEG_INF, acc_t)
        l_i = np.zeros((G, r1 - r0), acc_t)
        acc = np.zeros((G, r1 - r0, d), acc_t)
        for c0, c1, pred in steps:
            K_j = as_dtype(k[b, hkv, c0:c1], acc_t)
            V_j = as_dtype(v[b, hkv, c0:c1], acc_t)
            # -- compute qk, then the chain: S = softcap(scale·Q Kᵀ) + ALiBi + bias, masked
            S, _ = chain.apply(Q @ K_j.T, bh, r0, r1, c0, c1, pred)
            # -- update m_i and l_i (the guard: −inf − (−inf) would be NaN)
            m_new = np.maximum(m_i, S.max(axis=-1))
            m_safe = np.where(m_new == NEG_INF, 0, m_new).astype(acc_t, copy=False)
            P = np.exp(np.subtract(S, m_safe[..., None], out=S), out=S)  # P̃ = exp(S − m_i), in place
            alpha = np.exp(m_i - m_safe)
            l_i = alpha * l_i + P.sum(axis=-1)                       # ℓ on the undropped P̃
            Z = chain.keep(bh, r0, r1, c0, c1)
            if Z is not None:
                P *= Z                                               # dropout: P̃ ∘ keep/(1 − p)
            acc = alpha[..., None] * acc + P @ V_j                   # acc = α acc + P̃ V_j
            m_i = m_new
        # -- finalize: O = acc / ℓ, lse = m + log ℓ (a row that saw no key: 0 and −inf)
        seen = l_i > 0
        l_div = np.where(seen, l_i, 1).astype(acc_t, copy=False)
        o[b, hs, r0:r1] = acc / l_div[..., None]
        L = np.where(seen, m_i + np.log(l_div), NEG_INF)
        L[np.isnan(l_i)] = np.nan
        lse[b, hs, r0:r1] = L

    run_tasks(run, tasks, config.workers)
    return o, lse


def backward(do, q, k, v, o, lse, causal, scale, config, var, return_dbias):
    """dq, dk, dv (and dbias in the compact shape of var.bias) with the variants `var`.

        P = exp(S − lse),  Z = keep/(1 − p)
        dV_j += (P ∘ Z)ᵀ dO_i,  dP = (dO_i V_jᵀ) ∘ Z,  dS = P ∘ (dP − D_i)
        dbias += dS (summed over bias's broadcast axes)
        dS ← dS ∘ (1 − tanh²(s/softcap))
        dQ_i += dS K_j · scale,  dK_j += dSᵀ Q_i · scale
    """
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, BH = Hq // Hkv, B * Hkv
    acc_t = accum_dtype(q.dtype)
    chain = ScoreChain(var, B, Hq, Hkv, Nq, Nk, causal, acc_t)
    Br, Bc = _tile_sizes(Nq, Nk, G, causal, var.window, outer="k")
    sc = acc_t.type(scale)
    # D = rowsum(dO ∘ O) (dropout leaves it unchanged: rowsum(P ∘ dP) = rowsum(dO ∘ O)).
    D = np.einsum("bhnd,bhnd->bhn", as_dtype(do, acc_t), as_dtype(o, acc_t))
    # lse = −inf (the row sees no key): subtract +inf instead, so P = 0, not NaN.
    Ls = np.where(lse == NEG_INF, np.inf, lse).astype(acc_t, copy=False)
    dk = np.zeros((B, Hkv, Nk, d), k.dtype)
    dv = np.zeros((B, Hkv, Nk, d), v.dtype)
    dbias = None
    if return_dbias:
        dbias = np.zeros(var.bias.shape, acc_t)
        bias_lock = threading.Lock()
    sched = list(variant_schedule(Nq, Nk, Br, Bc, causal=causal, window=var.window,
                                  outer="k"))
    tasks = [(bh, c0, c1, steps) for bh in range(BH) for (c0, c1, steps) in sched]
    local = threading.local()
    dq_parts, parts_lock = [], threading.Lock()

    def add_dbias(dS, b, hs, a0, a1, c0, c1):
        """dbias += dS, summed over the axes along which the bias is broadcast."""
        bb, bhd, bq, bk = dbias.shape
        red = dS
        if bhd == 1:
            red = red.sum(axis=0, keepdims=True)
        if bq == 1:
            red = red.sum(axis=1, keepdims=True)
        if bk == 1:
            red = red.sum(axis=2, keepdims=True)
        target = dbias[b if bb > 1 else 0, hs if bhd > 1 else slice(0, 1),
                       slice(a0, a1) if bq > 1 else slice(0, 1),
                       slice(c0, c1) if bk > 1 else slice(0, 1)]
        with bias_lock:
            target += red

    def run(task):
        bh, c0, c1, steps = task
        if not steps:
            return
        if not hasattr(local, "dq"):
            local.dq = np.zeros((B, Hq, Nq, d), acc_t)
            with parts_lock:
                dq_parts.append(local.dq)
        b, hs = chain.heads(bh)
        hkv = bh % Hkv
        K_j = as_dtype(k[b, hkv, c0:c1], acc_t)
        V_j = as_dtype(v[b, hkv, c0:c1], acc_t)
        dK_j = np.zeros((c1 - c0, d), acc_t)
        dV_j = np.zeros((c1 - c0, d), acc_t)
        for r0, r1, pred in steps:
            Q_i = np.multiply(q[b, hs, r0:r1], sc, dtype=acc_t)      # (G, br, d), scaled
            dO_i = as_dtype(do[b, hs, r0:r1], acc_t)
            S, T = chain.apply(Q_i @ K_j.T, bh, r0, r1, c0, c1, pred)
            P = np.exp(S - Ls[b, hs, r0:r1, None])                   # P = exp(S − lse)
            Z = chain.keep(bh, r0, r1, c0, c1)
            Pd = P if Z is None else P * Z
            dV_j += np.einsum("gik,gid->kd", Pd, dO_i)               # dV_j += (P ∘ Z)ᵀ dO_i
            dP = dO_i @ V_j.T                                        # dP = dO_i V_jᵀ (∘ Z)
            if Z is not None:
                dP *= Z
            dS = P * (dP - D[b, hs, r0:r1, None])                    # dS = P ∘ (dP − D)
            if dbias is not None:
                add_dbias(dS, b, hs, r0, r1, c0, c1)
            if T is not None:
                dS *= 1 - T * T                                      # through the softcap
            dK_j += np.einsum("gik,gid->kd", dS, Q_i)                # dK_j += dSᵀ (scale·Q_i)
            local.dq[b, hs, r0:r1] += dS @ K_j                       # dQ_i += dS K_j
        dk[b, hkv, c0:c1] = dK_j
        dv[b, hkv, c0:c1] = dV_j

    run_tasks(run, tasks, config.workers)
    dq = np.zeros((B, Hq, Nq, d), acc_t)
    for part in dq_parts:
        dq += part
    dq *= sc                                                         # dQ = dS K · scale
    out = (dq.astype(q.dtype, copy=False), dk, dv)
    return out + (dbias,) if return_dbias else out
