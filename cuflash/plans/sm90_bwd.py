"""The Hopper backward's dK/dV pass, `Sm90BwdTraits` (kernels/flash_bwd_sm90.cu): one tile,
built for sm_90a alone (wgmma, TMA, setmaxnreg)."""
from __future__ import annotations

import dataclasses

from .base import Plan
from .sm90_fwd import SM90_DTYPES, SM90_HEAD_DIMS

KV_BOX_BYTES = 128 * 64 * 2    # a K or V box: 128 rows of 64 16-bit elements (128 bytes)
Q_BOX_BYTES = 64 * 64 * 2      # a Q or dO box: 64 rows


@dataclasses.dataclass(frozen=True)
class Sm90BwdPlan(Plan):
    """flash_bwd_dkdv_sm90_kernel<T, HEAD_DIM>: 128 keys per block, two consumer
    warpgroups of 64 keys, a producer warpgroup streaming 64-row Q_i, dO_i through a
    two-stage TMA ring."""

    dynamic_smem = True
    arch_specific = True
    block_n = 128             # kBlockN: keys per block
    block_m = 64              # kBlockM: queries per step
    stages = 2                # kStages
    num_threads = 384         # kThreads

    kernel: str               # "flash_bwd_dkdv_sm90"
    dtype: str                # "float16" or "bfloat16"
    head_dim: int             # HEAD_DIM: exactly d (64 or 128)

    @property
    def smem_bytes(self) -> int:
        """Smem: K_j, V_j, and the ring's Q_i, dO_i stages, each D / 64 boxes."""
        boxes = self.head_dim // 64
        return 2 * boxes * KV_BOX_BYTES + 2 * self.stages * boxes * Q_BOX_BYTES

    def __str__(self) -> str:
        return (f"{self.kernel} {self.dtype} D={self.head_dim} Bc={self.block_n} "
                f"Br={self.block_m} warpgroups=2+1 stages={self.stages} smem={self.smem_bytes} B")

    @property
    def name_expression(self) -> str:
        return self._instantiate(self.head_dim)


def sm90_bwd_plan(dtype: str, d: int) -> Sm90BwdPlan | None:
    """The Hopper dK/dV plan for `dtype` (a name) and head dim `d`, None if it has none."""
    if dtype in SM90_DTYPES and d in SM90_HEAD_DIMS:
        return Sm90BwdPlan("flash_bwd_dkdv_sm90", dtype, d)
    return None


def all_sm90_bwd_plans() -> tuple[Sm90BwdPlan, ...]:
    return tuple(Sm90BwdPlan("flash_bwd_dkdv_sm90", t, d) for t in SM90_DTYPES
                 for d in SM90_HEAD_DIMS)
