"""The backward on the CUDA kernels of `flash_bwd.cu` (FlashAttention-2, Algorithm 2).

`backward(backend, do, q, k, v, o, lse, *, causal, scale)` runs three launches on the
backend's array module (CuPy on "cuda", NumPy on "emulator"):

1. `flash_bwd_preprocess_kernel`: D = rowsum(dO ∘ O), one warp per row;
2. `flash_bwd_dkdv_kernel`: one thread block per (K/V block, K/V head, batch), Q tiles
   streamed; dK, dV, summed over the query heads of the GQA group inside the block;
3. `flash_bwd_dq_kernel`: one thread block per (Q block, query head, batch), K/V tiles
   streamed; dQ.

Head dims above the largest bucket (d > 256) run the chunked specializations, one block
per (row block, 256-wide head-dim chunk). No launch uses atomics, so results are bitwise
reproducible. The tile plans come from `tiling.backward_path`; inputs are as
`cuflash.backends` describes them (checked and non-empty).

Where tensor cores apply (float16 on sm_75+, bfloat16 on sm_80+, d a multiple of 8 up to
128, 16-byte aligned q, k, v, dO, no dbias asked for), launches 2 and 3 are the
`flash_bwd_tc.cu` kernels instead (`flash_bwd_dkdv_tc_kernel`, `flash_bwd_dq_tc_kernel`:
the same grids, dynamic shared memory, no chunk argument); the preprocess is shared.

Attention variants run on every kernel (run-time arguments, `kernel_variants`). With
`return_dbias` (SIMT kernels only) the dQ kernel also writes dbias; where the bias is
broadcast over heads or batch its blocks loop over them (the grid's y or z shrinks to 1):
`dbias_launch`.
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes, tiling
from ..families import FLASH_BWD_DKDV_TC
from .kernel_forward import loads_16b_aligned
from .kernel_variants import dbias_launch, variant_args
from .marshal import check_grid_yz, elem_strides, i32, prepare


def backward(backend, do, q, k, v, o, lse, *, causal, scale, variants=None,
             return_dbias=False):
    """dq, dk, dv for q, o, do (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) and lse (B, Hq, Nq):
    the input shapes and dtypes, dk and dv summed over each GQA group. `variants`
    (cuflash.variants.Variants): the options; with `return_dbias` (SIMT) a fourth
    result, dbias in the compact 4-D shape of variants.bias and the accumulation dtype."""
    xp = backend.xp
    q, k, v, o, do = (prepare(xp, a) for a in (q, k, v, o, do))
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    acc = _dtypes.accum_dtype(q.dtype)
    (p_dkdv, p_dq), _why = tiling.backward_path(d, q.dtype, aligned=loads_16b_aligned(q, k, v, do),
                                                dbias=return_dbias, **backend.limits())
    tc = p_dkdv.kernel == FLASH_BWD_DKDV_TC.name  # tensor cores: d <= 128, one chunk
    pre = tiling.bwd_preprocess_plan(q.dtype)
    num_d_chunks = tiling.bwd_head_dim_chunks(d)
    lse = xp.ascontiguousarray(lse, dtype=acc)
    Dvec = xp.empty((B, Hq, Nq), dtype=acc)
    dq = xp.empty((B, Hq, Nq, d), dtype=q.dtype)
    dk = xp.empty((B, Hkv, Nk, d), dtype=q.dtype)
    dv = xp.empty((B, Hkv, Nk, d), dtype=q.dtype)

    # 32-bit row indices and sizes; the grid's y and z carry heads and batch.
    rows = i32(B * Hq * Nq, "batch x heads x Nq")
    for n, what in ((B, "batch"), (Hq, "query heads"), (Hkv, "key/value heads")):
        check_grid_yz(n, what)
    grid_kv = i32(-(-Nk // p_dkdv.block_rows) * num_d_chunks, "dK/dV blocks per head")
    grid_q = i32(-(-Nq // p_dq.block_rows) * num_d_chunks, "dQ blocks per head")
    sizes = (i32(Hq, "query heads"), i32(Hq // Hkv, "group"), i32(Nq, "Nq"), i32(Nk, "Nk"),
             i32(d, "d"))
    s3 = lambda a: elem_strides(a)[:3]  # noqa: E731  (batch, head, row) element strides
    strides_in = (*s3(q), *s3(k), *s3(v), *s3(do))
    # The kernels fold log2(e) into the scale themselves (common.cuh).
    flags = (acc.type(scale), np.int32(bool(causal)), np.int32(num_d_chunks))

    # Variants: the score chain's run-time arguments (every kernel), and dbias's launch
    # (SIMT only: the dQ blocks loop over the heads and batches sharing a bias row, see
    # flash_bwd.cu).
    heads_per_block = batch_per_block = 1
    vflags = variant_args(xp, variants, acc)
    dq_extra = ()
    if not tc:
        dbias, dbias_st, heads_per_block, batch_per_block = dbias_launch(
            xp, variants if return_dbias else None, acc, backend.name, B=B, Hq=Hq, Nq=Nq)
        dq_extra = (dbias, *dbias_st, np.int32(return_dbias), np.int32(heads_per_block),
                    np.int32(batch_per_block))

    # 1. D = rowsum(dO ∘ O)
    backend.get_function(pre)((-(-rows // pre.rows_per_block),), (pre.num_threads,),
                              (do, o, Dvec, sizes[0], sizes[2], sizes[4], np.int64(rows),
                               *s3(do), *s3(o)))
    # The tensor-core kernels take no chunk count, and their tiles are dynamic shared memory.
    kflags = flags[:2] if tc else flags
    # 2. dK, dV
    backend.get_function(p_dkdv)((grid_kv, Hkv, B), (p_dkdv.num_threads,),
                                 (q, k, v, do, lse, Dvec, dk, dv, *sizes, *strides_in,
                                  *s3(dk), *s3(dv), *kflags, *vflags),
                                 shared_mem=p_dkdv.smem_bytes if tc else 0)
    # 3. dQ
    backend.get_function(p_dq)((grid_q, Hq // heads_per_block, B // batch_per_block),
                               (p_dq.num_threads,),
                               (q, k, v, do, lse, Dvec, dq, *sizes, *strides_in, *s3(dq),
                                *kflags, *dq_extra, *vflags),
                               shared_mem=p_dq.smem_bytes if tc else 0)
    if return_dbias:
        return dq, dk, dv, dbias
    return dq, dk, dv
