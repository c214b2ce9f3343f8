"""Independent NumPy reference model of Hopper ``wgmma`` operand layouts.

Written only from the PTX ISA text (PTX ISA 8.x/9.x, chapter 9.7.15
"Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"), not
from any emulator code.  It is meant as an oracle for tests of the emulator:

* the 64-bit shared-memory matrix descriptor
  (ISA 9.7.15.5.1.2.2 "Matrix Descriptor Format"),
* where element (mn, k) of operand A (M x K, mn = m) or B (N x K, mn = n) lives
  in shared memory for K-major / MN-major and the four swizzle modes
  (ISA 9.7.15.5.1.2 "Shared Memory Matrix Layout", 9.7.15.5.1.2.1
  "Major-ness supported by Strides", 9.7.15.5.1.2.1.3 "Canonical Layouts"),
* the register fragments of the f32 accumulator D and of A in registers
  (ISA 9.7.15.5.1.1 "Register Fragments").

Conventions
-----------
* All addresses/offsets are byte addresses in the shared-memory (``.shared::cta``)
  window; ``smem`` images are ``np.uint8`` arrays indexed by that address.
* An operand matrix is always passed as a 2-D array of shape (MN, K):
  A is (M, K) indexed [m, k]; B is passed as (N, K) indexed [n, k]
  (i.e. B transposed), matching the ISA's "mn" view of both operands.
* ``major="K"``  <=> imm-trans = 0 (ISA: "If the argument imm-trans-a /
  imm-trans-b ... is 0, then K-major is used").  ``major="MN"`` <=> imm-trans = 1.
  wgmma only offers imm-trans for .f16/.bf16 with A/B from descriptors, so tf32
  operands are always K-major for wgmma (the MN-major tf32 layout is still
  computed here because the ISA defines it for the shared layout tables).

Points the ISA text does not pin down (marked UNCONFIRMED below):
* how the hardware uses a non-zero "matrix base offset" (this model subtracts it
  from the 128-byte line index before swizzling; base_offset=0 is the
  well-trodden path);
* the exact per-thread fragment layout figures (Figures 148-151) are images;
  the formulas below are the per-warp mma.m16n8k16 / mma.m16n8k8 textual
  formulas (ISA 9.7.14.5.7/9.7.14.5.8) stacked so that warp w of the
  warpgroup owns rows 16*w .. 16*w+15, cross-checked against CUTLASS
  ``CLayout_64xN`` / ``ALayout_64x16`` / ``ALayout_64x8``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "SWIZZLE_CODES",
    "SWIZZLE_BYTES",
    "descriptor",
    "decode",
    "smem_offset",
    "smem_offsets",
    "canonical_strides",
    "store_operand",
    "load_operand",
    "accumulator_index",
    "a_register_index",
]

# ISA 9.7.15.5.1.2.2, bits 63-62: 0 none, 1 128B, 2 64B, 3 32B.
SWIZZLE_CODES = {"none": 0, "128B": 1, "64B": 2, "32B": 3}
_CODE_TO_SWIZZLE = {v: k for k, v in SWIZZLE_CODES.items()}
# Swizzle width in bytes (0 = no swizzle).  Width/16 = number of 16-byte
# chunks per swizzle row = 2**B in CuTe's Swizzle<B,4,3>.
SWIZZLE_BYTES = {"none": 0, "32B": 32, "64B": 64, "128B": 128}
_SWIZZLE_B = {"none": 0, "32B": 1, "64B": 2, "128B": 3}


def _encode(x: int) -> int:
    """``matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4`` (ISA 9.7.15.5.1.2.2)."""
    return (int(x) & 0x3FFFF) >> 4


def descriptor(start_address: int, lbo: int, sbo: int, swizzle: str,
               base_offset: int = 0) -> int:
    """Build a 64-bit wgmma shared-memory matrix descriptor.

    ISA 9.7.15.5.1.2.2 "Matrix Descriptor Format":

    ======  ====  ==========================================================
    bits    size  field
    ======  ====  ==========================================================
    13-0    14    matrix-descriptor-encode(matrix start address)
    29-16   14    matrix-descriptor-encode(leading dimension byte offset)
    45-32   14    matrix-descriptor-encode(stride dimension byte offset)
    51-49   3     matrix base offset (not used for no-swizzle)
    63-62   2     swizzle mode: 0 none, 1 128B, 2 64B, 3 32B
    ======  ====  ==========================================================

    ``start_address``, ``lbo`` and ``sbo`` are in bytes; they must be multiples
    of 16 (ISA 9.7.15.5.1.1: "starting addresses must be aligned to 16 bytes";
    the encode drops the 4 LSBs).  Bits 14-15, 30-31, 46-48, 52-61 are 0.
    """
    if swizzle not in SWIZZLE_CODES:
        raise ValueError(f"swizzle must be one of {sorted(SWIZZLE_CODES)}")
    for name, v in (("start_address", start_address), ("lbo", lbo), ("sbo", sbo)):
        if int(v) < 0 or int(v) % 16:
            raise ValueError(f"{name}={v} must be a non-negative multiple of 16")
        if int(v) > 0x3FFFF:
            raise ValueError(f"{name}={v} does not fit the 18-bit encoded range")
    if not 0 <= int(base_offset) <= 7:
        raise ValueError("base_offset is a 3-bit field")
    return (_encode(start_address)
            | (_encode(lbo) << 16)
            | (_encode(sbo) << 32)
            | ((int(base_offset) & 0x7) << 49)
            | (SWIZZLE_CODES[swizzle] << 62))


def decode(desc: int) -> dict:
    """Decode a 64-bit descriptor (ISA 9.7.15.5.1.2.2) into byte quantities.

    Returns ``{"start_address", "lbo", "sbo"}`` in bytes (field << 4),
    ``"base_offset"`` (3-bit), ``"swizzle"`` (str) and the raw 14-bit fields
    ``"start_field", "lbo_field", "sbo_field"``.
    """
    d = int(desc) & 0xFFFFFFFFFFFFFFFF
    start_f = d & 0x3FFF
    lbo_f = (d >> 16) & 0x3FFF
    sbo_f = (d >> 32) & 0x3FFF
    return {
        "start_address": start_f << 4,
        "lbo": lbo_f << 4,
        "sbo": sbo_f << 4,
        "base_offset": (d >> 49) & 0x7,
        "swizzle": _CODE_TO_SWIZZLE[(d >> 62) & 0x3],
        "start_field": start_f,
        "lbo_field": lbo_f,
        "sbo_field": sbo_f,
    }


def _fields(desc) -> dict:
    return decode(desc) if isinstance(desc, (int, np.integer)) else desc


def _swizzle_address(addr, swizzle: str, base_offset: int):
    """Apply CuTe ``Swizzle<B,4,3>`` to absolute byte addresses.

    ISA 9.7.15.5.1.2.1.3 lists ``Swizzle<0|1|2|3, 4, 3>`` for none/32B/64B/128B;
    ISA 5.5.7 "Swizzling Modes" shows the same pattern on 16-byte cells of
    128-byte shared-memory lines (repeat every 256/512/1024 bytes): address
    bits [4, 4+B) are XORed with bits [7, 7+B).  The ISA says base offset is 0
    when the repeating pattern starts on a 256/512/1024-byte boundary, else
    ``(pattern start addr >> 7) & 7`` -- i.e. the pattern phase is the 128-byte
    line index of the *absolute* address.  UNCONFIRMED: how a non-zero base
    offset is applied; this model uses ``line = (addr >> 7) - base_offset``.
    """
    b = _SWIZZLE_B[swizzle]
    if b == 0:
        return addr
    mask = (1 << b) - 1
    line = ((addr >> 7) - int(base_offset)) & mask
    return addr ^ (line << 4)


def smem_offsets(desc_fields, major: str, elem_bytes: int, mn, k):
    """Vectorised :func:`smem_offset` (``mn``/``k`` may be NumPy arrays)."""
    f = _fields(desc_fields)
    if major not in ("K", "MN"):
        raise ValueError("major must be 'K' or 'MN'")
    if elem_bytes not in (1, 2, 4):
        raise ValueError("elem_bytes must be 1, 2 or 4")
    sw = f["swizzle"]
    t = 16 // elem_bytes              # T = 128 / sizeof_bits(element)
    w = max(SWIZZLE_BYTES[sw] // 16, 1)   # 16-byte chunks per swizzle row
    lbo, sbo = int(f["lbo"]), int(f["sbo"])
    mn = np.asarray(mn, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    if major == "K":
        # ((8,m),(T,2k)) rows along MN, 16-byte chunks along K.
        r, mgrp = mn % 8, mn // 8
        kc, ke = k // t, k % t
        if sw == "none":
            # ((8,m),(T,2k)):((1T,SBO),(1,LBO)): core matrix = 8 rows x 16 B.
            off = r * 16 + mgrp * sbo + kc * lbo + ke * elem_bytes
        else:
            # ((8,m),(T,2k)):((W*T,SBO),(1,T)): rows of W*16 bytes, LBO unused.
            off = r * (16 * w) + mgrp * sbo + kc * 16 + ke * elem_bytes
    else:
        # ((T,W,m),(8,k)) along MN, 8 K-rows of W*16 bytes.
        ki, kgrp = k % 8, k // 8
        if sw == "none":
            # ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)).
            me, mgrp = mn % t, mn // t
            off = me * elem_bytes + mgrp * sbo + ki * 16 + kgrp * lbo
        else:
            # ((T,W,m),(8,k)):((1,T,LBO),(W*T,SBO)).
            me, mc, mgrp = mn % t, (mn // t) % w, mn // (t * w)
            off = (me * elem_bytes + mc * 16 + mgrp * lbo
                   + ki * (16 * w) + kgrp * sbo)
    addr = int(f["start_address"]) + off
    return _swizzle_address(addr, sw, int(f.get("base_offset", 0)))


def smem_offset(desc_fields, major: str, elem_bytes: int, mn: int, k: int) -> int:
    """Shared-memory byte address of operand element (mn, k).

    ISA 9.7.15.5.1.2.1.3 "Canonical Layouts" (CuTe notation, units of
    elements, T = 16 / elem_bytes, W = swizzle_bytes / 16; swizzle applied
    after adding the start address)::

        MN-major none   : Swizzle<0,4,3> o ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))
        MN-major 32B    : Swizzle<1,4,3> o ((T,2,m),(8,k)):((1,T,LBO),(2T,SBO))
        MN-major 64B    : Swizzle<2,4,3> o ((T,4,m),(8,k)):((1,T,LBO),(4T,SBO))
        MN-major 128B   : Swizzle<3,4,3> o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))
        K-major  none   : Swizzle<0,4,3> o ((8,m),(T,2k)):((1T,SBO),(1,LBO))
        K-major  32B    : Swizzle<1,4,3> o ((8,m),(T,2k)):((2T,SBO),(1,T))
        K-major  64B    : Swizzle<2,4,3> o ((8,m),(T,2k)):((4T,SBO),(1,T))
        K-major  128B   : Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T))

    The first mode is the MN coordinate, the second the K coordinate.  LBO and
    SBO are byte strides (descriptor fields << 4).  K-major swizzled layouts do
    not use LBO ("not used, assumed to be 1"); their K extent is one swizzle row
    (W chunks) -- one wgmma reads 32 bytes of K, which always fits.  Larger K in
    a swizzled K-major layout aliases the next row (store_operand rejects it).

    ``desc_fields`` is a decoded dict (see :func:`decode`) or a raw descriptor.
    """
    return int(smem_offsets(desc_fields, major, elem_bytes, mn, k))


def canonical_strides(major: str, swizzle: str, elem_bytes: int,
                      mn_size: int, k_size: int) -> tuple[int, int]:
    """A dense (LBO, SBO) choice in bytes for an (mn_size x k_size) operand.

    Not ISA-mandated; any values satisfying the canonical layouts work.  The
    choice tiles the swizzle atoms (ISA Table 38, 128-bit elements: K-major
    8 x W, MN-major W x 8) MN-first, like CuTe ``tile_to_shape``.  For K-major
    swizzled layouts LBO is unused; 16 (encoded 1, "assumed to be 1") is
    returned.
    """
    t = 16 // elem_bytes
    swb = SWIZZLE_BYTES[swizzle]
    if major == "K":
        if swizzle == "none":
            n_kchunks = -(-k_size // t)
            return 128, 128 * n_kchunks          # LBO: next K core matrix
        return 16, 8 * swb                         # SBO: next 8-row atom
    if swizzle == "none":
        n_mgroups = -(-mn_size // t)
        return 128 * n_mgroups, 128                # LBO: next 8 K, SBO: next T MN
    w = swb // 16
    n_matoms = -(-mn_size // (t * w))
    return 8 * swb, 8 * swb * n_matoms             # LBO: next MN atom, SBO: next 8 K


def _dtype_bytes(dtype) -> int:
    n = np.dtype(dtype).itemsize
    if n not in (2, 4):
        raise ValueError("only 2- and 4-byte element types are modelled")
    return n


def store_operand(smem: np.ndarray, matrix: np.ndarray, desc, major: str) -> None:
    """Write an (MN x K) operand into a uint8 shared-memory image.

    Uses :func:`smem_offsets` for every element; raises ``ValueError`` if two
    elements map to the same bytes (a shape/stride combination that is not a
    valid canonical layout) or if an element falls outside ``smem``.
    """
    if smem.dtype != np.uint8 or smem.ndim != 1:
        raise TypeError("smem must be a 1-D uint8 array")
    matrix = np.ascontiguousarray(matrix)
    if matrix.ndim != 2:
        raise ValueError("matrix must be 2-D (MN, K)")
    eb = _dtype_bytes(matrix.dtype)
    mn_size, k_size = matrix.shape
    mn, k = np.meshgrid(np.arange(mn_size), np.arange(k_size), indexing="ij")
    addr = smem_offsets(desc, major, eb, mn, k)
    if addr.min() < 0 or addr.max() + eb > smem.size:
        raise ValueError("operand does not fit in the shared-memory image")
    if np.unique(addr).size != addr.size:
        raise ValueError("layout aliases: two elements share an address")
    if np.any(addr % eb):
        raise ValueError("misaligned element address")
    idx = addr[..., None] + np.arange(eb)
    smem[idx.reshape(-1)] = matrix.view(np.uint8).reshape(-1)


def load_operand(smem: np.ndarray, desc, major: str, mn_size: int, k_size: int,
                 dtype) -> np.ndarray:
    """Inverse of :func:`store_operand`: read an (mn_size x k_size) operand."""
    eb = _dtype_bytes(dtype)
    mn, k = np.meshgrid(np.arange(mn_size), np.arange(k_size), indexing="ij")
    addr = smem_offsets(desc, major, eb, mn, k)
    idx = addr[..., None] + np.arange(eb)
    raw = np.ascontiguousarray(smem[idx.reshape(-1)])
    return raw.view(np.dtype(dtype)).reshape(mn_size, k_size)


def accumulator_index(n: int) -> np.ndarray:
    """(row, col) in the 64 x n tile of every f32 accumulator register.

    ISA 9.7.15.5.1.1.1/2 (Figures 149/151): D is N/2 ``.f32`` registers
    d0..d(N/2-1) per thread, N = 8*i, i = 1..32.  Per warp w (threads
    32w..32w+31) the layout is the mma.m16n8 C/D layout (ISA 9.7.14.5.8)
    repeated N/8 times along N, rows offset by 16*w::

        g = laneid >> 2, q = laneid % 4
        row(d_i) = 16*w + g + 8*((i >> 1) & 1)
        col(d_i) = 8*(i >> 2) + 2*q + (i & 1)

    Returns int array of shape (128, n//2, 2).
    """
    if n % 8 or not 8 <= n <= 256:
        raise ValueError("n must be a multiple of 8 in [8, 256]")
    t = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    w, lane = t // 32, t % 32
    g, q = lane >> 2, lane & 3
    row = 16 * w + g + 8 * ((i >> 1) & 1)
    col = 8 * (i >> 2) + 2 * q + (i & 1)
    return np.stack(np.broadcast_arrays(row, col), axis=-1)


def a_register_index(dtype_kind: str) -> np.ndarray:
    """(row, k) of every A element a thread holds for A-in-registers.

    * ``"f16"``/``"bf16"`` (m64nNk16, ISA 9.7.15.5.1.1.1, Figure 148): four
      ``.f16x2`` registers = elements a0..a7 (a_{2r} low half, a_{2r+1} high
      half of register r)::

          row(a_j) = 16*w + g + 8*((j >> 1) & 1)
          k(a_j)   = 2*q + (j & 1) + 8*(j >> 2)

    * ``"tf32"`` (m64nNk8, ISA 9.7.15.5.1.1.2, Figure 150): four ``.b32``
      registers a0..a3::

          row(a_j) = 16*w + g + 8*(j & 1)
          k(a_j)   = q + 4*(j >> 1)

    with w = warp in warpgroup, g = laneid >> 2, q = laneid % 4 (the
    mma.m16n8k16 / mma.m16n8k8 A formulas, ISA 9.7.14.5.8 / 9.7.14.5.7).
    Returns int array of shape (128, 8, 2) or (128, 4, 2).
    """
    t = np.arange(128)[:, None]
    w, lane = t // 32, t % 32
    g, q = lane >> 2, lane & 3
    if dtype_kind in ("f16", "bf16"):
        j = np.arange(8)[None, :]
        row = 16 * w + g + 8 * ((j >> 1) & 1)
        kk = 2 * q + (j & 1) + 8 * (j >> 2)
    elif dtype_kind == "tf32":
        j = np.arange(4)[None, :]
        row = 16 * w + g + 8 * (j & 1)
        kk = q + 4 * (j >> 1)
    else:
        raise ValueError("dtype_kind must be 'f16', 'bf16' or 'tf32'")
    return np.stack(np.broadcast_arrays(row, kk), axis=-1)


# --------------------------------------------------------------------------
# self-check
# --------------------------------------------------------------------------

def _self_check() -> None:
    rng = np.random.default_rng(0)

    # Descriptor round trip, including the ISA example encodings
    # (9.7.15.5.1.2.1.3: LBO 64*4 B -> 16, SBO 32*4 B -> 8).
    d = descriptor(0x1230, 64 * 4, 32 * 4, "none")
    f = decode(d)
    assert (f["start_field"], f["lbo_field"], f["sbo_field"]) == (0x123, 16, 8), f
    for sw in SWIZZLE_CODES:
        for bo in range(8):
            d = descriptor(0x400 + 0x80, 0x10, 0x400, sw, bo)
            f = decode(d)
            assert (f["start_address"], f["lbo"], f["sbo"], f["swizzle"],
                    f["base_offset"]) == (0x480, 0x10, 0x400, sw, bo)
            assert d >> 62 == SWIZZLE_CODES[sw]
    assert descriptor(0, 0, 0, "128B") == 1 << 62

    # ISA exact-layout examples (offsets in elements, no start address).
    # K-major none tf32: ((8,2),(4,4)):((4,32),(1,64)), LBO=256 B, SBO=128 B.
    f = decode(descriptor(0, 256, 128, "none"))
    for m in range(16):
        for kk in range(16):
            exp = (m % 8) * 4 + (m // 8) * 32 + (kk % 4) + (kk // 4) * 64
            assert smem_offset(f, "K", 4, m, kk) == exp * 4
    # MN-major 64B bf16: Swizzle<2,4,3> o ((8,4,2),(8,2)):((1,8,256),(32,512)).
    f = decode(descriptor(0, 512, 1024, "64B"))
    for m in range(64):
        for kk in range(16):
            e = ((m % 8) + ((m // 8) % 4) * 8 + (m // 32) * 256
                 + (kk % 8) * 32 + (kk // 8) * 512)
            b = e * 2
            b ^= ((b >> 7) & 3) << 4
            assert smem_offset(f, "MN", 2, m, kk) == b

    # MN-major none bf16: ((8,1,2),(8,2)):((1,8,64),(8,128)), LBO=256 B, SBO=128 B.
    f = decode(descriptor(0, 256, 128, "none"))
    for m in range(16):
        for kk in range(16):
            e = (m % 8) + (m // 8) * 64 + (kk % 8) * 8 + (kk // 8) * 128
            assert smem_offset(f, "MN", 2, m, kk) == 2 * e
    # MN-major 32B bf16: Swizzle<1,4,3> o ((8,2,2),(8,2)):((1,8,128),(16,256)).
    f = decode(descriptor(0, 256, 512, "32B"))
    for m in range(32):
        for kk in range(16):
            b = 2 * ((m % 8) + ((m // 8) % 2) * 8 + (m // 16) * 128
                     + (kk % 8) * 16 + (kk // 8) * 256)
            assert smem_offset(f, "MN", 2, m, kk) == b ^ (((b >> 7) & 1) << 4)
    # K-major 32B tf32: Swizzle<1,4,3> o ((8,2),(4,4)):((8,64),(1,4)), SBO=256 B
    # (first 2 K chunks = the 32 bytes one m64nNk8 instruction reads).
    f = decode(descriptor(0, 16, 256, "32B"))
    for m in range(16):
        for kk in range(8):
            b = 4 * ((m % 8) * 8 + (m // 8) * 64 + kk)
            assert smem_offset(f, "K", 4, m, kk) == b ^ (((b >> 7) & 1) << 4)

    # Round trips for every swizzle, major-ness, element size, a few shapes.
    smem = np.zeros(1 << 17, dtype=np.uint8)
    for dtype in (np.float16, np.float32):
        eb = np.dtype(dtype).itemsize
        t = 16 // eb
        for sw in ("none", "32B", "64B", "128B"):
            swb = SWIZZLE_BYTES[sw]
            for major in ("K", "MN"):
                if major == "K":
                    k_sizes = [32 // eb] + ([swb // eb] if swb else [64 // eb])
                    mn_sizes = [64, 128, 256]
                else:
                    k_sizes = [8, 16, 32]
                    unit = t * max(swb // 16, 1)
                    mn_sizes = sorted({max(unit, 8), 64, 128, 256})
                for mn_size in mn_sizes:
                    for k_size in sorted(set(k_sizes)):
                        lbo, sbo = canonical_strides(major, sw, eb, mn_size, k_size)
                        for start in (0, 1024, 3072):
                            desc = descriptor(start, lbo, sbo, sw)
                            mat = rng.standard_normal((mn_size, k_size)).astype(dtype)
                            smem[:] = 0
                            store_operand(smem, mat, desc, major)
                            back = load_operand(smem, desc, major, mn_size, k_size, dtype)
                            assert np.array_equal(back.view(np.uint8), mat.view(np.uint8)), \
                                (dtype, sw, major, mn_size, k_size, start)
                            # Dense packing: exactly mn*k*eb bytes touched.
                            addr = smem_offsets(desc, major, eb,
                                                *np.meshgrid(np.arange(mn_size),
                                                             np.arange(k_size),
                                                             indexing="ij"))
                            assert addr.min() == start
                            dense = (k_size * eb == swb) if (major == "K" and swb) else \
                                (k_size % 8 == 0 and mn_size % (t * max(swb // 16, 1)) == 0
                                 if major == "MN" else True)
                            if dense:
                                assert addr.max() + eb - start == mn_size * k_size * eb, \
                                    (dtype, sw, major, mn_size, k_size)

    # K-major swizzled: K wider than one swizzle row aliases -> rejected.
    for sw, swb in (("32B", 32), ("64B", 64), ("128B", 128)):
        desc = descriptor(0, 16, 8 * swb, sw)
        try:
            store_operand(smem, np.zeros((64, 2 * swb // 2), np.float16), desc, "K")
        except ValueError:
            pass
        else:
            raise AssertionError("aliasing K-major layout not rejected")

    # Swizzle acts on absolute addresses: advancing the start address by
    # 32 B inside a 1024-B aligned 128B-swizzle atom (how CUTLASS steps K)
    # addresses the same bytes as indexing k + 16 (f16) from the atom base.
    base = decode(descriptor(2048, 16, 1024, "128B"))
    step = decode(descriptor(2048 + 32, 16, 1024, "128B"))
    for m in range(64):
        for kk in range(16):
            assert smem_offset(step, "K", 2, m, kk) == smem_offset(base, "K", 2, m, kk + 16)

    # 128B swizzle == ISA 5.5.7 table: line r, cell c holds chunk c ^ r.
    f = decode(descriptor(0, 16, 1024, "128B"))
    for r in range(8):
        for c in range(8):
            assert smem_offset(f, "K", 2, r, 8 * c) == r * 128 + 16 * (c ^ r)

    # Accumulators: each (row, col) of 64 x n covered exactly once.
    for n in range(8, 257, 8):
        idx = accumulator_index(n)
        assert idx.shape == (128, n // 2, 2)
        cover = np.zeros((64, n), dtype=np.int64)
        np.add.at(cover, (idx[..., 0].ravel(), idx[..., 1].ravel()), 1)
        assert np.all(cover == 1), n
    # Thread 0 holds (0,0),(0,1),(8,0),(8,1),(0,8),... ; thread 4 -> row 1.
    assert accumulator_index(16)[0].tolist() == [[0, 0], [0, 1], [8, 0], [8, 1],
                                                 [0, 8], [0, 9], [8, 8], [8, 9]]
    assert accumulator_index(8)[37].tolist() == [[17, 2], [17, 3], [25, 2], [25, 3]]

    # A fragments cover 64 x 16 (f16) / 64 x 8 (tf32) exactly once.
    for kind, kdim, nel in (("f16", 16, 8), ("bf16", 16, 8), ("tf32", 8, 4)):
        idx = a_register_index(kind)
        assert idx.shape == (128, nel, 2)
        cover = np.zeros((64, kdim), dtype=np.int64)
        np.add.at(cover, (idx[..., 0].ravel(), idx[..., 1].ravel()), 1)
        assert np.all(cover == 1), kind
    assert a_register_index("f16")[1].tolist() == [[0, 2], [0, 3], [8, 2], [8, 3],
                                                  [0, 10], [0, 11], [8, 10], [8, 11]]
    assert a_register_index("tf32")[33].tolist() == [[16, 1], [24, 1], [16, 5], [24, 5]]

    print("wgmma_model self-check: OK")


if __name__ == "__main__":
    _self_check()
