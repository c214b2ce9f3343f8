"""The forward on the CUDA kernels: `flash_fwd.cu` (FA2) or `flash_fwd_fa1.cu` (FA1).

`forward(backend, q, k, v, *, causal, scale, algorithm)` runs one launch on the
backend's array module (CuPy on "cuda", NumPy on "emulator"):

* FA2 (`flash_fwd_kernel`): one thread block per (query block, head-dim chunk, head,
  batch), K/V tiles streamed; O and lse written once.
* FA1 (`flash_fwd_fa1_kernel`): one thread block per (head-dim chunk, head, batch), the
  paper's K/V-outer loop; O, ℓ and m live in global memory and are rescaled every step.
* FA2 on tensor cores (`flash_fwd_tc_kernel`, `flash_fwd_tc.cu`): the default for FA2
  where `tiling.forward_path` allows it (float16/bfloat16, sm_75/sm_80+, d a multiple of
  8 up to 256, 16-byte aligned rows); one block per (query block, head, batch).
* float32 FA2 on tensor cores (`flash_fwd_tc_kernel<float, ...>`): the same
  launch for float32 on sm_80+ (d a multiple of 4 up to 256): split tf32, or one-pass tf32
  with `allow_tf32=True`.
* The Hopper forward (`flash_fwd_sm90_kernel`, `kernel_forward_sm90`): on an sm_90a device,
  float16/bfloat16 calls with d = 64, 128 or 256, float32 as split tf32 (d = 64 or 128) or
  one-pass tf32 (d = 64, 128 or 256), packed sequences, KV caches, split-KV (`plain_call`,
  `tiling.forward_path`).

Every launch takes the attention variants' arguments (`variant_args`, kernels/variants.cuh):
the same plan serves a plain call and one with variants. The FA2 launches also take the
layout of kernels/seqlens.cuh (`layout_args`): packed variable-length sequences or a KV
cache (`Segments`), and split-KV — the keys of each query block cut over `num_splits`
blocks when the query blocks alone would leave SMs idle (`tiling.split_kv_count`), the
partial results merged by lse (`merge_states`) in a fixed order.

Head dims above the plan's bucket run in bucket-wide chunks (`num_d_chunks`). The tile
plan comes from `tiling.forward_path`; inputs are as `cuflash.backends` describes them
(checked and non-empty).
"""
from __future__ import annotations

import dataclasses

from .. import _dtypes, tiling
from ..merge import merge_states
from ..families import FLASH_FWD_TC, FORWARD_ALGORITHMS
from . import kernel_forward_sm90, marshal
from .kernel_variants import variant_args
from .marshal import fa1_forward_args, forward_args, i32, prepare


@dataclasses.dataclass(frozen=True)
class Segments:
    """Where each batch row's sequence lies (kernels/seqlens.cuh), as device int32 arrays:
    varlen `cu_q`, `cu_k` ((B+1,) row offsets into q, k and v given as (1, H, total, d)),
    and/or a KV cache's `used_k` ((B,) keys in use of the padded k, v), and a paged cache's
    `block_table` ((B, max_pages): k and v are (num_pages, H, page_size, d), page_size a
    multiple of the block_n of `forward_plan`). `max_q`: the longest query sequence (the
    grid's query blocks); `max_k`: the longest key sequence (split-KV's tile count)."""

    batch: int
    max_q: int
    max_k: int
    cu_q: object = None
    cu_k: object = None
    used_k: object = None
    block_table: object = None


def forward_plan(backend, q, k, v, *, algorithm="fa2", allow_tf32=False, scale=None,
                 segments=None, num_splits=None):
    """The plan `forward` launches for these (prepared) arrays and this call on this
    backend. The Hopper forward takes a call that is `plain_call` with q, k, v its tensor
    maps can read (`kernel_forward_sm90.tma_ready`; `scale` None: a call it does not take)
    unless a paged cache's pages are not whole key tiles of it, or the queries fill less
    than half its query tile (a decode step: mma.sync's smaller tiles and split-KV)."""
    lim = backend.limits()

    def path(plain):
        return tiling.forward_path(q.shape[-1], q.dtype, algorithm=algorithm,
                                   aligned=loads_16b_aligned(q, k, v), allow_tf32=allow_tf32,
                                   plain=plain, varlen=segments is not None, **lim)[0]

    plan = path(scale is not None and plain_call(scale) and kernel_forward_sm90.tma_ready(q, k, v))
    if isinstance(plan, tiling.Sm90FwdPlan):
        Nq = segments.max_q if segments is not None else q.shape[2]
        pages = segments is not None and segments.block_table is not None
        if pages and k.shape[2] % plan.block_n or Nq < plan.block_m // 2:
            plan = path(False)
    return plan


def plain_call(scale) -> bool:
    """Whether a call has none of what the Hopper forward does not take yet: a scale that
    is not positive and finite (its row max is taken of S before scaling); packed
    sequences, KV caches and split-KV it takes."""
    return 0 < float(scale) < float("inf")


def forward(backend, q, k, v, *, causal, scale, algorithm, variants=None, allow_tf32=False,
            segments=None, num_splits=None):
    """o, lse for q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d): o in q's dtype, lse (B, Hq,
    Nq) in the accumulation dtype. `variants` (cuflash.variants.Variants): the options;
    None or plain for none. `allow_tf32`: float32 may run one-pass tf32 (else split).
    `segments` (`Segments`): varlen or KV-cache lengths; None for the padded layout.
    `num_splits`: split-KV's key ranges; None picks them (`tiling.split_kv_count`)."""
    xp = backend.xp
    q, k, v = (prepare(xp, a) for a in (q, k, v))
    _, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    B = segments.batch if segments is not None else q.shape[0]
    max_q = segments.max_q if segments is not None else Nq
    max_k = segments.max_k if segments is not None else Nk
    acc = _dtypes.accum_dtype(q.dtype)
    lim = backend.limits()
    plan = forward_plan(backend, q, k, v, algorithm=algorithm, allow_tf32=allow_tf32,
                        scale=scale, segments=segments, num_splits=num_splits)
    if isinstance(plan, tiling.Sm90FwdPlan):
        if num_splits is None:  # its query tiles, one block per SM
            blocks = -(-max_q // plan.block_m) * Hq * B
            num_splits = tiling.split_kv_count(blocks, -(-max_k // plan.block_n), lim["sm_count"])
        return kernel_forward_sm90.forward_sm90(backend, q, k, v, causal=causal, scale=scale,
                                                variants=variants, plan=plan, segments=segments,
                                                num_splits=num_splits)
    if segments is not None and segments.block_table is not None and k.shape[2] % plan.block_n:
        raise ValueError(f"page_size {k.shape[2]} is not a multiple of the key tile "
                         f"({plan.block_n} keys of {plan}): gather the pages first")
    num_d_chunks = -(-d // plan.head_dim_bucket)
    mods = backend.kernel_mods(variants, acc)   # a score_mod / mask_mod, compiled in
    o = xp.empty(q.shape, dtype=q.dtype)
    lse = xp.empty(q.shape[:3], dtype=acc)

    sizes = (i32(Hq, "heads"), i32(Hq // Hkv, "group"), i32(Nq, "Nq"), i32(Nk, "Nk"),
             i32(d, "d"))
    # packed sequences: rows carry the batch offset (seqlens.cuh)
    cu = (None, None) if segments is None else (segments.cu_q, segments.cu_k)
    strides = [marshal.strides(a, packed=cu[i] is not None)
               for a, i in ((q, 0), (k, 1), (v, 1), (o, 0))]
    masked = variants is not None and variants.block_mask is not None
    if masked and plan.kernel not in SPLITTABLE:  # FA1's K/V-outer loop walks every tile
        raise ValueError(f"block_mask is taken by algorithm='fa2' (the default); got "
                         f"algorithm={algorithm!r}")
    if plan.kernel not in SPLITTABLE:
        grid = num_d_chunks * Hq * B  # FA1: O, ℓ, m in global memory, per head-dim chunk
        o_acc = xp.empty((B, Hq, Nq, d), dtype=acc)
        l_buf = xp.empty((num_d_chunks, B, Hq, Nq), dtype=acc)
        m_buf = xp.empty((num_d_chunks, B, Hq, Nq), dtype=acc)
        args = fa1_forward_args(q, k, v, o, lse, o_acc, l_buf, m_buf, batch=B, sizes=sizes,
                                strides=strides, scale=acc.type(scale), causal=causal,
                                num_d_chunks=num_d_chunks,
                                variants=variant_args(xp, variants, acc, mods, plan))
        i32(grid, "grid size (blocks = head-dim chunks x heads x batch)")
        backend.get_function(plan, mods)((grid,), (plan.num_threads,), args,
                                   shared_mem=plan.dynamic_smem_bytes)
        return o, lse

    num_m_blocks = -(-max_q // plan.block_m)
    blocks = num_m_blocks * num_d_chunks * Hq * B
    if num_splits is None:
        num_splits = tiling.split_kv_count(blocks, -(-max_k // plan.block_n), lim["sm_count"])
    grid = blocks * num_splits
    i32(grid, "grid size (blocks = query blocks x head-dim chunks x splits x heads x batch)")
    if num_splits > 1:  # partial O_i, lse_i per split, merged below
        o_part = xp.empty((num_splits, *q.shape), dtype=acc)
        lse_out = xp.empty((num_splits, *lse.shape), dtype=acc)
    else:
        o_part, lse_out = None, lse
    args = forward_args(plan, q, k, v, o, lse_out, sizes=sizes, strides=strides,
                        scale=acc.type(scale), causal=causal, num_m_blocks=num_m_blocks,
                        num_d_chunks=num_d_chunks,
                        layout=layout_args(xp, segments, lse, num_splits, o_part,
                                           page_size=k.shape[2]),
                        variants=variant_args(xp, variants, acc, mods, plan))
    backend.get_function(plan, mods)((grid,), (plan.num_threads,), args,
                               shared_mem=plan.dynamic_smem_bytes)
    if num_splits > 1:
        o[...], lse[...] = merge_states(o_part, lse_out)
    return o, lse


# The FA2 kernels: one block per (query block, head-dim chunk, split, head, batch), with
# the layout parameters of seqlens.cuh.
SPLITTABLE = (FORWARD_ALGORITHMS["fa2"].name, FLASH_FWD_TC.name)


def layout_args(xp, segments, lse, num_splits, o_part, page_size):
    """The CUFLASH_SEQLENS_PARAMS of kernels/seqlens.cuh, in order: cu_seqlens_q,
    cu_seqlens_k, seqused_k, block_table (null where absent), the SeqLayout record (the
    table's row stride and the page size, the lse strides — batch, head, split; the batch
    stride is 0 for a packed varlen lse, whose rows carry the offset — and num_splits),
    and o_part (null without split). None is a null pointer, on CuPy and the emulator."""
    seg = segments or Segments(batch=lse.shape[0], max_q=lse.shape[2], max_k=0)
    lse_sb = 0 if seg.cu_q is not None else lse.shape[1] * lse.shape[2]
    table = seg.block_table
    paging = (0, 0) if table is None else (table.shape[1], page_size)
    layout = marshal.record(marshal.LAYOUT, *paging, lse_sb, lse.shape[2], lse.size,
                            num_splits)
    return seg.cu_q, seg.cu_k, seg.used_k, table, layout, o_part


def _data_ptr(a) -> int:
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return iface["data"][0]


def loads_16b_aligned(*arrays) -> bool:
    """Whether the tensor-core kernel's 16-byte row loads fit these (B, H, N, d) arrays:
    every base pointer, and every batch, head and row stride (of an axis longer than 1),
    a multiple of 16 bytes (the last axis is contiguous after `prepare`)."""
    for a in arrays:
        if _data_ptr(a) % 16:
            return False
        if any(st % 16 for st, n in zip(a.strides[:3], a.shape[:3]) if n > 1):
            return False
    return True
