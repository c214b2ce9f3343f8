"""Input handling at the API's edges: index arguments of the serving functions in any
integer form, the order of the bias and mask checks, and the exact zeros of empty
sequences in the varlen backward (against the float64 reference)."""
import numpy as np
import pytest

import cuflash
from cuflash import reference
from conftest import assert_close_to_reference, packed, seqs, to_backend, to_host


# -- index arguments: any integer array-like within int32 -------------------------------

INDEX_FORMS = {
    "int32": lambda a: np.asarray(a, np.int32),
    "int64": lambda a: np.asarray(a, np.int64),
    "uint16": lambda a: np.asarray(a, np.uint16),
    "list": lambda a: np.asarray(a).tolist(),
    "tuple": lambda a: tuple(np.asarray(a).tolist()),
    "list of numpy ints": lambda a: list(np.asarray(a, np.int64)),
}


@pytest.mark.parametrize("form", INDEX_FORMS)
def test_varlen_takes_any_integer_cu_seqlens(form):
    rng = np.random.default_rng(1)
    q, k, v, cq, ck = packed(rng, [3, 0, 5], [4, 2, 6], 2, 1, 8, np.float64)
    do = rng.uniform(-1, 1, q.shape)
    o, lse = cuflash.flash_attention_varlen(q, k, v, cq, ck, causal=True, return_lse=True)
    grads = cuflash.flash_attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=True)
    as_form = INDEX_FORMS[form]
    o2, lse2 = cuflash.flash_attention_varlen(q, k, v, as_form(cq), as_form(ck), causal=True,
                                              return_lse=True)
    grads2 = cuflash.flash_attention_varlen_backward(do, q, k, v, o, lse, as_form(cq),
                                                     as_form(ck), causal=True)
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(lse2, lse)
    for g2, g in zip(grads2, grads):
        np.testing.assert_array_equal(g2, g)


def test_varlen_int64_cu_seqlens_on_the_emulator():
    rng = np.random.default_rng(2)
    q, k, v, cq, ck = packed(rng, [3, 0, 5], [4, 2, 6], 2, 1, 16, np.float32)
    o = cuflash.flash_attention_varlen(q, k, v, cq.tolist(), ck.astype(np.int64),
                                       causal=True, backend="emulator")
    for sq, sk in zip(seqs(cq), seqs(ck)):
        if sq.start == sq.stop:
            continue
        ref = reference.naive_attention(q[:, sq], k[:, sk], v[:, sk], causal=True)
        assert_close_to_reference(o[:, sq], ref, None, np.float32)


def cache_case():
    rng = np.random.default_rng(3)
    B, hq, hkv, page, d = 2, 2, 1, 4, 8
    q = rng.uniform(-1, 1, (B, hq, 1, d)).astype(np.float32)
    kc = rng.uniform(-1, 1, (5, hkv, page, d)).astype(np.float32)   # 5 pages of 4 keys
    vc = rng.uniform(-1, 1, kc.shape).astype(np.float32)
    table = np.array([[3, 0], [1, 4]], np.int32)
    return q, kc, vc, np.array([6, 3], np.int32), table


@pytest.mark.parametrize("form", INDEX_FORMS)
def test_kvcache_takes_any_integer_cache_seqlens_and_block_table(form):
    q, kc, vc, lens, table = cache_case()
    as_form = INDEX_FORMS[form]
    want = cuflash.flash_attention_with_kvcache(q, kc, vc, lens, block_table=table)
    got = cuflash.flash_attention_with_kvcache(q, kc, vc, as_form(lens),
                                               block_table=as_form(table))
    np.testing.assert_array_equal(got, want)
    for b in range(2):   # and against the reference over row b's pages
        pos = np.arange(lens[b])
        keys = kc[table[b, pos // 4], :, pos % 4].transpose(1, 0, 2)
        vals = vc[table[b, pos // 4], :, pos % 4].transpose(1, 0, 2)
        assert_close_to_reference(got[b], reference.naive_attention(q[b], keys, vals),
                                  None, np.float32)


@pytest.mark.parametrize("seqlens", [3, np.int64(3), np.array(3, np.uint8)])
def test_kvcache_takes_one_int_for_every_row(seqlens):
    q, kc, vc, _, table = cache_case()
    want = cuflash.flash_attention_with_kvcache(q, kc, vc, np.array([3, 3], np.int32),
                                               block_table=table)
    got = cuflash.flash_attention_with_kvcache(q, kc, vc, seqlens, block_table=table)
    np.testing.assert_array_equal(got, want)


BIG = 2 ** 31


def varlen_call(cq=(0, 3, 8), ck=(0, 4, 10)):
    q = np.zeros((2, 8, 16), np.float32)
    k = np.zeros((2, 10, 16), np.float32)
    return lambda: cuflash.flash_attention_varlen(q, k, k, cq, ck)


def cache_call(lens=None, table=None):
    q, kc, vc, lens0, table0 = cache_case()
    lens = lens0 if lens is None else lens
    table = table0 if table is None else table
    return lambda: cuflash.flash_attention_with_kvcache(q, kc, vc, lens, block_table=table)


INT32_RANGE = r"\[-2147483648, 2147483647\]"
INTEGERS = "must be an integer array"
INT_OR_INTEGERS = "must be an int or an integer array"
INDEX_ERRORS = [
    (varlen_call(cq=np.array([0, 3, 8.0])), TypeError,
     rf"cu_seqlens_q {INTEGERS} .*; got numpy.ndarray, shape \(3,\), dtype float64"),
    (varlen_call(ck=[0, 4.5, 10]), TypeError, rf"cu_seqlens_k {INTEGERS} .*; got \[0, 4.5, 10\]"),
    (varlen_call(ck=np.array([0, 1, 1], bool)), TypeError, rf"cu_seqlens_k {INTEGERS} .* dtype bool"),
    (varlen_call(cq=[0, [3], 8]), TypeError, rf"cu_seqlens_q {INTEGERS}"),
    (varlen_call(cq=None), TypeError, rf"cu_seqlens_q {INTEGERS} .*; got None"),
    (varlen_call(cq=np.array([0, 3, BIG], np.int64)), ValueError,
     rf"cu_seqlens_q\[2\] = 2147483648 does not fit in int32: the values must be in {INT32_RANGE}"),
    (varlen_call(ck=np.array([0, 4, 2 ** 64 - 1], np.uint64)), ValueError,
     r"cu_seqlens_k\[2\] = 18446744073709551615 does not fit in int32"),
    (varlen_call(ck=[0, 4, 2 ** 80]), ValueError,
     rf"cu_seqlens_k\[2\] = {2 ** 80} does not fit in int32"),
    (varlen_call(cq=[[0, 3, 8]]), ValueError, r"cu_seqlens_q must be 1-D; got shape \(1, 3\)"),
    (cache_call(lens=[3.0, 2.0]), TypeError, rf"cache_seqlens {INT_OR_INTEGERS} .*; got \[3.0, 2.0\]"),
    (cache_call(lens=True), TypeError, rf"cache_seqlens {INT_OR_INTEGERS} .*; got True"),
    (cache_call(lens=np.array(3.0)), TypeError, rf"cache_seqlens {INT_OR_INTEGERS}"),
    (cache_call(lens=BIG), ValueError,
     rf"cache_seqlens = 2147483648 does not fit in int32: the values must be in {INT32_RANGE}"),
    (cache_call(lens=[3, -BIG - 1]), ValueError, r"cache_seqlens\[1\] = -2147483649 does not fit"),
    (cache_call(lens=[3, 2, 1]), ValueError,
     r"cache_seqlens must have one entry per batch row \(B = 2\); got shape \(3,\)"),
    (cache_call(table=np.array([[3, 0], [1, 4]], np.float32)), TypeError,
     rf"block_table {INTEGERS} .*dtype float32"),
    (cache_call(table=np.array([[3, 0], [1, BIG]], np.int64)), ValueError,
     rf"block_table\[1, 1\] = 2147483648 does not fit in int32: the values must be in {INT32_RANGE}"),
    (cache_call(table=[3, 0, 1, 4]), ValueError, r"block_table must be 2-D; got shape \(4,\)"),
]


@pytest.mark.parametrize("call,exc,words", INDEX_ERRORS)
def test_index_errors_name_the_argument_the_value_and_what_is_accepted(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


# -- bias and mask: a wrong shape is reported as such, whatever the dtype ----------------

def test_bias_and_mask_shape_errors_come_before_dtype_errors():
    q = np.ones((2, 3, 8, 16), np.float32)
    k = np.ones((2, 3, 10, 16), np.float32)
    lse = np.zeros(q.shape[:-1], np.float32)
    calls = (lambda **kw: cuflash.flash_attention(q, k, k, **kw),
             lambda **kw: cuflash.flash_attention_backward(q, q, k, k, q, lse, **kw))
    for call in calls:
        with pytest.raises(ValueError, match=r"bias of shape \(3, 8, 9\) does not broadcast "
                                             r"to the scores' shape \(2, 3, 8, 10\)"):
            call(bias=np.ones((3, 8, 9)))                     # float64, and the wrong shape
        with pytest.raises(ValueError, match=r"mask of shape \(8, 9\) does not broadcast"):
            call(mask=np.ones((8, 9), np.int8))
        # the right shape: the dtype is checked as documented (q's dtype or float32)
        with pytest.raises(TypeError, match=r"bias must have q's dtype or float32 \(float32\); "
                                            r"got dtype float64 \(cast it: bias.astype"):
            call(bias=np.ones((3, 8, 10)))
        with pytest.raises(TypeError, match="mask must be a bool array"):
            call(mask=np.ones((8, 10), np.int8))


# -- varlen backward: empty sequences get exactly zero gradients --------------------------

EMPTY_CASES = {  # (query lengths, key lengths) per sequence
    "mixed": ([3, 0, 4, 2, 0, 5], [0, 4, 6, 2, 0, 5]),
    "no keys at all": ([3, 2], [0, 0]),
    "no queries at all": ([0, 0], [4, 3]),
}


@pytest.mark.parametrize("case", EMPTY_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_empty_sequences_have_zero_gradients(backend, case, causal):
    lq, lk = EMPTY_CASES[case]
    rng = np.random.default_rng(len(lq) + 10 * causal)
    q, k, v, cq, ck = packed(rng, lq, lk, 4, 2, 16, np.float64)
    do = rng.uniform(-1, 1, q.shape)
    args = to_backend(backend, q, k, v)
    o, lse = cuflash.flash_attention_varlen(*args, cq, ck, causal=causal, return_lse=True,
                                            backend=backend)
    dq, dk, dv = (to_host(g) for g in cuflash.flash_attention_varlen_backward(
        to_backend(backend, do), *args, o, lse, cq, ck, causal=causal, backend=backend))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for sq, sk in zip(seqs(cq), seqs(ck)):
        if sq.start == sq.stop or sk.start == sk.stop:   # no (query, key) pair
            assert (dq[:, sq] == 0).all() and (dk[:, sk] == 0).all() and (dv[:, sk] == 0).all()
            continue
        ro, rl = reference.naive_attention(q[:, sq], k[:, sk], v[:, sk], causal=causal,
                                           return_lse=True)
        want = reference.attention_backward(do[:, sq], q[:, sq], k[:, sk], v[:, sk], ro, rl,
                                            causal=causal)
        for got, w in zip((dq[:, sq], dk[:, sk], dv[:, sk]), want):
            np.testing.assert_allclose(got, w, rtol=1e-9, atol=1e-11)
