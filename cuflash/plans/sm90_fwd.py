"""The Hopper forward, `Sm90FwdTraits` (kernels/flash_fwd_sm90.cu): one tile, built for
sm_90a alone (wgmma, TMA, setmaxnreg), taken by plain calls on a device that runs it;
float32 as split tf32 or one-pass tf32 (`allow_tf32`)."""
from __future__ import annotations

import dataclasses

from .base import Plan, flag

SM90_DTYPES = ("float16", "bfloat16")
SM90_HEAD_DIMS = (64, 128, 256)
SM90_TF32_HEAD_DIMS = (64, 128, 256)   # float32, one-pass tf32
SM90_SPLIT_HEAD_DIMS = (64, 128)       # float32, split tf32
ROW_BYTES = 128              # a TMA box's row: 64 16-bit elements or 32 floats


@dataclasses.dataclass(frozen=True)
class Sm90FwdPlan(Plan):
    """flash_fwd_sm90_kernel<T, HEAD_DIM, VARLEN[, SPLIT]>: 128 × 128 tiles, two consumer
    warpgroups of 64 query rows and a producer warpgroup streaming K_j, V_j through a
    two-stage TMA ring; blocks walk the tiles head by head; VARLEN: packed sequences.
    float32 (tf32): 128 × 64 tiles, the producer's other warps writing V_jᵀ for P̃ V_j;
    SPLIT: split tf32. Narrow (split at D = 128, one-pass at 256): 64 × 32 tiles, one
    consumer warpgroup."""

    dynamic_smem = True
    arch_specific = True
    stages = 2                # kStages

    kernel: str               # "flash_fwd_sm90"
    dtype: str                # "float16", "bfloat16" or "float32" (tf32)
    head_dim: int             # HEAD_DIM: exactly d (64, 128 or 256; float32 64 or 128)
    varlen: bool = False      # VARLEN: packed sequences (cu_q, cu_k)
    split: bool = False       # SPLIT: float32 as split tf32 (else one-pass)

    @property
    def tf32(self) -> bool:
        """kTf32: float32 operands on tf32 wgmma."""
        return self.dtype == "float32"

    @property
    def narrow(self) -> bool:
        """kNarrow: split tf32 at D = 128 and one-pass at 256, whose lo parts or rows fit
        only beside 64 × 32 tiles."""
        return self.tf32 and self.head_dim == (128 if self.split else 256)

    @property
    def consumers(self) -> int:
        """kConsumers: warpgroups of 64 query rows (one where narrow)."""
        return 1 if self.narrow else 2

    @property
    def block_m(self) -> int:
        """kBlockM: the consumers' query rows."""
        return 64 * self.consumers

    @property
    def num_threads(self) -> int:
        """kThreads: the consumers and the producer warpgroup."""
        return 128 * (self.consumers + 1)

    @property
    def block_n(self) -> int:
        """kBlockN: 64-key tiles at D = 256 (its accumulators and Q_i leave room for no
        more) and for float32 (narrow: 32), 128 otherwise."""
        if self.narrow:
            return 32
        return 64 if self.head_dim == 256 or self.tf32 else 128

    @property
    def raw_stages(self) -> int:
        """kRawStages: V_j's slots as loaded (one-pass float32 at D ≥ 128: one, two leave
        no room)."""
        return 1 if self.tf32 and not self.split and self.head_dim >= 128 else self.stages

    @property
    def score_tile(self) -> tuple:
        """(query rows, keys) of the kernel's score tiles: a block mask's granularity."""
        return self.block_m, self.block_n

    @property
    def head_dim_bucket(self) -> int:
        return self.head_dim

    @property
    def stages_o(self) -> bool:
        """kStageO: O through shared memory and a TMA store (D = 256 and float32: from
        registers)."""
        return self.head_dim != 256 and not self.tf32

    @property
    def smem_bytes(self) -> int:
        """Smem: Q_i (and O_i's staging) in kBoxes boxes of block_m rows of 128 bytes, the
        rings' K_j, V_j stages in kBoxes boxes of block_n rows; float32's V_jᵀ stages (and
        split's lo parts)."""
        boxes = self.head_dim * self.element.bytes // ROW_BYTES
        q_box = self.block_m * ROW_BYTES
        q_o = (2 if self.stages_o else 1) * boxes * q_box
        kv_box = self.block_n * ROW_BYTES
        vt = self.stages * self.head_dim * self.block_n * 4 if self.tf32 else 0
        # split: Q_i's, K_j's and V_jᵀ's lo parts
        lo = boxes * q_box + self.stages * boxes * kv_box + vt if self.split else 0
        return q_o + (self.stages + self.raw_stages) * boxes * kv_box + vt + lo

    def __str__(self) -> str:
        tf32 = (" split-tf32" if self.split else " tf32") if self.tf32 else ""
        return (f"{self.kernel} {self.dtype}{tf32} D={self.head_dim} Br={self.block_m} "
                f"Bc={self.block_n} warpgroups={self.consumers}+1 stages={self.stages} "
                f"smem={self.smem_bytes} B"
                + (" varlen" if self.varlen else ""))

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, flag(self.varlen),
                                 *([flag(True)] if self.split else []))


def sm90_fwd_plan(dtype: str, d: int, varlen: bool = False,
                  allow_tf32: bool = False) -> Sm90FwdPlan | None:
    """The Hopper forward's plan for `dtype` (a name) and head dim `d` (`varlen`: packed
    sequences; float32 as split tf32, or with `allow_tf32` one-pass tf32), None if it has
    none."""
    if dtype in SM90_DTYPES and d in SM90_HEAD_DIMS:
        return Sm90FwdPlan("flash_fwd_sm90", dtype, d, varlen)
    if dtype == "float32" and d in (SM90_TF32_HEAD_DIMS if allow_tf32 else SM90_SPLIT_HEAD_DIMS):
        return Sm90FwdPlan("flash_fwd_sm90", dtype, d, varlen, split=not allow_tf32)
    return None


def all_sm90_fwd_plans() -> tuple[Sm90FwdPlan, ...]:
    return tuple(Sm90FwdPlan("flash_fwd_sm90", t, d, varlen, split)
                 for t, dims, split in [*((t, SM90_HEAD_DIMS, False) for t in SM90_DTYPES),
                                        ("float32", SM90_SPLIT_HEAD_DIMS, True),
                                        ("float32", SM90_TF32_HEAD_DIMS, False)]
                 for d in dims for varlen in (False, True))
