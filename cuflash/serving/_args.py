"""Argument checks shared by the serving functions (varlen, KV cache).

Every message names the argument, says what came and what is accepted, as in
`cuflash._checks`. Index arrays (cu_seqlens, cache_seqlens, block_table) are read on
the host once: the per-sequence calls need their values to slice the packed arrays.
"""
import numbers

import numpy as np

from .. import _checks
from .._dispatch import bring, resolve_backend


def resolve(backend, arrays):
    """(backend object, the arrays as its array type), as the public functions do."""
    be = resolve_backend(backend, arrays)
    return be, dict(zip(arrays, bring(be, arrays)))


def to_host_int(name, x, *, ndim):
    """An int32 index array (NumPy or CuPy) as a host int64 array; TypeError otherwise."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an int32 array; got {_checks.describe(x)}")
    if np.dtype(x.dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32; got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(x.shape)}")
    host = x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)
    return host.astype(np.int64)


def check_cu_seqlens(name, cu, total):
    """cu_seqlens: int32 (B+1,), cu[0] = 0, non-decreasing, cu[-1] = total. Host int64."""
    c = to_host_int(name, cu, ndim=1)
    if c.shape[0] < 1:
        raise ValueError(f"{name} must have B+1 >= 1 entries (0, then each sequence's end); "
                         f"got shape {tuple(cu.shape)}")
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0; got {name}[0] = {c[0]}")
    steps = np.diff(c)
    if (steps < 0).any():
        b = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing; got {name}[{b}] = {c[b]} > "
                         f"{name}[{b + 1}] = {c[b + 1]}")
    if c[-1] != total:
        raise ValueError(f"{name}[-1] = {c[-1]} must equal the total number of rows of the "
                         f"packed array ({total})")
    return c


def check_max_seqlen(name, value, lengths):
    """None, or an int >= the longest sequence (it bounds the per-sequence lengths)."""
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or None; got {value!r}")
    longest = int(lengths.max()) if lengths.size else 0
    if int(value) < longest:
        raise ValueError(f"{name} = {value} is below the longest sequence ({longest})")


def check_int(name, value, *, minimum):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value!r}")
    return int(value)


def check_ndim(name, x, ndim, layout):
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}; got shape {tuple(x.shape)}")


def check_alibi_rows(alibi_slopes, B, hq):
    """alibi_slopes for B sequences: (Hq,) or (B, Hq); returns one (Hq,) slice per b."""
    if alibi_slopes is None:
        return [None] * B
    if not hasattr(alibi_slopes, "shape") or not hasattr(alibi_slopes, "dtype"):
        raise TypeError(f"alibi_slopes must be an array or None; got "
                        f"{_checks.describe(alibi_slopes)}")
    if np.dtype(alibi_slopes.dtype).kind not in "fiu":
        raise TypeError(f"alibi_slopes must be a real array; got dtype {alibi_slopes.dtype}")
    shape = tuple(alibi_slopes.shape)
    if shape == (hq,):
        return [alibi_slopes] * B
    if shape == (B, hq):
        return [alibi_slopes[b] for b in range(B)]
    raise ValueError(f"alibi_slopes must have shape ({hq},) or ({B}, {hq}) (one slope per "
                     f"query head, optionally per sequence); got {shape}")
