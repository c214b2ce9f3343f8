"""The float32 tensor-core forward (flash_fwd_tc.cu's flash_fwd_tc_kernel<float>) in the
emulator on sm_80, sm_86, sm_89 and sm_90, each run asserting the plan that launched:
split tf32 by the float32 rule, one-pass tf32 by FlashAttention's rule over a plain tf32
implementation (conftest.error_bound); its dispatch; the public keyword. (Its
shared-memory formula: test_kernels_forward.py's test_smem_formula_matches_ptxas.)

Each specialization is built once per arch it runs on; the matrix builds each on one sm_80+
arch and reuses those builds for the features.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference, tiling
from cuflash.backends import kernels

from conftest import (HAS_GXX, assert_close_to_reference, assert_lse_close, attention_inputs,
                      emulator_backend, error_bound, plain_lse, plain_tf32_attention,
                      round_tf32)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F32 = np.dtype(np.float32)


def _tf32_plan(split, head_dim, block_m, block_n):
    return next(p for p in tiling.all_tf32_plans() if p.split == split and p.head_dim == head_dim
                and p.block_m == block_m and p.block_n == block_n)


def _inputs(B, Hq, Hkv, Nq, Nk, d, seed=0):
    return attention_inputs(B, Hq, Hkv, Nq, Nk, d, F32, seed=seed)[:3]


def _check(arch, q, k, v, *, causal, split, expect_plan=None, max_smem=None, checked=False,
           schedule="round-robin"):
    """Runs the tf32 kernel (the one launched: `expect_plan` when given) and checks it by
    the rule of conftest.error_bound: split, about fp32-accurate, by the float32 rule;
    one-pass by FlashAttention's rule over the plain one-pass tf32 implementation
    (conftest.plain_tf32_attention), its lse over that implementation's."""
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d)
    be = emulator_backend(arch, max_smem=max_smem, checked=checked, schedule=schedule, seed=3)
    o, lse = be.forward(q, k, v, causal=causal, scale=scale, algorithm="fa2", allow_tf32=not split)
    (plan,) = be.take_launches()
    assert plan.kernel == "flash_fwd_tc" and plan.split == split, plan
    if expect_plan is not None:
        assert plan == expect_plan, plan
    assert o.shape == q.shape and o.dtype == F32
    ref, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    if split:
        assert_close_to_reference(o, ref, None, F32, what=f"O ({plan})")
        assert_lse_close(lse, ref_lse, F32)
    else:
        plain = plain_tf32_attention(q, k, v, causal=causal, scale=scale)
        assert_close_to_reference(o, ref, plain, round_tf32, what=f"O ({plan})")
        assert_lse_close(lse, ref_lse, F32, precision=round_tf32,
                         plain=plain_lse(round_tf32(q), round_tf32(k), causal=causal,
                                         scale=scale, dtype=F32))
    return plan, o, lse


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
    (True, 64, 128, 16, "sm_120", None),       # sm_120's own split tiles (plans.tc_fwd)
    (True, 128, 128, 8, "sm_120", None),
]


def _spec_id(spec):
    split, D, bm, bn, arch, _ = spec
    return f"{'split' if split else 'one-pass'}-D{D}-{bm}x{bn}-{arch}"


def test_the_matrix_covers_every_specialization_and_arch():
    built = {_tf32_plan(*spec[:4]) for spec in SPECS}
    assert built == set(tiling.all_tf32_plans())
    assert {s[4] for s in SPECS} == {"sm_80", "sm_86", "sm_89", "sm_90", "sm_120"}


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
    plan, o, lse = _check(arch, q, k, v, causal=causal, split=split)
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

def test_api_split_by_default_one_pass_with_allow_tf32(monkeypatch):
    """flash_attention on the emulator (sm_80) launches split tf32 by default, within the
    float32 rule, and one-pass tf32 with allow_tf32=True, within the tf32 rule and beyond
    the float32 one; NumPy accepts the keyword and stays float32."""
    launched = []
    get_function = kernels.KernelBackend.get_function
    monkeypatch.setattr(kernels.KernelBackend, "get_function",
                        lambda be, plan, mods=None: launched.append(plan)
                        or get_function(be, plan, mods))
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", "sm_80")
    q, k, v = (x[0] for x in _inputs(1, 2, 2, 40, 70, 64, seed=5))    # (H, N, d)
    ref = reference.naive_attention(q, k, v, causal=True, scale=0.125)
    o_split = cuflash.flash_attention(q, k, v, causal=True, backend="emulator")
    assert_close_to_reference(o_split, ref, None, F32, what="O (split)")
    o_one = cuflash.flash_attention(q, k, v, causal=True, backend="emulator", allow_tf32=True)
    plain = plain_tf32_attention(q, k, v, causal=True, scale=0.125)
    assert_close_to_reference(o_one, ref, plain, round_tf32, what="O (one-pass)")
    assert np.max(np.abs(o_one - ref)) > error_bound(ref, None, F32)   # tf32-like
    assert [(p.kernel, p.split) for p in launched] == [("flash_fwd_tc", True),
                                                       ("flash_fwd_tc", False)]
    o_np = cuflash.flash_attention(q, k, v, causal=True, backend="numpy", allow_tf32=True)
    assert_close_to_reference(o_np, ref, None, F32, what="O (numpy)")


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
                assert plan.kernel == "flash_fwd_tc" and d <= plan.head_dim, why
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
    names = [n for n in tiling.specializations()["flash_fwd_tc.cu"] if "<float," in n]
    assert sorted(names) == sorted(p.name_expression for p in tiling.all_tf32_plans())
