"""The float32 tensor-core backward (flash_bwd_tc.cu's flash_bwd_*_tf32_kernel) in the
emulator on sm_80, sm_86, sm_89 and sm_90, against the float64 reference backward:

* split tf32 (the default) against the SIMT float32 backward's own error on the same
  inputs: root-mean-square and maximum error each at most 4x. hi + lo keeps 22 of an fp32
  operand's 24 significant bits (11 each), so a split product errs up to 4x fp32's
  rounding; the forward's 2x holds for most gradients here too (the matrix's median ratio
  is about 1.3), not for all: a decode step's dQ (d = 4) reaches 2.1x in rms, a dK whose
  rows cancel in dS = P ∘ (dP − D) 3.8x at its maximum;
* one-pass tf32 (allow_tf32=True) by FlashAttention's rule applied to tf32: at most 3x the
  error of a plain implementation whose every intermediate is stored in tf32, plus
  1e-5 · max(1, |ref|) (conftest.plain_backward with round_tf32).

Each (split, head dim, shared memory) picks one dK/dV and one dQ specialization; the
matrix runs every specialization on an sm_80+ arch, then reuses those builds for the
features, checked mode and the public keyword.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import emulator, reference, tiling
from cuflash.backends import kernel_forward, kernels

from conftest import HAS_GXX, plain_backward, round_tf32

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F32 = np.dtype(np.float32)
TF32_BWD = set(tiling.TF32_BWD_KERNELS)


def _backend(arch, *, checked=False, schedule="round-robin"):
    if schedule == "round-robin":
        return kernels.emulator_backend(arch=arch, checked=checked)
    lim = kernels.emulator_limits(arch)
    return kernels.KernelBackend("emulator", np, emulator.RawModule, device_key=lambda: "cpu",
                                 limits=lambda: dict(lim),
                                 module_options=dict(checked=checked, schedule=schedule, seed=7,
                                                     arch=arch))


def _problem(B, Hq, Hkv, Nq, Nk, d, causal, seed=0):
    """do, q, k, v, o, lse with o and lse from the float64 forward (rounded to float32)."""
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((B, Hq, Nq, d)).astype(F32) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, Nk, d)).astype(F32) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    o, lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return [do, q, k, v, o.astype(F32), lse.astype(F32)], scale


def _errors(out, ref):
    """(max, rms) of out − ref over the finite reference entries, which must be finite."""
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all() and np.isfinite(ref).all()
    e = out - ref
    return float(np.max(np.abs(e))), float(np.sqrt(np.mean(e * e)))


def _check(arch, args, scale, *, causal, split, expect=None, checked=False,
           schedule="round-robin"):
    """The tf32 backward on `arch`, checked as the module docstring says; returns dq, dk, dv."""
    do, q, k, v, o, lse = args
    be = _backend(arch, checked=checked, schedule=schedule)
    lim = be.limits()
    plans, why = tiling.backward_path(q.shape[-1], F32, lim["cc"],
                                      kernel_forward.loads_16b_aligned(q, k, v, do),
                                      max_smem=lim["max_smem"], allow_tf32=not split)
    assert {p.kernel for p in plans} == TF32_BWD and all(p.split == split for p in plans), why
    if expect is not None:
        assert plans == expect, why
    grads = be.backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                        **({} if split else {"allow_tf32": True}))
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    if split:
        simt = _backend("sm_75")   # no tf32 on sm_75: the SIMT float32 kernels
        assert not {p.kernel for p in tiling.backward_path(
            q.shape[-1], F32, (7, 5), max_smem=lim["max_smem"])[0]} & TF32_BWD
        others = simt.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    else:
        others = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                dtype=round_tf32)
    for name, out, r, other, like in zip(("dq", "dk", "dv"), grads, ref, others, (q, k, v)):
        assert out.shape == like.shape and out.dtype == F32, name
        (err, rms), (o_err, o_rms) = _errors(out, r), _errors(other, r)
        if split:
            assert rms <= 4 * o_rms and err <= 4 * o_err, (
                f"{name} ({why}): rms {rms:.3g}, max {err:.3g}; SIMT float32 rms {o_rms:.3g}, "
                f"max {o_err:.3g}")
        else:
            bound = 3 * o_err + 1e-5 * max(1.0, float(np.max(np.abs(r))))
            assert err <= bound, f"{name} ({why}): max {err:.3g} > {bound:.3g}"
    return grads


def _plans(split, D, arch):
    """The (dK/dV, dQ) plans for bucket D on `arch`: each kernel's first candidate that fits."""
    max_smem = kernels.emulator_limits(arch)["max_smem"]
    return tuple(next(p for p in tiling.all_tf32_bwd_plans()
                      if p.kernel == k and p.split == split and p.head_dim == D
                      and p.smem_bytes <= max_smem)
                 for k in tiling.TF32_BWD_KERNELS)


# -- every specialization, on the archs it targets --------------------------------------------
SPECS = [(True, 64, "sm_80"), (True, 128, "sm_86"), (True, 256, "sm_90"), (True, 256, "sm_89"),
         (False, 64, "sm_89"), (False, 128, "sm_90"), (False, 256, "sm_90"),
         (False, 256, "sm_80"), (False, 256, "sm_86")]


def _spec_id(spec):
    split, D, arch = spec
    return f"{'split' if split else 'one-pass'}-D{D}-{arch}"


def test_the_matrix_covers_every_specialization_and_arch():
    built = {p for split, D, arch in SPECS for p in _plans(split, D, arch)}
    assert built == set(tiling.all_tf32_bwd_plans())
    assert {arch for *_, arch in SPECS} == {"sm_80", "sm_86", "sm_89", "sm_90"}


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

def test_api_backward_split_by_default_one_pass_with_allow_tf32():
    (do, q, k, v, o, lse), scale = _problem(1, 2, 2, 40, 70, 64, True, seed=5)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale)
    errs = {}
    for allow in (False, True):
        grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=True,
                                                 backend="emulator", allow_tf32=allow)
        errs[allow] = max(_errors(g, r)[0] for g, r in zip(grads, ref))
    assert errs[False] < 1e-5 < 1e-4 < errs[True] < 1e-2, errs   # fp32-like vs tf32-like
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=True, backend="numpy",
                                             allow_tf32=True)   # accepted, exact fp32
    assert max(_errors(g, r)[0] for g, r in zip(grads, ref)) < 1e-5


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
                assert [p.kernel for p in plans] == list(tiling.TF32_BWD_KERNELS), why
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
