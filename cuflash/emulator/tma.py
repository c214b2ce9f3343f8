"""Tensor maps for the emulator's ``cp.async.bulk.tensor`` (the Tensor Memory Accelerator).

On a GPU a kernel's tensor map comes from the driver, ``cuTensorMapEncodeTiled``, and is passed
as a ``const __grid_constant__ CUtensorMap`` parameter. :func:`encode_tiled` takes the same
arguments, in the same order and with the driver's enum values, checks them as the driver
documents, and returns a 128-byte record of the emulator's own encoding to pass in its place:
the launch code differs only in which encoder it calls. The map holds the tensor's address, so
its array must outlive the launches that use the map, as on a GPU.

The emulator runs tile mode without interleaving and the 16-byte-atom swizzles (none, 32, 64,
128 bytes); the other options raise ``ValueError`` naming them. With an element stride s along
a dimension (not the innermost, whose stride the driver ignores) a box loads ceil(box / s)
elements s apart, packed in shared memory as a box of that many (the ISA does not draw this
case: the emulator's reading of the driver's documentation).
"""
from __future__ import annotations

import numpy as np

# CUtensorMapDataType: element size in bytes, and whether it is floating point (NaN fill)
DATA_TYPES = {0: ("UINT8", 1, False), 1: ("UINT16", 2, False), 2: ("UINT32", 4, False), 3: ("INT32", 4, False),
              4: ("UINT64", 8, False), 5: ("INT64", 8, False), 6: ("FLOAT16", 2, True), 7: ("FLOAT32", 4, True),
              8: ("FLOAT64", 8, True), 9: ("BFLOAT16", 2, True), 10: ("FLOAT32_FTZ", 4, True),
              11: ("TFLOAT32", 4, True), 12: ("TFLOAT32_FTZ", 4, True)}
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}     # CUtensorMapSwizzle NONE, 32B, 64B, 128B
OOB_FILL_NAN = 1                                 # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
MAGIC = 0x50414D54                               # "TMAP": a map this module encoded

# the record the runtime decodes (runtime/sm90.cpp, EmuTensorMap): 128 bytes
LAYOUT = np.dtype([("magic", "<u4"), ("elem", "u1"), ("rank", "u1"), ("swizzle", "u1"), ("oob_nan", "u1"),
                   ("address", "<u8"), ("stride", "<u8", 4), ("dim_minus_1", "<u4", 5), ("box", "<u2", 5),
                   ("estride", "u1", 5), ("pad", "V45")])
assert LAYOUT.itemsize == 128


def _ints(name, values, n):
    try:
        out = [int(v) for v in values]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of integers, got {type(values).__name__}") from None
    if len(out) != n:
        raise ValueError(f"{name} needs {n} value(s) for rank {n if name != 'global_strides' else n + 1}, "
                         f"got {len(out)}")
    return out


def encode_tiled(data_type: int, rank: int, global_address, global_dim, global_strides, box_dim,
                 element_strides, interleave: int = 0, swizzle: int = 0, l2_promotion: int = 0,
                 oob_fill: int = 0) -> np.void:
    """The emulator's ``cuTensorMapEncodeTiled``: a 128-byte record for a kernel's tensor-map
    parameter. `global_address` is a NumPy array (its data pointer) or an address; `global_dim`
    (elements, innermost first), `global_strides` (bytes, rank - 1 of them: dims 1 ...),
    `box_dim` and `element_strides` follow the driver's documentation."""
    if data_type not in DATA_TYPES:
        raise ValueError(f"data_type must be a CUtensorMapDataType (0..12), got {data_type!r}")
    _, elem, is_float = DATA_TYPES[data_type]
    if not isinstance(rank, (int, np.integer)) or not 1 <= rank <= 5:
        raise ValueError(f"rank must be 1..5, got {rank!r}")
    address = global_address.__array_interface__["data"][0] if isinstance(global_address, np.ndarray) \
        else int(global_address)
    if address % 16:
        raise ValueError(f"global_address must be 16-byte aligned, got {address:#x}")
    dims = _ints("global_dim", global_dim, rank)
    strides = _ints("global_strides", global_strides, rank - 1)
    box = _ints("box_dim", box_dim, rank)
    estrides = _ints("element_strides", element_strides, rank)
    for i, d in enumerate(dims):
        if not 1 <= d <= 2**32:
            raise ValueError(f"global_dim[{i}] must be in 1..2^32, got {d}")
    for i, s in enumerate(strides):
        if s <= 0 or s % 16 or s >= 2**40:
            raise ValueError(f"global_strides[{i}] must be a positive multiple of 16 below 2^40 (bytes), got {s}")
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ValueError(f"box_dim[{i}] must be in 1..256, got {b}")
    if box[0] * elem % 16:
        raise ValueError(f"box_dim[0] * element size must be a multiple of 16 bytes, got {box[0]} * {elem}")
    for i, s in enumerate(estrides):
        if not 1 <= s <= 8:
            raise ValueError(f"element_strides[{i}] must be in 1..8, got {s}")
    if interleave != 0:
        raise ValueError(f"interleave must be CU_TENSOR_MAP_INTERLEAVE_NONE (0) in the CPU emulator, got {interleave}")
    if swizzle not in SWIZZLE_BYTES:
        raise ValueError(f"swizzle must be CU_TENSOR_MAP_SWIZZLE_NONE, 32B, 64B or 128B (0..3) in the CPU emulator, "
                         f"got {swizzle!r}")
    span = SWIZZLE_BYTES[swizzle]
    if span and box[0] * elem > span:
        raise ValueError(f"with a {span}-byte swizzle the inner box must be at most {span} bytes, got "
                         f"{box[0] * elem}")
    if l2_promotion not in (0, 1, 2, 3):
        raise ValueError(f"l2_promotion must be a CUtensorMapL2promotion (0..3), got {l2_promotion!r}")
    if oob_fill not in (0, OOB_FILL_NAN) or (oob_fill and not is_float):
        raise ValueError(f"oob_fill must be NONE (0), or NAN_REQUEST_ZERO_FMA (1) for a floating-point type, got "
                         f"{oob_fill!r}")
    rec = np.zeros((), LAYOUT)
    rec["magic"], rec["elem"], rec["rank"], rec["swizzle"], rec["oob_nan"] = MAGIC, elem, rank, span, oob_fill
    rec["address"] = address
    rec["dim_minus_1"][:rank] = [d - 1 for d in dims]
    rec["stride"][:rank - 1] = strides
    rec["box"][:rank] = box
    rec["estride"][:rank] = [1] + estrides[1:]   # the innermost dimension's is ignored
    return np.frombuffer(rec.tobytes(), "V128")[0]


def extent(record: bytes) -> tuple | None:
    """(address, bytes) of the tensor a record of encode_tiled spans; None for other records."""
    if len(record) != LAYOUT.itemsize:
        return None
    r = np.frombuffer(record, LAYOUT)[0]
    if int(r["magic"]) != MAGIC:
        return None
    rank = int(r["rank"])
    last = sum(int(r["dim_minus_1"][i]) * int(r["stride"][i - 1]) for i in range(1, rank))
    return int(r["address"]), last + (int(r["dim_minus_1"][0]) + 1) * int(r["elem"])
