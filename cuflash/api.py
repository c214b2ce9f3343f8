"""The public functions: check the arguments, normalise shapes, pick a backend, dispatch.

Backends see only 4-D (B, H, N, d) inputs of one supported dtype with every size >= 1
(see `cuflash.backends`); everything about user-facing shapes, empty inputs, defaults
and error messages lives here.
"""
import math

import numpy as np

from . import _checks, _dtypes, variants as _variants
from ._dispatch import BACKENDS, bring, resolve_backend  # noqa: F401  (BACKENDS: the CLI's)


# -- shapes ----------------------------------------------------------------------------

def _as_4d(x, batch, heads):
    """(..., H, N, d) or (N, d) -> (B, H, N, d), a view where the strides allow."""
    return x.reshape((math.prod(batch), heads) + tuple(x.shape[-2:]))


def _compact4(xp, x, q, batch):
    """x (broadcastable to q's batch axes, heads, (Nq, Nk)) as a 4-D (B or 1, Hq or 1,
    Nq or 1, Nk or 1) array: a view of x wherever its strides allow, never expanded
    along heads, rows or keys. (Only a bias that is broadcast along some batch axes but
    not others, with two or more batch axes, is expanded along the batch axes.)"""
    nb = len(batch)
    full = nb + 3
    xs = x.reshape((1,) * (full - (x.ndim + (q.ndim == 2))) + tuple(x.shape))
    if q.ndim == 2:  # one head: no head axis in the user's shapes
        xs = xs.reshape((1,) * (full - xs.ndim) + tuple(xs.shape))
    bshape = tuple(xs.shape[:nb])
    if all(n == 1 for n in bshape):
        b_ax = 1
    else:
        if bshape != tuple(batch):
            xs = xp.broadcast_to(xs, tuple(batch) + tuple(xs.shape[nb:]))
        b_ax = math.prod(batch)
    return xs.reshape((b_ax,) + tuple(xs.shape[nb:]))


def _dbias_to_user(xp, d4, bias, batch, q):
    """dbias (the 4-D compact form of _compact4) in bias's shape and dtype: summed over
    the batch axes along which bias was broadcast."""
    nb = len(batch)
    rest = tuple(d4.shape[1:])
    lead = tuple(batch) if d4.shape[0] != 1 else (1,) * nb
    d = d4.reshape(lead + rest)
    bshape = (1,) * (nb + 3 - (bias.ndim + (q.ndim == 2))) + tuple(bias.shape)
    axes = tuple(i for i in range(nb) if bshape[i] == 1 and d.shape[i] != 1)
    if axes:
        d = d.sum(axis=axes, keepdims=True)
    return d.reshape(bias.shape).astype(bias.dtype, copy=False)


def _check_variants(q, nk, hq, dtype, *, window, softcap, alibi_slopes, bias, mask,
                    dropout_p, seed):
    """Every option checked before anything is computed; returns (window, softcap, p, seed)."""
    window = _checks.check_window(window)
    softcap = _checks.check_softcap(softcap)
    p, seed = _checks.check_dropout(dropout_p, seed)
    if alibi_slopes is not None:
        _checks.check_alibi(alibi_slopes, q, hq)
    if bias is not None:
        _checks.check_bias(bias, q, nk, dtype)
    if mask is not None:
        _checks.check_mask(mask, q, nk)
    return window, softcap, p, seed


def _make_variants(xp, q, batch, hq, dtype, window, softcap, p, seed, alibi_slopes, bias,
                   mask, mods=(None, None, None)):
    alibi = None
    if alibi_slopes is not None:
        acc = _dtypes.accum_dtype(dtype)
        a = alibi_slopes.reshape(-1, hq) if alibi_slopes.ndim > 1 else alibi_slopes[None]
        alibi = xp.ascontiguousarray(a, dtype=acc)  # (1 or B, Hq): tiny
    return _variants.Variants(
        window=window, softcap=softcap, alibi=alibi,
        bias=None if bias is None else _compact4(xp, bias, q, batch),
        mask=None if mask is None else _compact4(xp, mask, q, batch),
        dropout_p=p, seed=seed, score_mod=mods[0], mask_mod=mods[1], block_mask=mods[2])


def _mods(be, score_mod, mask_mod, block_mask, q, batch, hq, nk):
    """(score_mod, mask_mod, block_mask) translated and checked (cuflash.programmable):
    Mods, a BlockMask; the block mask's mask_mod is the call's."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return None, None, None
    from . import programmable
    sm = None if score_mod is None else programmable.translate(score_mod, "score_mod")
    mm = None if mask_mod is None else programmable.translate(mask_mod, "mask_mod")
    if block_mask is not None:
        if not isinstance(block_mask, programmable.BlockMask):
            raise TypeError(f"block_mask must be a cuflash.block_mask(...) result; got "
                            f"{type(block_mask).__name__}")
        if mm is not None and mm.key() != block_mask.mod.key():
            raise ValueError(f"mask_mod {mm.name} is not the mask_mod block_mask was made "
                             f"with ({block_mask.mod.name}); pass one of them")
        block_mask.check(math.prod(batch), hq, q.shape[-2], nk, _dtypes.accum_dtype(q.dtype))
        mm = block_mask.mod
    return sm, mm, block_mask


def _option_arrays(alibi_slopes, bias, mask):
    return {n: x for n, x in (("alibi_slopes", alibi_slopes), ("bias", bias), ("mask", mask))
            if x is not None}


# -- the public functions --------------------------------------------------------------

def flash_attention(q, k, v, *, causal=False, scale=None, return_lse=False,
                    algorithm="fa2", backend="auto", window=None, softcap=None,
                    alibi_slopes=None, bias=None, mask=None, dropout_p=0.0, seed=None,
                    allow_tf32=False, score_mod=None, mask_mod=None, block_mask=None):
    """Exact attention softmax(scale · Q Kᵀ) V without building the N×N score matrix.

    q: (..., Nq, d); k, v: (..., Nk, d). Leading axes are batch axes and must match,
    except the head axis -3, where q's head count may be a multiple of k's (GQA/MQA).
    causal masks key j for query i when j > i + (Nk - Nq) (bottom-right aligned);
    a query row that sees no key gets output 0 and lse -inf.
    Returns o with q's shape and dtype, and with return_lse=True also lse, the
    natural-log log-sum-exp of each row's scaled scores, shape (..., Nq), float32
    (float64 for float64 inputs).
    backend: "auto" ("cuda" for GPU arrays, else "numpy"), "numpy", "cuda", "emulator".

    Variants (docs/api.md; applied in this order): s = scale·q·kᵀ → softcap
    (softcap·tanh(s/softcap)) → + ALiBi (−slope·|i + Nk − Nq − j|) + bias → causal,
    window=(left, right) and the bool mask (True = may attend) → softmax → dropout
    (dropout_p, seed: Philox keyed by (seed, b, h, i, j)) → ·v. bias and mask broadcast
    to (..., Hq, Nq, Nk) and are never expanded in memory.

    allow_tf32: float32 inputs on tensor cores (sm_80+) take one tf32 mma per product
    (10-bit mantissas) instead of the default split tf32 (3 mma, about fp32 accuracy);
    no effect elsewhere (other dtypes, the SIMT kernels, the NumPy backend).

    Programmable attention (docs/programmable.md): score_mod(score, b, h, q_idx, kv_idx)
    → the new score, applied to scale·q·kᵀ before every other variant; mask_mod(b, h,
    q_idx, kv_idx) → True where the key may be attended (both compiled into the kernels
    too); block_mask (cuflash.block_mask) skips the tiles its mask_mod leaves empty and
    runs the full ones without it. b is the flattened batch index, h the query head.
    """
    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    allow_tf32 = _checks.check_flag("allow_tf32", allow_tf32)
    algorithm = _checks.check_algorithm(algorithm)
    options = _option_arrays(alibi_slopes, bias, mask)
    arrays = {"q": q, "k": k, "v": v, **options}
    be = resolve_backend(backend, arrays)
    q, k, v, *opt = bring(be, arrays)
    alibi_slopes, bias, mask = (dict(zip(options, opt)).get(n) for n in
                                ("alibi_slopes", "bias", "mask"))
    dtype = _checks.check_same_dtype(q=q, k=k, v=v)
    batch, hq, hkv, nq, nk, d = _checks.check_attention_shapes(q, k, v)
    scale = _checks.check_scale(scale, d)
    window, softcap, p, seed = _check_variants(
        q, nk, hq, dtype, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, dropout_p=dropout_p, seed=seed)
    mods = _mods(be, score_mod, mask_mod, block_mask, q, batch, hq, nk)
    xp = be.xp
    lse_dtype = _dtypes.lse_dtype(dtype)

    if math.prod(batch) == 0 or hq == 0 or nq == 0:
        o = xp.empty(q.shape, dtype=dtype)
        lse = xp.empty(q.shape[:-1], dtype=lse_dtype)
    elif nk == 0:  # no key at all: every row is fully masked
        o = xp.zeros(q.shape, dtype=dtype)
        lse = xp.full(q.shape[:-1], -np.inf, dtype=lse_dtype)
    else:
        var = _make_variants(xp, q, batch, hq, dtype, window, softcap, p, seed,
                             alibi_slopes, bias, mask, mods)
        extra = {} if var.is_plain() else {"variants": var}
        if allow_tf32:
            extra["allow_tf32"] = True
        o, lse = be.forward(_as_4d(q, batch, hq), _as_4d(k, batch, hkv),
                            _as_4d(v, batch, hkv), causal=causal, scale=scale,
                            algorithm=algorithm, **extra)
        o = o.reshape(q.shape)
        lse = lse.reshape(q.shape[:-1])
    return (o, lse) if return_lse else o


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None,
                             backend="auto", window=None, softcap=None, alibi_slopes=None,
                             bias=None, mask=None, dropout_p=0.0, seed=None,
                             return_dbias=False, allow_tf32=False, score_mod=None,
                             mask_mod=None, block_mask=None, return_mod_grads=False,
                             deterministic=True):
    """Gradients (dq, dk, dv) of attention from its output gradient do.

    o and lse are what flash_attention(q, k, v, return_lse=True) returned. dq, dk, dv
    have the shapes and dtypes of q, k, v; under GQA dk and dv sum over the query heads
    of each group. Rows whose lse is -inf (fully masked) contribute nothing.

    The variant options must be those the forward ran with (nothing can check that);
    dropout is redrawn from the seed. With return_dbias=True (needs bias) it returns
    (dq, dk, dv, dbias): dbias, in bias's shape and dtype, is the gradient with respect
    to the biased score, summed over bias's broadcast axes.

    allow_tf32: as in flash_attention, for the backward's products: float32 on tensor
    cores (sm_80+) takes one tf32 mma per product instead of split tf32's three.

    score_mod, mask_mod, block_mask: as in flash_attention, the forward's. With
    return_mod_grads=True it also returns, last, a dict of the gradients of the float
    arrays score_mod captures, keyed by the names it uses for them, in their dtypes.

    deterministic: True (the default) gives the same bits for the same inputs on the same
    device, every call. False lets the GPU kernels add dq's parts by float32 atomics from
    the dK/dV blocks, five GEMMs instead of seven, as FlashAttention-2 and -3 do: the
    mma.sync backward (16-bit, d <= 128, no option but causal and the window) from a block
    per key block, the Hopper backward (no dbias with a query axis) without its dQ pass;
    dq's last bits may then change from call to call. Elsewhere (the NumPy backend,
    the other kernels) no effect.
    """
    causal = _checks.check_flag("causal", causal)
    allow_tf32 = _checks.check_flag("allow_tf32", allow_tf32)
    deterministic = _checks.check_flag("deterministic", deterministic)
    return_dbias = _checks.check_return_dbias(return_dbias, bias)
    return_mod_grads = _checks.check_flag("return_mod_grads", return_mod_grads)
    options = _option_arrays(alibi_slopes, bias, mask)
    arrays = {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse, **options}
    be = resolve_backend(backend, arrays)
    do, q, k, v, o, lse, *opt = bring(be, arrays)
    alibi_slopes, bias, mask = (dict(zip(options, opt)).get(n) for n in
                                ("alibi_slopes", "bias", "mask"))
    dtype = _checks.check_same_dtype(q=q, k=k, v=v)
    batch, hq, hkv, nq, nk, d = _checks.check_attention_shapes(q, k, v)
    _checks.check_like("do", do, "q", q, dtype)
    _checks.check_like("o", o, "q", q, dtype)
    _checks.check_lse(lse, q)
    scale = _checks.check_scale(scale, d)
    window, softcap, p, seed = _check_variants(
        q, nk, hq, dtype, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
        bias=bias, mask=mask, dropout_p=dropout_p, seed=seed)
    mods = _mods(be, score_mod, mask_mod, block_mask, q, batch, hq, nk)
    if return_mod_grads and mods[0] is None:
        raise ValueError("return_mod_grads=True needs a score_mod (its captured float "
                         "arrays are what it differentiates); got score_mod=None")
    xp = be.xp

    if math.prod(batch) == 0 or hq == 0 or nq == 0 or nk == 0:
        # No (query, key) pair: every gradient is zero (or empty).
        grads = (xp.zeros(q.shape, dtype=dtype), xp.zeros(k.shape, dtype=dtype),
                 xp.zeros(v.shape, dtype=dtype))
        if return_dbias:
            grads += (xp.zeros(bias.shape, dtype=bias.dtype),)
        if return_mod_grads:
            grads += ({n: xp.zeros(a.shape, a.dtype) for n, a in mods[0].buffers.items()
                       if n in mods[0].float_buffers()},)
        return grads
    lse = lse.astype(_dtypes.lse_dtype(dtype), copy=False)
    var = _make_variants(xp, q, batch, hq, dtype, window, softcap, p, seed, alibi_slopes,
                         bias, mask, mods)
    extra = {} if var.is_plain() else {"variants": var}
    if return_dbias:
        extra["return_dbias"] = True
    if return_mod_grads:
        extra["return_mod_grads"] = True
    if allow_tf32:
        extra["allow_tf32"] = True
    if not deterministic:
        extra["deterministic"] = False
    out = be.backward(_as_4d(do, batch, hq), _as_4d(q, batch, hq),
                      _as_4d(k, batch, hkv), _as_4d(v, batch, hkv), _as_4d(o, batch, hq),
                      lse.reshape((math.prod(batch), hq, nq)),
                      causal=causal, scale=scale, **extra)
    dq, dk, dv = out[:3]
    grads = dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    if return_dbias:
        grads += (_dbias_to_user(xp, out[3], bias, batch, q),)
    if return_mod_grads:
        grads += (out[-1],)
    return grads


def online_softmax(x, axis=-1, *, backend="auto"):
    """softmax(x) along `axis`, equal to scipy.special.softmax(x, axis): `axis` is an int,
    a tuple of distinct ints (one softmax over those axes together) or None (over all
    elements).

    Computed in one pass with a running (max, sum) pair per line, then one normalising
    pass. Accumulates in float32 (float64 for float64); returns x's dtype.
    """
    be = resolve_backend(backend, {"x": x})
    (x,) = bring(be, {"x": x})
    dtype = _checks.check_dtype("x", x)
    if axis is None:
        axes = tuple(range(x.ndim))
    else:
        items = axis if isinstance(axis, tuple) else (axis,)
        if not all(isinstance(a, (int, np.integer)) and not isinstance(a, (bool, np.bool_))
                   for a in items):
            raise TypeError(f"axis must be an int, a tuple of ints or None; got {axis!r}")
        if x.ndim == 0 and items:
            raise ValueError(f"axis={axis!r} for a 0-d x: a 0-d array has no axis to "
                             "normalise over; pass axis=None (the softmax of one element, "
                             "1.0) or reshape x to at least 1-d")
        axes = tuple(_checks.check_axis(a, x.ndim) for a in items)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis {axis!r} names an axis twice; accepted: distinct axes "
                             f"of the {x.ndim}-d x")
    if x.size == 0:
        return be.xp.empty(x.shape, dtype=dtype)
    axes = tuple(sorted(axes))
    if axes and axes == tuple(range(axes[0], axes[-1] + 1)):
        # adjacent axes are the middle of (before, axes, after): a view where strides allow
        a, b = axes[0], axes[-1] + 1
        x3 = x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:b]),
                       math.prod(x.shape[b:]))
        return be.softmax(x3).reshape(x.shape)
    # scattered axes (or none): moved to the end, where they merge into one line (a copy)
    end = tuple(range(x.ndim - len(axes), x.ndim))
    xm = be.xp.moveaxis(x, axes, end)
    y = be.softmax(xm.reshape(-1, math.prod(xm.shape[x.ndim - len(axes):]), 1))
    return be.xp.moveaxis(y.reshape(xm.shape), end, axes)
