"""Kernel arguments from arrays: what every launch of the CUDA kernels shares.

Kernel parameters are device pointers (arrays), `int` sizes, `long long` element strides
and accumulation-type scalars; CuPy and the emulator both take NumPy scalars of the exact
C types (np.int32, np.int64, np.float32/np.float64).
"""
from __future__ import annotations

import numpy as np

_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535


def elem_strides(a) -> tuple[np.int64, ...]:
    """Element strides of every axis of `a`, as the kernels' `long long` parameters."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides)


def i32(n: int, what: str) -> np.int32:
    """`n` as a kernel `int` parameter; ValueError naming `what` when it does not fit."""
    if n > _INT32_MAX:
        raise ValueError(f"{what}={n} exceeds the kernels' 32-bit index range (max {_INT32_MAX})")
    return np.int32(n)


def check_grid_yz(n: int, what: str) -> None:
    """A grid's y or z extent (at most 65535 blocks): say which axis to split."""
    if n > _GRID_YZ_MAX:
        raise ValueError(f"{what}={n} exceeds the kernels' grid limit ({_GRID_YZ_MAX}); "
                         f"split that axis into several calls")


def prepare(xp, a):
    """`a` itself when the kernels can read it in place (unit last-axis stride, no
    negative strides); a contiguous copy otherwise."""
    st = a.strides
    if (a.shape[-1] > 1 and st[-1] != a.itemsize) or any(s < 0 for s in st):
        return xp.ascontiguousarray(a)
    return a
