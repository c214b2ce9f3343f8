"""Online-softmax plans (online_softmax.cu): no shared memory beyond the block reduction's
(static), so no traits struct to mirror."""
from __future__ import annotations

import dataclasses

from ..families import SOFTMAX_COLS, SOFTMAX_ROWS
from .base import DTYPE_NAMES, Plan, dtype_name

SOFTMAX_THREADS = 128
# softmax_cols (one thread per line) once there are this many lines side by side along
# the contiguous Q axis, so neighbouring threads read neighbouring addresses; otherwise
# softmax_rows (one block per line, its threads striding along n and merging their m, ℓ).
SOFTMAX_COLS_MIN_Q = 32


@dataclasses.dataclass(frozen=True)
class SoftmaxPlan(Plan):
    """One softmax kernel over x (P, n, Q), normalising axis 1."""

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
    return SoftmaxPlan(family.name, dtype_name(dtype))


def all_softmax_plans() -> tuple[SoftmaxPlan, ...]:
    return tuple(SoftmaxPlan(f.name, dt) for f in (SOFTMAX_ROWS, SOFTMAX_COLS)
                 for dt in DTYPE_NAMES)
