"""Attention variants on the tensor-core kernels in the emulator: the forwards
(flash_fwd_tc.cu: float16 and bfloat16, and float32 (flash_fwd_tc_kernel<float>), split and one-pass
tf32) and the 16-bit backward (flash_bwd_tc.cu). Every option alone and all of them at
once, against the float64 reference with the tolerance rule of conftest
(`plain_attention` / `plain_backward` with the variants for 16-bit inputs,
`plain_tf32_attention` for one-pass tf32, the float32 rule for split tf32), each run
asserting the kernels that launched; dropout's keep decisions against
`cuflash.dropout_mask` and the NumPy backend, bit for bit; bias and mask in checked mode
at ragged sizes.

The options are run-time arguments, so one build per (specialization, arch) serves every
case here: each configuration below builds one kernel.
"""
import math

import numpy as np
import pytest

import cuflash
from cuflash import _dtypes, reference, tiling, variants
from cuflash.backends import kernel_backward, kernel_forward

from conftest import (DBIAS_LAYOUTS, HAS_GXX, assert_close_to_reference, assert_lse_close,
                      attention_inputs, emulator_backend, plain_attention, plain_backward,
                      plain_lse, plain_tf32_attention, round_tf32, variant_options,
                      variants_of)

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

F16, BF16, F32 = np.dtype(np.float16), _dtypes.BFLOAT16, np.dtype(np.float32)

# (dtype, arch, split tf32; None for 16-bit)
CONFIGS = [
    pytest.param(F16, "sm_75", None, id="float16-sm_75"),
    pytest.param(F16, "sm_86", None, id="float16-sm_86"),
    pytest.param(BF16, "sm_90", None, id="bfloat16-sm_90"),
    pytest.param(F32, "sm_80", True, id="float32-split-sm_80"),
    pytest.param(F32, "sm_89", False, id="float32-tf32-sm_89"),
]

# B, Hq, Hkv, Nq, Nk, d: GQA, ragged tiles, Nq < Nk; the window's left edge lies beyond
# the first key tile of every plan, so the key loop starts past tile 0.
SHAPE = (2, 4, 2, 50, 170, 40)


def _backend(arch, *, checked=False, schedule="round-robin"):
    return emulator_backend(arch, checked=checked, schedule=schedule, seed=5)


def _inputs(dtype, shape=SHAPE, seed=0):
    return attention_inputs(*shape, dtype, seed=seed)[:3]


def _options(names, dtype, shape=SHAPE, seed=1):
    return variant_options(names, dtype, shape, seed)


def _run(dtype, arch, split, q, k, v, opts, *, checked=False, schedule="round-robin"):
    """The tensor-core forward with `opts` on the emulated `arch` (the one kernel launched),
    checked against the reference; returns O."""
    opts = dict(opts)
    causal = opts.pop("causal", False)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    be = _backend(arch, checked=checked, schedule=schedule)
    o, lse = kernel_forward.forward(be, q, k, v, causal=causal, scale=scale, algorithm="fa2",
                                    variants=variants_of(opts), allow_tf32=split is False)
    (plan,) = be.take_launches()
    assert plan.kernel == "flash_fwd_tc", plan
    assert getattr(plan, "split", None) == split, plan
    ref, ref_lse = reference.naive_attention(q, k, v, causal=causal, scale=scale,
                                             return_lse=True, **opts)
    scores = {n: x for n, x in opts.items() if n not in ("dropout_p", "seed")}
    if dtype != F32:
        plain, _ = plain_attention(q, k, v, causal=causal, scale=scale, dtype=dtype, **opts)
        assert_close_to_reference(o, ref, plain, dtype, what=f"O ({plan})")
        assert_lse_close(lse, ref_lse, dtype)   # the pre-dropout lse, in fp32
    elif split:   # split tf32 is about fp32-accurate: the float32 rule
        assert_close_to_reference(o, ref, None, F32, what=f"O ({plan})")
        assert_lse_close(lse, ref_lse, dtype)
    else:         # one-pass: scores from tf32 operands, P V from tf32 P and V
        plain = plain_tf32_attention(q, k, v, causal=causal, scale=scale, **opts)
        assert_close_to_reference(o, ref, plain, round_tf32, what=f"O ({plan})")
        assert_lse_close(lse, ref_lse, dtype, precision=round_tf32,
                         plain=plain_lse(round_tf32(q), round_tf32(k), causal=causal,
                                         scale=scale, dtype=F32, **scores))
    return o


CASES = [
    ["window"], ["causal", "window_left"], ["softcap"], ["alibi"], ["bias"], ["bias_f32"],
    ["mask"], ["dropout"],
    ["causal", "window", "softcap", "alibi", "bias", "mask", "dropout"],
]


@pytest.mark.parametrize("names", CASES, ids="+".join)
@pytest.mark.parametrize("dtype,arch,split", CONFIGS)
def test_variant_matches_reference(dtype, arch, split, names):
    q, k, v = _inputs(dtype)
    _run(dtype, arch, split, q, k, v, _options(names, dtype))


@pytest.mark.parametrize("dtype,arch,split", CONFIGS)
def test_dropout_keeps_what_dropout_mask_keeps(dtype, arch, split):
    """V = the identity (d = Nk) makes O[i, j] = P̃_ij · keep_ij / ((1 − p) ℓ_i): O is 0
    exactly where the kernel dropped key j of row i. That pattern is cuflash.dropout_mask's,
    and the NumPy backend's, bit for bit."""
    B, Hq, Nq, Nk = 2, 3, 37, 61
    d = 64
    rng = np.random.default_rng(8)
    q = (0.3 * rng.standard_normal((B, Hq, Nq, d))).astype(dtype)
    k = (0.3 * rng.standard_normal((B, Hq, Nk, d))).astype(dtype)
    v = np.tile(np.eye(Nk, d).astype(dtype), (B, Hq, 1, 1))
    opts = dict(dropout_p=0.4, seed=2**40 + 77)
    o = _run(dtype, arch, split, q, k, v, opts)
    dropped = np.asarray(o, np.float64)[..., :Nk] == 0
    keep = cuflash.dropout_mask((B, Hq, Nq, Nk), 0.4, 2**40 + 77)
    np.testing.assert_array_equal(dropped, ~keep)
    o_np = cuflash.flash_attention(q, k, v, backend="numpy", **opts)
    np.testing.assert_array_equal(dropped, np.asarray(o_np, np.float64)[..., :Nk] == 0)


@pytest.mark.parametrize("dtype,arch,split,schedule", [
    (F16, "sm_80", None, "random"),
    (F32, "sm_86", True, "reversed"),
])
def test_checked_bias_and_mask_at_ragged_sizes(dtype, arch, split, schedule):
    """Every option, Nq and Nk not multiples of the tile: no race, no out-of-bounds read
    (bias and mask are never read outside [0, Nq) x [0, Nk))."""
    shape = (1, 2, 1, 37, 75, 40)
    q, k, v = _inputs(dtype, shape, seed=4)
    opts = _options(["causal", "window_left", "softcap", "alibi", "bias", "mask", "dropout"],
                    dtype, shape, seed=6)
    _run(dtype, arch, split, q, k, v, opts, checked=True, schedule=schedule)



def test_kernels_refuse_a_dropout_batch_offset():
    """Variants.batch0 serves the NumPy backend's per-sequence calls; the kernels take the
    sequence index from the launch, so a nonzero one is an error, never another mask."""
    q = k = v = np.zeros((1, 1, 16, 64), F16)
    var = variants.Variants(dropout_p=0.4, seed=1, batch0=5)
    with pytest.raises(ValueError, match="batch0 = 5"):
        kernel_forward.forward(_backend("sm_80"), q, k, v, causal=False, scale=0.125,
                               algorithm="fa2", variants=var)

# -- the backward (flash_bwd_tc.cu) -------------------------------------------------------

def _run_backward(dtype, arch, do, q, k, v, opts, *, checked=False, schedule="round-robin",
                  dq_workers=None):
    """The tensor-core backward with `opts`, o and lse from the float64 forward (rounded, so
    the errors are the backward's own), each gradient within FlashAttention's rule for
    gradients (factor 3 over conftest.plain_backward with the variants). `dq_workers` as
    kernel_backward.backward takes it: W > 0, the 5-GEMM backward where the tile has one
    (dQ from the dK/dV blocks, then flash_bwd_dq_sum); 0, the two kernels; None, as
    `tiling.dq_workers` picks."""
    opts = dict(opts)
    causal = opts.pop("causal", False)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    be = _backend(arch, checked=checked, schedule=schedule)
    o, lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                       **opts)
    o, lse = o.astype(dtype), lse.astype(np.float32)
    grads = kernel_backward.backward(be, do, q, k, v, o, lse, causal=causal, scale=scale,
                                     variants=variants_of(opts), dq_workers=dq_workers)
    launched = [p.kernel for p in be.take_launches()]
    lim = be.limits()
    dkdv = tiling.backward_path(d, dtype, lim["cc"], max_smem=lim["max_smem"])[0][0]
    workers = (dq_workers if dq_workers is not None else
               tiling.dq_workers(q.shape[0] * k.shape[1], -(-k.shape[2] // dkdv.block_rows),
                                 lim["sm_count"]))
    # the 5-GEMM kernel takes plain scores only (causal, the window): variants, two kernels
    five = workers != 0 and dkdv.dq_parts and set(opts) <= {"window"}
    dq_pass = "flash_bwd_dq_sum" if five else "flash_bwd_dq_tc"
    assert launched == ["flash_bwd_preprocess", "flash_bwd_dkdv_tc", dq_pass], launched
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, **opts)
    plain = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale, dtype=dtype, **opts)
    for name, out, r, pl in zip(("dq", "dk", "dv"), grads, ref, plain):
        assert_close_to_reference(out, r, pl, dtype, factor=3.0, what=f"{name} ({arch})")


BWD_CONFIGS = [
    pytest.param(F16, "sm_75", id="float16-sm_75"),
    pytest.param(BF16, "sm_80", id="bfloat16-sm_80"),
]


@pytest.mark.parametrize("names", CASES, ids="+".join)
@pytest.mark.parametrize("dtype,arch", BWD_CONFIGS)
def test_backward_variant_matches_reference(dtype, arch, names):
    q, k, v = _inputs(dtype)
    do = np.random.default_rng(2).standard_normal(q.shape).astype(dtype)
    _run_backward(dtype, arch, do, q, k, v, _options(names, dtype))


@pytest.mark.parametrize("names,dq_workers", [
    (["causal", "window_left"], 2),   # plain scores: the 5-GEMM backward
    (["causal", "window_left", "softcap", "alibi", "bias", "mask", "dropout"], 2),
    (["causal", "window_left", "softcap", "alibi", "bias", "mask", "dropout"], 0)],
    ids=["window-5-gemm", "every-option-workers-asked", "every-option-two-kernels"])
def test_backward_checked_bias_and_mask_at_ragged_sizes(names, dq_workers):
    """Options at ragged sizes in checked mode, both ways to dQ: no backward kernel races or
    reads bias, mask or dQ's padded partials outside their bounds; with variants, workers
    asked for or not, the two kernels."""
    shape = (1, 2, 1, 37, 75, 40)
    q, k, v = _inputs(F16, shape, seed=4)
    do = np.random.default_rng(3).standard_normal(q.shape).astype(F16)
    opts = _options(names, F16, shape, seed=6)
    _run_backward(F16, "sm_80", do, q, k, v, opts, checked=True, schedule="random",
                  dq_workers=dq_workers)


def test_backward_variants_with_head_dim_chunks():
    """d = 200: the dK/dV blocks own 128-column chunks and recompute the scores per chunk;
    every option (the chain and dropout's redraw in each chunk's block) at ragged sizes."""
    shape = (1, 2, 1, 37, 75, 200)
    q, k, v = _inputs(F16, shape, seed=7)
    do = np.random.default_rng(8).standard_normal(q.shape).astype(F16)
    opts = _options(["causal", "window_left", "softcap", "alibi", "bias", "mask", "dropout"],
                    F16, shape, seed=9)
    _run_backward(F16, "sm_80", do, q, k, v, opts)


# -- dbias on tensor cores ------------------------------------------------------------------

# bias shapes from (B, Hq, Nq, Nk): the full bias, broadcast over heads and batch, over
# batch, over query rows (the dK/dV kernel's column sums), over query rows and heads, over
# keys (the dQ kernel's quad sums)
def _run_backward_dbias(dtype, arch, layout, names, shape=SHAPE, *, checked=False,
                        schedule="round-robin", seed=0):
    """The tensor-core backward with a bias of `layout` and return_dbias: both launched
    kernels are the tensor-core ones, dq, dk, dv as `_run_backward` checks them, dbias (an
    fp32 sum of the fp32 dS) within the float32 rule of the float64 reference. Returns the
    four gradients."""
    B, Hq, _, Nq, Nk, d = shape
    q, k, v = _inputs(dtype, shape, seed=seed)
    rng = np.random.default_rng(seed + 1)
    do = rng.standard_normal(q.shape).astype(dtype)
    opts = _options(names, dtype, shape, seed=seed + 2)
    opts["bias"] = rng.uniform(-1, 1, DBIAS_LAYOUTS[layout](B, Hq, Nq, Nk)).astype(np.float32)
    causal = opts.pop("causal", False)
    scale = 1.0 / math.sqrt(d)
    be = _backend(arch, checked=checked, schedule=schedule)
    o, lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                       **opts)
    o, lse = o.astype(dtype), lse.astype(np.float32)
    grads = kernel_backward.backward(be, do, q, k, v, o, lse, causal=causal, scale=scale,
                                     variants=variants_of(opts), return_dbias=True)
    tc = tiling.TC_BWD_KERNELS
    launched = {p.kernel for p in be.take_launches()}
    assert launched == {"flash_bwd_preprocess", *tc}, launched
    ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                       return_dbias=True, **opts)
    plain = plain_backward(do, q, k, v, o, lse, causal=causal, scale=scale, dtype=dtype, **opts)
    for name, out, r, pl in zip(("dq", "dk", "dv"), grads, ref, plain):
        assert_close_to_reference(out, r, pl, dtype, factor=3.0, what=f"{name} ({layout})")
    assert grads[3].shape == ref[3].shape
    assert_close_to_reference(grads[3], ref[3], None, F32, what=f"dbias ({layout})")
    return grads


DBIAS_CONFIGS = [
    pytest.param(F16, "sm_75", id="float16-sm_75"),
    pytest.param(BF16, "sm_80", id="bfloat16-sm_80"),
    pytest.param(BF16, "sm_90", id="bfloat16-sm_90"),
    pytest.param(F32, "sm_89", id="float32-sm_89"),   # split tf32
]


@pytest.mark.parametrize("layout", list(DBIAS_LAYOUTS))
@pytest.mark.parametrize("dtype,arch", DBIAS_CONFIGS)
def test_backward_dbias_matches_reference(dtype, arch, layout):
    """dbias from the tensor-core kernels for every layout: causal, softcap (dbias takes dS
    before softcap's factor, dK and dQ after it), GQA, Nq = 50 ≠ Nk = 170 (ragged tiles)."""
    _run_backward_dbias(dtype, arch, layout, ["causal", "softcap"])


@pytest.mark.parametrize("layout", ["full", "query-broadcast"])
def test_backward_dbias_with_every_option(layout):
    """dbias with the window, ALiBi, the bool mask (a row that sees no key) and dropout too."""
    _run_backward_dbias(F16, "sm_86", layout,
                        ["causal", "window", "softcap", "alibi", "mask", "dropout"])


@pytest.mark.parametrize("layout", ["head+batch-broadcast", "query-broadcast"])
def test_backward_dbias_with_head_dim_chunks(layout):
    """d = 200: two dK/dV blocks (chunks of 128 columns) see every key's dS; only the first
    chunk's block adds the column sums."""
    _run_backward_dbias(F16, "sm_80", layout, ["causal", "softcap"], (2, 2, 1, 37, 75, 200))


@pytest.mark.parametrize("layout", ["head+batch-broadcast", "query-broadcast", "key-broadcast"])
def test_backward_dbias_checked(layout):
    """Checked mode at ragged sizes: no race (one writer per dbias element, within a launch
    and across blocks) and no access outside dbias or the column sums."""
    _run_backward_dbias(F16, "sm_80", layout, ["causal", "softcap", "dropout"],
                        (2, 2, 1, 37, 75, 40), checked=True, schedule="random")


@pytest.mark.parametrize("layout", ["head+batch-broadcast", "query-broadcast", "key-broadcast"])
def test_backward_dbias_is_bitwise_reproducible(layout):
    """One writer per element in a fixed order: the same bits under every thread schedule."""
    runs = [_run_backward_dbias(BF16, "sm_80", layout, ["softcap"], (2, 2, 1, 37, 75, 40),
                                checked=True, schedule=s)
            for s in ("round-robin", "reversed", "random")]
    for other in runs[1:]:
        for name, x, y in zip(("dq", "dk", "dv", "dbias"), runs[0], other):
            assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)), name
