"""The Hopper forward (kernels/flash_fwd_sm90.cu, sm_90a): its inputs, tensor maps and launch.

The kernel takes float16 or bfloat16 with head dim 64, 128 or 256, or float32 as tf32 (split
at head dim 64 or 128; one-pass, for calls with `allow_tf32`, at 64, 128 or 256), q, k, v
(B, H, N, D) with strides TMA can read (`tma_ready`), causal or not, every attention variant
(kernels/variants.cuh), GQA/MQA, packed sequences (varlen), a KV cache (contiguous or paged),
split-KV. The planner (`tiling.forward_path`) gives such calls on an sm_90a device its plan
(`Sm90FwdPlan`); `forward_sm90` also runs it directly on any backend whose device is sm_90a
(the emulator's sm_90a, or an H100), for the tests and the GPU check.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import tiling
from ..merge import merge_states
from .kernel_variants import variant_args
from .marshal import i32

HEAD_DIMS = tiling.SM90_HEAD_DIMS
TF32_HEAD_DIMS = tiling.SM90_TF32_HEAD_DIMS
# dtype name → CUtensorMapDataType (cuda.h's FLOAT16, FLOAT32, BFLOAT16)
TENSOR_MAP_TYPES = {"float16": 6, "bfloat16": 9, "float32": 7}
_SWIZZLE_128B = 3                   # CU_TENSOR_MAP_SWIZZLE_128B


def tma_strides(x) -> list[int]:
    """The row, head and batch strides of (B, H, N, D) `x` in bytes, as a tensor map takes
    them: an axis of length 1 gets the extent of the axes inside it (its stride is never
    used, and TMA wants a positive multiple of 16)."""
    strides, extent = [], x.shape[-1] * x.itemsize
    for n, st in zip(x.shape[2::-1], x.strides[2::-1]):
        strides.append(st if n > 1 else extent)
        extent = strides[-1] * n
    return strides


def address(x) -> int:
    """The data pointer of a NumPy or CuPy array."""
    return (getattr(x, "__cuda_array_interface__", None) or x.__array_interface__)["data"][0]


# Encoded maps by their arguments (a map holds nothing else): a training loop's buffers come
# back at the same addresses, and four encodings cost more host time than a short launch.
@functools.lru_cache(maxsize=256)
def tensor_map_4d(encode, data_type, address, dims, strides, rows, cols):
    """A 4-D (D, N, H, B) map of boxes of `cols` columns (128 bytes) by `rows`, 128-byte
    swizzled."""
    return encode(data_type, 4, address, list(dims), list(strides), [cols, rows, 1, 1],
                  [1, 1, 1, 1], swizzle=_SWIZZLE_128B)


def tma_ready(*arrays) -> bool:
    """Whether TMA can read these (B, H, N, D) arrays as they are: contiguous rows, a
    16-byte aligned base, and row, head and batch strides (of axes longer than 1) positive
    multiples of 16 bytes. An empty array has nothing to read."""
    for x in arrays:
        if x.size == 0:
            continue
        if address(x) % 16 or x.strides[3] != x.itemsize:
            return False
        if any(st <= 0 or st % 16 for st in tma_strides(x)):
            return False
    return True


# The forward's head dims by dtype (float32 as tf32: split at SM90_SPLIT_HEAD_DIMS only)
FORWARD_HEAD_DIMS = {"float16": HEAD_DIMS, "bfloat16": HEAD_DIMS, "float32": TF32_HEAD_DIMS}


def _one_of(names):
    *head, last = names
    return f"{', '.join(head)} or {last}" if head else last


def check_inputs(q, k, v, paged=False, head_dims=FORWARD_HEAD_DIMS, what="forward"):
    """ValueError/TypeError naming what the kernel does not take yet (`paged`: k and v are
    a paged cache's (pages, Hkv, page_size, D), their first axis not the batch; `head_dims`:
    the dtypes taken, by name, and their head dims; `what`: the kernel, for the messages)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.dtype(x.dtype).name not in head_dims or np.dtype(x.dtype) != np.dtype(q.dtype):
            tf32 = " (as tf32)" if "float32" in head_dims else ""
            raise TypeError(f"{name}: the Hopper {what} takes {_one_of(list(head_dims))}{tf32}, "
                            f"q, k, v alike; got {np.dtype(x.dtype)}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected (B, H, N, D), got shape {tuple(x.shape)}")
        if not tma_ready(x):
            raise ValueError(f"{name}: the Hopper {what}'s tensor maps need contiguous rows, a "
                             f"16-byte aligned base and positive row, head and batch strides "
                             f"that are multiples of 16 bytes; got strides {x.strides}")
    (B, H, _, D), (Bk, Hkv, _, Dk) = q.shape, k.shape
    dims = head_dims[np.dtype(q.dtype).name]
    if D not in dims or Dk != D or tuple(v.shape) != tuple(k.shape) or (Bk != B and not paged):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: the Hopper "
                         f"{what} takes head dims {dims} for {np.dtype(q.dtype)}, k and v "
                         f"alike, one batch")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q's {H} heads must be a multiple of k's {Hkv}")


def check_launch(backend, scale, what: str):
    """ValueError unless `scale` is positive and finite (the kernels take the row max of S,
    then scale it) and `backend`'s device runs sm_90a code; `what`: "forward" or
    "backward", for the message."""
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: the Hopper {what} takes a positive finite scale, got {scale!r}")
    if not backend.limits()["sm90a"]:
        raise ValueError(f"backend: the Hopper {what} needs a device that runs sm_90a code (a "
                         f"cc 9.0 GPU, or the emulator's sm_90a); this one is "
                         f"sm_{''.join(map(str, backend.limits()['cc']))}")


def forward_sm90(backend, q, k, v, *, causal: bool, scale: float, variants=None, plan=None,
                 segments=None, num_splits=1, num_blocks=None, allow_tf32=False):
    """(o, lse) of attention on `backend`'s sm_90a device by flash_fwd_sm90_kernel (`plan`:
    the planner's `Sm90FwdPlan` for these inputs; None: this function's checks and plan,
    float32 as split tf32 at d = 64 or 128 or, with `allow_tf32`, one-pass tf32 at 64, 128
    or 256).
    `variants` (cuflash.variants.Variants): the options, None for none.
    `segments` (kernel_forward.Segments): lengths per batch row, seqlens.cuh's layouts —
    packed sequences (cu_q, cu_k: q, o (1, H, total_q, d), k, v (1, Hkv, total_k, d), lse
    (1, H, total_q)), a KV cache (used_k), a paged one (block_table: k, v (pages, Hkv,
    page_size, d), page_size a multiple of the plan's block_n).
    `num_splits`: split-KV's key ranges (seqlens.cuh's rule); the splits' O and lse are
    merged by `merge_states`.
    `num_blocks`: the grid, each block walking tiles x, x + num_blocks, … (None: one block
    per tile; a persistent grid of one block per SM measured slower causal on an H100,
    `docs/kernels.md`)."""
    table = None if segments is None else segments.block_table
    if plan is None:
        check_inputs(q, k, v, paged=table is not None)
        plan = tiling.sm90_fwd_plan(np.dtype(q.dtype).name, q.shape[-1], segments is not None,
                                    allow_tf32=allow_tf32)
        if plan is None:   # float32, split tf32 at d = 256
            raise ValueError(f"q: the Hopper forward takes float32 as split tf32 at head dims "
                             f"{tiling.SM90_SPLIT_HEAD_DIMS} (its lo parts leave no room above), "
                             f"as one-pass tf32 (allow_tf32=True) at {TF32_HEAD_DIMS}; got "
                             f"{q.shape[-1]}")
    if table is not None and k.shape[2] % plan.block_n:
        raise ValueError(f"page_size {k.shape[2]} is not a multiple of the key tile "
                         f"({plan.block_n} keys of {plan}): gather the pages first")
    if plan.varlen != (segments is not None):
        raise ValueError(f"plan: {plan} is for {'' if plan.varlen else 'no '}lengths per batch "
                         f"row; the call has {'none' if segments is None else 'segments'}")
    check_launch(backend, scale, "forward")
    xp = backend.xp
    (_, H, rows_q, _), Hkv, rows_k = q.shape, k.shape[1], k.shape[2]
    B, Nq, Nk = ((q.shape[0], rows_q, rows_k) if segments is None else
                 (segments.batch, segments.max_q, segments.max_k))
    lse_shape = q.shape[:3]
    if B * H * Nq == 0 or Nk == 0:   # no key: O = 0, lse = −inf
        return xp.zeros(q.shape, q.dtype), xp.full(lse_shape, -np.inf, np.float32)
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) \
            or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int; got {num_splits!r}")
    o = xp.empty(q.shape, q.dtype)
    lse = xp.empty(lse_shape, np.float32)
    # with splits, each split's O_i (float) and lse_i, merged below
    o_part = xp.empty((num_splits, *q.shape), np.float32) if num_splits > 1 else None
    lse_out = xp.empty((num_splits, *lse_shape), np.float32) if num_splits > 1 else lse
    mods = backend.kernel_mods(variants, np.float32)   # a score_mod / mask_mod, compiled in
    f = backend.get_function(plan, mods)
    data_type = TENSOR_MAP_TYPES[plan.dtype]

    def tensor_map(x, rows=plan.block_m):
        return tensor_map_4d(backend.encode_tensor_map, data_type, address(x), x.shape[::-1],
                             tuple(tma_strides(x)), rows, 128 // x.itemsize)

    # K and V by key tiles, O by each consumer warpgroup's 64 rows
    maps = (tensor_map(q), tensor_map(k, rows=plan.block_n), tensor_map(v, rows=plan.block_n),
            tensor_map(o, rows=64))
    num_m_blocks = -(-Nq // plan.block_m)
    num_tiles = i32(num_m_blocks * num_splits * B * H, "query blocks x splits x heads x batch")
    grid = num_tiles if num_blocks is None else min(num_tiles, num_blocks)
    lengths = ((None,) * 4 if segments is None else
               (segments.cu_q, segments.cu_k, segments.used_k, table))
    paging = (np.int32(0), np.int32(0)) if table is None else (np.int32(table.shape[1]),
                                                               np.int32(k.shape[2]))
    f((grid,), (plan.num_threads,),
      (*maps, o, lse_out, *lengths, *paging, np.int32(H), np.int32(H // Hkv), np.int32(rows_q),
       np.int32(rows_k),
       np.float32(scale), np.int32(bool(causal)), np.int32(num_m_blocks), num_tiles,
       np.int32(num_splits), np.int64(lse.size), o_part,
       *variant_args(xp, variants, np.float32, mods, plan)),
      shared_mem=plan.dynamic_smem_bytes)
    if num_splits > 1:
        o[...], lse[...] = merge_states(o_part, lse_out)
    return o, lse
