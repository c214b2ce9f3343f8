"""Argument checks for the public API.

Every message names the argument, says what came and what is accepted.
"""
import math
import numbers

import numpy as np

from . import _dtypes
from .families import FORWARD_ALGORITHMS

ALGORITHMS = tuple(FORWARD_ALGORITHMS)


def describe(x) -> str:
    """A short 'type shape dtype' description of an argument for error messages."""
    kind = f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    parts = [kind]
    if shape is not None:
        parts.append(f"shape {tuple(shape)}")
    if dtype is not None:
        parts.append(f"dtype {dtype}")
    return ", ".join(parts)


def check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {value!r}")
    return bool(value)


def check_algorithm(algorithm):
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; got {algorithm!r}")
    return algorithm


def check_scale(scale, d):
    """The softmax scale: 1/sqrt(d) by default, else any finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(d) if d > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale!r}")
    return scale


def check_dtype(name, x):
    """x's dtype must be one cuflash computes in."""
    dtype = np.dtype(x.dtype)
    if _dtypes.is_supported(dtype):
        return dtype
    if dtype.kind in "fc" or dtype.name == "bfloat16":
        raise TypeError(f"{name} has dtype {dtype}, which is not supported; "
                        f"accepted: {_dtypes.SUPPORTED_NAMES}")
    raise TypeError(f"{name} must be a floating-point array; got dtype {dtype} "
                    f"(accepted: {_dtypes.SUPPORTED_NAMES})")


def check_same_dtype(**arrays):
    dtypes = {name: check_dtype(name, x) for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"{', '.join(dtypes)} must share one dtype; got {listing}")
    return next(iter(dtypes.values()))


def check_attention_shapes(q, k, v):
    """Checks q (..., Nq, d), k and v (..., Nk, d); returns (batch, Hq, Hkv, Nq, Nk, d).

    batch is the tuple of leading axes before the head axis (-3).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., N, d); "
                             f"got shape {tuple(x.shape)}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError("q, k and v must have the same number of dimensions; got shapes "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape (..., Nk, d); "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head dim (last axis); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if d < 1:
        raise ValueError(f"the head dim (last axis of q, k, v) must be >= 1; got {d}")
    if q.ndim >= 3:
        hq, hkv = q.shape[-3], k.shape[-3]
        if tuple(q.shape[:-3]) != tuple(k.shape[:-3]):
            raise ValueError("the batch axes (all before the head axis -3) of q and k must "
                             f"match; got q {tuple(q.shape)}, k {tuple(k.shape)}")
        if hkv == 0 and hq != 0 or hkv != 0 and hq % hkv != 0:
            raise ValueError(f"the number of query heads (q.shape[-3] = {hq}) must be a "
                             f"multiple of the number of key/value heads (k.shape[-3] = "
                             f"{hkv}) for grouped-query attention")
        batch = tuple(q.shape[:-3])
    else:
        hq = hkv = 1
        batch = ()
    return batch, hq, hkv, q.shape[-2], k.shape[-2], d


def check_like(name, x, ref_name, ref, dtype):
    """Backward inputs that must match another argument's shape and dtype."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}; "
                         f"got {tuple(x.shape)}")
    got = check_dtype(name, x)
    if got != dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({dtype}); got {got}")


def check_lse(lse, q):
    want = tuple(q.shape[:-1])
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape q.shape[:-1] = {want} (one log-sum-exp per "
                         f"query row, as returned by flash_attention(..., return_lse=True)); "
                         f"got {tuple(lse.shape)}")
    if np.dtype(lse.dtype).kind != "f":
        raise TypeError(f"lse must be a floating-point array; got dtype {lse.dtype}")


def check_axis(axis, ndim):
    """None, or an int in [-ndim, ndim); returns the normalised axis."""
    if axis is None:
        return None
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int or None; got {axis!r}")
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of bounds for an array of {ndim} "
                         f"dimension(s); accepted: {-ndim} <= axis < {ndim}, or None")
    return axis % ndim


# -- attention variants (cuflash.variants) -----------------------------------------------

def is_int(x) -> bool:
    """An integer that is not a bool (True is an int to Python, never an index here)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def check_window(window):
    """None, or (left, right): two ints >= -1 (-1 = unbounded on that side)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2 \
            or not all(is_int(w) for w in window):
        raise TypeError(f"window must be None or a pair of ints (left, right); got {window!r}")
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window entries must be >= 0, or -1 for unbounded on that side; "
                         f"got {window!r}")
    return left, right


def check_softcap(softcap):
    """None, or a finite real number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number > 0 or None; got {softcap!r}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0; got {softcap!r}")
    return softcap


def check_dropout(dropout_p, seed):
    """dropout_p a real in [0, 1); seed None or an int in [0, 2^64). A dropout_p > 0
    needs a seed (the mask is a function of it). Returns (p, seed or 0)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number in [0, 1); got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    if seed is not None:
        if not is_int(seed):
            raise TypeError(f"seed must be an int >= 0 or None; got {seed!r}")
        if not 0 <= int(seed) < 2 ** 64:
            raise ValueError(f"seed must be an int in [0, 2**64); got {seed!r}")
    elif p > 0:
        raise ValueError(f"dropout_p={dropout_p!r} > 0 needs a seed (an int >= 0): the "
                         f"dropout mask is drawn from it, and the backward redraws it")
    return p, 0 if seed is None else int(seed)


def score_shape(q, nk):
    """The shape bias and mask broadcast to: q's batch axes and heads, then (Nq, Nk)."""
    return tuple(q.shape[:-1]) + (nk,)


def check_broadcastable(name, x, target):
    shape = tuple(x.shape)
    ok = len(shape) <= len(target) and all(
        a == 1 or a == b for a, b in zip(shape[::-1], target[::-1]))
    if not ok:
        raise ValueError(f"{name} of shape {shape} does not broadcast to the scores' shape "
                         f"{target} (q's batch axes and heads, then (Nq, Nk)); each axis "
                         f"must match or be 1")


def check_bias(bias, q, nk, dtype):
    """bias: a float array of q's dtype or float32, broadcastable to the scores' shape."""
    if not hasattr(bias, "shape") or not hasattr(bias, "dtype"):
        raise TypeError(f"bias must be an array or None; got {describe(bias)}")
    # the shape first: a bias of the wrong shape is wrong whatever its dtype
    check_broadcastable("bias", bias, score_shape(q, nk))
    got = np.dtype(bias.dtype)
    accepted = {np.dtype(dtype), np.dtype(np.float32)}
    if got not in accepted:
        names = " or ".join(sorted({str(d) for d in accepted}))
        raise TypeError(f"bias must have q's dtype or float32 ({names}); got dtype {got} "
                        f"(cast it: bias.astype(q.dtype))")


def check_mask(mask, q, nk):
    """mask: a bool array (True = may attend), broadcastable to the scores' shape."""
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise TypeError(f"mask must be a bool array or None; got {describe(mask)}")
    check_broadcastable("mask", mask, score_shape(q, nk))   # the shape first, as bias
    if np.dtype(mask.dtype) != np.bool_:
        raise TypeError(f"mask must be a bool array (True = may attend, as in PyTorch's "
                        f"scaled_dot_product_attention); got dtype {mask.dtype}. Use "
                        f"mask.astype(bool), or bias for additive masks")


def check_alibi(slopes, q, hq):
    """alibi_slopes: real, shape (Hq,) or (*batch, Hq) (q's batch axes, then heads)."""
    if not hasattr(slopes, "shape") or not hasattr(slopes, "dtype"):
        raise TypeError(f"alibi_slopes must be an array or None; got {describe(slopes)}")
    if np.dtype(slopes.dtype).kind not in "fiu":
        raise TypeError(f"alibi_slopes must be a real array; got dtype {slopes.dtype}")
    batch_heads = tuple(q.shape[:-2]) if q.ndim >= 3 else (1,)
    accepted = {(hq,), batch_heads}
    if tuple(slopes.shape) not in accepted:
        raise ValueError(f"alibi_slopes must have shape {' or '.join(map(str, sorted(accepted)))}"
                         f" (one slope per query head, optionally per batch); got "
                         f"{tuple(slopes.shape)}")


def check_return_dbias(return_dbias, bias):
    return_dbias = check_flag("return_dbias", return_dbias)
    if return_dbias and bias is None:
        raise ValueError("return_dbias=True needs a bias (dbias is the gradient of the bias "
                         "argument); got bias=None")
    return return_dbias
