"""Tensor-core backward plans (flash_bwd_tc.cu): mirrors `TcBwdTraits` in
kernels/tc_bwd_tile.cuh, for float16, bfloat16 and float32 (tf32) alike, and the sum of
the 5-GEMM backward's dQ partials (`DqSumPlan`).

FA2's backward on mma.sync: each warp owns 16 rows of its block (keys in the dK/dV
kernel, queries in the dQ kernel) and the other operand pair streams through a
`stages`-deep cp.async ring in tiles of `tile_rows` rows; the dK/dV kernel computes
Sᵀ = K Qᵀ, so Pᵀ and dSᵀ are already the A fragments of dV += Pᵀ dO and dK += dSᵀ Q.
With `dq_parts` (16-bit, one head-dim chunk) the dK/dV blocks also add dQ_i += dS K_j
into their worker's float32 partial of dQ, and `flash_bwd_dq_sum` sums the partials in
order: five GEMMs per tile instead of the dQ kernel's recomputing three more.
D = rowsum(dO ∘ O) stays flash_bwd.cu's preprocess kernel. float32 runs the same kernels
with float32 tiles and m16n8k8 .tf32 products (sm_80+), split tf32 by default, one-pass
with allow_tf32=True, as the float32 forward. See docs/kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools

from ..families import FLASH_BWD_DKDV_TC, FLASH_BWD_DQ_SUM, FLASH_BWD_DQ_TC
from .base import Plan, backward_score_tile, flag
from .tc_fwd import TC_DTYPES, TF32_DTYPE, TF32_HEAD_DIMS, shared_100kb, tf32_mode

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
# Turing (sm_75, cc 7.x) replaces one: at 255 registers CUDA 13.5's ptxas spills the dK/dV
# D=64 tile (24 bytes) since the kernels take their strides and layout as records; 32-row
# Q tiles hold at 209 registers (208 under CUDA 12.9).
_TC_BWD_CANDIDATES_SM75 = {
    (FLASH_BWD_DKDV_TC.name, 64): ((64, 32, 4, 2, True, 64),),
}
_TC_BWD_BY_ARCH = {7: _TC_BWD_CANDIDATES_SM75}
# The 5-GEMM backward's dK/dV tiles (DQ_PARTS: 16-bit, one head-dim chunk), per HEAD_DIM,
# best first: dQ_i's accumulators (TILE_ROWS · D / threads) and the dSᵀ tile come on top,
# so K_j, V_j stay in shared memory. 8 warps and 128 keys per block halve the dQ partials'
# reductions per product and the barriers per HMMA against 4 warps and 64 keys (which spill
# 4–52 bytes at D = 128, 12 at D = 64 under CUDA 13.5). The tall Q tiles — 128 × 128 at
# D = 64 (132 KB), 128 × 64 at D = 128 (147 KB), FlashAttention-2's blocks — spread each
# iteration's walk, barriers and addressing over twice the products of the next ones
# (instructions per HMMA on sm_80 / sm_90: D = 64 3.38 / 3.27 against 3.74 / 3.64 in
# 64-row tiles, D = 128 2.81 / 2.73 against 3.22 / 3.17 in 32-row ones), one block per
# SM. The 100 KB GPUs (sm_86, sm_89, sm_120) take 64-row tiles at D = 64 and 16-row ones at
# D = 128 (32-row ones would need 107 KB), the others too where the tall ones do not fit.
# Turing keeps its 32-row Q tiles with K_j, V_j in registers; its D = 128 spills (108
# bytes) and runs the two-kernel backward. All at 255 registers on sm_80 and sm_90 with
# 0 spills under CUDA 12.9 and 13.5 (the kernel has no variants' loop: kernel_backward
# sends those calls to the two kernels).
_TC_BWD_DQ_PARTS = {64: ((128, 128, 8, 2, False, 64),), 128: ((128, 64, 8, 2, False, 128),)}
_TC_BWD_DQ_PARTS_100KB = {64: ((128, 64, 8, 2, False, 64),), 128: ((128, 16, 8, 2, False, 128),)}
_TC_BWD_DQ_PARTS_BY_ARCH = {7: {64: ((64, 32, 4, 2, True, 64),), 128: ()}}
TC_BWD_KERNELS = (FLASH_BWD_DKDV_TC.name, FLASH_BWD_DQ_TC.name)

# float32: twice the bytes per tile and, split, hi/lo temporaries beside every mma: the
# tiles are smaller than the 16-bit kernel's. Candidates (block_rows, tile_rows, num_warps,
# stages, own_in_regs, chunk_cols) per (kernel, HEAD_DIM, split), best first; each list
# ends with a tile within 99 KB (sm_86/sm_89). ptxas registers on sm_80 (CUDA 12.9), in
# order: split dK/dV 203, 243, 249; dQ 217, 238, 241 / 231; one-pass dK/dV 169, 208,
# 222 x 3; dQ 192, 230, 184 / 180. Tried and rejected (sm_80): split dK/dV D=128 with
# 16-row Q tiles (spills 156 bytes), D=256 with 4 warps (253 registers, no margin);
# one-pass dQ D=64 with Q_i, dO_i in registers (spills 76 bytes).
_TF32_BWD_CANDIDATES = {
    (FLASH_BWD_DKDV_TC.name, 64, True): ((64, 16, 4, 2, False, 64),),
    (FLASH_BWD_DKDV_TC.name, 128, True): ((64, 8, 4, 2, False, 128),),
    (FLASH_BWD_DKDV_TC.name, 256, True): ((32, 8, 2, 2, False, 128),),
    (FLASH_BWD_DQ_TC.name, 64, True): ((64, 16, 4, 2, False, 64),),
    (FLASH_BWD_DQ_TC.name, 128, True): ((64, 8, 4, 2, False, 128),),
    (FLASH_BWD_DQ_TC.name, 256, True): ((64, 8, 4, 2, False, 128), (32, 8, 2, 2, False, 128)),
    (FLASH_BWD_DKDV_TC.name, 64, False): ((64, 32, 4, 2, False, 64),),
    (FLASH_BWD_DKDV_TC.name, 128, False): ((64, 8, 4, 2, False, 128),),
    (FLASH_BWD_DKDV_TC.name, 256, False): ((64, 16, 4, 2, False, 128),
                                             (32, 16, 2, 2, False, 128),
                                             (16, 16, 1, 2, False, 128)),
    (FLASH_BWD_DQ_TC.name, 64, False): ((64, 32, 4, 2, False, 64),),
    (FLASH_BWD_DQ_TC.name, 128, False): ((64, 16, 4, 2, False, 128),),
    (FLASH_BWD_DQ_TC.name, 256, False): ((64, 16, 4, 2, False, 128),
                                           (32, 8, 2, 2, False, 128)),
}
# Consumer Blackwell (sm_120, cc 12.x) replaces four split lists: its ptxas (CUDA 12.9)
# spills dK/dV D=64 (8 bytes), D=128 (8), D=256 (28) and dQ D=256 (12) at 255 registers,
# as it does with fewer rows per block or tile; 64-column output chunks (half the
# accumulators) do not spill, at D=128 in 32-row blocks (64 rows spill 8 bytes since the
# kernels take their strides and layout as records).
_TF32_BWD_CANDIDATES_SM120 = {
    (FLASH_BWD_DKDV_TC.name, 64, True): ((64, 8, 4, 2, False, 64),),
    (FLASH_BWD_DKDV_TC.name, 128, True): ((32, 8, 2, 2, False, 64),),
    (FLASH_BWD_DKDV_TC.name, 256, True): ((32, 8, 2, 2, False, 64),),
    (FLASH_BWD_DQ_TC.name, 256, True): ((32, 8, 2, 2, False, 64),),
}
# Data-centre Blackwell (sm_100, cc 10.x) replaces two: at 255 registers CUDA 13.5's ptxas
# spills the split dK/dV D=128 (8 bytes) and D=256 (12) tiles; 64-column output chunks as
# on sm_120.
_TF32_BWD_CANDIDATES_SM100 = {
    (FLASH_BWD_DKDV_TC.name, 128, True): ((64, 8, 4, 2, False, 64),),
    (FLASH_BWD_DKDV_TC.name, 256, True): ((32, 8, 2, 2, False, 64),),
}
# The replacements by compute capability major.
_TF32_BWD_BY_ARCH = {10: _TF32_BWD_CANDIDATES_SM100, 12: _TF32_BWD_CANDIDATES_SM120}


def tc_bwd_smem_bytes(kernel: str, elem_bytes: int, head_dim: int, block_rows: int,
                      tile_rows: int, stages: int, dq_parts: bool = False) -> int:
    """Dynamic shared memory of one tensor-core backward block: mirrors
    `TcBwdTraits::kSmemBytes` (kernels/tc_bwd_tile.cuh) term for term.

    own pair    2 · block_rows · D            K_j, V_j (dK/dV) | Q_i, dO_i (dQ), in T
    ring pair   2 · stages · tile_rows · D    Q_i, dO_i (dK/dV) | K_j, V_j (dQ), in T
    dSᵀ         block_rows · (tile_rows + 8)  the tile's dSᵀ, in T (dK/dV with dq_parts)
    row stats   2 · stages · tile_rows        (lse_i · log2 e, D_i) in float32 (dK/dV only)
    """
    ds = block_rows * (tile_rows + 8) if dq_parts else 0
    tiles = (2 * block_rows * head_dim + 2 * stages * tile_rows * head_dim + ds) * elem_bytes
    stats = 2 * stages * tile_rows * 4 if kernel == FLASH_BWD_DKDV_TC.name else 0
    return tiles + stats


@dataclasses.dataclass(frozen=True)
class TcBwdPlan(Plan):
    """One launchable specialization of a tensor-core backward kernel; the fields after
    `dtype` are the kernel's template parameters, in order (HEAD_DIM, BLOCK_ROWS,
    TILE_ROWS, NUM_WARPS, STAGES, OWN_IN_REGS, CHUNK_COLS, then SPLIT and, for the dK/dV
    kernel, DQ_PARTS in flash_bwd_tc.cu)."""

    dynamic_smem = True
    _split_flag = False    # SPLIT: 16-bit types have one kind of product (Tf32BwdPlan: its field)

    kernel: str            # one of TC_BWD_KERNELS
    dtype: str             # "float16" or "bfloat16" ("float32": Tf32BwdPlan)
    head_dim: int          # HEAD_DIM: runs any d <= head_dim whose rows are 16-byte chunks
    block_rows: int        # rows the block owns (Bc keys | Br queries) = 16 · num_warps
    tile_rows: int         # rows of each streamed tile (Q_i | K_j)
    num_warps: int
    stages: int            # depth of the cp.async ring
    own_in_regs: bool      # the own operands' A fragments held in registers
    chunk_cols: int        # output columns per block (< head_dim: head-dim chunks)
    # DQ_PARTS (dK/dV only): the blocks also accumulate dQ into float32 partials
    dq_parts: bool = dataclasses.field(default=False, kw_only=True)

    @property
    def num_threads(self) -> int:
        return self.num_warps * 32

    @property
    def head_dim_bucket(self) -> int:
        return self.head_dim

    @property
    def chunked(self) -> bool:
        return self.chunk_cols < self.head_dim

    @property
    def score_tile(self) -> tuple:
        """(query rows, keys) of the kernel's score tiles: a block mask's granularity."""
        return backward_score_tile(self.block_rows, self.tile_rows,
                                   self.kernel == FLASH_BWD_DKDV_TC.name)

    def num_d_chunks(self, d: int) -> int:
        """Blocks per row block for head dim d: the chunks that hold a column < d (the
        kernel computes the same count from d)."""
        return -(-d // self.chunk_cols) if self.chunked else 1

    @property
    def smem_bytes(self) -> int:
        return tc_bwd_smem_bytes(self.kernel, self.element.bytes, self.head_dim,
                                 self.block_rows, self.tile_rows, self.stages, self.dq_parts)

    def dq_part_shape(self, batch: int, heads: int, rows: int, *, packed: bool) -> tuple:
        """One worker's float32 partial of dQ (DQ_PARTS) for q (batch, heads, rows, d): rows
        of HEAD_DIM floats, and rows padded so that every tile the kernel adds is whole
        (add_dq_part, kernels/tc_bwd_tile.cuh): to a multiple of TILE_ROWS, or — packed
        sequences, whose tiles start anywhere — TILE_ROWS past the last."""
        t = self.tile_rows
        return (batch, heads, rows + t if packed else -(-rows // t) * t, self.head_dim)

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim} rows={self.block_rows} "
                f"tile={self.tile_rows} warps={self.num_warps} stages={self.stages} "
                f"{'regs' if self.own_in_regs else 'smem'}"
                f"{f' chunks of {self.chunk_cols}' if self.chunked else ''}"
                f"{' +dQ parts' if self.dq_parts else ''} smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(*self._template_args())

    def _template_args(self) -> tuple:
        args = (self.head_dim, self.block_rows, self.tile_rows, self.num_warps, self.stages,
                flag(self.own_in_regs), self.chunk_cols, flag(self._split_flag))
        return args + (flag(self.dq_parts),) if self.kernel == FLASH_BWD_DKDV_TC.name else args


@dataclasses.dataclass(frozen=True)
class Tf32BwdPlan(TcBwdPlan):
    """A float32 tensor-core backward specialization (flash_bwd_*_tc_kernel<float, ...>):
    split or one-pass tf32 products."""

    split: bool            # True: split tf32 (3 mma per product); False: one-pass tf32

    def __str__(self) -> str:
        return f"{super().__str__()} {tf32_mode(self.split)}"

    @property
    def _split_flag(self) -> bool:
        return self.split


@dataclasses.dataclass(frozen=True)
class DqSumPlan(Plan):
    """flash_bwd_dq_sum_kernel<T>: dQ = scale · Σ_w partial_w of the 5-GEMM backward,
    `elements_per_thread` elements per thread. No shared memory."""

    dtype: str
    kernel = FLASH_BWD_DQ_SUM.name
    num_threads = 256
    elements_per_thread = 4
    smem_bytes = 0

    def __str__(self) -> str:
        return f"{self.kernel} {self.dtype} threads={self.num_threads}"

    @property
    def name_expression(self) -> str:
        return self._instantiate()


def tc_bwd_candidates(kernel: str, dtype: str, head_dim: int, *, split: bool,
                      cc=None) -> list[TcBwdPlan]:
    """The tiles of tensor-core backward `kernel` for `dtype` and HEAD_DIM on compute
    capability `cc`, best first; `split` picks float32's split or one-pass tf32 (16-bit
    types have one kind)."""
    if dtype == TF32_DTYPE:
        table = {**_TF32_BWD_CANDIDATES, **_TF32_BWD_BY_ARCH.get(cc and cc[0], {})}
        return [Tf32BwdPlan(kernel, dtype, head_dim, *c, split)
                for c in table[(kernel, head_dim, split)]]
    table = {**_TC_BWD_CANDIDATES, **_TC_BWD_BY_ARCH.get(cc and cc[0], {})}
    return [TcBwdPlan(kernel, dtype, head_dim, *c) for c in table[(kernel, head_dim)]]


def dq_parts_tiles(dtype: str, head_dim: int, cc=None) -> list[TcBwdPlan]:
    """The 5-GEMM backward's dK/dV tiles (DQ_PARTS) for a 16-bit `dtype` and HEAD_DIM on
    compute capability `cc`, best first; none for float32, D = 256 and Turing's D = 128."""
    if dtype not in TC_DTYPES:
        return []
    tall = () if shared_100kb(cc) else _TC_BWD_DQ_PARTS.get(head_dim, ())
    tiles = _TC_BWD_DQ_PARTS_BY_ARCH.get(cc and cc[0], {}).get(
        head_dim, tall + _TC_BWD_DQ_PARTS_100KB.get(head_dim, ()))
    return [TcBwdPlan(FLASH_BWD_DKDV_TC.name, dtype, head_dim, *c, dq_parts=True)
            for c in tiles]


@functools.cache
def all_tc_bwd_plans(cc=None) -> tuple[TcBwdPlan | DqSumPlan, ...]:
    """Every 16-bit tensor-core backward specialization a device of compute capability
    `cc` can launch (for the gate; bfloat16 is a trap on sm_75), the 5-GEMM backward's
    tiles and its partials' sum included; None: of any device, sm_75's and sm_80's own
    last."""
    plans = [p for c in ((None, (7, 5), (8, 0)) if cc is None else (cc,))
             for dt in TC_DTYPES for D in TC_BWD_HEAD_DIMS
             for p in (*(q for kernel in TC_BWD_KERNELS
                         for q in tc_bwd_candidates(kernel, dt, D, split=False, cc=c)),
                       *dq_parts_tiles(dt, D, c))]
    return tuple(dict.fromkeys([*plans, *(DqSumPlan(dt) for dt in TC_DTYPES)]))


@functools.cache
def all_tf32_bwd_plans(cc=None) -> tuple[Tf32BwdPlan, ...]:
    """Every float32 tensor-core backward specialization a device of compute capability
    `cc` can launch (for the gate); None: of any device, sm_100's and sm_120's last."""
    plans = (p for c in ((None, (10, 0), (12, 0)) if cc is None else (cc,))
             for split in (True, False) for D in TF32_HEAD_DIMS for kernel in TC_BWD_KERNELS
             for p in tc_bwd_candidates(kernel, TF32_DTYPE, D, split=split, cc=c))
    return tuple(dict.fromkeys(plans))
