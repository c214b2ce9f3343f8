"""The online softmax on the CUDA kernels of `online_softmax.cu`.

`softmax(backend, x)` normalises x (P, n, Q) over axis 1 in one launch: one thread per
(p, q) line when lines lie side by side along the contiguous Q axis, else one block per
line (`tiling.plan_softmax`).
"""
from __future__ import annotations

from .. import tiling
from .marshal import i32, softmax_args


def softmax(backend, x):
    """softmax over axis 1 of x (P, n, Q), as scipy.special.softmax(x, axis=1)."""
    xp = backend.xp
    if any(s < 0 for s in x.strides):
        x = xp.ascontiguousarray(x)
    P, n, Q = x.shape
    y = xp.empty((P, n, Q), dtype=x.dtype)
    plan = tiling.plan_softmax(x.dtype, Q)
    lines = P * Q
    if plan.kernel == "softmax_cols":
        grid = -(-lines // plan.num_threads)   # one thread per line
    else:
        grid = lines                            # one block per line
    i32(grid, "grid size (softmax lines)")
    backend.get_function(plan)((grid,), (plan.num_threads,),
                               softmax_args(x, y, P=P, n=n, Q=Q),
                               shared_mem=plan.dynamic_smem_bytes)
    return y
