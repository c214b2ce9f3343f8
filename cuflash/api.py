"""The public functions: check the arguments, normalise shapes, pick a backend, dispatch.

Backends see only 4-D (B, H, N, d) inputs of one supported dtype with every size >= 1
(see `cuflash.backends`); everything about user-facing shapes, empty inputs, defaults
and error messages lives here.
"""
import math

import numpy as np

from . import _checks, _dtypes, backends

BACKENDS = ("auto",) + backends.NAMES


# -- choosing a backend and bringing arrays to it --------------------------------------

def _on_gpu(x) -> bool:
    """True for CuPy arrays and for arrays that live on a CUDA device (Torch, JAX, ...)."""
    if type(x).__module__.split(".")[0] == "cupy":
        return True
    if hasattr(x, "__cuda_array_interface__"):
        return True
    dlpack_device = getattr(x, "__dlpack_device__", None)
    if dlpack_device is not None:
        try:
            return dlpack_device()[0] in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
        except Exception:
            return False
    return False


def _resolve_backend(backend, arrays):
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "auto":
        backend = "cuda" if any(_on_gpu(x) for x in arrays.values()) else "numpy"
    return backends.get(backend)


def _to_cupy(name, x):
    import cupy
    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)  # zero-copy view of the foreign GPU buffer
    if _on_gpu(x):
        return cupy.from_dlpack(x)  # zero-copy
    raise TypeError(f"backend='cuda' computes on GPU arrays; {name} is "
                    f"{_checks.describe(x)}. Move it with cupy.asarray({name}), or use "
                    f"backend='numpy' for arrays in host memory")


def _to_numpy(name, x, backend_name):
    if _on_gpu(x):
        raise TypeError(f"backend={backend_name!r} computes on NumPy arrays in host memory; "
                        f"{name} is {_checks.describe(x)} on the GPU. Use backend='cuda', "
                        f"or copy it to the host with cupy.asnumpy({name})")
    return np.asarray(x)


def _bring(backend, arrays):
    """The arrays as the backend's array type, zero-copy where possible."""
    if backend.name == "cuda":
        return [_to_cupy(n, x) for n, x in arrays.items()]
    return [_to_numpy(n, x, backend.name) for n, x in arrays.items()]


# -- shapes ----------------------------------------------------------------------------

def _as_4d(x, batch, heads):
    """(..., H, N, d) or (N, d) -> (B, H, N, d), a view where the strides allow."""
    return x.reshape((math.prod(batch), heads) + tuple(x.shape[-2:]))


# -- the public functions --------------------------------------------------------------

def flash_attention(q, k, v, *, causal=False, scale=None, return_lse=False,
                    algorithm="fa2", backend="auto"):
    """Exact attention softmax(scale · Q Kᵀ) V without building the N×N score matrix.

    q: (..., Nq, d); k, v: (..., Nk, d). Leading axes are batch axes and must match,
    except the head axis -3, where q's head count may be a multiple of k's (GQA/MQA).
    causal masks key j for query i when j > i + (Nk - Nq) (bottom-right aligned);
    a query row that sees no key gets output 0 and lse -inf.
    Returns o with q's shape and dtype, and with return_lse=True also lse, the
    natural-log log-sum-exp of each row's scaled scores, shape (..., Nq), float32
    (float64 for float64 inputs).
    backend: "auto" ("cuda" for GPU arrays, else "numpy"), "numpy", "cuda", "emulator".
    """
    causal = _checks.check_flag("causal", causal)
    return_lse = _checks.check_flag("return_lse", return_lse)
    algorithm = _checks.check_algorithm(algorithm)
    arrays = {"q": q, "k": k, "v": v}
    be = _resolve_backend(backend, arrays)
    q, k, v = _bring(be, arrays)
    dtype = _checks.check_same_dtype(q=q, k=k, v=v)
    batch, hq, hkv, nq, nk, d = _checks.check_attention_shapes(q, k, v)
    scale = _checks.check_scale(scale, d)
    xp = be.xp
    lse_dtype = _dtypes.lse_dtype(dtype)

    if math.prod(batch) == 0 or hq == 0 or nq == 0:
        o = xp.empty(q.shape, dtype=dtype)
        lse = xp.empty(q.shape[:-1], dtype=lse_dtype)
    elif nk == 0:  # no key at all: every row is fully masked
        o = xp.zeros(q.shape, dtype=dtype)
        lse = xp.full(q.shape[:-1], -np.inf, dtype=lse_dtype)
    else:
        o, lse = be.forward(_as_4d(q, batch, hq), _as_4d(k, batch, hkv),
                            _as_4d(v, batch, hkv), causal=causal, scale=scale,
                            algorithm=algorithm)
        o = o.reshape(q.shape)
        lse = lse.reshape(q.shape[:-1])
    return (o, lse) if return_lse else o


def flash_attention_backward(do, q, k, v, o, lse, *, causal=False, scale=None,
                             backend="auto"):
    """Gradients (dq, dk, dv) of attention from its output gradient do.

    o and lse are what flash_attention(q, k, v, return_lse=True) returned. dq, dk, dv
    have the shapes and dtypes of q, k, v; under GQA dk and dv sum over the query heads
    of each group. Rows whose lse is -inf (fully masked) contribute nothing.
    """
    causal = _checks.check_flag("causal", causal)
    arrays = {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    be = _resolve_backend(backend, arrays)
    do, q, k, v, o, lse = _bring(be, arrays)
    dtype = _checks.check_same_dtype(q=q, k=k, v=v)
    batch, hq, hkv, nq, nk, d = _checks.check_attention_shapes(q, k, v)
    _checks.check_like("do", do, "q", q, dtype)
    _checks.check_like("o", o, "q", q, dtype)
    _checks.check_lse(lse, q)
    scale = _checks.check_scale(scale, d)
    xp = be.xp

    if math.prod(batch) == 0 or hq == 0 or nq == 0 or nk == 0:
        # No (query, key) pair: every gradient is zero (or empty).
        return (xp.zeros(q.shape, dtype=dtype), xp.zeros(k.shape, dtype=dtype),
                xp.zeros(v.shape, dtype=dtype))
    lse = lse.astype(_dtypes.lse_dtype(dtype), copy=False)
    dq, dk, dv = be.backward(_as_4d(do, batch, hq), _as_4d(q, batch, hq),
                             _as_4d(k, batch, hkv), _as_4d(v, batch, hkv),
                             _as_4d(o, batch, hq),
                             lse.reshape((math.prod(batch), hq, nq)),
                             causal=causal, scale=scale)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


def online_softmax(x, axis=-1, *, backend="auto"):
    """softmax(x) along `axis` (None: over all elements), equal to scipy.special.softmax.

    Computed in one pass with a running (max, sum) pair per row, then one normalising
    pass. Accumulates in float32 (float64 for float64); returns x's dtype.
    """
    be = _resolve_backend(backend, {"x": x})
    (x,) = _bring(be, {"x": x})
    dtype = _checks.check_dtype("x", x)
    axis = _checks.check_axis(axis, x.ndim)
    if x.size == 0:
        return be.xp.empty(x.shape, dtype=dtype)
    if axis is None:
        x3 = x.reshape(1, x.size, 1)
    else:
        x3 = x.reshape(math.prod(x.shape[:axis]), x.shape[axis],
                       math.prod(x.shape[axis + 1:]))
    return be.softmax(x3).reshape(x.shape)
