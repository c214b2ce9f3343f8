"""Attention on Dask arrays: chunks along batch, heads and queries map independently;
chunks along keys give partial (o, lse) that a tree of merge_states combines.

    import dask.array as da, cuflash.dask
    q = da.from_array(q_np, chunks=(1, 8, 1024, 64))
    k = da.from_array(k_np, chunks=(1, 8, 4096, 64))     # 4 key chunks: merged
    o = cuflash.dask.flash_attention(q, k, v, causal=True)   # lazy, q's chunks

Every task runs cuflash.flash_attention on one (query block, key chunk) pair with
return_lse, on whatever its chunks are (NumPy or CuPy arrays: backend="auto"), so no task
ever holds more than one chunk of each input, its outputs and the backend's own tiles:
never an N×N block. Causal masking stays bottom-right aligned to the whole (Nq, Nk)
problem: a block's rows are split into those that see none, some or all of the chunk's
keys, and the "some" rows run causal on the keys trimmed so that the block's own
bottom-right corner lies on the global diagonal. docs/dask.md has the rules.

Needs the `dask` extra (dask[array]; distributed for clusters).
"""
import itertools
import operator
import warnings

import numpy as np

try:
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as e:  # pragma: no cover - exercised only without dask
    raise ImportError("cuflash.dask needs Dask: pip install 'cuflash[dask]' "
                      f"(dask[array], distributed); importing it failed: {e}") from None

from . import _checks, _dtypes
from .api import flash_attention as _attention
from .api import flash_attention_backward as _attention_backward
from .merge import array_module, merge_states

__all__ = ["flash_attention", "flash_attention_backward"]

def _refuse(options):
    """ValueError naming the options in `options` (name -> value) that are set: those of
    cuflash.flash_attention(_backward) the chunks cannot take, since they would read or
    draw with chunk-local indices (a bias or mask of the whole problem, dropout's
    positions, a block mask's tiles) or return what no chunk holds (dbias, the mods'
    gradients)."""
    bad = [n for n, x in options.items()
           if x is not None and not (isinstance(x, (bool, int, float)) and x == 0)]
    if bad:
        raise ValueError(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not supported "
                         f"by cuflash.dask (the chunks would read or draw them with "
                         f"chunk-local indices, or return what no chunk holds); supported: "
                         f"causal, scale, softcap, allow_tf32, score_mod, mask_mod, and "
                         f"window, alibi_slopes with one query and one key chunk")


# -- checks -----------------------------------------------------------------------------

def _as_dask(name, x):
    if not isinstance(x, da.Array):
        raise TypeError(f"{name} must be a dask.array.Array (cuflash.flash_attention takes "
                        f"NumPy and CuPy arrays); got {_checks.describe(x)}")
    return x


def _shape_only(x):
    """A zero-byte NumPy stand-in with x's shape and dtype, for cuflash._checks."""
    return np.broadcast_to(np.empty((), dtype=x.dtype), x.shape)


def _one_chunk(name, x, axes, why):
    """x with each of `axes` in one chunk; warns when that needed a rechunk."""
    split = [a for a in axes if len(x.chunks[a]) > 1]
    if not split:
        return x
    warnings.warn(f"{name} is split along axis {split} ({why}); rechunked to one chunk "
                  f"there", stacklevel=3)
    return x.rechunk({a: -1 for a in split})


def _check_chunks(q, k, v):
    """The chunk rules (docs/dask.md): k and v alike; q, k, v alike along the batch axes;
    q's head chunks G times k's (G = Hq / Hkv, so a chunk of query heads has its K/V
    heads in the matching chunk of k)."""
    if k.chunks != v.chunks:
        raise ValueError(f"k and v must have the same chunks; got k {k.chunks}, v {v.chunks}")
    if q.chunks[:-3] != k.chunks[:-3]:
        raise ValueError(f"q, k and v must be chunked alike along the batch axes (all before "
                         f"the head axis -3); got q {q.chunks[:-3]}, k {k.chunks[:-3]}")
    g = q.shape[-3] // k.shape[-3]
    if q.chunks[-3] != tuple(g * c for c in k.chunks[-3]):
        raise ValueError(f"the head chunks of q must be those of k times Hq/Hkv = {g}, so "
                         f"that each chunk of query heads finds its K/V heads in one chunk; "
                         f"got q {q.chunks[-3]}, k {k.chunks[-3]}")


def _prepare(q, k, v, options):
    q, k, v = (_as_dask(n, x) for n, x in (("q", q), ("k", k), ("v", v)))
    dtype = _checks.check_same_dtype(q=q, k=k, v=v)
    batch, hq, hkv, nq, nk, d = _checks.check_attention_shapes(
        *(_shape_only(x) for x in (q, k, v)))
    squeeze = q.ndim == 2
    if squeeze:  # one head: give it a head axis
        q, k, v = q[None], k[None], v[None]
    positional = [n for n in ("window", "alibi_slopes") if options.get(n) is not None]
    if positional and (len(q.chunks[-2]) > 1 or len(k.chunks[-2]) > 1):
        raise ValueError(f"{', '.join(positional)} needs q in one chunk along the queries "
                         f"and k, v in one chunk along the keys (it depends on each query's "
                         f"and key's position); got query chunks {q.chunks[-2]}, key chunks "
                         f"{k.chunks[-2]}. Rechunk them, or chunk along batch and heads")
    q, k, v = (_one_chunk(n, x, [-1], "the head dim is never split")
               for n, x in (("q", q), ("k", k), ("v", v)))
    _check_chunks(q, k, v)
    scale = _checks.check_scale(options.get("scale"), d)
    return q, k, v, dtype, squeeze, scale


def _starts(chunks):
    return np.r_[0, np.cumsum(chunks)].astype(int)


def _alibi_block(slopes, starts, idx):
    """alibi_slopes (Hq,) or (*batch, Hq) sliced to the block idx (batch..., head)."""
    if slopes is None:
        return None
    slopes = np.asarray(slopes) if array_module(slopes) is np else slopes
    sl = tuple(slice(s[i], s[i + 1]) for s, i in zip(starts, idx))
    return slopes[sl[-1]] if slopes.ndim == 1 else slopes[sl[-slopes.ndim:]]


# -- the tasks ----------------------------------------------------------------------------

def _mods(score_mod, mask_mod, q):
    """{"score_mod", "mask_mod"}: translated (programmable.translate), for q with at most
    one batch axis (the mods' b is the flattened batch index: chunks of several batch
    axes are no range of it)."""
    if score_mod is None and mask_mod is None:
        return {}
    from . import programmable
    if q.ndim > 4:
        raise ValueError(f"score_mod and mask_mod need q with at most one batch axis in "
                         f"cuflash.dask (their b is the flattened batch index); got q of "
                         f"shape {q.shape}: reshape it to (B, H, Nq, d)")
    return {role: None if fn is None else programmable.translate(fn, role)
            for role, fn in (("score_mod", score_mod), ("mask_mod", mask_mod))}


def _mods_token(mods):
    """What of the mods names the graph: their trees and the captured arrays."""
    return [(m.key(), tokenize(*m.buffers.values())) for m in mods.values() if m is not None]


def _bh0(starts, bh):
    """The first batch row and query head of the block bh (chunk indices of q's batch and
    head axes, one or none batch axis)."""
    first = [int(s[i]) for s, i in zip(starts, bh)]
    return tuple([0] * (2 - len(first)) + first)


def _on_device(xp, opts):
    """The options with alibi_slopes moved to the chunks' device (a few numbers)."""
    if opts.get("alibi_slopes") is None or array_module(opts["alibi_slopes"]) is xp:
        return opts
    return dict(opts, alibi_slopes=xp.asarray(opts["alibi_slopes"]))


def _at(opts, bh0, q0, k0):
    """opts with its score_mod and mask_mod (translated Mods) for the part of the problem
    that starts at batch row and query head bh0, query q0 and key k0 (Mod.at)."""
    out = dict(opts)
    origin = np.array([*bh0, q0, k0], dtype=np.int64)   # one array for both mods
    for name in ("score_mod", "mask_mod"):
        if out.get(name) is not None:
            out[name] = out[name].at(origin)
    return out


def _partial(q, k, v, r0, c0, off, causal, opts, bh0=(0, 0)):
    """(o, lse) of query rows [r0, r0 + nq) over keys [c0, c0 + nk) of a problem whose key
    j is hidden from row i when causal and j > i + off; o in the accumulation dtype. Rows
    that see none of these keys get o = 0, lse = −inf. bh0: the block's first batch row
    and query head (the mods' b and h)."""
    xp = array_module(q)
    acc = _dtypes.accum_dtype(q.dtype)
    nq, nk = q.shape[-2], k.shape[-2]
    opts = _on_device(xp, opts)
    if not causal or c0 + nk == r0 + nq + off:
        # Not causal, or the block's bottom-right corner is on the diagonal: one call.
        o, lse = _attention(q, k, v, causal=causal, return_lse=True,
                            **_at(opts, bh0, r0, c0))
        return o.astype(acc, copy=False), lse
    o = xp.zeros(q.shape, dtype=acc)
    lse = xp.full(q.shape[:-1], -np.inf, dtype=acc)
    # Row r0 + t sees keys j <= r0 + t + off: none of the chunk for t < t_none, all of it
    # for t >= t_full, some in between.
    t_none = min(max(c0 - r0 - off, 0), nq)
    t_full = min(max(c0 + nk - 1 - r0 - off, t_none), nq)
    if t_full > t_none:
        # Trim the keys so that the block's bottom-right corner is on the diagonal:
        # its own causal mask is then the global one.
        e = t_full + r0 + off - c0
        o_p, lse_p = _attention(q[..., t_none:t_full, :], k[..., :e, :], v[..., :e, :],
                                causal=True, return_lse=True,
                                **_at(opts, bh0, r0 + t_none, c0))
        o[..., t_none:t_full, :], lse[..., t_none:t_full] = o_p, lse_p
    if nq > t_full:
        o_f, lse_f = _attention(q[..., t_full:, :], k, v, return_lse=True,
                                **_at(opts, bh0, r0 + t_full, c0))
        o[..., t_full:, :], lse[..., t_full:] = o_f, lse_f
    return o, lse


def _nothing(q):
    """The partial of a block that sees no key at all."""
    xp = array_module(q)
    acc = _dtypes.accum_dtype(q.dtype)
    return xp.zeros(q.shape, dtype=acc), xp.full(q.shape[:-1], -np.inf, dtype=acc)


def _merge(parts):
    """One node of the merge tree: partials over disjoint key chunks → one."""
    if len(parts) == 1:
        return parts[0]
    xp = array_module(parts[0][0])
    return merge_states(xp.stack([p[0] for p in parts]), xp.stack([p[1] for p in parts]))


def _output(part, dtype):
    return part[0].astype(dtype, copy=False)


def _tree(dsk, name, idx, keys, split_every, combine):
    """Reduce `keys` with `combine` (a function of a list) in a tree of fan-in
    split_every; returns the root's key."""
    level = 0
    while len(keys) > 1:
        nxt = []
        for g in range(0, len(keys), split_every):
            key = (f"{name}-{level}",) + idx + (g // split_every,)
            dsk[key] = (combine, keys[g:g + split_every])
            nxt.append(key)
        keys, level = nxt, level + 1
    return keys[0]


# -- the public functions -----------------------------------------------------------------

def flash_attention(q, k, v, *, causal=False, scale=None, return_lse=False,
                    algorithm="fa2", backend="auto", softcap=None, window=None,
                    alibi_slopes=None, allow_tf32=False, split_every=8, bias=None, mask=None,
                    dropout_p=0.0, seed=None, score_mod=None, mask_mod=None, block_mask=None):
    """cuflash.flash_attention on dask arrays (shapes and options as there), lazily.

    q (..., Nq, d), k and v (..., Nk, d) are dask arrays of NumPy or CuPy chunks. Chunks
    along batch and heads must line up between q, k and v (q's head chunks are Hq/Hkv
    times k's); q's query chunks and k's key chunks are free. Each (query block, key
    chunk) pair is one task; the partials of a query block are merged by a tree of
    merge_states with fan-in split_every. Returns o with q's chunks (and lse with
    q.chunks[:-1] when return_lse). window and alibi_slopes need one query and one key
    chunk; score_mod and mask_mod see the whole problem's b, h, q_idx, kv_idx (with at
    most one batch axis); bias, mask, dropout and block_mask are refused with a
    ValueError.
    """
    _refuse(dict(bias=bias, mask=mask, dropout_p=dropout_p, seed=seed, block_mask=block_mask))
    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    allow_tf32 = _checks.check_flag("allow_tf32", allow_tf32)
    _checks.check_algorithm(algorithm)
    split_every = int(split_every)
    if split_every < 2:
        raise ValueError(f"split_every must be >= 2; got {split_every}")
    q, k, v, dtype, squeeze, scale = _prepare(
        q, k, v, dict(scale=scale, window=window, alibi_slopes=alibi_slopes))
    mods = _mods(score_mod, mask_mod, q)
    acc = _dtypes.lse_dtype(dtype)
    nq, nk = q.shape[-2], k.shape[-2]
    off = nk - nq
    token = tokenize(q, k, v, causal, scale, algorithm, backend, softcap, window,
                     alibi_slopes, allow_tf32, split_every, _mods_token(mods))
    pname, mname = f"cuflash-attn-part-{token}", f"cuflash-attn-merge-{token}"
    oname, lname = f"cuflash-attn-o-{token}", f"cuflash-attn-lse-{token}"
    qs, ks = _starts(q.chunks[-2]), _starts(k.chunks[-2])
    starts = [_starts(c) for c in q.chunks[:-2]]
    dsk = {}
    for idx in itertools.product(*(range(len(c)) for c in q.chunks[:-1])):
        bh, qi = idx[:-1], idx[-1]
        r0, r1 = int(qs[qi]), int(qs[qi + 1])
        opts = dict(scale=scale, algorithm=algorithm, backend=backend, softcap=softcap,
                    window=window, alibi_slopes=_alibi_block(alibi_slopes, starts, bh),
                    allow_tf32=allow_tf32, **mods)
        parts = []
        for ki in range(len(ks) - 1):
            c0 = int(ks[ki])
            if causal and c0 > r1 - 1 + off:
                continue  # no row of this block sees a key of this chunk
            key = (pname,) + idx + (ki,)
            dsk[key] = (_partial, (q.name,) + idx + (0,), (k.name,) + bh + (ki, 0),
                        (v.name,) + bh + (ki, 0), r0, c0, off, causal, opts,
                        _bh0(starts, bh))
            parts.append(key)
        if not parts:
            parts = [(pname,) + idx + (-1,)]
            dsk[parts[0]] = (_nothing, (q.name,) + idx + (0,))
        root = _tree(dsk, mname, idx, parts, split_every, _merge)
        dsk[(oname,) + idx + (0,)] = (_output, root, dtype)
        dsk[(lname,) + idx] = (operator.getitem, root, 1)
    # One layer per output (each names its array), sharing the partial and merge tasks.
    def graph(name):
        return HighLevelGraph.from_collections(name, dsk, dependencies=[q, k, v])
    o = da.Array(graph(oname), oname, chunks=q.chunks,
                 meta=meta_from_array(q._meta, dtype=dtype))
    lse = da.Array(graph(lname), lname, chunks=q.chunks[:-1],
                   meta=meta_from_array(q._meta, ndim=q.ndim - 1, dtype=acc))
    if squeeze:
        o, lse = o[0], lse[0]
    return (o, lse) if return_lse else o


def _backward_block(do, q, k, v, o, lse, r0, off, causal, opts, bh0=(0, 0)):
    """(dq, dk, dv) of query rows [r0, r0 + nq) against all keys; dk, dv are this
    block's share, in the accumulation dtype, to be summed over the query blocks."""
    xp = array_module(q)
    acc = _dtypes.accum_dtype(q.dtype)
    nq, nk = q.shape[-2], k.shape[-2]
    opts = _on_device(xp, opts)
    dk = xp.zeros(k.shape, dtype=acc)
    dv = xp.zeros(v.shape, dtype=acc)
    # Causal: keys past the last row's diagonal are seen by no row of the block; dropping
    # them puts the block's bottom-right corner on the global diagonal.
    e = min(nk, max(0, r0 + nq + off)) if causal else nk
    if e == 0:
        return xp.zeros(q.shape, dtype=q.dtype), dk, dv
    dq, dk_e, dv_e = _attention_backward(do, q, k[..., :e, :], v[..., :e, :], o, lse,
                                         causal=causal, **_at(opts, bh0, r0, 0))
    dk[..., :e, :], dv[..., :e, :] = dk_e, dv_e
    return dq, dk, dv


def _sum(parts):
    """One node of the dk, dv tree: the shares of several query blocks, summed."""
    if len(parts) == 1:
        return parts[0]
    return (None, sum(p[1] for p in parts), sum(p[2] for p in parts))


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None,
                             backend="auto", softcap=None, window=None, alibi_slopes=None,
                             allow_tf32=False, split_every=8, bias=None, mask=None,
                             dropout_p=0.0, seed=None, return_dbias=False, score_mod=None,
                             mask_mod=None, block_mask=None, return_mod_grads=False):
    """cuflash.flash_attention_backward on dask arrays: (dq, dk, dv), lazily.

    Serves chunks along batch, heads and queries: each query block is one task against
    all keys, and the dk, dv shares of the query blocks are summed by a tree (fan-in
    split_every, in the accumulation dtype). k and v split along the keys are rechunked
    to one key chunk first, with a warning; dk and dv come back in k's chunks, dq in q's.
    """
    _refuse(dict(bias=bias, mask=mask, dropout_p=dropout_p, seed=seed,
                 return_dbias=return_dbias, block_mask=block_mask,
                 return_mod_grads=return_mod_grads))
    causal = _checks.check_flag("causal", causal)
    allow_tf32 = _checks.check_flag("allow_tf32", allow_tf32)
    split_every = int(split_every)
    if split_every < 2:
        raise ValueError(f"split_every must be >= 2; got {split_every}")
    k_chunks = _as_dask("k", k).chunks
    squeeze = _as_dask("q", q).ndim == 2
    if k.ndim >= 2 and len(k.chunks[-2]) > 1:
        k, v = (_one_chunk(n, x, [x.ndim - 2], "the backward takes keys in one chunk")
                for n, x in (("k", k), ("v", _as_dask("v", v))))
    q, k, v, dtype, _, scale = _prepare(
        q, k, v, dict(scale=scale, window=window, alibi_slopes=alibi_slopes))
    mods = _mods(score_mod, mask_mod, q)
    do, o, lse = (_as_dask(n, x) for n, x in (("do", do), ("o", o), ("lse", lse)))
    _checks.check_like("do", _shape_only(do), "q", _shape_only(q[0] if squeeze else q), dtype)
    _checks.check_like("o", _shape_only(o), "q", _shape_only(q[0] if squeeze else q), dtype)
    if squeeze:
        do, o, lse = do[None], o[None], lse[None]
    _checks.check_lse(_shape_only(lse), _shape_only(q))
    do, o = do.rechunk(q.chunks), o.rechunk(q.chunks)
    lse = lse.rechunk(q.chunks[:-1])
    nq, nk = q.shape[-2], k.shape[-2]
    off = nk - nq
    token = tokenize(do, q, k, v, o, lse, causal, scale, backend, softcap, window,
                     alibi_slopes, allow_tf32, split_every, _mods_token(mods))
    pname, sname = f"cuflash-bwd-part-{token}", f"cuflash-bwd-sum-{token}"
    dqname, dkname, dvname = (f"cuflash-bwd-{n}-{token}" for n in ("dq", "dk", "dv"))
    qs = _starts(q.chunks[-2])
    starts = [_starts(c) for c in q.chunks[:-2]]
    dsk = {}
    for bh in itertools.product(*(range(len(c)) for c in q.chunks[:-2])):
        opts = dict(scale=scale, backend=backend, softcap=softcap, window=window,
                    alibi_slopes=_alibi_block(alibi_slopes, starts, bh), allow_tf32=allow_tf32,
                    **mods)
        parts = []
        for qi in range(len(qs) - 1):
            idx = bh + (qi,)
            key = (pname,) + idx
            dsk[key] = (_backward_block, (do.name,) + idx + (0,), (q.name,) + idx + (0,),
                        (k.name,) + bh + (0, 0), (v.name,) + bh + (0, 0),
                        (o.name,) + idx + (0,), (lse.name,) + idx, int(qs[qi]), off,
                        causal, opts, _bh0(starts, bh))
            dsk[(dqname,) + idx + (0,)] = (operator.getitem, key, 0)
            parts.append(key)
        root = _tree(dsk, sname, bh, parts, split_every, _sum)
        for name, i in ((dkname, 1), (dvname, 2)):
            dsk[(name,) + bh + (0, 0)] = (_cast, root, i, dtype)
    def graph(name):
        return HighLevelGraph.from_collections(name, dsk, dependencies=[do, q, k, v, o, lse])
    meta = meta_from_array(q._meta, dtype=dtype)
    dq = da.Array(graph(dqname), dqname, chunks=q.chunks, meta=meta)
    dk = da.Array(graph(dkname), dkname, chunks=k.chunks, meta=meta)
    dv = da.Array(graph(dvname), dvname, chunks=v.chunks, meta=meta)
    if squeeze:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk.rechunk(k_chunks), dv.rechunk(k_chunks)


def _cast(part, i, dtype):
    return part[i].astype(dtype, copy=False)
