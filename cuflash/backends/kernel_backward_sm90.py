"""The Hopper backward (kernels/flash_bwd_sm90.cu, sm_90a): its inputs, tensor maps and
launches.

The kernels take float16 or bfloat16, head dim 64 or 128, q, k, v, dO with strides TMA can
read (`kernel_forward_sm90.tma_ready`), causal or not, every attention variant (without
dbias), GQA/MQA; lse and D = rowsum(dO ∘ O)
(flash_bwd.cu's preprocess) in float32. `backward_sm90` runs the dK/dV pass, then the dQ
pass, on any backend whose device is sm_90a (the emulator's sm_90a, or an H100);
`kernel_backward.backward` runs them for the plain calls `tiling.backward_path` gives them.
"""
from __future__ import annotations

import numpy as np

from .. import tiling
from .kernel_variants import variant_args
from .kernel_forward_sm90 import (TENSOR_MAP_TYPES, address, check_inputs, check_launch,
                                  tensor_map_4d, tma_strides)

_FLOAT32 = 7   # CU_TENSOR_MAP_DATA_TYPE_FLOAT32


def backward_sm90(backend, do, q, k, v, lse, Dvec, *, causal: bool, scale: float, variants=None,
                  plans=None):
    """(dq, dk, dv) of attention on `backend`'s sm_90a device: dk = scale · dSᵀ Q and
    dv = Pᵀ dO summed over each K/V head's query heads (flash_bwd_dkdv_sm90_kernel), dq =
    scale · dS K (flash_bwd_dq_sm90_kernel). `variants` (cuflash.variants.Variants): the
    forward's options, None for none. `plans`: the planner's (dK/dV, dQ) pair for these inputs (None:
    `tiling.sm90_bwd_plans`')."""
    check_inputs(q, k, v)
    check_inputs(do, k, v)
    if tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do: expected q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    check_launch(backend, scale, "backward")
    xp = backend.xp
    p_dkdv, p_dq = plans or tiling.sm90_bwd_plans(np.dtype(q.dtype).name, q.shape[-1])
    (B, Hq, Nq, _), Hkv, Nk = q.shape, k.shape[1], k.shape[2]
    for n, what in ((B * Hkv, "k: B·Hkv"), (B * Hq, "q: B·Hq")):
        if n > 65535:
            raise ValueError(f"{what} = {n} blocks in the grid's y, at most 65535")
    dq, dk, dv = xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
    if B * Hq * Nq == 0 or Nk == 0:
        return dq, dk, dv
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    Dvec = xp.ascontiguousarray(Dvec, dtype=np.float32)
    data_type = TENSOR_MAP_TYPES[p_dkdv.dtype]

    def maps(own, streamed, rows_own, rows_streamed):   # q, k, v, do in the kernels' order
        rows = {**{id(x): rows_own for x in own}, **{id(x): rows_streamed for x in streamed}}
        return tuple(tensor_map_4d(backend.encode_tensor_map, data_type, address(x),
                                   x.shape[::-1], tuple(tma_strides(x)), rows[id(x)])
                     for x in (q, k, v, do))

    # the dK/dV pass reads lse and D 64 queries at a time by TMA: rows padded to 16 bytes
    nq4 = -(-Nq // 4) * 4
    padded = [xp.zeros((B * Hq, nq4), np.float32) for _ in range(2)]
    for dst, x in zip(padded, (lse, Dvec)):
        dst[:, :Nq] = x.reshape(B * Hq, Nq)
    map_lse, map_dsum = (backend.encode_tensor_map(_FLOAT32, 2, x, [nq4, B * Hq], [nq4 * 4],
                                                   [p_dkdv.streamed_rows, 1], [1, 1])
                         for x in padded)
    sizes = (np.int32(Hq), np.int32(Hq // Hkv), np.int32(Nq), np.int32(Nk), np.float32(scale),
             np.int32(bool(causal)), *variant_args(xp, variants, np.float32))
    backend.get_function(p_dkdv)(
        (-(-Nk // p_dkdv.own_rows), B * Hkv), (p_dkdv.num_threads,),
        (*maps((k, v), (q, do), p_dkdv.own_rows, p_dkdv.streamed_rows), map_lse, map_dsum, dk, dv,
         *sizes),
        shared_mem=p_dkdv.dynamic_smem_bytes)
    backend.get_function(p_dq)(
        (-(-Nq // p_dq.own_rows), B * Hq), (p_dq.num_threads,),
        (*maps((q, do), (k, v), p_dq.own_rows, p_dq.streamed_rows), lse, Dvec, dq, *sizes),
        shared_mem=p_dq.dynamic_smem_bytes)
    return dq, dk, dv
