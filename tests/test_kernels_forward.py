"""The SIMT forward kernels (flash_fwd.cu, flash_fwd_fa1.cu) and the softmax kernels
(online_softmax.cu), run on the CPU through the emulator backend.

The forward runs on an emulated GPU whose planner sees compute capability 7.0 (no tensor
cores), so every dtype takes the SIMT kernels, and each test asserts the kernel that
launched. Inputs are 4-D (B, H, N, d), compared with the float64 NumPy reference
(`cuflash.reference`) by FlashAttention's rule (conftest.assert_close_to_reference): for
16-bit dtypes the kernel's max error may be at most 2x that of a plain implementation in
the same precision, plus a small floor. A representative subset runs again in checked mode
(no races, no out-of-bounds access). Last, every kernel family's shared-memory formula
against ptxas.
"""
import numpy as np
import pytest
import scipy.special

from cuflash import _dtypes, reference, tiling

from conftest import (DTYPES, HAS_GXX, assert_close_to_reference, assert_lse_close,
                      attention_inputs, emulator_backend, error_bound, have_toolchain,
                      plain_attention)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
BF16 = _dtypes.BFLOAT16


KERNEL = {"fa2": "flash_fwd", "fa1": "flash_fwd_fa1"}


def _simt(**options):
    """The emulator (sm_80, its builds) with a planner that sees compute capability 7.0:
    no tensor cores, so the SIMT kernels for every dtype and head dim."""
    return emulator_backend("sm_80", cc=(7, 0), **options)


def _inputs(B, Hq, Hkv, Nq, Nk, d, dtype, seed=0):
    return attention_inputs(B, Hq, Hkv, Nq, Nk, d, dtype, seed=seed)[:3]


def _forward(q, k, v, *, algorithm="fa2", checked=False, **kw):
    """o, lse of the SIMT kernel of `algorithm`, the only kernel launched."""
    be = _simt(checked=checked)
    o, lse = be.forward(q, k, v, algorithm=algorithm, **kw)
    assert [p.kernel for p in be.take_launches()] == [KERNEL[algorithm]]
    return o, lse


def _check_forward(q, k, v, *, causal, algorithm="fa2", checked=False, scale=None):
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    o, lse = _forward(q, k, v, causal=causal, scale=scale, algorithm=algorithm, checked=checked)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == q.shape[:-1]
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale,
                                               return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=q.dtype)
    assert_close_to_reference(o, ref_o, plain, q.dtype, what=f"O ({algorithm})")
    assert_lse_close(lse, ref_lse, q.dtype)
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
    o, lse = _forward(q, k, v, causal=False, scale=0.25, algorithm=algorithm)
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
    """Both loop orders within the rule of the reference, and of each other: their
    difference within the bound each one's error is held to."""
    q, k, v = _inputs(1, 2, 1, 113, 70, d, dtype, seed=d)
    o1, l1 = _check_forward(q, k, v, causal=True, algorithm="fa1")
    o2, l2 = _check_forward(q, k, v, causal=True, algorithm="fa2")
    scale = 1.0 / np.sqrt(d)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=True, scale=scale,
                                               return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=True, scale=scale, dtype=dtype)
    diff = np.abs(o1.astype(np.float64) - o2.astype(np.float64))
    assert np.max(diff) <= error_bound(ref_o, plain, dtype), np.max(diff)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(l1[~fin], l2[~fin])
    assert np.max(np.abs(l1[fin] - l2[fin])) <= error_bound(ref_lse, None, l1.dtype)


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

def _softmax(x, *, kernel=None, checked=False):
    """softmax over axis 1 of (P, n, Q) x: one launch of a softmax kernel (`kernel` when
    given)."""
    be = emulator_backend("sm_80", checked=checked)
    y = be.softmax(x)
    (plan,) = be.take_launches()
    assert plan.kernel == kernel if kernel else plan.kernel.startswith("softmax_"), plan
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 17, 1), (2, 203, 5), (1, 113, 64), (4, 1, 3)], ids=str)
def test_softmax(dtype, shape):
    rng = np.random.default_rng(sum(shape))
    x = (3 * rng.standard_normal(shape)).astype(dtype)
    y = _softmax(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref = scipy.special.softmax(x.astype(np.float64), axis=1)
    plain = np.asarray(scipy.special.softmax(x.astype(np.float32), axis=1)).astype(dtype)
    assert_close_to_reference(y, ref, plain.astype(np.float64), dtype, what="softmax")


@pytest.mark.parametrize("Q,kernel", [(1, "softmax_rows"), (40, "softmax_cols")],
                         ids=["rows-kernel", "cols-kernel"])
def test_softmax_nan_inf(Q, kernel):
    x = np.random.default_rng(1).standard_normal((6, 9, Q)).astype(np.float32)
    x[1, 4] = np.nan
    x[2, 0] = np.inf
    x[3, :] = -np.inf                  # all −inf: scipy gives NaN
    x[4, ::2] = -np.inf                # some −inf: those get 0
    x[5, 3] = x[5, 6] = np.inf         # two +inf: NaN
    y = _softmax(x, kernel=kernel)
    with np.errstate(invalid="ignore"):
        ref = scipy.special.softmax(x.astype(np.float64), axis=1)
    assert_close_to_reference(y, ref, None, F32, what="softmax")


def test_softmax_strided():
    x = np.random.default_rng(2).standard_normal((5, 30, 4)).astype(np.float64)
    xt = x.transpose(2, 1, 0)  # (4, 30, 5), axis 1 still the reduced one
    y = _softmax(xt)
    assert_close_to_reference(y, scipy.special.softmax(xt, axis=1), None, F64, what="softmax")


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
    y = _softmax(x, checked=True)
    assert_close_to_reference(y, scipy.special.softmax(x.astype(np.float64), axis=1), None, F32,
                              what="softmax")


# -- every tile plan the library can launch ----------------------------------------------

def _plan_id(plan):
    return f"{plan.kernel}-{plan.dtype}-D{plan.head_dim_bucket}-{plan.block_m}x{plan.block_n}"


@pytest.mark.parametrize("plan", tiling.all_simt_fwd_plans(), ids=_plan_id)
def test_every_plan(plan):
    """Each specialization, picked by giving the backend exactly its shared memory, under
    the reversed and a random order of the threads in a block (a missing barrier or a
    lane reading another's unwritten value shows up in one of them); one split, so each
    block walks every key tile, the partial last one included."""
    d = max(1, plan.head_dim_bucket - 3)
    alg = "fa1" if plan.kernel == "flash_fwd_fa1" else "fa2"
    q, k, v = _inputs(1, 2, 1, plan.block_m + 5, 2 * plan.block_n + 3, d, np.dtype(plan.dtype))
    scale = 1.0 / np.sqrt(d)
    ref_o, ref_lse = reference.naive_attention(q, k, v, causal=True, scale=scale, return_lse=True)
    plain, _ = plain_attention(q, k, v, causal=True, scale=scale, dtype=q.dtype)
    for schedule in ("reversed", "random"):
        be = _simt(max_smem=plan.smem_bytes, schedule=schedule,
                   seed=plan.block_m + plan.head_dim_bucket)
        o, lse = be.forward(q, k, v, causal=True, scale=scale, algorithm=alg, num_splits=1)
        assert be.take_launches() == [plan]
        assert_close_to_reference(o, ref_o, plain, q.dtype, what=f"{_plan_id(plan)} {schedule}")


# -- tile plans and the specialization list --------------------------------------------

def test_plans_fit_and_are_listed():
    specs = tiling.specializations()
    for plan in tiling.all_simt_fwd_plans():
        assert plan.name_expression in specs[plan.source]
        assert plan.smem_bytes <= 227 * 1024
    # every dtype/bucket has a plan that fits the smallest opt-in limit (sm_75: 64 KB)
    for dt in _dtypes.SUPPORTED:
        for d in (1, 64, 128, 256, 1000):
            for alg in ("fa2", "fa1"):
                plan = tiling.simt_forward_plan(d, dt, max_smem=64 * 1024, algorithm=alg)
                assert plan.smem_bytes <= 64 * 1024
    with pytest.raises(ValueError, match="shared memory"):
        tiling.simt_forward_plan(64, F32, max_smem=16 * 1024)


# -- every kernel family's shared-memory formula, through ptxas ------------------------------

SMEM_PROBE = r"""
#include "{header}"
// The kernels' shared memory is dynamic, so ptxas cannot see it: this probe declares
// 1/{part} of {traits}::kSmemBytes statically (the whole may exceed the 48 KB of static
// shared memory), which ptxas reports.
template <{params}>
__global__ void smem_probe(unsigned char* out) {{
    constexpr int kBytes = cuflash::{traits}<{args}>::kSmemBytes;
    static_assert(kBytes % {part} == 0, "the probe declares whole bytes");
    __shared__ unsigned char s[kBytes / {part}];
    s[threadIdx.x] = (unsigned char)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = s[sizeof(s) - 1 - threadIdx.x];
}}
"""


def _c(plan):
    return _dtypes.c_type(np.dtype(plan.dtype))


# traits struct: (its header, its template parameters, 1/part declared (float32 backward
# tiles reach 192 KB), the plans it sizes, a plan's traits arguments from its fields)
SMEM_TRAITS = {
    "AttnTileTraits": (
        "attn_tile.cuh", "typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS", 4,
        lambda: tiling.all_simt_fwd_plans(),
        lambda p: (_c(p), p.head_dim_bucket, p.block_m, p.block_n, p.num_threads // 32)),
    "TcTileTraits": (
        "tc_tile.cuh", "typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, "
        "int STAGES", 4, lambda: tiling.all_tc_plans(),
        lambda p: (_c(p), p.head_dim, p.block_m, p.block_n, p.num_warps, p.stages)),
    "Tf32TileTraits": (
        "tf32_tile.cuh", "int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, "
        "bool SPLIT", 4, lambda: tiling.all_tf32_plans(),
        lambda p: (p.head_dim, p.block_m, p.block_n, p.num_warps, p.stages, p.split)),
    "TcBwdTraits": (    # the dK/dV kernels keep the row statistics in shared memory
        "tc_bwd_tile.cuh", "typename T, int HEAD_DIM, int BLOCK_ROWS, int TILE_ROWS, "
        "int NUM_WARPS, int STAGES, bool OWN_IN_REGS, int CHUNK_COLS, bool ROW_STATS, "
        "bool SPLIT, bool DQ_PARTS", 8,
        lambda: [p for p in tiling.all_tc_bwd_plans() + tiling.all_tf32_bwd_plans()
                 if isinstance(p, tiling.TcBwdPlan)],
        lambda p: (_c(p), p.head_dim, p.block_rows, p.tile_rows, p.num_warps, p.stages,
                   p.own_in_regs, p.chunk_cols, p.kernel.startswith("flash_bwd_dkdv"),
                   getattr(p, "split", False), p.dq_parts)),
}


@pytest.mark.skipif(not have_toolchain(), reason="NVRTC or ptxas not installed")
@pytest.mark.parametrize("traits", list(SMEM_TRAITS))
def test_smem_formula_matches_ptxas(traits):
    """The planner's shared memory of every plan (tiling's *_smem_bytes) is what the
    kernel's traits struct declares (kSmemBytes) for the plan's tile, as ptxas counts it."""
    from cuflash import compile_gate
    header, params, part, plans, traits_args = SMEM_TRAITS[traits]
    probes = {"smem_probe<" + ", ".join(str(a).lower() if isinstance(a, bool) else str(a)
                                        for a in traits_args(p)) + ">": p
              for p in plans()}
    source = SMEM_PROBE.format(header=header, traits=traits, params=params, part=part,
                               args=", ".join(x.split()[-1] for x in params.split(", ")))
    name = f"{traits}_smem_probe.cu"
    rows = compile_gate.run_gate({name: list(probes)}, archs=["sm_80"], sources={name: source})
    assert len(rows) == len(probes)
    for r in rows:
        assert r.ok, r.error
        assert part * r.smem == probes[r.kernel].smem_bytes, str(probes[r.kernel])
