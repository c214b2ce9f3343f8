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

Numerics: 16-bit inputs are widened to float32 (K, V once per
call, Q per tile) and accumulated in float32, float64 in float64; −inf − (−inf)
is guarded by subtracting 0 from rows whose running max is still −inf; a fully
masked row gets o = 0 and lse = −inf; a NaN or +inf score poisons its own row
only, as scipy.special.softmax does.
"""
import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from .._dtypes import accum_dtype, lse_dtype

NEG_INF = -np.inf
LN2 = math.log(2)


# ---------------------------------------------------------------------------- exponential
class ExpBase(NamedTuple):
    """The base b the scores are carried in: S_b = S·log_b(e), so exp(S − m) = b^(S_b − m_b)
    costs one call of `exp` and no extra multiply (log_b(e) is folded into Q's scale)."""

    name: str
    exp: np.ufunc      # x ↦ b^x
    log_e: float       # log_b(e): natural units → base-b units
    ln: float          # ln(b): base-b units → natural units


BASE_2 = ExpBase("2", np.exp2, math.log2(math.e), LN2)
BASE_E = ExpBase("e", np.exp, 1.0, 1.0)


def fastest_base(targets, features):
    """BASE_2 where NumPy's float32 `exp2` loop is vectorised, else BASE_E.

    The exponential is the one elementwise pass over every score tile, and NumPy
    vectorises `exp2` only for AVX-512 (there 30% faster than `exp`), `exp` also
    for AVX2: on an AVX2 Zen 3, `exp2` runs a scalar loop 1.9× slower than `exp`
    (2.6 against 1.35 ns per float32), and the forward took up to 1.3× as long with it.
    `targets` is NumPy's dispatch table (`__cpu_targets_info__`, newer NumPy, or
    None), `features` its CPU feature flags (`__cpu_features__`, the fallback).
    """
    if targets is not None:
        current = targets.get("exp2", {}).get("ff", {}).get("current", "baseline")
        return BASE_E if current.startswith("baseline") else BASE_2
    return BASE_2 if features.get("AVX512F") else BASE_E


def _numpy_dispatch():
    """(targets, features) of this NumPy build on this CPU, for fastest_base."""
    umath = getattr(getattr(np, "_core", getattr(np, "core", None)), "_multiarray_umath", None)
    return (getattr(umath, "__cpu_targets_info__", None),
            getattr(umath, "__cpu_features__", {}))


BASE = fastest_base(*_numpy_dispatch())

# ---------------------------------------------------------------------------- tuning
# Tile sizes, measured on a 2-core Xeon (AVX-512, 2 MB L2 per core), float32,
# B=1, H=8, N=2048, d=64 (benchmarks/bench_cpu.py). A 1024 × 256 float32 score
# tile is 1 MB and stays in L2 from Q Kᵀ through exp to P̃ V. Forward CPU time
# per call, two workers, medians of 31 interleaved runs: 1024×256 198 ms,
# 2048×256 203 ms, 512×512 210 ms; earlier, one worker: 256×512 +12%,
# 128×512 +40% over 512×512. Causal: 512-row tiles (two heads per task) 3%
# faster than 1024 and 256 rows (medians of 41 runs); 128 or 256 keys equal.
# On a 2-core Zen 3 (AVX2, 512 KB L2), 256–2048 rows × 128–2048 keys were all
# within the machine's noise (±5%) of 1024 × 256.
ROWS = 1024       # rows of one score tile (G query heads × Br rows)
CAUSAL_ROWS = 512
BLOCK_N = 256     # Bc: keys per K/V tile
BWD_ROWS = 256    # backward keeps two tiles (P, dP) alive: half the rows
BWD_BLOCK_N = 512
TILE_BUDGET = 1 << 18      # max elements of one forward score tile (heads × rows × cols)
BWD_TILE_BUDGET = 1 << 17  # the same for each of the backward's two tiles
# Causal (block_schedule): the triangle a tile's diagonal crosses is cut into
# key strips (forward: DIAG_KEYS; backward: BWD_DIAG), each computing only the
# rows that see its keys. At N = 2048 the forward computes 53% of the N² scores,
# the backward 56% (whole 512-wide triangles: 62.5%). Measurements on a busy
# 2-core machine, 2 workers: forward strips of 64 / 256 no better than 128, key
# strips 2–3% less CPU than row strips (medians of 31 runs, three times);
# BWD_DIAG 128 slower than 256 (more, smaller steps of 5 matmuls each, each
# NumPy call a GIL hand-over between the workers).
DIAG_KEYS = 128
BWD_DIAG = 256
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
        # NaN and ±inf propagate as the API promises: exp(inf − inf) and
        # 0·inf inside a row are the defined result, not a warning.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return fn(task)

    return list(pool.map(quiet, tasks))


# ---------------------------------------------------------------------------- tiling
def block_schedule(Nq, Nk, Br, Bc, *, causal, outer="q", diag=None):
    """The blocks a tiled loop visits: the causal mask logic, in one place.

    outer="q" (the forward): yields (r0, r1, steps) for each Q tile of Br rows;
    outer="k" (the backward, FA1): yields (c0, c1, steps) for each K/V tile of
    Bc keys. A step (r0, r1, c0, c1, t) is the block rows [r0, r1) × keys
    [c0, c1), inside the tile; t is None where every row of the block sees
    every key of it, else the block straddles the causal diagonal (key j hidden
    from query i when j > i + Nk − Nq) and key c0+b is hidden from row r0+a
    exactly when b − a > t, t = r0 + Nk − Nq − c0 (`_mask_block`).

    With causal=True a Q tile's keys split into unmasked full-height blocks
    (Bc keys at a time) up to about the tile's first row, then the Br × Br
    triangle the diagonal crosses (outer="k": a K/V tile's rows, the other way
    round). That triangle is cut into key strips of `diag` keys, each computing
    only the rows that can see its keys: about (1 + 1/n)/2 of the triangle for
    n strips, instead of all of it. Big tiles stay where there is no mask (they reuse K/V from cache and
    amortise the per-tile work; 128-row tiles throughout measured 30% slower).
    A tile no row sees has steps = [].
    """
    off = Nk - Nq
    diag = diag or (Br if outer == "q" else Bc)
    if outer == "q":
        for r0 in range(0, Nq, Br):
            r1 = min(r0 + Br, Nq)
            if not causal:
                yield r0, r1, [(r0, r1, c0, min(c0 + Bc, Nk), None) for c0 in range(0, Nk, Bc)]
                continue
            full = min(max(r0 + off + 1, 0), Nk)   # keys 0 .. full−1: seen by every row
            full -= full % _ALIGN
            steps = [(r0, r1, c0, min(c0 + Bc, full), None) for c0 in range(0, full, Bc)]
            end = min(max(r1 + off, 0), Nk)        # keys past end−1: seen by no row of the tile
            for b0 in range(full, end, diag):      # the triangle, in key strips
                b1 = min(b0 + diag, end)
                lo = min(max(b0 - off, r0), r1)    # rows before lo see no key of the strip
                lo -= (lo - r0) % _ALIGN
                steps.append((lo, r1, b0, b1, lo + off - b0))
            yield r0, r1, steps
    elif outer == "k":
        for c0 in range(0, Nk, Bc):
            c1 = min(c0 + Bc, Nk)
            if not causal:
                yield c0, c1, [(r0, min(r0 + Br, Nq), c0, c1, None) for r0 in range(0, Nq, Br)]
                continue
            hi = min(max(c1 - 1 - off, 0), Nq)     # rows from hi on see every key of the tile
            hi = min(hi + (-hi) % _ALIGN, Nq)
            steps = []
            for b0 in range(c0, c1, diag):         # the triangle, in key strips
                b1 = min(b0 + diag, c1)
                lo = min(max(b0 - off, 0), Nq)     # rows before lo see no key of the strip
                if hi > lo:
                    steps.append((lo, hi, b0, b1, lo + off - b0))
            steps += [(r0, min(r0 + Br, Nq), c0, c1, None) for r0 in range(hi, Nq, Br)]
            yield c0, c1, steps
    else:
        raise ValueError(f"outer must be 'q' or 'k'; got {outer!r}")


# Blocks start on multiples of 16 keys (rows for outer="k"), one 64-byte cache
# line of float32, rather than right at the diagonal: the unmasked blocks and
# the K/V slices then start aligned (odd offsets measured ~10% slower).
_ALIGN = 16


@functools.lru_cache(maxsize=256)
def _hidden(rows, cols, t):
    """True where b − a > t in a (rows, cols) block (read-only, cached: a few shapes recur)."""
    mask = np.triu(np.ones((rows, cols), bool), k=t + 1)
    mask.flags.writeable = False
    return mask


def _mask_block(S, G, rows, t, fill=NEG_INF):
    """Write `fill` (−inf: a hidden score; 0: a hidden probability) into the hidden
    entries of S (nh, G·rows, w) or (nh, G, rows, w), a block straddling the
    diagonal (b − a > t hidden). Only the corner that holds hidden entries is
    touched: columns b > t and rows a < w − 1 − t."""
    nh, w = S.shape[0], S.shape[-1]
    b0 = max(0, t + 1)
    b0 -= b0 % _ALIGN
    a1 = min(rows, max(0, w - 1 - t))
    if b0 < w and a1 > 0:
        np.copyto(S.reshape(nh, G, rows, w)[:, :, :a1, b0:], fill,
                  where=_hidden(a1, w - b0, t - b0))


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

# The frozen-max fast path accepts a tile when every row that sees a key keeps
# ℓ_i within [2^-30, 2^64] and acc finite; otherwise the tile is redone with the
# running max.
_L_MIN, _L_MAX = 2.0 ** -30, 2.0 ** 64


def _exp_limit(dtype):
    """The range |x| ≤ this, in BASE's units, where BASE.exp is fast: weights down to
    2^-100 in float32 (x ≥ −100 in base 2, −69.3 in base e), 2^-996 in float64.

    Past 125 (float32), NumPy's exp2 leaves its SIMD loop for a scalar path,
    ~200× slower per element (np.exp, below −87, one ~10× slower); and a weight
    2^x < 2^-100 makes P̃·V products subnormal, which slow the BLAS kernels
    down as much. Measured with q scaled 30× (most weights underflow): with
    np.exp and no range, forward 35× and backward 22× their ordinary time.
    """
    return (np.finfo(dtype).maxexp - 28) * LN2 / BASE.ln


def _in_exp_range(Q, K, shift):
    """Per head, whether every Q_i·K_j − shift_i lies in BASE.exp's fast range, from
    norms alone: |Q_i·K_j − shift_i| ≤ |Q_i| max_j |K_j| + |shift_i| (Cauchy–Schwarz).
    Q (nh, n, d), K (nh, m, d), shift (nh, n); NaN or inf in a head gives False."""
    q_norm = np.sqrt(np.einsum("hij,hij->hi", Q, Q))
    k_norm = np.sqrt(np.einsum("hij,hij->hi", K, K).max(axis=1))
    return (q_norm * k_norm[:, None] + np.abs(shift)).max(axis=1) <= _exp_limit(Q.dtype)


def _with_ones(x, out):
    """out = [x | 1]: x (..., n, d) widened into out (..., n, d + 1), last column ones."""
    np.copyto(out[..., :-1], x, casting="unsafe")
    out[..., -1] = 1


def _head_ranges(BH):
    """B·Hkv heads cut into one contiguous range per worker, for the per-call
    preparation: a few NumPy calls over many heads rather than many calls over one
    (with two workers every call hands the GIL over; measured 2× faster at N = 512)."""
    n = min(BH, _n_workers())
    cuts = [BH * i // n for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]


def _prepare_fwd(q4, k3, v3, scale, causal, acc_t):
    """Qx = [c·Q | −m_b], Kx = [K | 1], Vx = [V | 1] in the accumulation dtype, made
    once per call on the pool (O(N·d), like o), with c = scale·log_b(e): scores come
    out in BASE b, S_b = c·Q Kᵀ, and b^(S_b − m_b) = exp(S − m).

    [Q_i | −m_b_i] [K_j | 1]ᵀ = S_b_ij − m_b_i: the column of ones lets the matmul
    subtract the frozen reference (see _fwd_tile_frozen) for free. [V | 1] lets
    one matmul P̃ [V_j | 1] give both P̃ V_j and ℓ̃ = rowsum(P̃), saving a pass
    over every score tile. 16-bit inputs are widened here.

    m_b is each row's max over the first MAX_SAMPLE keys, for all rows of a head
    in one matmul (done per tile, it was ~10 NumPy calls per tile, and with two
    workers every call is a GIL hand-over). Returns also m = m_b·ln b (natural
    units, for lse) and, per K/V head, whether every S_b − m_b is known to lie in
    BASE.exp's fast range: |S_b_ij − m_b_i| ≤ |c·q_i| |k_j| + |m_b_i| (Cauchy–Schwarz).
    """
    BH, G, Nq, d = q4.shape
    Nk = k3.shape[1]
    Qx = np.empty((BH, G, Nq, d + 1), acc_t)
    Kx = np.empty((BH, Nk, d + 1), acc_t)
    Vx = np.empty((BH, Nk, d + 1), acc_t)
    m = np.zeros((BH, G, Nq), acc_t)
    in_range = np.zeros(BH, bool)
    ns = min(MAX_SAMPLE, Nk)
    c = acc_t.type(scale * BASE.log_e)

    def prepare(heads):
        h0, h1 = heads
        nh = h1 - h0
        Q = Qx[h0:h1, ..., :d].reshape(nh, G * Nq, d)
        np.multiply(q4[h0:h1].reshape(nh, G * Nq, d), c, out=Q, casting="unsafe")
        _with_ones(k3[h0:h1], Kx[h0:h1])
        _with_ones(v3[h0:h1], Vx[h0:h1])
        m_b = np.zeros((nh, G * Nq), acc_t)
        if FAST_PATH:
            # Keys × rows: the max over keys is then an elementwise maximum of rows
            # (a max along a short last axis measured 6× slower).
            S0T = Kx[h0:h1, :ns, :d] @ Q.transpose(0, 2, 1)
            if causal:  # row r sees key j ≤ r + Nk − Nq
                _mask_block(S0T.reshape(nh, ns, G, Nq).transpose(0, 2, 3, 1), G, Nq, Nk - Nq)
            mh = S0T.max(axis=1)
            # A row that sees no sampled key sees no key at all (key 0 is sampled): it
            # subtracts 0, so that b^(−inf − 0) = 0 rather than b^(−inf + inf) = NaN.
            np.copyto(m_b, mh, where=mh != NEG_INF)
            in_range[h0:h1] = _in_exp_range(Q, Kx[h0:h1, :, :d], m_b)
        np.negative(m_b, out=Qx[h0:h1, ..., d].reshape(nh, G * Nq))
        np.multiply(m_b, BASE.ln, out=m[h0:h1].reshape(nh, G * Nq))

    _map(prepare, _head_ranges(BH))
    return Qx, Kx, Vx, m, in_range


def _strip(X, G, br, a0, a1):
    """Rows [a0, a1) of each of the G heads stacked in X (nh, G·br, …): X itself when
    that is all rows (one matmul over the stacked heads), else a (nh, G, a1 − a0, …) view."""
    if a0 == 0 and a1 == br:
        return X
    return X.reshape(X.shape[0], G, br, *X.shape[2:])[:, :, a0:a1]


def _fwd_scores(Qx, Kx, h0, h1, r0, br, step, G, buf):
    """S = Qx Kxᵀ for one step (r0 is the tile's first row), not masked. Returns
    (S, rows view) with S in buf, shaped like the view of Qx."""
    a0, a1, c0, c1, t = step
    Q = _strip(Qx, G, br, a0 - r0, a1 - r0)
    KT = Kx[h0:h1, c0:c1].transpose(0, 2, 1)
    S = np.matmul(Q, KT if Q.ndim == 3 else KT[:, None], out=buf.get(Q.shape[:-1] + (c1 - c0,)))
    return S, (a0 - r0, a1 - r0)


def _fwd_tile_online(Qx, Kx, Vx, h0, h1, r0, r1, kv, G, d, acc_t, local):
    """One Q tile, FlashAttention-2's inner loop with the running max m_i, in BASE.

    Qx is the tile's [c·Q_i | ·]; its last column is overwritten with 0 (no other
    tile reads these rows). Returns the unnormalised state (acc, ℓ_i, m_b_i).
    """
    nh, rows = Qx.shape[:2]
    br = r1 - r0
    lim = _exp_limit(acc_t)
    Qx[:, :, d] = 0
    # -- init -- (acc and ℓ_i share one array [acc | ℓ_i], updated as one: see _fwd_tile_frozen)
    m_i = np.full((nh, rows), NEG_INF, acc_t)
    accx = np.zeros((nh, rows, d + 1), acc_t)
    for step in kv:
        c0, c1, t = step[2:]
        # -- compute qk: S_b_ij = (c·Q_i) K_jᵀ, for the step's rows --
        S, (a0, a1) = _fwd_scores(Qx, Kx, h0, h1, r0, br, step, G, local.S)
        if t is not None:  # only the blocks the diagonal crosses
            _mask_block(S, G, a1 - a0, t)
        m_s, accx_s = _strip(m_i, G, br, a0, a1), _strip(accx, G, br, a0, a1)
        # -- update m_i and l_i --
        m_new = np.maximum(m_s, S.max(axis=-1))
        # Guard: a row that has seen only −inf keeps m = −inf and
        # −inf − (−inf) would be NaN; subtracting 0 gives b^(−inf) = 0.
        m_safe = np.where(m_new == NEG_INF, 0, m_new).astype(acc_t, copy=False)
        np.subtract(S, m_safe[..., None], out=S)
        # Weights below b^-lim count as b^-lim (see _fwd_tile_frozen); hidden
        # entries, lifted from −inf with them, are zeroed after the exponential.
        np.maximum(S, -lim, out=S)
        BASE.exp(S, out=S)                               # P̃_ij = exp(S_ij − m_i)
        if t is not None:
            _mask_block(S, G, a1 - a0, t, fill=0)
        alpha = BASE.exp(m_s - m_safe)                   # e^{m_old − m_new}
        V = Vx[h0:h1, c0:c1]
        PV = np.matmul(S, V if S.ndim == 3 else V[:, None],
                       out=local.PV.get(S.shape[:-1] + (d + 1,)))
        # ℓ_i = α ℓ_i + rowsum(P̃_ij);  acc = diag(α) acc + P̃_ij V_j  (O kept unscaled)
        accx_s *= alpha[..., None]
        accx_s += PV
        m_s[...] = m_new
    return accx[..., :d], accx[..., d], m_i


def _fwd_tile_frozen(Qx, Kx, Vx, h0, h1, r0, r1, kv, G, d, first, in_range, local):
    """One Q tile with the running max frozen at the reference m_b_i in Qx's last column.

    The max in exp(S − m) only guards against overflow; any fixed reference m
    near the row's largest score gives the same result to rounding. So m_i is
    the row max over the first MAX_SAMPLE keys (key 0 is visible to every row
    that sees any key, so ℓ_i ≥ 1), folded into the matmul as
    [Q_i | −m_b_i] [K_j | 1]ᵀ = S_b_ij − m_b_i: no tile needs a rowmax pass, a
    subtraction or an α rescale — Q Kᵀ, b^x, P̃ [V | 1], 3 passes instead of 5.

    BASE.exp is NumPy's fastest exponential on this CPU (fastest_base) as long
    as its argument stays in range (_exp_limit). Where `in_range` cannot promise
    that, S_b − m_b is clipped to it first: a weight below 2^-100 then counts as
    2^-100 instead, below rounding next to ℓ_i ≥ 1. Hidden (causal) entries are
    zeroed after the exponential, so −inf never reaches it.

    Returns [acc | ℓ_i] (nh, G·br, d + 1) when every row from `first` on (the
    rows that see a key) kept ℓ_i ∈ [2^-30, 2^64] and acc stayed finite;
    otherwise (a score more than ~44 above the sample's max, +inf, NaN, huge V)
    None, and the caller redoes the tile with the running max.
    """
    nh, rows = Qx.shape[:2]
    br = r1 - r0
    lim = _exp_limit(Qx.dtype)
    # [acc | ℓ_i] in one array, so that one addition of P̃ [V_j | 1] updates both:
    # with two workers every NumPy call is a GIL hand-over (a context switch when
    # the other worker holds it), so calls per step count.
    accx = local.acc.get((nh, rows, d + 1))
    accx.fill(0)
    for step in kv:
        c0, c1, t = step[2:]
        # -- compute qk: S_b_ij − m_b_i = [c·Q_i | −m_b_i] [K_j | 1]ᵀ, for the step's rows --
        S, (a0, a1) = _fwd_scores(Qx, Kx, h0, h1, r0, br, step, G, local.S)
        if not in_range:
            np.clip(S, -lim, lim, out=S)
        BASE.exp(S, out=S)                               # P̃_ij = exp(S_ij − m_i)
        if t is not None:  # only the blocks the diagonal crosses
            _mask_block(S, G, a1 - a0, t, fill=0)
        V = Vx[h0:h1, c0:c1]
        PV = np.matmul(S, V if S.ndim == 3 else V[:, None],
                       out=local.PV.get(S.shape[:-1] + (d + 1,)))
        _strip(accx, G, br, a0, a1)[...] += PV           # acc += P̃_ij V_j; ℓ_i += rowsum(P̃_ij)
    # Rows before `first` see no key: ℓ = 0 there by the mask. min/max are NaN for
    # a NaN row, which fails both comparisons; the sum is finite only if acc is.
    l_seen = accx.reshape(nh, G, br, d + 1)[:, :, first:, d]
    if l_seen.size and not (l_seen.min() >= _L_MIN and l_seen.max() <= _L_MAX):
        return None
    if not math.isfinite(accx.sum()):
        return None
    return accx


def _grouped_heads(q, k, v):
    """Sizes and GQA views without copies: the G query heads of one K/V head are axis 1
    of q4 (BH, G, Nq, d); k3 and v3 are (BH, Nk, d), with BH = B · Hkv."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BH = B * Hkv
    return (B, Hq, Nq, d, Hkv, Nk, G, BH, q.reshape(BH, G, Nq, d),
            k.reshape(BH, Nk, d), v.reshape(BH, Nk, d))


def _fwd_fa2(q, k, v, causal, scale):
    B, Hq, Nq, d, Hkv, Nk, G, BH, q4, k3, v3 = _grouped_heads(q, k, v)
    acc_t = accum_dtype(q.dtype)
    o = np.empty((B, Hq, Nq, d), q.dtype)
    lse = np.empty((B, Hq, Nq), lse_dtype(q.dtype))
    o4 = o.reshape(BH, G, Nq, d)
    lse3 = lse.reshape(BH, G, Nq)

    rows = CAUSAL_ROWS if causal else ROWS
    Br = max(1, min(Nq, rows // G)) if G <= rows else 1
    Bc = min(BLOCK_N, Nk)
    chunks = _head_chunks(BH, G * Br * Bc, TILE_BUDGET)
    # Fewer head ranges than workers (one long sequence): shorter Q tiles, so that
    # every worker gets some.
    per_chunk = -(-_n_workers() // len(chunks))
    Br = min(Br, -(-Nq // per_chunk))
    Qx, Kx, Vx, m, in_range = _prepare_fwd(q4, k3, v3, scale, causal, acc_t)
    sched = list(block_schedule(Nq, Nk, Br, Bc, causal=causal,
                                diag=DIAG_KEYS))
    # Biggest tiles first (causal: the bottom rows see the most keys) balances workers.
    tasks = [(h0, h1, r0, r1, kv) for (r0, r1, kv) in sched for (h0, h1) in chunks]
    tasks.sort(key=lambda t: -sum((a1 - a0) * (c1 - c0) for a0, a1, c0, c1, _ in t[4]))
    local = threading.local()
    # Causal rows before Nq − Nk see no key (o = 0, lse = −inf); all others see key 0.
    first_seen = max(0, Nq - Nk) if causal else 0

    def run(task):
        h0, h1, r0, r1, kv = task
        nh, br = h1 - h0, r1 - r0
        o_t, lse_t = o4[h0:h1, :, r0:r1], lse3[h0:h1, :, r0:r1]
        first = min(max(first_seen - r0, 0), br)  # the tile's first row that sees a key
        if first:
            o_t[:, :, :first] = 0
            lse_t[:, :, :first] = NEG_INF
            if first == br:
                return
        if not hasattr(local, "S"):
            local.S, local.PV, local.acc = _Buf(acc_t), _Buf(acc_t), _Buf(acc_t)
        # -- prologue: Q_i of all G heads as one (G·br, d + 1) matrix (a copy only when G > 1) --
        Qx_i = Qx[h0:h1, :, r0:r1].reshape(nh, G * br, d + 1)
        accx = _fwd_tile_frozen(Qx_i, Kx, Vx, h0, h1, r0, r1, kv, G, d, first,
                                in_range[h0:h1].all(), local) if FAST_PATH else None
        if accx is not None:
            # -- epilogue (finalize): the one rescale O_i = acc / ℓ_i, lse = m_i + log ℓ_i --
            acc = accx.reshape(nh, G, br, d + 1)[:, :, first:]
            l_i = acc[..., d]
            inv_l = np.reciprocal(l_i)  # then one multiply: a tile of divisions cost 3× more
            np.multiply(acc[..., :d], inv_l[..., None], out=o_t[:, :, first:], casting="unsafe")
            np.log(l_i, out=lse_t[:, :, first:], casting="unsafe")
            lse_t[:, :, first:] += m[h0:h1, :, r0 + first:r1]
            return
        acc, l_i, m_i = _fwd_tile_online(Qx_i, Kx, Vx, h0, h1, r0, r1, kv, G, d, acc_t, local)
        # -- epilogue, for any row: ℓ = 0 (no key), NaN rows --
        seen = l_i > 0  # NaN rows compare False but keep their NaN through acc and m
        with np.errstate(divide="ignore", invalid="ignore"):
            l_div = np.where(seen, l_i, 1).astype(acc_t, copy=False)
            acc /= l_div[:, :, None]
            L = np.where(seen, m_i * BASE.ln + np.log(l_div), NEG_INF)
            L[np.isnan(l_i)] = np.nan  # a NaN score: NaN lse, in that row only
        o_t[...] = acc.reshape(nh, G, br, d)
        lse_t[...] = L.reshape(nh, G, br)

    _map(run, tasks)
    return o, lse


def _fwd_fa1(q, k, v, causal, scale):
    """FlashAttention-1 loop order: K/V tiles outer, O, ℓ, m in "HBM", rescaled each step."""
    B, Hq, Nq, d, Hkv, Nk, G, BH, q4, k3, v3 = _grouped_heads(q, k, v)
    acc_t = accum_dtype(q.dtype)
    Br = max(1, min(Nq, ROWS // G)) if G <= ROWS else 1
    Bc = min(BLOCK_N, Nk)
    # O, ℓ, m live in "HBM" (full arrays), normalised after every step.
    O = np.zeros((BH, G, Nq, d), acc_t)
    l = np.zeros((BH, G, Nq), acc_t)
    m = np.full((BH, G, Nq), NEG_INF, acc_t)
    sc = acc_t.type(scale)
    # K/V tiles outer, each with the Q rows that see it (block_schedule, outer="k").
    for c0, c1, q_tiles in block_schedule(Nq, Nk, Br, Bc, causal=causal, outer="k",
                                          diag=max(1, min(Bc, DIAG_KEYS))):  # 5: for j
        K_j = _as(k3[:, c0:c1], acc_t)                     # 6: load K_j, V_j
        V_j = _as(v3[:, c0:c1], acc_t)
        for r0, r1, b0, b1, t in q_tiles:                  # 7: for i in 1..Tr
            # (a step may cover only keys [b0, b1) of the tile: a strip of the diagonal)
            K_s, V_s = K_j[:, b0 - c0:b1 - c0], V_j[:, b0 - c0:b1 - c0]
            Q_i = np.multiply(q4[:, :, r0:r1], sc, dtype=acc_t)  # 8: load Q_i, O_i, ℓ_i, m_i
            O_i, l_i, m_i = O[:, :, r0:r1], l[:, :, r0:r1], m[:, :, r0:r1]
            S = Q_i @ K_s[:, None].transpose(0, 1, 3, 2)   # 9: S_ij = Q_i K_jᵀ
            if t is not None:
                _mask_block(S, G, r1 - r0, t)
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
                                  + beta[..., None] * (P @ V_s[:, None])) / l_div[..., None]
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

    P is computed in BASE b with BASE.exp, as in the forward (_fwd_tile_frozen):
    S_b − L_b = (scale·log_b e) Q Kᵀ − L·log_b e, clipped into BASE.exp's fast range
    only where norms cannot rule out leaving it (P < 2^-100 then counts as 2^-100).
    """
    B, Hq, Nq, d, Hkv, Nk, G, BH, q4, k3, v3 = _grouped_heads(q, k, v)
    acc_t = accum_dtype(q.dtype)
    sc = acc_t.type(scale)
    c = acc_t.type(scale * BASE.log_e)
    lim = _exp_limit(acc_t)
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

    def prepare(heads):  # a range of K/V heads (and their G query heads), on the pool
        h0, h1 = heads
        nh = h1 - h0
        Q = Qx[h0:h1, ..., :d].reshape(nh, G * Nq, d)
        np.multiply(q4[h0:h1].reshape(nh, G * Nq, d), c, out=Q, casting="unsafe")
        # lse = −inf (row saw no key): subtract +inf instead, so P = 0 (2^-100 once
        # clipped), not NaN. (The schedule never visits such rows: this guards a
        # user's lse.)
        L_b = Qx[h0:h1, ..., d].reshape(nh, G * Nq)
        np.multiply(np.where(L[h0:h1] == NEG_INF, np.inf, L[h0:h1]).reshape(nh, G * Nq),
                    -BASE.log_e, out=L_b, casting="unsafe")
        np.copyto(dOx[h0:h1, ..., :d], do4[h0:h1], casting="unsafe")
        # −D = −rowsum(dO ∘ O)
        np.negative(np.einsum("...i,...i->...", dOx[h0:h1, ..., :d], _as(o4[h0:h1], acc_t)),
                    out=dOx[h0:h1, ..., d])
        _with_ones(k3[h0:h1], Kx[h0:h1])
        _with_ones(v3[h0:h1], Vx[h0:h1])
        in_range[h0:h1] = _in_exp_range(Q, Kx[h0:h1, :, :d], L_b)

    _map(prepare, _head_ranges(BH))

    Br = max(1, min(Nq, BWD_ROWS // G)) if G <= BWD_ROWS else 1
    Bc = min(BWD_BLOCK_N, Nk)
    chunks = _head_chunks(BH, G * Br * Bc, BWD_TILE_BUDGET)
    sched = list(block_schedule(Nq, Nk, Br, Bc, causal=causal, outer="k", diag=BWD_DIAG))
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
            local.S, local.dP, local.dQ = _Buf(acc_t), _Buf(acc_t), _Buf(acc_t)
            with parts_lock:
                dq_parts.append(local.dq)
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
            if not in_range[h0:h1].all():
                np.clip(P, -lim, lim, out=P)
            BASE.exp(P, out=P)
            if t is not None:  # only the block the diagonal crosses
                _mask_block(P, G, br, t, fill=0)
            dV_s += P.transpose(0, 2, 1) @ dOx_i[..., :d]        # dV_j += P_ijᵀ dO_i
            # dS_ij = P_ij ∘ (dP_ij − D_i),  dP_ij − D_i = [dO_i | −D_i] [V_j | 1]ᵀ
            dS = np.matmul(dOx_i, Vx_j.transpose(0, 2, 1), out=local.dP.get((nh, rows, w)))
            np.multiply(dS, P, out=dS)
            dK_s += dS.transpose(0, 2, 1) @ Qx_i[..., :d]        # dK_j += dS_ijᵀ (c·Q_i)
            dQ_i = np.matmul(dS, Kx_j[..., :d], out=local.dQ.get((nh, rows, d)))
            local.dq[h0:h1, :, r0:r1] += dQ_i.reshape(nh, G, br, d)  # dQ_i += dS_ij K_j
        np.multiply(dK_j, BASE.ln, out=dk3[h0:h1, c0:c1], casting="unsafe")  # c·ln b = scale
        dv3[h0:h1, c0:c1] = dV_j

    _map(run, tasks)
    if not dq_parts:
        return np.zeros(q.shape, q.dtype), dk, dv
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
