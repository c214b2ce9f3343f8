"""Kernel arguments from arrays: what every launch of the CUDA kernels shares.

Kernel parameters are device pointers (arrays), `int` sizes, accumulation-type scalars and
small records (an array's strides, the sequence layout's scalars). CuPy and the emulator
both take NumPy scalars of the exact C types (np.int32, np.int64, np.float32/np.float64),
and a record as a NumPy structured scalar whose dtype has the C struct's fields, offsets
and size (`align=True`; tests/test_kernel_records.py compares them). Arrays never go
inside a record: as arguments of their own the emulator checks every access against them.

One builder per kernel pass (`forward_args`, `fa1_forward_args`, `preprocess_args`,
`dkdv_args`, `dq_args`, `softmax_args`) gives a launch's arguments in its kernel's
parameter order, named; where the SIMT and tensor-core kernels of a pass differ, the
builder decides from the plan.
"""
from __future__ import annotations

import numpy as np

from ..families import FLASH_BWD_DKDV_TC, FLASH_BWD_DQ_TC, FLASH_FWD_TC

_INT32_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535


def elem_strides(a) -> tuple[np.int64, ...]:
    """Element strides of every axis of `a`, as the kernels' `long long` parameters."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides)


def record(dtype: np.dtype, *values) -> np.void:
    """A record argument: `values` in the field order of `dtype` (a C struct's layout)."""
    return np.array(tuple(values), dtype=dtype)[()]


# common.cuh's Strides: the (batch, head, row) element strides of a (B, H, N, d) array.
STRIDES = np.dtype([("b", np.int64), ("h", np.int64), ("r", np.int64)], align=True)


def strides(a, *, packed=False) -> np.void:
    """`a`'s Strides record; `packed` (sequences packed along the rows, which carry the
    batch offset: seqlens.cuh): a batch stride of 0."""
    sb, sh, sr = elem_strides(a)[:3]
    return record(STRIDES, 0 if packed else sb, sh, sr)


# seqlens.cuh's SeqLayout: a paged cache's block-table row stride and page size, lse's
# batch, head and split strides, and the split count.
LAYOUT = np.dtype([("table_stride", np.int32), ("page_size", np.int32), ("lse_sb", np.int64),
                   ("lse_sh", np.int64), ("lse_ss", np.int64), ("num_splits", np.int32)],
                  align=True)


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


# -- the builders, one per pass. `sizes` is (Hq, group, Nq, Nk, d) as int32, `strides` the
# Strides records of the arrays in the kernel's order, `scale` the accumulation type's (the
# kernels fold log2 e in themselves: common.cuh), `variants` kernel_variants.variant_args's
# tuple, `varlen` the backward's (cu_seqlens_q, cu_seqlens_k, LAYOUT record).

def forward_args(plan, q, k, v, o, lse, *, sizes, strides, scale, causal, num_m_blocks,
                 num_d_chunks, layout, variants) -> tuple:
    """FA2's forward, flash_fwd_kernel or flash_fwd_tc_kernel: only the SIMT kernel takes
    a head-dim chunk count (the tensor-core kernel holds d <= HEAD_DIM in one block).
    `layout`: kernel_forward.layout_args's tuple."""
    chunks = () if plan.kernel == FLASH_FWD_TC.name else (np.int32(num_d_chunks),)
    return (q, k, v, o, lse, *sizes, *strides, scale, np.int32(bool(causal)),
            np.int32(num_m_blocks), *chunks, *layout, *variants)


def fa1_forward_args(q, k, v, o, lse, o_acc, l_buf, m_buf, *, batch, sizes, strides, scale,
                     causal, num_d_chunks, variants) -> tuple:
    """FA1's forward (flash_fwd_fa1_kernel): O, ℓ and m in global memory."""
    return (q, k, v, o, lse, o_acc, l_buf, m_buf, i32(batch, "batch"), *sizes, *strides,
            scale, np.int32(bool(causal)), np.int32(num_d_chunks), *variants)


def preprocess_args(do, o, lse, delta, stats, *, heads, rows, d) -> tuple:
    """The backward's D = rowsum(dO ∘ O) and stats = (lse · log2 e, D) pairs
    (flash_bwd_preprocess_kernel) over (B, H, rows, d) dO and O."""
    total = i32(delta.size, "batch x heads x Nq")
    return (do, o, lse, delta, stats, heads, i32(rows, "rows"), d, np.int64(total), strides(do),
            strides(o))


def dkdv_args(plan, q, k, v, do, row_stats, dk, dv, *, sizes, strides, scale, causal,
              num_d_chunks, dbias_cols, want_dbias_cols, dq_parts, varlen, variants) -> tuple:
    """dK, dV (flash_bwd_dkdv_kernel or flash_bwd_dkdv_tc_kernel): only the SIMT kernel
    takes a head-dim chunk count (a tensor-core plan counts its chunks from d), only the
    tensor-core kernel `dq_parts`: the float32 partials of dQ (a dummy unless
    plan.dq_parts), one partial's Strides record and the elements between two.
    `row_stats`: (lse, D) for the SIMT kernel, (stats,) for the tensor-core kernel
    (kernel_backward.preprocess's (lse · log2 e, D) pairs)."""
    tc = plan.kernel == FLASH_BWD_DKDV_TC.name
    chunks = () if tc else (np.int32(num_d_chunks),)
    parts = (dq_parts[0], dq_parts[1], np.int64(dq_parts[2])) if tc else ()
    return (q, k, v, do, *row_stats, dk, dv, *sizes, *strides, scale,
            np.int32(bool(causal)), *chunks, dbias_cols, np.int32(want_dbias_cols), *parts,
            *varlen, *variants)


def dq_sum_args(parts, dq, *, d, scale) -> tuple:
    """dQ = scale · Σ_w parts[w] (flash_bwd_dq_sum_kernel): parts (W, batch, heads,
    rows_pad, head_dim) float32 (`TcBwdPlan.dq_part_shape`), dq (batch, heads, rows, d)
    contiguous."""
    rows_pad, head_dim = parts.shape[-2:]
    return (parts, dq, np.int64(dq.size), i32(parts.shape[0], "dQ workers"), scale,
            i32(d, "d"), i32(dq.shape[-2], "rows"), i32(rows_pad, "rows"),
            i32(head_dim, "head dim"), np.int64(parts[0].size))


def dq_args(plan, q, k, v, do, lse, delta, dq, *, sizes, strides, scale, causal,
            num_d_chunks, dbias, dbias_strides, want_dbias, heads, batches, varlen,
            variants) -> tuple:
    """dQ (flash_bwd_dq_kernel or flash_bwd_dq_tc_kernel). `heads`, `batches`: the heads
    and batch rows sharing a dbias row — the SIMT kernel's blocks loop over them, the
    tensor-core kernel takes one launch each and these are its offsets (head0, batch0)."""
    chunks = () if plan.kernel == FLASH_BWD_DQ_TC.name else (np.int32(num_d_chunks),)
    return (q, k, v, do, lse, delta, dq, *sizes, *strides, scale, np.int32(bool(causal)),
            *chunks, dbias, *dbias_strides, np.int32(want_dbias), np.int32(heads),
            np.int32(batches), *varlen, *variants)


def softmax_args(x, y, *, P, n, Q) -> tuple:
    """softmax_rows_kernel / softmax_cols_kernel over axis 1 of (P, n, Q) x into y."""
    return (x, y, i32(P, "P"), i32(n, "n"), i32(Q, "Q"), *elem_strides(x), *elem_strides(y))
