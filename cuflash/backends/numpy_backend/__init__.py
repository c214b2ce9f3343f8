"""The NumPy backend: blocked FlashAttention-2 on the CPU, the default without a GPU.

The FA2 loop order — Q tiles outer, K/V tiles inner, O kept unscaled until one final
rescale — with the online-softmax state named as in `cuflash.reference.fa2_attention`
(`m_i`, `l_i`, `acc`; init / update / finalize), but each step works on a tile of
several heads at once:

    q (B, Hq, Nq, d) → view (B·Hkv, G, Nq, d),  k, v (B, Hkv, Nk, d) → (B·Hkv, Nk, d)

with G = Hq / Hkv. A Q tile is the rows [r0, r1) of the G query heads sharing one
K/V head, stacked into one (G·Br, d) matrix: GQA costs no copy of K/V and every
matmul is a plain batched `@` over K/V heads. The tiles (head range × Q rows) are
spread over a small thread pool, by default one worker per usable core.

Unlike the CUDA kernels, the default forward tile does not keep a running max: the
max in exp(S − m) only guards against overflow, so each row's reference m is frozen
at its max over the first `CpuConfig.max_sample` keys (the "frozen max"), computed
once per call and folded into the Q Kᵀ matmul; a step is then Q Kᵀ, exp, P̃ [V | 1]
— no rowmax, no rescale.
A tile whose ℓ leaves [2^-30, 2^64] or whose acc is not finite (scores far above the
sample's max, +inf, NaN, huge V) is redone with FA2's running max (the online tile),
as is every tile with `CpuConfig(frozen_max=False)`. `algorithm="fa1"` runs FA1's
loop order (K/V tiles outer, O, ℓ, m rescaled in memory every step); the backward is
FA2's (K/V tiles outer, Q rows inner), with the seed equations' names.

Plain float32 and 16-bit forwards and backwards run compiled kernels first where the
CPU and a C++ compiler allow it (native: the same FA2 loops in C++ with AVX-512 or
AVX2, built on first use), the tiles above taking whatever they do not.

Modules: config (CpuConfig, every setting), native (the compiled kernels), expbase
(exp or exp2, and its fast range), pool (the worker threads), schedule (which blocks
a loop visits, the causal mask, tasks), arrays (views and scratch), forward and
forward_tiles (FA2 forward), fa1, backward, softmax, variants (window, softcap, ALiBi,
bias, mask, dropout, score_mod, mask_mod and block masks: forward and backward with
dbias and the score_mod's buffer gradients, in FA2's loop order for either algorithm).

Memory: one score tile (heads, G·Br, Bc) per worker, plus O(N·d) arrays (the
outputs; [c·Q | ·], [K | 1] and [V | 1] prepared once per call in the accumulation
dtype, whatever the inputs' strides; dQ accumulators) — never N×N. The tiles' and the
prepared arrays' buffers are kept for the next call (up to 32 MiB of the latter: fresh
pages cost a fault each); `release_buffers()` frees them.

Numerics: 16-bit inputs are widened to float32 and accumulated in float32, float64
in float64; −inf − (−inf) is guarded by subtracting 0 from rows whose max is still
−inf; a fully masked row gets o = 0 and lse = −inf; a NaN or +inf score poisons its
own row only, as scipy.special.softmax does. An extreme scale is split between Q and
K, and a P̃ V that overflows is redone with V scaled by powers of two (arrays:
split_scale, column_shift). The backward's tasks run in fixed lanes (pool.lanes), so
its sums have one order and its result is bitwise reproducible.
"""
import numpy as np

from . import backward, fa1, forward, softmax, variants as variant_loops
from .arrays import release_buffers
from .config import DEFAULT_CONFIG, CpuConfig

__all__ = ["BACKEND", "CpuConfig", "DEFAULT_CONFIG", "NumpyBackend", "release_buffers"]

_FORWARDS = {"fa2": forward.forward, "fa1": fa1.forward}


class NumpyBackend:
    """The backend object (see cuflash.backends): name, xp, forward, backward, softmax,
    with the settings of `config` (a CpuConfig)."""

    name = "numpy"
    xp = np

    def __init__(self, config=DEFAULT_CONFIG):
        if not isinstance(config, CpuConfig):
            raise TypeError(f"config must be a CpuConfig; got {type(config).__name__}")
        self.config = config

    def forward(self, q, k, v, *, causal, scale, algorithm="fa2", variants=None,
                allow_tf32=False):
        # allow_tf32 is ignored: float32 on the CPU is computed in exact fp32 already.
        if variants is not None and not variants.is_plain():
            # Both algorithms: the variants run in FA2's loop order (variants.py).
            return variant_loops.forward(q, k, v, causal, scale, self.config, variants)
        return _FORWARDS[algorithm](q, k, v, causal, scale, self.config)

    def backward(self, do, q, k, v, o, lse, *, causal, scale, variants=None,
                 return_dbias=False, allow_tf32=False, return_mod_grads=False,
                 deterministic=True):
        # allow_tf32 is ignored, as in forward; the results are deterministic always.
        if (variants is not None and not variants.is_plain()) or return_dbias:
            return variant_loops.backward(do, q, k, v, o, lse, causal, scale, self.config,
                                          variants, return_dbias, return_mod_grads)
        return backward.backward(do, q, k, v, o, lse, causal, scale, self.config)

    def softmax(self, x):
        return softmax.softmax(x, self.config)

    def __repr__(self):
        return (f"<cuflash numpy backend: {self.config.workers} workers, "
                f"base {self.config.base.name}>")


BACKEND = NumpyBackend()
