"""Shared fixtures: the backends every API test body runs on, and tolerance rules."""
import shutil

import numpy as np
import pytest

from cuflash import _dtypes


def _cuda_device_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


HAS_GPU = _cuda_device_count() > 0
HAS_GXX = shutil.which("g++") is not None

BACKEND_PARAMS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("emulator", id="emulator",
                 marks=pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")),
    pytest.param("cuda", id="cuda",
                 marks=[pytest.mark.gpu,
                        pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")]),
]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    return request.param


def to_backend(backend, *arrays):
    """Host arrays as the backend takes them (CuPy arrays for "cuda")."""
    if backend == "cuda":
        import cupy
        out = [cupy.asarray(a) for a in arrays]
    else:
        out = list(arrays)
    return out[0] if len(out) == 1 else out


def to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


DTYPES = [pytest.param(d, id=str(d)) for d in _dtypes.SUPPORTED]


def round_to(x, dtype):
    """x rounded to dtype and back to float64: one low-precision store."""
    return np.asarray(x).astype(dtype).astype(np.float64)


def assert_close_to_reference(out, ref, plain, dtype, *, factor=2.0, what="output"):
    """FlashAttention's rule: max|out - ref| <= factor * max|plain - ref| + floor.

    ref is float64; plain is a straightforward implementation in `dtype` (for float32 and
    float64 the rule turns into a tight absolute bound).
    """
    out = to_host(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    finite = np.isfinite(ref)
    # Non-finite reference entries (NaN rows) must be reproduced exactly.
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=f"NaN pattern of {what}")
    np.testing.assert_array_equal(out[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)])
    if not finite.any():
        return
    err = np.max(np.abs(out[finite] - ref[finite]))
    scale = max(1.0, float(np.max(np.abs(ref[finite]))))
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        bound = 1e-10 * scale
    elif dtype == np.float32:
        bound = 2e-5 * scale
    else:
        plain_err = np.max(np.abs(np.asarray(plain, np.float64)[finite] - ref[finite]))
        bound = factor * plain_err + 1e-3 * scale
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} ({dtype})"
