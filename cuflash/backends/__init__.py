"""Backends: where the attention actually runs.

Every backend is an object with

    name: str                      # "numpy", "cuda", "emulator"
    xp: module                     # the array module its arrays live in (numpy or cupy)
    forward(q, k, v, *, causal, scale, algorithm, allow_tf32=False) -> (o, lse)
    backward(do, q, k, v, o, lse, *, causal, scale, allow_tf32=False) -> (dq, dk, dv)
    softmax(x) -> p

and receives inputs already checked and normalised by `cuflash.api`:
q is (B, Hq, Nq, d), k and v are (B, Hkv, Nk, d) with Hq % Hkv == 0, all of one
supported dtype, any strides, every size >= 1. o has q's shape and dtype; lse is
(B, Hq, Nq) in the accumulation dtype; dk and dv sum over the query heads of their
group. softmax takes x of shape (P, n, Q) and normalises over axis 1.
`allow_tf32=True` (passed only when set) lets float32 run one-pass tf32 on tensor cores;
a backend without them (numpy: float32 on the CPU is exact fp32) accepts and ignores it.
"""
NAMES = ("numpy", "cuda", "emulator")


def get(name: str):
    """The backend object called `name` (one of NAMES)."""
    if name == "numpy":
        from .numpy_backend import BACKEND
        return BACKEND
    if name == "cuda":
        from .kernels import cuda_backend
        return cuda_backend()
    if name == "emulator":
        from .kernels import emulator_backend
        return emulator_backend()
    raise ValueError(f"backend must be one of {('auto',) + NAMES}; got {name!r}")
