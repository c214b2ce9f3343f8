"""The papers' block sizes: for M elements of SRAM, Bc = ceil(M / 4d) and Br = min(Bc, d)
(FlashAttention, Algorithm 1, line 1). The kernels' tuned plans are in the other modules."""
from __future__ import annotations

import math


def paper_block_sizes(M: int, d: int) -> tuple[int, int]:
    """The papers' rule, returned as (Br, Bc): Bc = ceil(M / 4d), Br = min(Bc, d)."""
    if M < 1 or d < 1:
        raise ValueError(f"paper_block_sizes needs M >= 1 and d >= 1; got M={M}, d={d}")
    bc = math.ceil(M / (4 * d))
    return min(bc, d), bc  # (Br, Bc)
