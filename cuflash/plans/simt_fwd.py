"""SIMT forward plans (flash_fwd.cu, flash_fwd_fa1.cu): mirrors `AttnTileTraits` in
kernels/attn_tile.cuh."""
from __future__ import annotations

import dataclasses
import functools

from ..families import FORWARD_ALGORITHMS
from .base import DTYPE_NAMES, ELEMENTS, Plan, dtype_name

# Head-dim buckets: a kernel is compiled for a bucket D and runs any d <= D, the columns
# d..D-1 zero-padded in shared memory. Larger d is split into D-wide chunks of the
# largest bucket (the launch's `num_d_chunks`): S sums over every chunk, and each chunk
# of O is its own block. float64 stops at 128 (a 256-wide double tile does not fit 64 KB).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
_BUCKETS_BY_ACCUM = {4: HEAD_DIM_BUCKETS, 8: (32, 64, 128)}

# Every SIMT forward kernel runs 4 warps laid out as 4 lane-rows x 8 lane-columns each
# (AttnTileTraits in attn_tile.cuh, which static_asserts the divisibility this implies).
NUM_WARPS = 4
SMEM_PAD = 1  # accumulator elements added to each shared row (bank-conflict padding)

# Candidate (block_m, block_n) per (accumulator bytes, head-dim bucket), best first.
# simt_forward_plan takes the first that fits the device's opt-in shared memory; the last
# of each list fits 64 KB, the smallest opt-in limit of any sm_70+ GPU (sm_75).
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


def attention_smem_bytes(accum_bytes: int, head_dim: int, block_m: int, block_n: int) -> int:
    """Dynamic shared memory of one attention-forward block (mirrors AttnTileTraits).

    Q tile [BLOCK_M][D + pad], K and V tiles [BLOCK_N][D + pad] and the probability
    tile P̃ [BLOCK_M][BLOCK_N + pad], all in the accumulation type.
    """
    row = head_dim + SMEM_PAD
    elems = block_m * row + 2 * block_n * row + block_m * (block_n + SMEM_PAD)
    return elems * accum_bytes


@dataclasses.dataclass(frozen=True)
class SimtFwdPlan(Plan):
    """One launchable specialization of a SIMT forward attention kernel."""

    dynamic_smem = True

    kernel: str            # a forward family: "flash_fwd" (FA2) or "flash_fwd_fa1"
    dtype: str             # "float16", "bfloat16", "float32" or "float64"
    head_dim_bucket: int   # compile-time D; runs any d <= D
    block_m: int           # Br: query rows per tile
    block_n: int           # Bc: keys per tile
    num_threads: int

    @property
    def smem_bytes(self) -> int:
        return attention_smem_bytes(self.accum_bytes, self.head_dim_bucket,
                                    self.block_m, self.block_n)

    @property
    def score_tile(self) -> tuple:
        """(query rows, keys) of the kernel's score tiles: a block mask's granularity."""
        return self.block_m, self.block_n

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim_bucket} "
                f"Br={self.block_m} Bc={self.block_n} threads={self.num_threads} "
                f"smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim_bucket, self.block_m, self.block_n,
                                 self.num_threads // 32)


def head_dim_buckets(dtype) -> tuple[int, ...]:
    return _BUCKETS_BY_ACCUM[ELEMENTS[dtype_name(dtype)].accum_bytes]


def head_dim_bucket(d: int, dtype) -> int:
    """The smallest bucket >= d; d above the largest bucket runs in chunks of it."""
    if d < 1:
        raise ValueError(f"head dim d must be >= 1; got d={d}")
    buckets = head_dim_buckets(dtype)
    for b in buckets:
        if d <= b:
            return b
    return buckets[-1]


def _candidates(kernel, dtype, bucket):
    tiles = _CANDIDATES[(ELEMENTS[dtype].accum_bytes, bucket)]
    if kernel == FORWARD_ALGORITHMS["fa1"].name:
        # FA1 is the paper's loop order, kept for teaching and cross-checking, not speed:
        # one (small, fits-everywhere) tile per bucket halves its compile-gate time.
        tiles = tiles[-1:]
    return [SimtFwdPlan(kernel, dtype, bucket, bm, bn, NUM_WARPS * 32) for bm, bn in tiles]


@functools.cache
def all_simt_fwd_plans() -> tuple[SimtFwdPlan, ...]:
    """Every SIMT forward specialization the library can launch (finite; for the gate)."""
    return tuple(p for kernel in (f.name for f in FORWARD_ALGORITHMS.values())
                 for dt in DTYPE_NAMES for bucket in head_dim_buckets(dt)
                 for p in _candidates(kernel, dt, bucket))


def simt_forward_plan(d: int, dtype, *, max_smem: int, algorithm: str = "fa2") -> SimtFwdPlan:
    """The SIMT kernel's plan (flash_fwd.cu or flash_fwd_fa1.cu) for head dim d: the first
    candidate tile that fits `max_smem` bytes of shared memory per block."""
    name = dtype_name(dtype)
    kernel = FORWARD_ALGORITHMS[algorithm].name
    cands = _candidates(kernel, name, head_dim_bucket(d, name))
    for plan in cands:
        if plan.smem_bytes <= max_smem:
            return plan
    need = min(p.smem_bytes for p in cands)
    raise ValueError(
        f"no {algorithm} tile plan for head dim d={d} ({name}) fits this "
        f"device's {max_smem} bytes of shared memory per block; the smallest needs {need} "
        f"bytes. Reduce d (or use float32/16-bit inputs instead of float64), or use "
        f"backend='numpy'.")
