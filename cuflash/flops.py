"""The FLOP count every cuflash benchmark and the `bench`/`demo` commands report.

FlashAttention's convention: the forward's two matmuls (S = Q Kᵀ, O = P V) are
4·B·H·Nq·Nk·d FLOPs (2 per multiply-add), halved under causal masking; the backward's
five matmuls count as 2.5× the forward. The exponentials and the softmax bookkeeping
are not counted, so rates are comparable with the papers' and flash-attn's.
"""

# Work of each pass relative to the forward.
PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(batch, heads, nq, nk, d, *, causal, pass_="fwd"):
    """FLOPs of one attention pass ("fwd", "bwd" or "fwd+bwd") by FlashAttention's count."""
    if pass_ not in PASS_FACTOR:
        raise ValueError(f"pass_ must be one of {tuple(PASS_FACTOR)}; got {pass_!r}")
    forward = 4.0 * batch * heads * nq * nk * d / (2 if causal else 1)
    return forward * PASS_FACTOR[pass_]
