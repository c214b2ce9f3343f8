"""The forward and softmax CUDA kernels, run on the CPU through the emulator backend.

Every test calls `emulator_backend()` directly with 4-D (B, H, N, d) inputs and compares
with the float64 NumPy reference (`cuflash.reference`). Tolerances follow FlashAttention's
rule (conftest.assert_close_to_reference): for 16-bit dtypes the kernel's max error may be
at most 2x that of a plain implementation in the same precision, plus a small floor.
A representative subset runs again in checked mode (no races, no out-of-bounds access).
"""
import numpy as np
import pytest
import scipy.special

from cuflash import _dtypes, reference, tiling
from cuflash.backends import kernels

from conftest import DTYPES, HAS_GXX, assert_close_to_reference, plain_attention

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
BF16 = _dtypes.BFLOAT16


def _backend(checked=False):
    return kernels.emulator_backend(checked=checked)


def _inputs(B, Hq, Hkv, Nq, Nk, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, d)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, d)).astype(dtype)
    return q, k, v


def _check_forward(q, k, v, *, causal, algorithm="fa2", checked=False, scale=None):
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    o, lse = _backend(checked).forward(q, k, v, causal=causal, scale=scale, algorithm=algorithm)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == _dtypes.lse_dtype(q.dtype)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale,
                                               return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=q.dtype)
    assert_close_to_reference(o, ref_o, plain, q.dtype, what=f"O ({algorithm})")
    # lse is kept in the accumulation precision: tight for every dtype.
    tol = 1e-10 if q.dtype == F64 else 2e-5
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(lse[~fin], ref_lse[~fin])
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=tol, atol=tol)
    return o, lse


# -- dtypes x causal -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_dtypes(dtype, causal):
    q, k, v = _inputs(1, 2, 1, 113, 203, 64, dtype)
    _check_forward(q, k, v, causal=causal)


# -- odd sizes and head dims -----------------------------------------------------------

@pytest.mark.parametrize("Nq,Nk,d,causal", [
    (1, 1, 1, False),
    (17, 17, 32, True),
    (113, 17, 40, True),      # Nq > Nk: the first rows see no key at all
    (17, 203, 59, True),      # Nq < Nk: KV-cache style decoding
    (203, 113, 96, False),
    (1, 203, 128, True),
    (113, 113, 256, True),
    (17, 113, 300, False),    # beyond the largest bucket: head-dim chunks
])
def test_forward_sizes(Nq, Nk, d, causal):
    q, k, v = _inputs(1, 1, 1, Nq, Nk, d, F32, seed=Nq + Nk + d)
    _check_forward(q, k, v, causal=causal)


@pytest.mark.parametrize("d", [1, 40, 59, 200])  # 200: float64 runs in 128-wide chunks
def test_forward_float64_head_dims(d):
    q, k, v = _inputs(1, 1, 1, 17, 113, d, F64, seed=d)
    _check_forward(q, k, v, causal=True)


# -- GQA / MQA -------------------------------------------------------------------------

@pytest.mark.parametrize("Hkv", [1, 2], ids=["mqa", "gqa"])
@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_forward_gqa(Hkv, algorithm):
    q, k, v = _inputs(2, 4, Hkv, 33, 47, 32, F32, seed=Hkv)
    _check_forward(q, k, v, causal=True, algorithm=algorithm)


# -- masking, NaN and inf --------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
def test_fully_masked_rows(algorithm):
    # Causal with Nq > Nk: query i sees keys j <= i - (Nq - Nk); rows 0..Nq-Nk-1 see none.
    q, k, v = _inputs(1, 1, 1, 80, 17, 64, F32)
    o, lse = _check_forward(q, k, v, causal=True, algorithm=algorithm)
    assert np.all(o[..., :63, :] == 0) and np.all(np.isneginf(lse[..., :63]))
    assert np.isfinite(o).all() and np.isfinite(lse[..., 63:]).all()


@pytest.mark.parametrize("algorithm", ["fa2", "fa1"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=str)
def test_nan_and_inf_rows(algorithm, dtype):
    q, k, v = _inputs(1, 1, 1, 40, 50, 32, dtype)
    k[..., 0] = np.abs(k[..., 0]) + 0.5   # every key positive in column 0
    q[0, 0, 3, 5] = np.nan                 # NaN score row 3 → O row 3 NaN, only it
    q[0, 0, 7, :] = 0
    q[0, 0, 7, 0] = np.inf                 # +inf scores in row 7 → NaN as scipy (inf − inf)
    o, lse = _backend().forward(q, k, v, causal=False, scale=0.25, algorithm=algorithm)
    nan_rows = np.isnan(o[0, 0]).any(axis=-1)
    assert nan_rows[3] and nan_rows[7] and nan_rows.sum() == 2
    assert np.isnan(o[0, 0, 3]).all() and np.isnan(o[0, 0, 7]).all()
    keep = np.ones(40, bool)
    keep[[3, 7]] = False
    ref = reference.naive_attention(q, k, v, scale=0.25)
    assert_close_to_reference(o[0, 0, keep], ref[0, 0, keep],
                              plain_attention(q, k, v, causal=False, scale=0.25, dtype=dtype)[0][0, 0, keep], dtype)
    assert np.isfinite(lse[0, 0, keep]).all()


# -- FA1 == FA2 ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,d", [(F32, 96), (F64, 64), (BF16, 40)], ids=str)
def test_fa1_matches_fa2(dtype, d):
    q, k, v = _inputs(1, 2, 1, 113, 70, d, dtype, seed=d)
    o1, l1 = _check_forward(q, k, v, causal=True, algorithm="fa1")
    o2, l2 = _check_forward(q, k, v, causal=True, algorithm="fa2")
    tol = {8: 1e-12, 4: 1e-6, 2: 1e-2}[np.dtype(dtype).itemsize]
    np.testing.assert_allclose(o1.astype(np.float64), o2.astype(np.float64), atol=tol, rtol=tol)
    np.testing.assert_allclose(l1, l2, atol=max(tol, 1e-6), rtol=max(tol, 1e-6))


# -- strided inputs --------------------------------------------------------------------

def test_strided_inputs():
    rng = np.random.default_rng(5)
    B, H, N, d = 2, 3, 37, 40
    qbig = rng.standard_normal((B, N, H, d)).astype(np.float32)
    q = qbig.transpose(0, 2, 1, 3)                                   # (B, H, N, d) view
    k = rng.standard_normal((B, H, 2 * N, d)).astype(np.float32)[:, :, ::2]  # row stride 2d
    v = rng.standard_normal((B, H, N, 2 * d)).astype(np.float32)[..., ::2]   # last dim strided
    assert not q.flags.c_contiguous and k.strides[-1] == 4 and v.strides[-1] == 8
    for algorithm in ("fa2", "fa1"):
        _check_forward(q, k, v, causal=True, algorithm=algorithm)


# -- online softmax --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 17, 1), (2, 203, 5), (1, 113, 64), (4, 1, 3)], ids=str)
def test_softmax(dtype, shape):
    rng = np.random.default_rng(sum(shape))
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    y = _backend().softmax(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = scipy.special.softmax(x.astype(np.float64), axis=1)
    plain = np.asarray(scipy.special.softmax(x.astype(np.float32), axis=1)).astype(dtype)
    assert_close_to_reference(y, ref, plain.astype(np.float64), dtype, what="softmax")


@pytest.mark.parametrize("Q", [1, 40], ids=["rows-kernel", "cols-kernel"])
def test_softmax_nan_inf(Q):
    x = np.random.default_rng(1).standard_normal((6, 9, Q)).astype(np.float32)
    x[1, 4] = np.nan
    x[2, 0] = np.inf
    x[3, :] = -np.inf                  # all −inf: scipy gives NaN
    x[4, ::2] = -np.inf                # some −inf: those get 0
    x[5, 3] = x[5, 6] = np.inf         # two +inf: NaN
    y = _backend().softmax(x)
    with np.errstate(invalid="ignore"):
        ref = scipy.special.softmax(x.astype(np.float64), axis=1)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    fin = ~np.isnan(ref)
    np.testing.assert_allclose(y[fin], ref[fin], atol=2e-6)


def test_softmax_strided():
    x = np.random.default_rng(2).standard_normal((5, 30, 4)).astype(np.float64)
    xt = x.transpose(2, 1, 0)  # (4, 30, 5), axis 1 still the reduced one
    y = _backend().softmax(xt)
    np.testing.assert_allclose(y, scipy.special.softmax(xt, axis=1), rtol=1e-12, atol=1e-14)


# -- checked mode: no races, no out-of-bounds accesses ---------------------------------

@pytest.mark.parametrize("algorithm,dtype,Nq,Nk,d,Hkv", [
    ("fa2", F32, 33, 47, 40, 1),
    ("fa2", F16, 70, 33, 64, 2),
    ("fa2", F32, 17, 20, 260, 1),     # head-dim chunks
    ("fa1", F32, 70, 47, 32, 1),
    ("fa1", F64, 17, 33, 59, 2),
])
def test_forward_checked(algorithm, dtype, Nq, Nk, d, Hkv):
    q, k, v = _inputs(1, 2, Hkv, Nq, Nk, d, dtype)
    _check_forward(q, k, v, causal=True, algorithm=algorithm, checked=True)


@pytest.mark.parametrize("shape", [(2, 70, 1), (2, 9, 33)], ids=str)
def test_softmax_checked(shape):
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    y = _backend(checked=True).softmax(x)
    np.testing.assert_allclose(y, scipy.special.softmax(x.astype(np.float64), axis=1), atol=2e-6)


# -- every tile plan the library can launch ----------------------------------------------

def _plan_id(plan):
    return f"{plan.kernel}-{plan.dtype}-D{plan.head_dim_bucket}-{plan.block_m}x{plan.block_n}"


@pytest.mark.parametrize("plan", tiling.all_plans(), ids=_plan_id)
def test_every_plan(plan):
    """Each specialization, picked by giving the backend exactly its shared memory, under
    the reversed and a random order of the threads in a block (a missing barrier or a
    lane reading another's unwritten value shows up in one of them)."""
    from cuflash import emulator
    d = max(1, plan.head_dim_bucket - 3)
    alg = "fa1" if plan.kernel == "flash_fwd_fa1" else "fa2"
    q, k, v = _inputs(1, 2, 1, plan.block_m + 5, 2 * plan.block_n + 3, d, np.dtype(plan.dtype))
    scale = 1.0 / np.sqrt(d)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=True, scale=scale, return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=True, scale=scale, dtype=q.dtype)
    for schedule in ("reversed", "random"):
        be = kernels.KernelBackend(
            "emulator", np, emulator.RawModule, device_key=lambda: "cpu",
            limits=lambda: {"max_smem": plan.smem_bytes, "sm_count": 1, "cc": (7, 5)},
            module_options=dict(schedule=schedule, seed=plan.block_m + plan.head_dim_bucket))
        assert be.plan(d, np.dtype(plan.dtype), alg) == plan
        o, lse = be.forward(q, k, v, causal=True, scale=scale, algorithm=alg)
        assert_close_to_reference(o, ref_o, plain, q.dtype, what=f"{_plan_id(plan)} {schedule}")


# -- tile plans and the specialization list --------------------------------------------

def test_plans_fit_and_are_listed():
    specs = tiling.specializations()
    for plan in tiling.all_plans():
        assert plan.name_expression in specs[plan.source]
        assert plan.smem_bytes <= 227 * 1024
    # every dtype/bucket has a plan that fits the smallest opt-in limit (sm_75: 64 KB)
    for dt in _dtypes.SUPPORTED:
        for d in (1, 64, 128, 256, 1000):
            for alg in ("fa2", "fa1"):
                assert tiling.plan_forward(d, dt, max_smem=64 * 1024, algorithm=alg).smem_bytes \
                    <= 64 * 1024
    with pytest.raises(ValueError, match="shared memory"):
        tiling.plan_forward(64, F32, max_smem=16 * 1024)
