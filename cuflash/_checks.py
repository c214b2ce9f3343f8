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
