"""The block-mask kernel's plan (block_mask.cu): one block of threads per tile, no shared
memory beyond the barrier's; compiled with the call's mask_mod in front of it, so it is
not among the plain specializations (the compile gate builds it with its example mods)."""
from __future__ import annotations

import dataclasses

from .base import Plan

BLOCK_MASK_THREADS = 256


@dataclasses.dataclass(frozen=True)
class BlockMaskPlan(Plan):
    """The kernel that classifies a block mask's tiles; `dtype`: the accumulation dtype the
    mask_mod's float arithmetic runs in ("float32" or "float64")."""

    dtype: str = "float32"
    kernel: str = "block_mask"
    num_threads: int = BLOCK_MASK_THREADS
    smem_bytes = 0

    @property
    def name_expression(self) -> str:
        return f"block_mask_kernel<{self.num_threads}>"
