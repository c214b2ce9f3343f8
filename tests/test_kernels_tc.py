"""The tensor-core forward (flash_fwd_tc.cu) in the emulator, on every emulated tensor-core
arch, against the float64 reference with FlashAttention's tolerance rule
(conftest.assert_close_to_reference), each run asserting the plan that launched; its
swizzle; its dispatch (`tiling.forward_path`); its machine code. (Its shared-memory
formula: test_kernels_forward.py's test_smem_formula_matches_ptxas.)

Each specialization is built once per arch it runs on (a g++ build of a few seconds), so
the matrix below is chosen to build each of them on at least one sm_80+ arch, every
float16 one on sm_75 too (two m16n8k8 per k16 step, synchronous copies), and to reuse
those builds for the features (causal, GQA/MQA, Nq != Nk, odd sizes, strides).
"""
import numpy as np
import pytest

from cuflash import _dtypes, compiler, emulator, reference, tiling
from cuflash.backends import kernel_forward, kernels

from conftest import (HAS_GXX, assert_close_to_reference, assert_lse_close, attention_inputs,
                      emulator_backend, have_toolchain, plain_attention)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F16, BF16, F32 = np.dtype(np.float16), _dtypes.BFLOAT16, np.dtype(np.float32)


def _tc_plan(dtype, head_dim, num_warps):
    (plan,) = (p for p in tiling.all_tc_plans() if p.dtype == np.dtype(dtype).name
               and p.head_dim == head_dim and p.num_warps == num_warps)
    return plan


def _backend(arch, *, max_smem=None, checked=False, schedule="round-robin"):
    """The emulator on `arch`; `max_smem` below the arch's limit forces a smaller tile."""
    return emulator_backend(arch, max_smem=max_smem, checked=checked, schedule=schedule, seed=3)


def _inputs(B, Hq, Hkv, Nq, Nk, d, dtype, seed=0):
    return attention_inputs(B, Hq, Hkv, Nq, Nk, d, dtype, seed=seed)[:3]


def _check(be, q, k, v, *, causal, expect_plan=None):
    """The forward on `be` (a conftest.emulator_backend) against the reference; returns the
    plan that launched (`expect_plan` when given), o and lse."""
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d)
    o, lse = be.forward(q, k, v, causal=causal, scale=scale, algorithm="fa2")
    (plan,) = be.take_launches()
    if expect_plan is not None:
        assert plan == expect_plan, plan
    assert o.shape == q.shape and o.dtype == q.dtype
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=q.dtype)
    assert_close_to_reference(o, ref_o, plain, q.dtype, what=f"O ({plan})")
    assert_lse_close(lse, ref_lse, q.dtype)
    return plan, o, lse


# -- every specialization, on the archs it targets --------------------------------------------
# (dtype, HEAD_DIM, NUM_WARPS, arch, max_smem forcing the tile or None for the arch's own pick)
SPECS = [
    (F16, 64, 4, "sm_75", None),             # two row tiles per warp (32 rows)
    (F16, 64, 4, "sm_80", None),
    (F16, 128, 4, "sm_75", None),            # T4: 64 KB, two row tiles, Q_i re-read, general loop
    (F16, 128, 4, "sm_86", 64 * 1024),       # the 100 KB GPUs' fallback
    (F16, 128, 8, "sm_86", None),            # 100 KB: one row tile per warp, the lean loop
    (F16, 256, 4, "sm_75", None),            # one row tile per warp
    (F16, 256, 4, "sm_89", 64 * 1024),
    (F16, 256, 8, "sm_89", None),
    (BF16, 64, 4, "sm_89", None),
    (BF16, 128, 4, "sm_80", None),
    (BF16, 128, 4, "sm_90", None),
    (BF16, 128, 8, "sm_89", None),
    (BF16, 256, 4, "sm_90", None),
    (BF16, 256, 8, "sm_86", None),
]


def _spec_id(spec):
    dt, D, warps, arch, smem = spec
    return f"{np.dtype(dt).name}-D{D}-w{warps}-{arch}{'-forced' if smem else ''}"


def test_the_matrix_covers_every_specialization_and_arch():
    built = {(_tc_plan(dt, D, warps), arch) for dt, D, warps, arch, _ in SPECS}
    for plan in tiling.all_tc_plans():
        archs = {a for p, a in built if p == plan}
        assert archs - {"sm_75"}, f"{plan} never runs on an sm_80+ arch"
        if plan.dtype == "float16" and plan.smem_bytes <= kernels.emulator_limits("sm_75")["max_smem"]:
            assert "sm_75" in archs, f"{plan} never runs with m16n8k8 (sm_75)"
    assert {a for _, a in built} == {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"}


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_specialization(spec):
    """Partial query and key tiles, columns d..D-1 zero-filled, causal with Nq < Nk; and the
    full-width head dim without the mask."""
    dt, D, warps, arch, smem = spec
    plan = _tc_plan(dt, D, warps)
    be = _backend(arch, max_smem=smem)
    q, k, v = _inputs(1, 2, 1, plan.block_m + 5, 2 * plan.block_n + 3, D - 8, dt,
                      seed=D + plan.block_m)
    _check(be, q, k, v, causal=True, expect_plan=plan)
    q, k, v = _inputs(1, 1, 1, 17, plan.block_n + 1, D, dt, seed=D)
    _check(be, q, k, v, causal=False, expect_plan=plan)


# -- features on the default tile of each arch -----------------------------------------------

@pytest.mark.parametrize("arch,dt", [("sm_75", F16), ("sm_80", F16), ("sm_90", BF16)])
@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,d,causal", [
    (4, 1, 33, 47, 64, False),     # MQA
    (4, 2, 113, 17, 56, True),     # GQA; Nq > Nk: the first 96 rows see no key (O = 0, lse = −inf)
    (2, 2, 1, 150, 8, True),       # decoding: one query, the smallest d
    (1, 1, 150, 113, 40, True),    # odd sizes, two query blocks
])
def test_features(arch, dt, Hq, Hkv, Nq, Nk, d, causal):
    q, k, v = _inputs(2, Hq, Hkv, Nq, Nk, d, dt, seed=Nq * Nk + d)
    plan, o, lse = _check(_backend(arch), q, k, v, causal=causal)
    assert plan.kernel == "flash_fwd_tc"
    if Nq > Nk and causal:
        assert np.all(o[..., :Nq - Nk, :] == 0) and np.all(np.isneginf(lse[..., :Nq - Nk]))


def test_strided_inputs_aligned_and_not():
    """Views whose strides keep 16-byte rows run on tensor cores; a base pointer 2 bytes off
    falls back to the SIMT kernel; both are right."""
    rng = np.random.default_rng(7)
    B, H, N, d = 1, 2, 37, 48
    q = rng.standard_normal((B, N, H, d)).astype(F16).transpose(0, 2, 1, 3)      # (B, H, N, d) view
    k = rng.standard_normal((B, H, 2 * N, d)).astype(F16)[:, :, ::2]             # row stride 2d
    v = rng.standard_normal((B, H, N, d)).astype(F16)
    be = _backend("sm_80")
    assert kernel_forward.loads_16b_aligned(q, k, v)
    assert _check(be, q, k, v, causal=True)[0].kernel == "flash_fwd_tc"
    buf = np.zeros(v.size + 1, F16)
    v_off = buf[1:].reshape(v.shape)
    v_off[...] = v
    assert not kernel_forward.loads_16b_aligned(q, k, v_off)
    assert _check(be, q, k, v_off, causal=True)[0].kernel == "flash_fwd"


# -- checked mode: no races, no out-of-bounds access, no read of a pending cp.async ----------

@pytest.mark.parametrize("arch,dt,D,warps,smem,schedule", [
    ("sm_80", F16, 64, 4, None, "round-robin"),
    ("sm_75", F16, 128, 4, None, "random"),          # synchronous copies, two m16n8k8
    ("sm_90", BF16, 256, 4, None, "reversed"),       # Q_i re-read from shared memory
    ("sm_90", BF16, 128, 4, None, "random"),         # two row tiles, one lean loop
    ("sm_86", BF16, 128, 8, None, "reversed"),       # 8 warps, the lean loop
])
def test_checked(arch, dt, D, warps, smem, schedule):
    plan = _tc_plan(dt, D, warps)
    be = _backend(arch, max_smem=smem, checked=True, schedule=schedule)
    # three key tiles: the ring wraps; Nq > Nk and causal: skipped and partial tiles
    q, k, v = _inputs(1, 2, 1, 3 * plan.block_n + 9, 3 * plan.block_n - 5, D - 16, dt, seed=D)
    _check(be, q, k, v, causal=True, expect_plan=plan)


# -- the swizzle ------------------------------------------------------------------------------

SWIZZLE_PROBE = r"""
#include "tc_tile.cuh"
using Tr = cuflash::TcTileTraits<__half, PROBE_D, 64, 16, 4, 2>;
// out[row][chunk] = the physical chunk of logical (row, chunk), from tile_offset.
extern "C" __global__ void probe(int* out) {
    for (int i = threadIdx.x; i < 16 * Tr::kChunksPerRow; i += blockDim.x) {
        const int row = i / Tr::kChunksPerRow, chunk = i % Tr::kChunksPerRow;
        const int off = cuflash::tile_offset<Tr>(row, chunk * 8 + 3);
        out[i] = (off - row * PROBE_D - 3) / 8;
    }
}
"""


@pytest.mark.parametrize("D", [64, 256])
def test_swizzle_is_a_row_permutation_without_bank_conflicts(D):
    out = np.full((16, D // 8), -1, np.int32)
    emulator.RawModule(code=SWIZZLE_PROBE, options=(*compiler.nvrtc_options(), f"-DPROBE_D={D}")
                       ).get_function("probe")((1,), (32,), (out,))
    for row in range(16):   # each row's chunks are permuted in place
        assert sorted(out[row]) == list(range(D // 8)), row
    # the 8 rows one ldmatrix phase reads (rows r..r+7, one logical chunk) hit 8 distinct
    # 16-byte bank groups (rows are multiples of 128 bytes, so the group is chunk % 8)
    for r0 in (0, 8):
        for chunk in range(D // 8):
            assert len({out[r0 + i, chunk] % 8 for i in range(8)}) == 8, (r0, chunk)
    # and 8 neighbouring threads storing 8 consecutive chunks of a row do too
    for row in range(16):
        for c0 in range(0, D // 8, 8):
            assert len({x % 8 for x in out[row, c0:c0 + 8]}) == 8


# -- dispatch ---------------------------------------------------------------------------------

def test_forward_path_and_its_reasons():
    big = 227 * 1024

    def path(d=64, dtype=F16, cc=(8, 0), aligned=True, max_smem=big, algorithm="fa2"):
        return tiling.forward_path(d, dtype, cc, aligned, max_smem=max_smem, algorithm=algorithm)

    for dt, cc in ((F16, (7, 5)), (F16, (9, 0)), (BF16, (8, 6))):
        for d in (8, 64, 72, 128, 136, 256):
            plan, why = path(d, dt, cc)
            assert plan.kernel == "flash_fwd_tc" and d <= plan.head_dim and "tensor cores" in why
    assert "m16n8k8" in path(cc=(7, 5))[1] and "m16n8k16" in path(cc=(8, 0))[1]
    fallbacks = [
        (path(dtype=F32, cc=(7, 5)), "float32"),   # tf32 needs sm_80 (test_kernels_tf32.py)
        (path(dtype=np.float64), "float64"),
        (path(cc=(7, 0)), "sm_70"),
        (path(dtype=BF16, cc=(7, 5)), "sm_80"),
        (path(d=59), "multiple of 8"),
        (path(d=264), "> 256"),
        (path(aligned=False), "16-byte aligned"),
        (path(algorithm="fa1"), "fa1"),
        (path(cc=None), "unknown"),
        (path(d=256, max_smem=60 * 1024), "fits"),
    ]
    for (plan, why), word in fallbacks:
        assert plan.kernel != "flash_fwd_tc" and why.startswith("SIMT") and word in why, why
    # no compute capability: SIMT
    assert tiling.forward_path(64, F16, max_smem=big)[0].kernel == "flash_fwd"
    # the emulator's default arch (sm_80) takes tensor cores for 16-bit inputs
    assert tiling.forward_path(64, BF16, **kernels.emulator_limits())[0].kernel == "flash_fwd_tc"


def test_tc_plans_fit_and_are_listed():
    specs = tiling.specializations()["flash_fwd_tc.cu"]
    for plan in tiling.all_tc_plans():
        assert plan.name_expression in specs
        assert plan.row_tiles in (1, 2) and plan.stages >= 2
        assert plan.block_m == 16 * plan.row_tiles * plan.num_warps
    for dt in (F16, BF16):      # every head dim has a tile within sm_75's 64 KB
        for D in tiling.TC_HEAD_DIMS:
            assert min(p.smem_bytes for p in tiling.all_tc_plans()
                       if p.dtype == dt.name and p.head_dim == D) <= 64 * 1024


# -- the machine code: tensor-core instructions present, local memory absent ----------------

@pytest.mark.skipif(not have_toolchain(), reason="NVRTC or ptxas not installed")
def test_sass_has_mma_ldmatrix_cp_async_and_no_local_memory():
    """nvdisasm of every specialization: all of the tile's mma (HMMA; twice as many on sm_75:
    two m16n8k8 per k16 step; per row tile of the warp), ldmatrix (LDSM), cp.async (LDGSTS,
    sm_80+; plain loads on sm_75) and no local memory (LDL/STL); bfloat16 and float32 on
    sm_75 are a trap. float32 (tf32): at least the unrolled P̃ V mma (three per product when
    split; Q Kᵀ's k loop is rolled when Q_i stays in shared memory), no ldmatrix."""
    from cuflash import compile_gate
    if compile_gate.nvdisasm_path() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    plans = {p.name_expression: p for p in (*tiling.all_tc_plans(), *tiling.all_tf32_plans())}
    archs = [a for a in compiler.GATE_ARCHS if a != "sm_70"]   # CUDA 13's nvdisasm has no sm_70
    # the file's whole list, as the gate builds it (its cached builds)
    names = tiling.specializations()["flash_fwd_tc.cu"]
    assert sorted(names) == sorted(plans)
    rows = compile_gate.run_gate({"flash_fwd_tc.cu": names}, archs=archs, sass=True)
    assert len(rows) == len(plans) * len(archs)
    for r in rows:
        assert r.ok and r.sass is not None, (r.kernel, r.arch, r.error)
        p, n = plans[r.kernel], r.sass
        if p.dtype in ("bfloat16", "float32") and r.arch == "sm_75":
            assert n["HMMA"] == n["LDSM"] == 0, (r.kernel, r.arch, n)
            continue
        if p.dtype == "float32":
            pv = (p.block_n // 8) * (p.head_dim // 8) * (3 if p.split else 1)
            assert n["HMMA"] >= pv and n["LDSM"] == 0 and n["LDGSTS"] > 0, (r.kernel, r.arch, n)
            assert n["LDL"] == n["STL"] == 0, (r.kernel, r.arch, n)
            continue
        D, bn = p.head_dim, p.block_n
        rt = p.row_tiles                                              # each K, V fragment
        mma = rt * ((D // 16) * (bn // 8) + (bn // 16) * (D // 8))   # Q Kᵀ + P̃ V per tile
        ldsm = (D // 16) * (bn // 16) + (bn // 16) * (D // 16)       # K and V fragments
        ldsm += rt * (D // 16)                                        # Q (once, or per tile)
        assert n["HMMA"] >= mma * (2 if r.arch == "sm_75" else 1), (r.kernel, r.arch, n)
        assert n["LDSM"] >= ldsm, (r.kernel, r.arch, n)
        assert (n["LDGSTS"] > 0) == (r.arch != "sm_75"), (r.kernel, r.arch, n)
        assert n["LDL"] == n["STL"] == 0, (r.kernel, r.arch, n)


# -- the online softmax over several key tiles in one block -----------------------------------

@pytest.mark.parametrize("dt,D,warps,arch", [
    (F16, 64, 4, "sm_80"),     # lean, two row tiles
    (BF16, 128, 4, "sm_90"),   # one lean loop, two row tiles
    (F16, 128, 8, "sm_86"),    # lean, one row tile
    (F16, 256, 4, "sm_75"),    # general loop, synchronous copies
    (F32, 128, 8, "sm_80"),    # one-pass tf32
    (F16, 128, 4, "sm_100"),   # one lean loop on Blackwell
    (BF16, 128, 8, "sm_120"),  # consumer Blackwell's 8-warp tiles
    (F16, 256, 8, "sm_120"),
], ids=lambda x: x if isinstance(x, (int, str)) else np.dtype(x).name)
def test_online_softmax_across_key_tiles(dt, D, warps, arch):
    """One block walks four key tiles (num_splits=1). Key 0 is a sink every row scores 8
    on, so no row's max moves after the first tile (the whole warp skips acc *= α), but for
    one row whose max moves to 16 in the last tile: its warp must rescale."""
    plan = (_tc_plan(dt, D, warps) if dt != F32 else next(
        p for p in tiling.all_tf32_plans() if not p.split and p.head_dim == D
        and p.num_warps == warps))
    rng = np.random.default_rng(D)
    Nq, Nk, d = plan.block_m, 4 * plan.block_n, D
    scale = d ** -0.5
    q = rng.uniform(-1, 1, (1, 1, Nq, d))
    k = rng.uniform(-1, 1, (1, 1, Nk, d)) * 0.5
    v = rng.uniform(-1, 1, (1, 1, Nk, d))
    q[..., 0], k[..., 0] = 1.0, 0.0
    k[..., 0, 0] = 8 / scale                      # the sink
    q[..., 1], k[..., 1] = 0.0, 0.0
    row, key = Nq // 2 + 3, Nk - plan.block_n // 2
    q[..., row, 1], k[..., key, 1] = 1.0, 16 / scale
    q, k, v = (x.astype(dt) for x in (q, k, v))
    be = _backend(arch)
    o, lse = be.forward(q, k, v, causal=False, scale=scale, algorithm="fa2", num_splits=1,
                        allow_tf32=dt == F32)
    (launched,) = be.take_launches()
    assert launched == plan, launched
    ref_o, ref_lse = reference.naive_attention(q, k, v, scale=scale, return_lse=True)
    if dt == F32:   # one-pass tf32: 10-bit mantissas in every product
        np.testing.assert_allclose(o, ref_o, atol=5e-3)
    else:
        plain, _ = plain_attention(q, k, v, causal=False, scale=scale, dtype=q.dtype)
        assert_close_to_reference(o, ref_o, plain, q.dtype, what=f"O ({plan})")
        assert_lse_close(lse, ref_lse, q.dtype)


# -- the lean main loop (float16, D = 64: key tiles of 64, kLean) -----------------------------

@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_lean_loop_reads_a_paged_cache(page, causal):
    """The lean loop's copies step their pointers through the block table at each page's
    end: pages of one and of two key tiles, out of order, lengths ending inside a tile, one
    block over all of a row's keys (num_splits=1)."""
    import cuflash
    rng = np.random.default_rng(page + causal)
    B, hq, hkv, d, max_pages = 2, 2, 1, 64, 5
    num_blocks = B * max_pages + 2
    table = rng.permutation(num_blocks)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    kc, vc = (rng.uniform(-1, 1, (num_blocks, hkv, page, d)).astype(np.float16)
              for _ in range(2))
    lens = np.array([4 * page + 17, 2 * page], np.int32)
    q = rng.uniform(-1, 1, (B, hq, 3, d)).astype(np.float16)
    o, lse = cuflash.flash_attention_with_kvcache(q, kc, vc, lens, block_table=table,
                                                  causal=causal, num_splits=1,
                                                  return_lse=True, backend="emulator")
    for b in range(B):
        pos = np.arange(lens[b])
        k, v = (c[table[b, pos // page], :, pos % page].transpose(1, 0, 2)[None]
                for c in (kc, vc))
        ref_o, ref_lse = reference.naive_attention(q[b:b + 1], k, v, causal=causal,
                                                   return_lse=True)
        plain, _ = plain_attention(q[b:b + 1], k, v, causal=causal, scale=d ** -0.5,
                                   dtype=q.dtype)
        assert_close_to_reference(o[b:b + 1], ref_o, plain, q.dtype, what=f"O, row {b}")
        assert_lse_close(lse[b:b + 1], ref_lse, q.dtype)


def test_lean_loop_scores_up_to_the_documented_limit():
    """The steady state folds the scale into its exponent after the row max (docs/api.md,
    Numerical limits: scores below 1e7): scores of ±5e6 give the float64 reference's
    answer, each row nearly all on its largest key."""
    rng = np.random.default_rng(11)
    q, k, v = _inputs(1, 2, 2, 128, 256, 64, F16, seed=11)
    q = (np.sign(q) * 8).astype(F16)                  # |q·k| up to 8·64·max|k|
    scale = 5e6 / np.abs(q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)).max()
    be = _backend("sm_80")
    o, lse = be.forward(q, k, v, causal=False, scale=scale, algorithm="fa2")
    (plan,) = be.take_launches()
    assert plan.kernel == "flash_fwd_tc" and plan.block_n == 64, plan
    ref_o, ref_lse = reference.naive_attention(q, k, v, scale=scale, return_lse=True)
    np.testing.assert_allclose(o.astype(np.float64), ref_o, rtol=0, atol=2e-3)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
