"""The SIMT backward kernels (cuflash/kernels/flash_bwd.cu), run on the CPU emulator
(and on "cuda" when a device is present) against the float64 reference backward.

The emulated GPU's planner sees compute capability 7.0 (no tensor cores), so every dtype
and head dim takes these kernels, and each test asserts the three that launched:
preprocess, dK/dV, dQ. Inputs o and lse come from the float64 reference forward (rounded
to the dtype), so the errors measured are the backward's own. Tolerances follow
FlashAttention's rule (conftest.error_bound): for 16-bit dtypes, max error <= 3 x that of
a plain implementation in the same precision, + a small floor.
"""
import numpy as np
import pytest

from cuflash import _dtypes, reference, tiling
from cuflash.backends import kernel_backward

from conftest import (HAS_GPU, HAS_GXX, assert_close_to_reference, backward_inputs,
                      emulator_backend, plain_backward, to_host)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

BF16 = _dtypes.BFLOAT16
SIMT_BWD = ["flash_bwd_preprocess", "flash_bwd_dkdv", "flash_bwd_dq"]


def _simt(**options):
    """The emulator (sm_80, its builds) with a planner that sees compute capability 7.0:
    no tensor cores, so flash_bwd.cu's kernels for every dtype and head dim."""
    return emulator_backend("sm_80", cc=(7, 0), **options)


def make_problem(B, Hq, Hkv, Nq, Nk, d, dtype, causal, seed=0):
    """([do, q, k, v, o, lse], scale): conftest.backward_inputs."""
    return backward_inputs(B, Hq, Hkv, Nq, Nk, d, np.dtype(dtype), causal=causal, seed=seed)


def run_and_check(backend, prob, causal, *, views=None, plan=None):
    """dq, dk, dv from flash_bwd.cu's three kernels, the only ones launched (the dK/dV one
    of `plan` when given), each within the rule for gradients."""
    args, scale = prob
    dtype = args[1].dtype
    dq, dk, dv = kernel_backward.backward(backend, *(views(args) if views else args),
                                          causal=causal, scale=scale)
    launched = backend.take_launches()
    assert [p.kernel for p in launched] == SIMT_BWD
    assert plan in (None, launched[1]), launched
    ref = reference.attention_backward(*args, causal=causal, scale=scale)
    plain = (None, None, None)
    if dtype.itemsize == 2:
        plain = plain_backward(*args, causal=causal, scale=scale, dtype=dtype)
    for name, out, r, p, like in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, plain, args[1:4]):
        assert out.dtype == like.dtype and out.shape == like.shape, name
        assert not np.isnan(to_host(out).astype(np.float64)).any(), f"NaN in {name}"
        assert_close_to_reference(out, r, p, dtype, factor=3.0, what=name)
    return dq, dk, dv


# ── correctness over dtypes, shapes, flags ───────────────────────────────────────────

DTYPES = [pytest.param(np.dtype(d), id=str(np.dtype(d))) for d in _dtypes.SUPPORTED]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(dtype, causal):
    prob = make_problem(1, 2, 2, 37, 45, 32, dtype, causal, seed=1)
    run_and_check(_simt(), prob, causal)


@pytest.mark.parametrize("Nq,Nk", [(1, 1), (1, 17), (17, 1), (113, 113), (113, 17), (17, 113)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_odd_sizes(Nq, Nk, causal):
    prob = make_problem(2, 1, 1, Nq, Nk, 59, np.float32, causal, seed=Nq * 1000 + Nk)
    run_and_check(_simt(), prob, causal)


@pytest.mark.parametrize("d,dtype", [(1, np.float32), (32, np.float16), (59, np.float64),
                                     (64, np.float32), (128, BF16 or np.float16),
                                     (256, np.float32), (200, np.float16)])
def test_head_dims(d, dtype):
    prob = make_problem(1, 2, 1, 33, 29, d, dtype, True, seed=d)
    run_and_check(_simt(), prob, True)


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 1), (6, 3)], ids=["gqa", "mqa", "gqa3"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_mqa(Hq, Hkv, causal):
    prob = make_problem(2, Hq, Hkv, 23, 31, 16, np.float32, causal, seed=Hq + Hkv)
    run_and_check(_simt(), prob, causal)


@pytest.mark.parametrize("dtype", [pytest.param(np.dtype(np.float32), id="float32"),
                                   pytest.param(np.dtype(np.float16), id="float16")])
def test_fully_masked_rows(dtype):
    # Causal with Nq > Nk: query i sees no key while i + (Nk - Nq) < 0 → lse = -inf.
    prob = make_problem(1, 2, 1, 50, 20, 24, dtype, True, seed=7)
    dead = np.isneginf(prob[0][5])
    assert dead.any()
    dq, dk, dv = run_and_check(_simt(), prob, True)
    assert np.all(to_host(dq)[dead] == 0)


def test_strided_inputs():
    # (B, N, H, d) storage seen as (B, H, N, d), and a last axis that is not contiguous.
    prob = make_problem(2, 3, 3, 19, 26, 20, np.float32, False, seed=3)

    def views(args):
        out = []
        for a in args[:5]:
            t = np.ascontiguousarray(np.swapaxes(a, 1, 2))         # (B, N, H, d) memory
            out.append(np.swapaxes(t, 1, 2))                        # strided (B, H, N, d)
        wide = np.zeros(out[1].shape[:-1] + (2 * out[1].shape[-1],), out[1].dtype)
        wide[..., ::2] = out[1]
        out[1] = wide[..., ::2]                                     # q: last-dim stride 2
        return out + [args[5]]

    run_and_check(_simt(), prob, False, views=views)


@pytest.mark.parametrize("d", [48, 300])
def test_deterministic_under_any_thread_order(d):
    """No atomics, one writer per output element in a fixed order: every schedule of
    the threads in a block (the emulator's reversed and random orders, several seeds)
    gives the same bits as the round-robin one."""
    args, scale = make_problem(1, 4, 2, 70, 90, d, np.float32, True, seed=11)
    first = run_and_check(_simt(), (args, scale), True)
    for schedule, seed in (("reversed", 0), ("random", 1), ("random", 2), ("random", 3)):
        be = _simt(schedule=schedule, seed=seed)
        again = kernel_backward.backward(be, *args, causal=True, scale=scale)
        assert [p.kernel for p in be.take_launches()] == SIMT_BWD
        for name, x, y in zip(("dq", "dk", "dv"), first, again):
            assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), (name, schedule, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_deterministic_on_gpu():
    """Where blocks really run concurrently: two runs give the same bits."""
    import cupy
    from cuflash.backends.kernels import cuda_backend
    args, scale = make_problem(2, 8, 2, 1000, 1200, 64, np.float32, True, seed=12)
    args = [cupy.asarray(a) for a in args]
    runs = [kernel_backward.backward(cuda_backend(), *args, causal=True, scale=scale)
            for _ in range(2)]
    for name, x, y in zip(("dq", "dk", "dv"), *runs):
        assert bool((x.view(cupy.uint32) == y.view(cupy.uint32)).all()), name


def _bwd_plan_id(p):
    return f"{p.dtype}-D{p.head_dim_bucket}{'-chunked' if p.chunked else ''}"


@pytest.mark.parametrize("plan", [p for p in tiling.all_simt_bwd_plans()
                                  if p.kernel == "flash_bwd_dkdv"], ids=_bwd_plan_id)
def test_every_plan_under_other_thread_orders(plan):
    """Every backward specialization (its dK/dV and dQ pair, and the preprocess) against
    the reference under the reversed and a random thread order."""
    d = plan.head_dim_bucket + 3 if plan.chunked else plan.head_dim_bucket - 3
    dtype = np.dtype(plan.dtype)
    prob = make_problem(1, 2, 1, plan.block_rows + 5, plan.tile_rows + 7, d, dtype, True,
                        seed=d)
    for schedule in ("reversed", "random"):
        run_and_check(_simt(schedule=schedule, seed=d), prob, True, plan=plan)


# ── head dims above the largest bucket: the chunked kernels ──────────────────────────

LOWP = BF16 or np.float16


def _large(d, dtype, causal):
    return pytest.param(d, np.dtype(dtype), causal,
                        id=f"d{d}-{np.dtype(dtype)}-{'causal' if causal else 'full'}")


@pytest.mark.parametrize("d,dtype,causal", [
    _large(300, np.float32, False), _large(300, np.float32, True),
    _large(300, np.float64, True), _large(300, LOWP, False),
    _large(520, np.float32, True), _large(520, np.float64, False),
    _large(520, np.float16, True),
])
def test_large_head_dims(d, dtype, causal):
    # GQA (2 query heads per K/V head), partial tiles on both axes, Nq < Nk.
    assert tiling.bwd_head_dim_chunks(d) > 1
    prob = make_problem(2, 4, 2, 21, 26, d, dtype, causal, seed=d + causal)
    run_and_check(_simt(), prob, causal)


def test_large_head_dim_fully_masked_rows():
    prob = make_problem(1, 2, 1, 30, 12, 300, np.float32, True, seed=13)
    dead = np.isneginf(prob[0][5])
    assert dead.any()
    dq, _, _ = run_and_check(_simt(), prob, True)
    assert np.all(to_host(dq)[dead] == 0)


# ── checked mode: zero races, zero out-of-bounds ─────────────────────────────────────

@pytest.mark.parametrize("case", [
    dict(B=1, Hq=2, Hkv=1, Nq=17, Nk=23, d=59, dtype=np.float16, causal=True),
    dict(B=1, Hq=1, Hkv=1, Nq=40, Nk=9, d=32, dtype=np.float64, causal=True),
    dict(B=2, Hq=2, Hkv=2, Nq=9, Nk=70, d=100, dtype=np.float32, causal=False),
    dict(B=1, Hq=2, Hkv=1, Nq=19, Nk=13, d=300, dtype=np.float32, causal=True),
], ids=["f16-gqa-causal", "f64-masked-rows", "f32-d100", "f32-d300-gqa-chunked"])
def test_checked_mode(case):
    case = dict(case)
    dtype, causal = case.pop("dtype"), case.pop("causal")
    prob = make_problem(*case.values(), dtype, causal, seed=5)
    run_and_check(_simt(checked=True), prob, causal)


# ── the launch plan ──────────────────────────────────────────────────────────────────

def test_plan_backward_routes_large_head_dims_to_chunks():
    for d, chunks in ((1, 1), (256, 1), (257, 2), (300, 2), (512, 2), (520, 3)):
        assert tiling.bwd_head_dim_chunks(d) == chunks
        dkdv, dq = tiling.simt_backward_plans(d, np.float32)
        assert dkdv.chunked == dq.chunked == (chunks > 1)
        assert dkdv.kernel.startswith("flash_bwd_dkdv") and dq.kernel.startswith("flash_bwd_dq")
    with pytest.raises(ValueError, match="d=0"):
        tiling.simt_backward_plans(0, np.float32)


def test_specializations_are_finite_and_fit():
    names = tiling.specializations()["flash_bwd.cu"]
    assert len(names) == len(set(names))
    plans = tiling.all_simt_bwd_plans()
    assert {p.name_expression for p in plans} <= set(names)
    for dtype in _dtypes.SUPPORTED:
        assert tiling.bwd_preprocess_plan(dtype) in plans
        for d in (*tiling.BWD_HEAD_DIM_BUCKETS, 300):
            for p in tiling.simt_backward_plans(d, dtype):
                assert p in plans and p.smem_bytes <= 48 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda(dtype, causal):
    import cupy
    from cuflash.backends.kernels import cuda_backend
    be = cuda_backend()
    args, scale = make_problem(2, 4, 2, 129, 200, 64, dtype, causal, seed=2)
    out = kernel_backward.backward(be, *map(cupy.asarray, args), causal=causal, scale=scale)
    ref = reference.attention_backward(*args, causal=causal, scale=scale)
    plain = (None,) * 3
    if dtype.itemsize == 2:
        plain = plain_backward(*args, causal=causal, scale=scale, dtype=dtype)
    for name, o, r, p in zip(("dq", "dk", "dv"), out, ref, plain):
        assert_close_to_reference(to_host(o), r, p, dtype, factor=3.0, what=name)


@pytest.mark.parametrize("d", [40, 300])
def test_public_api_end_to_end(d, monkeypatch):
    """flash_attention → flash_attention_backward on the emulator of a V100 (sm_70, no
    tensor cores): the bucketed and the head-dim-chunked kernels, the SIMT ones launched."""
    import cuflash
    from cuflash.backends import kernels
    launched = []
    get_function = kernels.KernelBackend.get_function
    monkeypatch.setattr(kernels.KernelBackend, "get_function",
                        lambda be, plan, mods=None: launched.append(plan.kernel)
                        or get_function(be, plan, mods))
    monkeypatch.setenv("CUFLASH_EMULATOR_ARCH", "sm_70")
    (do, q, k, v, _, _), _ = make_problem(1, 4, 2, 30, 41, d, np.float32, True, seed=9)
    o, lse = cuflash.flash_attention(q, k, v, causal=True, return_lse=True, backend="emulator")
    dq, dk, dv = cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=True,
                                                  backend="emulator")
    assert launched == ["flash_fwd", *SIMT_BWD]
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=True)
    for name, out, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert_close_to_reference(out, r, None, np.float32, what=name)
