"""Tile plans: on-chip memory turned into block sizes.

* the papers' rule, `paper_block_sizes(M, d)`: for M elements of SRAM,
  Bc = ceil(M / 4d) and Br = min(Bc, d) (FlashAttention, Algorithm 1, line 1);
* the plans the kernels actually launch, one frozen dataclass per kernel family
  (`families.py`): `KernelPlan` (forward), `BwdPlan` and `BwdPreprocessPlan` (backward),
  `SoftmaxPlan`. A plan names its family and carries the family's template parameters;
  its shared-memory size comes from one formula that mirrors the C++ traits struct
  (`AttnTileTraits` in `kernels/attn_tile.cuh`, `BwdTileTraits` in `kernels/bwd_tile.cuh`)
  term for term, checked against ptxas by the compile gate.

The set of plans is finite: `specializations()` lists every specialization the library
can launch, and the compile gate compiles exactly those.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _dtypes
from .families import (FLASH_BWD_DKDV_TC, FLASH_BWD_DKDV_TF32, FLASH_BWD_DQ_TC,
                       FLASH_BWD_DQ_TF32)
from .families import (FAMILIES, FLASH_BWD_DKDV, FLASH_BWD_DQ, FLASH_BWD_PREPROCESS,
                       FLASH_FWD_TC, FLASH_FWD_TF32, FORWARD_ALGORITHMS, SOFTMAX_COLS,
                       SOFTMAX_ROWS)

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


class _Plan:
    """What every plan offers: the fields `kernel` (a name in `families.FAMILIES`) and
    `dtype`, and `num_threads`, `smem_bytes` (its family's formula), `source` and
    `name_expression` for the launch and the gate. `dynamic_smem`: whether smem_bytes is
    the launch's dynamic shared memory (else the kernel's static arrays)."""

    dynamic_smem = False

    @property
    def accum_bytes(self) -> int:
        return _dtypes.accum_dtype(np.dtype(self.dtype)).itemsize

    @property
    def source(self) -> str:
        return FAMILIES[self.kernel].source

    def _instantiate(self, *template_args) -> str:
        """`<kernel>_kernel<ctype, args...>`: the name expression NVRTC instantiates."""
        args = ", ".join([_dtypes.c_type(np.dtype(self.dtype)), *map(str, template_args)])
        return f"{FAMILIES[self.kernel].function}<{args}>"


@dataclasses.dataclass(frozen=True)
class KernelPlan(_Plan):
    """One launchable specialization of a forward attention kernel."""

    dynamic_smem = True

    kernel: str            # a forward family: "flash_fwd" (FA2) or "flash_fwd_fa1"
    dtype: str             # NumPy dtype name: "float16", "bfloat16", "float32", "float64"
    head_dim_bucket: int   # compile-time D; runs any d <= D
    block_m: int           # Br: query rows per tile
    block_n: int           # Bc: keys per tile
    num_threads: int

    @property
    def smem_bytes(self) -> int:
        return attention_smem_bytes(self.accum_bytes, self.head_dim_bucket,
                                    self.block_m, self.block_n)

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim_bucket} "
                f"Br={self.block_m} Bc={self.block_n} threads={self.num_threads} "
                f"smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim_bucket, self.block_m, self.block_n,
                                 self.num_threads // 32)


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


def _candidates(kernel, dtype, bucket):
    dt = np.dtype(dtype)
    acc = _dtypes.accum_dtype(dt).itemsize
    tiles = _CANDIDATES[(acc, bucket)]
    if kernel == FORWARD_ALGORITHMS["fa1"].name:
        # FA1 is the paper's loop order, kept for teaching and cross-checking, not speed:
        # one (small, fits-everywhere) tile per bucket halves its compile-gate time.
        tiles = tiles[-1:]
    return [KernelPlan(kernel, dt.name, bucket, bm, bn, NUM_WARPS * 32) for bm, bn in tiles]


@functools.cache
def all_plans() -> tuple[KernelPlan, ...]:
    """Every forward specialization the library can launch (finite; for the gate)."""
    plans = []
    for kernel in (f.name for f in FORWARD_ALGORITHMS.values()):
        for dt in _dtypes.SUPPORTED:
            for bucket in head_dim_buckets(dt):
                plans.extend(_candidates(kernel, dt, bucket))
    return tuple(plans)


def _plan_simt(d: int, dtype, *, max_smem: int, algorithm: str) -> KernelPlan:
    """The SIMT kernel's plan (flash_fwd.cu or flash_fwd_fa1.cu): the first candidate tile
    that fits `max_smem`."""
    kernel = FORWARD_ALGORITHMS[algorithm].name
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


def plan_forward(d: int, dtype, *, max_smem: int, sm_count=None, cc=None,
                 algorithm: str = "fa2", aligned: bool = True, allow_tf32: bool = False):
    """The plan for head dim d and dtype on a device with `max_smem` bytes per block and
    compute capability `cc` ((major, minor); None: unknown, SIMT only): a `TcPlan` where
    tensor cores apply, else a SIMT `KernelPlan` (see `forward_path`, which also says why).
    `aligned`: the inputs allow 16-byte loads (base pointers and strides). `allow_tf32`:
    float32 may run one-pass tf32 (else split tf32; see `forward_path`). Attention
    variants take the same plan as a plain call: every forward kernel runs them."""
    return forward_path(d, dtype, cc, aligned, max_smem=max_smem, sm_count=sm_count,
                        algorithm=algorithm, allow_tf32=allow_tf32)[0]


# ── tensor-core forward (flash_fwd_tc.cu) ─────────────────────────────────────────────
#
# FA2 on mma.sync for float16 (sm_75+) and bfloat16 (sm_80+): each warp owns one or two
# 16-row mma tiles (BLOCK_M = 16 · row_tiles · num_warps), S and O live in mma accumulator fragments, K/V tiles stream
# through a `stages`-deep cp.async ring, shared tiles stay in the storage dtype with an
# XOR swizzle. See `TcTileTraits` in kernels/tc_tile.cuh and docs/kernels.md.
TC_DTYPES = ("float16", "bfloat16")
TC_MIN_CC = {"float16": (7, 5), "bfloat16": (8, 0)}   # mma.m16n8k8 f16; m16n8k16 bf16
TC_HEAD_DIMS = (64, 128, 256)   # HEAD_DIM buckets; d a multiple of 8 up to 256 runs in one
TC_D_MULTIPLE = 8               # d % 8 == 0: a row is whole 16-byte chunks

# Candidate (block_m, block_n, num_warps, stages) per HEAD_DIM, best first; the last of
# each fits 64 KB (sm_75's opt-in limit). block_m = 16 · row_tiles · num_warps: D = 64 and
# 128 give each warp two 16-row mma tiles (32 rows, FlashAttention-2's d = 128 layout),
# sharing every K and V fragment load between them. ptxas registers (sm_80): D=64 128x64
# 253, D=128 128x32 248, D=256 64x16 210. Tried and rejected (spills, sm_80): D=128 128x64
# with two row tiles (148 bytes), D=256 with Q_i's fragments in registers (64x16: 8 bytes),
# D=256 64x32 (56 bytes) and 64x64 (424 bytes) even with Q_i in shared memory.
_TC_CANDIDATES = {
    64: ((128, 64, 4, 2),),
    128: ((128, 32, 4, 2),),
    256: ((64, 16, 4, 2),),
}


def tc_smem_bytes(elem_bytes: int, head_dim: int, block_m: int, block_n: int,
                  stages: int) -> int:
    """Dynamic shared memory of one tensor-core forward block: mirrors
    `TcTileTraits::kSmemBytes` (kernels/tc_tile.cuh) term for term.

    sQ  block_m · D                 Q_i (then the O tile's staging)
    sK  stages · block_n · D        the K_j ring
    sV  stages · block_n · D        the V_j ring
    all in the storage type (2 bytes), no padding (the tiles are swizzled).
    """
    q = block_m * head_dim
    k = stages * block_n * head_dim
    v = stages * block_n * head_dim
    return (q + k + v) * elem_bytes


@dataclasses.dataclass(frozen=True)
class TcPlan(_Plan):
    """One launchable specialization of the tensor-core forward; the fields after `dtype`
    are the kernel's template parameters, in order (HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS,
    STAGES in flash_fwd_tc.cu)."""

    dynamic_smem = True

    kernel: str            # "flash_fwd_tc"
    dtype: str             # "float16" or "bfloat16"
    head_dim: int          # HEAD_DIM: runs any d <= head_dim that is a multiple of 8
    block_m: int           # Br = 16 · row_tiles · num_warps
    block_n: int           # Bc
    num_warps: int
    stages: int            # depth of the K/V cp.async ring

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    @property
    def row_tiles(self) -> int:
        """16-row mma tiles per warp (`TcTileTraits::kRowTiles`): block_m / (16 · num_warps)."""
        return self.block_m // (16 * self.num_warps)

    @property
    def head_dim_bucket(self) -> int:
        return self.head_dim

    @property
    def smem_bytes(self) -> int:
        return tc_smem_bytes(np.dtype(self.dtype).itemsize, self.head_dim, self.block_m,
                             self.block_n, self.stages)

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim} Br={self.block_m} "
                f"Bc={self.block_n} warps={self.num_warps} stages={self.stages} "
                f"smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, self.block_m, self.block_n, self.num_warps,
                                 self.stages)


def _tc_candidates(dtype, head_dim):
    return [TcPlan(FLASH_FWD_TC.name, np.dtype(dtype).name, head_dim, bm, bn, w, st)
            for bm, bn, w, st in _TC_CANDIDATES[head_dim]]


@functools.cache
def all_tc_plans() -> tuple[TcPlan, ...]:
    """Every tensor-core specialization the library can launch (for the gate)."""
    return tuple(p for dt in TC_DTYPES for D in TC_HEAD_DIMS for p in _tc_candidates(dt, D))


def _tensor_core_refusal(d, cc, aligned, *, what, need, head_dims, operands):
    """Why the tensor-core kernels for `what` ("float16", "float32 (tf32)", ...) cannot take
    head dim d on a device of compute capability `cc` (at least `need`), or None when they
    can: d a multiple of a 16-byte chunk's elements up to head_dims[-1], and `operands` (the
    arrays read by 16-byte loads) `aligned`. One wording for every tensor-core path."""
    elems = TF32_D_MULTIPLE if what == TF32_WHAT else TC_D_MULTIPLE
    if cc < need:
        return (f"SIMT: {what} tensor cores need sm_{need[0]}{need[1]}; the device is "
                f"sm_{cc[0]}{cc[1]}")
    if d % elems:
        return (f"SIMT: head dim d={d} is not a multiple of {elems} ({what} tensor-core rows "
                f"are whole 16-byte chunks)")
    if d > head_dims[-1]:
        return f"SIMT: head dim d={d} > {head_dims[-1]}, the largest {what} tensor-core tile"
    if not aligned:
        return (f"SIMT: {operands} is not 16-byte aligned (a base pointer, or a batch, head or "
                f"row stride that is not a multiple of {elems} elements)")
    return None


def _no_tile_fits(what, D, max_smem, pass_=""):
    return (f"SIMT: no {what} tensor-core {pass_}tile for D={D} fits {max_smem} bytes of "
            f"shared memory per block")


def forward_path(d: int, dtype, cc, aligned: bool = True, *, max_smem: int,
                 sm_count=None, algorithm: str = "fa2", allow_tf32: bool = False):
    """(plan, reason): the forward kernel a call takes, and why, in words.

    Tensor cores (`TcPlan`) where `algorithm` is "fa2", the dtype is float16 (sm_75+) or
    bfloat16 (sm_80+), d is a multiple of 8 up to 256, the inputs allow 16-byte loads
    (`aligned`) and a tile fits `max_smem`; float32 on sm_80+ takes the tf32 kernel
    (`Tf32Plan`: split tf32 by default, one-pass with `allow_tf32`; see `_tf32_path`);
    the SIMT kernel (`KernelPlan`) otherwise. Attention variants (window, softcap, ALiBi,
    bias, mask, dropout) do not change the path: every forward kernel takes them
    (kernels/variants.cuh).
    `cc` is (major, minor), or None when unknown (SIMT)."""
    dt = np.dtype(dtype)
    simt = functools.partial(_plan_simt, d, dt, max_smem=max_smem, algorithm=algorithm)
    if algorithm != "fa2":
        return simt(), f"SIMT: algorithm={algorithm!r} runs the FA1 loop order (SIMT only)"
    if dt.name not in TC_DTYPES + (TF32_DTYPE,):
        return simt(), (f"SIMT: {dt.name} has no tensor-core path (float16, bfloat16 and "
                        f"float32 do)")
    if cc is None:
        return simt(), "SIMT: the device's compute capability is unknown"
    cc = tuple(cc)
    if dt.name == TF32_DTYPE:
        return _tf32_path(d, cc, aligned, max_smem=max_smem, allow_tf32=allow_tf32, simt=simt)
    why = _tensor_core_refusal(d, cc, aligned, what=dt.name, need=TC_MIN_CC[dt.name],
                               head_dims=TC_HEAD_DIMS, operands="q, k or v")
    if why:
        return simt(), why
    D = next(b for b in TC_HEAD_DIMS if d <= b)
    for plan in _tc_candidates(dt, D):
        if plan.smem_bytes <= max_smem:
            instr = "mma.m16n8k16" if cc >= (8, 0) else "2 x mma.m16n8k8"
            return plan, f"tensor cores: {instr} on sm_{cc[0]}{cc[1]}"
    return simt(), _no_tile_fits(dt.name, D, max_smem)


# ── float32 forward on tensor cores (flash_fwd_tc.cu, flash_fwd_tf32_kernel) ───────────────────────────────
#
# The tensor-core forward's tiles with float32 in shared memory and m16n8k8 .tf32 mma
# (sm_80+). Split tf32 (the default): each operand split into two tf32 parts, 3 mma per
# product, about fp32 accuracy; one-pass (allow_tf32=True): one tf32 mma per product,
# 10-bit mantissas. See `Tf32TileTraits` in kernels/tf32_tile.cuh and docs/kernels.md.
TF32_DTYPE = "float32"
TF32_WHAT = "float32 (tf32)"     # the reasons' name for these kernels
TF32_MIN_CC = (8, 0)             # mma.m16n8k8 .tf32, cvt.rna.tf32.f32, cp.async
TF32_HEAD_DIMS = (64, 128, 256)  # HEAD_DIM buckets; d a multiple of 4 up to 256
TF32_D_MULTIPLE = 4              # d % 4 == 0: a row of floats is whole 16-byte chunks

# Candidate (block_m, block_n, num_warps, stages) per (HEAD_DIM, split), best first; each
# list ends with a tile within 99 KB, the opt-in limit of sm_86/sm_89 (A10, L4): float32
# tiles take twice the bytes of the 16-bit kernel's. Split tf32 holds hi/lo temporaries
# beside every mma: ptxas spilled (sm_80) at D=64 128x64 (32 bytes), D=128 128x32 and
# 64x32 (88), D=256 64x16 (48); the split lists keep to the spill-free Bc.
_TF32_CANDIDATES = {
    (64, False): ((128, 64, 8, 2),),
    (128, False): ((128, 32, 8, 2), (64, 32, 4, 2)),
    (256, False): ((64, 16, 4, 2), (64, 8, 4, 2)),
    (64, True): ((128, 32, 8, 2),),
    (128, True): ((128, 16, 8, 2),),
    (256, True): ((64, 8, 4, 2),),
}


def tf32_smem_bytes(head_dim: int, block_m: int, block_n: int, stages: int) -> int:
    """Dynamic shared memory of one float32 tensor-core forward block: mirrors
    `Tf32TileTraits::kSmemBytes` (kernels/tf32_tile.cuh) term for term.

    sQ  block_m · D                 Q_i (then the O tile's staging)
    sK  stages · block_n · D        the K_j ring
    sV  stages · block_n · D        the V_j ring
    all float32 (4 bytes), no padding (the tiles are swizzled).
    """
    q = block_m * head_dim
    k = stages * block_n * head_dim
    v = stages * block_n * head_dim
    return (q + k + v) * 4


@dataclasses.dataclass(frozen=True)
class Tf32Plan(_Plan):
    """One launchable specialization of the float32 tensor-core forward; the fields after
    `dtype` are the kernel's template parameters, in order (HEAD_DIM, BLOCK_M, BLOCK_N,
    NUM_WARPS, STAGES, SPLIT of flash_fwd_tf32_kernel in flash_fwd_tc.cu)."""

    dynamic_smem = True

    kernel: str            # "flash_fwd_tf32"
    dtype: str             # "float32"
    head_dim: int          # HEAD_DIM: runs any d <= head_dim that is a multiple of 4
    block_m: int           # Br = 16 · num_warps
    block_n: int           # Bc
    num_warps: int
    stages: int            # depth of the K/V cp.async ring
    split: bool            # True: split tf32 (3 mma per product); False: one-pass tf32

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    @property
    def head_dim_bucket(self) -> int:
        return self.head_dim

    @property
    def smem_bytes(self) -> int:
        return tf32_smem_bytes(self.head_dim, self.block_m, self.block_n, self.stages)

    def __str__(self) -> str:
        mode = "split" if self.split else "one-pass"
        return (f"{self.kernel} {self.dtype} {mode} D={self.head_dim} Br={self.block_m} "
                f"Bc={self.block_n} warps={self.num_warps} stages={self.stages} "
                f"smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, self.block_m, self.block_n, self.num_warps,
                                 self.stages, "true" if self.split else "false")


def _tf32_candidates(head_dim, *, split):
    return [Tf32Plan(FLASH_FWD_TF32.name, TF32_DTYPE, head_dim, bm, bn, w, st, split)
            for bm, bn, w, st in _TF32_CANDIDATES[(head_dim, split)]]


@functools.cache
def all_tf32_plans() -> tuple[Tf32Plan, ...]:
    """Every float32 tensor-core specialization the library can launch (for the gate)."""
    return tuple(p for split in (True, False) for D in TF32_HEAD_DIMS
                 for p in _tf32_candidates(D, split=split))


def _tf32_path(d, cc, aligned, *, max_smem, allow_tf32, simt):
    """forward_path for float32 on a device of known compute capability `cc`."""
    why = _tensor_core_refusal(d, cc, aligned, what=TF32_WHAT, need=TF32_MIN_CC,
                               head_dims=TF32_HEAD_DIMS, operands="q, k or v")
    if why:
        return simt(), why
    D = next(b for b in TF32_HEAD_DIMS if d <= b)
    for plan in _tf32_candidates(D, split=not allow_tf32):
        if plan.smem_bytes <= max_smem:
            return plan, (f"tensor cores: mma.m16n8k8.tf32 on sm_{cc[0]}{cc[1]}, "
                          f"{_tf32_mode(allow_tf32)}")
    return simt(), _no_tile_fits(TF32_WHAT, D, max_smem)


def _tf32_mode(allow_tf32):
    return ("one-pass tf32 (allow_tf32=True)" if allow_tf32
            else "split tf32, 3 mma per product (allow_tf32=True: one)")

# ── backward (flash_bwd.cu) ────────────────────────────────────────────────────────────
#
# The backward kernels are plain SIMT with *static* shared memory (every tile stays under
# the 48 KB any device gives without opting in), laid out differently from the forward:
# a warp is cut into groups of G lanes, a group owns `rows_per_group` rows (keys in the
# dK/dV kernel, queries in the dQ kernel) and lane g of the group holds the head-dim
# columns g, g+G, … (DPL = D/G of them); the other operand streams through shared memory
# in tiles of `tile_rows` rows. See `BwdTileTraits` in kernels/bwd_tile.cuh.
#
# Head dims above the largest bucket run the kernels with `chunked=True`, in 256-wide
# chunks: a block owns one chunk of its output's columns and sums the scores over every

# ── split-KV (seqlens.cuh) ──────────────────────────────────────────────────────────────

MAX_SPLITS = 128            # FlashAttention-2's cap
SPLIT_FULL_WAVES = 0.8      # this many blocks per SM (as a fraction) already fill the GPU
SPLIT_EFFICIENCY = 0.85     # take the fewest splits within this fraction of the best


def split_kv_count(blocks: int, key_tiles: int, sm_count) -> int:
    """How many key ranges (split-KV) a forward launch of `blocks` blocks (query blocks ×
    heads × batch, and head-dim chunks), each walking `key_tiles` key tiles, should cut the
    keys into on `sm_count` SMs. FlashAttention-2's rule: no split once the blocks fill
    SPLIT_FULL_WAVES of the SMs; else, of the split counts s ≤ min(MAX_SPLITS, SMs, key
    tiles) that change the tiles per split, the fewest whose wave efficiency
    (blocks·s / SMs) / ⌈blocks·s / SMs⌉ is within SPLIT_EFFICIENCY of the best. The merge
    (one lse-weighted sum per split) is not modelled: it is small next to the tiles."""
    if not sm_count or blocks <= 0 or blocks >= SPLIT_FULL_WAVES * sm_count:
        return 1
    cap = min(MAX_SPLITS, sm_count, key_tiles)
    if cap <= 1:
        return 1

    def efficiency(s):
        waves = blocks * s / sm_count
        return waves / math.ceil(waves)

    counts = [s for s in range(1, cap + 1)
              if s == 1 or -(-key_tiles // s) != -(-key_tiles // (s - 1))]
    best = max(efficiency(s) for s in counts)
    return next(s for s in counts if efficiency(s) >= SPLIT_EFFICIENCY * best)


# chunk (`bwd_head_dim_chunks`). Causal is a run-time argument of every backward kernel.
BWD_HEAD_DIM_BUCKETS = (32, 64, 128, 256)   # the same for every dtype (double too)
BWD_NUM_WARPS = 8                # 256 threads per block for the dK/dV and dQ kernels
BWD_PREPROCESS_ROWS = 4          # rows (one warp each) per block of the preprocess kernel
BWD_SMEM_TILE_BYTES = 32 * 1024  # the streamed operand pair (2 · tile_rows · D accumulators)
BWD_KERNELS = (FLASH_BWD_DKDV.name, FLASH_BWD_DQ.name)


def bwd_smem_bytes(kernel: str, accum_bytes: int, head_dim: int, tile_rows: int,
                   block_rows: int, chunked: bool) -> int:
    """Static shared memory of one backward block: mirrors `BwdTileTraits::kSmemBytes`
    (kernels/bwd_tile.cuh) term for term, and is checked against ptxas by the gate.

    tile pair  2 · tile_rows · D      (Q_i, dO_i for dK/dV; K_j, V_j for dQ)
    row stats  2 · tile_rows          (lse_i, D_i; dK/dV only)
    scores     2 · tile_rows · block_rows   (Σ S_ij, Σ dP_ij; chunked only)
    """
    tile = tile_rows * head_dim
    row_stat = tile_rows if kernel == FLASH_BWD_DKDV.name else 0
    scores = tile_rows * block_rows if chunked else 0
    return (2 * tile + 2 * row_stat + 2 * scores) * accum_bytes


@dataclasses.dataclass(frozen=True)
class BwdPlan(_Plan):
    """One launchable specialization of a backward kernel (dK/dV or dQ, maybe chunked).

    The fields are the kernel's template parameters, in order (their UPPER_CASE names in
    flash_bwd.cu). A block owns `block_rows` = num_warps · (32/G) · rows_per_group rows
    (Bc keys of the dK/dV kernel, Br queries of the dQ kernel); the streamed operand comes
    in tiles of `tile_rows` rows.
    """

    kernel: str            # one of BWD_KERNELS
    dtype: str             # NumPy dtype name
    head_dim_bucket: int   # HEAD_DIM
    lanes_per_row: int     # G
    rows_per_group: int
    num_warps: int
    tile_rows: int
    chunked: bool          # d above the bucket: D-wide chunks, num_d_chunks at run time

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    @property
    def block_rows(self) -> int:
        return self.num_warps * (32 // self.lanes_per_row) * self.rows_per_group

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.kernel, self.accum_bytes, self.head_dim_bucket,
                              self.tile_rows, self.block_rows, self.chunked)

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim_bucket} G={self.lanes_per_row} "
                f"rows={self.block_rows} tile={self.tile_rows} threads={self.num_threads}"
                f"{' chunked' if self.chunked else ''} smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim_bucket, self.lanes_per_row, self.rows_per_group,
                                 self.num_warps, self.tile_rows,
                                 "true" if self.chunked else "false")


@dataclasses.dataclass(frozen=True)
class BwdPreprocessPlan(_Plan):
    """The preprocess kernel D = rowsum(dO ∘ O): one warp per row, `rows_per_block` rows
    (ROWS_PER_BLOCK) per block. No shared memory."""

    dtype: str
    rows_per_block: int
    kernel = FLASH_BWD_PREPROCESS.name
    smem_bytes = 0

    @property
    def num_threads(self) -> int:
        return self.rows_per_block * 32

    def __str__(self) -> str:
        return f"{self.kernel} {self.dtype} rows={self.rows_per_block} threads={self.num_threads}"

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.rows_per_block)


def bwd_preprocess_plan(dtype) -> BwdPreprocessPlan:
    return BwdPreprocessPlan(np.dtype(dtype).name, BWD_PREPROCESS_ROWS)


def bwd_head_dim_bucket(d: int) -> int:
    """The smallest backward bucket >= d; d above the largest runs in chunks of it."""
    if d < 1:
        raise ValueError(f"head dim d must be >= 1; got d={d}")
    for b in BWD_HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    return BWD_HEAD_DIM_BUCKETS[-1]


def bwd_head_dim_chunks(d: int) -> int:
    """How many bucket-wide chunks the backward splits head dim d into."""
    return -(-d // bwd_head_dim_bucket(d))


def _bwd_shape(dtype, D):
    """(G, rows_per_group, tile_rows) of the backward tiles for `dtype` and bucket D."""
    acc_bytes = _dtypes.accum_dtype(np.dtype(dtype)).itemsize
    # Columns per lane: 8 float accumulators (4 doubles) keep the 4·rows·DPL register
    # accumulators (K, V, dK, dV) near 64 words per thread.
    dpl = 8 if acc_bytes == 4 else 4
    G = max(1, min(32, D // dpl))
    # Two rows per lane group reuse each shared-memory read twice; the one case whose
    # DPL is forced up (double, D=256 → DPL 8) keeps one row to stay spill-free.
    rows_per_group = 1 if (acc_bytes == 8 and D // G > 4) else 2
    tile_rows = min(64, BWD_SMEM_TILE_BYTES // (2 * D * acc_bytes))
    return G, rows_per_group, tile_rows


def plan_backward(d: int, dtype, *, max_smem: int = 48 * 1024, sm_count=None,
                  cc=None) -> tuple[BwdPlan, BwdPlan]:
    """The (dK/dV, dQ) plans for head dim d and dtype; chunked for d above the largest
    bucket (`bwd_head_dim_chunks(d)` chunks, a run-time argument)."""
    if not _dtypes.is_supported(dtype):
        raise TypeError(f"dtype must be one of {_dtypes.SUPPORTED_NAMES}; got {dtype}")
    D = bwd_head_dim_bucket(d)
    G, rpg, tile_rows = _bwd_shape(dtype, D)
    plans = tuple(BwdPlan(kernel, np.dtype(dtype).name, D, G, rpg, BWD_NUM_WARPS, tile_rows,
                          chunked=d > D)
                  for kernel in BWD_KERNELS)
    need = max(p.smem_bytes for p in plans)
    if need > max_smem:
        raise ValueError(
            f"the backward tiles for head dim d={d} ({np.dtype(dtype).name}) need {need} "
            f"bytes of shared memory per block; this device has {max_smem}. "
            f"Use backend='numpy'.")
    return plans


@functools.cache
def all_bwd_plans() -> tuple[BwdPlan | BwdPreprocessPlan, ...]:
    """Every backward specialization the library can launch (for the gate): per dtype,
    the preprocess kernel, both kernels for every bucket, and both chunked."""
    plans = []
    for dt in _dtypes.SUPPORTED:
        plans.append(bwd_preprocess_plan(dt))
        for D in BWD_HEAD_DIM_BUCKETS:
            plans.extend(plan_backward(D, dt))
        plans.extend(plan_backward(BWD_HEAD_DIM_BUCKETS[-1] + 1, dt))
    return tuple(plans)


# ── backward on tensor cores (flash_bwd_tc.cu) ────────────────────────────────────────
#
# FA2's backward on mma.sync for float16 (sm_75+) and bfloat16 (sm_80+): each warp owns 16
# rows of its block (keys in the dK/dV kernel, queries in the dQ kernel) and the other
# operand pair streams through a `stages`-deep cp.async ring in tiles of `tile_rows` rows;
# the dK/dV kernel computes Sᵀ = K Qᵀ, so Pᵀ and dSᵀ are already the A fragments of
# dV += Pᵀ dO and dK += dSᵀ Q. D = rowsum(dO ∘ O) stays flash_bwd.cu's preprocess kernel.
# See `TcBwdTraits` in kernels/tc_bwd_tile.cuh and docs/kernels.md.
TC_BWD_HEAD_DIMS = (64, 128, 256)   # HEAD_DIM buckets; d a multiple of 8 up to 256 runs in one

# Candidate (block_rows, tile_rows, num_warps, stages, own_in_regs, chunk_cols) per
# (kernel, HEAD_DIM), best first; the last of each fits 64 KB (sm_75's opt-in limit).
# `own_in_regs`: the warp's own operands (K_j, V_j | Q_i, dO_i) as A fragments in
# registers, else re-read from shared memory at every k16 step. `chunk_cols`: the output
# columns one block accumulates; below HEAD_DIM the output's columns are split into
# chunks over blocks (grid x), each block recomputing Sᵀ, dPᵀ over the full head dim.
# ptxas registers (sm_80 / sm_75): dK/dV D=64 237 / 244, D=128 217 / 224; dQ D=64
# 241 / 227, D=128 242 / 250. Tried and rejected: dK/dV D=128 with 32-row Q tiles (ptxas
# spills 16 bytes on sm_75 at 255 registers).
# D = 256: dK_j and dV_j whole would be 2 · D/2 = 256 accumulator registers per thread, so
# the dK/dV blocks own 128-column chunks (two blocks per key block: the scores are
# computed twice), which leaves them the D = 128 tile's 128 accumulators; dQ_i alone is
# 128, so the dQ kernel keeps all 256 columns with Q_i, dO_i in shared memory. Three
# tiles: 8 warps (sm_80, sm_90), 4 (sm_86, sm_89's 99 KB), and for sm_75's 64 KB 16 keys
# (one warp: 32 keys need 64 KB + 256 bytes of row statistics) and 32 queries. ptxas
# registers (sm_80 / sm_75): dK/dV 221 / 232, 229 / 240, 213 / 224; dQ 238 / 245,
# 242 / 251, 224 / 222.
_TC_BWD_CANDIDATES = {
    (FLASH_BWD_DKDV_TC.name, 64): ((64, 64, 4, 2, True, 64),),
    (FLASH_BWD_DKDV_TC.name, 128): ((64, 16, 4, 2, False, 128),),
    (FLASH_BWD_DKDV_TC.name, 256): ((128, 16, 8, 2, False, 128), (64, 16, 4, 2, False, 128),
                                    (16, 16, 1, 2, False, 128)),
    (FLASH_BWD_DQ_TC.name, 64): ((64, 64, 4, 2, True, 64),),
    (FLASH_BWD_DQ_TC.name, 128): ((64, 32, 4, 2, True, 128),),
    (FLASH_BWD_DQ_TC.name, 256): ((128, 16, 8, 2, False, 256), (64, 16, 4, 2, False, 256),
                                  (32, 16, 2, 2, False, 256)),
}
TC_BWD_KERNELS = (FLASH_BWD_DKDV_TC.name, FLASH_BWD_DQ_TC.name)


def tc_bwd_smem_bytes(kernel: str, elem_bytes: int, head_dim: int, block_rows: int,
                      tile_rows: int, stages: int) -> int:
    """Dynamic shared memory of one tensor-core backward block: mirrors
    `TcBwdTraits::kSmemBytes` (kernels/tc_bwd_tile.cuh) term for term.

    own pair    2 · block_rows · D            K_j, V_j (dK/dV) | Q_i, dO_i (dQ), in T
    ring pair   2 · stages · tile_rows · D    Q_i, dO_i (dK/dV) | K_j, V_j (dQ), in T
    row stats   2 · stages · tile_rows        lse_i, D_i in float32 (dK/dV only)
    """
    tiles = (2 * block_rows * head_dim + 2 * stages * tile_rows * head_dim) * elem_bytes
    stats = (2 * stages * tile_rows * 4
             if kernel in (FLASH_BWD_DKDV_TC.name, FLASH_BWD_DKDV_TF32.name) else 0)
    return tiles + stats


@dataclasses.dataclass(frozen=True)
class TcBwdPlan(_Plan):
    """One launchable specialization of a tensor-core backward kernel; the fields after
    `dtype` are the kernel's template parameters, in order (HEAD_DIM, BLOCK_ROWS,
    TILE_ROWS, NUM_WARPS, STAGES, OWN_IN_REGS, CHUNK_COLS in flash_bwd_tc.cu)."""

    dynamic_smem = True

    kernel: str            # one of TC_BWD_KERNELS (TF32_BWD_KERNELS: Tf32BwdPlan)
    dtype: str             # "float16" or "bfloat16" ("float32": Tf32BwdPlan)
    head_dim: int          # HEAD_DIM: runs any d <= head_dim that is a multiple of 8
    block_rows: int        # rows the block owns (Bc keys | Br queries) = 16 · num_warps
    tile_rows: int         # rows of each streamed tile (Q_i | K_j)
    num_warps: int
    stages: int            # depth of the cp.async ring
    own_in_regs: bool      # the own operands' A fragments held in registers
    chunk_cols: int        # output columns per block (< head_dim: head-dim chunks)

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    @property
    def head_dim_bucket(self) -> int:
        return self.head_dim

    @property
    def chunked(self) -> bool:
        return self.chunk_cols < self.head_dim

    def num_d_chunks(self, d: int) -> int:
        """Blocks per row block for head dim d: the chunks that hold a column < d (the
        kernel computes the same count from d)."""
        return -(-d // self.chunk_cols) if self.chunked else 1

    @property
    def smem_bytes(self) -> int:
        return tc_bwd_smem_bytes(self.kernel, np.dtype(self.dtype).itemsize, self.head_dim,
                                 self.block_rows, self.tile_rows, self.stages)

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim} rows={self.block_rows} "
                f"tile={self.tile_rows} warps={self.num_warps} stages={self.stages} "
                f"{'regs' if self.own_in_regs else 'smem'}"
                f"{f' chunks of {self.chunk_cols}' if self.chunked else ''} "
                f"smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, self.block_rows, self.tile_rows, self.num_warps,
                                 self.stages, "true" if self.own_in_regs else "false",
                                 self.chunk_cols)


def _tc_bwd_candidates(kernel, dtype, head_dim):
    return [TcBwdPlan(kernel, np.dtype(dtype).name, head_dim, *c)
            for c in _TC_BWD_CANDIDATES[(kernel, head_dim)]]


@functools.cache
def all_tc_bwd_plans() -> tuple[TcBwdPlan, ...]:
    """Every tensor-core backward specialization the library can launch (for the gate)."""
    return tuple(p for dt in TC_DTYPES for D in TC_BWD_HEAD_DIMS for kernel in TC_BWD_KERNELS
                 for p in _tc_bwd_candidates(kernel, dt, D))


# ── float32 backward on tensor cores (flash_bwd_tc.cu, flash_bwd_*_tf32_kernel) ─────────
#
# The tensor-core backward's kernels with float32 tiles and m16n8k8 .tf32 products (sm_80+),
# split tf32 by default, one-pass with allow_tf32=True, as the float32 forward. Twice the
# bytes per tile and, split, hi/lo temporaries beside every mma: the tiles are smaller than
# the 16-bit kernel's. Candidates (block_rows, tile_rows, num_warps, stages, own_in_regs,
# chunk_cols) per (kernel, HEAD_DIM, split), best first; each list ends with a tile within
# 99 KB (sm_86/sm_89). ptxas registers on sm_80 (CUDA 12.9), in order: split dK/dV 203, 243,
# 249; dQ 217, 238, 241 / 231; one-pass dK/dV 169, 208, 222 x 3; dQ 192, 230, 184 / 180.
# Tried and rejected (sm_80): split dK/dV D=128 with 16-row Q tiles (spills 156 bytes),
# D=256 with 4 warps (253 registers, no margin); one-pass dQ D=64 with Q_i, dO_i in
# registers (spills 76 bytes).
_TF32_BWD_CANDIDATES = {
    (FLASH_BWD_DKDV_TF32.name, 64, True): ((64, 16, 4, 2, False, 64),),
    (FLASH_BWD_DKDV_TF32.name, 128, True): ((64, 8, 4, 2, False, 128),),
    (FLASH_BWD_DKDV_TF32.name, 256, True): ((32, 8, 2, 2, False, 128),),
    (FLASH_BWD_DQ_TF32.name, 64, True): ((64, 16, 4, 2, False, 64),),
    (FLASH_BWD_DQ_TF32.name, 128, True): ((64, 8, 4, 2, False, 128),),
    (FLASH_BWD_DQ_TF32.name, 256, True): ((64, 8, 4, 2, False, 128), (32, 8, 2, 2, False, 128)),
    (FLASH_BWD_DKDV_TF32.name, 64, False): ((64, 32, 4, 2, False, 64),),
    (FLASH_BWD_DKDV_TF32.name, 128, False): ((64, 8, 4, 2, False, 128),),
    (FLASH_BWD_DKDV_TF32.name, 256, False): ((64, 16, 4, 2, False, 128),
                                             (32, 16, 2, 2, False, 128),
                                             (16, 16, 1, 2, False, 128)),
    (FLASH_BWD_DQ_TF32.name, 64, False): ((64, 32, 4, 2, False, 64),),
    (FLASH_BWD_DQ_TF32.name, 128, False): ((64, 16, 4, 2, False, 128),),
    (FLASH_BWD_DQ_TF32.name, 256, False): ((64, 16, 4, 2, False, 128),
                                           (32, 8, 2, 2, False, 128)),
}
TF32_BWD_KERNELS = (FLASH_BWD_DKDV_TF32.name, FLASH_BWD_DQ_TF32.name)


@dataclasses.dataclass(frozen=True)
class Tf32BwdPlan(TcBwdPlan):
    """A float32 tensor-core backward specialization: `TcBwdPlan`'s template parameters,
    then SPLIT (flash_bwd_*_tf32_kernel in flash_bwd_tc.cu)."""

    split: bool            # True: split tf32 (3 mma per product); False: one-pass tf32

    def __str__(self) -> str:
        return f"{super().__str__()} {'split' if self.split else 'one-pass'}"

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, self.block_rows, self.tile_rows, self.num_warps,
                                 self.stages, "true" if self.own_in_regs else "false",
                                 self.chunk_cols, "true" if self.split else "false")


def _tf32_bwd_candidates(kernel, head_dim, *, split):
    return [Tf32BwdPlan(kernel, TF32_DTYPE, head_dim, *c, split)
            for c in _TF32_BWD_CANDIDATES[(kernel, head_dim, split)]]


@functools.cache
def all_tf32_bwd_plans() -> tuple[Tf32BwdPlan, ...]:
    """Every float32 tensor-core backward specialization (for the gate)."""
    return tuple(p for split in (True, False) for D in TF32_HEAD_DIMS
                 for kernel in TF32_BWD_KERNELS
                 for p in _tf32_bwd_candidates(kernel, D, split=split))


def _tf32_bwd_path(d, cc, aligned, *, max_smem, allow_tf32, simt):
    """backward_path for float32 on a device of known compute capability `cc`."""
    why = _tensor_core_refusal(d, cc, aligned, what=TF32_WHAT, need=TF32_MIN_CC,
                               head_dims=TF32_HEAD_DIMS, operands="q, k, v or dO")
    if why:
        return simt(), why
    D = next(b for b in TF32_HEAD_DIMS if d <= b)
    fits = [next((p for p in _tf32_bwd_candidates(kernel, D, split=not allow_tf32)
                  if p.smem_bytes <= max_smem), None) for kernel in TF32_BWD_KERNELS]
    if None in fits:
        return simt(), _no_tile_fits(TF32_WHAT, D, max_smem, "backward ")
    return tuple(fits), (f"tensor cores: mma.m16n8k8.tf32 on sm_{cc[0]}{cc[1]}, "
                         f"{_tf32_mode(allow_tf32)}{_chunks(fits, d)}")


def backward_path(d: int, dtype, cc, aligned: bool = True, *, max_smem: int,
                  sm_count=None, allow_tf32: bool = False):
    """((dkdv_plan, dq_plan), reason): the backward kernels a call takes, and why.

    Tensor cores (two `TcBwdPlan`s) where the dtype is float16 (sm_75+) or bfloat16
    (sm_80+), d is a multiple of 8 up to 256, q, k, v and dO allow 16-byte loads
    (`aligned`) and a tile of each kernel fits `max_smem` (the first candidate that does:
    for 128 < d ≤ 256 the dK/dV plan splits dK, dV into 128-column chunks,
    `TcBwdPlan.num_d_chunks`); float32 on sm_80+ with d a multiple of 4 up to 256 takes two
    `Tf32BwdPlan`s (split tf32, or one-pass with `allow_tf32`: `_tf32_bwd_path`); otherwise
    the SIMT kernels of `plan_backward`. Attention variants (window, softcap, ALiBi, bias,
    mask, dropout) and dbias (every kernel family writes it) take the same path as a plain
    call. The reason names the instruction and, for chunked plans, the chunks.
    `cc` is (major, minor), or None when unknown (SIMT)."""
    dt = np.dtype(dtype)

    def simt():
        return plan_backward(d, dt, max_smem=max_smem, sm_count=sm_count, cc=cc)

    if dt.name not in (*TC_DTYPES, TF32_DTYPE):
        return simt(), (f"SIMT: {dt.name} has no tensor-core backward (float16, bfloat16 "
                        f"and float32 do)")
    if cc is None:
        return simt(), "SIMT: the device's compute capability is unknown"
    cc = tuple(cc)
    if dt.name == TF32_DTYPE:
        return _tf32_bwd_path(d, cc, aligned, max_smem=max_smem, allow_tf32=allow_tf32,
                              simt=simt)
    why = _tensor_core_refusal(d, cc, aligned, what=dt.name, need=TC_MIN_CC[dt.name],
                               head_dims=TC_BWD_HEAD_DIMS, operands="q, k, v or dO")
    if why:
        return simt(), why
    D = next(b for b in TC_BWD_HEAD_DIMS if d <= b)
    fits = [next((p for p in _tc_bwd_candidates(kernel, dt, D) if p.smem_bytes <= max_smem),
                 None) for kernel in TC_BWD_KERNELS]
    if None in fits:
        return simt(), _no_tile_fits(dt.name, D, max_smem, "backward ")
    instr = "mma.m16n8k16" if cc >= (8, 0) else "2 x mma.m16n8k8"
    return tuple(fits), f"tensor cores: {instr} on sm_{cc[0]}{cc[1]}{_chunks(fits, d)}"


def _chunks(plans, d):
    """The backward reason's note on the plans that split head dim d into chunks."""
    return "".join(f", {p.kernel} in {p.num_d_chunks(d)} head-dim chunks of {p.chunk_cols}"
                   for p in plans if p.num_d_chunks(d) > 1)


# ── online softmax (online_softmax.cu) ─────────────────────────────────────────────────

SOFTMAX_THREADS = 128
# softmax_cols (one thread per line) once there are this many lines side by side along
# the contiguous Q axis, so neighbouring threads read neighbouring addresses; otherwise
# softmax_rows (one block per line, its threads striding along n and merging their m, ℓ).
SOFTMAX_COLS_MIN_Q = 32


@dataclasses.dataclass(frozen=True)
class SoftmaxPlan(_Plan):
    """One softmax kernel over x (P, n, Q), normalising axis 1. No shared memory beyond
    the block reduction's (static)."""

    kernel: str            # "softmax_rows" or "softmax_cols"
    dtype: str
    num_threads: int = SOFTMAX_THREADS
    smem_bytes = 0

    def __str__(self) -> str:
        return f"{self.kernel} {self.dtype} threads={self.num_threads}"

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.num_threads)


def plan_softmax(dtype, Q: int) -> SoftmaxPlan:
    """The softmax kernel for lines `Q` apart in memory (see SOFTMAX_COLS_MIN_Q)."""
    family = SOFTMAX_COLS if Q >= SOFTMAX_COLS_MIN_Q else SOFTMAX_ROWS
    return SoftmaxPlan(family.name, np.dtype(dtype).name)


def all_softmax_plans() -> tuple[SoftmaxPlan, ...]:
    return tuple(SoftmaxPlan(f.name, np.dtype(dt).name)
                 for f in (SOFTMAX_ROWS, SOFTMAX_COLS) for dt in _dtypes.SUPPORTED)


def every_plan() -> dict:
    """{name expression: plan} of every kernel specialization the library can launch:
    finite (every plan of every family, dtype and head-dim bucket)."""
    plans = (*all_plans(), *all_tc_plans(), *all_tf32_plans(), *all_bwd_plans(),
             *all_tc_bwd_plans(), *all_tf32_bwd_plans(), *all_softmax_plans())
    return {p.name_expression: p for p in plans}


def specializations() -> dict[str, list[str]]:
    """every_plan() as {source: [name expression]}, for the compile gate."""
    out: dict[str, list[str]] = {}
    for name, plan in every_plan().items():
        out.setdefault(plan.source, []).append(name)
    return out


def occupancy(limits, *, threads: int, smem_bytes: int, registers: int) -> int:
    """Resident blocks per SM of a kernel, by the CUDA occupancy calculator's rules:
    the fewest allowed by the SM's block slots, its warp slots, its registers (allocated
    per warp in units of 256) and its shared memory (static + dynamic + the per-block
    reserve, in units of 128 bytes). `limits` is a `cuflash.emulator.archs.GpuLimits`."""
    warps = -(-threads // 32)
    by_warps = limits.max_threads_per_sm // 32 // warps
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = limits.registers_per_sm // (regs_per_warp * warps) if registers > 0 else by_warps
    smem = -(-(smem_bytes + limits.shared_reserved_per_block) // 128) * 128
    by_smem = limits.shared_per_sm // smem if smem else by_warps
    return max(0, min(limits.max_blocks_per_sm, by_warps, by_regs, by_smem))


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
