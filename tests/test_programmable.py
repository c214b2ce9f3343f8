"""Programmable attention (cuflash.programmable): score_mod, mask_mod and block masks.

The reference applies the user's Python function itself to every score, one call per
(b, h, i, j) in plain Python and float64 — it never goes through the translator — and
takes ∂score_mod/∂score by central differences, so nothing expected comes from the code
under test. Buffer gradients are checked against finite differences of the loss.
"""
import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cuflash
from cuflash.programmable import block_mask, evaluate, translate
from cuflash.programmable.block_mask import BlockMask

from conftest import assert_close_to_reference, assert_lse_close, attention_inputs

NEG_INF = -np.inf


# ------------------------------------------------------------------ the reference
def _mod_scores(q, k, scale, score_mod, mask_mod):
    """(S after the mods, ∂score_mod/∂score), float64, one Python call per score."""
    B, Hq, Nq, _ = q.shape
    G = Hq // k.shape[1]
    S = np.einsum("bhid,bhjd->bhij", q.astype(np.float64),
                  np.repeat(k.astype(np.float64), G, axis=1)) * scale
    out, deriv = S.copy(), np.ones_like(S)
    for b, h, i, j in np.ndindex(S.shape):
        s = S[b, h, i, j]  # a float64 scalar: float32 buffers do not round it (NEP 50)
        if mask_mod is not None and not mask_mod(b, h, i, j):
            out[b, h, i, j], deriv[b, h, i, j] = NEG_INF, 0.0
        elif score_mod is not None:
            out[b, h, i, j] = score_mod(s, b, h, i, j)
            e = 1e-3 * max(1.0, abs(s))  # the five-point stencil: error O(e⁴)
            f = [score_mod(s + t * e, b, h, i, j) for t in (-2, -1, 1, 2)]
            deriv[b, h, i, j] = (f[0] - 8 * f[1] + 8 * f[2] - f[3]) / (12 * e)
    return out, deriv


def reference(q, k, v, do=None, *, scale, score_mod=None, mask_mod=None, p_dtype=None):
    """o, lse (and dq, dk, dv with do) of attention with the mods, float64. p_dtype rounds
    P before P·V and the gradients (a plain implementation in that precision, for
    FlashAttention's rule)."""
    S, deriv = _mod_scores(q, k, scale, score_mod, mask_mod)
    m = S.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    E = np.exp(S - m)
    l = E.sum(axis=-1, keepdims=True)
    P = np.where(l > 0, E / np.where(l > 0, l, 1), 0)
    G = q.shape[1] // k.shape[1]
    K, V = (np.repeat(x.astype(np.float64), G, axis=1) for x in (k, v))
    Pv = P if p_dtype is None else P.astype(p_dtype).astype(np.float64)
    o = Pv @ V
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)), NEG_INF)
    if do is None:
        return o, lse
    do = do.astype(np.float64)
    dP = do @ np.swapaxes(V, -1, -2)
    dS = P * (dP - (do * o).sum(-1, keepdims=True)) * deriv
    dq = dS @ K * scale
    dk = (np.swapaxes(dS, -1, -2) @ q.astype(np.float64) * scale)
    dv = np.swapaxes(P, -1, -2) @ do
    B, Hkv = k.shape[:2]
    fold = lambda x: x.reshape(B, Hkv, G, *x.shape[2:]).sum(axis=2)
    grads = dq, fold(dk), fold(dv)
    if p_dtype is not None:  # the plain implementation returns the dtype, as cuflash does
        grads = tuple(g.astype(p_dtype).astype(np.float64) for g in grads)
    return (o, lse) + grads


# ------------------------------------------------------------------ the examples
rng = np.random.default_rng(7)
NQ, NK, H = 130, 270, 2          # crosses the NumPy tiles (128 rows, 256 keys)

T5_BUCKETS, T5_MAX = 16, 64
t5_table = rng.standard_normal((H, T5_BUCKETS)).astype(np.float32)


def t5_bucket(rel):
    """T5's relative position bucket (bidirectional): exact near, logarithmic far."""
    n = T5_BUCKETS // 2
    side = np.where(rel > 0, n, 0)
    a = abs(rel)
    exact = n // 2
    far = exact + int(np.log(np.maximum(a, 1) / exact) / np.log(T5_MAX / exact) * (n - exact))
    return side + np.where(a < exact, a, np.minimum(far, n - 1))


def t5_bias(score, b, h, q_idx, kv_idx):
    return score + t5_table[h, t5_bucket(kv_idx - q_idx)]


doc_id = np.sort(rng.integers(0, 4, size=NK))


def document_mask(b, h, q_idx, kv_idx):
    return doc_id[q_idx + NK - NQ] == doc_id[kv_idx]


PREFIX = 40


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < PREFIX) | (kv_idx <= q_idx + NK - NQ)


SWIN = 6  # a 6 × 6 window of tokens: q_idx → (row, column)
swin_table = rng.standard_normal((H, (2 * SWIN - 1) ** 2)).astype(np.float32)


def swin_bias(score, b, h, q_idx, kv_idx):
    qy, qx = (q_idx % (SWIN * SWIN)) // SWIN, q_idx % SWIN
    ky, kx = (kv_idx % (SWIN * SWIN)) // SWIN, kv_idx % SWIN
    return score + swin_table[h, (qy - ky + SWIN - 1) * (2 * SWIN - 1) + qx - kx + SWIN - 1]


# float64: the reference computes with the arrays as captured, cuflash in the
# accumulation dtype (float64 for float64 inputs)
points = rng.standard_normal((NK, 3))
reach = np.array([0.5, 2.0])


def distance_bias(score, b, h, q_idx, kv_idx):
    i = q_idx + NK - NQ
    dx = points[i, 0] - points[kv_idx, 0]
    dy = points[i, 1] - points[kv_idx, 1]
    dz = points[i, 2] - points[kv_idx, 2]
    return score - np.sqrt(dx * dx + dy * dy + dz * dz + 1e-6) / reach[h]


EXAMPLES = {
    "t5": dict(score_mod=t5_bias),
    "document": dict(mask_mod=document_mask),
    "prefix_lm": dict(mask_mod=prefix_lm),
    "swin": dict(score_mod=swin_bias),
    "distance": dict(score_mod=distance_bias, mask_mod=document_mask),
}


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_examples_forward_backward(name, dtype):
    mods = EXAMPLES[name]
    q, k, v, do = attention_inputs(1, H, 1, NQ, NK, 32, dtype, seed=3)
    scale = 1 / math.sqrt(32)
    ref = reference(q, k, v, do, scale=scale, **mods)
    plain = None
    if dtype == np.float16:  # FlashAttention's rule: P rounded to float16 before P·V
        plain = reference(q, k, v, do, scale=scale, p_dtype=np.float16, **mods)
    o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **mods)
    assert o.dtype == dtype
    assert_close_to_reference(o, ref[0], None if plain is None else plain[0], dtype)
    assert_lse_close(lse, ref[1], dtype)
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, **mods)
    for g, r, p, what in zip(grads, ref[2:], (None,) * 3 if plain is None else plain[2:],
                             ("dq", "dk", "dv")):
        assert g.dtype == dtype
        assert_close_to_reference(g, r, p, dtype, factor=4.0, what=what)


@pytest.mark.parametrize("name,table", [("t5", "t5_table"), ("swin", "swin_table"),
                                        ("distance", "points"), ("distance", "reach")])
def test_buffer_gradients_match_finite_differences(name, table):
    mods = EXAMPLES[name]
    q, k, v, do = attention_inputs(1, H, 1, NQ, NK, 16, np.float64, seed=5)
    o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **mods)
    *_, grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, return_mod_grads=True,
                                                 **mods)
    arr = globals()[table]
    # every captured float array, and only those (doc_id is an integer array)
    assert set(grads) == {"t5": {"t5_table"}, "swin": {"swin_table"},
                          "distance": {"points", "reach"}}[name]
    g = grads[table]
    assert g.shape == arr.shape and g.dtype == arr.dtype
    saved = arr.copy()
    try:
        for idx in list(zip(*np.nonzero(np.abs(g) > 1e-3)))[:4] + [np.unravel_index(0, arr.shape)]:
            arr[idx] = saved[idx] + 1e-2
            up, e_up = float((cuflash.flash_attention(q, k, v, **mods) * do).sum()), arr[idx]
            arr[idx] = saved[idx] - 1e-2
            down, e_down = float((cuflash.flash_attention(q, k, v, **mods) * do).sum()), arr[idx]
            arr[idx] = saved[idx]
            fd = (up - down) / (float(e_up) - float(e_down))  # the steps float32 could store
            assert abs(g[idx] - fd) <= 2e-3 * max(1.0, abs(fd)), (idx, g[idx], fd)
    finally:
        arr[...] = saved


# ------------------------------------------------------------------ the built-ins, as mods
def _builtin_cases(Nq, Nk, Hq):
    off = Nk - Nq
    slopes = np.array([0.25, 0.5, 0.125, 1.0][:Hq], np.float64)
    bias = rng.standard_normal((2, Hq, Nq, Nk))
    cap = 5.0

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off

    def window(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx + off - 20) & (kv_idx <= q_idx + off + 7)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * np.tanh(score / cap)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx + off - kv_idx)

    def dense_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    def tanh(score, b, h, q_idx, kv_idx):   # softcap 1: the derivative reads the mod's value
        return np.tanh(score)

    return [(dict(causal=True), dict(mask_mod=causal)),
            (dict(window=(20, 7)), dict(mask_mod=window)),
            (dict(softcap=cap), dict(score_mod=softcap)),
            (dict(alibi_slopes=slopes), dict(score_mod=alibi)),
            (dict(bias=bias), dict(score_mod=dense_bias)),
            (dict(softcap=1.0), dict(score_mod=tanh))]


@pytest.mark.parametrize("case", range(6),
                         ids=["causal", "window", "softcap", "alibi", "bias", "tanh"])
def test_builtins_written_as_mods(case):
    q, k, v, do = attention_inputs(2, 4, 2, 150, 290, 16, np.float64, seed=case)
    builtin, mods = _builtin_cases(150, 290, 4)[case]
    o1, lse1 = cuflash.flash_attention(q, k, v, return_lse=True, **builtin)
    o2, lse2 = cuflash.flash_attention(q, k, v, return_lse=True, **mods)
    np.testing.assert_allclose(o2, o1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse2, lse1, rtol=1e-12, atol=1e-12)
    extra = dict(return_dbias=True) if "bias" in builtin else {}
    g1 = cuflash.flash_attention_backward(do, q, k, v, o1, lse1, **builtin, **extra)
    extra = dict(return_mod_grads=True) if "bias" in builtin else {}
    g2 = cuflash.flash_attention_backward(do, q, k, v, o1, lse1, **mods, **extra)
    for a, b in zip(g1[:3], g2[:3]):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
    if "bias" in builtin:  # dbias of the built-in = the score_mod's gradient of its bias
        np.testing.assert_allclose(g2[3]["bias"], g1[3], rtol=1e-10, atol=1e-12)


def test_mods_combine_with_builtins_and_gqa():
    """score_mod first, then the built-ins (softcap, causal), as docs/api.md orders them."""
    q, k, v, do = attention_inputs(1, 4, 2, 70, 90, 8, np.float64, seed=11)
    slopes = np.array([0.5, 0.25, 1.0, 0.125])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx + 20 - kv_idx)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 20

    o, lse = cuflash.flash_attention(q, k, v, score_mod=alibi, softcap=3.0, causal=True,
                                     return_lse=True)
    ref_o, ref_lse = cuflash.flash_attention(q, k, v, alibi_slopes=slopes, softcap=3.0,
                                             causal=True, return_lse=True, backend="numpy")
    # softcap after ALiBi as a score_mod differs from the built-in order (softcap first):
    # check against the reference written out instead.
    ref = reference(q, k, v, scale=1 / math.sqrt(8),
                    score_mod=lambda s, b, h, i, j: 3.0 * math.tanh(alibi(s, b, h, i, j) / 3.0),
                    mask_mod=causal)
    np.testing.assert_allclose(o, ref[0], rtol=1e-10, atol=1e-12)
    assert not np.allclose(o, ref_o)  # the order matters, and is the documented one


def test_mods_under_a_window_band():
    """A built-in window runs the band's tiles in runs of several blocks at once: the mods'
    indices must follow every block of a run."""
    q, k, v, do = attention_inputs(1, 2, 2, 600, 640, 8, np.float64, seed=12)
    o, lse = cuflash.flash_attention(q, k, v, score_mod=swin_bias, mask_mod=prefix_lm,
                                     window=(30, 0), return_lse=True)

    def window(b, h, i, j):
        return prefix_lm(b, h, i, j) and i + 40 - 30 <= j <= i + 40

    ref = reference(q, k, v, do, scale=1 / math.sqrt(8), score_mod=swin_bias, mask_mod=window)
    np.testing.assert_allclose(o, ref[0], rtol=1e-10, atol=1e-12)
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, score_mod=swin_bias,
                                             mask_mod=prefix_lm, window=(30, 0))
    for g, r in zip(grads, ref[2:]):
        np.testing.assert_allclose(g, r, rtol=1e-8, atol=1e-10)


# ------------------------------------------------------------------ block masks
def _count_blocks(monkeypatch):
    """Counts the score blocks the NumPy variant loops compute (every block goes
    through ScoreChain.hide once; the frozen forward's sample of the first keys, which
    is not a block of the loop, does not)."""
    from cuflash.backends.numpy_backend import variants as nv
    seen = []
    orig = nv.ScoreChain.hide

    def hide(self, S, bh, a0, c0, pred, shift, **kw):
        seen.append((bh, a0, c0, S.shape))
        return orig(self, S, bh, a0, c0, pred, shift, **kw)

    monkeypatch.setattr(nv.ScoreChain, "hide", hide)
    return seen


def test_block_mask_visits_only_nonempty_tiles(monkeypatch):
    N = 1024
    docs = np.repeat(np.arange(8), 128)  # eight documents of 128 tokens

    def doc(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - 256)

    q, k, v, do = attention_inputs(1, 2, 2, N, N, 16, np.float32, seed=1)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    for fn in (doc, sliding):
        # the tiles with any visible key, counted from the mask written out densely
        dense = np.broadcast_to(fn(0, 0, i, j), (N, N))
        expected = int(dense.reshape(8, 128, 8, 128).any(axis=(1, 3)).sum())
        assert expected < 8 * 8 // 2
        bm = block_mask(fn, None, None, N, N, block_size=128)
        assert int(np.sum(bm.kinds != 0)) == expected
        seen = _count_blocks(monkeypatch)
        o, lse = cuflash.flash_attention(q, k, v, block_mask=bm, return_lse=True)
        assert len(seen) == 2 * expected  # two K/V heads
        assert all(s[2:] == (128, 128) for *_, s in seen)
        seen.clear()
        cuflash.flash_attention_backward(do, q, k, v, o, lse, block_mask=bm)
        assert len(seen) == 2 * expected
        o_dense = cuflash.flash_attention(q, k, v, mask_mod=fn)
        np.testing.assert_allclose(o, o_dense, rtol=1e-6, atol=1e-6)
        monkeypatch.undo()


def test_block_mask_kinds_and_memory():
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    bm = block_mask(causal, 3, None, 300, 260, block_size=(128, 64))
    # rows 0-127, 128-255, 256-299 × keys in blocks of 64 (the last 4 wide), worked out:
    # row r sees keys 0..r; a block is full if its first row sees its last key.
    want = np.array([[1, 1, 0, 0, 0],      # rows 0-127: row 0 sees key 0 only
                     [2, 2, 1, 1, 0],      # rows 128-255: 128-191 and 192-255 partial
                     [2, 2, 2, 2, 1]], np.uint8)  # row 256 does not see keys 257-259
    assert bm.kinds.shape == (3, 1, 3, 5)
    for b in range(3):
        np.testing.assert_array_equal(bm.kinds[b, 0], want)
    assert bm.shape == (3, 1, 300, 260)
    assert "12 empty, 15 partial, 18 full tiles" in repr(bm)  # 3 × the counts of `want`


class _DeviceArray:
    """What translate and block_mask see of a CuPy array: a dtype, a shape, a
    __cuda_array_interface__ (no host memory NumPy could read) and .get()."""
    __cuda_array_interface__ = {}

    def __init__(self, a):
        self._a = a

    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)

    def get(self):
        return self._a.copy()


_docs_host = np.repeat(np.arange(4), 64)
_docs_device = _DeviceArray(_docs_host)


def test_block_mask_of_arrays_on_the_device():
    """A mask_mod over arrays on a GPU, evaluated on the host (backend="numpy"): block_mask
    reads them there (.get()), and keeps the mask_mod as captured (the kernels read the
    device arrays)."""
    def on_host(b, h, q_idx, kv_idx):
        return _docs_host[q_idx] == _docs_host[kv_idx]

    def on_device(b, h, q_idx, kv_idx):
        return _docs_device[q_idx] == _docs_device[kv_idx]

    want = block_mask(on_host, None, None, 256, 256, block_size=64)
    got = block_mask(on_device, None, None, 256, 256, block_size=64, backend="numpy")
    np.testing.assert_array_equal(got.kinds, want.kinds)
    assert got.mod.buffers["_docs_device"] is _docs_device


def test_block_mask_save_load(tmp_path):
    def doc(b, h, q_idx, kv_idx):
        return doc_id[q_idx] == doc_id[kv_idx]

    def other(b, h, q_idx, kv_idx):
        return doc_id[q_idx] != doc_id[kv_idx]

    bm = block_mask(doc, None, None, NK, NK, block_size=64)
    bm.save(tmp_path / "bm.npz")
    back = BlockMask.load(tmp_path / "bm.npz", doc)
    np.testing.assert_array_equal(back.kinds, bm.kinds)
    assert back.block == (64, 64) and (back.Nq, back.Nk) == (NK, NK)
    with pytest.raises(ValueError, match="made for another mask_mod than test_block_mask_save_load.<locals>.other"):
        BlockMask.load(tmp_path / "bm.npz", other)


def test_backward_is_bitwise_reproducible():
    q, k, v, do = attention_inputs(2, 4, 2, 200, 300, 16, np.float32, seed=2)
    o, lse = cuflash.flash_attention(q, k, v, score_mod=t5_like, return_lse=True)
    runs = [cuflash.flash_attention_backward(do, q, k, v, o, lse, score_mod=t5_like,
                                             return_mod_grads=True) for _ in range(4)]
    for r in runs[1:]:
        for a, b in zip(r[:3], runs[0][:3]):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(r[3]["table4"], runs[0][3]["table4"])


table4 = rng.standard_normal((4, 32)).astype(np.float32)


def t5_like(score, b, h, q_idx, kv_idx):
    return score + table4[h, min(abs(q_idx - kv_idx), 31)]


# ------------------------------------------------------------------ errors
def _loop(score, b, h, q_idx, kv_idx):
    for _ in range(2):
        score = score + 1
    return score


def _unknown_call(score, b, h, q_idx, kv_idx):
    return np.fft.fft(score)


def _keyword(score, b, h, q_idx, kv_idx):
    return np.clip(score, a_min=0, a_max=1)


def _three_args(b, h, q_idx):
    return True


def _mask_returns_int(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def _bare_array(score, b, h, q_idx, kv_idx):
    return score + t5_table


def _two_indices(score, b, h, q_idx, kv_idx):
    return score + points[q_idx]


def _float_index(score, b, h, q_idx, kv_idx):
    return score + reach[score]


def _out_of_range(score, b, h, q_idx, kv_idx):
    return score + reach[q_idx]


def _line(fn, offset):
    return f"test_programmable.py, line {fn.__code__.co_firstlineno + offset}"


@pytest.mark.parametrize("fn,role,cls,message", [
    (_loop, "score_mod", TypeError, "`for` is not supported"),
    (_unknown_call, "score_mod", TypeError,
     "only functions by name and NumPy's / math's functions (np.exp) can be called"),
    (_keyword, "score_mod", TypeError, "keyword arguments are not supported"),
    (_three_args, "mask_mod", TypeError,
     "must take 4 arguments (b, h, q_idx, kv_idx); it takes 3"),
    (_mask_returns_int, "mask_mod", TypeError,
     "must return a boolean (True: may attend); it returns an integer"),
    (_bare_array, "score_mod", TypeError, "the captured array `t5_table` must be indexed"),
    (_two_indices, "score_mod", ValueError, "`points` has 2 dimensions and takes 2 indices; got 1"),
    (_float_index, "score_mod", TypeError, "`reach` must be indexed by integers"),
])
def test_bad_functions(fn, role, cls, message):
    with pytest.raises(cls) as e:
        translate(fn, role)
    assert message in str(e.value)
    assert fn.__qualname__ in str(e.value)
    if fn not in (_three_args,):
        assert "test_programmable.py, line" in str(e.value)
    if cls is TypeError and fn not in (_three_args, _mask_returns_int):
        assert "Allowed: arithmetic" in str(e.value)


def test_error_names_the_line():
    with pytest.raises(TypeError, match=_line(_loop, 1)):
        translate(_loop, "score_mod")
    with pytest.raises(TypeError, match=_line(_keyword, 1)):
        translate(_keyword, "score_mod")


def test_bad_buffers_and_calls():
    q, k, v, do = attention_inputs(1, 2, 2, 10, 12, 8, np.float32)
    with pytest.raises(ValueError, match=r"_out_of_range \(.*\): index 9 is out of range for "
                                         r"axis 0 of `reach` \(size 2\)"):
        cuflash.flash_attention(q, k, v, score_mod=_out_of_range)
    bm = block_mask(prefix_lm, None, None, 10, 12)
    with pytest.raises(ValueError, match=r"block_mask is taken by algorithm='fa2' \(the "
                                         r"default\); got algorithm='fa1'"):
        cuflash.flash_attention(q, k, v, block_mask=bm, backend="emulator", algorithm="fa1")
    o, lse = cuflash.flash_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="return_mod_grads=True needs a score_mod"):
        cuflash.flash_attention_backward(do, q, k, v, o, lse, return_mod_grads=True)
    with pytest.raises(ValueError, match=r"block_mask was made for \(B, H, Nq, Nk\) = "
                                         r"\(1, 1, 10, 12\) \(1: any\); this call has "
                                         r"\(1, 2, 10, 13\)"):
        cuflash.flash_attention(q, np.concatenate([k, k[:, :, :1]], 2),
                                np.concatenate([v, v[:, :, :1]], 2), block_mask=bm)
    with pytest.raises(ValueError, match="mask_mod document_mask is not the mask_mod "
                                         "block_mask was made with"):
        cuflash.flash_attention(q, k, v, block_mask=bm, mask_mod=document_mask)
    with pytest.raises(TypeError, match="block_mask must be a cuflash.block_mask"):
        cuflash.flash_attention(q, k, v, block_mask=np.ones(3))
    with pytest.raises(TypeError, match="score_mod must be a Python function"):
        cuflash.flash_attention(q, k, v, score_mod=np.exp)


def test_translation_is_shared_by_equal_functions():
    """The specialization key depends on the expression and buffer dtypes only."""
    def a(score, b, h, q_idx, kv_idx):
        x = table4[h, 0]
        return score + x

    def b_(score, b, h, q_idx, kv_idx):
        return score + table4[h, 0]

    assert translate(a, "score_mod").key() == translate(b_, "score_mod").key()
    assert translate(a, "score_mod").key() != translate(t5_like, "score_mod").key()

    def closing_over(tab):
        def f(score, b, h, q_idx, kv_idx):
            return score + tab[h, 0]
        return f

    same = [translate(closing_over(t), "score_mod").key() for t in
            (np.zeros((4, 2), np.float32), np.ones((4, 2), np.float32),
             np.zeros((4, 2), np.float64))]
    assert same[0] == same[1] != same[2]   # the values are read at run time, the dtype compiled


# ------------------------------------------------------------------ the evaluator's shortcuts
rel_table = rng.standard_normal((4, 64))


def relative(score, b, h, q_idx, kv_idx):
    return score + rel_table[h, min(abs(q_idx - kv_idx) // 16, 63)]


def test_relative_parts_are_reused_only_at_their_offset():
    """The bucket of q_idx − kv_idx is computed once per tile offset and reused: against
    the built-in dense bias it stands for (tiles of one shape at many offsets)."""
    q, k, v, do = attention_inputs(1, 4, 2, 1100, 1300, 16, np.float64, seed=8)
    i, j = np.arange(1100)[:, None], np.arange(1300)[None, :]
    dense = rel_table[:, np.minimum(np.abs(i - j) // 16, 63)][None]
    for causal in (False, True):
        o, lse = cuflash.flash_attention(q, k, v, score_mod=relative, causal=causal,
                                         return_lse=True)
        o_ref, lse_ref = cuflash.flash_attention(q, k, v, bias=dense, causal=causal,
                                                 return_lse=True)
        np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
        g = cuflash.flash_attention_backward(do, q, k, v, o, lse, score_mod=relative,
                                             causal=causal, return_mod_grads=True)
        g_ref = cuflash.flash_attention_backward(do, q, k, v, o_ref, lse_ref, bias=dense,
                                                 causal=causal, return_dbias=True)
        for a, b in zip(g[:3], g_ref[:3]):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
        per_bucket = np.zeros_like(rel_table)
        np.add.at(per_bucket, (np.arange(4)[:, None, None],
                               np.minimum(np.abs(i - j) // 16, 63)[None]), g_ref[3][0])
        np.testing.assert_allclose(g[3]["rel_table"], per_bucket, rtol=1e-9, atol=1e-12)


def test_integer_ranges_worked_out():
    from cuflash.programmable.ranges import int_ranges

    small = np.array([3, -2, 7])

    def f(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) * 3 // 4 + abs(kv_idx - 5) % 4 + small[h] * q_idx

    m = translate(f, "score_mod")
    ranges = int_ranges(m.expr.walk(), {"b": (0, 0), "h": (0, 2), "q_idx": (0, 9),
                                        "kv_idx": (0, 19)}, {"small": (-2, 7)})
    got = [(n.op + ("" if n.value is None else f":{n.value}"), ranges[id(n)])
           for n in m.expr.walk() if n.kind == "int"]
    for want in [("sub", (-19, 9)),            # q − kv
                 ("mul", (-57, 27)),           # (q − kv)·3
                 ("floordiv", (-15, 6)),       # floor(−57/4) = −15, floor(27/4) = 6
                 ("sub", (-5, 14)),            # kv − 5
                 ("call:abs", (0, 14)),
                 ("mod", (0, 3)),              # a % 4 of a ≥ 0
                 ("index:small", (-2, 7)),
                 ("mul", (-18, 63))]:          # small[h]·q: −2·9 … 7·9
        assert want in got, (want, got)


def _shifted(score, b, h, q_idx, kv_idx):
    return score + ten[q_idx + 5]


ten = np.arange(10.0)


def test_an_index_out_of_range_through_arithmetic():
    q, k, v, _ = attention_inputs(1, 1, 1, 10, 12, 8, np.float64)
    with pytest.raises(ValueError, match=r"index 14 is out of range for axis 0 of `ten`"):
        cuflash.flash_attention(q, k, v, score_mod=_shifted)


# ------------------------------------------------ the NumPy variant forward's frozen reference
frozen_table = rng.standard_normal((4, 64)).astype(np.float32)
doc_ids = np.repeat(np.arange(6), 60)[:340]


def table_mod(score, b, h, q_idx, kv_idx):
    return score + frozen_table[h, min(abs(q_idx - kv_idx) // 8, 63)]


def capped_mod(score, b, h, q_idx, kv_idx):
    return 30.0 * np.tanh(score / 30.0)


def document(b, h, q_idx, kv_idx):
    return doc_ids[q_idx] == doc_ids[kv_idx]


def down_200(score, b, h, q_idx, kv_idx):
    return score - 200.0


def _fills(monkeypatch, config):
    """The NumPy backend run with `config`; returns the list of fills ScoreChain.hide
    writes, in call order: 0 for the frozen forward's probabilities, −inf for the
    running max's scores."""
    from cuflash.backends import numpy_backend as nb
    from cuflash.backends.numpy_backend import variants as nv
    monkeypatch.setattr(nb.BACKEND, "config", config)
    fills, hide = [], nv.ScoreChain.hide

    def recorded(self, S, bh, a0, c0, pred, shift, fill=-np.inf, **kw):
        fills.append(fill)
        return hide(self, S, bh, a0, c0, pred, shift, fill=fill, **kw)

    monkeypatch.setattr(nv.ScoreChain, "hide", recorded)
    return fills


FROZEN_CASES = {
    "softcap": dict(softcap=5.0),
    "alibi causal": dict(alibi_slopes=np.linspace(0.1, 2.0, 4), causal=True),
    "bias window": dict(bias=rng.standard_normal((1, 4, 300, 340)).astype(np.float32) * 3,
                        window=(70, 20)),
    "softcap alibi mask": dict(softcap=3.0, alibi_slopes=np.full(4, 0.3),
                               mask=rng.random((300, 340)) > 0.2),
    "table score_mod": dict(score_mod=table_mod, causal=True),
    "capped score_mod": dict(score_mod=capped_mod),
    "document mask_mod": dict(mask_mod=document),
    "document block_mask": dict(block_mask=block_mask(document, None, None, 300, 340,
                                                      block_size=64)),
}


@pytest.mark.parametrize("base", ["2", "e"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("case", FROZEN_CASES, ids=str)
def test_variant_forward_frozen_reference(monkeypatch, case, dtype, base):
    """The variants' forward takes a frozen reference (no max, rescale or row sum per
    step) and gives the running max's result to rounding, in either base."""
    import dataclasses
    from cuflash.backends.numpy_backend import config as cfg
    from cuflash.backends.numpy_backend.expbase import BASE_2, BASE_E
    q, k, v, _ = attention_inputs(1, 4, 2, 300, 340, 32, dtype, seed=11)
    q *= 2   # scores up to ~15: a reference that matters
    kw = FROZEN_CASES[case]
    config = dataclasses.replace(cfg.DEFAULT_CONFIG, base=BASE_2 if base == "2" else BASE_E)
    fills = _fills(monkeypatch, dataclasses.replace(config, frozen_max=False))
    o_ref, lse_ref = cuflash.flash_attention(q, k, v, return_lse=True, **kw)
    assert fills and set(fills) == {-np.inf}
    fills = _fills(monkeypatch, config)
    o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **kw)
    assert fills and set(fills) == {0}, "the frozen reference did not serve every tile"
    tol = 2e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(o, o_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, lse_ref, rtol=tol, atol=tol)


def test_variant_forward_frozen_reference_hands_over(monkeypatch):
    """Where the reference cannot serve — scores far above the first keys' (a bias, a
    softcap wider than exp's range), far below them (a score_mod's shift), a row whose
    keys a bias hides, NaN — the tile falls back to the running max, and the result is
    the reference's."""
    from cuflash.backends.numpy_backend import config as cfg
    q, k, v, _ = attention_inputs(1, 2, 2, 40, 90, 16, np.float32, seed=12)
    late = np.zeros((1, 1, 40, 90), np.float32)
    late[..., 70:] = 300.0                          # past the first keys' sample: overflow
    hidden = np.zeros((1, 1, 40, 90), np.float32)
    hidden[..., 5, :] = -np.inf                      # row 5 sees no key
    q_nan = q.copy()
    q_nan[0, 1, 7, 3] = np.nan
    for qq, kw, ref_kw in ((q, dict(bias=late), dict(bias=late)),
                           (q * 30, dict(softcap=300.0), dict(softcap=300.0)),
                           (q, dict(score_mod=down_200), dict(bias=np.full(late.shape, -200.0))),
                           (q, dict(bias=hidden), dict(bias=hidden)),
                           (q_nan, dict(softcap=5.0), dict(softcap=5.0))):
        fills = _fills(monkeypatch, cfg.DEFAULT_CONFIG)
        o, lse = cuflash.flash_attention(qq, k, v, return_lse=True, **kw)
        assert 0 in fills and -np.inf in fills, f"{list(kw)}: no hand-over"
        o_ref, lse_ref = cuflash.reference.naive_attention(
            qq.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
            return_lse=True, **ref_kw)
        np.testing.assert_array_equal(np.isnan(o), np.isnan(o_ref))
        ok = ~np.isnan(o_ref)
        np.testing.assert_allclose(o[ok], o_ref[ok], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        ok = np.isfinite(lse_ref)
        np.testing.assert_allclose(lse[ok], lse_ref[ok], rtol=1e-5, atol=1e-4)


def test_evaluating_a_mod_leaves_no_garbage_cycles():
    """A mod's value and gradients on a tile free their intermediate tiles at once (no
    reference cycles for the garbage collector to find later: with strips of a big
    block mask they piled up to hundreds of MiB)."""
    import gc

    from cuflash.programmable.evaluate import Bound
    bound = Bound(translate(relative, "score_mod"), np.float64,
                  {"b": (0, 0), "h": (0, 3), "q_idx": (0, 999), "kv_idx": (0, 999)})
    env = {"b": np.int64(0), "h": np.arange(4)[None, :, None, None],
           "q_idx": np.arange(100, 164)[None, None, :, None],
           "kv_idx": np.arange(300, 428)[None, None, None, :],
           "score": rng.standard_normal((1, 4, 64, 128))}
    def made_here(o):  # a tile, an evaluator object, a closure or frame of cuflash's
        code = getattr(o, "__code__", None) or getattr(o, "f_code", None)
        return (isinstance(o, np.ndarray) or type(o).__module__.startswith("cuflash")
                or (code is not None and "cuflash" in code.co_filename))

    def ours(o):  # arrays are not tracked by the collector: what holds one counts too
        return made_here(o) or any(made_here(r) for r in gc.get_referents(o))

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)   # what a collection finds stays in gc.garbage
    # Held, every object older than the evaluation stays alive: what other tests or
    # threads drop meanwhile (a figure, a Dask cluster) cannot turn up as garbage here.
    older = gc.get_objects()
    try:
        for tile in (None, (100 - 300, 64, 128)):
            bound.value(env, tile=tile)
            bound.gradients(env, np.ones((1, 4, 64, 128)), tile=tile)
            gc.collect()
            assert not [o for o in gc.garbage if ours(o)]
            gc.garbage.clear()
    finally:
        del older
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def shared_reads(score, b, h, q_idx, kv_idx):
    x = score * 0.5 + kv_idx * 0.01     # a tile two nodes read
    return np.tanh(x) + x + np.tanh(score) * score    # the score read twice as well


def test_tiles_read_twice_are_not_overwritten():
    """The forward computes a score_mod in place where a tile has one reader; a tile read
    by two nodes (here x, and the score) keeps its value for the second."""
    q, k, v, do = attention_inputs(1, 2, 1, 70, 300, 16, np.float64, seed=13)
    o, lse = cuflash.flash_attention(q, k, v, score_mod=shared_reads, return_lse=True)
    ref_o, ref_lse = reference(q, k, v, scale=16 ** -0.5, score_mod=shared_reads)
    np.testing.assert_allclose(o, ref_o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)
    *grads, = cuflash.flash_attention_backward(do, q, k, v, o, lse, score_mod=shared_reads)
    for g, r in zip(grads, reference(q, k, v, do, scale=16 ** -0.5, score_mod=shared_reads)[2:]):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-8)


# Arrays read at indices affine in the positions (a view of the array, not a gather), in
# every arrangement: reversed, offset, axes swapped, a constant index; and one not affine.
_TRANSPOSED = rng.standard_normal((300, 2, 3, 100))
_SQUARES = rng.standard_normal((4, 300))


def reversed_offset_bias(score, b, h, q_idx, kv_idx):
    return score + _TRANSPOSED[kv_idx + 10, b, 2 - h, 99 - q_idx] * _SQUARES[1, q_idx]


def squares_bias(score, b, h, q_idx, kv_idx):       # q_idx² % 4: no stride reads it
    return score + _SQUARES[(q_idx * q_idx) % 4, kv_idx]


@pytest.mark.parametrize("mod", [reversed_offset_bias, squares_bias],
                         ids=["affine", "not-affine"])
@pytest.mark.parametrize("band", [{}, dict(causal=True), dict(window=(17, 5))],
                         ids=["full", "causal", "window"])
def test_reads_at_affine_indices(mod, band):
    """Captured arrays read at positions affine in b, h, q_idx and kv_idx are strided views
    of the arrays: the values equal the reference's, in runs of several blocks (causal,
    window) too, and neither pass writes the arrays."""
    q, k, v, do = attention_inputs(2, 2, 2, 100, 290, 8, np.float64, seed=15)
    saved = _TRANSPOSED.copy(), _SQUARES.copy()
    o, lse = cuflash.flash_attention(q, k, v, score_mod=mod, return_lse=True, **band)
    mask = {"causal": lambda b, h, i, j: j <= i + 190,
            "window": lambda b, h, i, j: i + 190 - 17 <= j <= i + 190 + 5}
    ref = reference(q, k, v, do, scale=8 ** -0.5, score_mod=mod,
                    mask_mod=mask[next(iter(band))] if band else None)
    np.testing.assert_allclose(o, ref[0], rtol=1e-10, atol=1e-12)
    grads = cuflash.flash_attention_backward(do, q, k, v, o, lse, score_mod=mod,
                                             return_mod_grads=True, **band)
    for g, r in zip(grads, ref[2:]):
        np.testing.assert_allclose(g, r, rtol=1e-8, atol=1e-10)
    np.testing.assert_array_equal(_TRANSPOSED, saved[0])
    np.testing.assert_array_equal(_SQUARES, saved[1])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_strided_reads_equal_gathers(data):
    """evaluate._strided_read against NumPy's own fancy indexing: index arrays affine in the
    result's axes (any steps, negative ones too, broadcast axes, scalars) give a view with
    the gather's values; others (a permuted range) give None, never wrong values."""
    rank = data.draw(st.integers(1, 4), label="rank")
    arr = np.arange(math.prod(shape := data.draw(st.lists(st.integers(1, 6), min_size=rank,
                                                          max_size=rank), label="shape")),
                    dtype=np.float32).reshape(shape)
    out_rank = data.draw(st.integers(1, 4), label="result rank")
    out = data.draw(st.lists(st.integers(1, 5), min_size=out_rank, max_size=out_rank),
                    label="result shape")
    idx, affine = [], True
    for n in shape:
        axes = data.draw(st.lists(st.integers(0, out_rank - 1), max_size=2, unique=True))
        i = np.zeros([1] * out_rank, np.int64)
        for a in axes:   # first + step · x_a along result axis a, kept inside [0, n)
            step = data.draw(st.integers(-2, 2))
            x = np.arange(out[a]).reshape([out[a] if b == a else 1 for b in range(out_rank)])
            i = i + step * x
        i = i - i.min() + data.draw(st.integers(0, max(0, n - 1 - int(i.max() - i.min()))))
        if i.max() >= n:
            i = np.clip(i, 0, n - 1)   # clipped: not affine any more (or still, if flat)
        if data.draw(st.booleans()) and i.size > 2:    # a permutation: not affine
            i = np.ascontiguousarray(np.random.default_rng(i.size).permutation(i.ravel())
                                     .reshape(i.shape))
        idx.append(np.int64(i.ravel()[0]) if i.size == 1 and data.draw(st.booleans()) else i)
    result = np.broadcast_shapes(*(np.shape(i) for i in idx))
    steps = [st_ // arr.itemsize for st_ in arr.strides]
    with mock.patch.object(evaluate, "_AFFINE_SHARE", 0):   # every index tested, small or not
        view = evaluate._strided_read(arr, idx, steps, result)
    gather = arr[tuple(np.broadcast_to(i, result) for i in idx)]
    if view is not None:
        assert not view.flags.writeable
        np.testing.assert_array_equal(view, gather)


def test_strided_reads_view_affine_indices_only():
    """Both outcomes of the property above, drawn for certain: a bias read at (h, q_idx,
    kv_idx) reversed along the rows is a view of the bias; a permuted row index is not."""
    bias = np.arange(2 * 40 * 40, dtype=np.float32).reshape(2, 40, 40)
    h, rows, cols = np.int64(1), 39 - np.arange(16)[:, None], np.arange(3, 19)[None, :]
    view = evaluate._strided_read(bias, (h, rows, cols), [1600, 40, 1], (16, 16))
    assert view is not None and np.shares_memory(view, bias)
    np.testing.assert_array_equal(view, bias[1, rows, cols])
    shuffled = np.random.default_rng(0).permutation(16)[:, None]
    assert evaluate._strided_read(bias, (h, shuffled, cols), [1600, 40, 1], (16, 16)) is None


def test_relative_parts_follow_their_arrays_across_calls():
    """The relative parts are kept from call to call, by the values of the arrays they read:
    an array changed in place (a training step) is read anew, and equal values give the
    same result."""
    from cuflash.programmable import evaluate
    q, k, v, _ = attention_inputs(1, 4, 2, 200, 300, 16, np.float64, seed=14)
    saved = rel_table.copy()
    try:
        first = cuflash.flash_attention(q, k, v, score_mod=relative)
        assert any(key[0] is not None for key in evaluate._KEPT_DIAGONALS)
        rel_table[1, :5] += 3.0                      # in place, as an optimizer step would
        i, j = np.arange(200)[:, None], np.arange(300)[None, :]
        dense = rel_table[:, np.minimum(np.abs(i - j) // 16, 63)][None]
        second = cuflash.flash_attention(q, k, v, score_mod=relative)
        np.testing.assert_allclose(second, cuflash.flash_attention(q, k, v, bias=dense),
                                   rtol=1e-12, atol=1e-12)
        assert not np.allclose(first, second)
        rel_table[...] = saved
        np.testing.assert_array_equal(cuflash.flash_attention(q, k, v, score_mod=relative),
                                      first)
    finally:
        rel_table[...] = saved


sweep_table = rng.standard_normal((4, 40)).astype(np.float32)


def sweep_relative(score, b, h, q_idx, kv_idx):
    return score + sweep_table[h, min(abs(q_idx - kv_idx) // 8, 39)]


def sweep_capped(score, b, h, q_idx, kv_idx):
    return 3.0 * np.tanh(score / 3.0)


def sweep_scaled(score, b, h, q_idx, kv_idx):   # the score read once, and the result, scaled
    return 1.5 * score


def sweep_mask(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx) % 3 != 0


def test_variant_forward_frozen_reference_random_combinations(monkeypatch):
    """Random sizes, GQA, dtypes and combinations of every option and mod: the frozen
    reference's forward (whichever tiles it serves) gives the running max's result."""
    import dataclasses
    from cuflash.backends import numpy_backend as nb
    base = nb.BACKEND.config
    r = np.random.default_rng(123)
    for trial in range(40):
        dtype = (np.float16, np.float32, np.float64)[trial % 3]
        Hq = int(r.choice([1, 2, 4]))
        Hkv = int(r.choice([h for h in (1, 2, 4) if Hq % h == 0]))
        Nq, Nk, d = int(r.integers(1, 300)), int(r.integers(1, 300)), int(r.choice([8, 40]))
        q = (r.standard_normal((1, Hq, Nq, d)) * r.choice([0.5, 2, 5])).astype(dtype)
        k, v = (r.standard_normal((1, Hkv, Nk, d)).astype(dtype) for _ in range(2))
        kw = {}
        if r.random() < 0.4:
            kw["causal"] = True
        if r.random() < 0.3:
            kw["window"] = (int(r.integers(0, 50)), int(r.integers(-1, 50)))
        if r.random() < 0.3:
            kw["softcap"] = float(r.choice([1.0, 5.0, 30.0]))
        if r.random() < 0.3:
            kw["alibi_slopes"] = r.uniform(0.01, 2, Hq)
        if r.random() < 0.3:
            kw["bias"] = (r.standard_normal((1, Hq, Nq, Nk)) * r.choice([1, 10])).astype(np.float32)
        if r.random() < 0.2:
            kw["mask"] = r.random((Nq, Nk)) > 0.3
        kw["score_mod"] = (sweep_relative, sweep_capped, sweep_scaled, None, None,
                           None)[int(r.integers(6))]
        kw["mask_mod"] = sweep_mask if r.random() < 0.2 else None
        monkeypatch.setattr(nb.BACKEND, "config", base)
        o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **kw)
        monkeypatch.setattr(nb.BACKEND, "config", dataclasses.replace(base, frozen_max=False))
        o_ref, lse_ref = cuflash.flash_attention(q, k, v, return_lse=True, **kw)
        tol = {np.float16: 2e-3, np.float32: 3e-5, np.float64: 1e-12}[dtype]
        where = f"trial {trial}: {dtype.__name__}, {(Hq, Hkv, Nq, Nk, d)}, {sorted(kw)}"
        np.testing.assert_allclose(o.astype(np.float64), o_ref.astype(np.float64), rtol=tol,
                                   atol=tol * max(1.0, float(np.abs(o_ref).max(initial=0))),
                                   err_msg=where)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg=where)
        ok = np.isfinite(lse_ref)
        np.testing.assert_allclose(lse[ok], lse_ref[ok], rtol=tol, atol=10 * tol, err_msg=where)
