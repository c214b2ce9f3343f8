"""Hopper's PTX in cuflash.emulator (sm_90a): wgmma against the NumPy model of the PTX ISA's
layouts in tests/wgmma_model.py (written from the ISA, not from the emulator) and against the
block model on special values; mbarriers, bulk and tensor copies (TMA boxes against NumPy
slicing), named barriers, setmaxnreg, elect and stmatrix (kernels: tests/emulator_kernels/sm90.cu);
every asynchronous hazard planted and caught; cuflash/kernels/sm90_gemm.cu end to end; the
capture tool; and the arch rules ptxas applies.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import wgmma_model as model
from cuflash.emulator import (AsyncHazardError, DeadlockError, EmulatorCompileError, EmulatorError, RaceError,
                              RawModule, archs)

SWIZZLES = ("none", "32B", "64B", "128B")
DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "tf32": np.float32}
IMAGE = 64 * 1024          # the shared-memory image: A at 0, B at 32 KiB


def wgmma_source(n: int, kind: str, a_regs: bool, guard: str = "") -> str:
    """A kernel that copies a shared-memory image in, runs one wgmma.mma_async (variant: which
    transposes) and writes every thread's accumulators out."""
    k = 8 if kind == "tf32" else 16
    d = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    i = n // 2
    if a_regs:
        a, ins = f"{{%{i}, %{i + 1}, %{i + 2}, %{i + 3}}}", 'a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]'
        b, p, sa = f"%{i + 4}", f"%{i + 5}", f"%{i + 6}"
        ins = f'"r"({ins}), "l"(db), "r"(scale_d), "n"(SCALE_A)'
    else:
        a, b, p, sa = f"%{i}", f"%{i + 1}", f"%{i + 2}", f"%{i + 3}"
        ins = '"l"(da), "l"(db), "r"(scale_d), "n"(SCALE_A)'
    trans = ([(0, 0)] if kind == "tf32" else [(0, 0), (0, 1)] if a_regs else [(0, 0), (0, 1), (1, 0), (1, 1)])
    cases = []
    for v, (ta, tb) in enumerate(trans):
        imms = "" if kind == "tf32" else f", {tb}" if a_regs else f", {ta}, {tb}"
        cases.append(
            f'case {v}: asm volatile("{{ .reg .pred p; setp.ne.b32 p, {p}, 0; '
            f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{kind}.{kind} {{{d}}}, {a}, {b}, p, {sa}, 1{imms}; }}\""
            f" : {outs} : {ins}); break;")
    body = "\n        ".join(cases)
    return f"""
#ifndef SCALE_A
#define SCALE_A 1
#endif
extern "C" __global__ void wgmma_kernel(const unsigned char* image, int image_bytes, const unsigned long long* desc,
                                        const unsigned* a_frag, const float* c_in, float* d_out, int scale_d,
                                        int variant) {{
    extern __shared__ __align__(1024) unsigned char smem[];
    for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) smem[i] = image[i];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#ifndef NO_BARRIER
    __syncthreads();
#endif
    const unsigned long long base = (__cvta_generic_to_shared(smem) >> 4) & 0x3fff;
    const unsigned long long da = desc[0] + base, db = desc[1] + base;
    unsigned a[4];
    for (int i = 0; i < 4; ++i) a[i] = a_frag[threadIdx.x * 4 + i];
    float d[{n // 2}];
    for (int i = 0; i < {n // 2}; ++i) d[i] = c_in[threadIdx.x * {n // 2} + i];
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    switch (variant) {{
        {body}
    }}
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    {guard}
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int i = 0; i < {n // 2}; ++i) d_out[threadIdx.x * {n // 2} + i] = d[i];
}}
"""


@lru_cache(maxsize=None)
def wgmma_module(n, kind, a_regs, checked=False, options=(), guard=""):
    return RawModule(code=wgmma_source(n, kind, a_regs, guard), arch="sm_90a", checked=checked, options=options)


def integers(rng, shape, dtype):
    return rng.integers(-4, 5, shape).astype(dtype)   # exact in every arithmetic


def run_wgmma(n, kind, *, a_major="K", b_major="K", swizzle_a="128B", swizzle_b="128B", a_regs=False,
              scale_d=1, checked=False, seed=0, neg_a=False, data=None, module=None):
    """(the emulator's D, A @ B + C by NumPy) for one wgmma laid out by the model; `data`:
    (A, B as N x K, C) to use instead of random integers; `module`, a wgmma_module built
    another way."""
    rng = np.random.default_rng(seed)
    dt, k = DTYPES[kind], 8 if kind == "tf32" else 16
    eb = np.dtype(dt).itemsize
    A, B = integers(rng, (64, k), dt), integers(rng, (n, k), dt)   # B as (N, K): the model's view
    if data is not None:
        A, B = data[0], data[1]
    image = np.zeros(IMAGE, np.uint8)
    lbo, sbo = model.canonical_strides(a_major, swizzle_a, eb, 64, k)
    desc_a = model.descriptor(0, lbo, sbo, swizzle_a)
    model.store_operand(image, A, desc_a, a_major)
    lbo, sbo = model.canonical_strides(b_major, swizzle_b, eb, n, k)
    desc_b = model.descriptor(IMAGE // 2, lbo, sbo, swizzle_b)
    model.store_operand(image, B, desc_b, b_major)
    a_frag = np.zeros((128, 4), np.uint32)
    if a_regs:
        idx = model.a_register_index(kind)
        elems = A[idx[..., 0], idx[..., 1]]
        a_frag = (elems.view(np.uint32) if kind == "tf32"
                  else elems.view(np.uint16).astype(np.uint32).reshape(128, 4, 2) @ np.array([1, 1 << 16], np.uint32))
    acc = model.accumulator_index(n)
    C = rng.integers(-50, 50, (64, n)).astype(np.float32) if data is None else data[2]
    c_in = C[acc[..., 0], acc[..., 1]].astype(np.float32)
    d_out = np.full_like(c_in, np.nan)
    variant = ({("K", "K"): 0, ("K", "MN"): 1, ("MN", "K"): 2, ("MN", "MN"): 3}[a_major, b_major]
               if not a_regs else int(b_major == "MN"))
    mod = module or wgmma_module(n, kind, a_regs, checked, ("-DSCALE_A=-1",) if neg_a else ())
    f = mod.get_function("wgmma_kernel")
    f.max_dynamic_shared_size_bytes = IMAGE
    f((1,), (128,), (image, np.int32(IMAGE), np.array([desc_a, desc_b], np.uint64), a_frag.reshape(-1),
                     c_in.reshape(-1), d_out.reshape(-1), np.int32(scale_d), np.int32(variant)), shared_mem=IMAGE)
    D = np.full((64, n), np.nan, np.float32)
    D[acc[..., 0], acc[..., 1]] = d_out
    with np.errstate(invalid="ignore"):   # special values (inf - inf) in the block-model test
        ref = (-1 if neg_a else 1) * A.astype(np.float64) @ B.astype(np.float64).T + (C if scale_d else 0)
    return D, ref


# ---------------------------------------------------------------------------------------------
# layouts: every swizzle, K- and MN-major operands, A from shared memory and from registers
@pytest.mark.parametrize("swizzle", SWIZZLES)
@pytest.mark.parametrize("a_major,b_major", [("K", "K"), ("MN", "MN"), ("K", "MN"), ("MN", "K")])
def test_wgmma_f16_layouts(swizzle, a_major, b_major):
    D, ref = run_wgmma(64, "f16", a_major=a_major, b_major=b_major, swizzle_a=swizzle, swizzle_b=swizzle)
    np.testing.assert_array_equal(D, ref)


@pytest.mark.parametrize("n", [8, 128, 256])
def test_wgmma_every_width(n):
    D, ref = run_wgmma(n, "f16", swizzle_a="64B", swizzle_b="32B", b_major="MN", seed=n)
    np.testing.assert_array_equal(D, ref)


@pytest.mark.parametrize("swizzle", SWIZZLES)
def test_wgmma_bf16_and_tf32(swizzle):
    D, ref = run_wgmma(64, "bf16", a_major="MN", swizzle_a=swizzle, swizzle_b=swizzle)
    np.testing.assert_array_equal(D, ref)
    D, ref = run_wgmma(64, "tf32", swizzle_a=swizzle, swizzle_b=swizzle, seed=1)
    np.testing.assert_array_equal(D, ref)


@pytest.mark.parametrize("kind", ["f16", "tf32"])
def test_wgmma_a_from_registers(kind):
    for b_major in ("K", "MN") if kind == "f16" else ("K",):
        D, ref = run_wgmma(64, kind, a_regs=True, b_major=b_major, swizzle_b="128B")
        np.testing.assert_array_equal(D, ref)


@pytest.mark.parametrize("finite", [False, True])
@pytest.mark.parametrize("kind", ["f16", "bf16", "tf32"])
def test_wgmma_sums_follow_the_sm90_block_model(kind, finite):
    """Every element of D, on operands with ±0, ±inf, NaN, subnormals and extremes, is the block
    model's sum (test_emulator_ptx.model_block, written from the model's description); `finite`:
    without inf and NaN, the sums the emulator takes a faster path for."""
    from test_emulator_ptx import _special_values, model_block
    rng = np.random.default_rng(11)
    k, n = (8 if kind == "tf32" else 16), 16
    a_bits = _special_values(rng, kind, 64 * k).reshape(64, k)
    b_bits = _special_values(rng, kind, n * k).reshape(n, k)
    c = (rng.standard_normal((64, n)) * np.exp2(rng.integers(-4, 5, (64, n)))).astype(np.float32)
    if finite:   # inf and NaN operands become zeros
        exponent = {"f16": 0x7C00, "bf16": 0x7F80, "tf32": 0x7F800000}[kind]
        for bits in (a_bits, b_bits):
            bits[(bits & exponent) == exponent] = 0
    else:
        c.reshape(-1)[rng.random(64 * n) < 0.05] = np.float32(np.inf)
    view = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}
    A = a_bits.view(np.float32) if kind == "tf32" else a_bits.astype(np.uint16).view(view[kind])
    B = b_bits.view(np.float32) if kind == "tf32" else b_bits.astype(np.uint16).view(view[kind])
    D, _ = run_wgmma(n, kind, swizzle_a="none", swizzle_b="64B", data=(A, B, c))
    tc = archs.get_arch("sm_90a").mma
    block = tc.block_k_tf32 if kind == "tf32" else tc.block_k_f16
    got = D.view(np.uint32)
    for i in range(64):
        for j in range(n):
            want = model_block([int(x) for x in a_bits[i]], [int(x) for x in b_bits[j]], int(c.view(np.uint32)[i, j]),
                               kind, block, tc.extra_bits, tc.min_exponent)
            assert int(got[i, j]) == want, (i, j, hex(int(got[i, j])), hex(want))


def test_wgmma_scale_d_and_negated_a():
    D, ref = run_wgmma(64, "f16", scale_d=0)          # D = A·B: the accumulators' values are not read
    np.testing.assert_array_equal(D, ref)
    D, ref = run_wgmma(64, "bf16", neg_a=True, swizzle_a="none", swizzle_b="none")
    np.testing.assert_array_equal(D, ref)


def test_wgmma_in_checked_mode():
    D, ref = run_wgmma(64, "f16", a_regs=True, checked=True, b_major="MN")
    np.testing.assert_array_equal(D, ref)
    D, ref = run_wgmma(128, "bf16", checked=True, a_major="MN", swizzle_a="32B")
    np.testing.assert_array_equal(D, ref)


# ---------------------------------------------------------------------------------------------
# the architecture: wgmma is sm_90a's alone, as ptxas decides
def test_wgmma_needs_sm90a():
    for arch in ("sm_90", "sm_80", "sm_100"):
        with pytest.raises(EmulatorCompileError, match="needs sm_90a"):
            RawModule(code=wgmma_source(8, "f16", False), arch=arch).get_function("wgmma_kernel")


def test_sm90a_defines_the_feature_macro():
    out = np.zeros(2, np.int32)
    code = ('extern "C" __global__ void k(int* o) { o[0] = __CUDA_ARCH__;\n'
            '#ifdef __CUDA_ARCH_FEAT_SM90_ALL\n o[1] = 1;\n#endif\n}')
    for arch, want in (("sm_90a", [900, 1]), ("sm_90", [900, 0])):
        out[:] = 0
        RawModule(code=code, arch=arch).get_function("k")((1,), (1,), (out,))
        assert out.tolist() == want, arch
    assert archs.get_arch("sm_90a").limits == archs.get_arch("sm_90").limits


# ---------------------------------------------------------------------------------------------
# asynchronous hazards, planted
def test_wgmma_operands_written_without_a_barrier_are_a_hazard():
    # every thread copies a 128th of the operands and fences, and the wgmma reads them all: the
    # four warps that issue it must meet the writers on a barrier first
    mod = wgmma_module(64, "f16", False, True, ("-DNO_BARRIER",))
    with pytest.raises(AsyncHazardError, match=r"read by the wgmma.mma_async at .* with no barrier between them"):
        run_wgmma(64, "f16", checked=True, module=mod)


def test_reading_an_accumulator_before_the_wait_is_a_hazard():
    guard = "if (d[0] == 12345.0f) d_out[0] = 1.0f;   // PLANTED: reads an accumulator in flight"
    D, ref = run_wgmma(8, "f16")
    mod = wgmma_module(8, "f16", False, True, (), guard)
    with pytest.raises(AsyncHazardError, match=r"still owns this register \(an accumulator") as ei:
        f = mod.get_function("wgmma_kernel")
        f.max_dynamic_shared_size_bytes = IMAGE
        f((1,), (128,), (np.zeros(IMAGE, np.uint8), np.int32(IMAGE), np.zeros(2, np.uint64), np.zeros(512, np.uint32),
                         np.zeros(512, np.float32), np.zeros(512, np.float32), np.int32(1), np.int32(0)),
          shared_mem=IMAGE)
    assert "PLANTED" not in str(ei.value) and ".cu:" in str(ei.value), str(ei.value)


# ---------------------------------------------------------------------------------------------
# mbarriers, bulk copies, named barriers, setmaxnreg, elect.sync, stmatrix: tests/emulator_kernels/sm90.cu
SM90_CU = Path(__file__).resolve().parent / "emulator_kernels" / "sm90.cu"


def sm90_line(marker: str, path=SM90_CU) -> int:
    return next(i for i, line in enumerate(Path(path).read_text().splitlines(), 1) if marker in line)


def sm90_options(plants):
    from cuflash import compiler
    return compiler.nvrtc_options() + tuple(f"-DPLANT_{p}" for p in plants)


@lru_cache(maxsize=None)
def sm90_module(*plants, checked=False, arch="sm_90a"):
    return RawModule(path=SM90_CU, arch=arch, checked=checked, options=sm90_options(plants))


def run_ring(*plants, checked=False, tiles=5, schedule="round-robin"):
    x = np.arange(tiles * 256, dtype=np.float32)
    out = np.full_like(x, np.nan)
    m = sm90_module(*plants, checked=checked)
    if schedule != "round-robin":
        m = RawModule(path=SM90_CU, arch="sm_90a", checked=checked, schedule=schedule, seed=3,
                      options=sm90_options(plants))
    m.get_function("bulk_ring")((1,), (256,), (x, out, np.int32(tiles)))
    return x, out


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("schedule", ["round-robin", "reversed", "random"])
def test_bulk_copies_through_an_mbarrier_ring(checked, schedule):
    x, out = run_ring(checked=checked, schedule=schedule)
    np.testing.assert_array_equal(out, x + 1)


def test_reading_a_bulk_copy_before_its_phase_is_a_hazard():
    # two tiles, one per stage (the buggy consumers cannot lap the producer); the first one waited for
    x, out = run_ring("NO_WAIT", tiles=2)         # unchecked: the second tile has not landed (NaN)
    np.testing.assert_array_equal(out[:256], x[:256] + 1)
    assert np.isnan(out[256:]).all()
    for plant in ("NO_WAIT", "PARITY"):
        with pytest.raises(AsyncHazardError, match="cp.async.bulk at .*sm90.cu:.* still writes this shared memory"):
            run_ring(plant, checked=True, tiles=2)


def test_mbarrier_misuse_is_caught():
    with pytest.raises(AsyncHazardError, match="more transaction bytes .* than expect_tx announced"):
        run_ring("SHORT_TX")
    with pytest.raises(AsyncHazardError, match="more arrivals than the expected count 128"):
        run_ring("EXTRA_ARRIVE")
    with pytest.raises(DeadlockError) as ei:      # the phase waits for bytes no copy brings
        run_ring("LONG_TX")
    msg = str(ei.value)
    from cuflash import compiler
    header = compiler.KERNEL_DIR / "sm90.cuh"   # the helpers the test kernels use
    assert f"mbarrier.try_wait at {header}:{sm90_line('.reg .pred done', header)}" in msg, msg
    assert f"initialised at {header}:{sm90_line('mbarrier.init.shared', header)}" in msg, msg
    assert "1024 transaction bytes pending" in msg, msg


def test_bulk_store_and_its_hazards():
    out = np.zeros(256, np.float32)
    for checked in (False, True):
        sm90_module(checked=checked).get_function("bulk_store")((1,), (128,), (out,))
        np.testing.assert_array_equal(out, 2.0 * np.arange(256))
    with pytest.raises(AsyncHazardError, match="no fence.proxy.async") as ei:
        sm90_module("NO_FENCE", checked=True).get_function("bulk_store")((1,), (128,), (out,))
    assert f"sm90.cu:{sm90_line('tile[i] = 2.0f * i')}" in str(ei.value), str(ei.value)
    with pytest.raises(AsyncHazardError, match=r"cp.async.bulk \(store\) at .* still reads this shared memory") as ei:
        sm90_module("WRITE_IN_FLIGHT", checked=True).get_function("bulk_store")((1,), (128,), (out,))
    # thread 0 stores what the others wrote, with no barrier after their writes
    with pytest.raises(AsyncHazardError, match=r"read by the cp.async.bulk \(store\) at .* with no barrier "
                                               r"between them") as ei:
        sm90_module("NO_BARRIER", checked=True).get_function("bulk_store")((1,), (128,), (out,))
    assert f"sm90.cu:{sm90_line('tile[i] = 2.0f * i')}" in str(ei.value), str(ei.value)


def test_bulk_reduce_adds_as_atomics():
    """cp.reduce.async.bulk .add.f32 from four blocks into one array: the sum, in checked mode
    under a random schedule no race (the adds are atomic, unlike plain adds of the same
    values); the tile written while the reduction still reads it is a hazard."""
    for checked, schedule in ((False, "round-robin"), (True, "random")):
        out = np.full(256, 0.5, np.float32)
        RawModule(path=SM90_CU, arch="sm_90a", checked=checked, schedule=schedule, seed=5,
                  options=sm90_options(())).get_function("bulk_reduce_add")((4,), (128,), (out, np.int32(1)))
        np.testing.assert_array_equal(out, 0.5 + 4 * np.arange(256) + 6)
    with pytest.raises(RaceError):
        sm90_module("ADD", checked=True).get_function("bulk_reduce_add")((4,), (128,), (out, np.int32(1)))
    with pytest.raises(AsyncHazardError, match=r"cp.reduce.async.bulk at .* still reads this shared memory"):
        sm90_module("WRITE_IN_FLIGHT", checked=True).get_function("bulk_reduce_add")(
            (4,), (128,), (out, np.int32(1)))


def test_bulk_reduce_adds_in_order():
    """A thread's two reduce-adds to the same floats, the second once the first completed
    (cp.async.bulk.wait_group 0): both land, in order; in checked mode a second add after a
    .read wait alone is reported (both in flight: their order, and so the sum's bits, not
    defined); the writes of a store waited for with .read land by the time its thread
    exits."""
    for checked in (False, True):
        out = np.full(256, 0.25, np.float32)
        sm90_module(checked=checked).get_function("bulk_reduce_add")((1,), (32,), (out, np.int32(2)))
        np.testing.assert_array_equal(out, 0.25 + 2 * np.arange(256))
    out = np.full(256, 0.25, np.float32)
    sm90_module("READ_ONLY").get_function("bulk_reduce_add")((1,), (32,), (out, np.int32(2)))
    np.testing.assert_array_equal(out, 0.25 + 2 * np.arange(256))   # landed at the exit
    with pytest.raises(AsyncHazardError, match=r"the cp.reduce.async.bulk at .* writes these global bytes too "
                                               r"and has not completed"):
        sm90_module("READ_ONLY", checked=True).get_function("bulk_reduce_add")((1,), (32,), (out, np.int32(2)))


def test_named_barriers():
    out = np.zeros(128, np.float32)
    for checked in (False, True):
        sm90_module(checked=checked).get_function("named_barrier")((1,), (256,), (out,))
        np.testing.assert_array_equal(out, 3.0 * (127 - np.arange(128)))
    with pytest.raises(AsyncHazardError, match="named barrier 1: thread counts disagree: 256 at .*, 224 at"):
        sm90_module("COUNT").get_function("named_barrier")((1,), (256,), (out,))


def test_setmaxnreg_budget():
    out = np.zeros(384, np.int32)
    sm90_module().get_function("setmaxnreg")((1,), (384,), (out,))
    assert out.all()
    with pytest.raises(DeadlockError, match="waits for 256 registers per thread, which the SM's 65536 cannot give "
                                            "while the block's warpgroups hold 40, 256, 168"):
        sm90_module("BUDGET").get_function("setmaxnreg")((1,), (384,), (out,))
    with pytest.raises(EmulatorCompileError, match="needs sm_90a"):
        sm90_module(arch="sm_90").get_function("setmaxnreg")


@pytest.mark.parametrize("trans", [0, 1])
def test_elect_and_stmatrix(trans):
    rng = np.random.default_rng(trans)
    frag = rng.integers(0, 2**32, (64, 4), dtype=np.uint32)
    leaders, rows = np.zeros(64, np.uint32), np.zeros(512, np.uint16)
    sm90_module(checked=bool(trans)).get_function("elect_and_stmatrix")(
        (1,), (64,), (frag.reshape(-1), leaders, rows, np.int32(trans)))
    assert (leaders.reshape(2, 32) == [99] * 4 + [4] * 28).all()   # the lowest lane of the mask 0xfffffff0
    # the ISA's fragment (the ldmatrix/mma layout): thread t holds row t/4, columns 2(t%4), 2(t%4)+1
    # of matrix j in register j, the lower column in the low half; .trans stores the transpose
    want = np.zeros((2, 4, 8, 8), np.uint16)
    lane = np.arange(32)
    for warp in range(2):
        for j in range(4):
            for half in range(2):
                want[warp, j, lane >> 2, 2 * (lane % 4) + half] = frag[32 * warp + lane, j] >> (16 * half)
    if trans:
        want = want.transpose(0, 1, 3, 2)
    np.testing.assert_array_equal(rows.reshape(2, 4, 8, 8), want)


# ---------------------------------------------------------------------------------------------
# tensor copies (TMA) against NumPy slicing, laid out as the PTX ISA's "Tensor" chapter says: the
# box packed with dimension 0 fastest, its 16-byte chunks swizzled by address bits 7.. of the
# shared memory it lands in (the box starts 1024-byte aligned here)
def box_image(tensor, coords, box, swizzle, fill=0, estrides=None):
    """The shared-memory bytes of the box of `tensor` (dims outermost first) at `coords` (innermost
    first); with element strides, every s-th element of a dimension, ceil(box / s) of them."""
    rank = tensor.ndim
    estrides = estrides or [1] * rank
    count = [-(-b // s) for b, s in zip(box, estrides)]
    vals = np.full(count[::-1], fill, tensor.dtype)
    for idx in np.ndindex(*count[::-1]):        # numpy order: outermost first
        g = [coords[d] + idx[rank - 1 - d] * estrides[d] for d in range(rank)]
        if all(0 <= g[d] < tensor.shape[rank - 1 - d] for d in range(rank)):
            vals[idx] = tensor[tuple(g[::-1])]
    raw = vals.reshape(-1).view(np.uint8)
    if not swizzle:
        return raw
    addr = np.arange(raw.size)
    mask = swizzle // 16 - 1
    phys = addr ^ (((addr >> 7) & mask) << 4)
    out = np.empty_like(raw)
    out[phys] = raw
    return out


def run_box(tensor, box, coords, swizzle_code, *, oob_fill=0, store_image=None, checked=False, estrides=None):
    from cuflash.emulator import tma
    rank = tensor.ndim
    estrides = estrides or [1] * rank
    dtype_code = {np.dtype(np.float16): 6, np.dtype(np.float32): 7}[tensor.dtype]
    strides = [tensor.strides[rank - 1 - d] for d in range(1, rank)]
    tmap = tma.encode_tiled(dtype_code, rank, tensor, tensor.shape[::-1], strides, box, estrides,
                            swizzle=swizzle_code, oob_fill=oob_fill)
    nbytes = int(np.prod([-(-b // s) for b, s in zip(box, estrides)])) * tensor.itemsize
    image = np.zeros(nbytes, np.uint8) if store_image is None else store_image
    f = sm90_module(checked=checked).get_function("tma_box")
    c = list(coords) + [0] * (3 - rank)
    f((1,), (128,), (tmap, *map(np.int32, c), np.int32(rank), image, np.int32(nbytes),
                     np.int32(store_image is not None)), shared_mem=nbytes)
    return image


@pytest.mark.parametrize("swizzle_code,swizzle", [(0, 0), (1, 32), (2, 64), (3, 128)])
def test_tma_load_box_layouts(swizzle_code, swizzle):
    rng = np.random.default_rng(swizzle)
    t = rng.standard_normal((40, 72)).astype(np.float16)
    box = [swizzle // 2 if swizzle else 24, 16]    # inner box of the swizzle span (24 x 2 B unswizzled)
    for coords in ([8, 4], [64, 30], [-8, -3]):    # inside, over the far edges, before the near ones
        got = run_box(t, box, coords, swizzle_code, checked=coords[0] == 64)
        np.testing.assert_array_equal(got, box_image(t, coords, box, swizzle))


def test_tma_3d_nan_fill_and_store():
    rng = np.random.default_rng(7)
    t = rng.standard_normal((3, 10, 32)).astype(np.float32)
    box, coords = [32, 8, 2], [0, 6, 2]
    got = run_box(t, box, coords, 3, oob_fill=1).view(np.float32)
    want = box_image(t, coords, box, 128, fill=np.nan).view(np.float32)
    np.testing.assert_array_equal(got, want)     # NaN where the box leaves the tensor
    assert np.isnan(got).sum() == 32 * 8 * 2 - 32 * 4 * 1
    # store a box back: in-bounds elements written, the rest dropped
    new = rng.standard_normal(box[::-1]).astype(np.float32)
    image = box_image(new, [0, 0, 0], box, 128)
    before = t.copy()
    run_box(t, box, [0, 6, 1], 3, store_image=image.copy(), checked=True)
    before[1:3, 6:10, :] = new[:2, :4, :]
    np.testing.assert_array_equal(t, before)
    # a box wholly outside the tensor (rows from 10 on) writes nothing: not the tensor's first
    # rows, as when its empty list of elements was taken for a plain bulk store
    for checked in (False, True):
        run_box(t, box, [0, 12, 0], 3, store_image=image.copy(), checked=checked)
        np.testing.assert_array_equal(t, before)


def test_tma_element_strides():
    """Every other row and every third plane: ceil(box / stride) of them, packed."""
    rng = np.random.default_rng(9)
    t = rng.standard_normal((7, 20, 32)).astype(np.float16)
    box, coords, estrides = [32, 8, 3], [0, 5, 1], [1, 2, 3]
    got = run_box(t, box, coords, 2, estrides=estrides)
    np.testing.assert_array_equal(got, box_image(t, coords, box, 64, estrides=estrides))
    assert got.size == 32 * 4 * 1 * 2


def test_tensor_map_arguments_are_checked():
    from cuflash.emulator import tma
    t = np.zeros((8, 64), np.float16)
    ok = dict(data_type=6, rank=2, global_address=t, global_dim=[64, 8], global_strides=[128], box_dim=[64, 8],
              element_strides=[1, 1], swizzle=3)
    tma.encode_tiled(**ok)
    for bad, match in ((dict(global_strides=[100]), "global_strides"), (dict(box_dim=[72, 8]), "at most 128 bytes"),
                       (dict(box_dim=[4, 8], swizzle=0), "multiple of 16 bytes"), (dict(rank=6), "rank"),
                       (dict(element_strides=[1, 9]), "element_strides"), (dict(oob_fill=2), "oob_fill"),
                       (dict(global_address=t[:, 1:]), "16-byte aligned")):
        with pytest.raises(ValueError, match=match):
            tma.encode_tiled(**{**ok, **bad})


# ---------------------------------------------------------------------------------------------
# end to end: cuflash/kernels/sm90_gemm.cu, a producer warpgroup, TMA into a two-stage ring,
# mbarriers, wgmma, setmaxnreg, compiled by the options the run-time path uses
def run_gemm(m=256, n=256, k=256, *, backend=None, checked=False, schedule="round-robin", planted=None):
    """C by the kernel on `backend` (default: the emulator's sm_90a), and by NumPy; `planted`: a
    directory of edited kernel sources. The launch is the same on every backend: only the
    module and the tensor maps' encoder come from it."""
    from cuflash import compiler
    from cuflash.backends import kernels
    backend = backend or kernels.emulator_backend(checked=checked, schedule=schedule, seed=1, arch="sm_90a")
    xp = backend.xp
    rng = np.random.default_rng(m + n + k)
    a = rng.integers(-3, 4, (m, k)).astype(np.float16)
    b = rng.integers(-3, 4, (n, k)).astype(np.float16)
    da, db = xp.asarray(a), xp.asarray(b)
    c = xp.full((m, n), np.nan, np.float32)
    if planted is None:
        mod = backend.module("sm90_gemm.cu")
    else:
        mod = RawModule(path=planted / "sm90_gemm.cu", options=compiler.nvrtc_options(), arch="sm_90a",
                        checked=checked, schedule=schedule, seed=1)
    f = mod.get_function("sm90_gemm")
    f.max_dynamic_shared_size_bytes = 65536
    # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank 2, dims innermost first, row pitch, 64 x 128 boxes, SWIZZLE_128B
    map_a = backend.encode_tensor_map(6, 2, da, [k, m], [k * 2], [64, 128], [1, 1], swizzle=3)
    map_b = backend.encode_tensor_map(6, 2, db, [k, n], [k * 2], [64, 128], [1, 1], swizzle=3)
    f((n // 128, m // 128), (384,), (map_a, map_b, c, np.int32(n), np.int32(k)), shared_mem=65536)
    c = c.get() if hasattr(c, "get") else c
    return c, a.astype(np.float64) @ b.astype(np.float64).T


@pytest.mark.parametrize("checked,schedule", [(False, "round-robin"), (True, "reversed"), (True, "random")])
def test_sm90_gemm_end_to_end(checked, schedule):
    c, ref = run_gemm(checked=checked, schedule=schedule)
    np.testing.assert_array_equal(c, ref)


@pytest.mark.gpu
def test_sm90_gemm_on_the_gpu():
    """The same launch on an H100: the driver's tensor maps, NVRTC for sm_90a."""
    from conftest import hopper_gpu_backend
    backend = hopper_gpu_backend()
    c, ref = run_gemm(512, 384, 320, backend=backend)
    np.testing.assert_array_equal(c, ref)


def planted_kernel(tmp_path, filename, old, new):
    """A copy of the GEMM's sources in tmp_path with `old` replaced by `new` in `filename`."""
    from cuflash import compiler
    tmp_path.mkdir()
    for name in ("sm90_gemm.cu", "sm90.cuh"):
        text = (compiler.KERNEL_DIR / name).read_text()
        if name == filename:
            assert old in text
            text = text.replace(old, new)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_sm90_gemm_planted_bugs(tmp_path):
    # the descriptor's stride between 8-row atoms halved: wrong numbers
    d = planted_kernel(tmp_path / "sbo", "sm90.cuh", "(1024ull >> 4) << 32", "(512ull >> 4) << 32")
    c, ref = run_gemm(m=128, n=128, k=128, planted=d)
    assert not np.array_equal(c, ref)
    # the consumers do not wait for the boxes: their wgmma reads the stage as the TMA fills it
    d = planted_kernel(tmp_path / "wait", "sm90_gemm.cu", "sm90::mbar_wait(&full[s], (t / kStages) & 1);", "")
    with pytest.raises(AsyncHazardError, match=r"the cp.async.bulk.tensor at .*sm90.cuh:\d+ overwrites shared memory "
                                               r"that the wgmma.mma_async at .*sm90.cuh:\d+ still reads"):
        run_gemm(m=128, n=128, k=128, checked=True, planted=d)


# ---------------------------------------------------------------------------------------------
# tools/capture_tensor_cores.py: what it would record on a GPU, recorded in the emulator, is the
# block model's sum for every sample (so its fragment layouts and file format are right)
def _capture_tool():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "tools" / "capture_tensor_cores.py"
    spec = importlib.util.spec_from_file_location("capture_tensor_cores", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capture_tool_records_the_block_model(tmp_path):
    from test_emulator_ptx import model_block
    cap = _capture_tool()
    assert cap.main(["--emulator", "sm_90a", "--samples", "40", "--out", str(tmp_path)]) == 0
    tc = archs.get_arch("sm_90a").mma
    for instr in ("mma.sync", "wgmma"):
        for fmt, (etype, k) in cap.FORMATS.items():
            d = tmp_path / f"{instr}-emulator-sm_90a" / fmt
            a, b = [np.array([[int(v, 16) for v in line.split()] for line in (d / f"{n}.txt").read_text().split("\n")
                              if line], np.uint32) for n in "ab"]
            c, got = [np.array([int(v, 2) for v in (d / f"{n}.txt").read_text().split()], np.uint32) for n in "cd"]
            assert a.shape == b.shape == (40, k) and c.shape == got.shape == (40,)
            block = tc.block_k_tf32 if etype == "tf32" else tc.block_k_f16
            for s in range(40):
                reg = {"f16": lambda x: int(np.uint32(x).view(np.float32).astype(np.float16).view(np.uint16)),
                       "bf16": lambda x: int(x) >> 16, "tf32": int}[etype]
                want = model_block([reg(x) for x in a[s]], [reg(x) for x in b[s]], int(c[s]), etype, block,
                                   tc.extra_bits, tc.min_exponent)
                assert int(got[s]) == want, (instr, fmt, s)


def test_capture_kernels_compile_for_the_gpu():
    """The capture kernels as CuPy would build them on an A100 and an H100 (NVRTC + ptxas)."""
    from conftest import have_toolchain
    if not have_toolchain():
        pytest.skip("NVRTC or ptxas not installed")
    from cuflash import compile_gate, compiler
    cap = _capture_tool()
    for arch, names in (("sm_80", ["mma_capture<0>", "mma_capture<2>"]),
                        ("sm_90a", ["mma_capture<1>", "wgmma_capture<0>", "wgmma_capture<2>"])):
        rows = compile_gate.compile_one(cap.KERNELS, names, arch, options=compile_gate.gate_options(arch))
        assert all(not r.error for r in rows), rows[0].error


def test_ptx_statement_registers_labels_and_guards():
    """The forms CUTLASS writes: `%`-named registers of the statement, a guarded mov, a wait loop
    of labels and branches."""
    code = r'''
extern "C" __global__ void k(unsigned* out) {
    __shared__ __align__(8) unsigned long long bar;
    unsigned leader = 0, elected = 0;
    asm volatile("{\n.reg .b32 %%rx;\n.reg .pred %%px;\n elect.sync %%rx|%%px, %2;\n@%%px mov.s32 %1, 1;\n"
                 " mov.s32 %0, %%rx;\n}" : "+r"(leader), "+r"(elected) : "r"(0xffffffffu));
    const unsigned a = (unsigned)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(a), "r"(32));
    __syncwarp();
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(a));
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1, %2;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}" :: "r"(a), "r"(0), "r"(0x989680));
    out[threadIdx.x] = leader * 100 + elected;
}
'''
    out = np.zeros(32, np.uint32)
    RawModule(code=code, arch="sm_90").get_function("k")((1,), (32,), (out,))
    assert out.tolist() == [1] + [0] * 31
