"""Tests of cuflash.emulator: CUDA C kernels run on the CPU, compared with NumPy.

Kernels live in tests/emulator_kernels/. Every expected value is computed independently with
NumPy; planted bugs must be caught in checked mode. Where CuPy sees a GPU the same kernels also
run through cupy.RawModule and must agree (skipped otherwise).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cuflash import compiler
from cuflash.emulator import (BoundsError, DeadlockError, EmulatorCompileError, EmulatorError, KernelTrap,
                              RaceError, RawModule, _abi, _build)
from cuflash.emulator.archs import get_arch

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None

KDIR = Path(__file__).resolve().parent / "emulator_kernels"
INC = f"-I{KDIR / 'include'}"
SCHEDULES = ["round-robin", "reversed", "random"]


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAVE_GPU = _gpu_available()


def src(name: str) -> str:
    return (KDIR / name).read_text()


def line_of(name: str, marker: str) -> int:
    """1-based line of tests/emulator_kernels/<name> that contains `marker`."""
    return next(i for i, line in enumerate(src(name).splitlines(), 1) if marker in line)


def mod(name, schedule="round-robin", checked=False, options=(), names=(), seed=0):
    return RawModule(code=src(name), options=options, name_expressions=names, checked=checked,
                     schedule=schedule, seed=seed)


def run_gpu(code, options, names, fname, grid, block, args, shared_mem=0):
    """Run the same kernel through cupy.RawModule; returns the NumPy copies of the array args."""
    import cupy
    m = cupy.RawModule(code=code, options=tuple(o for o in options), name_expressions=names or None)
    f = m.get_function(fname)
    dargs = tuple(cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args)
    f(grid, block, dargs, shared_mem=shared_mem)
    return [cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a for a in dargs]


# ---------------------------------------------------------------------------------------------
# correctness under every schedule
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_block_sum_matches_numpy(schedule):
    rng = np.random.default_rng(1)
    n = 5000
    x = rng.standard_normal(n).astype(np.float32)
    out = np.zeros(7, np.float32)
    mod("reduce.cu", schedule, seed=3).get_function("block_sum")((7,), (256,), (x, out, np.int32(n)))
    np.testing.assert_allclose(out.sum(dtype=np.float64), x.sum(dtype=np.float64), rtol=1e-4, atol=1e-3)
    # each block's partial: elements i with (i // 256) % 7 == block
    idx = (np.arange(n) // 256) % 7
    expect = np.array([x[idx == b].sum(dtype=np.float64) for b in range(7)])
    np.testing.assert_allclose(out, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_warp_primitives(schedule):
    rng = np.random.default_rng(2)
    x = rng.integers(0, 5, size=128).astype(np.int32)
    scan = np.zeros(128, np.int32)
    votes = np.zeros(12, np.uint32)
    seg = np.zeros(128, np.int32)
    mod("reduce.cu", schedule, seed=5).get_function("warp_ops")((2,), (64,), (x, scan, votes, seg))
    w = x.reshape(4, 32)
    np.testing.assert_array_equal(scan.reshape(4, 32), np.cumsum(w, axis=1))
    bits = (w > 0).astype(np.uint64) << np.arange(32, dtype=np.uint64)
    np.testing.assert_array_equal(votes[0::3], bits.sum(axis=1).astype(np.uint32))
    np.testing.assert_array_equal(votes[1::3], (w > 2).any(axis=1).astype(np.uint32))
    np.testing.assert_array_equal(votes[2::3], np.ones(4, np.uint32))
    lane = np.arange(128) % 32
    base = np.arange(128) - lane
    expect = x[base + (lane & ~7) + 2] * 100 + x[base + ((lane & ~7) | ((lane & 7) ^ 1))]
    down = np.where(lane + 1 < 16, x[np.minimum(np.arange(128) + 1, 127)], x)
    expect = expect + np.where(lane < 16, 10000 * down, 0)
    np.testing.assert_array_equal(seg, expect)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype,tile", [(np.float32, 16), (np.float64, 8)])
def test_tiled_matmul_templates(schedule, dtype, tile):
    rng = np.random.default_rng(3)
    M, N, K = 37, 29, 45
    A = rng.standard_normal((M, K)).astype(dtype)
    B = rng.standard_normal((K, N)).astype(dtype)
    C = np.full((M, N), np.nan, dtype)
    ctype = "float" if dtype == np.float32 else "double"
    names = [f"matmul<{ctype}, {tile}>", "matmul<float, 8>"]
    m = mod("matmul.cu", schedule, options=(INC, "-std=c++17", "-arch=sm_80", "--use_fast_math"), names=names)
    f = m.get_function(names[0])
    grid = ((N + tile - 1) // tile, (M + tile - 1) // tile)
    f(grid, (tile, tile), (A, B, C, np.int32(M), np.int32(N), np.int32(K)))
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(C, A.astype(np.float64) @ B.astype(np.float64), rtol=tol, atol=tol)


def test_strided_views_are_raw_pointers():
    # a view's data pointer is passed as is; the kernel sees a contiguous run starting there
    x = np.arange(40, dtype=np.float32)
    y = np.zeros(40, np.float32)
    f = mod("dynsmem.cu").get_function("reverse_chunks")
    f((1,), (16,), (x[8:], y[4:], np.int32(16)), shared_mem=16 * 4)
    np.testing.assert_array_equal(y[4:20], x[8:24][::-1])
    assert (y[:4] == 0).all() and (y[20:] == 0).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_half_and_bfloat16(schedule):
    rng = np.random.default_rng(4)
    n = 300
    a = rng.uniform(-2, 2, n).astype(np.float16)
    b = rng.uniform(-2, 2, n).astype(np.float16)
    c = rng.uniform(-2, 2, n).astype(np.float16)
    fma_out = np.zeros(n, np.float16)
    exp_out = np.zeros(n, np.float16)
    sum2 = np.zeros(n, np.float32)
    m = mod("lowp.cu", schedule)
    m.get_function("half_ops")((3,), (128,), (a, b, c, fma_out, exp_out, sum2, np.int32(n)))
    a64, b64, c64 = (v.astype(np.float64) for v in (a, b, c))
    np.testing.assert_array_equal(fma_out, (a64 * b64 + c64).astype(np.float16))  # one rounding
    np.testing.assert_allclose(exp_out.astype(np.float64), np.exp(a64), rtol=1e-3)
    np.testing.assert_allclose(sum2, 2 * a64 + 2 * b64, rtol=1e-3)
    if BF16 is not None:
        ab, bb, cb = (v.astype(np.float32).astype(BF16) for v in (a, b, c))
        fo = np.zeros(n, BF16)
        eo = np.zeros(n, BF16)
        m.get_function("bf16_ops")((3,), (128,), (ab, bb, cb, fo, eo, np.int32(n)))
        ref = ab.astype(np.float64) * bb.astype(np.float64) + cb.astype(np.float64)
        np.testing.assert_allclose(fo.astype(np.float64), ref, rtol=2 ** -7, atol=1e-2)
        np.testing.assert_allclose(eo.astype(np.float64), np.exp(ab.astype(np.float64)), rtol=2 ** -7)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_atomics(schedule):
    rng = np.random.default_rng(5)
    n = 3000
    x = rng.integers(0, 1000, n).astype(np.int32)
    hist = np.zeros(16, np.int32)
    fsum = np.zeros(1, np.float32)
    imax = np.full(1, -1, np.int32)
    cnt = np.zeros(1, np.uint32)
    mod("atomics.cu", schedule).get_function("atomics")((5,), (128,), (x, np.int32(n), hist, fsum, imax, cnt))
    np.testing.assert_array_equal(hist, np.bincount(x & 15, minlength=16))
    assert fsum[0] == pytest.approx(float(x.sum()), rel=1e-5)
    assert imax[0] == x.max()
    assert cnt[0] == n


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dynamic_shared_memory(schedule):
    n = 1000
    x = np.arange(n, dtype=np.float32)
    y = np.zeros(n, np.float32)
    f = mod("dynsmem.cu", schedule).get_function("reverse_chunks")
    f((4,), (256,), (x, y, np.int32(n)), shared_mem=256 * 4)
    expect = np.concatenate([x[i:i + 256][::-1] for i in range(0, n, 256)])
    np.testing.assert_array_equal(y, expect)


def test_large_dynamic_shared_needs_attribute():
    f = mod("dynsmem.cu").get_function("reverse_chunks")
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        f((1,), (64,), (x, y, np.int32(64)), shared_mem=64 * 1024)
    f.max_dynamic_shared_size_bytes = 64 * 1024
    f((1,), (64,), (x, y, np.int32(64)), shared_mem=64 * 1024)
    np.testing.assert_array_equal(y, x[::-1])


def _static_and_dynamic(f, x, y, launch_error):
    """CUDA's default limit covers the static arrays and the dynamic buffer together: 48 KiB
    of dynamic memory beside `value`'s static bytes needs the attribute raised."""
    args = (x, y, np.int32(64))
    static = f.shared_size_bytes
    assert static > 0
    f((1,), (64,), args, shared_mem=48 * 1024 - static)
    with pytest.raises(launch_error):
        f((1,), (64,), args, shared_mem=48 * 1024)
    f.max_dynamic_shared_size_bytes = 48 * 1024
    f((1,), (64,), args, shared_mem=48 * 1024)


def test_static_shared_counts_against_the_limit():
    f = mod("static_smem.cu").get_function("reverse_broadcast")
    # `value`'s 8 bytes, in ptxas's 16-byte units
    assert (f.shared_size_bytes, f.max_dynamic_shared_size_bytes) == (16, 48 * 1024 - 16)
    x, y = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    _static_and_dynamic(f, x, y, ValueError)
    np.testing.assert_array_equal(y, x[::-1])
    optin = get_arch().limits.shared_per_block_optin   # the arch `mod` built for
    with pytest.raises(ValueError, match=f"must be in \\[0, {optin - 16}\\]"):
        f.max_dynamic_shared_size_bytes = optin


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")
def test_static_shared_counts_against_the_limit_on_gpu():
    import cupy
    f = cupy.RawModule(code=src("static_smem.cu")).get_function("reverse_broadcast")
    x, y = cupy.arange(64, dtype=cupy.float32), cupy.zeros(64, cupy.float32)
    _static_and_dynamic(f, x, y, cupy.cuda.driver.CUDADriverError)
    np.testing.assert_array_equal(cupy.asnumpy(y), np.arange(64, dtype=np.float32)[::-1])


def test_argument_type_errors():
    f = mod("dynsmem.cu").get_function("reverse_chunks")
    x = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="NumPy scalar"):
        f((1,), (4,), (x, x, 4), shared_mem=16)
    with pytest.raises(TypeError, match="4-byte"):
        f((1,), (4,), (x, x, np.int64(4)), shared_mem=16)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        f((1,), (4,), (x, x), shared_mem=16)
    with pytest.raises(ValueError, match="1024"):
        f((1,), (2048,), (x, x, np.int32(4)))


def test_misspelt_keyword_and_bad_schedule_are_errors():
    code = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = 0.0f; }'
    with pytest.raises(TypeError, match="check"):
        RawModule(code=code, check=True)          # checked= misspelt: CuPy's RawModule raises too
    with pytest.raises(ValueError, match="round-robin.*'sideways'"):
        RawModule(code=code, schedule="sideways")


# ---------------------------------------------------------------------------------------------
# checked mode: clean kernels pass, planted bugs are caught
def test_checked_mode_clean_kernels_pass():
    rng = np.random.default_rng(6)
    x = rng.standard_normal(3000).astype(np.float32)
    out = np.zeros(4, np.float32)
    mod("reduce.cu", checked=True).get_function("block_sum")((4,), (128,), (x, out, np.int32(3000)))
    np.testing.assert_allclose(out.sum(), x.sum(dtype=np.float64), rtol=1e-4, atol=1e-3)
    xi = rng.integers(0, 5, 64).astype(np.int32)
    mod("reduce.cu", checked=True).get_function("warp_ops")(
        (1,), (64,), (xi, np.zeros(64, np.int32), np.zeros(6, np.uint32), np.zeros(64, np.int32)))
    A = rng.standard_normal((20, 12)).astype(np.float32)
    B = rng.standard_normal((12, 9)).astype(np.float32)
    C = np.zeros((20, 9), np.float32)
    m = mod("matmul.cu", checked=True, options=(INC,), names=["matmul<float, 8>"])
    m.get_function("matmul<float, 8>")((2, 3), (8, 8), (A, B, C, np.int32(20), np.int32(9), np.int32(12)))
    np.testing.assert_allclose(C, A @ B, rtol=1e-5, atol=1e-5)
    hist = np.zeros(16, np.int32)
    mod("atomics.cu", checked=True).get_function("atomics")(
        (3,), (64,), (xi, np.int32(64), hist, np.zeros(1, np.float32), np.zeros(1, np.int32), np.zeros(1, np.uint32)))
    np.testing.assert_array_equal(hist, np.bincount(xi & 15, minlength=16))


def test_checked_mode_from_environment(monkeypatch):
    code = """extern "C" __global__ void k(float* y) { y[threadIdx.x + 1] = 1.0f; }"""
    y = np.zeros(8, np.float32)
    f = RawModule(code=code).get_function("k")
    f((1,), (8,), (y,))  # normal mode: writes one element past the end, unnoticed
    monkeypatch.setenv("CUFLASH_EMULATOR_CHECKED", "1")
    with pytest.raises(BoundsError):
        f((1,), (8,), (np.zeros(8, np.float32),))


RACY = r"""
extern "C" __global__ void shift(const float* x, float* y) {
    __shared__ float tile[64];
    const int t = threadIdx.x;
    tile[t] = x[t] * 2.0f;
    MAYBE_SYNC
    y[t] = tile[(t + 1) % 64];
}
"""


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_missing_syncthreads_is_a_race(schedule):
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    good = RawModule(code=RACY, options=("-DMAYBE_SYNC=__syncthreads();",), checked=True, schedule=schedule)
    good.get_function("shift")((1,), (64,), (x, y))
    np.testing.assert_array_equal(y, np.roll(x * 2, -1))
    bad = RawModule(code=RACY, options=("-DMAYBE_SYNC=",), checked=True, schedule=schedule)
    with pytest.raises(RaceError) as ei:
        bad.get_function("shift")((1,), (64,), (x, y))
    msg = str(ei.value)
    assert "tile" in msg and "shared-memory race" in msg
    assert ":5" in msg and ":7" in msg  # the write (line 5) and the read (line 7)


def test_warp_sync_orders_lanes_and_barrier_reductions():
    code = r"""
    extern "C" __global__ void k(float* y, int* counts) {
        __shared__ float s[64];
        const int lane = threadIdx.x & 31;
        s[threadIdx.x] = (float)threadIdx.x;
        __syncwarp();                                        // orders the lanes of each warp
        float v = s[(threadIdx.x & ~31) | ((lane + 1) & 31)];
        y[threadIdx.x] = v;
        int c = __syncthreads_count(threadIdx.x % 3 == 0);
        int a = __syncthreads_and(threadIdx.x < 64);
        int o = __syncthreads_or(threadIdx.x == 5);
        float g[2] = {(float)lane, 1.0f}, all[64];
        __cuflash_emu_warp_allgather(0xffffffffu, g, all, sizeof(g));
        if (threadIdx.x == 0) { counts[0] = c; counts[1] = a; counts[2] = o; counts[3] = (int)all[2 * 31]; }
    }"""
    y = np.zeros(64, np.float32)
    counts = np.zeros(4, np.int32)
    for checked in (False, True):
        RawModule(code=code, checked=checked, schedule="random").get_function("k")((1,), (64,), (y, counts))
        t = np.arange(64)
        np.testing.assert_array_equal(y, (t & ~31) | ((t % 32 + 1) % 32))
        np.testing.assert_array_equal(counts, [22, 1, 1, 31])


def test_missing_syncwarp_is_a_race():
    code = r"""
    extern "C" __global__ void k(float* y) {
        __shared__ float s[32];
        s[threadIdx.x] = (float)threadIdx.x;
        y[threadIdx.x] = s[(threadIdx.x + 1) & 31];      // no __syncwarp(): lanes are not ordered
    }"""
    with pytest.raises(RaceError, match="s at byte offset"):
        RawModule(code=code, checked=True).get_function("k")((1,), (32,), (np.zeros(32, np.float32),))


def test_read_modify_write_race_on_one_shared_word():
    code = r"""
    extern "C" __global__ void count(float* out) {
        __shared__ float total;
        if (threadIdx.x == 0) total = 0.0f;
        __syncthreads();
        total += 1.0f;            // every thread: unsynchronised read-modify-write
        __syncthreads();
        if (threadIdx.x == 0) out[0] = total;
    }"""
    with pytest.raises(RaceError, match="total"):
        RawModule(code=code, checked=True).get_function("count")((1,), (32,), (np.zeros(1, np.float32),))


def test_out_of_bounds_global_read():
    code = r"""
    extern "C" __global__ void copy(const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i + 1];   // off by one
    }"""
    x = np.arange(100, dtype=np.float32)
    y = np.zeros(100, np.float32)
    with pytest.raises(BoundsError) as ei:
        RawModule(code=code, checked=True).get_function("copy")((4,), (32,), (x, y, np.int32(100)))
    msg = str(ei.value)
    assert "read" in msg and "argument 0" in msg and "0 bytes past its end" in msg and ":4" in msg


def test_shared_access_beyond_dynamic_size():
    code = r"""
    extern "C" __global__ void k(float* y) {
        extern __shared__ float dyn[];
        dyn[threadIdx.x] = 1.0f;
        __syncthreads();
        y[threadIdx.x] = dyn[threadIdx.x + 32];   // only 32 floats were requested
    }"""
    with pytest.raises(BoundsError, match="dyn"):
        RawModule(code=code, checked=True).get_function("k")((1,), (32,), (np.zeros(32, np.float32),),
                                                               shared_mem=32 * 4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_wrong_fragment_layout_is_a_race(schedule):
    c = np.arange(64, dtype=np.float32)
    ct = np.zeros(64, np.float32)
    path = KDIR / "fragment.cu"
    RawModule(path=path, checked=True, schedule=schedule).get_function("fragment_transpose")((1,), (32,), (c, ct))
    np.testing.assert_array_equal(ct.reshape(8, 8), c.reshape(8, 8).T)
    # rows from lane >> 3 instead of g = lane >> 2: lanes 0 and 4 both store C[0][0]'s slot
    wrong = RawModule(path=path, options=("-DFRAG_ROW(lane)=((lane) >> 3)",), checked=True, schedule=schedule)
    with pytest.raises(RaceError) as ei:
        wrong.get_function("fragment_transpose")((1,), (32,), (c, ct))
    msg = str(ei.value)
    store = line_of("fragment.cu", "the fragment's store")
    assert "shared-memory race on __shared__ fragment_transpose::tile" in msg
    assert f"fragment.cu:{store} " in msg and "writes" in msg and "wrote it" in msg


def test_shared_write_past_dynamic_size():
    n = 64
    x = np.random.default_rng(9).standard_normal(n).astype(np.float32)
    y = np.zeros(n, np.float32)
    f = RawModule(path=KDIR / "halo.cu", checked=True).get_function("three_point_sum")
    f((1,), (n,), (x, y), shared_mem=(n + 2) * 4)
    xp = np.pad(x.astype(np.float64), 1)
    np.testing.assert_allclose(y, xp[:-2] + xp[1:-1] + xp[2:], rtol=1e-6)
    with pytest.raises(BoundsError) as ei:      # room for one halo element only
        f((1,), (n,), (x, y), shared_mem=(n + 1) * 4)
    msg = str(ei.value)
    assert "out-of-bounds shared-memory write of 4 byte(s) on extern __shared__ row" in msg
    assert f"byte offset {(n + 1) * 4}" in msg and f"thread ({n - 1},0,0)" in msg
    assert f"halo.cu:{line_of('halo.cu', 'the right halo')} " in msg


def test_inter_block_write_write_race():
    code = r"""
    extern "C" __global__ void k(float* y) { y[threadIdx.x] = (float)blockIdx.x; }  // every block: same rows"""
    with pytest.raises(RaceError) as ei:
        RawModule(code=code, checked=True).get_function("k")((3,), (16,), (np.zeros(16, np.float32),))
    assert "inter-block" in str(ei.value) and "argument 0" in str(ei.value)


def test_inter_block_read_of_other_blocks_write():
    code = r"""
    extern "C" __global__ void k(float* y) {
        if (blockIdx.x == 0) y[threadIdx.x] = 1.0f; else y[16 + threadIdx.x] = y[threadIdx.x];
    }"""
    with pytest.raises(RaceError, match="inter-block"):
        RawModule(code=code, checked=True).get_function("k")((2,), (16,), (np.zeros(32, np.float32),))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checked", [False, True])
def test_deadlock_is_reported(checked):
    code = r"""
    extern "C" __global__ void k(float* y) {
        float v = threadIdx.x;
        if (threadIdx.x < 16) __syncthreads();
        else v = __shfl_sync(0xffffffffu, v, 0);    // waits for lanes 0-15, which wait at the barrier
        y[threadIdx.x] = v;
    }"""
    with pytest.raises(DeadlockError) as ei:
        RawModule(code=code, checked=checked).get_function("k")((1,), (32,), (np.zeros(32, np.float32),))
    msg = str(ei.value)
    assert "__syncthreads" in msg and "__shfl_sync" in msg and ":4" in msg and ":5" in msg


@pytest.mark.timeout(60)
def test_divergent_barrier_in_checked_mode():
    code = r"""
    extern "C" __global__ void k(float* y, int n) {
        if (threadIdx.x >= n) return;     // early exit before a barrier
        __syncthreads();
        y[threadIdx.x] = 1.0f;
    }"""
    args = (np.zeros(64, np.float32), np.int32(40))
    RawModule(code=code).get_function("k")((1,), (64,), args)  # what GPUs do: exited threads are not waited for
    with pytest.raises(DeadlockError, match="exited"):
        RawModule(code=code, checked=True).get_function("k")((1,), (64,), args)


def test_device_assert_and_trap():
    code = r"""
    #include <assert.h>
    extern "C" __global__ void k(const int* x) { assert(x[threadIdx.x] >= 0); }
    extern "C" __global__ void t() { if (threadIdx.x == 3) __trap(); }"""
    m = RawModule(code=code)
    with pytest.raises(KernelTrap, match="x\\[threadIdx.x\\] >= 0"):
        m.get_function("k")((1,), (8,), (np.array([0, 1, 2, -1, 4, 5, 6, 7], np.int32),))
    with pytest.raises(KernelTrap, match="__trap"):
        m.get_function("t")((1,), (8,), ())


def test_compile_error_shows_source_line():
    code = "extern \"C\" __global__ void k(float* y) {\n    y[0] = undefined_thing;\n}\n"
    with pytest.raises(EmulatorCompileError) as ei:
        RawModule(code=code).get_function("k")
    msg = str(ei.value)
    assert "undefined_thing" in msg and ":2:" in msg


def test_inline_asm_is_a_clear_error():
    code = r"""
    extern "C" __global__ void k(unsigned* y) {
        unsigned lane;
        asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
        y[threadIdx.x] = lane;
    }"""
    with pytest.raises(EmulatorCompileError, match="inline PTX"):
        RawModule(code=code).get_function("k")


def test_emulator_macro_selects_cpu_implementation():
    code = r"""
    __device__ unsigned lane_id() {
    #ifdef CUFLASH_EMULATOR
        return threadIdx.x & 31;
    #else
        unsigned l; asm volatile("mov.u32 %0, %%laneid;" : "=r"(l)); return l;
    #endif
    }
    extern "C" __global__ void k(unsigned* y) { y[threadIdx.x] = lane_id(); }"""
    y = np.zeros(64, np.uint32)
    RawModule(code=code).get_function("k")((1,), (64,), (y,))
    np.testing.assert_array_equal(y, np.arange(64) % 32)


def test_segfault_in_device_code_is_an_error_not_a_crash():
    code = r"""extern "C" __global__ void k(float* y) { ((float*)8)[threadIdx.x] = 1.0f; }"""
    with pytest.raises(EmulatorError, match="invalid memory access"):
        RawModule(code=code).get_function("k")((1,), (4,), (np.zeros(4, np.float32),))


def test_path_and_include_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "k.cu").write_text('#include "emu_test_helpers.cuh"\n'
                                   'extern "C" __global__ void k(const float* a, float* b) {\n'
                                   '  b[threadIdx.x] = load_or_zero(a, 0, threadIdx.x, 1, 4); }\n')
    a = np.arange(8, dtype=np.float32)
    b = np.zeros(8, np.float32)
    m = RawModule(path=str(tmp_path / "k.cu"), options=("-I", str(KDIR / "include")))
    m.get_function("k")((1,), (8,), (a, b))
    np.testing.assert_array_equal(b, [0, 1, 2, 3, 0, 0, 0, 0])
    assert list((tmp_path / "cache" / "emulator").glob("k-*.so"))


def test_cache_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("CUFLASH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiler.cache_dir("emulator") == tmp_path / "xdg" / "cuflash" / "emulator"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")     # invalid in the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compiler.cache_dir("emulator") == tmp_path / "home" / ".cache" / "cuflash" / "emulator"
    monkeypatch.setenv("CUFLASH_CACHE_DIR", str(tmp_path / "mine"))
    assert compiler.cache_dir("compile_gate") == tmp_path / "mine" / "compile_gate"


def test_cache_key_reads_kernel_headers_not_toolkit_headers(tmp_path):
    kernels, toolkit = tmp_path / "kernels", tmp_path / "cuda" / "include"
    kernels.mkdir()
    toolkit.mkdir(parents=True)
    (kernels / "tile.cuh").write_text("#define TILE 64\n")
    (toolkit / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12090\n")
    (toolkit / "cuda_fp16.h").write_text("// one\n")

    def key():
        return _build.cache_key("code", None, (f"-I{kernels}", f"-I{toolkit}"), ["k"], False, "g++", [])

    k0 = key()
    (kernels / "tile.cuh").write_text("#define TILE 128\n")
    k1 = key()
    assert k1 != k0                                   # a kernel header edit rebuilds
    (toolkit / "cuda_fp16.h").write_text("// two\n")
    assert key() == k1                                # toolkit headers count by version only
    (toolkit / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 12100\n")
    compiler.cuda_version.cache_clear()
    assert key() != k1


def test_abi_enums_mirror_abi_h():
    text = (Path(_abi.__file__).parent / "runtime" / "abi.h").read_text()
    for c_enum, py_enum, prefix in [("EmuErrorKind", _abi.ErrorKind, "EMU_ERROR_"),
                                    ("EmuSpace", _abi.Space, "EMU_SPACE_"),
                                    ("EmuSchedule", _abi.Schedule, "EMU_SCHEDULE_"),
                                    ("EmuParamKind", _abi.ParamKind, "EMU_PARAM_")]:
        body = re.search(r"enum %s \{(.*?)\};" % c_enum, text, re.S).group(1)
        in_c = {name.removeprefix(prefix): int(v) for name, v in re.findall(r"(\w+)\s*=\s*(\d+)", body)}
        assert in_c == {m.name: m.value for m in py_enum}, c_enum


# ---------------------------------------------------------------------------------------------
# a launch of FlashAttention's shape (timings: docs/emulator.md, not tests)
FA_LIKE = r"""
template <int BR>
__global__ void fa_like(const float* __restrict__ q, float* __restrict__ o, int steps) {
    __shared__ float tile[BR][33];
    const int t = threadIdx.x;
    float acc[32];
    for (int i = 0; i < 32; ++i) acc[i] = q[blockIdx.x * BR + t] * i;
    float m = -1e30f, l = 0.0f;
    for (int s = 0; s < steps; ++s) {
        for (int i = 0; i < 32; ++i) tile[t][i] = sinf(acc[i]) + 0.01f * s;
        __syncthreads();
        float mx = m;
        for (int i = 0; i < 32; ++i) mx = fmaxf(mx, tile[(t + s) % BR][i]);
        const float sc = __expf(m - mx);
        l *= sc;
        for (int i = 0; i < 32; ++i) { float p = __expf(tile[(t + 1) % BR][i] - mx); l += p; acc[i] = acc[i] * sc + p; }
        m = mx;
        __syncthreads();
    }
    o[blockIdx.x * BR + t] = acc[0] / l;
}
"""


def test_flash_attention_sized_launch():
    m = RawModule(code=FA_LIKE, name_expressions=["fa_like<128>"])
    f = m.get_function("fa_like<128>")
    q = np.random.default_rng(7).random(64 * 128).astype(np.float32)
    o = np.zeros_like(q)
    f((64,), (128,), (q, o, np.int32(16)))   # 64 blocks x 128 threads x 32 barriers
    # NumPy model of the same computation
    acc = q.reshape(64, 128, 1).astype(np.float64) * np.arange(32)
    m_ = np.full((64, 128), -1e30)
    l_ = np.zeros((64, 128))
    t = np.arange(128)
    for s in range(16):
        tile = np.sin(acc) + 0.01 * s
        mx = np.maximum(m_, tile[:, (t + s) % 128, :].max(axis=2))
        sc = np.exp(m_ - mx)
        p = np.exp(tile[:, (t + 1) % 128, :] - mx[..., None])
        l_ = l_ * sc + p.sum(axis=2)
        acc = acc * sc[..., None] + p
        m_ = mx
    np.testing.assert_allclose(o, (acc[..., 0] / l_).ravel(), rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# GPU cross-check (skipped without a device)
@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")
def test_same_kernels_on_gpu_agree():
    rng = np.random.default_rng(8)
    x = rng.standard_normal(5000).astype(np.float32)
    args = (x, np.zeros(7, np.float32), np.int32(5000))
    emu = args[1].copy()
    mod("reduce.cu").get_function("block_sum")((7,), (256,), (x, emu, np.int32(5000)))
    gpu = run_gpu(src("reduce.cu"), (), (), "block_sum", (7,), (256,), args)[1]
    np.testing.assert_allclose(emu, gpu, rtol=1e-5, atol=1e-4)
    M, N, K = 37, 29, 45
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((K, N)).astype(np.float32)
    C = np.zeros((M, N), np.float32)
    name = "matmul<float, 16>"
    mod("matmul.cu", options=(INC,), names=[name]).get_function(name)(
        (2, 3), (16, 16), (A, B, C, np.int32(M), np.int32(N), np.int32(K)))
    Cg = run_gpu(src("matmul.cu"), (INC,), [name], name, (2, 3), (16, 16),
                 (A, B, np.zeros_like(C), np.int32(M), np.int32(N), np.int32(K)))[2]
    np.testing.assert_allclose(C, Cg, rtol=1e-5, atol=1e-5)
    a = rng.uniform(-2, 2, 300).astype(np.float16)
    outs = [np.zeros(300, np.float16), np.zeros(300, np.float16), np.zeros(300, np.float32)]
    mod("lowp.cu").get_function("half_ops")((3,), (128,), (a, a, a, *outs, np.int32(300)))
    g = run_gpu(src("lowp.cu"), (), (), "half_ops", (3,), (128,),
                (a, a, a, *[np.zeros_like(o) for o in outs], np.int32(300)))
    np.testing.assert_array_equal(outs[0], g[3])
    np.testing.assert_allclose(outs[1].astype(np.float32), g[4].astype(np.float32), rtol=2e-3)


def test_intra_block_global_race():
    # FA1-style: threads rescale rows kept in global memory; one thread reads a value another
    # thread of the same block wrote, without a barrier in between
    code = r"""
    extern "C" __global__ void k(float* m, float* o) {
        const int t = threadIdx.x;
        m[t] = 2.0f * t;
        SYNC
        o[t] = m[(t + 1) % 32];
    }"""
    m = np.zeros(32, np.float32)
    o = np.zeros(32, np.float32)
    RawModule(code=code, options=("-DSYNC=__syncthreads();",), checked=True).get_function("k")((1,), (32,), (m, o))
    np.testing.assert_array_equal(o, 2.0 * ((np.arange(32) + 1) % 32))
    with pytest.raises(RaceError) as ei:
        RawModule(code=code, options=("-DSYNC=",), checked=True).get_function("k")((1,), (32,), (m, o))
    assert "global-memory race" in str(ei.value) and "argument 0" in str(ei.value)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_launches_do_not_leak_mappings(monkeypatch):
    # fiber stacks (one guard-page mapping per thread) must be returned after every launch,
    # or a long test session runs out of vm.max_map_count
    monkeypatch.setenv("CUFLASH_EMULATOR_THREADS", "2")
    f = mod("dynsmem.cu").get_function("reverse_chunks")
    x = np.arange(512, dtype=np.float32)
    y = np.zeros(512, np.float32)

    def launches(n):
        for _ in range(n):
            f((2,), (256,), (x, y, np.int32(512)), shared_mem=1024)

    def mappings():
        """(number of mappings, bytes mapped): a leak that merges with a neighbouring
        mapping shows in the bytes."""
        with open("/proc/self/maps") as fh:
            spans = [line.split()[0].split("-") for line in fh]
        return len(spans), sum(int(hi, 16) - int(lo, 16) for lo, hi in spans)

    # Some mappings come once per process, not per launch, at a moment no test controls:
    # glibc gives a worker thread that finds every malloc arena locked a new arena (a
    # 64 MiB reservation, two mappings; at most 8 per core), the heap grows, and the first
    # reading allocates the reading's own memory. A leak recurs in every round of
    # launches, so one round of 40 that maps nothing new (count and bytes) is the proof.
    launches(5)
    mappings()
    growth = []
    for _ in range(4):
        before = mappings()
        launches(40)
        after = mappings()
        growth.append((after[0] - before[0], after[1] - before[1]))
        if after == before:
            break
    assert growth[-1] == (0, 0), f"(mappings, bytes) added per round of 40 launches: {growth}"
