"""Attention with variants on the CPU: window, softcap, ALiBi, bias, bool mask, dropout.

The FA2 loops with the score chain of `cuflash.variants` applied to every score tile:

    S = scale·Q_i K_jᵀ → score_mod → softcap → + ALiBi + bias → causal/window/mask(_mod)
      → softmax (m_i, ℓ_i on the undropped P̃) → P̃ ∘ keep/(1 − p) → acc += P̃ V_j

The forward's tiles (without dropout) first run with the max frozen at a reference, as
the plain forward's (`frozen_steps`: the reference from the first keys, folded into the
matmul; the chain's values in the exponential's base; the masks applied to P̃ as zeros;
ℓ from P̃ [V_j | 1]): Q Kᵀ, the chain, the exponential and P̃ V per step, no max,
rescale or row sum. A tile whose ℓ or acc shows the reference did not serve is redone
with FlashAttention-2's running max (`online_steps`, natural units, masks as −inf), as
is every tile with dropout or `CpuConfig(frozen_max=False)`, and the backward's (lse
given) never needs one.
The block schedule (`variant_schedule`) visits only the blocks the causal and window
bands reach, a band's whole span in one step per tile (`_tile_sizes`); a band's tiles
between the sequence's ends run many at once (`band.runs`: one NumPy call per pass for
all of them), and each pool task takes a batch of tiles of one K/V head and its G query
heads (Q tiles forward, K/V tiles backward). At N = 8192 with a causal window of 256 keys
(3.1% of the square) the forward's 32-row tiles compute 3.5% of the scores, in 3.4–3.9%
of the full square's CPU time (the same loops; medians of interleaved runs on 2 shared
cores, bench_variants.py); the rest of the gap to the band is the tiles' corners.

bias and mask are read tile by tile from their compact 4-D form (a size-1 axis
broadcast as a stride-0 view): nothing of size Nq × Nk is made. dbias is summed in one
accumulator of the bias's own compact shape; where the bias is broadcast across tasks
(other batch rows, K/V heads or key tiles add to the same entries) one per lane.
The backward's tasks run in fixed lanes (`pool.lanes`), so dq and dbias are bitwise
the same from call to call.
"""
import functools
import math
from typing import NamedTuple, Optional

import numpy as np

from ... import variants as _var
from ..._dtypes import accum_dtype, lse_dtype
from ...programmable.block_mask import EMPTY, PARTIAL, tile_kinds
from ...programmable.evaluate import Bound, toeplitz
from .arrays import CALL_BUFFERS, Scratch, as_dtype, column_shift, split_scale, with_ones
from .band import batches, diagonal_windows, runs, windows
from .expbase import BASE_E, exp_limit
from .forward_tiles import reference_failed, reference_served
from .pool import lanes, run_tasks
from .schedule import NEG_INF, head_ranges

# Rows (per query head) of a backward's score tile, keys of every score tile; a wide
# window's band is visited in steps of _WINDOW_BLOCK. 512 rows against 128, on a 2-core Zen 4 (1 MB L2 per core), float32,
# H = 8, medians of 3 interleaved runs: 0.55–0.9× the time forward and 0.7–0.85× backward
# for softcap, causal ALiBi, bias, dropout and a causal table-lookup score_mod, at N = 1024,
# 2048 (d = 64) and 4096 (d = 128): fewer NumPy calls per score outweigh the bigger tile.
_ROWS, _KEYS, _WINDOW_BLOCK = 512, 256, 128
# Rows of a forward's tile (the backward keeps _ROWS: two tiles alive). On a 2-core Zen 5
# (1 MB L2 per core), H = 8, d = 64, medians of interleaved runs, the forward's ratio to
# plain attention for softcap, an ALiBi and a table-lookup score_mod, with 512 / 1024 /
# 2048 rows: 1.12–1.25× / 1.10–1.20× / 1.09–1.13× at N = 2048; causal (its steps past the
# first computing only the rows that see their keys, frozen_steps) 1.23–1.57× with 512,
# 1.07–1.31× with 2048 (N = 1024: 1.27–1.49× → 1.17–1.37×). Fewer, bigger NumPy calls
# per score: the calls' Python and the GIL between them, not the cache, set the pace.
_FORWARD_ROWS = 2048
# Rows (per query head) of a Q tile, keys of a K/V tile under a band: its span across is
# these plus the band's width, so fewer compute fewer hidden scores, until the matmuls'
# few rows cost more per score than they save (see _tile_sizes).
_BAND_BLOCK = 32
# A score_mod's reference below this (natural units) is taken as 0: e^S then stays far from
# overflow and underflow, and the frozen forward skips a subtraction per score.
_NEAR_ZERO = 20.0
# Scores of one run of band tiles, and of one task's batch of runs (all heads). 1 MB of
# float32 measured 3–10% less CPU time than 512 KB: fewer tasks, each a few GIL hand-overs.
_RUN_SCORES = 1 << 18


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


def block_mask_schedule(bm, b, heads, Nq, Nk, *, causal, window, outer="q"):
    """variant_schedule for one batch row and K/V head (its query heads `heads`) under a
    block mask: the block mask's tiles, without those it leaves empty for every head or
    that no row sees by causal and window; pred is True where some entry of the tile may
    be masked (the block mask's partial tiles, the band's edges)."""
    off = Nk - Nq
    L, R = _bounds(Nq, Nk, causal, window)
    bq, bk = bm.block

    def kind(a0, a1, b0, b1, i, j):  # None: skip; else pred
        if b0 > a1 - 1 + off + R or b1 - 1 < a0 + off - L:
            return None
        k = tile_kinds(bm, b, heads, i, j)
        if k == EMPTY:
            return None
        return k == PARTIAL or not (b0 >= a1 - 1 + off - L and b1 - 1 <= a0 + off + R)

    if outer == "q":
        for i, r0 in enumerate(range(0, Nq, bq)):
            r1 = min(r0 + bq, Nq)
            steps = [(c0, min(c0 + bk, Nk), p) for j, c0 in enumerate(range(0, Nk, bk))
                     if (p := kind(r0, r1, c0, min(c0 + bk, Nk), i, j)) is not None]
            yield r0, r1, steps
    else:
        for j, c0 in enumerate(range(0, Nk, bk)):
            c1 = min(c0 + bk, Nk)
            steps = [(r0, min(r0 + bq, Nq), p) for i, r0 in enumerate(range(0, Nq, bq))
                     if (p := kind(r0, min(r0 + bq, Nq), c0, c1, i, j)) is not None]
            yield c0, c1, steps


def _tasks(var, Nq, Nk, Br, Bc, G, Hkv, BH, causal, outer):
    """The pool tasks (bh, batch of runs) of every K/V head: the shape's cached batches,
    or under a block mask each head's own."""
    bm = var.block_mask
    if bm is None:
        return [(bh, batch) for bh in range(BH)
                for batch in _task_batches(Nq, Nk, Br, Bc, G, causal, var.window, outer,
                                           _RUN_SCORES)]
    tasks = []
    for bh in range(BH):
        b, hkv = divmod(bh, Hkv)
        sched = block_mask_schedule(bm, b, slice(hkv * G, (hkv + 1) * G), Nq, Nk,
                                    causal=causal, window=var.window, outer=outer)
        tasks += [(bh, batch) for batch in batches(
            [(a0, a1 - a0, 1, steps) for a0, a1, steps in sched], G, _RUN_SCORES)]
    return tasks


# A block's index predicates depend only on its shape and its offset t from the diagonal,
# and a loop meets a few (shape, t) over and over: cached, read-only.
@functools.lru_cache(maxsize=512)
def _outside_band(rows, cols, t, L, R):
    """True where key y of the block is outside row x's band: y − x < t − L or > t + R."""
    d = np.arange(cols)[None, :] - np.arange(rows)[:, None]
    out = (d < t - L) | (d > t + R)
    out.flags.writeable = False
    return out


def hide_outside_band(S, t, L, R, fill=NEG_INF):
    """S (…, rows, cols) = fill where key y is outside row x's band (see _outside_band),
    testing only the columns and rows that can hold such keys: left of the band's left
    edge at the last row, in the rows whose edge is past the first key; right of its
    right edge at the first row, in the rows whose edge is before the last key (a band's
    tile is mostly inside it; a causal step of many rows has its diagonal at the top)."""
    rows, cols = S.shape[-2:]
    left = min(cols, max(0, t - L + rows - 1))  # y < left: outside for some row, on the left
    right = min(cols, max(0, t + R + 1))        # y ≥ right: outside for some row, on the right
    if left >= right:
        np.copyto(S, fill, where=_outside_band(rows, cols, t, L, R))
        return
    top = min(rows, max(0, L - t + 1))          # rows x ≥ top: outside on the left
    bottom = min(rows, max(0, cols - 1 - t - R))  # rows x < bottom: outside on the right
    if left and top < rows:
        np.copyto(S[..., top:, :left], fill, where=_outside_band(rows - top, left, t + top, L, R))
    if right < cols and bottom:
        np.copyto(S[..., :bottom, right:], fill,
                  where=_outside_band(bottom, cols - right, t - right, L, R))


def _hide_where_not(S, keep, fill):
    """S = fill where not `keep` (a bool array broadcast to S). Probabilities (fill 0, S
    finite or NaN) take one multiply by keep instead of a negation and a masked copy."""
    if fill == 0:
        np.multiply(S, keep, out=S)
    else:
        np.copyto(S, fill, where=np.logical_not(keep))


# The mods' index arrays (ScoreChain.indices): a loop meets the same few over and over, and
# making them was a tenth of a small mod's time per tile. Cached, read-only.
@functools.lru_cache(maxsize=1024)
def _positions(q0, kv0, shift, n, rows, cols):
    """q_idx (n, 1, rows, 1) and kv_idx (n, 1, 1, cols) of n blocks, block i from row q0 +
    i·shift and key kv0 + i·shift."""
    i = (np.arange(n) * shift)[:, None, None, None]
    out = {"q_idx": q0 + i + np.arange(rows)[None, None, :, None],
           "kv_idx": kv0 + i + np.arange(cols)[None, None, None, :]}
    for a in out.values():
        a.flags.writeable = False
    return out


@functools.lru_cache(maxsize=256)
def _heads(h0, h1):
    """The query heads h0 … h1 − 1 as (1, G, 1, 1), read-only."""
    h = np.arange(h0, h1)[None, :, None, None]
    h.flags.writeable = False
    return h


def _alibi(slopes, rows, cols, t):
    """slope·|i + Nk − Nq − j| over a block of each head's slope (G,), (G, rows, cols): a
    Toeplitz view (evaluate.toeplitz) of its rows + cols − 1 diagonals, |t + x − y|."""
    d = np.abs(t + rows - 1 - np.arange(rows + cols - 1)).astype(slopes.dtype)
    return toeplitz(slopes[:, None] * d, rows, cols)


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
        self.banded = causal or var.window is not None
        ranges = {"b": (var.batch0, var.batch0 + B - 1), "h": (0, Hq - 1),
                  "q_idx": (0, Nq - 1), "kv_idx": (var.kv0, var.kv0 + Nk - 1)}
        self.score_mod = None if var.score_mod is None else Bound(var.score_mod, acc_t, ranges)
        self.mask_mod = None if var.mask_mod is None else Bound(var.mask_mod, acc_t, ranges)
        # Without a block mask every tile may hold masked entries; with one, a step's
        # `pred` says so (block_mask_schedule).
        self.mask_every_tile = var.block_mask is None

    def heads(self, bh):
        """(batch index, slice of the G query heads) of K/V head bh."""
        b, hkv = divmod(bh, self.Hkv)
        return b, slice(hkv * self.G, (hkv + 1) * self.G)

    def rows_seeing(self, r0, br, c0, c1):
        """(lo, hi): rows r0 + lo … r0 + hi − 1 of a br-row block are those that see one
        of keys c0 … c1 − 1 by causal and window (alike for a run's shifted blocks)."""
        off = self.Nk - self.Nq
        return max(0, c0 - off - self.R - r0), min(br, c1 - off + self.L - r0)

    def indices(self, bh, a0, c0, shift, shape):
        """The mods' index arguments for `apply`'s n blocks, broadcastable to
        shape = (n, G, rows, cols): b, the query heads h, q_idx and kv_idx (and "heads",
        a key for b and h)."""
        b, hs = self.heads(bh)
        b += self.var.batch0
        return {"b": np.int64(b), "h": _heads(hs.start, hs.stop),
                "heads": (b, hs.start, hs.stop),   # their key for the evaluator's caches
                **_positions(a0, self.var.kv0 + c0, shift, *shape[:1], *shape[2:])}

    def apply(self, S, bh, a0, c0, pred, shift, reuse=False, prescaled=False):
        """S (n, G, rows, cols) = scale·Q Kᵀ of n blocks, block i at rows a0 + i·shift and
        keys c0 + i·shift → (the masked, biased score; tanh(S/softcap), the backward's
        softcap factor, or None; the score_mod's evaluation, for its gradients, or None).
        S is overwritten, unless a score_mod keeps it as its input; `reuse` and
        `prescaled` as in `values`."""
        index = self.shared_indices(bh, a0, c0, shift, S.shape)
        S, T, R = self.values(S, bh, a0, c0, shift, index=index, reuse=reuse,
                              prescaled=prescaled)
        self.hide(S, bh, a0, c0, pred, shift, index=index)
        return S, T, R

    def shared_indices(self, bh, a0, c0, shift, shape):
        """`indices` where both a score_mod and a mask_mod will read them (made once for
        `values` and `hide`), else None."""
        if self.score_mod is None or self.mask_mod is None:
            return None
        return self.indices(bh, a0, c0, shift, shape)

    def values(self, S, bh, a0, c0, shift, unit=1.0, over_softcap=False, index=None,
               reuse=False, prescaled=False, scale_out=1.0):
        """The chain up to the masks: score_mod, softcap, ALiBi and bias, in `unit`s of
        the natural one (log_b(e) for scores in base b; the score_mod's and the bias's
        only in natural units); with `over_softcap`, S is already scale·Q Kᵀ/softcap;
        `index`, the tile's `indices` if made already; with `reuse` (no gradients
        wanted), the score_mod may compute in place, S included, and with `prescaled` S is
        the score times the score_mod's `score_factor` (`Bound.evaluate`); the result
        times `scale_out` (with a score_mod that ends in a constant factor and nothing
        after it, one multiply for both). Returns (S, T, R) as `apply`."""
        var = self.var
        b, hs = self.heads(bh)
        n, _, rows, cols = S.shape
        T = R = None
        if self.score_mod is not None:                      # score_mod(score, b, h, i, j)
            index = index or self.indices(bh, a0, c0, shift, S.shape)
            R = self.score_mod.evaluate({**index, "score": S},
                                        tile=(a0 - c0 - self.var.kv0, rows, cols),
                                        reuse="score" if reuse else False,
                                        prescaled=prescaled)
            last = var.softcap is None and self.alibi is None and self.bias is None
            outer = self.score_mod.root_factor if scale_out != 1 and last else None
            node, score = self.score_mod.mod.expr if outer is None else outer[0], S
            S = R(node)
            R.vals.pop(id(node))                # the later steps write the tile in place
            mine = S.flags.owndata if S is not score else reuse   # the score: given up?
            if not (mine and S.shape == score.shape and S.dtype == self.acc_t
                    and S.flags.writeable):
                S = np.array(np.broadcast_to(S, score.shape), self.acc_t)
            if outer is not None:               # the mod's own factor and scale_out at once
                np.multiply(S, outer[1] * scale_out, out=S)
                scale_out = 1.0
        if var.softcap is not None:                          # softcap·tanh(s/softcap)
            T = np.tanh(S if over_softcap else np.multiply(S, 1.0 / var.softcap, out=S), out=S)
            S = np.multiply(T, var.softcap * unit, out=np.empty_like(T))
        t = a0 + self.Nk - self.Nq - c0  # key c0 + y sits t + x − y from row a0 + x's diagonal
        if self.alibi is not None:                           # − slope·|i + Nk − Nq − j|
            S -= _alibi((self.alibi[b, hs] * unit).astype(self.acc_t), rows, cols, t)
        if self.bias is not None:                            # + bias (natural units only)
            assert unit == 1, "a bias is added to natural scores"
            S += diagonal_windows(self.bias[b, hs, a0:, c0:], n, shift, rows, cols)
        if scale_out != 1:
            np.multiply(S, scale_out, out=S)
        return S, T, R

    def hide(self, S, bh, a0, c0, pred, shift, fill=NEG_INF, index=None):
        """S = fill where the masks hide a key: causal / window, mask, mask_mod (−inf on
        scores; 0 on probabilities); `index` as in `values`."""
        b, hs = self.heads(bh)
        n, _, rows, cols = S.shape
        if pred and self.banded:                             # causal / window
            hide_outside_band(S, a0 + self.Nk - self.Nq - c0, self.L, self.R, fill)
        if self.mask is not None:                            # / mask (True = may attend)
            _hide_where_not(S, diagonal_windows(self.mask[b, hs, a0:, c0:], n, shift, rows,
                                                cols), fill)
        if self.mask_mod is not None and (pred or self.mask_every_tile):   # / mask_mod
            _hide_where_not(S, self.mask_mod.value(index or self.indices(bh, a0, c0, shift,
                                                                         S.shape),
                                                   tile=(a0 - c0 - self.var.kv0, rows, cols)),
                            fill)

    def mod_gradients(self, R, dS, into):
        """dS with respect to the score_mod's input, of the blocks `values` evaluated the
        score_mod on (R, its evaluation); with `into` ({buffer name: accumulator}) the
        buffers' gradients added there too."""
        return self.score_mod.gradients(R.env, dS, into, evaluation=R)

    def keep(self, bh, a0, c0, n, shift, rows, cols):
        """keep/(1 − p) for the n blocks of `apply`, (n, G, rows, cols), or None without
        dropout."""
        if not self.var.dropout_p:
            return None
        b, hs = self.heads(bh)
        heads = np.arange(hs.start, hs.stop)
        keep = np.stack([_var.keep_tile(self.var.seed, self.threshold, b + self.var.batch0,
                                        heads, a0 + i * shift, a0 + i * shift + rows,
                                        c0 + i * shift, c0 + i * shift + cols)
                         for i in range(n)])
        return keep * self.acc_t.type(self.var.keep_scale)


def _tile_sizes(Nq, Nk, G, causal, window, *, outer="q"):
    """(Br rows per query head, Bc keys) of a score tile.

    Under a band (a window bounded on both sides, or on the left with causal) a tile is
    _BAND_BLOCK on the loop's own axis (rows of a Q tile, keys of a K/V tile) and, across,
    the whole span they reach (Br + L + R keys, Bc + L + R rows), one step, while a
    tile's G heads fit a run (_RUN_SCORES): the scores computed are the band's and a
    parallelogram's corners, (_BAND_BLOCK + L + R)/(L + R + 1) of the band, and the tiles
    between the sequence's ends run in batches (band.runs), which pay the fixed cost of
    a step once for many tiles. At N = 8192, window 256, d = 64 (2 shared cores, CPU
    time, medians of interleaved runs) the forward took 0.88× the time with 32 rows as
    with 16 (whose matmuls are slower per score), 0.97× as with 64, and 24 about the
    same; 64 was 3–7% faster at windows of 1024 and 2048. The backward's K/V tiles: 32
    keys took 0.72–0.87× the time of 16, 64 the same. Wider bands take _WINDOW_BLOCK
    steps across, so that few hidden scores are computed."""
    most = _FORWARD_ROWS if outer == "q" else _ROWS
    rows = max(1, min(Nq, most // G if G <= most else 1))
    keys = min(Nk, _KEYS)
    if window is not None and window[0] >= 0 and (window[1] >= 0 or causal):
        L, R = _bounds(Nq, Nk, causal, window)
        if G * _BAND_BLOCK * (_BAND_BLOCK + L + R) <= _RUN_SCORES:
            span = _BAND_BLOCK + L + R
            return ((min(Nq, _BAND_BLOCK), min(Nk, span)) if outer == "q"
                    else (min(Nq, span), min(Nk, _BAND_BLOCK)))
        rows, keys = min(rows, _WINDOW_BLOCK), min(keys, _WINDOW_BLOCK)
    return rows, keys


def _cost(task):
    """The scores a pool task (bh, batch of runs) computes."""
    return sum(n * rows * sum(c1 - c0 for c0, c1, _ in steps) for _, rows, n, steps in task[1])


# A pure function of its arguments, and calls of one shape repeat (layers, steps): made
# once per shape instead of a Python pass over every tile per call (~0.9 ms at N = 8192,
# window 256, 32-row tiles: 4% of the forward's CPU time).
@functools.lru_cache(maxsize=64)
def _task_batches(Nq, Nk, Br, Bc, G, causal, window, outer, budget):
    """The pool tasks of one K/V head: batches of runs of the variant schedule's tiles."""
    sched = variant_schedule(Nq, Nk, Br, Bc, causal=causal, window=window, outer=outer)
    return batches(runs(sched, G, budget), G, budget)


def forward(q, k, v, causal, scale, config, var):
    """o, lse for q (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) with the variants `var`."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, BH = Hq // Hkv, B * Hkv
    acc_t = accum_dtype(q.dtype)
    chain = ScoreChain(var, B, Hq, Hkv, Nq, Nk, causal, acc_t)
    Br, Bc = _tile_sizes(Nq, Nk, G, causal, var.window)
    # Few heads (one long sequence): shorter Q tiles, down to _ROWS, until each worker
    # gets one (causal, whose tiles differ: two); the biggest first (the bottom rows see
    # the most keys), so that the last to start are short.
    while Br > _ROWS // G and BH * -(-Nq // Br) < config.workers * (1 + causal):
        Br = max(_ROWS // G, Br // 2)
    o = np.empty((B, Hq, Nq, d), q.dtype)
    lse = np.empty((B, Hq, Nq), lse_dtype(q.dtype))
    tasks = sorted(_tasks(var, Nq, Nk, Br, Bc, G, Hkv, BH, causal, "q"), key=lambda t: -_cost(t))
    # scale = s_q·s_k, split so that neither s_q·Q nor Q Kᵀ overflows alone (split_scale).
    s_q, s_k = (acc_t.type(f) for f in split_scale(scale, acc_t))
    # The frozen reference (frozen_steps) but under dropout, whose ℓ is summed before
    # the mask: ℓ cannot come from P̃ [V_j | 1] there.
    frozen = config.frozen_max and not var.dropout_p
    base, sample = config.base, config.max_sample
    exp, lim, lim_e = base.exp, exp_limit(acc_t, base), exp_limit(acc_t, BASE_E)
    if frozen:
        # [s_k·K | 1] and [V | 1] once per call in the accumulation dtype (O(N·d), as the
        # plain forward's): every step's keys are then a view, not a copy.
        buf, (Kx, Vx) = CALL_BUFFERS.take(((BH, Nk, d + 1), acc_t), ((BH, Nk, d + 1), acc_t))
        k3, v3 = k.reshape(BH, Nk, d), v.reshape(BH, Nk, d)

        def prepare(heads):
            h0, h1 = heads
            with_ones(k3[h0:h1], Kx[h0:h1], s_k)
            with_ones(v3[h0:h1], Vx[h0:h1])

        run_tasks(prepare, head_ranges(BH, config.workers), config.workers)

    def run(task):
        bh, batch = task
        for r0, br, n, steps in batch:
            run_blocks(bh, r0, br, n, steps)

    def key_windows(x, keys, n, br, span, factor=1):
        """The n blocks' keys of x (K or V of one head) as (n, span, d) windows, in the
        accumulation dtype, times `factor` (a number or V's column shift)."""
        x = as_dtype(x[keys], acc_t)
        return windows(x if np.ndim(factor) == 0 and factor == 1 else x * factor,
                       n, br, span)

    def frozen_steps(q_i, bh, r0, br, n, steps):
        """(acc, ℓ, m) of the tile with the max frozen at a reference, as the plain
        forward's frozen_max_tile: per step Q Kᵀ, the chain's values, the exponential
        and P̃ [V_j | 1] (ℓ from the column of ones), the masks zeroing probabilities
        after the exponential; no max, rescale or row sum. A step past the first takes
        only the rows that see one of its keys (causal, N = 2048: 56% of the square).

        Scores are in the config's base b, except with a bias (natural units: the bias is
        read once, not scaled, and np.exp takes them) or a score_mod, whose input is the
        natural score (its result is brought into base b before the exponential).

        The reference m_i: under softcap (without a score_mod), whose scores lie within
        ±softcap, 0, with Q scaled by 1/softcap for the tanh; otherwise the larger of the
        row's max before and after the chain (ALiBi only lowers scores; a bias or score_mod
        may move them anywhere) over the first `max_sample` keys, folded into the matmul as
        in the plain forward ([c·Q_i | −m_i] [K_j | 1]ᵀ) — with a score_mod over the first
        step's keys, subtracted after the chain, or not at all where every |m_i| ≤
        _NEAR_ZERO. Exponents are clipped to ±lim, so a score more than ~44 above m_i shows
        as ℓ > 2^64, and every weight is at least b^-lim: ℓ = 0 only where the masks hide
        every key. None where a row ends with ℓ outside [2^-30, 2^64] (other than 0) or acc
        is not finite (scores far from the reference's, a NaN, a huge V): the caller runs
        the running max instead."""
        mod = chain.score_mod is not None
        capped = chain.var.softcap is not None and not mod
        # natural units under a score_mod (its input is) or a bias (read once, not scaled)
        natural = mod or chain.bias is not None
        unit = 1.0 if natural else base.log_e
        fold = not (mod or capped)
        # a score_mod that reads the score once, times a constant: Q takes the constant
        pre = chain.score_mod.score_factor[1] if mod and chain.score_mod.score_factor else 1.0
        Q = np.empty((n, G, br, d + fold), acc_t)
        np.multiply(q_i, s_q * acc_t.type(1 / chain.var.softcap if capped else unit * pre),
                    out=Q[..., :d])
        m_i = None                               # with a score_mod: from the first step
        if capped:
            m_i = np.zeros((n, G * br), acc_t)
        elif fold:                               # the first keys, the same for every block
            K0 = Kx[bh, None, :min(sample, Nk), :d]
            S0 = Q[..., :d] @ K0[:, None].transpose(0, 1, 3, 2)
            m_i = S0.max(axis=-1)
            for i in range(n):
                np.maximum(m_i[i], chain.values(S0[i:i + 1], bh, r0 + i * br, 0, br,
                                                unit=unit)[0].max(axis=-1)[0], out=m_i[i])
            Q[..., d] = -m_i
            m_i = m_i.reshape(n, G * br)
        accx = np.zeros((n, G, br, d + 1), acc_t)
        for c0, c1, pred in steps:
            span, keys = c1 - c0, slice(c0, c0 + (n - 1) * br + c1 - c0)  # the n blocks' keys
            K_j = windows(Kx[bh, keys, :d + fold], n, br, span)      # [K_j | 1] or K_j
            # only the rows that see one of the step's keys (past the first step, which
            # makes the reference): the rest of a diagonal step is all zeros after exp
            lo, hi = (0, br) if m_i is None else chain.rows_seeing(r0, br, c0, c1)
            rows = slice(lo, hi)
            if hi - lo == br:                                        # one product
                S = (Q.reshape(n, G * br, -1) @ K_j.transpose(0, 2, 1)).reshape(n, G, br, span)
            else:
                S = Q[:, :, rows] @ K_j[:, None].transpose(0, 1, 3, 2)
            a0 = r0 + lo
            index = chain.shared_indices(bh, a0, c0, br, S.shape)
            raw_max = S.max(axis=-1) * acc_t.type(base.log_e / pre) if m_i is None else None
            # a score_mod's result brought into the base here (its input is natural)
            S, _, _ = chain.values(S, bh, a0, c0, br, unit=unit, over_softcap=capped,
                                   index=index, reuse=True, prescaled=pre != 1.0,
                                   scale_out=base.log_e if mod else 1.0)
            if m_i is None:
                m_i = np.maximum(raw_max, S.max(axis=-1)).reshape(n, G * br)
                if np.abs(m_i).max() <= _NEAR_ZERO * base.log_e:   # e^S stays in range:
                    m_i[...] = 0                                      # no subtraction
            if mod and m_i.any():                # the reference, in the base's units
                np.subtract(S, m_i.reshape(n, G, br, 1)[:, :, rows], out=S)
            if natural and not mod:              # a bias's scores: np.exp, fast anywhere
                np.clip(S, -lim_e, lim_e, out=S)
                np.exp(S, out=S)                                     # P̃ = e^(S − m)
            else:
                np.clip(S, -lim, lim, out=S)
                exp(S, out=S)                                        # P̃ = b^(S_b − m_b)
            chain.hide(S, bh, a0, c0, pred, br, fill=0, index=index)
            V_j = windows(Vx[bh, keys], n, br, span)
            if hi - lo == br:                                        # acc += P̃ [V_j | 1]
                accx += (S.reshape(n, G * br, span) @ V_j).reshape(accx.shape)
            else:
                accx[:, :, rows] += S @ V_j[:, None]
            if reference_failed(accx[..., d]):
                return None
        accx = accx.reshape(n, G * br, d + 1)
        l_i = accx[..., d]
        if not reference_served(l_i[l_i > 0], accx):   # ℓ = 0: a row every key is hidden from
            return None
        return accx[..., :d], l_i, m_i if natural and not mod else m_i * acc_t.type(base.ln)

    def online_steps(Q, kh, vh, bh, r0, br, n, steps, shift):
        """(acc, ℓ, m) of the tile with FlashAttention-2's running max, in natural units."""
        m_i = l_i = acc = None
        for c0, c1, pred in steps:
            span, keys = c1 - c0, slice(c0, c0 + (n - 1) * br + c1 - c0)  # the n blocks' keys
            K_j = key_windows(kh, keys, n, br, span, s_k)
            V_j = key_windows(vh, keys, n, br, span, 1 if shift is None else shift)
            # -- compute qk, then the chain: S = softcap(scale·Q Kᵀ) + ALiBi + bias, masked
            S, _, _ = chain.apply((Q @ K_j.transpose(0, 2, 1)).reshape(n, G, br, span), bh,
                                  r0, c0, pred, br, reuse=True)
            S = S.reshape(n, G * br, span)
            # -- update m_i and l_i (the guard: −inf − (−inf) would be NaN)
            m_new = S.max(axis=-1) if m_i is None else np.maximum(m_i, S.max(axis=-1))
            m_safe = np.where(m_new == NEG_INF, 0, m_new).astype(acc_t, copy=False)
            P = np.exp(np.subtract(S, m_safe[..., None], out=S), out=S)  # P̃ = exp(S − m_i), in place
            l_step = P.sum(axis=-1)                                  # ℓ on the undropped P̃
            Z = chain.keep(bh, r0, c0, n, br, br, span)
            if Z is not None:
                P *= Z.reshape(P.shape)                              # dropout: P̃ ∘ keep/(1 − p)
            if m_i is None:                                          # first step: nothing to rescale
                l_i, acc = l_step, P @ V_j
            else:
                alpha = np.exp(m_i - m_safe)
                l_i = alpha * l_i + l_step
                acc = alpha[..., None] * acc + P @ V_j               # acc = α acc + P̃ V_j
            m_i = m_new
        return acc, l_i, m_i

    def run_blocks(bh, r0, br, n, steps, shift=None):
        """n blocks of br rows from row r0, block i shifted by i·br keys; V's columns
        scaled by `shift` (column_shift) where not None."""
        b, hs = chain.heads(bh)
        hkv = bh % Hkv
        r1 = r0 + n * br
        if not steps:                          # rows that see no key: o = 0, lse = −inf
            o[b, hs, r0:r1] = 0
            lse[b, hs, r0:r1] = NEG_INF
            return
        # Q (n, G·br, d): each block's G heads stacked, one matmul's rows.
        q_i = q[b, hs, r0:r1].reshape(G, n, br, d).transpose(1, 0, 2, 3)
        kh, vh = k[b, hkv], v[b, hkv]
        state = None
        if frozen and shift is None:
            state = frozen_steps(q_i, bh, r0, br, n, steps)
        if state is None:
            Q = np.empty((n, G, br, d), acc_t)
            np.multiply(q_i, s_q, out=Q)
            Q = Q.reshape(n, G * br, d)
            state = online_steps(Q, kh, vh, bh, r0, br, n, steps, shift)
        acc, l_i, m_i = state
        if shift is None and not math.isfinite(acc.sum()):
            # P̃ V overflowed where |V| nears the dtype's maximum: again with V's big
            # columns scaled down by powers of two, scaled back after the division by ℓ.
            shift = column_shift(as_dtype(vh, acc_t), Nk, acc_t)
            if shift is not None:
                return run_blocks(bh, r0, br, n, steps, shift)
        # -- finalize: O = acc / ℓ, lse = m + log ℓ (a row that saw no key: 0 and −inf)
        seen = l_i > 0
        l_div = np.where(seen, l_i, 1).astype(acc_t, copy=False)
        acc /= l_div[..., None]
        if shift is not None:
            acc /= shift
        o[b, hs, r0:r1] = acc.reshape(n, G, br, d).transpose(1, 0, 2, 3).reshape(G, n * br, d)
        L = np.where(seen, m_i + np.log(l_div), NEG_INF)
        L[np.isnan(l_i)] = np.nan
        lse[b, hs, r0:r1] = L.reshape(n, G, br).transpose(1, 0, 2).reshape(G, n * br)

    run_tasks(run, tasks, config.workers)
    if frozen:
        CALL_BUFFERS.give_back(buf)
    return o, lse


class Lane(NamedTuple):
    """A backward lane's accumulators: dq, dbias (its own or the shared one), and the
    scratch of a step's dQ before its blocks are added."""

    dq: np.ndarray
    dbias: Optional[np.ndarray]
    dQ: Scratch
    mods: Optional[dict]  # the score_mod's buffer gradients by name (float64), if wanted


def backward(do, q, k, v, o, lse, causal, scale, config, var, return_dbias,
             return_mod_grads=False):
    """dq, dk, dv (and dbias in the compact shape of var.bias, and the score_mod's buffer
    gradients as a dict) with the variants `var`.

        P = exp(S − lse),  Z = keep/(1 − p)
        dV_j += (P ∘ Z)ᵀ dO_i,  dP = (dO_i V_jᵀ) ∘ Z,  dS = P ∘ (dP − D_i)
        dbias += dS (summed over bias's broadcast axes)
        dS ← dS ∘ (1 − tanh²(s/softcap))
        dS ← ∂score_mod/∂score ∘ dS,  dbuffer += Σ dS ∂score_mod/∂buffer
        dQ_i += dS K_j · scale,  dK_j += dSᵀ Q_i · scale
    """
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G, BH = Hq // Hkv, B * Hkv
    acc_t = accum_dtype(q.dtype)
    chain = ScoreChain(var, B, Hq, Hkv, Nq, Nk, causal, acc_t)
    Br, Bc = _tile_sizes(Nq, Nk, G, causal, var.window, outer="k")
    # scale = s_q·s_k (split_scale); dQ and dK take back the other factor at the end.
    s_q, s_k = (acc_t.type(f) for f in split_scale(scale, acc_t))
    # D = rowsum(dO ∘ O) (dropout leaves it unchanged: rowsum(P ∘ dP) = rowsum(dO ∘ O)).
    D = np.einsum("bhnd,bhnd->bhn", as_dtype(do, acc_t), as_dtype(o, acc_t))
    # lse = −inf (the row sees no key): subtract +inf instead, so P = 0, not NaN.
    Ls = np.where(lse == NEG_INF, np.inf, lse).astype(acc_t, copy=False)
    dk = np.zeros((B, Hkv, Nk, d), k.dtype)
    dv = np.zeros((B, Hkv, Nk, d), v.dtype)
    tasks = _tasks(var, Nq, Nk, Br, Bc, G, Hkv, BH, causal, "k")
    factor = chain.score_mod.score_factor if chain.score_mod is not None else None
    pre = factor[1] if factor else 1.0
    # dbias sums over its broadcast axes; where such a sum crosses tasks (other batch
    # rows, other K/V heads, other key tiles) each lane keeps its own dbias, else the
    # tasks write disjoint entries of one.
    dbias, per_lane = None, False
    if return_dbias:
        bb, bhd, _, bk = var.bias.shape
        per_lane = bb < B or (bhd < Hq and Hkv > 1) or bk < Nk
        dbias = None if per_lane else np.zeros(var.bias.shape, acc_t)

    def add_dbias(dbias, dS, b, hs, a0, a1, c0, c1):
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
        target += red

    def run_lane(lane):
        # dQ (and a broadcast dbias) are summed across tasks: one accumulator per lane, its
        # tasks in a fixed order (pool.lanes), so every sum has one order.
        acc = Lane(np.zeros((B, Hq, Nq, d), acc_t),
                   np.zeros(var.bias.shape, acc_t) if per_lane else dbias,
                   Scratch(acc_t),
                   {name: np.zeros(var.score_mod.buffers[name].shape) for name in
                    var.score_mod.float_buffers()} if return_mod_grads else None)
        for bh, batch in lane:
            for c0, bc, n, steps in batch:
                run_blocks(acc, bh, c0, bc, n, steps)
        return acc

    def run_blocks(acc, bh, c0, bc, n, steps):
        """n K/V blocks of bc keys from key c0, block i shifted by i·bc rows."""
        if not steps:
            return
        b, hs = chain.heads(bh)
        hkv = bh % Hkv
        c1 = c0 + n * bc
        K_j = as_dtype(k[b, hkv, c0:c1], acc_t).reshape(n, 1, bc, d)
        if s_k != 1:
            K_j = K_j * s_k
        # a score_mod reading the score once times a constant takes it from the product
        # (its gradient carries the constant: no value of the score is read)
        K_s = K_j if pre == 1.0 else K_j * acc_t.type(pre)
        V_j = as_dtype(v[b, hkv, c0:c1], acc_t).reshape(n, 1, bc, d)
        dK_j = np.zeros((n, bc, d), acc_t)
        dV_j = np.zeros((n, bc, d), acc_t)
        for r0, r1, pred in steps:
            h, rows = r1 - r0, slice(r0, r0 + (n - 1) * bc + r1 - r0)   # the n blocks' rows
            Q_i = windows(np.multiply(q[b, hs, rows], s_q, dtype=acc_t), n, bc, h, axis=1)
            dO_i = windows(as_dtype(do[b, hs, rows], acc_t), n, bc, h, axis=1)  # (n, G, h, d)
            S, T, R = chain.apply(Q_i @ K_s.transpose(0, 1, 3, 2), bh, r0, c0, pred, bc,
                                  prescaled=pre != 1.0)
            Ls_i = windows(Ls[b, hs, rows], n, bc, h, axis=1)
            P = np.exp(np.subtract(S, Ls_i[..., None], out=S), out=S)  # P = exp(S − lse), in place
            Z = chain.keep(bh, r0, c0, n, bc, h, bc)
            Pd = P if Z is None else P * Z
            dV_j += (Pd.transpose(0, 1, 3, 2) @ dO_i).sum(axis=1)   # dV_j += (P ∘ Z)ᵀ dO_i
            dS = dO_i @ V_j.transpose(0, 1, 3, 2)                    # dP = dO_i V_jᵀ (∘ Z)
            if Z is not None:
                dS *= Z
            dS -= windows(D[b, hs, rows], n, bc, h, axis=1)[..., None]
            dS *= P                                                  # dS = P ∘ (dP − D)
            if acc.dbias is not None:
                for i in range(n):
                    add_dbias(acc.dbias, dS[i], b, hs, r0 + i * bc, r1 + i * bc, c0 + i * bc,
                              c0 + (i + 1) * bc)
            if T is not None:
                dS *= 1 - T * T                                      # through the softcap
            if R is not None:                                        # through the score_mod
                dS = chain.mod_gradients(R, dS, acc.mods)
            dK_j += (dS.transpose(0, 1, 3, 2) @ Q_i).sum(axis=1)    # dK_j += dSᵀ (s_q·Q_i)
            dQ = np.matmul(dS, K_j, out=acc.dQ.get(Q_i.shape))       # dQ_i += dS K_j
            for i in range(n):                                       # (the blocks' rows overlap)
                acc.dq[b, hs, r0 + i * bc:r1 + i * bc] += dQ[i]
        if s_k != 1:
            dK_j *= s_k
        dk[b, hkv, c0:c1] = dK_j.reshape(n * bc, d)
        dv[b, hkv, c0:c1] = dV_j.reshape(n * bc, d)

    parts = run_tasks(run_lane, lanes(tasks, config.workers, _cost), config.workers)
    dq = parts[0].dq
    if per_lane:
        dbias = parts[0].dbias
    mods = parts[0].mods
    for part in parts[1:]:                                           # in lane order
        dq += part.dq
        if per_lane:
            dbias += part.dbias
        for name, g in (part.mods or {}).items():
            mods[name] += g
    dq *= s_q                                                        # dQ = dS (s_k·K) · s_q
    out = (dq.astype(q.dtype, copy=False), dk, dv)
    if return_dbias:
        out += (dbias,)
    if return_mod_grads:
        out += ({name: g.astype(var.score_mod.buffers[name].dtype) for name, g in mods.items()},)
    return out
