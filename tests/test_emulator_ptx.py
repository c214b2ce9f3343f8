"""Inline PTX in cuflash.emulator: mma.sync, ldmatrix, cp.async, cvt and ex2 against models
written here from the PTX ISA's tables, the tensor-core arithmetic against real GPU captures,
and planted bugs that must be caught. Kernels: tests/emulator_kernels/ptx.cu.
"""
from __future__ import annotations

import dataclasses
import io
import tarfile
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cuflash.emulator import (BoundsError, DeadlockError, EmulatorCompileError, RaceError, RawModule, archs)

KDIR = Path(__file__).resolve().parent / "emulator_kernels"
PTX_CU = KDIR / "ptx.cu"
CAPTURES = Path(__file__).resolve().parent / "data" / "tensor-core" / "captures.tar.xz"
LANE = np.arange(32)
G, T = LANE >> 2, LANE % 4


def line_of(marker: str) -> int:
    return next(i for i, line in enumerate(PTX_CU.read_text().splitlines(), 1) if marker in line)


@lru_cache(maxsize=None)
def ptx_module(arch="sm_80", checked=False, options=()):
    names = []
    if archs.get_arch(arch).cuda_arch >= 800:
        names += [f"ldmatrix_kernel<{n}, {t}>" for n in (1, 2, 4) for t in ("false", "true")]
        names += [f"cp_async_sizes<{n}>" for n in (4, 8, 16)]
    return RawModule(path=PTX_CU, arch=arch, checked=checked, options=options, name_expressions=names)


# ---------------------------------------------------------------------------------------------
# The PTX ISA's fragment tables ("Matrix Fragments for mma.m16n8k16 / m16n8k8"), per element
# index i: (row, col) of A, (k, n) of B, (row, col) of C and D, for every lane at once.
def a_f16(i):      # a0..a7
    return G + 8 * (i in (2, 3, 6, 7)), 2 * T + (i & 1) + 8 * (i >= 4)


def b_f16(i):      # b0..b3
    return 2 * T + (i & 1) + 8 * (i >= 2), G


def a_tf32(i):     # a0 (g,t) a1 (g+8,t) a2 (g,t+4) a3 (g+8,t+4)
    return G + 8 * (i in (1, 3)), T + 4 * (i >= 2)


def b_tf32(i):     # b0 (t,g) b1 (t+4,g)
    return T + 4 * i, G


def c_f32(i):      # c0..c3
    return G + 8 * (i >= 2), 2 * T + (i & 1)


FORMS = {   # kernel: (k, element type, A elements, B elements, a/b tables)
    "mma_m16n8k16_f16_kernel": (16, "f16", 8, 4, a_f16, b_f16),
    "mma_m16n8k16_bf16_kernel": (16, "bf16", 8, 4, a_f16, b_f16),
    "mma_m16n8k8_f16_kernel": (8, "f16", 4, 2, a_f16, b_f16),
    "mma_m16n8k8_tf32_kernel": (8, "tf32", 4, 2, a_tf32, b_tf32),
}


def element_bits(x: np.ndarray, etype: str) -> np.ndarray:
    """Bit patterns of float values in an mma operand type (uint32; 16 significant bits for f16/bf16)."""
    if etype == "f16":
        return x.astype(np.float16).view(np.uint16).astype(np.uint32)
    if etype == "bf16":
        return x.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    return x.astype(np.float32).view(np.uint32)


def pack_fragments(kernel: str, A: np.ndarray, B: np.ndarray, C: np.ndarray):
    """Lane registers (a [P,32,4], b [P,32,2], c [P,32,4]) of problems A [P,16,k], B [P,k,8], C [P,16,8]."""
    k, etype, na, nb, amap, bmap = FORMS[kernel]
    P = A.shape[0]
    Ab, Bb = element_bits(A, etype), element_bits(B, etype)
    a = np.zeros((P, 32, 4), np.uint32)
    b = np.zeros((P, 32, 2), np.uint32)
    c = np.zeros((P, 32, 4), np.float32)
    for regs, bits, n, table in ((a, Ab, na, amap), (b, Bb, nb, bmap)):
        for i in range(n):
            r, col = table(i)
            if etype == "tf32":        # one element per 32-bit register
                regs[:, :, i] = bits[:, r, col]
            else:                      # two per register, the lower index in the low half
                regs[:, :, i >> 1] |= bits[:, r, col] << np.uint32(16 * (i & 1))
    for i in range(4):
        r, col = c_f32(i)
        c[:, :, i] = C[:, r, col]
    return a, b, c


def unpack_d(d: np.ndarray) -> np.ndarray:
    D = np.zeros((d.shape[0], 16, 8), np.float32)
    for i in range(4):
        r, col = c_f32(i)
        D[:, r, col] = d[:, :, i]
    return D


def run_mma(kernel: str, arch: str, A, B, C, checked=False) -> np.ndarray:
    a, b, c = pack_fragments(kernel, A, B, C)
    d = np.full(c.shape, np.nan, np.float32)
    P = A.shape[0]
    ptx_module(arch, checked).get_function(kernel)((min(P, 64),), (32,), (a, b, c, d, np.int32(P)))
    return unpack_d(d)


# ---------------------------------------------------------------------------------------------
# layouts: small integers make every summation order exact, so D = A·B + C exactly
@pytest.mark.parametrize("kernel", list(FORMS))
def test_mma_fragment_layouts(kernel):
    k = FORMS[kernel][0]
    rng = np.random.default_rng(hash(kernel) % 2**32)
    P = 6
    A = rng.integers(-8, 9, (P, 16, k)).astype(np.float32)
    B = rng.integers(-8, 9, (P, k, 8)).astype(np.float32)
    C = rng.integers(-64, 65, (P, 16, 8)).astype(np.float32)
    D = run_mma(kernel, "sm_80", A, B, C)
    np.testing.assert_array_equal(D, A.astype(np.float64) @ B + C)


def test_mma_in_checked_mode_and_every_lane_written():
    A = np.ones((1, 16, 16), np.float32)
    D = run_mma("mma_m16n8k16_f16_kernel", "sm_80", A, np.ones((1, 16, 8), np.float32),
                np.arange(128, dtype=np.float32).reshape(1, 16, 8), checked=True)
    np.testing.assert_array_equal(D[0], 16 + np.arange(128).reshape(16, 8))


# ---------------------------------------------------------------------------------------------
# tensor-core arithmetic: every capture of a real GPU, bit for bit
DATASETS = {   # (gpu, format): (emulated arch, kernel)
    ("V100", "fp16"): ("sm_75", "mma_m16n8k8_f16_kernel"),
    ("A100", "fp16"): ("sm_80", "mma_m16n8k16_f16_kernel"),
    ("A100", "bf16"): ("sm_80", "mma_m16n8k16_bf16_kernel"),
    ("A100", "tf32"): ("sm_80", "mma_m16n8k8_tf32_kernel"),
    ("H100", "fp16"): ("sm_90", "mma_m16n8k16_f16_kernel"),
    ("H100", "bf16"): ("sm_90", "mma_m16n8k16_bf16_kernel"),
    ("H100", "tf32"): ("sm_90", "mma_m16n8k8_tf32_kernel"),
}


@lru_cache(maxsize=1)
def _captures() -> dict:
    with tarfile.open(CAPTURES, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def load_capture(gpu: str, fmt: str):
    """a, b: [S, K] float32; c, d: [S] uint32 bit patterns."""
    files = _captures()
    text = {n: files[f"{gpu}/{fmt}/{n}.txt"] for n in "abcd"}
    ab = [np.loadtxt(io.StringIO(text[n]), dtype=str, ndmin=2) for n in "ab"]
    a, b = [np.vectorize(lambda s: int(s, 16), otypes=[np.uint32])(x).view(np.float32) for x in ab]
    c, d = [np.array([int(s, 2) for s in text[n].split()], np.uint32) for n in "cd"]
    return a, b, c, d


@pytest.mark.parametrize("gpu,fmt", list(DATASETS))
def test_mma_reproduces_gpu_captures(gpu, fmt):
    arch, kernel = DATASETS[(gpu, fmt)]
    k = FORMS[kernel][0]
    a, b, c, d = load_capture(gpu, fmt)
    S, K = a.shape
    assert K <= k and S == 5000
    # sample s in problem s // 8: a in row r = s % 8 of A, b in column r of B, c at C[r, r];
    # the other k positions hold zeros, which do not change a block's sum
    P = -(-S // 8)
    s = np.arange(S)
    p, r = s // 8, s % 8
    A = np.zeros((P, 16, k), np.float32)
    B = np.zeros((P, k, 8), np.float32)
    C = np.zeros((P, 16, 8), np.float32)
    A[p, r, :K] = a
    B[p, :K, r] = b
    C[p, r, r] = c.view(np.float32)
    got = run_mma(kernel, arch, A, B, C)[p, r, r].view(np.uint32)
    bad = np.flatnonzero(got != d)
    assert bad.size == 0, (f"{bad.size} of {S} differ; first: sample {bad[0]}: got {got[bad[0]]:#010x}, "
                           f"GPU {d[bad[0]]:#010x}")
    # the captures tell the arithmetic apart: a plain rounded float sum misses many of them
    plain = (np.einsum("sk,sk->s", a.astype(np.float64), b.astype(np.float64))
             + c.view(np.float32)).astype(np.float32).view(np.uint32)
    assert np.mean(plain == d) < 0.8


# ---------------------------------------------------------------------------------------------
# the block model on what no capture holds (zeros, infinities, NaN, subnormals, overflow, the
# exponent floor), against an exact rational model written from its description
def _decode(bits: int, etype: str):
    """(value as Fraction or 'nan'/'inf'/'-inf', alignment exponent or None for 0)."""
    e_bits, f_bits = {"f16": (5, 10), "bf16": (8, 7), "tf32": (8, 10), "f32": (8, 23)}[etype]
    if etype == "tf32":
        bits >>= 13
    sign = -1 if bits >> (e_bits + f_bits) & 1 else 1
    field, frac = bits >> f_bits & ((1 << e_bits) - 1), bits & ((1 << f_bits) - 1)
    bias = (1 << (e_bits - 1)) - 1
    if field == (1 << e_bits) - 1:
        return ("nan" if frac else ("inf" if sign > 0 else "-inf")), None
    e = max(field, 1) - bias
    m = frac + (1 << f_bits if field else 0)
    return sign * Fraction(m) * Fraction(2) ** (e - f_bits), e


def _rz_f32(x: Fraction) -> int:
    """Bits of x truncated toward zero to float32 (an overflow stops at the largest finite)."""
    sign = 0x80000000 if x < 0 else 0
    x = abs(x)
    if x == 0:
        return sign
    if x >= Fraction(2) ** 128:
        return sign | 0x7F7FFFFF
    e = max(x.numerator.bit_length() - x.denominator.bit_length() - 1, -126)
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    e = max(e, -126)
    m = int(x / Fraction(2) ** (e - 23))        # truncates
    return sign | (m if m < (1 << 23) else ((e + 127) << 23) | (m - (1 << 23)))


def model_block(a_bits, b_bits, c_bits, etype, block_k, extra, emin) -> int:
    acc = c_bits
    for k0 in range(0, len(a_bits), block_k):
        c, ec = _decode(acc, "f32")
        terms, specials, zero_signs = [], [], []
        for x, y in zip(a_bits[k0:k0 + block_k], b_bits[k0:k0 + block_k]):
            (vx, ex), (vy, ey) = _decode(x, etype), _decode(y, etype)
            if isinstance(vx, str) or isinstance(vy, str):
                if "nan" in (vx, vy) or 0 in (vx, vy):
                    specials.append("nan")        # NaN, or inf · 0
                else:
                    neg = (vx == "-inf" or (not isinstance(vx, str) and vx < 0)) != \
                          (vy == "-inf" or (not isinstance(vy, str) and vy < 0))
                    specials.append("-inf" if neg else "inf")
            elif vx * vy == 0:
                zero_signs.append((x >> (15 if etype != "tf32" else 31) & 1) ^ (y >> (15 if etype != "tf32" else 31) & 1))
            else:
                terms.append((vx * vy, ex + ey))   # exact product, aligned by the exponent sum
        if isinstance(c, str):
            specials.append(c)
        elif c == 0:
            zero_signs.append(acc >> 31)
        else:
            terms.append((c, ec))
        if "nan" in specials or {"inf", "-inf"} <= set(specials):
            acc = 0x7FFFFFFF
        elif specials:
            acc = 0x7F800000 if specials[0] == "inf" else 0xFF800000
        elif not terms:
            acc = 0x80000000 if all(zero_signs) else 0
        else:
            emax = max([emin] + [e for _, e in terms])
            ulp = Fraction(2) ** (emax - 23 - extra)
            total = sum((1 if v > 0 else -1) * int(abs(v) / ulp) * ulp for v, _ in terms)
            acc = _rz_f32(total)
    return acc


def _special_values(rng, etype: str, n: int, share: float = 0.15) -> np.ndarray:
    """Element bit patterns mixing ordinary values with ±0, ±inf, NaN, subnormals and extremes."""
    dtype = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "tf32": np.float32}[etype]
    base = rng.standard_normal(n) * np.exp2(rng.integers(-6, 7, n))
    if etype == "tf32":
        bits = (base.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).astype(np.uint32)
        pool = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00002000, 0x80400000,
                         0x7F7FE000, 0xFF7FE000, 0x00800000], np.uint32)
    else:
        bits = base.astype(dtype).view(np.uint16).astype(np.uint32)
        pool = (np.array([0, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x0001, 0x83FF, 0x7BFF, 0xFBFF, 0x0400], np.uint32)
                if etype == "f16" else
                np.array([0, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x0080], np.uint32))
    pick = rng.random(n) < share
    bits[pick] = rng.choice(pool, pick.sum())
    return bits


def _to_float(bits: np.ndarray, etype: str) -> np.ndarray:
    if etype == "tf32":
        return bits.astype(np.uint32).view(np.float32)
    dtype = np.float16 if etype == "f16" else ml_dtypes.bfloat16
    return bits.astype(np.uint16).view(dtype).astype(np.float32)


MODEL_CASES = [("sm_75", "mma_m16n8k8_f16_kernel")] + [(a, k) for a in ("sm_80", "sm_90") for k in FORMS]


def _compare_with_model(arch, kernel, share) -> int:
    """Runs random problems (a `share` of the elements special) against model_block; returns
    how many outputs a single block over all k would get wrong."""
    k, etype = FORMS[kernel][:2]
    tc = archs.get_arch(arch).mma
    block_k = tc.block_k_tf32 if etype == "tf32" else tc.block_k_f16
    rng = np.random.default_rng(k * 7 + len(arch) + len(etype) + int(share * 100))
    P = 2
    Ab = _special_values(rng, etype, P * 16 * k, share).reshape(P, 16, k)
    Bb = _special_values(rng, etype, P * k * 8, share).reshape(P, k, 8)
    Cb = _special_values(rng, "tf32", P * 16 * 8, share).reshape(P, 16, 8)
    if share:
        Cb[:, :4, :] = rng.choice(np.array([0x00000001, 0x80000005, 0x7F7FFFFF, 0x1F000000], np.uint32), (P, 4, 8))
    D = run_mma(kernel, arch, _to_float(Ab, etype), _to_float(Bb, etype), Cb.view(np.float32)).view(np.uint32)
    one_block_differs = 0
    for p in range(P):
        for r in range(16):
            for col in range(8):
                args = [int(x) for x in Ab[p, r]], [int(x) for x in Bb[p, :, col]], int(Cb[p, r, col]), etype
                want = model_block(*args, block_k, tc.extra_bits, tc.min_exponent)
                assert int(D[p, r, col]) == want, (p, r, col, hex(int(D[p, r, col])), hex(want))
                one_block_differs += want != model_block(*args, k, tc.extra_bits, tc.min_exponent)
    return one_block_differs


@pytest.mark.parametrize("arch,kernel", MODEL_CASES)
def test_mma_special_values_follow_the_block_model(arch, kernel):
    _compare_with_model(arch, kernel, share=0.15)


@pytest.mark.parametrize("arch,kernel", MODEL_CASES)
def test_mma_chains_blocks_along_k(arch, kernel):
    """k beyond one block: each block's fp32 result is the next block's c."""
    k, etype = FORMS[kernel][:2]
    tc = archs.get_arch(arch).mma
    chained = k > (tc.block_k_tf32 if etype == "tf32" else tc.block_k_f16)
    differs = _compare_with_model(arch, kernel, share=0.0)
    assert (differs > 0) == chained


def test_mma_signed_zeros():
    """A sum of zeros only is -0 when every zero is -0; a cancellation is +0."""
    A = np.zeros((1, 16, 16), np.float32)
    B = np.zeros((1, 16, 8), np.float32)
    C = np.zeros((1, 16, 8), np.float32)
    A[0, 0:2] = -0.0                      # rows 0, 1: (-0)·(+0) products
    C[0, 0, 0] = -0.0                     # row 0 adds c = -0, row 1 c = +0
    A[0, 2, 0], B[0, 0, 2], C[0, 2, 2] = 1.0, -1.0, 1.0     # 1 - 1
    A[0, 3], B[0, 0, 3], C[0, 3, 3] = -0.0, 5.0, -0.0      # (-0)·5 + (-0)·(+0) ... + (-0)
    A[0, 4], B[0, 0, 4], C[0, 4, 4] = -0.0, -5.0, -0.0      # (-0)·(-5) = +0
    D = run_mma("mma_m16n8k16_f16_kernel", "sm_80", A, B, C).view(np.uint32)
    assert [hex(D[0, r, r]) for r in range(5)] == ["0x80000000", "0x0", "0x0", "0x80000000", "0x0"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_mma_exponent_floor(arch):
    """With c = 0 and only tiny products, the alignment exponent is floored (-132 on sm_80,
    -133 on sm_90): a product far below 2^-140 is cut off where an unfloored sum keeps it."""
    tc = archs.get_arch(arch).mma
    P, k = 1, 16
    A = np.zeros((P, 16, k), np.float32)
    B = np.zeros((P, k, 8), np.float32)
    C = np.zeros((P, 16, 8), np.float32)
    for r, small in enumerate(range(150, 166)):        # row r: 2^-140 - 2^-small
        A[0, r, :2] = [2.0 ** -70, 2.0 ** -(small // 2)]
        B[0, :2, r % 8] = [2.0 ** -70, -(2.0 ** -(small - small // 2))]
    D = run_mma("mma_m16n8k16_bf16_kernel", arch, A, B, C).view(np.uint32)
    unfloored = 0
    for r in range(16):
        a = [int(x) for x in element_bits(A[0, r], "bf16")]
        b = [int(x) for x in element_bits(B[0, :, r % 8], "bf16")]
        want = model_block(a, b, 0, "bf16", tc.block_k_f16, tc.extra_bits, tc.min_exponent)
        assert D[0, r, r % 8] == want, (r, hex(D[0, r, r % 8]), hex(want))
        unfloored += want != model_block(a, b, 0, "bf16", tc.block_k_f16, tc.extra_bits, -1000)
    assert unfloored > 0     # the inputs reach below the floor


# ---------------------------------------------------------------------------------------------
# ldmatrix: lane l addresses row rowidx[l]; matrix j's rows come from lanes 8j..8j+7
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("checked", [False, True])
def test_ldmatrix(num, trans, checked):
    rng = np.random.default_rng(num * 2 + trans)
    rows = rng.integers(0, 2**16, (64, 8)).astype(np.uint16)
    rowidx = rng.permutation(64)[:32].astype(np.int32)
    d = np.zeros((32, num), np.uint32)
    name = f"ldmatrix_kernel<{num}, {'true' if trans else 'false'}>"
    ptx_module(checked=checked).get_function(name)((1,), (32,), (rows, rowidx, d))
    for j in range(num):
        M = rows[rowidx[8 * j:8 * j + 8]].astype(np.uint32)        # matrix j, 8 x 8
        if trans:   # (row 2(l%4), col l>>2) low, (row 2(l%4)+1, col l>>2) high
            lo, hi = M[2 * T, G], M[2 * T + 1, G]
        else:       # row l>>2, cols 2(l%4) low and 2(l%4)+1 high
            lo, hi = M[G, 2 * T], M[G, 2 * T + 1]
        np.testing.assert_array_equal(d[:, j], lo | hi << np.uint32(16), err_msg=f"register {j}")


# ---------------------------------------------------------------------------------------------
# cp.async: every cp-size and src-size, zero fill, landing at the wait
@pytest.mark.parametrize("cp_size", [4, 8, 16])
@pytest.mark.parametrize("checked", [False, True])
def test_cp_async_sizes_and_zero_fill(cp_size, checked):
    n = 64
    rng = np.random.default_rng(cp_size)
    src = rng.integers(1, 256, n * cp_size).astype(np.uint8)
    src_size = (np.arange(n) % (cp_size + 1)).astype(np.int32)     # every src-size 0..cp-size
    out = np.zeros(n * cp_size, np.uint8)
    f = ptx_module(checked=checked).get_function(f"cp_async_sizes<{cp_size}>")
    f((1,), (n,), (src, src_size, out), shared_mem=n * cp_size)
    want = src.reshape(n, cp_size).copy()
    want[np.arange(cp_size)[None, :] >= src_size[:, None]] = 0
    np.testing.assert_array_equal(out.reshape(n, cp_size), np.roll(want, -1, axis=0))
    if checked:  # the traffic of each argument: a cp.async reads src-size bytes
        assert f.last_traffic == {0: (int(src_size.sum()), 0), 1: (4 * n, 0),
                                  2: (0, n * cp_size)}


@pytest.mark.parametrize("checked", [False, True])
def test_cp_async_bad_addresses_are_bounds_errors(checked):
    f = ptx_module(checked=checked).get_function("cp_async_sizes<16>")
    src, sizes, out = np.zeros(32 * 16 + 32, np.uint8), np.full(32, 16, np.int32), np.zeros(512, np.uint8)
    with pytest.raises(BoundsError, match="destination's 16 bytes .* not inside"):
        f((1,), (32,), (src, sizes, out), shared_mem=256)                 # threads 16..31 copy past it
    skew = (4 - src.ctypes.data) % 16                                      # an address 4 past 16-byte alignment
    with pytest.raises(BoundsError, match="source \\(global\\) address .* not aligned to cp-size 16"):
        f((1,), (32,), (src[skew:], sizes, out), shared_mem=512)
    if checked:
        with pytest.raises(BoundsError, match="out-of-bounds global read"):
            f((1,), (32,), (src[:256], sizes, out), shared_mem=512)       # source past the array


def test_cvta_of_a_global_pointer_is_a_bounds_error():
    code = 'extern "C" __global__ void k(float* y) { y[0] = (float)__cvta_generic_to_shared(y); }'
    with pytest.raises(BoundsError, match="__cvta_generic_to_shared at .*:1: .* is not a shared-memory address"):
        RawModule(code=code).get_function("k")((1,), (1,), (np.zeros(1, np.float32),))


def test_cp_async_groups_land_in_commit_order_at_the_wait():
    src = np.random.default_rng(5).integers(0, 255, 3 * 32 * 16).astype(np.uint8)
    seen = np.zeros((32, 3, 3, 16), np.uint8)     # [thread][after wait 2/1/all][group][byte]
    ptx_module().get_function("cp_async_groups")((1,), (32,), (src, seen))
    data = src.reshape(3, 32, 16).transpose(1, 0, 2)
    pending = np.full(16, 0xFF, np.uint8)         # NaN bytes until the copy lands
    for step in range(3):
        for g in range(3):
            want = data[:, g] if g <= step else np.broadcast_to(pending, (32, 16))
            np.testing.assert_array_equal(seen[:, step, g], want, err_msg=f"after wait {2 - step}, group {g}")


# ---------------------------------------------------------------------------------------------
# cvt and ex2
def _tf32_rna(x: np.ndarray) -> np.ndarray:
    """Round to 10 fraction bits, ties away from zero, computed on float64 values."""
    out = np.empty(x.shape, np.uint32)
    for i, v in enumerate(x.astype(np.float64)):
        if np.isnan(v):
            out[i] = 0x7FFFFFFF
            continue
        if np.isinf(v) or v == 0:
            out[i] = np.float32(v).view(np.uint32)
            continue
        e = max(int(np.floor(np.log2(abs(v)))), -126)
        q = 2.0 ** (e - 10)
        r = np.sign(v) * np.floor(abs(v) / q + 0.5) * q
        out[i] = np.float32(r).view(np.uint32) if abs(r) < 2.0 ** 128 else np.float32(np.sign(v) * np.inf).view(np.uint32)
    return out


def test_cvt_and_ex2():
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(400) * np.exp2(rng.integers(-30, 30, 400))).astype(np.float32)
    x[:12] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 65520.0, 1 + 2.0 ** -11, 3.4e38, -130.5, 0.5]
    x[12] = np.float32(1 + 2.0 ** -11 + 2.0 ** -23)        # just above a tie
    x[13] = np.uint32(0x3F801000).view(np.float32)         # a tie for tf32: away from zero
    x[14] = np.uint32(0xBF803000).view(np.float32)
    y = rng.standard_normal(400).astype(np.float32)
    y[:3] = [np.nan, 1 + 2.0 ** -11, 2.0 ** -25]
    out = np.zeros((400, 4), np.uint32)
    ptx_module().get_function("convert")((4,), (128,), (x, y, out, np.int32(400)))
    with np.errstate(over="ignore"):
        _check_conversions(x, y, out)


def _check_conversions(x, y, out):

    def canon(h, bits):
        return np.where(np.isnan(h.astype(np.float32)), 0x7FFF, bits)
    hx, hy = x.astype(np.float16), y.astype(np.float16)
    f16 = canon(hx, hx.view(np.uint16)).astype(np.uint32) << 16 | canon(hy, hy.view(np.uint16)).astype(np.uint32)
    bx, by = x.astype(ml_dtypes.bfloat16), y.astype(ml_dtypes.bfloat16)
    bf16 = canon(bx, bx.view(np.uint16)).astype(np.uint32) << 16 | canon(by, by.view(np.uint16)).astype(np.uint32)
    np.testing.assert_array_equal(out[:, 0], f16, err_msg="cvt.rn.f16x2.f32 (a high, b low)")
    np.testing.assert_array_equal(out[:, 1], bf16, err_msg="cvt.rn.bf16x2.f32")
    np.testing.assert_array_equal(out[:, 2], _tf32_rna(x), err_msg="cvt.rna.tf32.f32")
    # ex2.approx.ftz.f32: within 2 ulp of 2^x; subnormal inputs act as zero, subnormal results are +0
    xf = np.where(np.abs(x) < np.float32(2.0 ** -126), np.float32(0), x)
    want = np.exp2(xf.astype(np.float64)).astype(np.float32)
    want = np.where(want < np.float32(2.0 ** -126), np.float32(0), want)
    got = out[:, 3].view(np.float32)
    same_nan = np.isnan(want) & np.isnan(got)
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert np.all(same_nan | (ulps <= 2)), x[~same_nan & (ulps > 2)]


# ---------------------------------------------------------------------------------------------
# the emulated architecture
@pytest.mark.parametrize("arch,value", [("sm_75", 750), ("sm_80", 800), ("sm_90", 900)])
def test_cuda_arch_follows_the_emulated_arch(arch, value, monkeypatch):
    out = np.zeros(1, np.int32)
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", arch)
    RawModule(code="extern \"C\" __global__ void k(int* o) { o[0] = __CUDA_ARCH__; }").get_function("k")(
        (1,), (1,), (out,))
    assert out[0] == value


def test_arch_table():
    assert set(archs.ARCHS) == {"sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100",
                                "sm_120"}
    lim = archs.gpu_limits("sm_90")
    assert lim.shared_per_block_optin == 232448 and lim.sm_count == 132
    assert archs.gpu_limits("80").shared_per_block_optin == 166912
    with pytest.raises(ValueError, match="sm_80"):
        RawModule(code="", arch="sm_60")
    with pytest.raises(dataclasses.FrozenInstanceError, match="sm_count"):
        lim.sm_count = 1     # the limits are a frozen dataclass


# ---------------------------------------------------------------------------------------------
# planted bugs
def test_missing_cp_async_wait_is_a_race():
    with pytest.raises(RaceError) as ei:
        ptx_module(checked=True, options=("-DSKIP_WAIT",)).get_function("cp_async_sizes<16>")(
            (1,), (32,), (np.zeros(512, np.uint8), np.full(32, 16, np.int32), np.zeros(512, np.uint8)),
            shared_mem=512)
    msg = str(ei.value)
    assert f"ptx.cu:{line_of('cp.async.ca.shared.global [%0]')}" in msg and "still pending" in msg, msg


def test_divergent_mma_is_an_error():
    for kernel, args in (("divergent_mma", (np.zeros(32, np.float32),)),
                         ("divergent_call_sites", (np.ones(2, np.float32), np.zeros(32, np.float32)))):
        with pytest.raises(DeadlockError) as ei:
            ptx_module().get_function(kernel)((1,), (32,), args)
        msg = str(ei.value)
        assert "mma.sync" in msg and "divergent" in msg, msg
        assert f"ptx.cu:{line_of('mma.sync.aligned.m16n8k16.row.col.f32.f16')}" in msg, msg
    assert f"ptx.cu:{line_of('mma.sync.aligned.m16n8k16.row.col.f32.bf16')}" in str(
        pytest.raises(DeadlockError, ptx_module(checked=True).get_function("divergent_mma"), (1,), (32,),
                      (np.zeros(32, np.float32),)).value)


def test_misaligned_ldmatrix_row_is_a_bounds_error():
    m = ptx_module(options=("-DROW_SKEW=8",))
    with pytest.raises(BoundsError) as ei:
        m.get_function("ldmatrix_kernel<4, false>")(
            (1,), (32,), (np.zeros((64, 8), np.uint16), np.arange(32, dtype=np.int32), np.zeros(128, np.uint32)))
    msg = str(ei.value)
    assert "not 16-byte aligned" in msg and f"ptx.cu:{line_of('m8n8.x4.shared.b16')}" in msg, msg


def test_instruction_the_arch_lacks_is_a_compile_error():
    with pytest.raises(EmulatorCompileError) as ei:
        RawModule(path=PTX_CU, arch="sm_75", options=("-DALL_ARCHS",)).get_function("mma_m16n8k16_f16_kernel")
    msg = str(ei.value)
    assert f"ptx.cu:{line_of('mma.sync.aligned.m16n8k16.row.col.f32.f16')}" in msg and "needs sm_80" in msg, msg


def test_unsupported_instruction_is_a_compile_error_naming_it():
    code = ('extern "C" __global__ void k(float* y) {\n    float v = y[0];\n'
            '    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0}, {%0}, {%0}, {%0};"\n'
            '                 : "+f"(v));\n    y[0] = v;\n}\n')
    with pytest.raises(EmulatorCompileError) as ei:
        RawModule(code=code).get_function("k")
    msg = str(ei.value)
    assert "`mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32`" in msg and ":3:" in msg and "not supported" in msg


def test_asm_syntax_and_line_numbers_survive():
    """Named operands, tied inputs, immediates, %% and a statement over several lines; a
    g++ error after it still names its own line."""
    code = r'''extern "C" __global__ void k(float* y, unsigned* u) {
    float v = y[threadIdx.x];
    unsigned d;
    asm volatile(
        "cvt.rna.tf32.f32 %[out], %[in];  // %% is a literal percent\n"
        : [out] "=r"(d)
        : [in] "f"(v));
    float w;
    asm("ex2.approx.f32 %0, %1;" : "=f"(w) : "0"(v));
    u[threadIdx.x] = d;
    y[threadIdx.x] = w + ERR;
}
'''
    y = np.array([1.0, 3.0, -2.0, 0.5], np.float32)
    u = np.zeros(4, np.uint32)
    RawModule(code=code, options=("-DERR=0",)).get_function("k")((1,), (4,), (y, u))
    np.testing.assert_array_equal(u, np.array([1.0, 3.0, -2.0, 0.5], np.float32).view(np.uint32))
    np.testing.assert_allclose(y, np.exp2(np.float32([1.0, 3.0, -2.0, 0.5])), rtol=1e-7)   # ex2 of the tied input
    with pytest.raises(EmulatorCompileError, match=r":11:\d+: error"):
        RawModule(code=code, options=("-DERR=undefined_name",)).get_function("k")
