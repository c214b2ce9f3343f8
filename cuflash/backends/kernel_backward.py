"""The FlashAttention-2 backward on the CUDA kernels of `cuflash/kernels/flash_bwd.cu`.

`backward(backend, do, q, k, v, o, lse, *, causal, scale)` runs three launches on the
backend's array module (CuPy on "cuda", NumPy on "emulator"):

1. `flash_bwd_preprocess_kernel`: D = rowsum(dO ∘ O), one warp per row;
2. `flash_bwd_dkdv_kernel`: one thread block per K/V block (Q tiles streamed), dK, dV;
3. `flash_bwd_dq_kernel`: one thread block per Q block (K/V tiles streamed), dQ.

Head dims above the largest bucket (d > 256) run the chunked specializations, one block
per (row block, 256-wide head-dim chunk); see flash_bwd.cu.
No launch uses atomics, so results are bitwise reproducible.

This module is the launch sequence only: the tile plans (`BwdPlan`, `plan_backward`, the
shared-memory formula, every specialization for the compile gate) are in
`cuflash/tiling.py`; argument marshalling (layouts, strides, range checks) is shared with
the forward in `backends/kernels.py`.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _dtypes, tiling
from .kernels import check_grid_yz, elem_strides, i32, prepare


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

    p_dkdv, p_dq = tiling.plan_backward(d, dtype)
    n_chunks = tiling.bwd_head_dim_chunks(d)
    # Range checks: 32-bit row indices and sizes; grid y/z carry heads and batch.
    i32(B * Hq * Nq, "batch x heads x Nq")
    for n, what in ((B, "batch"), (Hq, "query heads"), (Hkv, "key/value heads")):
        check_grid_yz(n, what)
    grid_kv = i32(math.ceil(Nk / p_dkdv.block_rows) * n_chunks, "dK/dV blocks per head")
    grid_q = i32(math.ceil(Nq / p_dq.block_rows) * n_chunks, "dQ blocks per head")

    q, k, v, o, do = (prepare(xp, a) for a in (q, k, v, o, do))
    lse = xp.ascontiguousarray(lse, dtype=acc)
    Dvec = xp.empty((B, Hq, Nq), dtype=acc)
    scale = acc.type(scale)
    sizes = (i32(Hq, "query heads"), i32(Hq // Hkv, "group"), i32(Nq, "Nq"), i32(Nk, "Nk"),
             i32(d, "d"))
    s3 = lambda a: elem_strides(a)[:3]  # noqa: E731  (batch, head, row) element strides

    # 1. D = rowsum(dO ∘ O)
    rows = B * Hq * Nq
    pre = tiling.bwd_preprocess_plan(dtype)
    f = backend.get_function(pre.source, pre.name_expression)
    f((math.ceil(rows / pre.rows_per_block),), (pre.num_threads,),
      (do, o, Dvec, sizes[0], sizes[2], sizes[4], np.int64(rows), *s3(do), *s3(o)))

    strides_in = (*s3(q), *s3(k), *s3(v), *s3(do))
    tail = (scale, np.int32(bool(causal)), np.int32(n_chunks))

    # 2. dK, dV: one block per (K/V block [x head-dim chunk], kv head, batch)
    f = backend.get_function(p_dkdv.source, p_dkdv.name_expression)
    f((grid_kv, Hkv, B), (p_dkdv.num_threads,),
      (q, k, v, do, lse, Dvec, dk, dv, *sizes, *strides_in, *s3(dk), *s3(dv), *tail))

    # 3. dQ: one block per (Q block [x head-dim chunk], query head, batch)
    f = backend.get_function(p_dq.source, p_dq.name_expression)
    f((grid_q, Hq, B), (p_dq.num_threads,),
      (q, k, v, do, lse, Dvec, dq, *sizes, *strides_in, *s3(dq), *tail))
    return dq, dk, dv
