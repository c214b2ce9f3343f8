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
* float32 FA2 on tensor cores (`flash_fwd_tf32_kernel`, `flash_fwd_tf32.cu`): the same
  launch for float32 on sm_80+ (d a multiple of 4 up to 256): split tf32, or one-pass tf32
  with `allow_tf32=True`.

Every launch takes the attention variants' arguments (`variant_args`, kernels/variants.cuh):
the same plan serves a plain call and one with variants.

Head dims above the plan's bucket run in bucket-wide chunks (`num_d_chunks`). The tile
plan comes from `tiling.plan_forward`; inputs are as `cuflash.backends` describes them
(checked and non-empty).
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes, tiling
from ..families import FLASH_FWD_TC, FLASH_FWD_TF32, FORWARD_ALGORITHMS
from .kernel_variants import variant_args
from .marshal import elem_strides, i32, prepare


def forward(backend, q, k, v, *, causal, scale, algorithm, variants=None, allow_tf32=False):
    """o, lse for q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d): o in q's dtype, lse (B, Hq,
    Nq) in the accumulation dtype. `variants` (cuflash.variants.Variants): the options;
    None or plain for none. `allow_tf32`: float32 may run one-pass tf32 (else split)."""
    xp = backend.xp
    q, k, v = (prepare(xp, a) for a in (q, k, v))
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    acc = _dtypes.accum_dtype(q.dtype)
    plan = tiling.plan_forward(d, q.dtype, algorithm=algorithm,
                               aligned=loads_16b_aligned(q, k, v), allow_tf32=allow_tf32,
                               **backend.limits())
    num_d_chunks = -(-d // plan.head_dim_bucket)
    o = xp.empty((B, Hq, Nq, d), dtype=q.dtype)
    lse = xp.empty((B, Hq, Nq), dtype=acc)

    sizes = (i32(Hq, "heads"), i32(Hq // Hkv, "group"), i32(Nq, "Nq"), i32(Nk, "Nk"),
             i32(d, "d"))
    strides = [s for a in (q, k, v, o) for s in elem_strides(a)[:3]]  # batch, head, row
    # The kernels fold log2(e) into the scale themselves (common.cuh).
    flags = (acc.type(scale), np.int32(bool(causal)))
    if plan.kernel in (FLASH_FWD_TC.name, FLASH_FWD_TF32.name):  # d <= head_dim: one chunk
        num_m_blocks = -(-Nq // plan.block_m)
        grid = num_m_blocks * Hq * B
        args = (q, k, v, o, lse, *sizes, *strides, *flags, np.int32(num_m_blocks),
                *variant_args(xp, variants, acc))
    elif plan.kernel == FORWARD_ALGORITHMS["fa2"].name:
        num_m_blocks = -(-Nq // plan.block_m)
        grid = num_m_blocks * num_d_chunks * Hq * B
        args = (q, k, v, o, lse, *sizes, *strides, *flags, np.int32(num_m_blocks),
                np.int32(num_d_chunks), *variant_args(xp, variants, acc))
    else:  # FA1: O, ℓ, m in global memory, one set per head-dim chunk for ℓ and m
        o_acc = xp.empty((B, Hq, Nq, d), dtype=acc)
        l_buf = xp.empty((num_d_chunks, B, Hq, Nq), dtype=acc)
        m_buf = xp.empty((num_d_chunks, B, Hq, Nq), dtype=acc)
        grid = num_d_chunks * Hq * B
        args = (q, k, v, o, lse, o_acc, l_buf, m_buf, i32(B, "batch"), *sizes, *strides,
                *flags, np.int32(num_d_chunks), *variant_args(xp, variants, acc))
    i32(grid, "grid size (blocks = query blocks x heads x batch)")
    backend.get_function(plan)((grid,), (plan.num_threads,), args, shared_mem=plan.smem_bytes)
    return o, lse


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
