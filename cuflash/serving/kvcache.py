"""Attention against a KV cache: decoding (Nq = 1), speculative decoding (a few rows),
contiguous or paged, with split-KV.

Layouts (docs/serving.md):
  contiguous  k_cache, v_cache (B, Hkv, Ncache, d); row b's keys are k_cache[b, :, :L_b].
  paged       k_cache, v_cache (num_blocks, Hkv, page_size, d) and block_table
              (B, max_pages), integers within int32: row b's key p lives in page
              block_table[b, p // page_size] at offset p % page_size. Pages may be
              shared between rows (read-only).

Row b attends to its first L_b = cache_seqlens[b] + Nnew keys, causal bottom-right.
New keys (k, v) are written into the cache in place first, after every argument has
been checked (a bad call changes nothing).

On the kernel backends a call is one launch: each block reads its row's cache length and,
when paged, its pages through block_table in place (page_size a multiple of the key
tile), and the launch splits the keys over blocks itself (split-KV, merged by lse:
kernels/seqlens.cuh). Elsewhere (the NumPy backend, smaller pages) row b's keys are cut
into up to num_splits contiguous chunks; each runs through the backend's attention with
return_lse on views of the cache (a paged chunk's pages gathered into one buffer first),
and merge_states combines them.
"""
import numpy as np

from .. import _checks, _dtypes
from ..api import flash_attention
from ..backends import kernel_forward
from ..backends.kernel_forward import Segments
from ..programmable import translate as _translate
from ..variants import Variants
from . import _args
from ..merge import merge_states
from ..plans.device import split_kv_calls


# -- split-KV: how many chunks, and where they start ----------------------------------

def parallel_units(be) -> int:
    """What split-KV fills: the SM count (cuda: the device's; emulator: the emulated
    GPU's, cuflash.emulator.gpu_limits), or the NumPy backend's worker threads."""
    if be.name == "numpy":
        return max(1, int(be.config.workers))
    return max(1, int(be.limits()["sm_count"]))


def split_points(L, nq, num_splits, *, causal, window, alibi, page_size=1):
    """Chunk boundaries [c0, c1, ..., L] of a row's keys [0, L).

    The last chunk ends at L, so it runs with every option as given (they are all
    bottom-right aligned to L). Every other chunk is placed where all nq query rows see
    all of its keys: before key L − nq + 1 (causal), from key L − nq − left on (window:
    keys left of that are seen by no row and are skipped). Such a chunk runs without
    causal or window; under ALiBi its scores differ from the true ones by a per-row
    constant, corrected in its lse (only for nq = 1). With window or ALiBi and nq > 1
    the keys are not split. Boundaries fall on page edges when paged.
    """
    left = window[0] if window is not None else -1
    lo = max(0, L - nq - left) if left >= 0 else 0
    if num_splits <= 1 or L - lo <= 1 or (nq > 1 and (left >= 0 or alibi)):
        return [lo, L]
    hi = L - nq + 1                                   # non-last chunks end at or before hi
    cuts = set()
    for t in range(1, num_splits):
        c = lo + round(t * (L - lo) / num_splits)
        c = (c // page_size) * page_size
        if lo < c <= hi and c < L:
            cuts.add(c)
    return [lo] + sorted(cuts) + [L]


# -- the kernels' launch: every row in one grid ------------------------------------------

def _attend_kernels(be, q, cache, lengths, slopes, *, causal, scale, window, softcap,
                    num_splits, mods):
    """Attention against the cache in one launch, or None where the kernels cannot read
    it in place (a page size that is not a multiple of the kernel's key tile). The kernels
    read row b's first lengths[b] keys, through block_table when paged
    (kernels/seqlens.cuh), and split the keys over blocks themselves (num_splits None:
    `tiling.split_kv_count`)."""
    xp = be.xp
    B, hq = q.shape[:2]
    alibi = None
    if slopes[0] is not None:
        alibi = xp.ascontiguousarray(xp.stack([xp.asarray(s) for s in slopes]),
                                     dtype=_dtypes.accum_dtype(q.dtype))
    var = Variants(window=window, softcap=softcap, alibi=alibi, score_mod=mods[0],
                   mask_mod=mods[1])
    var = None if var.is_plain() else var
    table = None
    if cache.paged:
        plan = kernel_forward.forward_plan(be, q, cache.k_cache, cache.v_cache)
        if cache.page % plan.block_n:
            return None
        table = xp.asarray(cache.table, dtype=np.int32)
    segments = Segments(batch=B, max_q=q.shape[2], max_k=int(lengths.max()),
                        used_k=xp.asarray(lengths, dtype=np.int32), block_table=table)
    return be.forward(q, cache.k_cache, cache.v_cache, causal=causal, scale=scale,
                      variants=var, segments=segments, num_splits=num_splits)


# -- the cache ----------------------------------------------------------------------------

class _Cache:
    """Where row b's keys live (contiguous or paged) and how to read a chunk of them."""

    def __init__(self, xp, k_cache, v_cache, block_table):
        self.xp, self.k_cache, self.v_cache = xp, k_cache, v_cache
        self.table = block_table                        # host int64 (B, max_pages) or None
        self.page = k_cache.shape[2] if block_table is not None else None

    @property
    def paged(self):
        return self.table is not None

    def capacity(self):
        if self.paged:
            return self.table.shape[1] * self.page
        return self.k_cache.shape[2]

    def slots(self, b, positions):
        """(page or row index, offset) of row b's key positions."""
        if self.paged:
            return self.table[b, positions // self.page], positions % self.page
        return np.full(positions.shape, b), positions

    def read(self, b, c0, c1):
        """Row b's keys [c0, c1) as (Hkv, c1 − c0, d) arrays: views when contiguous; the
        chunk's pages gathered into one buffer when paged."""
        if not self.paged:
            return self.k_cache[b, :, c0:c1], self.v_cache[b, :, c0:c1]
        p0, p1 = c0 // self.page, (c1 - 1) // self.page + 1
        pages = self.xp.asarray(self.table[b, p0:p1])
        out = []
        for cache in (self.k_cache, self.v_cache):
            g = cache[pages]                                  # (pages, Hkv, page, d)
            g = g.transpose(1, 0, 2, 3).reshape(cache.shape[1], -1, cache.shape[3])
            out.append(g[:, c0 - p0 * self.page:c1 - p0 * self.page])
        return out

    def write(self, starts, k, v):
        """k, v (B, Hkv, Nnew, d) into positions starts[b] … starts[b] + Nnew − 1."""
        B, _, nnew, _ = k.shape
        pos = starts[:, None] + np.arange(nnew)[None, :]          # (B, Nnew)
        rows, offs = self.slots(np.arange(B)[:, None], pos)
        rows, offs = (self.xp.asarray(a.reshape(-1)) for a in (rows, offs))
        for cache, new in ((self.k_cache, k), (self.v_cache, v)):
            # (B, Hkv, Nnew, d) → (B·Nnew, Hkv, d), the order of (rows, offs)
            cache[rows, :, offs] = new.transpose(0, 2, 1, 3).reshape(B * nnew, *new.shape[1::2])


def _check_writable(name, x):
    flags = getattr(x, "flags", None)
    if flags is not None and hasattr(flags, "writeable") and not flags.writeable:
        raise ValueError(f"{name} is read-only; new keys are written into the cache in "
                         f"place, so it must be writable")


def _check_cache_args(q, k_cache, v_cache, cache_seqlens, k, v, block_table):
    """Every check, before anything is written. Returns (_Cache pieces, seqlens, nnew)."""
    _args.check_ndim("q", q, 4, "(B, Hq, Nq, d)")
    paged = block_table is not None
    layout = "(num_blocks, Hkv, page_size, d)" if paged else "(B, Hkv, Ncache, d)"
    _args.check_ndim("k_cache", k_cache, 4, layout)
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape; got k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if (k is None) != (v is None):
        raise ValueError(f"k and v (the new keys and values) go together; got "
                         f"k {'None' if k is None else tuple(k.shape)}, "
                         f"v {'None' if v is None else tuple(v.shape)}")
    if k is not None:
        named.update(k=k, v=v)
    dtype = _checks.check_same_dtype(**named)
    B, hq, nq, d = q.shape
    hkv = k_cache.shape[1]
    if k_cache.shape[3] != d:
        raise ValueError(f"q and k_cache must have the same head dim (last axis); got "
                         f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the number of query heads (q.shape[1] = {hq}) must be a multiple "
                         f"of the number of key/value heads (k_cache.shape[1] = {hkv})")
    table = None
    if paged:
        table = _args.to_host_int("block_table", block_table, ndim=2)
        if table.shape[0] != B:
            raise ValueError(f"block_table must have one row per batch row of q (B = {B}); "
                             f"got block_table {table.shape}, q {tuple(q.shape)}")
    elif k_cache.shape[0] != B:
        raise ValueError(f"k_cache must have one row per batch row of q (B = {B}); got "
                         f"k_cache {tuple(k_cache.shape)}, q {tuple(q.shape)}")
    nnew = 0
    if k is not None:
        want = (B, hkv, None, d)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or any(w is not None and s != w for s, w in zip(x.shape, want)):
                raise ValueError(f"{name} must be (B, Hkv, Nnew, d) = ({B}, {hkv}, Nnew, "
                                 f"{d}) to match q {tuple(q.shape)} and k_cache "
                                 f"{tuple(k_cache.shape)}; got {tuple(x.shape)}")
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")
        nnew = k.shape[2]
        _check_writable("k_cache", k_cache)
        _check_writable("v_cache", v_cache)
    cap = table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("k and v (new keys) need cache_seqlens: the position each row "
                             "writes them at")
        seqlens = np.full(B, cap, np.int64)
    else:
        seqlens = _args.to_host_int_rows("cache_seqlens", cache_seqlens, rows=B)
        if seqlens.shape[0] != B:
            raise ValueError(f"cache_seqlens must have one entry per batch row (B = {B}); "
                             f"got shape {seqlens.shape}")
    if (seqlens < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0; got {seqlens.min()}")
    total = seqlens + nnew
    if (total > cap).any():
        b = int(np.argmax(total > cap))
        what = (f"max_pages · page_size = {table.shape[1]} · {k_cache.shape[2]}" if paged
                else f"Ncache = {cap}")
        raise ValueError(f"row {b}: cache_seqlens + Nnew = {seqlens[b]} + {nnew} = "
                         f"{total[b]} exceeds the cache capacity ({what})")
    if paged:
        nblocks, page = k_cache.shape[0], k_cache.shape[2]
        used = (np.arange(table.shape[1])[None, :] * page) < total[:, None]
        bad = used & ((table < 0) | (table >= nblocks))
        if bad.any():
            b, p = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"block_table[{b}, {p}] = {table[b, p]} is out of range: the "
                             f"cache has {nblocks} pages (k_cache.shape[0]); every page a "
                             f"row uses must be in [0, {nblocks})")
        if nnew:
            # A page that two rows use (a shared prefix) is read-only: an append into it
            # would change the other row's keys.
            rows, cols = np.nonzero(used)
            pairs = np.unique(np.stack([table[rows, cols], rows]), axis=1)
            shared = np.unique(pairs[0], return_counts=True)
            shared = set(shared[0][shared[1] > 1].tolist())
            pos = seqlens[:, None] + np.arange(nnew)[None, :]
            written = table[np.arange(B)[:, None], pos // page]
            hit = np.isin(written, list(shared))
            if hit.any():
                b, t = (int(i) for i in np.argwhere(hit)[0])
                raise ValueError(f"row {b} would write its new key {t} into page "
                                 f"{written[b, t]}, which another row also uses: pages "
                                 f"shared between rows are read-only (give each row its "
                                 f"own page for new keys)")
    return dtype, table, seqlens, nnew


def flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, *, k=None,
                                 v=None, block_table=None, causal=False, scale=None,
                                 window=None, softcap=None, alibi_slopes=None,
                                 num_splits=0, return_lse=False, backend="auto",
                                 score_mod=None, mask_mod=None):
    """Attention of new query rows against a KV cache, appending new keys first.

    q: (B, Hq, Nq, d) — Nq = 1 when decoding, a few for speculative decoding.
    k_cache, v_cache: (B, Hkv, Ncache, d), or paged (num_blocks, Hkv, page_size, d) with
    block_table (B, max_pages). cache_seqlens: an int, or (B,): the valid keys of each
    row (None: the whole capacity). Index arguments take any integer dtype (or lists)
    whose values fit in int32. k, v (B, Hkv, Nnew, d), when given, are written into
    the cache in place at positions cache_seqlens … + Nnew − 1 (the caller
    advances cache_seqlens). Row b then attends to its first cache_seqlens[b] + Nnew
    keys, causal bottom-right. num_splits: 0 picks the split-KV count from the device
    (SMs, or the NumPy backend's workers), 1 does not split, n > 1 forces n chunks.
    score_mod and mask_mod (docs/programmable.md) see b as the row, q_idx as the query's
    row in q and kv_idx as the key's position in the cache.
    Returns o (B, Hq, Nq, d) in q's dtype, and lse (B, Hq, Nq) with return_lse=True.
    """
    return_lse = _checks.check_flag("return_lse", return_lse)
    num_splits = _args.check_int("num_splits", num_splits, minimum=0)
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, x in (("k", k), ("v", v), ("alibi_slopes", alibi_slopes)):
        if x is not None:
            arrays[name] = x
    be, arrays = _args.resolve(backend, arrays)
    q, k_cache, v_cache = arrays["q"], arrays["k_cache"], arrays["v_cache"]
    k, v = arrays.get("k"), arrays.get("v")
    dtype, table, seqlens, nnew = _check_cache_args(q, k_cache, v_cache, cache_seqlens,
                                                    k, v, block_table)
    B, hq, nq, d = q.shape
    slopes = _args.check_alibi_rows(arrays.get("alibi_slopes"), B, hq)
    window = _checks.check_window(window)
    softcap = _checks.check_softcap(softcap)
    scale = _checks.check_scale(scale, d)
    mods = tuple(None if fn is None else _translate(fn, role)
                 for fn, role in ((score_mod, "score_mod"), (mask_mod, "mask_mod")))
    xp = be.xp
    cache = _Cache(xp, k_cache, v_cache, table)
    if nnew:
        cache.write(seqlens, k, v)                         # everything checked: append
    lengths = seqlens + nnew
    if be.name != "numpy" and B and hq and nq:
        out = _attend_kernels(be, q, cache, lengths, slopes, causal=causal, scale=scale,
                              window=window, softcap=softcap, num_splits=num_splits or None,
                              mods=mods)
        if out is not None:
            return out if return_lse else out[0]
        if mods != (None, None):
            raise ValueError(f"score_mod and mask_mod on backend={be.name!r} need the cache "
                             f"read in place: a page_size that is a multiple of the key "
                             f"tile; got page_size {cache.page}")
    if num_splits == 0:
        num_splits = split_kv_calls(parallel_units(be), B, hq, nq,
                                    int(lengths.max()) if B else 0)
    acc = _dtypes.lse_dtype(dtype)
    o = xp.empty(q.shape, dtype=dtype)
    lse = xp.empty(q.shape[:-1], dtype=acc)
    opts = dict(scale=scale, softcap=softcap, backend=be.name)

    def attend_mods(b, kb, vb, c0, **options):
        """One chunk through the backend with the mods, which see key c0 as kv_idx c0."""
        alibi = slopes[b]
        var = Variants(window=options.get("window"), softcap=softcap,
                       alibi=None if alibi is None else xp.ascontiguousarray(
                           xp.asarray(alibi)[None], dtype=acc),
                       batch0=b, kv0=c0, score_mod=mods[0], mask_mod=mods[1])
        o_s, lse_s = be.forward(q[b][None], kb[None], vb[None],
                                causal=options.get("causal", False), scale=scale, variants=var)
        return o_s[0], lse_s[0]

    def attend(b, kb, vb, c0, **options):
        if mods != (None, None):
            return attend_mods(b, kb, vb, c0, **options)
        return flash_attention(q[b], kb, vb, alibi_slopes=slopes[b], return_lse=True,
                               **options, **opts)

    for b in range(B):
        L = int(lengths[b])
        if L == 0:  # no key at all: the contract's fully masked rows
            o[b], lse[b] = 0, -np.inf
            continue
        cuts = split_points(L, nq, num_splits, causal=causal, window=window,
                            alibi=slopes[b] is not None, page_size=cache.page or 1)
        parts = []
        for s, (c0, c1) in enumerate(zip(cuts[:-1], cuts[1:])):
            kb, vb = cache.read(b, c0, c1)
            last = s == len(cuts) - 2
            if last:   # ends at L: every option, bottom-right aligned as given
                part = attend(b, kb, vb, c0, causal=causal, window=window)
            else:      # all rows see all of these keys (split_points)
                o_s, lse_s = attend(b, kb, vb, c0)
                if slopes[b] is not None:
                    # ALiBi is −slope·|i + Nk − Nq − j|: this chunk ends L − c1 keys
                    # before L, so every true score is slope·(L − c1) lower (nq = 1).
                    shift = xp.asarray(slopes[b], dtype=acc)[:, None] * (L - c1)
                    lse_s = lse_s - shift
                part = (o_s, lse_s)
            parts.append(part)
        if len(parts) == 1:
            o[b], lse[b] = parts[0]
        else:
            o[b], lse[b] = merge_states(xp.stack([p[0] for p in parts]),
                                        xp.stack([p[1] for p in parts]))
    return (o, lse) if return_lse else o

