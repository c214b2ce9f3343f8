"""The FlashAttention-2 backward on the CUDA kernels of `cuflash/kernels/flash_bwd.cu`.

`backward(backend, do, q, k, v, o, lse, *, causal, scale)` runs three launches on the
backend's array module (CuPy on "cuda", NumPy on "emulator"):

1. `flash_bwd_preprocess_kernel`: D = rowsum(dO ∘ O), one warp per row;
2. `flash_bwd_dkdv_kernel`: one thread block per K/V block (Q tiles streamed), dK, dV;
3. `flash_bwd_dq_kernel`: one thread block per Q block (K/V tiles streamed), dQ.

No launch uses atomics, so results are bitwise reproducible.

The tile plan for each (dtype, head-dim bucket) is `plan()`; its shared-memory formula
mirrors the kernels' `__shared__` declarations (the one place it is written in Python).
`specializations()` lists every instantiation `backward` can launch, for the compile gate.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .. import _dtypes, compiler

SOURCE = "flash_bwd.cu"

# Head-dim buckets: a head dim d runs in the smallest bucket D >= d (columns d..D-1 are
# zero-padded in registers and shared memory, never read from or written to memory).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
MAX_HEAD_DIM = HEAD_DIM_BUCKETS[-1]

NWARPS = 8                  # 256 threads per block for the dK/dV and dQ kernels
PREPROCESS_ROWS = 4         # rows (warps) per block of the preprocess kernel
SMEM_TILE_BYTES = 32 * 1024  # per streamed operand pair: stays under the 48 KB static limit


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """Tiles of the dK/dV and dQ kernels for one element type and head-dim bucket.

    G lanes share one row (key or query), each holding DPL = D/G columns; every lane
    group owns `rows_per_group` rows, so a block owns `block_rows` = NWARPS·(32/G)·rpg
    rows (BC keys of the dK/dV kernel, BRQ queries of the dQ kernel); the operand that
    is streamed through shared memory comes in tiles of `tile_rows` rows (BR / BC).
    """
    c_type: str
    acc_bytes: int
    D: int
    G: int
    rows_per_group: int
    nwarps: int
    tile_rows: int

    @property
    def threads(self):
        return self.nwarps * 32

    @property
    def block_rows(self):
        return self.nwarps * (32 // self.G) * self.rows_per_group

    @property
    def dkdv_smem_bytes(self):
        # __shared__ Acc sQ[BR][D], sdO[BR][D], sL[BR], sD[BR];
        return (2 * self.tile_rows * self.D + 2 * self.tile_rows) * self.acc_bytes

    @property
    def dq_smem_bytes(self):
        # __shared__ Acc sK[BC][D], sV[BC][D];
        return 2 * self.tile_rows * self.D * self.acc_bytes

    def dkdv_name(self, causal):
        return (f"flash_bwd_dkdv_kernel<{self.c_type}, {self.D}, {self.G}, "
                f"{self.rows_per_group}, {self.nwarps}, {self.tile_rows}, "
                f"{'true' if causal else 'false'}>")

    def dq_name(self, causal):
        return (f"flash_bwd_dq_kernel<{self.c_type}, {self.D}, {self.G}, "
                f"{self.rows_per_group}, {self.nwarps}, {self.tile_rows}, "
                f"{'true' if causal else 'false'}>")


def head_dim_bucket(d: int) -> int:
    for D in HEAD_DIM_BUCKETS:
        if d <= D:
            return D
    raise ValueError(
        f"head dim d={d} is not supported by the CUDA backward kernels; they accept "
        f"1 <= d <= {MAX_HEAD_DIM} (use backend='numpy' for larger head dims)")


@functools.cache
def plan(dtype, D: int) -> BwdPlan:
    """The backward tile plan for element `dtype` and head-dim bucket `D`."""
    dtype = np.dtype(dtype)
    acc_bytes = _dtypes.accum_dtype(dtype).itemsize
    # Columns per lane: 8 float accumulators (4 doubles) keep the 4·KPG·DPL register
    # accumulators (K, V, dK, dV) near 64 words per thread.
    dpl = 8 if acc_bytes == 4 else 4
    G = max(1, min(32, D // dpl))
    # Two rows per lane group reuse each shared-memory read twice; the one case whose
    # DPL is forced up (double, D=256 → DPL 8) keeps one row to stay spill-free.
    rows_per_group = 1 if (acc_bytes == 8 and D // G > 4) else 2
    tile_rows = min(64, SMEM_TILE_BYTES // (2 * D * acc_bytes))
    return BwdPlan(_dtypes.c_type(dtype), acc_bytes, D, G, rows_per_group, NWARPS, tile_rows)


def preprocess_name(dtype) -> str:
    return f"flash_bwd_preprocess_kernel<{_dtypes.c_type(dtype)}>"


def specializations() -> dict:
    """Every backward kernel instantiation the library can launch: {filename: [names]}."""
    names = []
    for dtype in _dtypes.SUPPORTED:
        names.append(preprocess_name(dtype))
        for D in HEAD_DIM_BUCKETS:
            p = plan(dtype, D)
            for causal in (False, True):
                names.append(p.dkdv_name(causal))
                names.append(p.dq_name(causal))
    return {SOURCE: names}


# ── launching ────────────────────────────────────────────────────────────────────────

def _get_function(backend, name_expr):
    """The compiled kernel `name_expr` of flash_bwd.cu on `backend`: the backend's
    memoised accessor `get_function(source, name_expression)` (backends/kernels.py)."""
    return backend.get_function(SOURCE, name_expr)


def _kernel_layout(xp, a):
    """`a` itself when the kernels can read it in place (unit last-axis stride, no
    negative strides); a contiguous copy otherwise."""
    if (a.shape[-1] > 1 and a.strides[-1] != a.itemsize) or any(s < 0 for s in a.strides):
        return xp.ascontiguousarray(a)
    return a


_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535


def _check_launch(B, Hq, Hkv, Nq, Nk):
    for what, n in (("Nq", Nq), ("Nk", Nk), ("batch x heads x Nq", B * Hq * Nq)):
        if n > _INT32_MAX:
            raise ValueError(f"{what}={n} exceeds the backward kernels' 32-bit range "
                             f"(max {_INT32_MAX}); split the batch")
    for what, n in (("batch", B), ("query heads", Hq), ("key/value heads", Hkv)):
        if n > _GRID_YZ_MAX:
            raise ValueError(f"{what}={n} exceeds the backward kernels' grid limit "
                             f"({_GRID_YZ_MAX}); split that axis into several calls")


def _elem_strides(a):
    """int64 element strides of the first three axes of a 4-D array."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides[:3])


def backward(backend, do, q, k, v, o, lse, *, causal, scale):
    """dq, dk, dv of O = softmax(scale·Q Kᵀ) V, from the forward's o and lse.

    q, o, do: (B, Hq, Nq, d); k, v: (B, Hkv, Nk, d); lse: (B, Hq, Nq) in the
    accumulation dtype. Arrays of `backend.xp`, one supported dtype, any strides.
    Returns arrays of the input shapes and dtypes (dk, dv summed over GQA groups).
    """
    xp = backend.xp
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    dtype = q.dtype
    acc = _dtypes.accum_dtype(dtype)
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    D = head_dim_bucket(d)
    p = plan(dtype, D)
    _check_launch(B, Hq, Hkv, Nq, Nk)

    dq = xp.empty((B, Hq, Nq, d), dtype=dtype)
    dk = xp.empty((B, Hkv, Nk, d), dtype=dtype)
    dv = xp.empty((B, Hkv, Nk, d), dtype=dtype)
    if dq.size == 0 or dk.size == 0:
        if dq.size:
            dq[...] = 0
        if dk.size:
            dk[...] = 0
            dv[...] = 0
        return dq, dk, dv

    q, k, v, o, do = (_kernel_layout(xp, a) for a in (q, k, v, o, do))
    lse = xp.ascontiguousarray(lse, dtype=acc)
    Dvec = xp.empty((B, Hq, Nq), dtype=acc)
    acc_t = acc.type
    scale = acc_t(scale)
    sizes = (np.int32(Hq), np.int32(Hkv), np.int32(Nq), np.int32(Nk), np.int32(d))

    # 1. D = rowsum(dO ∘ O)
    rows = B * Hq * Nq
    f = _get_function(backend, preprocess_name(dtype))
    f((math.ceil(rows / PREPROCESS_ROWS),), (PREPROCESS_ROWS * 32,),
      (do, o, Dvec, np.int32(Hq), np.int32(Nq), np.int32(d), np.int64(rows),
       *_elem_strides(do), *_elem_strides(o)))

    strides_in = (*_elem_strides(q), *_elem_strides(k), *_elem_strides(v), *_elem_strides(do))

    # 2. dK, dV: one block per (K/V block, kv head, batch)
    f = _get_function(backend, p.dkdv_name(causal))
    f((math.ceil(Nk / p.block_rows), Hkv, B), (p.threads,),
      (q, k, v, do, lse, Dvec, dk, dv, *sizes, scale, *strides_in,
       *_elem_strides(dk), *_elem_strides(dv)))

    # 3. dQ: one block per (Q block, query head, batch)
    f = _get_function(backend, p.dq_name(causal))
    f((math.ceil(Nq / p.block_rows), Hq, B), (p.threads,),
      (q, k, v, do, lse, Dvec, dq, *sizes, scale, *strides_in, *_elem_strides(dq)))
    return dq, dk, dv
