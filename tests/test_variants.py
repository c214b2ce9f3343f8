"""Attention variants: window, softcap, ALiBi, bias (with dbias), bool mask, dropout.

Every option alone and in combination against the float64 reference (whose score chain
is `reference.attention_scores`), on every backend; gradients against the reference and
central differences; dropout's Philox against the Random123 known answers.
"""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import cuflash
from cuflash import reference, variants
from conftest import assert_close_to_reference, round_to, to_backend, to_host

def rand(rng, shape, dtype=np.float64):
    return rng.uniform(-1, 1, shape).astype(dtype)


Q_SHAPE, K_SHAPE = (2, 4, 37, 24), (2, 2, 53, 24)   # GQA, Nq < Nk, odd sizes


def make_options(rng, names, q_shape=Q_SHAPE, nk=K_SHAPE[-2], dtype=np.float64):
    """Options by name, with random arrays of the shapes the scores broadcast to."""
    *batch, hq, nq, _ = q_shape
    opts = {}
    for n in names:
        if n == "causal":
            opts["causal"] = True
        elif n == "window":
            opts["window"] = (7, 4)
        elif n == "window_left":
            opts["window"] = (11, -1)
        elif n == "softcap":
            opts["softcap"] = 0.8
        elif n == "alibi":
            opts["alibi_slopes"] = rng.uniform(0.05, 0.5, (hq,))
        elif n == "alibi_batch":
            opts["alibi_slopes"] = rng.uniform(0.05, 0.5, tuple(batch) + (hq,))
        elif n == "bias":
            opts["bias"] = rand(rng, tuple(batch) + (hq, nq, nk), dtype)
        elif n == "bias_pair":  # (Nq, Nk), broadcast over batch and heads
            opts["bias"] = rand(rng, (nq, nk), dtype)
        elif n == "bias_head":  # (Hq, 1, Nk): broadcast over batch and query rows
            opts["bias"] = rand(rng, (hq, 1, nk), np.float32)
        elif n == "mask":
            m = rng.random((nq, nk)) > 0.3
            m[3] = False  # a row that sees no key
            opts["mask"] = m
        elif n == "mask_batch":
            opts["mask"] = rng.random(tuple(batch) + (1, nq, nk)) > 0.5
        elif n == "dropout":
            opts["dropout_p"], opts["seed"] = 0.3, 1234
        else:
            raise KeyError(n)
    return opts


CASES = [
    ["window"], ["causal", "window"], ["causal", "window_left"], ["softcap"], ["alibi"],
    ["alibi_batch"], ["bias"], ["bias_pair"], ["bias_head"], ["mask"], ["mask_batch"],
    ["dropout"], ["causal", "mask", "bias_pair"], ["softcap", "alibi", "bias", "window"],
    ["causal", "window_left", "softcap", "alibi", "bias_head", "mask", "dropout"],
]


def forward_both(backend, q, k, v, opts):
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), return_lse=True,
                                     backend=backend, **to_options(backend, opts))
    ref_o, ref_lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    return to_host(o), to_host(lse), ref_o, ref_lse


def to_options(backend, opts):
    return {n: (to_backend(backend, x) if isinstance(x, np.ndarray) else x)
            for n, x in opts.items()}


def assert_lse_close(lse, ref, tol):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(lse[finite], ref[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("names", CASES, ids="+".join)
def test_forward_matches_reference(backend, names, dtype):
    rng = np.random.default_rng(0)
    q, k, v = (rand(rng, s, dtype) for s in (Q_SHAPE, K_SHAPE, K_SHAPE))
    opts = make_options(rng, names, dtype=dtype)
    o, lse, ref_o, ref_lse = forward_both(backend, q, k, v, opts)
    tol = 1e-10 if dtype == np.float64 else 2e-5
    assert o.shape == q.shape and o.dtype == dtype
    np.testing.assert_allclose(o, ref_o, rtol=tol, atol=tol)
    assert_lse_close(lse, ref_lse, tol)


@pytest.mark.parametrize("names", [["causal", "window", "bias_pair", "dropout"],
                                   ["softcap", "alibi_batch", "mask_batch", "window_left"]],
                         ids="+".join)
def test_fa1_takes_the_variants(backend, names):
    rng = np.random.default_rng(9)
    q, k, v = (rand(rng, s) for s in (Q_SHAPE, K_SHAPE, K_SHAPE))
    opts = make_options(rng, names)
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), return_lse=True,
                                     algorithm="fa1", backend=backend,
                                     **to_options(backend, opts))
    ref_o, ref_lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(to_host(o), ref_o, rtol=1e-10, atol=1e-10)
    assert_lse_close(to_host(lse), ref_lse, 1e-10)


@pytest.mark.parametrize("names", CASES, ids="+".join)
def test_backward_matches_reference(backend, names):
    rng = np.random.default_rng(1)
    q, k, v, = (rand(rng, s) for s in (Q_SHAPE, K_SHAPE, K_SHAPE))
    do = rand(rng, Q_SHAPE)
    opts = make_options(rng, names)
    ref_o, ref_lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    with_bias = "bias" in opts
    grads = cuflash.flash_attention_backward(
        *to_backend(backend, do, q, k, v, ref_o, ref_lse), backend=backend,
        return_dbias=with_bias, **to_options(backend, opts))
    refs = reference.attention_backward(do, q, k, v, ref_o, ref_lse, return_dbias=with_bias,
                                        **opts)
    assert len(grads) == len(refs) == 3 + with_bias
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, refs):
        g = to_host(g)
        assert g.shape == r.shape, name
        tol = 1e-9 if g.dtype == np.float64 else 1e-6  # a float32 bias gets a float32 dbias
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol / 10, err_msg=name)
    if with_bias:
        assert to_host(grads[3]).dtype == opts["bias"].dtype


def test_gradients_match_finite_differences(backend):
    """d/dx of L = sum(O ∘ W) for x in q, k, v, bias, by central differences (float64),
    through softcap, ALiBi, bias, window, mask and dropout at once."""
    rng = np.random.default_rng(2)
    q, k, v = rand(rng, (1, 2, 6, 5)), rand(rng, (1, 1, 9, 5)), rand(rng, (1, 1, 9, 5))
    w = rand(rng, q.shape)
    opts = dict(window=(4, 2), softcap=0.7, alibi_slopes=np.array([0.3, 0.1]),
                bias=rand(rng, (2, 1, 9)),  # broadcast over query rows
                mask=rng.random((6, 9)) > 0.2,
                dropout_p=0.25, seed=99)

    def loss(q, k, v, bias):
        o = cuflash.flash_attention(*to_backend(backend, q, k, v), backend=backend,
                                    **to_options(backend, {**opts, "bias": bias}))
        return float(np.sum(to_host(o) * w))

    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), return_lse=True,
                                     backend=backend, **to_options(backend, opts))
    grads = cuflash.flash_attention_backward(*to_backend(backend, w, q, k, v), o, lse,
                                             backend=backend, return_dbias=True,
                                             **to_options(backend, opts))
    eps = 1e-6
    xs = [q, k, v, opts["bias"]]
    for i, (x, g) in enumerate(zip(xs, grads)):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [a.copy() for a in xs]
            args[i][idx] += eps
            up = loss(*args)
            args[i][idx] -= 2 * eps
            numeric[idx] = (up - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(to_host(g), numeric, rtol=1e-6, atol=1e-8,
                                   err_msg="dq dk dv dbias".split()[i])


# -- dropout -----------------------------------------------------------------------------

# Random123's kat_vectors: counter (4 words), key (2 words) -> output (4 words).
PHILOX_KAT = [
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


@pytest.mark.parametrize("rounds, counter, key, want", PHILOX_KAT)
def test_philox_known_answers(rounds, counter, key, want):
    got = variants.philox4x32(counter, key, rounds=rounds)
    assert tuple(int(w) for w in got) == want


def test_dropout_mask_is_the_documented_map():
    """keep[b, h, i, j] = word (j mod 4) of Philox(counter (j div 4, i, h, b), key of
    seed) >= floor(p·2^32), checked entry by entry for a few entries."""
    seed, p = (7 << 32) | 5, 0.4
    m = cuflash.dropout_mask((2, 3, 5, 11), p, seed)
    t = math.floor(p * 2 ** 32)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 10), (1, 0, 3, 6), (0, 1, 2, 7)]:
        words = variants.philox4x32((j // 4, i, h, b), (5, 7))
        assert m[b, h, i, j] == (int(words[j % 4]) >= t)


@pytest.mark.parametrize("blocks", [1, 7, 64, 1 << 16])
def test_keep_tiles_in_chunks_are_the_map(monkeypatch, blocks):
    """keep_tile draws its rows in chunks of about _PHILOX_BLOCKS Philox blocks: any chunk
    size gives keep_mask's entries (one Philox call per entry), unaligned keys included."""
    monkeypatch.setattr(variants, "_PHILOX_BLOCKS", blocks)
    seed, t = (3 << 32) | 9, variants.dropout_threshold(0.4)
    h = np.array([1, 4])
    got = variants.keep_tile(seed, t, 2, h, 3, 40, 5, 50)
    want = variants.keep_mask(seed, t, 2, h[:, None, None], np.arange(3, 40)[None, :, None],
                              np.arange(5, 50)[None, None, :])
    np.testing.assert_array_equal(got, want)


def test_dropout_keep_fraction():
    p, n = 0.3, 1024 * 1024
    m = cuflash.dropout_mask((1, 1, 1024, 1024), p, seed=2024)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(m.mean() - (1 - p)) < 4 * sigma


def test_dropout_uses_dropout_mask(backend):
    """O = (softmax(S) ∘ dropout_mask / (1 − p)) V, with the public dropout_mask."""
    rng = np.random.default_rng(3)
    q, k, v = rand(rng, (2, 3, 19, 8)), rand(rng, (2, 3, 45, 8)), rand(rng, (2, 3, 45, 8))
    opts = dict(dropout_p=0.4, seed=31337, causal=True)
    o = to_host(cuflash.flash_attention(*to_backend(backend, q, k, v), backend=backend, **opts))
    s = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(8)
    s = np.where(reference.visible_keys(19, 45, causal=True), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    keep = cuflash.dropout_mask((2, 3, 19, 45), 0.4, 31337)
    np.testing.assert_allclose(o, (p * keep / 0.6) @ v, rtol=1e-10, atol=1e-12)
    # Another seed draws another mask.
    o2 = to_host(cuflash.flash_attention(*to_backend(backend, q, k, v), backend=backend,
                                         **{**opts, "seed": 31338}))
    assert np.abs(o2 - o).max() > 1e-3


def test_dropout_backward_redraws_the_forward_mask(backend):
    rng = np.random.default_rng(4)
    q, k, v, do = (rand(rng, (1, 2, 33, 16)) for _ in range(4))
    opts = dict(dropout_p=0.5, seed=5)
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), return_lse=True,
                                     backend=backend, **opts)
    ref = reference.attention_backward(do, q, k, v, to_host(o), to_host(lse), **opts)
    got = cuflash.flash_attention_backward(*to_backend(backend, do, q, k, v), o, lse,
                                           backend=backend, **opts)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(to_host(g), r, rtol=1e-9, atol=1e-10)
    other = cuflash.flash_attention_backward(*to_backend(backend, do, q, k, v), o, lse,
                                             backend=backend, **{**opts, "seed": 6})
    assert np.abs(to_host(other[2]) - ref[2]).max() > 1e-3


# -- shapes and conventions --------------------------------------------------------------

def test_fully_masked_rows_and_defaults(backend):
    """A row the mask hides entirely: o = 0, lse = −inf, no NaN in any gradient."""
    rng = np.random.default_rng(5)
    q, k, v, do = rand(rng, (3, 12, 8)), rand(rng, (3, 20, 8)), rand(rng, (3, 20, 8)), \
        rand(rng, (3, 12, 8))
    mask = np.ones((12, 20), bool)
    mask[4] = False
    opts = dict(mask=mask)
    o, lse = cuflash.flash_attention(*to_backend(backend, q, k, v), return_lse=True,
                                     backend=backend, **to_options(backend, opts))
    o, lse = to_host(o), to_host(lse)
    assert np.all(o[:, 4] == 0) and np.all(lse[:, 4] == -np.inf)
    grads = cuflash.flash_attention_backward(*to_backend(backend, do, q, k, v, o, lse),
                                             backend=backend, **to_options(backend, opts))
    assert all(np.isfinite(to_host(g)).all() for g in grads)
    assert np.all(to_host(grads[0])[:, 4] == 0)


def test_default_options_change_nothing():
    """Every option at its default gives the plain call's result bit for bit."""
    rng = np.random.default_rng(6)
    q, k, v = (rand(rng, (2, 40, 16), np.float32) for _ in range(3))
    plain = cuflash.flash_attention(q, k, v, causal=True, return_lse=True)
    explicit = cuflash.flash_attention(q, k, v, causal=True, return_lse=True, window=None,
                                       softcap=None, alibi_slopes=None, bias=None, mask=None,
                                       dropout_p=0.0, seed=None)
    for a, b in zip(plain, explicit):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bias_shape", [(5, 7), (1, 1, 5, 7), (2, 1, 1, 1, 1), (3, 5, 1),
                                        (2, 1, 3, 5, 7), (1, 3, 1, 7)])
def test_bias_broadcast_and_dbias_shape(bias_shape):
    """Two batch axes (2, 1), three heads: dbias has bias's shape, summed over its
    broadcast axes, in bias's dtype."""
    rng = np.random.default_rng(7)
    q, k, v, do = rand(rng, (2, 1, 3, 5, 4)), rand(rng, (2, 1, 3, 7, 4)), \
        rand(rng, (2, 1, 3, 7, 4)), rand(rng, (2, 1, 3, 5, 4))
    bias = rand(rng, bias_shape, np.float32)
    o, lse = cuflash.flash_attention(q, k, v, bias=bias, return_lse=True)
    np.testing.assert_allclose(o, reference.naive_attention(q, k, v, bias=bias),
                               rtol=1e-6, atol=1e-7)
    *_, dbias = cuflash.flash_attention_backward(do, q, k, v, o, lse, bias=bias,
                                                 return_dbias=True)
    ref = reference.attention_backward(do, q, k, v, o, lse, bias=bias, return_dbias=True)[3]
    assert dbias.shape == bias.shape and dbias.dtype == np.float32
    np.testing.assert_allclose(dbias, ref, rtol=1e-5, atol=1e-6)


def test_bias_is_read_in_place():
    """A broadcast bias reaches the backend as a view of the caller's memory."""
    from cuflash import api
    q = np.zeros((2, 3, 5, 4))
    bias = np.ones((1, 1, 5, 7))
    compact = api._compact4(np, bias, q, (2,))
    assert compact.shape == (1, 1, 5, 7) and np.shares_memory(compact, bias)
    per_head = np.ones((3, 5, 7))
    assert np.shares_memory(api._compact4(np, per_head, q, (2,)), per_head)


# -- errors: the argument, what came, what is accepted; nothing computed -----------------

F64 = np.ones((2, 3, 8, 16))
K64 = np.ones((2, 3, 10, 16))


@pytest.mark.parametrize("opts, exc, words", [
    (dict(window=(-2, 3)), ValueError, r"window entries must be >= 0, or -1"),
    (dict(window=(1.5, 3)), TypeError, "window must be None or a pair of ints"),
    (dict(window=5), TypeError, "window"),
    (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(4)), ValueError, r"alibi_slopes must have shape .*\(3,\)"),
    (dict(alibi_slopes=np.ones((2, 3), complex)), TypeError, "alibi_slopes must be a real"),
    (dict(bias=np.ones((3, 8, 9))), ValueError, r"bias of shape \(3, 8, 9\) does not "
     r"broadcast to the scores' shape \(2, 3, 8, 10\)"),
    (dict(bias=np.ones((8, 10), np.float16)), TypeError, "bias must have q's dtype or float32"),
    (dict(mask=np.ones((8, 10)) > 0, bias=np.ones((4, 8, 10))), ValueError, "bias of shape"),
    (dict(mask=np.ones((8, 10))), TypeError, "mask must be a bool array"),
    (dict(mask=np.ones((2, 8, 1)) > 0), ValueError, r"mask of shape \(2, 8, 1\)"),
    (dict(dropout_p=1.0, seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1, seed=1), ValueError, "dropout_p"),
    (dict(dropout_p=0.1), ValueError, "needs a seed"),
    (dict(dropout_p=0.1, seed=-1), ValueError, "seed must be an int in"),
    (dict(dropout_p=0.1, seed=1.0), TypeError, "seed must be an int"),
    (dict(dropout_p=0.1, seed=True), TypeError, "seed"),
])
def test_errors_name_the_argument(opts, exc, words):
    with pytest.raises(exc, match=words):
        cuflash.flash_attention(F64, K64, K64, **opts)
    lse = np.zeros(F64.shape[:-1])
    with pytest.raises(exc, match=words):
        cuflash.flash_attention_backward(F64, F64, K64, K64, F64, lse, **opts)


def test_return_dbias_needs_a_bias():
    lse = np.zeros(F64.shape[:-1])
    with pytest.raises(ValueError, match="return_dbias=True needs a bias"):
        cuflash.flash_attention_backward(F64, F64, K64, K64, F64, lse, return_dbias=True)


def test_dropout_mask_arguments():
    with pytest.raises(ValueError, match="needs a seed"):
        cuflash.dropout_mask((1, 1, 4, 4), 0.5, None)
    with pytest.raises(ValueError, match=r"shape must be \(B, H, Nq, Nk\)"):
        cuflash.dropout_mask((4, 4), 0.5, 1)


# -- properties --------------------------------------------------------------------------

option_sets = st.fixed_dictionaries({
    "batch": st.integers(1, 2), "hkv": st.integers(1, 2), "group": st.integers(1, 2),
    "nq": st.integers(1, 40), "nk": st.integers(1, 40), "d": st.integers(1, 20),
    "causal": st.booleans(), "seed": st.integers(0, 2**16),
    "window": st.one_of(st.none(), st.tuples(st.integers(-1, 12), st.integers(-1, 12))),
    "softcap": st.one_of(st.none(), st.floats(0.2, 5.0)),
    "alibi": st.booleans(), "bias": st.sampled_from([None, "full", "pair", "head"]),
    "mask": st.booleans(), "dropout": st.sampled_from([0.0, 0.2, 0.6]),
})


def check_property(p, backend):
    rng = np.random.default_rng(p["seed"])
    hq = p["hkv"] * p["group"]
    B, nq, nk, d = p["batch"], p["nq"], p["nk"], p["d"]
    q = rng.standard_normal((B, hq, nq, d))
    k, v = (rng.standard_normal((B, p["hkv"], nk, d)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    opts = dict(causal=p["causal"], window=p["window"], softcap=p["softcap"])
    if p["alibi"]:
        opts["alibi_slopes"] = rng.uniform(0, 1, hq)
    if p["bias"]:
        shape = {"full": (B, hq, nq, nk), "pair": (nq, nk), "head": (hq, 1, 1)}[p["bias"]]
        opts["bias"] = rng.standard_normal(shape)
    if p["mask"]:
        opts["mask"] = rng.random((B, 1, nq, nk)) > 0.3
    if p["dropout"]:
        opts["dropout_p"], opts["seed"] = p["dropout"], p["seed"]
    o, lse = cuflash.flash_attention(q, k, v, return_lse=True, backend=backend, **opts)
    ref_o, ref_lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(o, ref_o, rtol=1e-9, atol=1e-11)
    assert_lse_close(lse, ref_lse, 1e-9)
    with_bias = "bias" in opts
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, backend=backend,
                                             return_dbias=with_bias, **opts)
    refs = reference.attention_backward(do, q, k, v, ref_o, ref_lse, return_dbias=with_bias,
                                        **opts)
    for g, r in zip(grads, refs):
        np.testing.assert_allclose(g, r, rtol=1e-8, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(option_sets)
def test_numpy_backend_any_options(p):
    check_property(p, "numpy")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(option_sets)
def test_emulated_kernels_any_options(p):
    check_property(p, "emulator")


def test_variants_take_the_tensor_core_kernels():
    """A call with variants takes the plan a plain call takes on mma.sync: the tensor-core
    forwards run every option (tests/test_kernels_tc_variants.py). On sm_90a, where plain
    calls take the Hopper forward (which runs none yet), it takes the mma.sync one."""
    from cuflash import tiling
    limits = dict(max_smem=163 * 1024, sm_count=108)
    for dt in (np.float16, np.float32):
        for plain in (False, True):
            plan, why = tiling.forward_path(64, dt, (8, 0), plain=plain, **limits)
            assert plan.kernel == "flash_fwd_tc" and why.startswith("tensor cores")
    h100 = dict(max_smem=227 * 1024, sm_count=132, sm90a=True)
    assert tiling.forward_path(64, np.float16, (9, 0), plain=True, **h100)[0].kernel == "flash_fwd_sm90"
    plan, why = tiling.forward_path(64, np.float16, (9, 0), plain=False, **h100)
    assert plan.kernel == "flash_fwd_tc" and "plain calls" in why


def test_window_edges_on_tile_boundaries(backend):
    """Window edges one key either side of every tile boundary (tiles of 16, 32, 64 or
    128 keys): a tile skipped one key too early loses exactly that key."""
    rng = np.random.default_rng(10)
    q, k, v = (rand(rng, (1, 1, 300, 8)) for _ in range(3))
    args = to_backend(backend, q, k, v)
    for left in (15, 17, 31, 33, 63, 65, 127, 129):
        for window, causal in (((left, -1), False), ((left, 3), True), ((5, left), False)):
            for algorithm in ("fa2", "fa1"):
                o = cuflash.flash_attention(*args, window=window, causal=causal,
                                            algorithm=algorithm, backend=backend)
                ref = reference.naive_attention(q, k, v, window=window, causal=causal)
                np.testing.assert_allclose(to_host(o), ref, rtol=1e-10, atol=1e-12,
                                           err_msg=f"{window} {causal} {algorithm}")


@pytest.mark.parametrize("whole", [False, True], ids=["band-in-steps", "band-whole"])
@pytest.mark.parametrize("window, causal", [((40, -1), True), ((9, 30), False), ((33, 0), False)])
def test_numpy_band_tiles(monkeypatch, whole, window, causal):
    """The NumPy variant loops take a band's whole span in one tile across (Q tiles: keys,
    K/V tiles: rows) or in _WINDOW_BLOCK steps when it is wider than a run (_RUN_SCORES):
    both give the reference's output and gradients, GQA, Nq ≠ Nk, over several tiles (in
    steps: of 32, several per tile)."""
    from cuflash.backends.numpy_backend import variants as loops
    if not whole:
        monkeypatch.setattr(loops, "_RUN_SCORES", 0)
        monkeypatch.setattr(loops, "_WINDOW_BLOCK", 32)
        for outer in ("q", "k"):
            Br, Bc = loops._tile_sizes(290, 310, 2, causal, window, outer=outer)
            assert max(len(steps) for _, _, steps in loops.variant_schedule(
                290, 310, Br, Bc, causal=causal, window=window, outer=outer)) > 1
    rng = np.random.default_rng(16)
    q, do = rand(rng, (1, 2, 290, 8)), rand(rng, (1, 2, 290, 8))
    k, v = rand(rng, (1, 1, 310, 8)), rand(rng, (1, 1, 310, 8))
    opts = dict(window=window, causal=causal, bias=rand(rng, (290, 310)))
    o, lse = cuflash.flash_attention(q, k, v, return_lse=True, backend="numpy", **opts)
    ref_o, ref_lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(o, ref_o, rtol=1e-10, atol=1e-12)
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, backend="numpy",
                                             return_dbias=True, **opts)
    refs = reference.attention_backward(do, q, k, v, ref_o, ref_lse, return_dbias=True, **opts)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, refs):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11, err_msg=name)


# 256 rows over 2 heads: 128 a head, 3 tiles; causal, 2 workers, wants 4 tasks: 64 rows, 5
# tiles; 8 workers want 16: 48 rows (the backward's 96 over 2 heads), no fewer
@pytest.mark.parametrize("causal, workers, want", [(False, 2, 128), (True, 2, 64), (True, 8, 48)])
def test_numpy_forward_tiles_for_few_heads(monkeypatch, causal, workers, want):
    """One K/V head, two query heads, one long sequence (tiles shrunk to show it at a small
    size): the forward's Q tiles shorten until each worker gets one (causal: two, its
    tiles differ), never below the backward's; built-ins and a score_mod give the
    reference's output, every causal step past the first computing only its rows."""
    from cuflash.backends import numpy_backend
    from cuflash.backends.numpy_backend import variants as loops
    monkeypatch.setattr(numpy_backend.BACKEND, "config",
                        dataclasses.replace(numpy_backend.BACKEND.config, workers=workers))
    monkeypatch.setattr(loops, "_FORWARD_ROWS", 256)
    monkeypatch.setattr(loops, "_ROWS", 96)
    rows = []
    tasks = loops._tasks
    monkeypatch.setattr(loops, "_tasks", lambda *a: rows.append(a[3]) or tasks(*a))
    rng = np.random.default_rng(21)
    q, k, v = rand(rng, (1, 2, 300, 8)), rand(rng, (1, 1, 330, 8)), rand(rng, (1, 1, 330, 8))
    slopes = rng.uniform(0.05, 0.5, 2)

    def alibi(score, b, h, q_idx, kv_idx):                 # ALiBi, bottom-right aligned
        return score - slopes[h] * abs(q_idx + 30 - kv_idx)

    for opts, ref_opts in ((dict(softcap=0.8, alibi_slopes=slopes),) * 2,
                           (dict(score_mod=alibi), dict(alibi_slopes=slopes))):
        o = cuflash.flash_attention(q, k, v, causal=causal, backend="numpy", **opts)
        ref = reference.naive_attention(q, k, v, causal=causal, **ref_opts)
        np.testing.assert_allclose(o, ref, rtol=1e-10, atol=1e-12)
    assert rows == [want, want]


def test_numpy_failed_reference_hands_over_at_once(monkeypatch):
    """As the plain forward's: a variant tile whose frozen reference fails at a step goes
    to the running max there. One Q tile, four K/V steps (keys shrunk to 24), ALiBi,
    scores 100× larger from the second step: the reference's sample, two frozen steps,
    then four running-max ones, each evaluating the chain once."""
    from cuflash.backends.numpy_backend import variants as loops
    monkeypatch.setattr(loops, "_KEYS", 24)
    evaluations = []
    values = loops.ScoreChain.values
    monkeypatch.setattr(loops.ScoreChain, "values",
                        lambda *a, **kw: evaluations.append(1) or values(*a, **kw))
    rng = np.random.default_rng(12)
    q, k, v = rand(rng, (1, 1, 16, 4)), rand(rng, (1, 1, 96, 4)), rand(rng, (1, 1, 96, 4))
    k[:, :, 24:] *= 300
    slopes = np.array([0.01])
    o = cuflash.flash_attention(q, k, v, alibi_slopes=slopes, backend="numpy")
    assert len(evaluations) == 1 + 2 + 4
    np.testing.assert_allclose(o, reference.naive_attention(q, k, v, alibi_slopes=slopes),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("outer", ["q", "k"])
def test_numpy_band_is_one_step_per_tile(outer):
    """N = 8192, causal window of 256 keys: each block of 32 on the loop's axis (Q rows,
    K/V keys) is one step across the band's whole span, so the scores computed are the
    band's parallelogram: (32 + 256)/N = 3.5% of the square (the band itself: 3.1%)."""
    from cuflash.backends.numpy_backend import variants as loops
    n, window = 8192, (256, 0)
    Br, Bc = loops._tile_sizes(n, n, 1, True, window, outer=outer)
    sched = list(loops.variant_schedule(n, n, Br, Bc, causal=True, window=window,
                                        outer=outer))
    assert all(len(steps) == 1 for _, _, steps in sched)
    computed = sum((a1 - a0) * (c1 - c0) for a0, a1, steps in sched for c0, c1, _ in steps)
    assert computed / n**2 <= (32 + 256) / n


@pytest.mark.parametrize("bias_shape", [(1, 4, 100, 130), (4, 1, 130), (100, 1)],
                         ids=["per-head", "query-broadcast", "key-broadcast"])
@pytest.mark.parametrize("window, causal", [((20, 5), False), ((24, -1), True)])
def test_numpy_band_runs(monkeypatch, window, causal, bias_shape):
    """Band tiles computed in runs (one batched step for several tiles, each shifted along
    the diagonal, band.runs) and batched into tasks with the clipped tiles at the ends,
    forward (Q tiles) and backward (K/V tiles, whose rows overlap in dQ): every variant
    of the chain (bias and mask read as strided blocks, ALiBi, softcap, dropout drawn
    per block) against the reference, dbias summed over broadcast axes, GQA, Nq ≠ Nk."""
    from cuflash.backends.numpy_backend import band, variants as loops
    monkeypatch.setattr(loops, "_BAND_BLOCK", 8)
    monkeypatch.setattr(loops, "_RUN_SCORES", 2 * 8 * 33 * 5)   # 5 blocks of 2 heads
    rng = np.random.default_rng(17)
    q, k, v = rand(rng, (1, 4, 100, 8)), rand(rng, (1, 2, 130, 8)), rand(rng, (1, 2, 130, 8))
    do = rand(rng, q.shape)
    opts = make_options(rng, ["softcap", "alibi", "dropout"], (1, 4, 100, 8), 130)
    opts.update(window=window, causal=causal, bias=rand(rng, bias_shape),
                mask=rng.random((1, 4, 100, 130)) > 0.2)
    for outer in ("q", "k"):
        Br, Bc = loops._tile_sizes(100, 130, 2, causal, window, outer=outer)
        runs = band.runs(loops.variant_schedule(100, 130, Br, Bc, causal=causal,
                                                window=window, outer=outer),
                         2, loops._RUN_SCORES)
        assert (Br if outer == "q" else Bc) == 8
        assert max(n for _, _, n, _ in runs) == 5          # several runs of several tiles
    o, lse = cuflash.flash_attention(q, k, v, return_lse=True, backend="numpy", **opts)
    ref_o, ref_lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    np.testing.assert_allclose(o, ref_o, rtol=1e-10, atol=1e-12)
    assert_lse_close(lse, ref_lse, 1e-10)
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, backend="numpy",
                                             return_dbias=True, **opts)
    refs = reference.attention_backward(do, q, k, v, ref_o, ref_lse, return_dbias=True,
                                        **opts)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, refs):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11, err_msg=name)


# -- the kernel backward with variants: dbias's layouts, chunks, checked mode ------------

@pytest.mark.parametrize("bias_shape, d", [((2, 1, 21, 1), 24), ((1, 4, 21, 30), 300),
                                           ((21, 30), 300), ((1, 4, 1, 30), 300)],
                         ids=["key+head-broadcast", "batch-broadcast-chunked",
                              "pair-chunked", "query-broadcast-chunked"])
def test_emulated_backward_dbias_layouts(bias_shape, d):
    """dbias summed over a broadcast key axis (one thread's running sum), over heads and
    batch (the dQ block's loop over them), and with head-dim chunks (one chunk writes)."""
    rng = np.random.default_rng(11)
    q, do = rand(rng, (2, 4, 21, d)), rand(rng, (2, 4, 21, d))
    k, v = rand(rng, (2, 2, 30, d)), rand(rng, (2, 2, 30, d))
    opts = dict(bias=rand(rng, bias_shape), softcap=1.5, window=(9, 3), dropout_p=0.2,
                seed=3)
    o, lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    got = cuflash.flash_attention_backward(do, q, k, v, o, lse, backend="emulator",
                                           return_dbias=True, **opts)
    ref = reference.attention_backward(do, q, k, v, o, lse, return_dbias=True, **opts)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        assert g.shape == r.shape, name
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11, err_msg=name)


QUERY_BROADCAST_BIASES = [(2, 4, 1, 80), (1, 1, 1, 80), (1, 4, 1, 80), (2, 1, 1, 1)]


@pytest.mark.parametrize("bias_shape", QUERY_BROADCAST_BIASES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_emulated_backward_query_broadcast_dbias(bias_shape, causal):
    """A bias broadcast over the query rows (a key-padding bias): dbias is the dK/dV
    kernel's column sums of dS over every query row (two query tiles of 64, two key
    blocks), summed over heads and batch where the bias is shared; GQA, float64."""
    rng = np.random.default_rng(13)
    q, do = rand(rng, (2, 4, 70, 24)), rand(rng, (2, 4, 70, 24))
    k, v = rand(rng, (2, 2, 80, 24)), rand(rng, (2, 2, 80, 24))
    opts = dict(bias=rand(rng, bias_shape), causal=causal, softcap=2.0)
    o, lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    got = cuflash.flash_attention_backward(do, q, k, v, o, lse, backend="emulator",
                                           return_dbias=True, **opts)
    ref = reference.attention_backward(do, q, k, v, o, lse, return_dbias=True, **opts)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("bias_shape", [(2, 2, 1, 9), (1, 1, 1, 9), (1, 2, 1, 9)], ids=str)
def test_emulated_query_broadcast_dbias_finite_differences(bias_shape):
    """dbias of a query-broadcast bias against central differences of L = sum(O ∘ W)
    (float64, causal, GQA with two query heads on one K/V head)."""
    rng = np.random.default_rng(14)
    q, w = rand(rng, (2, 2, 6, 5)), rand(rng, (2, 2, 6, 5))
    k, v = rand(rng, (2, 1, 9, 5)), rand(rng, (2, 1, 9, 5))
    bias = rand(rng, bias_shape)

    def loss(b):
        return float(np.sum(cuflash.flash_attention(q, k, v, bias=b, causal=True,
                                                    backend="emulator") * w))

    o, lse = cuflash.flash_attention(q, k, v, bias=bias, causal=True, return_lse=True,
                                     backend="emulator")
    *_, dbias = cuflash.flash_attention_backward(w, q, k, v, o, lse, bias=bias, causal=True,
                                                 return_dbias=True, backend="emulator")
    eps, numeric = 1e-6, np.zeros_like(bias)
    for idx in np.ndindex(bias.shape):
        up, down = bias.copy(), bias.copy()
        up[idx] += eps
        down[idx] -= eps
        numeric[idx] = (loss(up) - loss(down)) / (2 * eps)
    assert np.abs(numeric).max() > 1e-3  # the keys are seen: the check is not vacuous
    np.testing.assert_allclose(dbias, numeric, rtol=1e-6, atol=1e-8)


def _plain_dbias(do, q, k, v, o, lse, bias, dtype):
    """dbias of a plain backward in `dtype` (no softcap: dbias = dS): S, P, dP, D and dS
    each stored in `dtype`, dS summed (in float64) over bias's broadcast axes, stored."""
    r = lambda x: round_to(x, dtype)  # noqa: E731
    do, q, k, v, o, bias = (np.asarray(x, np.float64) for x in (do, q, k, v, o, bias))
    s = r(r(q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])) + bias)
    p = r(np.exp(s - np.asarray(lse, np.float64)[..., None]))
    dp = r(do @ np.swapaxes(v, -1, -2))
    ds = r(p * (dp - r(np.sum(do * o, axis=-1, keepdims=True))))
    axes = tuple(a for a, n in enumerate(bias.shape) if n == 1 and ds.shape[a] != 1)
    return r(ds.sum(axis=axes, keepdims=True))


def test_emulated_query_broadcast_dbias_float16():
    """float16 inputs with a float16 key-padding bias: dbias comes back float16, within
    FlashAttention's gradient rule (3× a plain float16 backward's error) of the float64
    reference of the same (rounded) inputs."""
    rng = np.random.default_rng(15)
    q, do = (rand(rng, (1, 2, 70, 16), np.float16) for _ in range(2))
    k, v = (rand(rng, (1, 1, 80, 16), np.float16) for _ in range(2))
    bias = rand(rng, (1, 1, 1, 80), np.float16)
    o, lse = cuflash.flash_attention(q, k, v, bias=bias, return_lse=True, backend="emulator")
    *_, dbias = cuflash.flash_attention_backward(do, q, k, v, o, lse, bias=bias,
                                                 return_dbias=True, backend="emulator")
    f64 = [a.astype(np.float64) for a in (do, q, k, v, o)]
    ref = reference.attention_backward(*f64, lse.astype(np.float64),
                                       bias=bias.astype(np.float64), return_dbias=True)[3]
    assert dbias.dtype == np.float16 and dbias.shape == bias.shape
    plain = _plain_dbias(do, q, k, v, o, lse, bias, np.float16)
    assert_close_to_reference(dbias, ref, plain, np.float16, factor=3.0, what="dbias")


@pytest.mark.parametrize("query_axis", [True, False], ids=["bias-rows", "bias-query-broadcast"])
def test_emulated_backward_variants_checked_mode(query_axis):
    """Every option at once, GQA, bias shared by heads and batch, in checked mode: no race and
    no out-of-bounds access in either kernel (dbias's read-modify-writes in the dQ kernel,
    or the dK/dV kernel's column sums for a bias without its query axis)."""
    from cuflash.backends import kernel_backward
    from cuflash.backends.kernels import emulator_backend
    rng = np.random.default_rng(12)
    B, Hq, Hkv, Nq, Nk, d = 2, 2, 1, 19, 27, 20
    q, do = rand(rng, (B, Hq, Nq, d)), rand(rng, (B, Hq, Nq, d))
    k, v = rand(rng, (B, Hkv, Nk, d)), rand(rng, (B, Hkv, Nk, d))
    bias, mask = rand(rng, (1, 1, Nq if query_axis else 1, Nk)), rng.random((B, 1, Nq, Nk)) > 0.2
    slopes = rng.uniform(0.05, 0.5, (Hq,))
    opts = dict(causal=True, window=(6, -1), softcap=0.9, alibi_slopes=slopes, bias=bias,
                mask=mask, dropout_p=0.35, seed=77)
    o, lse = reference.naive_attention(q, k, v, return_lse=True, **opts)
    var = variants.Variants(window=(6, -1), softcap=0.9, alibi=slopes[None], bias=bias,
                            mask=mask, dropout_p=0.35, seed=77)
    got = kernel_backward.backward(emulator_backend(checked=True), do, q, k, v, o, lse,
                                   causal=True, scale=1 / math.sqrt(d), variants=var,
                                   return_dbias=True)
    ref = reference.attention_backward(do, q, k, v, o, lse, return_dbias=True, **opts)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11, err_msg=name)


def test_variants_and_dbias_take_the_tensor_core_backward():
    """The tensor-core backward runs every option and writes dbias
    (tests/test_kernels_tc_variants.py): the path does not depend on them."""
    from cuflash import tiling
    limits = dict(max_smem=163 * 1024, sm_count=108)
    (tc, _), why = tiling.backward_path(64, np.float16, (8, 0), **limits)
    assert tc.kernel == "flash_bwd_dkdv_tc" and why.startswith("tensor cores")
