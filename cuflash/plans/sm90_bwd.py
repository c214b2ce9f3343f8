"""The Hopper backward, `Sm90BwdTraits` and `Sm90BwdDqTraits` (kernels/flash_bwd_sm90.cu):
the dK/dV pass and the dQ pass, built for sm_90a alone (wgmma, TMA, setmaxnreg); or the
5-GEMM pair, the dK/dV pass adding dQ's parts into float32 partials (DQ_PARTS) and the
partials' sum."""
from __future__ import annotations

import dataclasses

from .base import Plan, backward_score_tile
from .sm90_fwd import SM90_DTYPES

SM90_BWD_HEAD_DIMS = (64, 128)   # d = 256 runs mma.sync's backward

BOX_BYTES = {128: 128 * 64 * 2, 64: 64 * 64 * 2}   # a TMA box of 64 16-bit columns, by rows
SM90_BWD_KERNELS = ("flash_bwd_dkdv_sm90", "flash_bwd_dq_sm90")
SM90_DQ_SUM_KERNEL = "flash_bwd_dq_sum_sm90"


@dataclasses.dataclass(frozen=True)
class Sm90BwdPlan(Plan):
    """flash_bwd_dkdv_sm90_kernel<T, HEAD_DIM> (128 keys K_j, V_j per block; Q_i, dO_i
    streamed in 64-row blocks) or flash_bwd_dq_sm90_kernel<T, HEAD_DIM> (128 query rows Q_i,
    dO_i per block; K_j, V_j streamed in 64-row tiles): two consumer warpgroups of 64 rows of
    the block's own operand, a producer warpgroup with a two-stage TMA ring."""

    dynamic_smem = True
    arch_specific = True
    own_rows = 128            # the block's own rows (kBlockN of dK/dV, kBlockM of dQ)
    streamed_rows = 64        # the ring's rows per step
    stages = 2                # kStages
    num_threads = 384         # kThreads

    kernel: str               # one of SM90_BWD_KERNELS
    dtype: str                # "float16" or "bfloat16"
    head_dim: int             # HEAD_DIM: exactly d (64 or 128)
    dq_parts: bool = False    # DQ_PARTS (dK/dV): dQ's parts by bulk reduce-adds, no dQ pass

    @property
    def score_tile(self) -> tuple:
        """(query rows, keys) of the kernel's score tiles: a block mask's granularity."""
        return backward_score_tile(self.own_rows, self.streamed_rows,
                                   self.kernel == "flash_bwd_dkdv_sm90")

    @property
    def smem_bytes(self) -> int:
        """Smem: the block's two own tiles and the ring's stages of two streamed ones, each
        D / 64 boxes; the dK/dV pass's stages also hold their queries' lse and D."""
        boxes = self.head_dim // 64
        dkdv = self.kernel == "flash_bwd_dkdv_sm90"
        stats = 2 * self.stages * self.streamed_rows * 4 if dkdv else 0
        tiles = 2 * boxes * (BOX_BYTES[self.own_rows]
                             + self.stages * BOX_BYTES[self.streamed_rows]) + stats
        if self.dq_parts:   # each warpgroup's dSᵀ (64 x 64, 16-bit), on a 1024-byte boundary,
            # and its part of dQ_i (64 x D, float32)
            tiles = -(-tiles // 1024) * 1024 + 2 * 64 * 64 * 2 + 2 * 64 * self.head_dim * 4
        return tiles

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim} own={self.own_rows} "
                f"streamed={self.streamed_rows} warpgroups=2+1 stages={self.stages} "
                f"smem={self.smem_bytes} B" + (" dq-parts" if self.dq_parts else ""))

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, *(["true"] if self.dq_parts else []))


def sm90_bwd_plans(dtype: str, d: int) -> tuple[Sm90BwdPlan, Sm90BwdPlan] | None:
    """The Hopper (dK/dV, dQ) plans for `dtype` (a name) and head dim `d`, None if none."""
    if dtype in SM90_DTYPES and d in SM90_BWD_HEAD_DIMS:
        return tuple(Sm90BwdPlan(kernel, dtype, d) for kernel in SM90_BWD_KERNELS)
    return None


SM90_DQ_PARTS_HEAD_DIMS = (64, 128)   # the dK/dV pass adding dQ's parts itself


@dataclasses.dataclass(frozen=True)
class Sm90DqSumPlan(Plan):
    """flash_bwd_dq_sum_sm90_kernel<T, HEAD_DIM>: dQ = scale · Σ_p partial_p of the 5-GEMM
    Hopper backward, from its tiles' order back to rows; a float4 of the partials per
    thread. No shared memory."""

    arch_specific = True
    num_threads = 256
    smem_bytes = 0
    kernel = SM90_DQ_SUM_KERNEL

    dtype: str                # "float16" or "bfloat16"
    head_dim: int             # HEAD_DIM: 64 or 128

    def __str__(self) -> str:
        return f"{self.kernel} {self.dtype} D={self.head_dim} threads={self.num_threads}"

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim)


def sm90_dq_parts_plans(dtype: str, d: int) -> tuple[Sm90BwdPlan, Sm90DqSumPlan] | None:
    """The Hopper 5-GEMM pair for `dtype` and head dim `d`: the dK/dV plan that adds dQ's
    parts by bulk reduce-adds (into per-worker partials, or all into one: deterministic=False)
    and the partials' sum; None if none."""
    if dtype in SM90_DTYPES and d in SM90_DQ_PARTS_HEAD_DIMS:
        return Sm90BwdPlan(SM90_BWD_KERNELS[0], dtype, d, dq_parts=True), Sm90DqSumPlan(dtype, d)
    return None


def all_sm90_bwd_plans() -> tuple[Plan, ...]:
    return tuple(p for t in SM90_DTYPES for d in SM90_DQ_PARTS_HEAD_DIMS
                 for p in sm90_dq_parts_plans(t, d)) + tuple(
        Sm90BwdPlan(kernel, t, d) for kernel in SM90_BWD_KERNELS
        for t in SM90_DTYPES for d in SM90_BWD_HEAD_DIMS)
