"""The float32 tensor-core backward (flash_bwd_tc.cu's flash_bwd_*_tc_kernel<float>) in the
emulator on sm_80, sm_86, sm_89 and sm_90, against the float64 reference backward, each
run asserting the kernels that launched; the rule is conftest.error_bound's:

* split tf32 (the default): hi + lo keeps 22 of an fp32 operand's 24 significant bits,
  about fp32 accuracy, so the float32 rule (a fixed bound relative to max(1, |ref|));
* one-pass tf32 (allow_tf32=True): FlashAttention's rule for gradients applied to tf32, at
  most 3x the error of a plain implementation whose every intermediate is stored in tf32,
  plus 1e-5 · max(1, |ref|) (conftest.plain_backward with round_tf32).

Each (split, head dim, shared memory) picks one dK/dV and one dQ specialization; the
matrix runs every specialization on an sm_80+ arch, then reuses those builds for the
features, checked mode and the public keyword.
"""
import numpy as np
import pytest

import cuflash
from cuflash import reference, tiling
from cuflash.backends import kernels

from conftest import (HAS_GXX, assert_close_to_reference, backward_inputs, emulator_backend,
                      error_bound, plain_backward, round_tf32)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F32 = np.dtype(np.float32)
TF32_BWD = set(tiling.TC_BWD_KERNELS)


def _backend(arch, *, checked=False, schedule="round-robin"):
    return emulator_backend(arch, checked=checked, schedule=schedule, seed=7)


def _problem(B, Hq, Hkv, Nq, Nk, d, causal, seed=0):
    """[do, q, k, v, o, lse], scale (conftest.backward_inputs, float32)."""
    return backward_inputs(B, Hq, Hkv, Nq, Nk, d, F32, causal=causal, seed=seed)


def _check(arch, args, scale, *, causal, split, expect=None, checked=False,
           schedule="round-robin"):
    """The tf32 backward on `arch` (its two kernels launched after the preprocess: the
    plans `expect` when given), checked as the module docstring says; returns dq, dk, dv."""
    do, q, k, v, o, lse = args
    be = _backend(arch, checked=checked, schedule=schedule)
    grads = be.backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                        **({} if split else {"allow_tf32": True}))
    pre, *plans = be.take_launches()
    assert pre.kernel == "flash_bwd_preprocess", pre
    assert {p.kernel for p in plans} == TF32_BWD and all(p.split == split for p in plans), plans
    if expect is not None:
        assert tuple(plans) == expect, plans
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    plain = (None,) * 3 if split else plain_backward(do, q, k, v, o, lse, causal=causal,
                                                     scale=scale, dtype=round_tf32)
    for name, out, r, p, like in zip(("dq", "dk", "dv"), grads, ref, plain, (q, k, v)):
        assert out.shape == like.shape and out.dtype == F32, name
        assert np.isfinite(out).all(), name
        assert_close_to_reference(out, r, p, F32 if split else round_tf32, factor=3.0,
                                  what=f"{name} ({plans[0]})")
    return grads


def _plans(split, D, arch):
    """The (dK/dV, dQ) plans for bucket D on `arch`: each kernel's first candidate that fits."""
    limits = kernels.emulator_limits(arch)
    max_smem = limits["max_smem"]
    return tuple(next(p for p in tiling.all_tf32_bwd_plans(limits["cc"])
                      if p.kernel == k and p.split == split and p.head_dim == D
                      and p.smem_bytes <= max_smem)
                 for k in tiling.TC_BWD_KERNELS)


# -- every specialization, on the archs it targets --------------------------------------------
SPECS = [(True, 64, "sm_80"), (True, 128, "sm_86"), (True, 256, "sm_90"), (True, 256, "sm_89"),
         (False, 64, "sm_89"), (False, 128, "sm_90"), (False, 256, "sm_90"),
         (False, 256, "sm_80"), (False, 256, "sm_86"),
         (True, 64, "sm_120"), (True, 128, "sm_120"), (True, 256, "sm_120"),   # sm_120's tiles
         (True, 128, "sm_100"), (True, 256, "sm_100")]                         # sm_100's


def _spec_id(spec):
    split, D, arch = spec
    return f"{'split' if split else 'one-pass'}-D{D}-{arch}"


def test_the_matrix_covers_every_specialization_and_arch():
    built = {p for split, D, arch in SPECS for p in _plans(split, D, arch)}
    assert built == set(tiling.all_tf32_bwd_plans())
    assert {arch for *_, arch in SPECS} == {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100",
                                            "sm_120"}


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_specialization(spec):
    """Causal with Nq < Nk, partial key and query tiles, GQA, head-dim columns d..D-1 padded
    (d a multiple of 4, not of 8); then the full head dim without the mask."""
    split, D, arch = spec
    expect = _plans(split, D, arch)
    args, scale = _problem(1, 2, 1, 37, 75, D - 4, True, seed=D)
    _check(arch, args, scale, causal=True, split=split, expect=expect)
    args, scale = _problem(1, 1, 1, 70, 17, D, False, seed=D + 1)
    _check(arch, args, scale, causal=False, split=split, expect=expect)


@pytest.mark.parametrize("arch,split", [("sm_80", True), ("sm_90", False)])
@pytest.mark.parametrize("Hq,Hkv,Nq,Nk,d,causal", [
    (4, 1, 33, 47, 64, False),     # MQA: each dK/dV block sums over 4 query heads
    (6, 2, 113, 17, 60, True),     # GQA; Nq > Nk: the first 96 rows see no key (lse = −inf)
    (2, 2, 1, 150, 4, True),       # decoding: one query, the smallest d
    (1, 1, 40, 90, 200, True),     # 128 < d <= 256: head-dim chunks of dK, dV and dQ
])
def test_features(arch, split, Hq, Hkv, Nq, Nk, d, causal):
    args, scale = _problem(2, Hq, Hkv, Nq, Nk, d, causal, seed=Nq * Nk + d)
    dq, dk, dv = _check(arch, args, scale, causal=causal, split=split)
    if causal and Nq > Nk:  # rows that see no key: zero dQ (and nothing added to dK, dV)
        assert np.all(dq[..., :Nq - Nk, :] == 0)


# -- checked mode: no races, no out-of-bounds access, no read of a pending cp.async ----------

@pytest.mark.parametrize("arch,split,D,schedule", [
    ("sm_80", True, 64, "random"),
    ("sm_86", False, 256, "reversed"),   # one-warp dK/dV blocks, head-dim chunks
])
def test_checked(arch, split, D, schedule):
    """GQA (the dK/dV ring runs across two query heads), Nq > Nk, causal: skipped, partial
    and fully masked tiles; the rings wrap. Bitwise equal to the round-robin schedule."""
    args, scale = _problem(1, 2, 1, 50, 37, D - 12, True, seed=D)
    grads = _check(arch, args, scale, causal=True, split=split, expect=_plans(split, D, arch),
                   checked=True, schedule=schedule)
    again = _backend(arch).backward(*args, causal=True, scale=scale,
                                    **({} if split else {"allow_tf32": True}))
    for name, x, y in zip(("dq", "dk", "dv"), grads, again):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), name


# -- the public API ----------------------------------------------------------------------------

def test_api_backward_split_by_default_one_pass_with_allow_tf32(monkeypatch):
    """flash_attention_backward on the emulator (sm_80) launches split tf32 by default,
    within the float32 rule, and one-pass tf32 with allow_tf32=True, within the tf32 rule
    and beyond the float32 one; NumPy accepts the keyword and stays float32."""
    launched = []
    get_function = kernels.KernelBackend.get_function
    monkeypatch.setattr(kernels.KernelBackend, "get_function",
                        lambda be, plan, mods=None: launched.append(plan)
                        or get_function(be, plan, mods))
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", "sm_80")
    (do, q, k, v, o, lse), scale = _problem(1, 2, 2, 40, 70, 64, True, seed=5)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale)
    plain = plain_backward(do, q, k, v, o, lse, causal=True, scale=scale, dtype=round_tf32)
    tf32_like = False
    for allow in (False, True):
        grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=True,
                                                 backend="emulator", allow_tf32=allow)
        assert [p.split for p in launched[1:]] == [not allow] * 2, launched
        assert {p.kernel for p in launched[1:]} == TF32_BWD, launched
        launched.clear()
        for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
            assert_close_to_reference(g, r, p, round_tf32 if allow else F32, factor=3.0,
                                      what=f"{name} (allow_tf32={allow})")
            tf32_like |= allow and np.max(np.abs(g - r)) > error_bound(r, None, F32)
    assert tf32_like
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=True, backend="numpy",
                                             allow_tf32=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert_close_to_reference(g, r, None, F32, what=f"{name} (numpy)")


# -- dispatch ---------------------------------------------------------------------------------

def test_backward_path_for_float32():
    big = 227 * 1024

    def path(d=64, cc=(8, 0), aligned=True, max_smem=big, allow_tf32=False):
        return tiling.backward_path(d, F32, cc, aligned, max_smem=max_smem,
                                    allow_tf32=allow_tf32)

    for cc in ((8, 0), (8, 6), (9, 0)):
        for d in (4, 64, 100, 128, 132, 200, 256):
            for allow in (False, True):
                plans, why = path(d, cc, allow_tf32=allow)
                assert [p.kernel for p in plans] == list(tiling.TC_BWD_KERNELS), why
                assert all(p.split != allow and d <= p.head_dim for p in plans), why
                assert "tf32" in why and ("one-pass" in why) == allow, why
                assert ("head-dim chunks of 128" in why) == (d > 128), why
    fallbacks = [
        (path(cc=(7, 5)), "sm_80"),
        (path(d=62), "multiple of 4"),
        (path(d=260), "> 256"),
        (path(aligned=False), "16-byte aligned"),
        (path(d=256, max_smem=64 * 1024), "fits"),
    ]
    for (plans, why), word in fallbacks:
        assert not {p.kernel for p in plans} & TF32_BWD and why.startswith("SIMT") and word in why, why
    # the emulated sm_80+ archs take it by default, up to d = 256
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):
        lim = kernels.emulator_limits(arch)
        for d in (64, 256):
            plans = path(d, lim["cc"], max_smem=lim["max_smem"])[0]
            assert {p.kernel for p in plans} == TF32_BWD, (arch, d)


def test_tf32_bwd_plans_fit_and_are_listed():
    """Every plan is compiled by the gate; each (kernel, split, D) has a tile within 99 KB
    (sm_86, sm_89); the chunks start on whole swizzle periods (128 bytes)."""
    specs = tiling.specializations()["flash_bwd_tc.cu"]
    a10 = kernels.emulator_limits("sm_86")["max_smem"]
    smallest = {}
    for plan in tiling.all_tf32_bwd_plans():
        assert plan.name_expression in specs and plan.dtype == "float32"
        assert plan.block_rows == 16 * plan.num_warps and plan.stages >= 2
        assert plan.tile_rows % 8 == 0 and (plan.chunk_cols * 4) % 128 == 0
        key = (plan.kernel, plan.split, plan.head_dim)
        smallest[key] = min(smallest.get(key, plan.smem_bytes), plan.smem_bytes)
    assert {D for *_, D in smallest} == set(tiling.TF32_HEAD_DIMS)
    assert all(b <= a10 for b in smallest.values()), smallest
