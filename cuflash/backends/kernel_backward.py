"""The backward on the CUDA kernels of `flash_bwd.cu` (FlashAttention-2, Algorithm 2).

`backward(backend, do, q, k, v, o, lse, *, causal, scale)` runs three launches on the
backend's array module (CuPy on "cuda", NumPy on "emulator"):

1. `flash_bwd_preprocess_kernel`: D = rowsum(dO ∘ O) and (lse · log2 e, D), one warp per row;
2. `flash_bwd_dkdv_kernel`: one thread block per (K/V block, K/V head, batch), Q tiles
   streamed; dK, dV, summed over the query heads of the GQA group inside the block;
3. `flash_bwd_dq_kernel`: one thread block per (Q block, query head, batch), K/V tiles
   streamed; dQ.

The default 16-bit tensor-core backward (d <= 128, plain scores: causal and the window,
no other option) has five GEMMs instead of seven: `flash_bwd_dkdv_tc_kernel` with
DQ_PARTS runs W workers per (batch, K/V head) (`tiling.dq_workers`), each walking key
blocks w, w + W, ... and adding dS K_j into its own float32 partial of dQ, and launch 3 is
`flash_bwd_dq_sum_kernel`, which adds the W partials in order (flash_bwd_tc.cu). The
partials take W float32 copies of dq, padded to whole tiles (`TcBwdPlan.dq_part_shape`).

Head dims above the largest bucket (d > 256) run the chunked specializations, one block
per (row block, 256-wide head-dim chunk). Every output element, and every element of a dQ
partial, has one writing thread and a fixed order of additions, so results are bitwise
reproducible (for the same worker count). The tile plans come from `tiling.backward_path`;
inputs are as `cuflash.backends` describes them (checked and non-empty).

Where tensor cores apply (float16 on sm_75+, bfloat16 on sm_80+, d a multiple of 8 up to
256; float32 on sm_80+, d a multiple of 4 up to 256; 16-byte aligned q, k, v, dO),
launches 2 and 3 are the `flash_bwd_tc.cu` kernels instead (`flash_bwd_dkdv_tc_kernel`,
`flash_bwd_dq_tc_kernel`, float32 included: dynamic shared memory, no chunk argument; a
chunked plan, d > 128 for dK/dV, has `plan.num_d_chunks(d)` blocks per row block, a count
the kernel derives from d); the preprocess is shared.

Attention variants run on every kernel (run-time arguments, `kernel_variants`). With
`return_dbias` the dQ kernel also writes dbias; where the bias is broadcast over heads or
batch the grid's y or z shrinks to 1 and the SIMT blocks loop over them, while the
tensor-core dQ kernel takes one launch per head or batch row (stream order keeps one
writer per element). A bias broadcast over query rows takes the dK/dV kernel's column
sums of dS instead, summed over the other broadcast axes here: `dbias_launch`,
`dbias_from_cols`.
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes, tiling
from . import kernel_backward_sm90, kernel_forward, kernel_forward_sm90
from .kernel_forward import loads_16b_aligned
from .kernel_variants import dbias_from_cols, dbias_launch, score_plain, variant_args
from .marshal import (LAYOUT, STRIDES, check_grid_yz, dkdv_args, dq_args, dq_sum_args, i32,
                      prepare, preprocess_args, record, strides)


def backward_plans(backend, do, q, k, v, *, allow_tf32=False, dq_parts=True, plain=False):
    """((dkdv_plan, dq_plan), reason) of `backward` for these (prepared) arrays; with
    `dq_parts` the 5-GEMM pair where it applies, with `plain` (`kernel_forward.plain_call`)
    the Hopper pair where the device and q, k, v, dO allow (`tiling.backward_path`)."""
    plain = plain and kernel_forward_sm90.tma_ready(q, k, v, do)
    return tiling.backward_path(q.shape[-1], q.dtype, aligned=loads_16b_aligned(q, k, v, do),
                                allow_tf32=allow_tf32, dq_parts=dq_parts, plain=plain,
                                **backend.limits())


def preprocess(backend, do, o, lse):
    """D = rowsum(dO ∘ O) in lse's shape and dtype (the accumulation dtype, lse
    contiguous), and stats: the pairs (lse · log2 e, D) (+inf where lse = −inf: a row that
    saw no key), (*lse.shape, 2) (flash_bwd_preprocess), for dO and O (B, H, rows, d). The
    tensor-core dK/dV kernel reads stats: per column of its transposed scores, one copy per
    row and no conversion per score."""
    _, H, rows_q, d = o.shape
    pre = tiling.bwd_preprocess_plan(o.dtype)
    rows = i32(lse.size, "batch x heads x Nq")
    Dvec = backend.xp.empty(lse.shape, dtype=lse.dtype)
    stats = backend.xp.empty((*lse.shape, 2), dtype=lse.dtype)
    backend.get_function(pre)((-(-rows // pre.rows_per_block),), (pre.num_threads,),
                              preprocess_args(do, o, lse, Dvec, stats, heads=i32(H, "query heads"),
                                              rows=rows_q, d=i32(d, "d")),
                              shared_mem=pre.dynamic_smem_bytes)
    return Dvec, stats


def backward(backend, do, q, k, v, o, lse, *, causal, scale, variants=None,
             return_dbias=False, allow_tf32=False, segments=None, dq_workers=None,
             return_mod_grads=False, deterministic=True):
    """dq, dk, dv for q, o, do (B, Hq, Nq, d), k, v (B, Hkv, Nk, d) and lse (B, Hq, Nq):
    the input shapes and dtypes, dk and dv summed over each GQA group. `variants`
    (cuflash.variants.Variants): the options; with `return_dbias` a fourth
    result, dbias in the compact 4-D shape of variants.bias and the accumulation dtype.
    `allow_tf32`: float32 may run one-pass tf32 (else split) on tensor cores.
    `segments` (kernel_forward.Segments, cu_q and cu_k only): packed sequences, q, do, o
    (1, Hq, total_q, d), k, v (1, Hkv, total_k, d), lse (1, Hq, total_q).
    `dq_workers`: the 5-GEMM backward's workers per (batch, K/V head) where it applies
    (None: `tiling.dq_workers`' count; 0: the two-kernel backward); a count also keeps the
    call on mma.sync. On an sm_90a device a `kernel_forward.plain_call` (a positive finite
    scale: every variant, dbias and packed sequences are taken) runs the Hopper kernels
    (`kernel_backward_sm90.backward_sm90`) where `tiling.backward_path` takes them.
    `return_mod_grads`: a last result, {name: gradient} of the float arrays the
    score_mod captures (`mod_grads`), on the two-kernel backward: the dQ kernel's warps
    add them into partials of their own.
    `deterministic=False`: where the 5-GEMM backward runs, FlashAttention-2's grid instead —
    a block per key block, all adding dS K_j into one float32 dQ by atomics, in whatever
    order they run (the last bits of dq may differ from run to run; dk, dv do not); on the
    Hopper kernels the same, their five GEMMs from a block per key block
    (`kernel_backward_sm90.five_gemm_pair`); the two-kernel backward stays as it is
    (deterministic)."""
    xp = backend.xp
    q, k, v, o, do = (prepare(xp, a) for a in (q, k, v, o, do))
    _, Hq, rows_q, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    B = q.shape[0] if segments is None else segments.batch
    Nq = rows_q if segments is None else segments.max_q   # the grid's longest sequence
    Nk = Nk if segments is None else segments.max_k
    acc = _dtypes.accum_dtype(q.dtype)
    # the Hopper pair for a plain call; else the 5-GEMM backward (16-bit, one head-dim
    # chunk) with W workers for plain scores (its kernel has no variants' loop), unless the
    # model prefers two kernels (W = 0)
    plain = dq_workers is None and kernel_forward.plain_call(scale) and not return_mod_grads
    (p_dkdv, p_dq), _why = backward_plans(backend, do, q, k, v, allow_tf32=allow_tf32,
                                          dq_parts=score_plain(variants) and dq_workers != 0,
                                          plain=plain)
    if isinstance(p_dkdv, tiling.Sm90BwdPlan):   # 1. D, 2. dK, dV, 3. dQ
        lse = xp.ascontiguousarray(lse, dtype=acc)
        Dvec, _ = preprocess(backend, do, o, lse)
        return kernel_backward_sm90.backward_sm90(backend, do, q, k, v, lse, Dvec,
                                                  causal=causal, scale=scale,
                                                  variants=variants, segments=segments,
                                                  return_dbias=return_dbias,
                                                  plans=(p_dkdv, p_dq),
                                                  deterministic=deterministic)
    workers = 0
    if isinstance(p_dq, tiling.DqSumPlan):
        key_blocks = -(-Nk // p_dkdv.block_rows)
        if not deterministic:
            workers = key_blocks
        else:
            workers = (min(dq_workers, key_blocks) if dq_workers is not None else
                       tiling.dq_workers(B * Hkv, key_blocks, backend.limits()["sm_count"]))
        if not workers:
            (p_dkdv, p_dq), _why = backward_plans(backend, do, q, k, v, allow_tf32=allow_tf32,
                                                  dq_parts=False)
    tc = isinstance(p_dkdv, tiling.TcBwdPlan)  # tensor cores (f16, bf16, tf32): d <= 256
    num_d_chunks = tiling.bwd_head_dim_chunks(d)  # SIMT: one argument for both kernels
    # tensor cores: each plan's own chunks (the kernels count them from d)
    chunks_kv = p_dkdv.num_d_chunks(d) if tc else num_d_chunks
    lse = xp.ascontiguousarray(lse, dtype=acc)
    dq = xp.empty(q.shape, dtype=q.dtype)
    dk = xp.empty(k.shape, dtype=q.dtype)
    dv = xp.empty(v.shape, dtype=q.dtype)

    # 32-bit row indices and sizes; the grid's y and z carry heads and batch.
    for n, what in ((B, "batch"), (Hq, "query heads"), (Hkv, "key/value heads")):
        check_grid_yz(n, what)
    grid_kv = i32((workers or -(-Nk // p_dkdv.block_rows)) * chunks_kv, "dK/dV blocks per head")
    sizes = (i32(Hq, "query heads"), i32(Hq // Hkv, "group"), i32(Nq, "Nq"), i32(Nk, "Nk"),
             i32(d, "d"))
    def s3(a):  # Strides records; packed rows carry the batch offset
        return strides(a, packed=segments is not None)

    strides_in = (s3(q), s3(k), s3(v), s3(do))
    # CUFLASH_VARLEN_PARAMS: the packed sequences, the layout of lse and D (no cache, no split)
    layout = record(LAYOUT, 0, 0, 0 if segments is not None else Hq * rows_q, rows_q, 0, 1)
    varlen = (None, None, layout) if segments is None else (segments.cu_q, segments.cu_k, layout)
    common = dict(sizes=sizes, scale=acc.type(scale), causal=causal, num_d_chunks=num_d_chunks,
                  varlen=varlen)

    # Variants: the score chain's run-time arguments (every kernel), and dbias's launch
    # (the dQ blocks loop over the heads and batches sharing a bias row; a bias without its
    # query axis takes the dK/dV kernel's column sums instead: flash_bwd.cu, flash_bwd_tc.cu).
    # a score_mod / mask_mod, compiled in (with the score_mod's gradients: `mod_grads`)
    mods = backend.kernel_mods(variants, acc, grads=return_mod_grads)

    def vflags(plan, grad_part=None):  # a block mask's kinds are of the plan's own tiles
        return variant_args(xp, variants, acc, mods, plan, grad_part)

    dbias, dbias_st, heads_per_block, batch_per_block, cols = dbias_launch(
        xp, variants if return_dbias else None, acc, B=B, Hq=Hq, Nq=Nq, Nk=Nk)
    by_cols = return_dbias and cols.ndim == 3  # query-broadcast bias: dK/dV writes it
    # SIMT: one dQ launch whose blocks loop over them; tensor cores: one launch per (head,
    # batch) pair, in stream order (a loop in the block spilled), its offsets head0, batch0
    if tc:
        dq_launches = [(h0, b0) for b0 in range(batch_per_block) for h0 in range(heads_per_block)]
    else:
        dq_launches = [(heads_per_block, batch_per_block)]

    Dvec, stats = preprocess(backend, do, o, lse)   # 1. D = rowsum(dO ∘ O), (lse · log2 e, D)
    # dQ's float32 partials, one per worker (zeroed: a worker adds only the rows its key
    # blocks see), padded as the plan says (whole tiles), contiguous; not deterministic: one
    # for all (the kernel's stride between workers' partials 0); else a dummy
    n_parts = workers if deterministic else 1
    parts = xp.zeros((n_parts, *p_dkdv.dq_part_shape(*q.shape[:3], packed=segments is not None))
                     if workers else 1, dtype=acc)
    if workers:   # the kernel's row index within a batch row: query heads x padded rows
        i32(parts.shape[2] * parts.shape[3], "query heads x rows of dQ's partial")
    dq_parts = ((parts, s3(parts[0]), parts[0].size if deterministic else 0) if workers else
                (parts, record(STRIDES, 0, 0, 0), 0))
    # 2. dK, dV (and dQ's partials)
    backend.get_function(p_dkdv, mods)((grid_kv, Hkv, B), (p_dkdv.num_threads,),
                                 dkdv_args(p_dkdv, q, k, v, do, (stats,) if tc else (lse, Dvec),
                                           dk, dv,
                                           strides=(*strides_in, s3(dk), s3(dv)),
                                           dbias_cols=cols, want_dbias_cols=by_cols,
                                           dq_parts=dq_parts, variants=vflags(p_dkdv), **common),
                                 shared_mem=p_dkdv.dynamic_smem_bytes)
    # 3. dQ: the partials' sum, or the dQ kernel
    if workers:
        threads = p_dq.num_threads * p_dq.elements_per_thread
        backend.get_function(p_dq)((-(-dq.size // threads),), (p_dq.num_threads,),
                                   dq_sum_args(parts, dq, d=d, scale=acc.type(scale)))
        dq_launches = []
    else:
        chunks_q = p_dq.num_d_chunks(d) if tc else num_d_chunks
        grid_q = i32(-(-Nq // p_dq.block_rows) * chunks_q, "dQ blocks per head")
    grad_part = None
    if return_mod_grads:  # one partial per warp of a dQ launch (the launches add in turn)
        warps = grid_q * (Hq // heads_per_block) * (B // batch_per_block) * (
            p_dq.num_threads // 32)
        grad_part = mod_grad_partials(xp, mods, warps, acc)
    for heads, batches in dq_launches:
        backend.get_function(p_dq, mods)((grid_q, Hq // heads_per_block, B // batch_per_block),
                                   (p_dq.num_threads,),
                                   dq_args(p_dq, q, k, v, do, lse, Dvec, dq,
                                           strides=(*strides_in, s3(dq)), dbias=dbias,
                                           dbias_strides=dbias_st,
                                           want_dbias=return_dbias and not by_cols,
                                           heads=heads, batches=batches,
                                           variants=vflags(p_dq, grad_part),
                                           **common),
                                   shared_mem=p_dq.dynamic_smem_bytes)
    out = (dq, dk, dv)
    if return_dbias:
        if by_cols:
            dbias = dbias_from_cols(cols, variants.bias.shape)
        out += (dbias,)
    if return_mod_grads:
        out += (mod_grads(grad_part, mods, variants.score_mod),)
    return out


# The most memory the dQ warps' gradient partials may take.
_MOD_GRAD_BYTES = 2 << 30


def mod_grad_partials(xp, mods, warps, acc):
    """Zeroed (warps, entries) partials of the score_mod's float arrays' gradients, one row
    per warp of the dQ launch; ValueError past _MOD_GRAD_BYTES (an array as big as the
    score matrix belongs in `bias`, whose gradient the kernels reduce by rows)."""
    entries = sum(size for *_, size in mods.grad_spans)
    need = warps * entries * np.dtype(acc).itemsize
    if need > _MOD_GRAD_BYTES:
        names = ", ".join(f"{n} ({size} entries)" for n, _, size in mods.grad_spans)
        raise ValueError(f"return_mod_grads: the kernels add the gradients of {names} into "
                         f"one partial per dQ warp, {warps} of them: {need / 2**30:.1f} GiB, "
                         f"over the {_MOD_GRAD_BYTES / 2**30:.0f} GiB limit; pass a dense "
                         f"bias as bias= (return_dbias=True), or use backend='numpy'")
    return xp.zeros((warps, max(entries, 1)), dtype=acc)


def mod_grads(part, mods, score_mod):
    """{name: gradient} of the score_mod's float arrays from the warps' partials: summed
    over the warps in a fixed order (the array module's reduction), in each array's shape
    and dtype."""
    total = part.sum(axis=0)
    return {name: total[off:off + size].reshape(score_mod.buffers[name].shape)
            .astype(score_mod.buffers[name].dtype)
            for name, off, size in mods.grad_spans}
