"""Choosing a backend and bringing arrays to it: the one place the public functions
(cuflash.api, cuflash.serving) turn `backend=` and the caller's arrays into a backend
object and arrays of its type.
"""
import numpy as np

from . import _checks, backends

BACKENDS = ("auto",) + backends.NAMES


def on_gpu(x) -> bool:
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


def resolve_backend(backend, arrays):
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if backend == "auto":
        backend = "cuda" if any(on_gpu(x) for x in arrays.values()) else "numpy"
    return backends.get(backend)


def to_cupy(name, x):
    import cupy
    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)  # zero-copy view of the foreign GPU buffer
    if on_gpu(x):
        return cupy.from_dlpack(x)  # zero-copy
    raise TypeError(f"backend='cuda' computes on GPU arrays; {name} is "
                    f"{_checks.describe(x)}. Move it with cupy.asarray({name}), or use "
                    f"backend='numpy' for arrays in host memory")


def to_numpy(name, x, backend_name):
    if on_gpu(x):
        raise TypeError(f"backend={backend_name!r} computes on NumPy arrays in host memory; "
                        f"{name} is {_checks.describe(x)} on the GPU. Use backend='cuda', "
                        f"or copy it to the host with cupy.asnumpy({name})")
    return np.asarray(x)


def bring(backend, arrays):
    """The arrays as the backend's array type, zero-copy where possible; GPU arrays must
    all live on one device (the one the kernels then run on)."""
    if backend.name == "cuda":
        out = [to_cupy(n, x) for n, x in arrays.items()]
        devices = {n: x.device.id for n, x in zip(arrays, out)}
        if len(set(devices.values())) > 1:
            listing = ", ".join(f"{n} on GPU {d}" for n, d in devices.items())
            raise ValueError(f"{', '.join(devices)} must live on one GPU; got {listing}. "
                             f"Move them with cupy.asarray inside `with cupy.cuda.Device(i)`")
        return out
    return [to_numpy(n, x, backend.name) for n, x in arrays.items()]
