"""The Hopper backward (kernels/flash_bwd_sm90.cu, sm_90a): its inputs, tensor maps and
launches.

The kernels take float16 or bfloat16, head dim 64 or 128, q, k, v, dO with strides TMA can
read (`kernel_forward_sm90.tma_ready`), causal or not, every attention variant and dbias,
GQA/MQA, packed sequences; lse and D = rowsum(dO ∘ O)
(flash_bwd.cu's preprocess) in float32. `backward_sm90` runs the dK/dV pass, then the dQ
pass, or the 5-GEMM pair (the dK/dV pass adding dQ's parts into float32 partials, then their
sum), on any backend whose device is sm_90a (the emulator's sm_90a, or an H100);
`kernel_backward.backward` runs them for the plain calls `tiling.backward_path` gives them.
"""
from __future__ import annotations

import numpy as np

from .. import tiling
from .kernel_variants import dbias_from_cols, dbias_launch, variant_args
from .kernel_forward_sm90 import (HEAD_DIMS, TENSOR_MAP_TYPES, address, check_inputs,
                                  check_launch, tensor_map_4d, tma_strides)


def five_gemm_pair(backend, plans, *, units, Nk, deterministic=True, dq_workers=None):
    """(plans, W): the 5-GEMM pair (`tiling.sm90_dq_parts_plans`) and its workers W per
    (batch, K/V head) for `units` (batch × K/V heads) over Nk keys where it runs, else
    `plans` (the dK/dV and dQ passes) and 0. `deterministic=False`: a worker per key block;
    `dq_workers`: W (0: the two passes), None: `tiling.dq_workers`' count for the Hopper
    tile cost and its partials' memory (two warpgroup partials per worker, at most
    DQ_PARTS_MAX in all)."""
    fused = tiling.sm90_dq_parts_plans(plans[0].dtype, plans[0].head_dim)
    key_blocks = -(-Nk // plans[0].own_rows)
    if fused is None or dq_workers == 0:
        return plans, 0
    if not deterministic:
        workers = key_blocks
    elif dq_workers is not None:
        workers = min(dq_workers, key_blocks)
    else:
        workers = tiling.dq_workers(units, key_blocks, backend.limits()["sm_count"],
                                    tile_cost=tiling.SM90_DQ_PARTS_TILE_COST,
                                    most=tiling.DQ_PARTS_MAX // 2,
                                    partial_tiles=tiling.SM90_PARTIAL_TILES,
                                    partials_per_worker=2)
    return (fused, workers) if workers else (plans, 0)


def backward_sm90(backend, do, q, k, v, lse, Dvec, *, causal: bool, scale: float, variants=None,
                  return_dbias=False, segments=None, plans=None, deterministic=True,
                  dq_workers=None):
    """(dq, dk, dv) of attention on `backend`'s sm_90a device: dk = scale · dSᵀ Q and
    dv = Pᵀ dO summed over each K/V head's query heads (flash_bwd_dkdv_sm90_kernel), dq =
    scale · dS K (flash_bwd_dq_sm90_kernel). `variants` (cuflash.variants.Variants): the
    forward's options, None for none; with `return_dbias` a fourth result, dbias in the
    compact shape of variants.bias in float32 (`kernel_variants.dbias_launch`).
    `segments` (kernel_forward.Segments, cu_q and cu_k only): packed sequences, q, do
    (1, Hq, total_q, d), k, v (1, Hkv, total_k, d), lse and D (1, Hq, total_q). `plans`: the
    planner's (dK/dV, dQ) pair for these inputs (None: `tiling.sm90_bwd_plans`').

    Five GEMMs instead of seven (`tiling.sm90_dq_parts_plans`; padded rows, no dbias with a
    query axis, which the dQ pass writes): the dK/dV pass's W blocks per (batch, K/V head)
    each walk key blocks w, w + W, .. and each warpgroup adds dQ's parts by bulk reduce-adds
    into a float32 partial of its own, a key block's adds complete before the next's; then
    flash_bwd_dq_sum_sm90 adds the 2W partials in order: bitwise reproducible for the same
    W. `dq_workers`: W (None: `tiling.dq_workers`' count for the Hopper tile cost; 0: the
    dQ pass). `deterministic=False`: a block per key block, all adding into one partial
    in whatever order they run; dq's last bits may vary from call to call."""
    dims = {t: HEAD_DIMS for t in tiling.SM90_DTYPES}
    check_inputs(q, k, v, head_dims=dims, what="backward")
    check_inputs(do, k, v, head_dims=dims, what="backward")
    if tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do: expected q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    check_launch(backend, scale, "backward")
    xp = backend.xp
    p_dkdv, p_dq = plans or tiling.sm90_bwd_plans(np.dtype(q.dtype).name, q.shape[-1])
    (_, Hq, rows_q, _), Hkv, rows_k = q.shape, k.shape[1], k.shape[2]
    B, Nq, Nk = ((q.shape[0], rows_q, rows_k) if segments is None else
                 (segments.batch, segments.max_q, segments.max_k))
    for n, what in ((B * Hkv, "k: B·Hkv"), (Hq, "q: Hq"), (B, "batch")):
        if n > 65535:
            raise ValueError(f"{what} = {n} blocks in the grid's y or z, at most 65535")
    # the kernels write every row of a sequence (a row or key no score reaches gets 0)
    empty = B * Hq * Nq == 0 or Nk == 0
    alloc = xp.zeros if empty else xp.empty
    dq, dk, dv = alloc(q.shape, q.dtype), alloc(k.shape, k.dtype), alloc(v.shape, v.dtype)
    dbias, dbias_st, heads_per_launch, batch_per_launch, cols = dbias_launch(
        xp, variants if return_dbias else None, np.float32, B=B, Hq=Hq, Nq=Nq, Nk=Nk)
    by_cols = return_dbias and cols.ndim == 3   # a bias broadcast over query rows
    # the 5-GEMM pair where it applies (the dQ pass writes dbias with a query axis)
    key_blocks = -(-Nk // p_dkdv.own_rows)
    workers = 0
    if segments is None and not (return_dbias and not by_cols):
        (p_dkdv, p_dq), workers = five_gemm_pair(backend, (p_dkdv, p_dq), units=B * Hkv, Nk=Nk,
                                                 deterministic=deterministic,
                                                 dq_workers=dq_workers)
    if workers:   # dQ's float32 partials, in tiles of 64 queries (zeroed: a worker adds the
        # tiles its key blocks see), one per warpgroup of a worker; not deterministic: one
        parts = xp.zeros((2 * workers if deterministic else 1, B, Hq,
                          -(-Nq // p_dkdv.streamed_rows) * p_dkdv.streamed_rows, q.shape[-1]),
                         np.float32)

    def result():
        if not return_dbias:
            return dq, dk, dv
        return dq, dk, dv, (dbias_from_cols(cols, variants.bias.shape) if by_cols else dbias)

    if empty:
        return result()
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    Dvec = xp.ascontiguousarray(Dvec, dtype=np.float32)
    data_type = TENSOR_MAP_TYPES[p_dkdv.dtype]

    def maps(own, streamed, rows_own, rows_streamed):   # q, k, v, do in the kernels' order
        rows = {**{id(x): rows_own for x in own}, **{id(x): rows_streamed for x in streamed}}
        return tuple(tensor_map_4d(backend.encode_tensor_map, data_type, address(x),
                                   x.shape[::-1], tuple(tma_strides(x)), rows[id(x)],
                                   128 // x.itemsize)
                     for x in (q, k, v, do))

    # the dK/dV pass reads lse and D 64 queries at a time by TMA: (B·Hq, Nq) rows padded to
    # 16 bytes (a packed sequence's own rows gathered into its batch row's); lse as the
    # kernels' lse_log2 (common.cuh) makes it, so that its loop takes it as it comes
    nq4 = -(-Nq // 4) * 4
    lse2 = xp.where(lse == -np.inf, np.float32(np.inf), lse * _LOG2E)
    padded = [_rows_by_batch(xp, x, segments, Nq, nq4) for x in (lse2, Dvec)]
    map_lse, map_dsum = (backend.encode_tensor_map(TENSOR_MAP_TYPES["float32"], 2, x,
                                                   [nq4, B * Hq], [nq4 * 4],
                                                   [p_dkdv.streamed_rows, 1], [1, 1])
                         for x in padded)
    cu = (None, None) if segments is None else (segments.cu_q, segments.cu_k)
    mods = backend.kernel_mods(variants, np.float32)   # a score_mod / mask_mod, compiled in

    def sizes(plan):  # a block mask's kinds are of the plan's own tiles
        return (*cu, np.int32(Hq), np.int32(Hq // Hkv), np.int32(rows_q), np.int32(rows_k),
                np.float32(scale), np.int32(bool(causal)),
                *variant_args(xp, variants, np.float32, mods, plan))

    part_tiles = parts[0].size // (64 * q.shape[-1]) if workers and deterministic else 0
    backend.get_function(p_dkdv, mods)(
        (workers or key_blocks, B * Hkv), (p_dkdv.num_threads,),
        (*maps((k, v), (q, do), p_dkdv.own_rows, p_dkdv.streamed_rows), map_lse, map_dsum, dk, dv,
         parts if workers else None, np.uint32(part_tiles), cols, np.int32(by_cols),
         *sizes(p_dkdv)),
        shared_mem=p_dkdv.dynamic_smem_bytes)
    if workers:   # dq = scale · Σ parts, in rows, a float4 of the partials per thread
        n = parts[0].size // 4
        backend.get_function(p_dq)((-(-n // p_dq.num_threads),), (p_dq.num_threads,),
                                   (parts, dq, np.int64(n), np.int32(parts.shape[0]),
                                    np.int64(n), np.int32(Nq), np.float32(scale)))
        return result()
    # the heads (batch rows) that share a row of dbias take one launch each, in stream order
    want = np.int32(return_dbias and not by_cols)
    for h0 in range(heads_per_launch):
        for b0 in range(batch_per_launch):
            backend.get_function(p_dq, mods)(
                (-(-Nq // p_dq.own_rows), Hq // heads_per_launch, B // batch_per_launch),
                (p_dq.num_threads,),
                (*maps((q, do), (k, v), p_dq.own_rows, p_dq.streamed_rows), lse, Dvec, dq,
                 dbias, *dbias_st, want, np.int32(h0), np.int32(b0), *sizes(p_dq)),
                shared_mem=p_dq.dynamic_smem_bytes)
    return result()


_LOG2E = np.float32(1.4426950408889634)   # MathConst<float>::log2e (common.cuh)


def _rows_by_batch(xp, x, segments, Nq, width):
    """x (B, Hq, Nq), or packed (1, Hq, total_q), as (B·Hq, width) float32 rows of Nq
    entries: sequence b's entries of head h in row b·Hq + h, zeros after them."""
    if segments is None:
        B, Hq = x.shape[:2]
        out = xp.zeros((B * Hq, width), np.float32)
        out[:, :Nq] = x.reshape(B * Hq, Nq)
        return out
    cu = segments.cu_q.astype(np.int64)
    pos = cu[:-1, None] + xp.arange(Nq)[None, :]            # (B, Nq) rows of x[0, h]
    inside = pos < cu[1:, None]
    rows = xp.where(inside[:, None, :], xp.take(x[0], xp.minimum(pos, x.shape[2] - 1), axis=1)
                    .transpose(1, 0, 2), 0)                 # (B, Hq, Nq)
    out = xp.zeros((segments.batch * x.shape[1], width), np.float32)
    out[:, :Nq] = rows.reshape(-1, Nq)
    return out
