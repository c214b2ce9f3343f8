"""Tensor-core forward plans (flash_fwd_tc.cu): mirrors `TcTileTraits` in
kernels/tc_tile.cuh (float16, bfloat16) and `Tf32TileTraits` in kernels/tf32_tile.cuh
(float32), whose shared memory is the same three swizzled tiles in the storage type.

FA2 on mma.sync: each warp owns one or two 16-row mma tiles (BLOCK_M = 16 · row_tiles ·
num_warps), S and O live in mma accumulator fragments, K/V tiles stream through a
`stages`-deep cp.async ring, shared tiles stay in the storage dtype with an XOR swizzle.
float32 runs m16n8k8 .tf32 mma (sm_80+): split tf32 (the default) splits each operand into
two tf32 parts, 3 mma per product, about fp32 accuracy; one-pass (allow_tf32=True) is one
tf32 mma per product, 10-bit mantissas. See docs/kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools

from ..families import FLASH_FWD_TC
from .base import Plan, flag

TC_DTYPES = ("float16", "bfloat16")
TC_HEAD_DIMS = (64, 128, 256)   # HEAD_DIM buckets; d a multiple of 8 up to 256 runs in one
TF32_DTYPE = "float32"
TF32_HEAD_DIMS = (64, 128, 256)  # HEAD_DIM buckets; d a multiple of 4 up to 256

# Candidate (block_m, block_n, num_warps, stages) per HEAD_DIM, best first; the last of
# each fits 64 KB (sm_75's opt-in limit). block_m = 16 · row_tiles · num_warps: D = 64 and
# 128 give each warp two 16-row mma tiles (32 rows, FlashAttention-2's d = 128 layout),
# sharing every K and V fragment load between them. ptxas registers (sm_80): D=64 128x64
# 255, D=128 128x32 248, D=256 64x16 254. Tried and rejected (spills, sm_80): D=128 128x64
# with two row tiles (148 bytes; 104 in the lean loop), D=256 with Q_i's fragments in
# registers (64x16: 8 bytes), D=256 64x32 (56 bytes) and 64x64 (424 bytes) even with Q_i in
# shared memory.
_TC_CANDIDATES = {
    64: ((128, 64, 4, 2),),
    128: ((128, 32, 4, 2),),
    256: ((64, 16, 4, 2),),
}
# GPUs with 100 KB of shared memory per SM (sm_86, sm_89, sm_120) replace two lists: there
# the 64 KB tiles above run one block of 4 warps per SM, one warp per scheduler, which
# every barrier and copy then stalls, while their tensor cores (half sm_80's rate per SM)
# keep the loop tensor-bound whatever its ldmatrix traffic. 8 warps of one row tile each
# (96 KB) keep 8 warps per SM (at D = 128, 3.24 instructions per HMMA against the two row
# tiles' 3.80 on sm_86; docs/kernels.md).
_TC_CANDIDATES_100KB = {
    128: ((128, 64, 8, 2), (128, 32, 4, 2)),
    256: ((128, 16, 8, 2), (64, 16, 4, 2)),
}

# float32: candidate (block_m, block_n, num_warps, stages) per (HEAD_DIM, split), best
# first; each list ends with a tile within 99 KB, the opt-in limit of sm_86/sm_89 (A10,
# L4): float32 tiles take twice the bytes of the 16-bit kernel's. Split tf32 holds hi/lo
# temporaries beside every mma: ptxas spilled (sm_80) at D=64 128x64 (32 bytes), D=128
# 128x32 and 64x32 (88), D=256 64x16 (48); the split lists keep to the spill-free Bc.
_TF32_CANDIDATES = {
    (64, False): ((128, 64, 8, 2),),
    (128, False): ((128, 32, 8, 2), (64, 32, 4, 2)),
    (256, False): ((64, 16, 4, 2), (64, 8, 4, 2)),
    (64, True): ((128, 32, 8, 2),),
    (128, True): ((128, 16, 8, 2),),
    (256, True): ((64, 8, 4, 2),),
}
# Consumer Blackwell (sm_120, cc 12.x) replaces two split lists: its ptxas (CUDA 12.9)
# spills D=64 128x32 (40 bytes) and D=128 128x16 (172) at 255 registers, where sm_80 to
# sm_100 do not; half the keys per tile fit (252 and 255 registers, no spill). At D=128,
# CUDA 13.5's ptxas still spills 128x8 with a 2-stage ring (4 bytes); a 3-stage ring
# (88 KB) does not, with either toolkit.
_TF32_CANDIDATES_SM120 = {
    (64, True): ((128, 16, 8, 2),),
    (128, True): ((128, 8, 8, 3),),
}


def tc_smem_bytes(elem_bytes: int, head_dim: int, block_m: int, block_n: int,
                  stages: int) -> int:
    """Dynamic shared memory of one tensor-core forward block: mirrors
    `TcTileTraits::kSmemBytes` (kernels/tc_tile.cuh) and `Tf32TileTraits::kSmemBytes`
    (kernels/tf32_tile.cuh) term for term.

    sQ  block_m · D                 Q_i (then the O tile's staging)
    sK  stages · block_n · D        the K_j ring
    sV  stages · block_n · D        the V_j ring
    all in the storage type (2 or 4 bytes), no padding (the tiles are swizzled).
    """
    q = block_m * head_dim
    k = stages * block_n * head_dim
    v = stages * block_n * head_dim
    return (q + k + v) * elem_bytes


@dataclasses.dataclass(frozen=True)
class TcPlan(Plan):
    """One launchable specialization of the tensor-core forward; the fields after `dtype`
    are the kernel's template parameters, in order (HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS,
    STAGES, then SPLIT in flash_fwd_tc.cu)."""

    dynamic_smem = True
    _split_flag = False    # SPLIT: 16-bit types have one kind of product (Tf32Plan: its field)

    kernel: str            # "flash_fwd_tc"
    dtype: str             # "float16" or "bfloat16" ("float32": Tf32Plan)
    head_dim: int          # HEAD_DIM: runs any d <= head_dim whose rows are 16-byte chunks
    block_m: int           # Br = 16 · row_tiles · num_warps
    block_n: int           # Bc
    num_warps: int
    stages: int            # depth of the K/V cp.async ring

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    @property
    def row_tiles(self) -> int:
        """16-row mma tiles per warp (`kRowTiles`): block_m / (16 · num_warps)."""
        return self.block_m // (16 * self.num_warps)

    @property
    def score_tile(self) -> tuple:
        """(query rows, keys) of the kernel's score tiles: a block mask's granularity."""
        return self.block_m, self.block_n

    @property
    def head_dim_bucket(self) -> int:
        return self.head_dim

    @property
    def smem_bytes(self) -> int:
        return tc_smem_bytes(self.element.bytes, self.head_dim, self.block_m, self.block_n,
                             self.stages)

    def _tile(self) -> str:
        return (f"D={self.head_dim} Br={self.block_m} Bc={self.block_n} "
                f"warps={self.num_warps} stages={self.stages} smem={self.smem_bytes} B")

    def __str__(self) -> str:
        return f"{self.kernel} {self.dtype} {self._tile()}"

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, self.block_m, self.block_n, self.num_warps,
                                 self.stages, flag(self._split_flag))


@dataclasses.dataclass(frozen=True)
class Tf32Plan(TcPlan):
    """A float32 tensor-core forward specialization (flash_fwd_tc_kernel<float, ...>): split
    or one-pass tf32 products. One 16-row mma tile per warp."""

    split: bool            # True: split tf32 (3 mma per product); False: one-pass tf32

    def __str__(self) -> str:
        return f"{self.kernel} {self.dtype} {tf32_mode(self.split)} {self._tile()}"

    @property
    def _split_flag(self) -> bool:
        return self.split


def tf32_mode(split: bool) -> str:
    return "split" if split else "one-pass"


def shared_100kb(cc) -> bool:
    """Whether the SMs of compute capability `cc` hold 100 KB of shared memory (sm_86,
    sm_89, sm_120), where the 16-bit forward takes 8-warp tiles."""
    return cc is not None and (cc in ((8, 6), (8, 9)) or cc[0] == 12)


def sm120(cc) -> bool:
    """Whether compute capability `cc` is consumer Blackwell's (12.x), whose ptxas needs
    smaller split-tf32 tiles."""
    return cc is not None and cc[0] == 12


def tc_fwd_candidates(dtype: str, head_dim: int, *, split: bool, cc=None) -> list[TcPlan]:
    """The tensor-core forward tiles for `dtype` and HEAD_DIM on compute capability `cc`,
    best first; `split` picks float32's split or one-pass tf32 (16-bit types have one)."""
    if dtype == TF32_DTYPE:
        table = {**_TF32_CANDIDATES, **_TF32_CANDIDATES_SM120} if sm120(cc) else _TF32_CANDIDATES
        return [Tf32Plan(FLASH_FWD_TC.name, dtype, head_dim, *c, split)
                for c in table[(head_dim, split)]]
    table = {**_TC_CANDIDATES, **_TC_CANDIDATES_100KB} if shared_100kb(cc) else _TC_CANDIDATES
    return [TcPlan(FLASH_FWD_TC.name, dtype, head_dim, *c) for c in table[head_dim]]


@functools.cache
def all_tc_plans(cc=None) -> tuple[TcPlan, ...]:
    """Every 16-bit tensor-core forward specialization a device of compute capability `cc`
    can launch (for the gate); None: of any device, the 100 KB GPUs' last."""
    plans = (p for c in ((None, (8, 6)) if cc is None else (cc,))
             for dt in TC_DTYPES for D in TC_HEAD_DIMS
             for p in tc_fwd_candidates(dt, D, split=False, cc=c))
    return tuple(dict.fromkeys(plans))


@functools.cache
def all_tf32_plans(cc=None) -> tuple[Tf32Plan, ...]:
    """Every float32 tensor-core forward specialization a device of compute capability
    `cc` can launch (for the gate); None: of any device, sm_120's last."""
    plans = (p for c in ((None, (12, 0)) if cc is None else (cc,))
             for split in (True, False) for D in TF32_HEAD_DIMS
             for p in tc_fwd_candidates(TF32_DTYPE, D, split=split, cc=c))
    return tuple(dict.fromkeys(plans))

