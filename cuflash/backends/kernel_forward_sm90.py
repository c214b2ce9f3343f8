"""The Hopper forward (kernels/flash_fwd_sm90.cu, sm_90a): its inputs, tensor maps and launch.

The kernel's first step: float16 or bfloat16, head dim 64 or 128, q, k, v contiguous
(B, H, N, D), causal or not, GQA/MQA; no variants, varlen, KV cache or split-KV yet. The
planner does not choose it yet (the mma.sync kernels run on sm_90); `forward_sm90` runs it on
any backend whose device is an sm_90a one (the emulator's sm_90a, or an H100), for the tests
and the GPU check.
"""
from __future__ import annotations

import weakref

import numpy as np

SOURCE = "flash_fwd_sm90.cu"
HEAD_DIMS = (64, 128)
BLOCK_M = BLOCK_N = 128
THREADS = 384                       # two consumer warpgroups and a producer
BOX_BYTES = 128 * 64 * 2            # one TMA box: 128 rows of 64 16-bit elements (128 bytes)
# dtype name → (the kernel's T, CUtensorMapDataType: cuda.h's FLOAT16, BFLOAT16)
DTYPES = {"float16": ("__half", 6), "bfloat16": ("__nv_bfloat16", 9)}
_SWIZZLE_128B = 3                   # CU_TENSOR_MAP_SWIZZLE_128B


def kernel_name(dtype, head_dim: int) -> str:
    return f"flash_fwd_sm90_kernel<{DTYPES[np.dtype(dtype).name][0]}, {head_dim}>"


# the compiled kernels, per backend and name (a module is built and loaded once)
_FUNCTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _function(backend, name: str, head_dim: int):
    functions = _FUNCTIONS.setdefault(backend, {})
    if name not in functions:
        f = backend.module(SOURCE, name_expressions=[name]).get_function(name)
        f.max_dynamic_shared_size_bytes = smem_bytes(head_dim)
        functions[name] = f
    return functions[name]


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory: Q_i and a two-stage ring of K_j, V_j, each D / 64 boxes
    (mirrors Sm90FwdTraits::Smem)."""
    return (1 + 2 * 2) * (head_dim // 64) * BOX_BYTES


def check_inputs(q, k, v):
    """ValueError/TypeError naming what the kernel does not take yet."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.dtype(x.dtype).name not in DTYPES or np.dtype(x.dtype) != np.dtype(q.dtype):
            raise TypeError(f"{name}: the Hopper forward takes float16 or bfloat16 (q, k, v "
                            f"alike), got {np.dtype(x.dtype)}")
        if x.ndim != 4:
            raise ValueError(f"{name}: expected (B, H, N, D), got shape {tuple(x.shape)}")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: the Hopper forward's tensor maps need contiguous (B, H, N, D)")
    (B, H, Nq, D), (Bk, Hkv, Nk, Dk) = q.shape, k.shape
    if D not in HEAD_DIMS or Dk != D or tuple(v.shape) != tuple(k.shape) or Bk != B:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: the Hopper "
                         f"forward takes head dims {HEAD_DIMS}, k and v alike, one batch")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q's {H} heads must be a multiple of k's {Hkv}")


def forward_sm90(backend, q, k, v, *, causal: bool, scale: float):
    """(o, lse) of attention on `backend`'s sm_90a device by flash_fwd_sm90_kernel."""
    check_inputs(q, k, v)
    if not (np.isfinite(scale) and scale > 0):   # the row max is taken of S, then scaled
        raise ValueError(f"scale: the Hopper forward takes a positive finite scale, got {scale!r}")
    cc = tuple(backend.limits()["cc"])
    if cc != (9, 0):
        raise ValueError(f"backend: the Hopper forward runs on sm_90a (cc 9.0), this one is cc {cc}")
    xp = backend.xp
    (B, H, Nq, D), Hkv, Nk = q.shape, k.shape[1], k.shape[2]
    if B * H > 65535:
        raise ValueError(f"q: B·H = {B * H} blocks in the grid's y, at most 65535")
    if B * H * Nq == 0 or Nk == 0:   # no key: O = 0, lse = −inf
        return xp.zeros(q.shape, q.dtype), xp.full((B, H, Nq), -np.inf, np.float32)
    o = xp.empty(q.shape, q.dtype)
    lse = xp.empty((B, H, Nq), np.float32)
    f = _function(backend, kernel_name(q.dtype, D), D)
    data_type = DTYPES[np.dtype(q.dtype).name][1]

    def tensor_map(x, n, bh, rows=BLOCK_M):   # 3-D (D, N, B·H), boxes of 64 columns x rows
        return backend.encode_tensor_map(data_type, 3, x, [D, n, bh], [D * 2, n * D * 2],
                                         [64, rows, 1], [1, 1, 1], swizzle=_SWIZZLE_128B)

    # O by each consumer warpgroup's 64 rows
    maps = (tensor_map(q, Nq, B * H), tensor_map(k, Nk, B * Hkv), tensor_map(v, Nk, B * Hkv),
            tensor_map(o, Nq, B * H, rows=BLOCK_M // 2))
    f(((Nq + BLOCK_M - 1) // BLOCK_M, B * H), (THREADS,),
      (*maps, lse, np.int32(H), np.int32(H // Hkv), np.int32(Nq), np.int32(Nk),
       np.float32(scale), np.int32(bool(causal))), shared_mem=smem_bytes(D))
    return o, lse
