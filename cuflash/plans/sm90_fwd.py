"""The Hopper forward, `Sm90FwdTraits` (kernels/flash_fwd_sm90.cu): one tile, built for
sm_90a alone (wgmma, TMA, setmaxnreg), taken by plain calls on a device that runs it."""
from __future__ import annotations

import dataclasses

from .base import Plan, flag

SM90_DTYPES = ("float16", "bfloat16")
SM90_HEAD_DIMS = (64, 128, 256)
BOX_BYTES = 128 * 64 * 2     # one TMA box: 128 rows of 64 16-bit elements (128 bytes)


@dataclasses.dataclass(frozen=True)
class Sm90FwdPlan(Plan):
    """flash_fwd_sm90_kernel<T, HEAD_DIM, VARLEN>: 128 × 128 tiles, two consumer warpgroups
    of 64 query rows and a producer warpgroup streaming K_j, V_j through a two-stage TMA
    ring; blocks walk the tiles head by head; VARLEN: packed sequences."""

    dynamic_smem = True
    arch_specific = True
    block_m = 128             # kBlockM
    stages = 2                # kStages
    num_threads = 384         # kThreads

    kernel: str               # "flash_fwd_sm90"
    dtype: str                # "float16" or "bfloat16"
    head_dim: int             # HEAD_DIM: exactly d (64 or 128)
    varlen: bool = False      # VARLEN: packed sequences (cu_q, cu_k)

    @property
    def block_n(self) -> int:
        """kBlockN: 64-key tiles at D = 256 (its accumulators and Q_i leave room for no
        more), 128 below."""
        return 64 if self.head_dim == 256 else 128

    @property
    def score_tile(self) -> tuple:
        """(query rows, keys) of the kernel's score tiles: a block mask's granularity."""
        return self.block_m, self.block_n

    @property
    def head_dim_bucket(self) -> int:
        return self.head_dim

    @property
    def stages_o(self) -> bool:
        """kStageO: O through shared memory and a TMA store (D = 256: from registers)."""
        return self.head_dim != 256

    @property
    def smem_bytes(self) -> int:
        """Smem: Q_i (and O_i's staging) in D / 64 boxes of 128 rows, the rings' K_j, V_j
        stages in D / 64 boxes of block_n rows."""
        boxes = self.head_dim // 64
        q_o = (2 if self.stages_o else 1) * boxes * BOX_BYTES
        return q_o + 2 * self.stages * boxes * BOX_BYTES * self.block_n // 128

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim} Br={self.block_m} "
                f"Bc={self.block_n} warpgroups=2+1 stages={self.stages} smem={self.smem_bytes} B"
                + (" varlen" if self.varlen else ""))

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim, flag(self.varlen))


def sm90_fwd_plan(dtype: str, d: int, varlen: bool = False) -> Sm90FwdPlan | None:
    """The Hopper forward's plan for `dtype` (a name) and head dim `d` (`varlen`: packed
    sequences), None if it has none."""
    if dtype in SM90_DTYPES and d in SM90_HEAD_DIMS:
        return Sm90FwdPlan("flash_fwd_sm90", dtype, d, varlen)
    return None


def all_sm90_fwd_plans() -> tuple[Sm90FwdPlan, ...]:
    return tuple(Sm90FwdPlan("flash_fwd_sm90", t, d, varlen) for t in SM90_DTYPES
                 for d in SM90_HEAD_DIMS for varlen in (False, True))
