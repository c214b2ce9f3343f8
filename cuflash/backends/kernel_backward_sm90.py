"""The Hopper backward's dK/dV pass (kernels/flash_bwd_sm90.cu, sm_90a): its inputs, tensor
maps and launch.

The kernel takes float16 or bfloat16, head dim 64 or 128, q, k, v, dO with strides TMA can
read (`kernel_forward_sm90.tma_ready`), causal or not, GQA/MQA; lse and D = rowsum(dO ∘ O)
(flash_bwd.cu's preprocess) in float32. It writes dK and dV; dQ is the two-kernel
backward's dQ kernel's. The planner does not choose it yet: `dkdv_sm90` runs it on any
backend whose device is sm_90a (the emulator's sm_90a, or an H100), for the tests.
"""
from __future__ import annotations

import numpy as np

from .. import tiling
from .kernel_forward_sm90 import (TENSOR_MAP_TYPES, address, check_inputs, tensor_map_4d,
                                  tma_strides)


def dkdv_sm90(backend, do, q, k, v, lse, Dvec, *, causal: bool, scale: float):
    """(dk, dv) of attention on `backend`'s sm_90a device by flash_bwd_dkdv_sm90_kernel:
    dk = scale · dSᵀ Q, dv = Pᵀ dO summed over each K/V head's query heads."""
    check_inputs(q, k, v)
    check_inputs(do, k, v)
    if tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do: expected q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: the Hopper backward takes a positive finite scale, got {scale!r}")
    if not backend.limits()["sm90a"]:
        raise ValueError(f"backend: the Hopper backward needs a device that runs sm_90a code (a "
                         f"cc 9.0 GPU, or the emulator's sm_90a); this one is "
                         f"sm_{''.join(map(str, backend.limits()['cc']))}")
    xp = backend.xp
    plan = tiling.sm90_bwd_plan(np.dtype(q.dtype).name, q.shape[-1])
    (B, Hq, Nq, _), Hkv, Nk = q.shape, k.shape[1], k.shape[2]
    if B * Hkv > 65535:
        raise ValueError(f"k: B·Hkv = {B * Hkv} blocks in the grid's y, at most 65535")
    dk, dv = xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
    if B * Hkv * Nk == 0:
        return dk, dv
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    Dvec = xp.ascontiguousarray(Dvec, dtype=np.float32)
    data_type = TENSOR_MAP_TYPES[plan.dtype]

    def tensor_map(x, rows):
        return tensor_map_4d(backend.encode_tensor_map, data_type, address(x), x.shape[::-1],
                           tuple(tma_strides(x)), rows)

    maps = (tensor_map(q, plan.block_m), tensor_map(k, plan.block_n),
            tensor_map(v, plan.block_n), tensor_map(do, plan.block_m))
    backend.get_function(plan)(
        (-(-Nk // plan.block_n), B * Hkv), (plan.num_threads,),
        (*maps, lse, Dvec, dk, dv, np.int32(Hq), np.int32(Hq // Hkv), np.int32(Nq), np.int32(Nk),
         np.float32(scale), np.int32(bool(causal))),
        shared_mem=plan.dynamic_smem_bytes)
    return dk, dv
