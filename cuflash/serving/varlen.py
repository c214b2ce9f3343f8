"""Variable-length batches: B sequences packed along the row axis, no padding.

q is (Hq, total_q, d), k and v are (Hkv, total_k, d); sequence b is rows
cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v,
and attends only within its own pair of segments (causal and window bottom-right aligned
per sequence).

On the kernel backends the forward and the backward are one launch (of each kernel):
each block finds its sequence from its block index through cu_seqlens
(kernels/seqlens.cuh); nothing is padded or copied and the work is Σ_b Nq_b·Nk_b, not
B·max². The NumPy backend runs each sequence as one call on views into the packed
arrays.
"""
import numpy as np

from .. import _checks, _dtypes
from ..backends.kernel_forward import Segments
from ..variants import Variants
from . import _args

_LAYOUT_Q = "(Hq, total_q, d): heads first, sequences packed along the rows"
_LAYOUT_K = "(Hkv, total_k, d): heads first, sequences packed along the rows"


def _prepare(arrays, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             alibi_slopes):
    if alibi_slopes is not None:
        arrays["alibi_slopes"] = alibi_slopes
    be, arrays = _args.resolve(backend, arrays)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    _args.check_ndim("q", q, 3, _LAYOUT_Q)
    _args.check_ndim("k", k, 3, _LAYOUT_K)
    _args.check_ndim("v", v, 3, _LAYOUT_K)
    dtype = _checks.check_same_dtype(q=q, k=k, v=v)
    _, hq, hkv, total_q, total_k, d = _checks.check_attention_shapes(q, k, v)
    cq = _args.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
    ck = _args.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences; got shapes {cq.shape} and {ck.shape}")
    _args.check_max_seqlen("max_seqlen_q", max_seqlen_q, np.diff(cq))
    _args.check_max_seqlen("max_seqlen_k", max_seqlen_k, np.diff(ck))
    slopes = _args.check_alibi_rows(arrays.get("alibi_slopes"), cq.shape[0] - 1, hq)
    return be, arrays, dtype, cq, ck, slopes


def _variants(xp, dtype, slopes, *, window, softcap, dropout_p, seed, score_mod, mask_mod,
              b=None):
    """The checked options as backends take them: of sequence b alone (its ALiBi slopes,
    and b as dropout's and the mods' batch index), or of the whole batch (b None). None
    when plain."""
    acc = _dtypes.accum_dtype(dtype)
    rows = slopes if b is None else slopes[b:b + 1]
    alibi = None
    if rows[0] is not None:
        alibi = xp.ascontiguousarray(xp.stack([xp.asarray(r) for r in rows]), dtype=acc)
    var = Variants(window=window, softcap=softcap, alibi=alibi, dropout_p=dropout_p,
                   seed=seed, batch0=b or 0, score_mod=score_mod, mask_mod=mask_mod)
    return None if var.is_plain() else var


def _segments(xp, cq, ck):
    """The kernels' description of the packed sequences (kernels/seqlens.cuh)."""
    nq, nk = np.diff(cq), np.diff(ck)
    return Segments(batch=len(nq), max_q=int(nq.max()), max_k=int(nk.max()),
                    cu_q=xp.asarray(cq, dtype=np.int32), cu_k=xp.asarray(ck, dtype=np.int32))


def _check_options(scale, d, window, softcap, dropout_p, seed, score_mod, mask_mod):
    p, seed = _checks.check_dropout(dropout_p, seed)
    mods = {}
    for role, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None:
            from ..programmable import translate
            fn = translate(fn, role)
        mods[role] = fn
    return dict(scale=_checks.check_scale(scale, d), window=_checks.check_window(window),
                softcap=_checks.check_softcap(softcap), dropout_p=p, seed=seed, **mods)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, scale=None, window=None,
                           softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                           return_lse=False, backend="auto", score_mod=None, mask_mod=None):
    """Attention over a batch of B sequences of different lengths, packed without padding.

    q: (Hq, total_q, d); k, v: (Hkv, total_k, d); Hq a multiple of Hkv (GQA/MQA).
    cu_seqlens_q, cu_seqlens_k: (B+1,) integers (any integer dtype, or lists) within
    int32, starting at 0, non-decreasing, ending at total_q (total_k): sequence b is
    rows cu[b]:cu[b+1] and attends only within its own pair of segments. Empty
    sequences are allowed (Nk_b = 0: output 0, lse −inf).
    max_seqlen_q/k, when given, must be at least the longest sequence.
    causal and window are bottom-right aligned per sequence; alibi_slopes is (Hq,) or
    (B, Hq). score_mod and mask_mod (docs/programmable.md) see b as the sequence's index
    and q_idx, kv_idx as positions within it. Returns o (Hq, total_q, d) in q's dtype, and with return_lse=True also lse
    (Hq, total_q) in the accumulation dtype.
    """
    return_lse = _checks.check_flag("return_lse", return_lse)
    be, arrays, dtype, cq, ck, slopes = _prepare(
        {"q": q, "k": k, "v": v}, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, alibi_slopes)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    opts = _check_options(scale, q.shape[-1], window, softcap, dropout_p, seed, score_mod,
                          mask_mod)
    scale = opts.pop("scale")
    xp = be.xp
    if be.name != "numpy" and q.shape[1] and k.shape[1]:
        # the kernels: one launch, each block finding its sequence (seqlens.cuh)
        o, lse = be.forward(q[None], k[None], v[None], causal=causal, scale=scale,
                            variants=_variants(xp, dtype, slopes, **opts),
                            segments=_segments(xp, cq, ck))
        return (o[0], lse[0]) if return_lse else o[0]
    o = xp.zeros(q.shape, dtype=dtype)  # a sequence without keys: 0 and lse −inf
    lse = xp.full(q.shape[:-1], -np.inf, dtype=_dtypes.lse_dtype(dtype))
    for b in range(cq.shape[0] - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.start == rq.stop or rk.start == rk.stop:
            continue
        o_b, lse_b = be.forward(q[None, :, rq], k[None, :, rk], v[None, :, rk], causal=causal,
                                scale=scale, variants=_variants(xp, dtype, slopes, b=b, **opts))
        o[:, rq] = o_b[0]
        lse[:, rq] = lse_b[0]
    return (o, lse) if return_lse else o


def flash_attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                                    max_seqlen_q=None, max_seqlen_k=None, causal=False,
                                    scale=None, window=None, softcap=None,
                                    alibi_slopes=None, dropout_p=0.0, seed=None,
                                    backend="auto", score_mod=None, mask_mod=None):
    """Gradients (dq, dk, dv) of flash_attention_varlen from its output gradient do.

    o and lse are what flash_attention_varlen(..., return_lse=True) returned; the options
    must be those of the forward. dq, dk, dv have the shapes and dtypes of q, k, v
    (under GQA dk and dv sum over the query heads of each group).
    """
    be, arrays, dtype, cq, ck, slopes = _prepare(
        {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}, backend, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes)
    do, q, k, v, o, lse = (arrays[n] for n in ("do", "q", "k", "v", "o", "lse"))
    _checks.check_like("do", do, "q", q, dtype)
    _checks.check_like("o", o, "q", q, dtype)
    _checks.check_lse(lse, q)
    opts = _check_options(scale, q.shape[-1], window, softcap, dropout_p, seed, score_mod,
                          mask_mod)
    scale = opts.pop("scale")
    lse = lse.astype(_dtypes.lse_dtype(dtype), copy=False)
    xp = be.xp
    if be.name != "numpy" and q.shape[1] and k.shape[1]:
        # the kernels: one launch each, every block finding its sequence (seqlens.cuh)
        grads = be.backward(*(a[None] for a in (do, q, k, v, o, lse)), causal=causal,
                            scale=scale, variants=_variants(xp, dtype, slopes, **opts),
                            segments=_segments(xp, cq, ck))
        return tuple(g[0] for g in grads)
    dq = xp.zeros(q.shape, dtype=dtype)
    dk = xp.zeros(k.shape, dtype=dtype)
    dv = xp.zeros(v.shape, dtype=dtype)
    for b in range(cq.shape[0] - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.start == rq.stop or rk.start == rk.stop:
            continue  # no (query, key) pair: zero gradients
        grads = be.backward(do[None, :, rq], q[None, :, rq], k[None, :, rk], v[None, :, rk],
                            o[None, :, rq], lse[None, :, rq], causal=causal, scale=scale,
                            variants=_variants(xp, dtype, slopes, b=b, **opts))
        dq[:, rq], dk[:, rk], dv[:, rk] = (g[0] for g in grads)
    return dq, dk, dv
