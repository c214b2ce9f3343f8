"""Variable-length batches: B sequences packed along the row axis, no padding.

q is (Hq, total_q, d), k and v are (Hkv, total_k, d); sequence b is rows
cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v,
and attends only within its own pair of segments (causal and window bottom-right aligned
per sequence).

On the kernel backends the forward is one launch: each block finds its sequence from its
block index through cu_seqlens (kernels/seqlens.cuh); nothing is padded or copied and
the work is Σ_b Nq_b·Nk_b, not B·max². The NumPy backend, and the backward on every
backend, run each sequence as one call on views into the packed arrays.
"""
import numpy as np

from .. import _checks, _dtypes
from ..api import flash_attention, flash_attention_backward
from ..backends.kernel_forward import Segments
from ..variants import Variants
from . import _args

_LAYOUT_Q = "(Hq, total_q, d): heads first, sequences packed along the rows"
_LAYOUT_K = "(Hkv, total_k, d): heads first, sequences packed along the rows"


def _check_dropout(dropout_p):
    # The dropout mask is keyed by (seed, b, h, i, j) with b the sequence index; the
    # per-sequence calls (the backward, the NumPy backend) would all draw with b = 0, a
    # different mask from the one the varlen forward kernels draw. A clear error rather
    # than a silent other mask.
    if isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) \
            and dropout_p == 0:
        return
    raise ValueError(f"dropout_p={dropout_p!r}: dropout is not available in the varlen "
                     "functions yet (its mask is keyed by the sequence index b as the "
                     "batch index, which the per-sequence calls of the backward cannot "
                     "pass to the backend); use dropout_p=0.0, or flash_attention on a "
                     "padded batch")


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


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                           max_seqlen_k=None, causal=False, scale=None, window=None,
                           softcap=None, alibi_slopes=None, dropout_p=0.0, seed=None,
                           return_lse=False, backend="auto"):
    """Attention over a batch of B sequences of different lengths, packed without padding.

    q: (Hq, total_q, d); k, v: (Hkv, total_k, d); Hq a multiple of Hkv (GQA/MQA).
    cu_seqlens_q, cu_seqlens_k: int32 (B+1,), starting at 0, non-decreasing, ending at
    total_q (total_k): sequence b is rows cu[b]:cu[b+1] and attends only within its own
    pair of segments. Empty sequences are allowed (Nk_b = 0: output 0, lse −inf).
    max_seqlen_q/k, when given, must be at least the longest sequence.
    causal and window are bottom-right aligned per sequence; alibi_slopes is (Hq,) or
    (B, Hq). Returns o (Hq, total_q, d) in q's dtype, and with return_lse=True also lse
    (Hq, total_q) in the accumulation dtype.
    """
    return_lse = _checks.check_flag("return_lse", return_lse)
    _check_dropout(dropout_p)
    be, arrays, dtype, cq, ck, slopes = _prepare(
        {"q": q, "k": k, "v": v}, backend, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, alibi_slopes)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    xp = be.xp
    if be.name != "numpy" and q.shape[1] and k.shape[1]:  # kernels: one launch
        o, lse = _forward_kernels(be, q, k, v, cq, ck, arrays.get("alibi_slopes"),
                                  causal=causal, scale=_checks.check_scale(scale, q.shape[-1]),
                                  window=_checks.check_window(window),
                                  softcap=_checks.check_softcap(softcap))
        return (o, lse) if return_lse else o
    o = xp.empty(q.shape, dtype=dtype)
    lse = xp.empty(q.shape[:-1], dtype=_dtypes.lse_dtype(dtype))
    for b in range(cq.shape[0] - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.start == rq.stop:
            continue
        o_b, lse_b = flash_attention(q[:, rq], k[:, rk], v[:, rk], causal=causal,
                                     scale=scale, window=window, softcap=softcap,
                                     alibi_slopes=slopes[b], return_lse=True,
                                     backend=be.name)
        o[:, rq] = o_b
        lse[:, rq] = lse_b
    return (o, lse) if return_lse else o


def _forward_kernels(be, q, k, v, cq, ck, alibi_slopes, *, causal, scale, window, softcap):
    """The kernels' varlen launch: every sequence in one grid, each block finding its
    sequence from its batch index (kernels/seqlens.cuh)."""
    xp = be.xp
    hq = q.shape[0]
    alibi = None
    if alibi_slopes is not None:
        alibi = xp.ascontiguousarray(alibi_slopes.reshape(-1, hq),
                                     dtype=_dtypes.accum_dtype(q.dtype))
    var = Variants(window=window, softcap=softcap, alibi=alibi)
    nq, nk = np.diff(cq), np.diff(ck)
    segments = Segments(batch=len(nq), max_q=int(nq.max()), max_k=int(nk.max()),
                        cu_q=xp.asarray(cq, dtype=np.int32), cu_k=xp.asarray(ck, dtype=np.int32))
    o, lse = be.forward(q[None], k[None], v[None], causal=causal, scale=scale,
                        variants=None if var.is_plain() else var, segments=segments)
    return o[0], lse[0]


def flash_attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                                    max_seqlen_q=None, max_seqlen_k=None, causal=False,
                                    scale=None, window=None, softcap=None,
                                    alibi_slopes=None, dropout_p=0.0, seed=None,
                                    backend="auto"):
    """Gradients (dq, dk, dv) of flash_attention_varlen from its output gradient do.

    o and lse are what flash_attention_varlen(..., return_lse=True) returned; the options
    must be those of the forward. dq, dk, dv have the shapes and dtypes of q, k, v
    (under GQA dk and dv sum over the query heads of each group).
    """
    _check_dropout(dropout_p)
    be, arrays, dtype, cq, ck, slopes = _prepare(
        {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}, backend, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes)
    do, q, k, v, o, lse = (arrays[n] for n in ("do", "q", "k", "v", "o", "lse"))
    _checks.check_like("do", do, "q", q, dtype)
    _checks.check_like("o", o, "q", q, dtype)
    _checks.check_lse(lse, q)
    xp = be.xp
    dq = xp.zeros(q.shape, dtype=dtype)
    dk = xp.zeros(k.shape, dtype=dtype)
    dv = xp.zeros(v.shape, dtype=dtype)
    for b in range(cq.shape[0] - 1):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if rq.start == rq.stop or rk.start == rk.stop:
            continue  # no (query, key) pair: zero gradients
        dq[:, rq], dk[:, rk], dv[:, rk] = flash_attention_backward(
            do[:, rq], q[:, rq], k[:, rk], v[:, rk], o[:, rq], lse[:, rq], causal=causal,
            scale=scale, window=window, softcap=softcap, alibi_slopes=slopes[b],
            backend=be.name)
    return dq, dk, dv
