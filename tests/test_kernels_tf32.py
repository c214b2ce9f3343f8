"""The float32 tensor-core forward (flash_fwd_tc.cu's flash_fwd_tf32_kernel) in the emulator on sm_80, sm_86, sm_89
and sm_90: split tf32 against the SIMT float32 kernel's own error (at most 2x), one-pass tf32
against a plain tf32 implementation (FlashAttention's rule); its dispatch; the public keyword;
its shared-memory formula through ptxas.

Each specialization is built once per arch it runs on; the matrix builds each on one sm_80+
arch and reuses those builds for the features.
"""
import numpy as np
import pytest

import cuflash
from cuflash import compiler, emulator, reference, tiling
from cuflash.backends import kernel_forward, kernels

from conftest import HAS_GXX, round_tf32 as tf32

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F32 = np.dtype(np.float32)


def _tf32_plan(split, head_dim, block_m, block_n):
    return next(p for p in tiling.all_tf32_plans() if p.split == split and p.head_dim == head_dim
                and p.block_m == block_m and p.block_n == block_n)


def _backend(arch, *, max_smem=None, cc=None, checked=False, schedule="round-robin"):
    """The emulator on `arch`; `max_smem` below the arch's limit forces a smaller tile, and
    `cc` = (7, 0) makes the planner pick the SIMT kernel (same arch, same arithmetic)."""
    if max_smem is None and cc is None and schedule == "round-robin":
        return kernels.emulator_backend(arch=arch, checked=checked)
    lim = kernels.emulator_limits(arch)
    lim["max_smem"] = max_smem or lim["max_smem"]
    lim["cc"] = cc or lim["cc"]
    return kernels.KernelBackend("emulator", np, emulator.RawModule, device_key=lambda: "cpu",
                                 limits=lambda: dict(lim),
                                 module_options=dict(checked=checked, schedule=schedule, seed=3,
                                                     arch=arch))


def _inputs(B, Hq, Hkv, Nq, Nk, d, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, h, n, d)).astype(F32)
                 for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))


def plain_tf32_attention(q, k, v, *, causal, scale):
    """A plain tf32 implementation: S = tf32(Q)·tf32(K)ᵀ and O = tf32(P)·tf32(V), products
    exact and sums in float64, each of S, P, O stored in fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = (scale * (tf32(q) @ np.swapaxes(tf32(k), -1, -2))).astype(F32).astype(np.float64)
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        s = np.where(np.arange(nk)[None, :] > np.arange(nq)[:, None] + (nk - nq), -np.inf, s)
    m = np.max(s, axis=-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.exp(s - np.where(seen, m, 0.0))
    with np.errstate(invalid="ignore"):   # rows that see no key: 0/0, replaced by 0
        p = np.where(seen, p / np.sum(p, axis=-1, keepdims=True), 0.0).astype(F32)
    return (tf32(p) @ tf32(v)).astype(F32).astype(np.float64)


def _err(o, ref):
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.asarray(o)[~fin], ref[~fin])
    return float(np.max(np.abs(np.asarray(o, np.float64)[fin] - ref[fin])))


def _check(arch, q, k, v, *, causal, split, expect_plan=None, max_smem=None, checked=False,
           schedule="round-robin"):
    """Runs the tf32 kernel and checks it: split ≤ 2x the SIMT float32 kernel's error on the
    same inputs and arch; one-pass ≤ 2x the plain tf32 error + 1e-5 · max(1, |ref|)."""
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d)
    be = _backend(arch, max_smem=max_smem, checked=checked, schedule=schedule)
    lim = be.limits()
    plan, why = tiling.forward_path(d, F32, lim["cc"], kernel_forward.loads_16b_aligned(q, k, v),
                                    max_smem=lim["max_smem"], allow_tf32=not split)
    assert plan.kernel == "flash_fwd_tf32" and plan.split == split, why
    if expect_plan is not None:
        assert plan == expect_plan, why
    o, lse = be.forward(q, k, v, causal=causal, scale=scale, algorithm="fa2", allow_tf32=not split)
    assert o.shape == q.shape and o.dtype == F32 and lse.dtype == F32
    ref, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    err = _err(o, ref)
    big = max(1.0, float(np.max(np.abs(ref[np.isfinite(ref)]))))
    if split:
        simt = _backend(arch, cc=(7, 0))
        assert simt.plan(d, F32).kernel == "flash_fwd"
        o_simt, _ = simt.forward(q, k, v, causal=causal, scale=scale, algorithm="fa2")
        bound = 2 * _err(o_simt, ref)
        lse_tol = 2e-5
    else:
        bound = 2 * _err(plain_tf32_attention(q, k, v, causal=causal, scale=scale), ref) + 1e-5 * big
        lse_tol = 2e-3
    assert err <= bound, f"{why}: max error {err:.3g} > bound {bound:.3g}"
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(lse[~fin], ref_lse[~fin])
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=lse_tol, atol=lse_tol)
    return plan, o, lse, err


# -- every specialization, on an sm_80+ arch each; all four archs ---------------------------
# (split, HEAD_DIM, BLOCK_M, BLOCK_N, arch, max_smem forcing the tile or None)
SPECS = [
    (True, 64, 128, 32, "sm_80", None),
    (True, 128, 128, 16, "sm_86", None),
    (True, 256, 64, 8, "sm_89", None),
    (False, 64, 128, 64, "sm_90", None),
    (False, 128, 128, 32, "sm_80", None),
    (False, 128, 64, 32, "sm_89", None),       # 99 KB: the smaller D=128 tile
    (False, 256, 64, 16, "sm_90", None),
    (False, 256, 64, 8, "sm_86", None),
]


def _spec_id(spec):
    split, D, bm, bn, arch, _ = spec
    return f"{'split' if split else 'one-pass'}-D{D}-{bm}x{bn}-{arch}"


def test_the_matrix_covers_every_specialization_and_arch():
    built = {_tf32_plan(*spec[:4]) for spec in SPECS}
    assert built == set(tiling.all_tf32_plans())
    assert {s[4] for s in SPECS} == {"sm_80", "sm_86", "sm_89", "sm_90"}


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_specialization(spec):
    """Partial query and key tiles, columns d..D-1 zero-filled, causal with Nq < Nk."""
    split, D, bm, bn, arch, smem = spec
    plan = _tf32_plan(split, D, bm, bn)
    q, k, v = _inputs(1, 2, 1, bm + 5, 2 * bn + 3, D - 4, seed=D + bm)
    _check(arch, q, k, v, causal=True, split=split, expect_plan=plan, max_smem=smem)


@pytest.mark.parametrize("arch,split", [("sm_80", True), ("sm_90", False)])
@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,d,causal", [
    (4, 2, 113, 17, 60, True),     # GQA; Nq > Nk: the first 96 rows see no key (O = 0, lse = −inf)
    (2, 2, 1, 150, 4, True),       # decoding: one query, the smallest d
    (4, 1, 33, 47, 64, False),     # MQA, full width
])
def test_features(arch, split, Hq, Hkv, Nq, Nk, d, causal):
    q, k, v = _inputs(1, Hq, Hkv, Nq, Nk, d, seed=Nq * Nk + d)
    plan, o, lse, _ = _check(arch, q, k, v, causal=causal, split=split)
    if Nq > Nk and causal:
        assert np.all(o[..., :Nq - Nk, :] == 0) and np.all(np.isneginf(lse[..., :Nq - Nk]))


@pytest.mark.parametrize("arch,split,D,bm,bn,schedule", [
    ("sm_80", True, 64, 128, 32, "random"),
    ("sm_89", False, 128, 64, 32, "reversed"),   # Q_i re-read from shared memory
])
def test_checked(arch, split, D, bm, bn, schedule):
    """No races, no out-of-bounds access, no read of a pending cp.async; the ring wraps."""
    plan = _tf32_plan(split, D, bm, bn)
    q, k, v = _inputs(1, 1, 1, bm + 9, 3 * bn - 5, D - 12, seed=D)
    _check(arch, q, k, v, causal=True, split=split, expect_plan=plan, checked=True,
           schedule=schedule)


# -- the public API ----------------------------------------------------------------------------

def test_api_split_by_default_one_pass_with_allow_tf32():
    q, k, v = (x[0] for x in _inputs(1, 2, 2, 40, 70, 64, seed=5))    # (H, N, d)
    ref = reference.naive_attention(q, k, v, causal=True, scale=0.125)
    o_split = cuflash.flash_attention(q, k, v, causal=True, backend="emulator")
    o_one = cuflash.flash_attention(q, k, v, causal=True, backend="emulator", allow_tf32=True)
    e_split, e_one = _err(o_split, ref), _err(o_one, ref)
    assert e_split < 2e-6 < 2e-5 < e_one < 1e-2, (e_split, e_one)   # fp32-like vs tf32-like
    # NumPy accepts the keyword and stays exact fp32
    o_np = cuflash.flash_attention(q, k, v, causal=True, backend="numpy", allow_tf32=True)
    assert _err(o_np, ref) < 2e-6


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_allow_tf32_must_be_a_bool(bad):
    q = np.zeros((4, 8), F32)
    with pytest.raises(TypeError, match="allow_tf32"):
        cuflash.flash_attention(q, q, q, allow_tf32=bad)
    with pytest.raises(TypeError, match="allow_tf32"):
        cuflash.flash_attention_backward(q, q, q, q, q, np.zeros(4, F32), allow_tf32=bad)


# -- dispatch ----------------------------------------------------------------------------------

def test_forward_path_for_float32():
    big = 227 * 1024

    def path(d=64, cc=(8, 0), aligned=True, max_smem=big, allow_tf32=False, dtype=F32):
        return tiling.forward_path(d, dtype, cc, aligned, max_smem=max_smem, allow_tf32=allow_tf32)

    for cc in ((8, 0), (8, 6), (8, 9), (9, 0)):
        for d in (4, 60, 64, 68, 128, 132, 256):
            for allow in (False, True):
                plan, why = path(d, cc, allow_tf32=allow)
                assert plan.kernel == "flash_fwd_tf32" and d <= plan.head_dim, why
                assert plan.split is (not allow) and "tensor cores" in why
                assert ("one-pass" if allow else "split") in why
    fallbacks = [
        (path(cc=(7, 5)), "sm_80"),
        (path(cc=(7, 0)), "sm_80"),
        (path(d=62), "multiple of 4"),
        (path(d=260), "> 256"),
        (path(aligned=False), "16-byte aligned"),
        (path(cc=None), "unknown"),
        (path(d=256, max_smem=64 * 1024), "fits"),
        (path(dtype=np.float64), "float64"),
    ]
    for (plan, why), word in fallbacks:
        assert plan.kernel == "flash_fwd" and why.startswith("SIMT") and word in why, why
    # every D has a tile within the 99 KB of sm_86/sm_89, in both modes
    for split in (True, False):
        for D in tiling.TF32_HEAD_DIMS:
            assert min(p.smem_bytes for p in tiling.all_tf32_plans()
                       if p.split == split and p.head_dim == D) <= 99 * 1024
    names = [n for n in tiling.specializations()["flash_fwd_tc.cu"] if "tf32" in n]
    assert sorted(names) == sorted(p.name_expression for p in tiling.all_tf32_plans())


# -- the shared-memory formula, through ptxas --------------------------------------------------

def _have_toolchain():
    try:
        from cupy.cuda import nvrtc
        from cuflash import compile_gate
        nvrtc.getVersion()
        compile_gate.ptxas_path()
        return True
    except Exception:
        return False


SMEM_PROBE = r"""
#include "tf32_tile.cuh"
// The kernel's shared memory is dynamic, so ptxas cannot see it: this probe declares a
// quarter of Tf32TileTraits::kSmemBytes statically (the whole may exceed 48 KB).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, bool SPLIT>
__global__ void smem_probe(unsigned char* out) {
    constexpr int kBytes = cuflash::Tf32TileTraits<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES,
                                                   SPLIT>::kSmemBytes;
    __shared__ unsigned char s[kBytes / 4];
    s[threadIdx.x] = (unsigned char)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[sizeof(s) - 1 - threadIdx.x];
}
"""


@pytest.mark.skipif(not _have_toolchain(), reason="NVRTC or ptxas not installed")
def test_smem_formula_matches_ptxas():
    """tiling.tf32_smem_bytes is what Tf32TileTraits::kSmemBytes declares."""
    from cuflash import compile_gate
    probes = {p.name_expression.replace("flash_fwd_tf32_kernel", "smem_probe", 1): p
              for p in tiling.all_tf32_plans()}
    rows = compile_gate.run_gate({"tf32_smem_probe.cu": list(probes)}, archs=["sm_80"],
                                 sources={"tf32_smem_probe.cu": SMEM_PROBE})
    for r in rows:
        assert r.ok, r.error
        assert 4 * r.smem == probes[r.kernel].smem_bytes, str(probes[r.kernel])
