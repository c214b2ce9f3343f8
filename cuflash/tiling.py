"""Tile plans: on-chip memory turned into block sizes.

Two things live here:

* the papers' rule, `paper_block_sizes(M, d)`: for M elements of SRAM,
  Bc = ceil(M / 4d) and Br = min(Bc, d) (FlashAttention, Algorithm 1, line 1);
* the plans the kernels actually launch. A plan is a frozen `KernelPlan`; its
  shared-memory size comes from `attention_smem_bytes`, which mirrors the C++ traits
  struct `AttnTileTraits` in `kernels/attn_tile.cuh` term for term. That formula exists
  once here and once there (with messaged static_asserts); nothing else computes it.

The set of plans is finite: `all_plans()` lists every specialization the library can
launch, and the compile gate compiles exactly those.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _dtypes

# Head-dim buckets: a kernel is compiled for a bucket D and runs any d <= D, the columns
# d..D-1 zero-padded in shared memory. Larger d is split into D-wide chunks of the
# largest bucket (see `head_dim_chunks`): S sums over every chunk, and each chunk of O is
# its own block. float64 stops at 128 (a 256-wide double tile does not fit 64 KB).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
_BUCKETS_BY_ACCUM = {4: HEAD_DIM_BUCKETS, 8: (32, 64, 128)}

# Every forward kernel runs 4 warps laid out as 4 lane-rows x 8 lane-columns each
# (see attn_tile.cuh); the traits static_assert the divisibility this implies.
NUM_WARPS = 4
LANE_ROWS = 4
LANE_COLS = 8
SMEM_PAD = 1  # accumulator elements added to each shared row (bank-conflict padding)

# Representative limits for backends without a device (the emulator): an A100 (sm_80).
EMULATOR_LIMITS = {"max_smem": 163 * 1024, "sm_count": 108, "cc": (8, 0)}

# Candidate (block_m, block_n) per (accumulator bytes, head-dim bucket), best first.
# plan_forward takes the first that fits the device's opt-in shared memory; the last of
# each list fits 64 KB, the smallest opt-in limit of any sm_70+ GPU (sm_75).
#   The SIMT kernel keeps BLOCK_M/16 rows x HEAD_DIM/8 columns of O in registers per
#   thread (doubles count twice); the lists keep that <= 64 registers' worth so ptxas
#   never spills.
_CANDIDATES = {
    (4, 32): ((64, 64),),
    (4, 64): ((64, 64), (64, 32)),
    (4, 128): ((64, 32), (32, 16)),
    (4, 256): ((32, 16), (16, 16)),
    (8, 32): ((64, 32), (32, 32)),
    (8, 64): ((32, 32), (32, 16)),
    (8, 128): ((32, 16), (16, 16)),
}

KERNEL_SOURCES = {
    "flash_fwd": "flash_fwd.cu",
    "flash_fwd_fa1": "flash_fwd_fa1.cu",
}
_KERNEL_FUNC = {
    "flash_fwd": "flash_fwd_kernel",
    "flash_fwd_fa1": "flash_fwd_fa1_kernel",
}


def paper_block_sizes(M: int, d: int) -> tuple[int, int]:
    """The papers' rule, returned as (Br, Bc): Bc = ceil(M / 4d), Br = min(Bc, d)."""
    if M < 1 or d < 1:
        raise ValueError(f"paper_block_sizes needs M >= 1 and d >= 1; got M={M}, d={d}")
    bc = math.ceil(M / (4 * d))
    return min(bc, d), bc  # (Br, Bc)


def attention_smem_bytes(accum_bytes: int, head_dim: int, block_m: int, block_n: int) -> int:
    """Dynamic shared memory of one attention-forward block (mirrors AttnTileTraits).

    Q tile [BLOCK_M][D + pad], K and V tiles [BLOCK_N][D + pad] and the probability
    tile P̃ [BLOCK_M][BLOCK_N + pad], all in the accumulation type.
    """
    row = head_dim + SMEM_PAD
    elems = block_m * row + 2 * block_n * row + block_m * (block_n + SMEM_PAD)
    return elems * accum_bytes


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """One launchable specialization of a forward attention kernel."""

    kernel: str            # "flash_fwd" (FA2) or "flash_fwd_fa1"
    dtype: str             # NumPy dtype name: "float16", "bfloat16", "float32", "float64"
    head_dim_bucket: int   # compile-time D; runs any d <= D
    block_m: int           # Br: query rows per tile
    block_n: int           # Bc: keys per tile
    num_threads: int

    @property
    def accum_bytes(self) -> int:
        return _dtypes.accum_dtype(np.dtype(self.dtype)).itemsize

    @property
    def smem_bytes(self) -> int:
        return attention_smem_bytes(self.accum_bytes, self.head_dim_bucket,
                                    self.block_m, self.block_n)

    @property
    def source(self) -> str:
        return KERNEL_SOURCES[self.kernel]

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim_bucket} "
                f"Br={self.block_m} Bc={self.block_n} threads={self.num_threads} "
                f"smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        ctype = _dtypes.c_type(np.dtype(self.dtype))
        return (f"{_KERNEL_FUNC[self.kernel]}<{ctype}, {self.head_dim_bucket}, "
                f"{self.block_m}, {self.block_n}, {self.num_threads // 32}>")


def head_dim_buckets(dtype) -> tuple[int, ...]:
    return _BUCKETS_BY_ACCUM[_dtypes.accum_dtype(np.dtype(dtype)).itemsize]


def head_dim_bucket(d: int, dtype) -> int:
    """The smallest bucket >= d; d above the largest bucket runs in chunks of it."""
    if d < 1:
        raise ValueError(f"head dim d must be >= 1; got d={d}")
    buckets = head_dim_buckets(dtype)
    for b in buckets:
        if d <= b:
            return b
    return buckets[-1]


def head_dim_chunks(d: int, dtype) -> int:
    """How many bucket-wide chunks head dim d is split into (1 up to the largest bucket)."""
    return -(-d // head_dim_bucket(d, dtype))


def _candidates(kernel, dtype, bucket):
    dt = np.dtype(dtype)
    acc = _dtypes.accum_dtype(dt).itemsize
    tiles = _CANDIDATES[(acc, bucket)]
    if kernel == "flash_fwd_fa1":
        # FA1 is the paper's loop order, kept for teaching and cross-checking, not speed:
        # one (small, fits-everywhere) tile per bucket halves its compile-gate time.
        tiles = tiles[-1:]
    return [KernelPlan(kernel, dt.name, bucket, bm, bn, NUM_WARPS * 32) for bm, bn in tiles]


@functools.cache
def all_plans() -> tuple[KernelPlan, ...]:
    """Every forward specialization the library can launch (finite; for the gate)."""
    plans = []
    for kernel in KERNEL_SOURCES:
        for dt in _dtypes.SUPPORTED:
            for bucket in head_dim_buckets(dt):
                plans.extend(_candidates(kernel, dt, bucket))
    return tuple(plans)


def plan_forward(d: int, dtype, *, max_smem: int, sm_count=None, cc=None,
                 algorithm: str = "fa2") -> KernelPlan:
    """The plan for head dim d and dtype on a device with `max_smem` bytes per block.

    `sm_count` and `cc` are accepted for plans that will depend on them (they do not yet:
    the SIMT kernel's best tile depends only on what fits).
    """
    kernel = {"fa2": "flash_fwd", "fa1": "flash_fwd_fa1"}.get(algorithm)
    if kernel is None:
        raise ValueError(f"algorithm must be 'fa1' or 'fa2'; got {algorithm!r}")
    if not _dtypes.is_supported(dtype):
        raise TypeError(f"dtype must be one of {_dtypes.SUPPORTED_NAMES}; got {dtype}")
    bucket = head_dim_bucket(d, dtype)
    cands = _candidates(kernel, dtype, bucket)
    for plan in cands:
        if plan.smem_bytes <= max_smem:
            return plan
    need = min(p.smem_bytes for p in cands)
    raise ValueError(
        f"no {algorithm} tile plan for head dim d={d} ({np.dtype(dtype).name}) fits this "
        f"device's {max_smem} bytes of shared memory per block; the smallest needs {need} "
        f"bytes. Reduce d (or use float32/16-bit inputs instead of float64), or use "
        f"backend='numpy'.")


def device_limits():
    """{'max_smem', 'sm_count', 'cc'} of the current CuPy device."""
    import cupy
    dev = cupy.cuda.Device()
    attrs = dev.attributes
    cc = dev.compute_capability  # e.g. "80"
    return {
        "max_smem": int(attrs["MaxSharedMemoryPerBlockOptin"]),
        "sm_count": int(attrs["MultiProcessorCount"]),
        "cc": (int(cc[:-1]), int(cc[-1])),
    }
