"""The dtypes cuflash accepts, and what each one accumulates in.

One place maps a NumPy dtype to its accumulation dtype, its lse dtype and the
C type name the kernels are instantiated with.
"""
import numpy as np

try:  # bfloat16 as CuPy and JAX spell it; optional (the `bf16` extra).
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover - exercised only without ml_dtypes
    bfloat16 = None

FLOAT16 = np.dtype(np.float16)
FLOAT32 = np.dtype(np.float32)
FLOAT64 = np.dtype(np.float64)
BFLOAT16 = np.dtype(bfloat16) if bfloat16 is not None else None

SUPPORTED = tuple(d for d in (FLOAT16, BFLOAT16, FLOAT32, FLOAT64) if d is not None)
SUPPORTED_NAMES = "float16, bfloat16 (ml_dtypes), float32, float64"

_C_TYPE = {FLOAT16: "__half", FLOAT32: "float", FLOAT64: "double"}
if BFLOAT16 is not None:
    _C_TYPE[BFLOAT16] = "__nv_bfloat16"


def is_supported(dtype) -> bool:
    return np.dtype(dtype) in SUPPORTED


def accum_dtype(dtype) -> np.dtype:
    """float64 inputs accumulate in float64; every other dtype in float32."""
    return FLOAT64 if np.dtype(dtype) == FLOAT64 else FLOAT32


# lse is kept in the accumulation precision: it is what the backward needs.
lse_dtype = accum_dtype


def c_type(dtype) -> str:
    """The CUDA C type name a kernel template is instantiated with."""
    return _C_TYPE[np.dtype(dtype)]
