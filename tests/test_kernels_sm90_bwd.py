"""The Hopper backward's dK/dV pass (kernels/flash_bwd_sm90.cu) in the emulator's sm_90a:
TMA, mbarriers, a producer warpgroup, wgmma with Pᵀ and dSᵀ from registers; dK and dV
against the float64 reference with FlashAttention's rule for gradients, in checked mode
(races, bounds, every asynchronous hazard) and bitwise equal under other block schedules.
And the same kernel on an H100 (`gpu`), for the day one is lent.
"""
import numpy as np
import pytest

from cuflash import _dtypes, reference
from cuflash.backends import kernel_backward_sm90 as sm90_bwd
from cuflash.backends import kernels

from conftest import (HAS_GPU, HAS_GXX, assert_close_to_reference, backward_inputs,
                      plain_backward, to_host)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")
F16, BF16 = np.dtype(np.float16), _dtypes.BFLOAT16


def _backend(checked=False, schedule="round-robin"):
    return kernels.emulator_backend(checked=checked, schedule=schedule, seed=3, arch="sm_90a")


def _check(backend, B, Hq, Hkv, Nq, Nk, D, causal, dtype=F16, seed=0):
    """dK, dV on `backend` within the rule (factor 3 over a plain dtype implementation)."""
    (do, q, k, v, o, lse), scale = backward_inputs(B, Hq, Hkv, Nq, Nk, D, dtype, causal=causal,
                                                   seed=seed)
    Dvec = np.sum(do.astype(np.float32) * o.astype(np.float32), axis=-1)
    xp = backend.xp
    dk, dv = sm90_bwd.dkdv_sm90(backend, *map(xp.asarray, (do, q, k, v, lse, Dvec)),
                                causal=causal, scale=scale)
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    plain = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale, dtype=dtype)
    for name, out, r, p, like in (("dk", dk, ref[1], plain[1], k), ("dv", dv, ref[2], plain[2], v)):
        assert out.shape == like.shape and out.dtype == like.dtype, name
        assert_close_to_reference(out, r, p, dtype, factor=3.0, what=f"{name} (D={D}, causal={causal})")
    return to_host(dk), to_host(dv)


@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,causal", [
    (1, 2, 1, 128, 256, False),    # whole tiles, MQA: the ring runs across the group's heads
    (2, 4, 2, 150, 200, True),     # GQA, partial query and key tiles, the diagonal inside
    (1, 2, 2, 200, 70, True),      # Nq > Nk: the first 130 rows see no key
])
def test_dkdv(dt, D, B, Hq, Hkv, Nq, Nk, causal):
    _check(_backend(), B, Hq, Hkv, Nq, Nk, D, causal, dtype=dt, seed=Nq + D)


def test_the_whole_backward_with_it():
    """kernel_backward.backward(dkdv_sm90=True): dK, dV by the Hopper kernel, dQ by the
    two-kernel backward's dQ kernel; the three within the rule, dK and dV the bits of the
    kernel alone; calls it does not take are refused by name."""
    from conftest import emulator_backend
    from cuflash.backends import kernel_backward
    from cuflash.variants import Variants
    be = emulator_backend("sm_90a")
    (do, q, k, v, o, lse), scale = backward_inputs(2, 4, 2, 150, 200, 64, F16, causal=True, seed=5)
    dq, dk, dv = kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=scale,
                                          dkdv_sm90=True)
    assert [p.kernel for p in be.take_launches()] == [
        "flash_bwd_preprocess", "flash_bwd_dkdv_sm90", "flash_bwd_dq_tc"]
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale)
    plain = plain_backward(do, q, k, v, o, lse, causal=True, scale=scale, dtype=F16)
    for name, out, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, plain):
        assert_close_to_reference(out, r, p, F16, factor=3.0, what=name)
    Dvec = np.sum(do.astype(np.float32) * o.astype(np.float32), axis=-1)
    dk_1, dv_1 = sm90_bwd.dkdv_sm90(be, do, q, k, v, lse, Dvec, causal=True, scale=scale)
    np.testing.assert_array_equal(dv.view(np.uint16), dv_1.view(np.uint16))
    with pytest.raises(ValueError, match="dkdv_sm90: .* no variants"):
        kernel_backward.backward(be, do, q, k, v, o, lse, causal=True, scale=scale,
                                 variants=Variants(softcap=3.0), dkdv_sm90=True)


@pytest.mark.parametrize("D,schedule,dt", [(64, "reversed", F16), (128, "random", BF16)])
def test_checked_and_schedules(D, schedule, dt):
    """No hazard of any kind the emulator checks, and the bits of round-robin."""
    args = (1, 4, 2, 130, 140, D, True)
    dk, dv = _check(_backend(checked=True, schedule=schedule), *args, dtype=dt, seed=D)
    dk_rr, dv_rr = _check(_backend(), *args, dtype=dt, seed=D)
    np.testing.assert_array_equal(dk.view(np.uint16), dk_rr.view(np.uint16))
    np.testing.assert_array_equal(dv.view(np.uint16), dv_rr.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_on_the_gpu(dt, D, causal):
    """The same launch on an H100: the driver's tensor maps, NVRTC for sm_90a."""
    if not HAS_GPU:
        pytest.skip("no CUDA device")
    be = kernels.cuda_backend()
    if not be.limits()["sm90a"]:
        pytest.skip(f"wgmma and TMA need an sm_90 GPU, this is {be.limits()['cc']}")
    _check(be, 2, 8, 2, 700, 900, D, causal, dtype=dt, seed=D)
