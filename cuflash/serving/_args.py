"""Argument checks shared by the serving functions (varlen, KV cache).

Every message names the argument, says what came and what is accepted, as in
`cuflash._checks`. Index arrays (cu_seqlens, cache_seqlens, block_table) are read on
the host once: the per-sequence calls need their values to slice the packed arrays.
"""
import numpy as np

from .. import _checks
from .._dispatch import bring, resolve_backend


def resolve(backend, arrays):
    """(backend object, the arrays as its array type), as the public functions do."""
    be = resolve_backend(backend, arrays)
    return be, dict(zip(arrays, bring(be, arrays)))


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
_ACCEPTED = "an integer array (any integer dtype; NumPy, CuPy, or a list of ints)"


def to_host_int(name, x, *, ndim, accepted=_ACCEPTED):
    """An integer array-like whose values fit in int32 (the kernels' index type), as a
    host int64 array. Not integers: TypeError; a value outside int32: ValueError."""
    if hasattr(x, "__cuda_array_interface__"):          # CuPy, PyTorch, ...: read once
        import cupy
        host = cupy.asarray(x).get()
    else:
        try:
            host = np.asarray(x)
        except (TypeError, ValueError) as e:   # ragged lists, objects NumPy cannot take
            raise TypeError(f"{name} must be {accepted}; got {x!r:.80} ({e})") from None
    if host.size == 0 and not hasattr(x, "dtype"):
        host = host.astype(np.int64)                      # NumPy makes [] float64
    if host.dtype.kind in "iu":
        # compared in the array's own dtype: astype(int64) would wrap uint64 above 2^63
        bad = (host < INT32_MIN) | (host > INT32_MAX)
    elif host.dtype == object and all(_checks.is_int(e) for e in host.flat):
        # NumPy keeps ints beyond 64 bits as Python objects: integers, only too large
        bad = np.array([not INT32_MIN <= e <= INT32_MAX for e in host.flat],
                       dtype=bool).reshape(host.shape)
    else:
        got = _checks.describe(x) if hasattr(x, "dtype") else f"{x!r:.80}"
        raise TypeError(f"{name} must be {accepted}; got {got}")
    if host.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {host.shape}")
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{', '.join(map(str, at))}] = {host[at]} does not fit in "
                         f"int32: the values must be in [{INT32_MIN}, {INT32_MAX}]")
    return host.astype(np.int64)


def to_host_int_rows(name, x, *, rows):
    """One int per row: an int (or a 0-d integer array) for all `rows` rows, or an
    integer array-like of shape (rows,); checked as to_host_int."""
    if isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iu":
        x = x.item()
    if _checks.is_int(x):
        if not INT32_MIN <= x <= INT32_MAX:
            raise ValueError(f"{name} = {x} does not fit in int32: the values must be in "
                             f"[{INT32_MIN}, {INT32_MAX}]")
        x = [x] * rows
    return to_host_int(name, x, ndim=1, accepted=f"an int or {_ACCEPTED}")


def check_cu_seqlens(name, cu, total):
    """cu_seqlens: integers (B+1,) within int32, cu[0] = 0, non-decreasing, cu[-1] =
    total. Host int64."""
    c = to_host_int(name, cu, ndim=1)
    if c.shape[0] < 1:
        raise ValueError(f"{name} must have B+1 >= 1 entries (0, then each sequence's end); "
                         f"got shape {c.shape}")
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
    if not _checks.is_int(value):
        raise TypeError(f"{name} must be an int or None; got {value!r}")
    longest = int(lengths.max()) if lengths.size else 0
    if int(value) < longest:
        raise ValueError(f"{name} = {value} is below the longest sequence ({longest})")


def check_int(name, value, *, minimum):
    if not _checks.is_int(value):
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
