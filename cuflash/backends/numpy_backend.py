"""The NumPy backend: blocked FlashAttention-2 on the CPU, the default without a GPU.

The same loops as the CUDA kernels and as `cuflash.reference.fa2_attention`, with
the same names for the online-softmax state (`m_i`, `l_i`, `acc`; init / update /
finalize), but each step works on a tile of several heads at once:

    q (B, Hq, Nq, d) → view (B·Hkv, G, Nq, d),  k, v (B, Hkv, Nk, d) → (B·Hkv, Nk, d)

with G = Hq / Hkv. A Q tile is the rows [r0, r1) of the G query heads sharing
one K/V head, stacked into one (G·Br, d) matrix: GQA costs no copy of K/V and
every matmul is a plain batched `@` over K/V heads. The tiles (head range ×
Q rows) are spread over a small thread pool, one worker per core.

Memory: one score tile (heads, G·Br, Bc) per worker, plus O(N·d) arrays (the
outputs, Kᵀ and [V | 1] prepared once per call, dQ accumulators) — never N×N.

Numerics (DESIGN.md §1): 16-bit inputs are widened to float32 (K, V once per
call, Q per tile) and accumulated in float32, float64 in float64; −inf − (−inf)
is guarded by subtracting 0 from rows whose running max is still −inf; a fully
masked row gets o = 0 and lse = −inf; a NaN or +inf score poisons its own row
only, as scipy.special.softmax does.
"""
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._dtypes import accum_dtype, lse_dtype

NEG_INF = -np.inf

# ---------------------------------------------------------------------------- tuning
# Tile sizes, measured on a 2-core Xeon (AVX-512, 2 MB L2 per core), float32,
# B=1, H=8, N=2048, d=64 (benchmarks/bench_cpu.py). A 512 × 512 float32 score
# tile is 1 MB and stays in L2 from Q Kᵀ through exp to P̃ V. Alternatives that
# lost (forward, one worker, same run): 256×512 two heads per tile +45%,
# 256×512 one head +12%, 256×1024 +12%, 128×512 +40%, 512×256 +3%.
ROWS = 512        # rows of one score tile (G query heads × Br rows)
BLOCK_N = 512     # Bc: keys per K/V tile
BWD_ROWS = 256    # backward keeps two tiles (P, dP) alive: half the rows
BWD_BLOCK_N = 512
TILE_BUDGET = 1 << 18      # max elements of one forward score tile (heads × rows × cols)
BWD_TILE_BUDGET = 1 << 17  # the same for each of the backward's two tiles
_N_THREADS = None      # None: one worker per usable core
FAST_PATH = True       # frozen-max forward tiles (see _fwd_tile_frozen)
MAX_SAMPLE = 64        # keys whose row max becomes the frozen reference


def _n_workers():
    if _N_THREADS is not None:
        return max(1, int(_N_THREADS))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


_POOL = None
_POOL_LOCK = threading.Lock()


def _forget_pool_after_fork():
    # A forked child inherits the pool object but none of its threads.
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _blas_one_thread_here():
    """Pool initializer: make BLAS single-threaded in this worker thread only.

    Our workers already split the tiles over the cores; a multi-threaded BLAS
    inside each of them oversubscribes the cores (measured 1.6× slower on 2
    cores). OpenBLAS ≥ 0.3.27 has a per-thread setting,
    `openblas_set_num_threads_local`, which leaves every other thread (and the
    user's own BLAS calls) alone. Where it is missing nothing changes.
    """
    try:
        import ctypes
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
        for path in paths:
            fn = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local", None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                fn(1)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - non-Linux / no OpenBLAS
        pass


def _map(fn, tasks):
    """Run fn over tasks on a small pool of worker threads (one per core).

    NumPy releases the GIL inside BLAS and inside ufunc loops, so the workers
    run the big tile operations in parallel. Even with one worker the tiles run
    in the pool, where BLAS is single-threaded: a multi-threaded OpenBLAS call
    on a tile this small spends its time waking threads (and, on a loaded
    machine, waiting for them: measured up to 25× slower).
    """
    n = _n_workers()
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers != n:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="cuflash-np",
                                       initializer=_blas_one_thread_here)
        pool = _POOL

    def quiet(task):
        # NaN and ±inf propagate by design (DESIGN.md §1): exp(inf − inf) and
        # 0·inf inside a row are the defined result, not a warning.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return fn(task)

    return list(pool.map(quiet, tasks))


# ---------------------------------------------------------------------------- tiling
def block_schedule(Nq, Nk, Br, Bc, *, causal):
    """The (Q tile, [K tiles]) pairs a blocked loop visits: the mask logic, in one place.

    Yields (r0, r1, kv) with kv a list of (c0, c1, width, needs_mask). With
    causal=True (key j hidden from query i when j > i + Nk − Nq), K tiles
    entirely above the diagonal are skipped, tiles entirely below it need no
    mask, and only the tiles the diagonal crosses get one. `width` ≤ c1 − c0 is
    how many of the tile's keys any row of the Q tile can see: the keys past it
    are masked for every row, so the loops compute only S[:, :width] (on a
    diagonal tile that halves the work). A Q tile with no visible key has kv = [].
    """
    off = Nk - Nq
    for r0 in range(0, Nq, Br):
        r1 = min(r0 + Br, Nq)
        kv = []
        for c0 in range(0, Nk, Bc):
            c1 = min(c0 + Bc, Nk)
            if causal:
                last = (r1 - 1) + off          # the last key the tile's last row sees
                if c0 > last:                  # above the diagonal for every row: skip
                    break
                width = min(c1, last + 1) - c0
                kv.append((c0, c1, width, c0 + width - 1 > r0 + off))  # crosses it: mask
            else:
                kv.append((c0, c1, c1 - c0, False))
        yield r0, r1, kv


def _causal_tile(Nq, Nk, r0, r1, c0, c1):
    """True where key c0+b is hidden from query r0+a (one (r1−r0, c1−c0) tile)."""
    i = np.arange(r0, r1)[:, None]
    j = np.arange(c0, c1)[None, :]
    return j > i + (Nk - Nq)


def _head_chunks(BH, per_head_elems, budget):
    """Split the B·Hkv K/V heads into ranges whose score tiles fit `budget` elements,
    with at least one range per worker when there are enough heads (small N)."""
    hc = max(1, min(BH, budget // max(1, per_head_elems)))
    hc = min(hc, max(1, BH // _n_workers()))
    return [(h, min(h + hc, BH)) for h in range(0, BH, hc)]


def _as(x, dtype):
    """x in dtype, without a copy when it already is (the per-tile cast for 16-bit)."""
    return x if x.dtype == dtype else x.astype(dtype)


class _Buf:
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


# ---------------------------------------------------------------------------- forward

# The frozen-max fast path accepts a tile when every row keeps ℓ_i within
# [2^-30, 2^64] and acc finite; otherwise the tile is redone with the running max.
_L_MIN, _L_MAX = 2.0 ** -30, 2.0 ** 64


def _prepare_kv(k3, v3, acc_t):
    """[Kᵀ; 1] and [V | 1] in the accumulation dtype, made once per call (O(N·d), like o).

    [Q_i | −m] [Kᵀ; 1] = Q_i Kᵀ − m: the row of ones lets the matmul subtract a
    per-row max for free. [V | 1] lets one matmul P̃ [V_j | 1] give both P̃ V_j
    and ℓ̃ = rowsum(P̃), saving a pass over every score tile. Kᵀ is contiguous
    because OpenBLAS runs faster on it than on a transposed view (a transposed
    copy per tile cost ~10% of the forward). 16-bit K, V are widened here.
    """
    BH, Nk, d = v3.shape
    KTx = np.empty((BH, d + 1, Nk), acc_t)
    np.copyto(KTx[:, :d], k3.transpose(0, 2, 1))
    KTx[:, d] = 1
    Vx = np.empty((BH, Nk, d + 1), acc_t)
    Vx[:, :, :d] = v3
    Vx[:, :, d] = 1
    return KTx, Vx


def _fwd_tile_online(Qx, KTx, Vx, h0, h1, r0, r1, kv, G, d, Nq, Nk, acc_t, local):
    """One Q tile, FlashAttention-2's inner loop with the running max m_i.

    Qx is [scale·Q_i | 0]. Returns the unnormalised state (acc, ℓ_i, m_i).
    """
    nh, rows = Qx.shape[:2]
    br = r1 - r0
    Qx[:, :, d] = 0
    # -- init --
    m_i = np.full((nh, rows), NEG_INF, acc_t)
    l_i = np.zeros((nh, rows), acc_t)
    acc = np.zeros((nh, rows, d), acc_t)
    for c0, c1, width, needs_mask in kv:
        c1 = c0 + width  # keys past `width` are masked for every row: never loaded
        bc = c1 - c0
        # -- compute qk: S_ij = (scale·Q_i) K_jᵀ --
        S = np.matmul(Qx, KTx[h0:h1, :, c0:c1], out=local.S.get((nh, rows, bc)))
        if needs_mask:  # only the tiles the diagonal crosses
            np.copyto(S.reshape(nh, G, br, bc), NEG_INF,
                      where=_causal_tile(Nq, Nk, r0, r1, c0, c1))
        # -- update m_i and l_i --
        m_new = np.maximum(m_i, S.max(axis=-1))
        # Guard: a row that has seen only −inf keeps m = −inf and
        # −inf − (−inf) would be NaN; subtracting 0 gives exp(−inf) = 0.
        m_safe = np.where(m_new == NEG_INF, 0, m_new).astype(acc_t, copy=False)
        np.subtract(S, m_safe[:, :, None], out=S)
        np.exp(S, out=S)                                 # P̃_ij = exp(S_ij − m_i)
        alpha = np.exp(m_i - m_safe)                     # e^{m_old − m_new}
        PV = np.matmul(S, Vx[h0:h1, c0:c1], out=local.PV.get((nh, rows, d + 1)))
        # ℓ_i = α ℓ_i + rowsum(P̃_ij);  acc = diag(α) acc + P̃_ij V_j  (O kept unscaled)
        l_i *= alpha
        l_i += PV[:, :, d]
        acc *= alpha[:, :, None]
        acc += PV[:, :, :d]
        m_i = m_new
    return acc, l_i, m_i


def _fwd_tile_frozen(Qx, KTx, Vx, h0, h1, r0, r1, kv, G, d, Nq, Nk, has_key, acc_t, local):
    """One Q tile with the running max frozen from a sample of keys.

    The max in exp(S − m) only guards against overflow; any fixed reference m
    near the row's largest score gives the same result to rounding. So m_i is
    the row max over the first MAX_SAMPLE keys (key 0 is visible to every row
    that sees any key, so ℓ_i ≥ 1), folded into the matmul as
    [Q_i | −m_i] [K_jᵀ; 1] = S_ij − m_i: no tile needs a rowmax pass, a
    subtraction or an α rescale — Q Kᵀ, exp, P̃ [V | 1], 3 passes instead of 5.
    The result is accepted when every row kept ℓ_i ∈ [2^-30, 2^64] and a finite
    acc; otherwise (a score more than ~44 above the sample's max, +inf, NaN,
    huge V) it returns None and the caller redoes the tile with the running max.
    """
    nh, rows = Qx.shape[:2]
    br = r1 - r0
    # -- init: the frozen reference m_i from a sample of keys --
    c0, _, width, needs_mask = kv[0]
    ns = min(width, MAX_SAMPLE)
    Qx[:, :, d] = 0
    S0 = np.matmul(Qx, KTx[h0:h1, :, c0:c0 + ns])
    if needs_mask:
        np.copyto(S0.reshape(nh, G, br, ns), NEG_INF,
                  where=_causal_tile(Nq, Nk, r0, r1, c0, c0 + ns))
    m_i = S0.max(axis=-1)
    m_i[m_i == NEG_INF] = 0   # −inf − (−inf) guard: such rows subtract 0
    Qx[:, :, d] = -m_i
    l_i = np.zeros((nh, rows), acc_t)
    acc = np.zeros((nh, rows, d), acc_t)
    for c0, c1, width, needs_mask in kv:
        c1 = c0 + width
        bc = c1 - c0
        # -- compute qk: S_ij − m_i = [scale·Q_i | −m_i] [K_jᵀ; 1] --
        S = np.matmul(Qx, KTx[h0:h1, :, c0:c1], out=local.S.get((nh, rows, bc)))
        if needs_mask:
            np.copyto(S.reshape(nh, G, br, bc), NEG_INF,
                      where=_causal_tile(Nq, Nk, r0, r1, c0, c1))
        np.exp(S, out=S)                                 # P̃_ij = exp(S_ij − m_i)
        PV = np.matmul(S, Vx[h0:h1, c0:c1], out=local.PV.get((nh, rows, d + 1)))
        l_i += PV[:, :, d]                               # ℓ_i += rowsum(P̃_ij)
        acc += PV[:, :, :d]                              # acc += P̃_ij V_j
    # A row with no visible key has ℓ = 0 legitimately; any other row must stay
    # in the window (NaN fails every comparison, so NaN rows go to the slow path).
    ok = (l_i <= _L_MAX) & ((l_i >= _L_MIN) | ((l_i == 0) & ~has_key))
    if not (ok.all() and np.isfinite(acc).all()):
        return None
    return acc, l_i, m_i


def _fwd_fa2(q, k, v, causal, scale):
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BH = B * Hkv
    acc_t = accum_dtype(q.dtype)
    # GQA without copies: the G query heads of one K/V head are axis 1 of q4.
    q4 = q.reshape(BH, G, Nq, d)
    k3 = k.reshape(BH, Nk, d)
    v3 = v.reshape(BH, Nk, d)
    o = np.empty((B, Hq, Nq, d), q.dtype)
    lse = np.empty((B, Hq, Nq), lse_dtype(q.dtype))
    o4 = o.reshape(BH, G, Nq, d)
    lse3 = lse.reshape(BH, G, Nq)

    Br = max(1, min(Nq, ROWS // G)) if G <= ROWS else 1
    Bc = min(BLOCK_N, Nk)
    chunks = _head_chunks(BH, G * Br * Bc, TILE_BUDGET)
    KTx, Vx = _prepare_kv(k3, v3, acc_t)
    sched = list(block_schedule(Nq, Nk, Br, Bc, causal=causal))
    # Longest tiles first (causal: the bottom rows see the most keys) balances workers.
    tasks = [(h0, h1, r0, r1, kv) for (r0, r1, kv) in sched for (h0, h1) in chunks]
    tasks.sort(key=lambda t: -len(t[4]))
    local = threading.local()

    off = Nk - Nq

    def run(task):
        h0, h1, r0, r1, kv = task
        nh, br = h1 - h0, r1 - r0
        rows = G * br
        if not kv:  # no visible key for any row of this tile: o = 0, lse = −inf
            o4[h0:h1, :, r0:r1] = 0
            lse3[h0:h1, :, r0:r1] = NEG_INF
            return
        if not hasattr(local, "S"):
            local.S, local.PV, local.Q = _Buf(acc_t), _Buf(acc_t), _Buf(acc_t)
        # -- prologue: load Q_i (all G heads) as [scale·Q_i | ·], the scale folded in once --
        Qx = local.Q.get((nh, rows, d + 1))
        np.multiply(q4[h0:h1, :, r0:r1], acc_t.type(scale),
                    out=Qx.reshape(nh, G, br, d + 1)[..., :d], casting="unsafe")
        # Rows that see at least one key (causal: query r sees keys 0 .. r + Nk − Nq).
        has_key = np.tile(np.arange(r0, r1) + off >= 0 if causal else np.ones(br, bool), G)
        state = None
        if FAST_PATH:
            state = _fwd_tile_frozen(Qx, KTx, Vx, h0, h1, r0, r1, kv, G, d, Nq, Nk,
                                     has_key, acc_t, local)
        if state is None:
            state = _fwd_tile_online(Qx, KTx, Vx, h0, h1, r0, r1, kv, G, d, Nq, Nk, acc_t, local)
        acc, l_i, m_i = state
        # -- epilogue (finalize): the one rescale O_i = acc / ℓ_i, lse = m_i + log ℓ_i --
        seen = l_i > 0  # NaN rows compare False but keep their NaN through acc and m
        with np.errstate(divide="ignore", invalid="ignore"):
            l_div = np.where(seen, l_i, 1).astype(acc_t, copy=False)
            acc /= l_div[:, :, None]
            L = np.where(seen, m_i + np.log(l_div), NEG_INF)
            L[np.isnan(l_i)] = np.nan  # a NaN score: NaN lse, in that row only
        o4[h0:h1, :, r0:r1] = acc.reshape(nh, G, br, d)
        lse3[h0:h1, :, r0:r1] = L.reshape(nh, G, br)

    _map(run, tasks)
    return o, lse


def _fwd_fa1(q, k, v, causal, scale):
    """FlashAttention-1 loop order: K/V tiles outer, O, ℓ, m in "HBM", rescaled each step."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BH = B * Hkv
    acc_t = accum_dtype(q.dtype)
    q4 = q.reshape(BH, G, Nq, d)
    k3 = k.reshape(BH, Nk, d)
    v3 = v.reshape(BH, Nk, d)
    Br = max(1, min(Nq, ROWS // G)) if G <= ROWS else 1
    Bc = min(BLOCK_N, Nk)
    # O, ℓ, m live in "HBM" (full arrays), normalised after every step.
    O = np.zeros((BH, G, Nq, d), acc_t)
    l = np.zeros((BH, G, Nq), acc_t)
    m = np.full((BH, G, Nq), NEG_INF, acc_t)
    sched = list(block_schedule(Nq, Nk, Br, Bc, causal=causal))
    # Turn the (Q tile -> K tiles) schedule around: for each K tile, its Q tiles.
    by_kv = {}
    for r0, r1, kv in sched:
        for c0, c1, width, needs_mask in kv:  # (FA1 keeps whole tiles: width unused)
            by_kv.setdefault((c0, c1), []).append((r0, r1, needs_mask))
    sc = acc_t.type(scale)
    for (c0, c1), q_tiles in sorted(by_kv.items()):        # 5: for j in 1..Tc
        K_j = _as(k3[:, c0:c1], acc_t)                     # 6: load K_j, V_j
        V_j = _as(v3[:, c0:c1], acc_t)
        for r0, r1, needs_mask in q_tiles:                 # 7: for i in 1..Tr
            br = r1 - r0
            Q_i = np.multiply(q4[:, :, r0:r1], sc, dtype=acc_t)  # 8: load Q_i, O_i, ℓ_i, m_i
            O_i, l_i, m_i = O[:, :, r0:r1], l[:, :, r0:r1], m[:, :, r0:r1]
            S = Q_i @ K_j[:, None].transpose(0, 1, 3, 2)   # 9: S_ij = Q_i K_jᵀ
            if needs_mask:
                np.copyto(S, NEG_INF, where=_causal_tile(Nq, Nk, r0, r1, c0, c1))
            # 10: m̃_ij = rowmax(S_ij), P̃_ij = exp(S_ij − m̃_ij), ℓ̃_ij = rowsum(P̃_ij)
            mt = S.max(axis=-1)
            mt_safe = np.where(mt == NEG_INF, 0, mt).astype(acc_t, copy=False)  # −inf guard
            with np.errstate(invalid="ignore"):
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
                                  + beta[..., None] * (P @ V_j[:, None])) / l_div[..., None]
            l[:, :, r0:r1] = l_new                          # 13: write ℓ_i, m_i
            m[:, :, r0:r1] = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(l == 0, NEG_INF, m + np.log(np.where(l == 0, 1, l)))
    return (O.astype(q.dtype, copy=False).reshape(B, Hq, Nq, d),
            lse.astype(lse_dtype(q.dtype), copy=False).reshape(B, Hq, Nq))


# ---------------------------------------------------------------------------- backward
def _bwd_fa2(do, q, k, v, o, lse, causal, scale):
    """FlashAttention-2 backward: K/V tiles outer (dK_j, dV_j accumulated on chip), Q inner.

        P_ij = exp(S_ij − L_i)          recomputed from the stored lse
        dV_j += P_ijᵀ dO_i
        dP_ij = dO_i V_jᵀ
        dS_ij = P_ij ∘ (dP_ij − D_i),   D_i = rowsum(dO_i ∘ O_i)
        dQ_i += dS_ij K_j · scale
        dK_j += dS_ijᵀ Q_i · scale
    """
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BH = B * Hkv
    acc_t = accum_dtype(q.dtype)
    sc = acc_t.type(scale)
    q4 = q.reshape(BH, G, Nq, d)
    do4 = do.reshape(BH, G, Nq, d)
    k3 = k.reshape(BH, Nk, d)
    v3 = v.reshape(BH, Nk, d)
    # D = rowsum(dO ∘ O): O(N·d), computed once.
    D = np.sum(_as(do, acc_t) * _as(o, acc_t), axis=-1).reshape(BH, G, Nq)
    # lse = −inf (row saw no key): subtract +inf instead, so P = exp(−inf) = 0, not NaN.
    L = lse.astype(acc_t).reshape(BH, G, Nq)
    L[L == NEG_INF] = np.inf

    Br = max(1, min(Nq, BWD_ROWS // G)) if G <= BWD_ROWS else 1
    Bc = min(BWD_BLOCK_N, Nk)
    chunks = _head_chunks(BH, G * Br * Bc, BWD_TILE_BUDGET)
    # For each K tile, the Q tiles that see it (the forward schedule turned around).
    by_kv = {}
    for r0, r1, kv in block_schedule(Nq, Nk, Br, Bc, causal=causal):
        for c0, c1, width, needs_mask in kv:
            by_kv.setdefault((c0, c1), []).append((r0, r1, width, needs_mask))
    tasks = [(h0, h1, c0, c1, qt) for (c0, c1), qt in by_kv.items() for (h0, h1) in chunks]
    tasks.sort(key=lambda t: -len(t[4]))

    dk = np.zeros((B, Hkv, Nk, d), k.dtype)
    dv = np.zeros((B, Hkv, Nk, d), v.dtype)
    dk3, dv3 = dk.reshape(BH, Nk, d), dv.reshape(BH, Nk, d)
    local = threading.local()
    dq_parts = []
    parts_lock = threading.Lock()

    def run(task):
        h0, h1, c0, c1, q_tiles = task
        nh, bc = h1 - h0, c1 - c0
        if not hasattr(local, "dq"):
            # dQ is accumulated across K tiles: one private accumulator per worker,
            # summed at the end (no two workers write the same dQ rows).
            local.dq = np.zeros((BH, G, Nq, d), acc_t)
            local.S, local.dP = _Buf(acc_t), _Buf(acc_t)
            with parts_lock:
                dq_parts.append(local.dq)
        K_j = _as(k3[h0:h1, c0:c1], acc_t)
        V_j = _as(v3[h0:h1, c0:c1], acc_t)
        K_jT = np.ascontiguousarray(K_j.transpose(0, 2, 1))  # BLAS is faster on these
        V_jT = np.ascontiguousarray(V_j.transpose(0, 2, 1))
        dK_j = np.zeros((nh, bc, d), acc_t)
        dV_j = np.zeros((nh, bc, d), acc_t)
        for r0, r1, w, needs_mask in q_tiles:
            # Only the first w keys of the tile are visible to any row of this Q tile.
            br = r1 - r0
            rows = G * br
            Q_i = np.multiply(q4[h0:h1, :, r0:r1], sc, dtype=acc_t).reshape(nh, rows, d)
            dO_i = np.ascontiguousarray(do4[h0:h1, :, r0:r1], dtype=acc_t).reshape(nh, rows, d)
            L_i = L[h0:h1, :, r0:r1].reshape(nh, rows, 1)
            D_i = D[h0:h1, :, r0:r1].reshape(nh, rows, 1)
            # S_ij = (scale·Q_i) K_jᵀ;  P_ij = exp(S_ij − L_i)
            P = np.matmul(Q_i, K_jT[:, :, :w], out=local.S.get((nh, rows, w)))
            if needs_mask:
                np.copyto(P.reshape(nh, G, br, w), NEG_INF,
                          where=_causal_tile(Nq, Nk, r0, r1, c0, c0 + w))
            np.subtract(P, L_i, out=P)
            np.exp(P, out=P)
            dV_j[:, :w] += P.transpose(0, 2, 1) @ dO_i          # dV_j += P_ijᵀ dO_i
            dP = np.matmul(dO_i, V_jT[:, :, :w],                # dP_ij = dO_i V_jᵀ
                           out=local.dP.get((nh, rows, w)))
            np.subtract(dP, D_i, out=dP)                        # dS_ij = P_ij ∘ (dP_ij − D_i)
            np.multiply(dP, P, out=dP)
            dS = dP
            dK_j[:, :w] += dS.transpose(0, 2, 1) @ Q_i          # dK_j += dS_ijᵀ (scale·Q_i)
            local.dq[h0:h1, :, r0:r1] += (dS @ K_j[:, :w]).reshape(nh, G, br, d)  # dQ_i += dS_ij K_j
        dk3[h0:h1, c0:c1] = dK_j
        dv3[h0:h1, c0:c1] = dV_j

    _map(run, tasks)
    dq_acc = dq_parts[0]
    for part in dq_parts[1:]:
        dq_acc += part
    dq_acc *= sc                                                # dQ = dS K · scale
    return dq_acc.reshape(B, Hq, Nq, d).astype(q.dtype, copy=False), dk, dv


# ---------------------------------------------------------------------------- softmax
SOFTMAX_BLOCK = 1 << 16   # elements of x per block (P · rows · Q)


def _softmax(x):
    """Softmax of x (P, n, Q) over axis 1: one online pass (running max, running sum),
    then one normalising pass, both blocked over n; O(P·Q·block) extra memory.

    Matches scipy.special.softmax, NaN/inf included: all −inf → NaN, +inf → NaN.
    """
    P_, n, Q_ = x.shape
    acc_t = accum_dtype(x.dtype)
    nb = max(1, SOFTMAX_BLOCK // max(1, P_ * Q_))
    # -- init --
    m = np.full((P_, 1, Q_), NEG_INF, acc_t)
    l = np.zeros((P_, 1, Q_), acc_t)
    # -- update: pass 1 --
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for a in range(0, n, nb):
            blk = _as(x[:, a:a + nb], acc_t)
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
        out = np.empty(x.shape, x.dtype)
        inv_l = np.divide(1, l, dtype=acc_t)
        for a in range(0, n, nb):
            e = _as(x[:, a:a + nb], acc_t) - m
            np.exp(e, out=e)
            e *= inv_l
            out[:, a:a + nb] = e
    return out


# ---------------------------------------------------------------------------- backend
class NumpyBackend:
    """The backend object (see cuflash.backends): name, xp, forward, backward, softmax."""

    name = "numpy"
    xp = np

    def forward(self, q, k, v, *, causal=False, scale=None, algorithm="fa2"):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        if algorithm == "fa1":
            return _fwd_fa1(q, k, v, causal, scale)
        if algorithm != "fa2":
            raise ValueError(f"algorithm must be 'fa2' or 'fa1'; got {algorithm!r}")
        return _fwd_fa2(q, k, v, causal, scale)

    def backward(self, do, q, k, v, o, lse, *, causal=False, scale=None):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return _bwd_fa2(do, q, k, v, o, lse, causal, scale)

    def softmax(self, x):
        return _softmax(x)

    def __repr__(self):
        return "<cuflash numpy backend>"


BACKEND = NumpyBackend()
