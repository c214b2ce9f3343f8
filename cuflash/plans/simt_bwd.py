"""SIMT backward plans (flash_bwd.cu): mirrors `BwdTileTraits` in kernels/bwd_tile.cuh.

The backward kernels are plain SIMT with *static* shared memory (every tile stays under
the 48 KB any device gives without opting in), laid out differently from the forward:
a warp is cut into groups of G lanes, a group owns `rows_per_group` rows (keys in the
dK/dV kernel, queries in the dQ kernel) and lane g of the group holds the head-dim
columns g, g+G, … (DPL = D/G of them); the other operand streams through shared memory
in tiles of `tile_rows` rows.

Head dims above the largest bucket run the kernels with `chunked=True`, in 256-wide
chunks: a block owns one chunk of its output's columns and sums the scores over every
chunk (`bwd_head_dim_chunks`). Causal is a run-time argument of every backward kernel.
"""
from __future__ import annotations

import dataclasses
import functools

from ..families import FLASH_BWD_DKDV, FLASH_BWD_DQ, FLASH_BWD_PREPROCESS
from .base import DTYPE_NAMES, ELEMENTS, Plan, backward_score_tile, dtype_name, flag

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
class SimtBwdPlan(Plan):
    """One launchable specialization of a SIMT backward kernel (dK/dV or dQ, maybe chunked).

    The fields are the kernel's template parameters, in order (their UPPER_CASE names in
    flash_bwd.cu). A block owns `block_rows` = num_warps · (32/G) · rows_per_group rows
    (Bc keys of the dK/dV kernel, Br queries of the dQ kernel); the streamed operand comes
    in tiles of `tile_rows` rows.
    """

    kernel: str            # one of BWD_KERNELS
    dtype: str             # "float16", "bfloat16", "float32" or "float64"
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
    def score_tile(self) -> tuple:
        """(query rows, keys) of the kernel's score tiles: a block mask's granularity."""
        return backward_score_tile(self.block_rows, self.tile_rows,
                                   self.kernel == FLASH_BWD_DKDV.name)

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
                                 self.num_warps, self.tile_rows, flag(self.chunked))


@dataclasses.dataclass(frozen=True)
class BwdPreprocessPlan(Plan):
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
    return BwdPreprocessPlan(dtype_name(dtype), BWD_PREPROCESS_ROWS)


def bwd_head_dim_bucket(d: int) -> int:
    """The smallest backward bucket >= d; d above the largest runs in chunks of it."""
    if d < 1:
        raise ValueError(f"head dim d must be >= 1; got d={d}")
    for b in BWD_HEAD_DIM_BUCKETS:
        if d <= b:
            return b
    return BWD_HEAD_DIM_BUCKETS[-1]


def bwd_head_dim_chunks(d: int) -> int:
    """How many bucket-wide chunks the SIMT backward splits head dim d into."""
    return -(-d // bwd_head_dim_bucket(d))


def _bwd_shape(dtype, D):
    """(G, rows_per_group, tile_rows) of the backward tiles for `dtype` and bucket D."""
    acc_bytes = ELEMENTS[dtype].accum_bytes
    # Columns per lane: 8 float accumulators (4 doubles) keep the 4·rows·DPL register
    # accumulators (K, V, dK, dV) near 64 words per thread.
    dpl = 8 if acc_bytes == 4 else 4
    G = max(1, min(32, D // dpl))
    # Two rows per lane group reuse each shared-memory read twice; the one case whose
    # DPL is forced up (double, D=256 → DPL 8) keeps one row to stay spill-free.
    rows_per_group = 1 if (acc_bytes == 8 and D // G > 4) else 2
    tile_rows = min(64, BWD_SMEM_TILE_BYTES // (2 * D * acc_bytes))
    return G, rows_per_group, tile_rows


def simt_backward_plans(d: int, dtype, *, max_smem: int = 48 * 1024
                        ) -> tuple[SimtBwdPlan, SimtBwdPlan]:
    """The SIMT (dK/dV, dQ) plans for head dim d and dtype; chunked for d above the
    largest bucket (`bwd_head_dim_chunks(d)` chunks, a run-time argument)."""
    name = dtype_name(dtype)
    D = bwd_head_dim_bucket(d)
    G, rpg, tile_rows = _bwd_shape(name, D)
    plans = tuple(SimtBwdPlan(kernel, name, D, G, rpg, BWD_NUM_WARPS, tile_rows, chunked=d > D)
                  for kernel in BWD_KERNELS)
    need = max(p.smem_bytes for p in plans)
    if need > max_smem:
        raise ValueError(
            f"the backward tiles for head dim d={d} ({name}) need {need} "
            f"bytes of shared memory per block; this device has {max_smem}. "
            f"Use backend='numpy'.")
    return plans


@functools.cache
def all_simt_bwd_plans() -> tuple[SimtBwdPlan | BwdPreprocessPlan, ...]:
    """Every SIMT backward specialization the library can launch (for the gate): per
    dtype, the preprocess kernel, both kernels for every bucket, and both chunked."""
    plans = []
    for dt in DTYPE_NAMES:
        plans.append(bwd_preprocess_plan(dt))
        for D in BWD_HEAD_DIM_BUCKETS:
            plans.extend(simt_backward_plans(D, dt))
        plans.extend(simt_backward_plans(BWD_HEAD_DIM_BUCKETS[-1] + 1, dt))
    return tuple(plans)
