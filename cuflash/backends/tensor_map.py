"""Tensor maps (CUtensorMap) for TMA copies on the GPU: the driver's cuTensorMapEncodeTiled,
called through ctypes (CuPy does not wrap it).

`driver_encode_tiled` takes the arguments of `cuflash.emulator.tma.encode_tiled` (those of the
driver function, in its order, with its enum values) and returns the same kind of value: a
128-byte NumPy record to pass as the kernel's `const __grid_constant__` map parameter. The
backends give their kernels one or the other (`KernelBackend.encode_tensor_map`).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np


@functools.cache
def _encode_fn():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"tensor maps need the CUDA driver (libcuda.so.1): {e}") from None
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int]
    return fn


def driver_encode_tiled(data_type: int, rank: int, global_address, global_dim, global_strides, box_dim,
                        element_strides, interleave: int = 0, swizzle: int = 0, l2_promotion: int = 0,
                        oob_fill: int = 0) -> np.void:
    """cuTensorMapEncodeTiled: `global_address` a CuPy array (its device pointer) or an address;
    ValueError naming the driver's CUresult when it refuses the arguments."""
    ptr = global_address.data.ptr if hasattr(global_address, "data") and hasattr(global_address.data, "ptr") \
        else int(global_address)
    rank = int(rank)
    buf = (ctypes.c_uint8 * (128 + 64))()   # the map must be 64-byte aligned
    at = -ctypes.addressof(buf) % 64
    rc = _encode_fn()(ctypes.addressof(buf) + at, int(data_type), rank, ptr,
                      (ctypes.c_uint64 * rank)(*map(int, global_dim)),
                      (ctypes.c_uint64 * max(1, rank - 1))(*map(int, global_strides)),
                      (ctypes.c_uint32 * rank)(*map(int, box_dim)),
                      (ctypes.c_uint32 * rank)(*map(int, element_strides)),
                      int(interleave), int(swizzle), int(l2_promotion), int(oob_fill))
    if rc != 0:
        raise ValueError(f"cuTensorMapEncodeTiled refused the tensor map (CUresult {rc}): data_type={data_type}, "
                         f"rank={rank}, global_dim={list(global_dim)}, global_strides={list(global_strides)}, "
                         f"box_dim={list(box_dim)}, element_strides={list(element_strides)}, swizzle={swizzle}")
    return np.frombuffer(bytes(buf[at:at + 128]), "V128")[0]
