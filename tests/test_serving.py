"""Serving: varlen batches, KV-cache attention (contiguous, paged, split-KV), merge_states.

Every function is compared with the float64 reference run sequence by sequence (and with
per-sequence flash_attention), on every backend.
"""
import numpy as np
import pytest

import cuflash
from cuflash import _dtypes, reference
from cuflash.serving import kvcache as kvc
from conftest import (assert_close_to_reference, packed, plain_attention, seqs, to_backend,
                      to_host)


def ref_attention(q, k, v, **kw):
    """The float64 reference for one sequence, empty sequences included."""
    q = np.asarray(q, np.float64)
    if q.shape[-2] == 0:
        return np.zeros(q.shape), np.zeros(q.shape[:-1])
    if k.shape[-2] == 0:
        return np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    return reference.naive_attention(q, k, v, return_lse=True, **kw)


# -- merge_states ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_merge_states_equals_attention_over_the_union(dtype):
    rng = np.random.default_rng(0)
    q = rng.uniform(-1, 1, (2, 3, 9, 16)).astype(dtype)
    k = rng.uniform(-2, 2, (2, 3, 40, 16)).astype(dtype)
    v = rng.uniform(-1, 1, (2, 3, 40, 16)).astype(dtype)
    cuts = [0, 3, 4, 4, 25, 40]          # one empty part, uneven sizes
    parts = [cuflash.flash_attention(q, k[..., a:b, :], v[..., a:b, :], causal=True,
                                     return_lse=True) for a, b in zip(cuts[:-1], cuts[1:])]
    o, lse = cuflash.merge_states(np.stack([p[0] for p in parts]),
                                  np.stack([p[1] for p in parts]))
    # causal per part is bottom-right per part, so compare with the same masked union:
    ref_o, ref_lse = reference.naive_attention(q, k, v, return_lse=True, mask=np.concatenate(
        [reference.visible_keys(9, b - a, causal=True) for a, b in zip(cuts[:-1], cuts[1:])],
        axis=1))
    assert o.dtype == dtype and lse.dtype == _dtypes.lse_dtype(dtype)
    plain = None if dtype != np.float16 else (ref_o.astype(np.float16))
    assert_close_to_reference(o, ref_o, plain, dtype, factor=3.0)
    assert_close_to_reference(lse, ref_lse, None, _dtypes.lse_dtype(dtype), what="lse")


def test_merge_states_rows_that_see_nothing():
    o = np.ones((3, 2, 4, 8), np.float32)
    lse = np.zeros((3, 2, 4), np.float32)
    lse[:, 0, 1] = -np.inf                       # no part saw row (0, 1)
    o[:, 0, 1] = 0
    lse[1, 1, 2] = -np.inf                       # one part saw nothing of row (1, 2)
    o[1, 1, 2] = 0
    om, lm = cuflash.merge_states(o, lse)
    assert not np.isnan(om).any() and not np.isnan(lm).any()
    np.testing.assert_array_equal(om[0, 1], 0)
    assert lm[0, 1] == -np.inf
    np.testing.assert_allclose(om[1, 2], 1.0, rtol=1e-6)
    np.testing.assert_allclose(lm[1, 2], np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(lm[0, 0], np.log(3.0), rtol=1e-6)


def test_merge_states_single_part_and_errors():
    o = np.random.default_rng(1).standard_normal((1, 5, 4)).astype(np.float32)
    lse = np.random.default_rng(2).standard_normal((1, 5)).astype(np.float32)
    om, lm = cuflash.merge_states(o, lse)
    np.testing.assert_allclose(om, o[0], rtol=1e-6)
    np.testing.assert_allclose(lm, lse[0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"lse must have shape o.shape\[:-1\]"):
        cuflash.merge_states(o, lse[:, :4])
    with pytest.raises(ValueError, match="at least one partial"):
        cuflash.merge_states(o[:0], lse[:0])
    with pytest.raises(TypeError, match="floating-point"):
        cuflash.merge_states(o.astype(np.int32), lse)


# -- varlen ----------------------------------------------------------------------------

VARLEN_CASES = [  # (Hq, Hkv, d, causal)
    (2, 2, 16, False), (4, 2, 16, True), (3, 1, 40, True)]


@pytest.mark.parametrize("hq,hkv,d,causal", VARLEN_CASES)
def test_varlen_forward_matches_reference_per_sequence(backend, hq, hkv, d, causal):
    rng = np.random.default_rng(hq * 7 + d)
    lq = [0, 1, 5, 17, 3, 1, 9]
    lk = [4, 1, 0, 23, 3, 2, 9]              # Nq > Nk, Nk = 0 and Nq = 0 among them
    q, k, v, cq, ck = packed(rng, lq, lk, hq, hkv, d)
    o, lse = cuflash.flash_attention_varlen(*to_backend(backend, q, k, v, cq, ck),
                                            causal=causal, return_lse=True,
                                            backend=backend)
    o, lse = to_host(o), to_host(lse)
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    for sq, sk in zip(seqs(cq), seqs(ck)):
        ro, rl = ref_attention(q[:, sq], k[:, sk], v[:, sk], causal=causal)
        assert_close_to_reference(o[:, sq], ro, None, np.float32)
        assert_close_to_reference(lse[:, sq], rl, None, np.float32, what="lse")
        # and the very per-sequence call it is built on:
        if sq.start != sq.stop:
            one = cuflash.flash_attention(*to_backend(backend, q[:, sq], k[:, sk], v[:, sk]),
                                          causal=causal, backend=backend)
            np.testing.assert_array_equal(o[:, sq], to_host(one))


def test_varlen_random_lengths_float16(backend):
    rng = np.random.default_rng(5)
    B = 9
    lq = rng.integers(0, 12, B)
    lk = rng.integers(0, 30, B)
    q, k, v, cq, ck = packed(rng, lq, lk, 4, 2, 32, np.float16)
    o = to_host(cuflash.flash_attention_varlen(*to_backend(backend, q, k, v, cq, ck),
                                               causal=True, max_seqlen_q=int(lq.max()),
                                               max_seqlen_k=64, backend=backend))
    for sq, sk in zip(seqs(cq), seqs(ck)):
        if sq.start == sq.stop:
            continue
        ro, _ = ref_attention(q[:, sq], k[:, sk], v[:, sk], causal=True)
        if sk.start == sk.stop:
            np.testing.assert_array_equal(o[:, sq], 0)
            continue
        plain, _ = plain_attention(q[:, sq], k[:, sk], v[:, sk], causal=True,
                                   scale=1 / np.sqrt(32), dtype=np.float16)
        assert_close_to_reference(o[:, sq], ro, plain, np.float16)


def _at_batch_index(b, *arrays):
    """Sequence arrays (H, n, d) placed at batch index b of a (b+1, H, n, d) batch (copies
    of it elsewhere): the reference then draws dropout's mask with b as the batch index."""
    return tuple(np.broadcast_to(a[None], (b + 1,) + a.shape) for a in arrays)


def test_varlen_dropout_uses_the_sequence_index_as_batch_index(backend):
    """Sequence b draws dropout's keep mask with b as the batch index, i and j within the
    sequence, in the forward (one launch on the kernels) and the backward (per sequence),
    on every backend: against the float64 reference of each sequence at batch index b."""
    rng = np.random.default_rng(8)
    lq, lk = [6, 0, 9, 4], [7, 3, 12, 0]
    q, k, v, cq, ck = packed(rng, lq, lk, 2, 1, 16, np.float64)
    do = rng.uniform(-1, 1, q.shape)
    opts = dict(causal=True, dropout_p=0.3, seed=11, backend=backend)
    args = to_backend(backend, q, k, v, cq, ck)
    o, lse = cuflash.flash_attention_varlen(*args, return_lse=True, **opts)
    dq, dk, dv = (to_host(x) for x in cuflash.flash_attention_varlen_backward(
        to_backend(backend, do), *args[:3], o, lse, *args[3:], **opts))
    o, lse = to_host(o), to_host(lse)
    ref = dict(causal=True, scale=0.25, dropout_p=0.3, seed=11)
    for b, (sq, sk) in enumerate(zip(seqs(cq), seqs(ck))):
        if sq.start == sq.stop or sk.start == sk.stop:
            continue
        qb, kb, vb, dob = _at_batch_index(b, q[:, sq], k[:, sk], v[:, sk], do[:, sq])
        ro, rl = reference.naive_attention(qb, kb, vb, return_lse=True, **ref)
        np.testing.assert_allclose(o[:, sq], ro[b], rtol=1e-10, atol=1e-12)
        grads = reference.attention_backward(dob, qb, kb, vb, ro, rl, **ref)
        for got, want in zip((dq[:, sq], dk[:, sk], dv[:, sk]), grads):
            np.testing.assert_allclose(got, want[b], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_matches_reference(backend, causal):
    rng = np.random.default_rng(7)
    lq, lk = [3, 0, 1, 11, 6], [5, 2, 0, 13, 6]
    q, k, v, cq, ck = packed(rng, lq, lk, 4, 2, 16, np.float64)
    do = rng.uniform(-1, 1, q.shape)
    args = to_backend(backend, q, k, v, cq, ck)
    o, lse = cuflash.flash_attention_varlen(*args, causal=causal, return_lse=True,
                                            backend=backend)
    dq, dk, dv = (to_host(x) for x in cuflash.flash_attention_varlen_backward(
        to_backend(backend, do), args[0], args[1], args[2], o, lse, args[3], args[4],
        causal=causal, backend=backend))
    o, lse = to_host(o), to_host(lse)
    for sq, sk in zip(seqs(cq), seqs(ck)):
        if sq.start == sq.stop or sk.start == sk.stop:
            np.testing.assert_array_equal(dq[:, sq], 0)
            np.testing.assert_array_equal(dk[:, sk], 0)
            continue
        r = reference.attention_backward(do[:, sq], q[:, sq], k[:, sk], v[:, sk], o[:, sq],
                                         lse[:, sq], causal=causal)
        for got, want in zip((dq[:, sq], dk[:, sk], dv[:, sk]), r):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def test_varlen_variants_per_sequence():
    """window, softcap and per-sequence ALiBi slopes, bottom-right per sequence (NumPy)."""
    rng = np.random.default_rng(9)
    lq, lk = [4, 1, 9, 0], [9, 6, 9, 3]
    q, k, v, cq, ck = packed(rng, lq, lk, 4, 2, 16, np.float64)
    slopes = rng.uniform(0.1, 1.0, (4, 4))
    opts = dict(causal=True, window=(3, 0), softcap=2.5)
    o = cuflash.flash_attention_varlen(q, k, v, cq, ck, alibi_slopes=slopes, **opts)
    for b, (sq, sk) in enumerate(zip(seqs(cq), seqs(ck))):
        if sq.start == sq.stop:
            continue
        ro, _ = ref_attention(q[:, sq], k[:, sk], v[:, sk], alibi_slopes=slopes[b], **opts)
        np.testing.assert_allclose(o[:, sq], ro, rtol=1e-10, atol=1e-12)


VARLEN_ERRORS = [
    (dict(cq=np.array([0, 3, 8.0])), TypeError, "cu_seqlens_q must be an integer array"),
    (dict(cq=np.array([[0, 3, 8]], np.int32)), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cq=np.array([1, 3, 8], np.int32)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cq=np.array([0, 5, 3, 8], np.int32), ck=np.array([0, 5, 6, 10], np.int32)),
     ValueError, "non-decreasing; got cu_seqlens_q\\[1\\] = 5 > cu_seqlens_q\\[2\\] = 3"),
    (dict(ck=np.array([0, 5, 9], np.int32)), ValueError,
     "cu_seqlens_k\\[-1\\] = 9 must equal the total number of rows .* \\(10\\)"),
    (dict(ck=np.array([0, 10], np.int32)), ValueError, "the same number of sequences"),
    (dict(max_seqlen_q=4), ValueError, "max_seqlen_q = 4 is below the longest sequence \\(5\\)"),
    (dict(q=np.zeros((2, 1, 8, 16), np.float32)), ValueError, "q must be 3-D"),
    (dict(k=np.zeros((2, 10, 8), np.float32)), ValueError, "head dim"),
    (dict(dropout_p=0.1), ValueError, "seed"),
    (dict(dropout_p=1.0, seed=1), ValueError, "dropout_p"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(alibi_slopes=np.zeros(2, np.complex64)), TypeError, "alibi_slopes must be a real"),
]


@pytest.mark.parametrize("change,exc,words", VARLEN_ERRORS)
def test_varlen_errors_name_the_argument(change, exc, words):
    q = np.zeros((2, 8, 16), np.float32)
    k = v = np.zeros((2, 10, 16), np.float32)
    args = dict(q=q, k=k, v=v, cq=np.array([0, 5, 8], np.int32),
                ck=np.array([0, 4, 10], np.int32))
    args.update(change)
    opts = {n: args.pop(n) for n in list(args) if n not in ("q", "k", "v", "cq", "ck")}
    if "k" in change:
        args["v"] = args["k"]
    with pytest.raises(exc, match=words):
        cuflash.flash_attention_varlen(args["q"], args["k"], args["v"], args["cq"],
                                       args["ck"], **opts)


# -- KV cache --------------------------------------------------------------------------

def check_cache_rows(o, lse, q, keys, values, *, causal, dtype=np.float32, **opts):
    """Each row b against the reference over keys[b], values[b] (host arrays)."""
    for b in range(q.shape[0]):
        ro, rl = ref_attention(q[b], keys[b], values[b], causal=causal, **opts)
        assert_close_to_reference(o[b], ro, None, dtype)
        assert_close_to_reference(lse[b], rl, None, _dtypes.lse_dtype(dtype), what="lse")


@pytest.mark.parametrize("nq,causal", [(1, True), (3, True), (2, False)])
def test_kvcache_contiguous_every_split(backend, nq, causal):
    rng = np.random.default_rng(11 + nq)
    # the emulator runs a 300-key call in about a second: shorter rows there
    B, hq, hkv, N, d = 6, 4, 2, 300 if backend == "numpy" else 80, 16
    kc = rng.uniform(-1, 1, (B, hkv, N, d)).astype(np.float32)
    vc = rng.uniform(-1, 1, (B, hkv, N, d)).astype(np.float32)
    q = rng.uniform(-1, 1, (B, hq, nq, d)).astype(np.float32)
    lens = np.array([0, 1, N - 1, 37, N, 5], np.int32)   # 5: cuts near the end
    keys = [kc[b, :, :lens[b]] for b in range(B)]
    values = [vc[b, :, :lens[b]] for b in range(B)]
    outs = {}
    for ns in ([1, 3] if backend != "numpy" else range(1, 17)):  # the emulator is slow
        o, lse = cuflash.flash_attention_with_kvcache(
            *to_backend(backend, q, kc, vc, lens), causal=causal, num_splits=ns,
            return_lse=True, backend=backend)
        outs[ns] = to_host(o)
        check_cache_rows(outs[ns], to_host(lse), q, keys, values, causal=causal)
    # the result does not depend on the split (up to rounding) and repeats bit for bit
    for ns, o in outs.items():
        np.testing.assert_allclose(o, outs[1], rtol=1e-5, atol=2e-6)
    again = cuflash.flash_attention_with_kvcache(*to_backend(backend, q, kc, vc, lens),
                                                 causal=causal, num_splits=3,
                                                 backend=backend)
    np.testing.assert_array_equal(to_host(again), outs[3])


def random_pages(rng, B, max_pages, num_blocks, shared):
    """A block table drawing distinct pages per row; the first `shared` pages of every
    row are the same physical pages (a shared prompt prefix, read-only)."""
    perm = rng.permutation(num_blocks)
    table = np.empty((B, max_pages), np.int32)
    table[:, :shared] = perm[:shared]
    rest = perm[shared:shared + B * (max_pages - shared)].reshape(B, max_pages - shared)
    table[:, shared:] = rest
    return table


# page 16: the kernels gather the pages first; 128: they read them in place
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("nq,nnew", [(1, 1), (4, 4), (2, 0)])
def test_kvcache_paged_append_and_attend(backend, nq, nnew, page):
    rng = np.random.default_rng(21 + nq + nnew)
    B, hq, hkv, d, max_pages = 4, 4, 2, 16, 9
    shared = 2                                            # a 2-page shared prefix
    num_blocks = shared + B * (max_pages - shared) + 3
    table = random_pages(rng, B, max_pages, num_blocks, shared)
    kc = rng.uniform(-1, 1, (num_blocks, hkv, page, d)).astype(np.float32)
    vc = rng.uniform(-1, 1, (num_blocks, hkv, page, d)).astype(np.float32)
    lens = shared * page + np.array([0, 1, 68, 108 - nnew], np.int32)  # past the prefix
    q = rng.uniform(-1, 1, (B, hq, nq, d)).astype(np.float32)
    kn = rng.uniform(-1, 1, (B, hkv, nnew, d)).astype(np.float32)
    vn = rng.uniform(-1, 1, (B, hkv, nnew, d)).astype(np.float32)
    before_k, before_v = kc.copy(), vc.copy()

    def logical(cache, b, n):  # row b's first n keys, through the table
        pos = np.arange(n)
        return cache[table[b, pos // page], :, pos % page].transpose(1, 0, 2)

    kcd, vcd = to_backend(backend, kc, vc)
    new = dict(k=to_backend(backend, kn), v=to_backend(backend, vn)) if nnew else {}
    o, lse = cuflash.flash_attention_with_kvcache(
        to_backend(backend, q), kcd, vcd, to_backend(backend, lens),
        block_table=to_backend(backend, table), causal=True, num_splits=4,
        return_lse=True, backend=backend, **new)
    kc_after, vc_after = to_host(kcd), to_host(vcd)
    # Byte for byte: the new keys sit at lens … lens + Nnew − 1, nothing else changed.
    want_k, want_v = before_k.copy(), before_v.copy()
    for b in range(B):
        pos = lens[b] + np.arange(nnew)
        want_k[table[b, pos // page], :, pos % page] = kn[b].transpose(1, 0, 2)
        want_v[table[b, pos // page], :, pos % page] = vn[b].transpose(1, 0, 2)
    assert kc_after.tobytes() == want_k.tobytes() and vc_after.tobytes() == want_v.tobytes()
    keys = [logical(want_k, b, lens[b] + nnew) for b in range(B)]
    values = [logical(want_v, b, lens[b] + nnew) for b in range(B)]
    check_cache_rows(to_host(o), to_host(lse), q, keys, values, causal=True)


def test_kvcache_contiguous_append_is_in_place_and_exact():
    rng = np.random.default_rng(3)
    kc = rng.standard_normal((3, 2, 20, 8)).astype(np.float32)
    vc = rng.standard_normal((3, 2, 20, 8)).astype(np.float32)
    kn = rng.standard_normal((3, 2, 2, 8)).astype(np.float32)
    vn = rng.standard_normal((3, 2, 2, 8)).astype(np.float32)
    q = rng.standard_normal((3, 2, 2, 8)).astype(np.float32)
    want_k, want_v = kc.copy(), vc.copy()
    lens = np.array([0, 7, 18], np.int32)
    for b in range(3):
        want_k[b, :, lens[b]:lens[b] + 2] = kn[b]
        want_v[b, :, lens[b]:lens[b] + 2] = vn[b]
    o = cuflash.flash_attention_with_kvcache(q, kc, vc, lens, k=kn, v=vn, causal=True)
    assert kc.tobytes() == want_k.tobytes() and vc.tobytes() == want_v.tobytes()
    keys = [want_k[b, :, :lens[b] + 2] for b in range(3)]
    vals = [want_v[b, :, :lens[b] + 2] for b in range(3)]
    for b in range(3):
        np.testing.assert_allclose(o[b], ref_attention(q[b], keys[b], vals[b],
                                                       causal=True)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nq", [1, 3])
def test_kvcache_variants_with_splits(nq):
    """window, softcap and ALiBi through split-KV (NumPy backend, float64)."""
    rng = np.random.default_rng(31)
    B, hq, hkv, N, d = 3, 4, 2, 200, 8
    kc, vc = rng.uniform(-1, 1, (2, B, hkv, N, d))
    q = rng.uniform(-1, 1, (B, hq, nq, d))
    lens = np.array([200, 57, 1], np.int32)
    slopes = rng.uniform(0.05, 0.5, (B, hq))
    for opts in (dict(window=(40, 0)), dict(softcap=1.5), dict(alibi_slopes=slopes),
                 dict(window=(70, -1), softcap=3.0, alibi_slopes=slopes[0])):
        for ns in (1, 5, 16):
            o = cuflash.flash_attention_with_kvcache(q, kc, vc, lens, causal=True,
                                                     num_splits=ns, **opts)
            for b in range(B):
                ref_opts = dict(opts)
                if getattr(opts.get("alibi_slopes"), "ndim", 1) == 2:
                    ref_opts["alibi_slopes"] = slopes[b]
                ro, _ = ref_attention(q[b], kc[b, :, :lens[b]], vc[b, :, :lens[b]],
                                      causal=True, **ref_opts)
                np.testing.assert_allclose(o[b], ro, rtol=1e-10, atol=1e-12,
                                           err_msg=f"{opts} num_splits={ns} row {b}")


def test_split_points_and_auto_splits():
    assert kvc.split_points(1000, 1, 4, causal=True, window=None, alibi=False) == \
        [0, 250, 500, 750, 1000]
    # causal with 3 rows: no chunk but the last reaches past key L − Nq + 1
    cuts = kvc.split_points(10, 3, 16, causal=True, window=None, alibi=False)
    assert cuts[-1] == 10 and all(c <= 8 for c in cuts[:-1])
    # paged: cuts on page edges; window: keys no row sees are skipped
    assert all(c % 16 == 0 for c in kvc.split_points(200, 1, 5, causal=True, window=None,
                                                     alibi=False, page_size=16)[:-1])
    assert kvc.split_points(200, 1, 1, causal=True, window=(10, 0), alibi=False) == [189, 200]
    assert kvc.split_kv_calls(132, 64, 32, 1, 65536) == 1      # enough tiles: no split
    assert kvc.split_kv_calls(132, 1, 8, 1, 65536) == 16       # one row: split, capped
    assert kvc.split_kv_calls(2, 1, 1, 1, 300) == 2            # NumPy: one per worker
    assert kvc.split_kv_calls(132, 1, 8, 1, 300) == 2          # ≥ 256 keys per chunk


def cache_error_cases():
    z = lambda *s, dt=np.float32: np.zeros(s, dt)  # noqa: E731
    ok = dict(q=z(2, 4, 1, 8), k_cache=z(2, 2, 16, 8), v_cache=z(2, 2, 16, 8),
              cache_seqlens=np.array([3, 15], np.int32), k=z(2, 2, 1, 8), v=z(2, 2, 1, 8))
    paged = dict(ok, k_cache=z(5, 2, 4, 8), v_cache=z(5, 2, 4, 8),
                 block_table=np.array([[0, 1], [2, 3]], np.int32),
                 cache_seqlens=np.array([3, 6], np.int32))
    return [
        (ok, dict(cache_seqlens=np.array([3, 16], np.int32)), ValueError,
         r"row 1: cache_seqlens \+ Nnew = 16 \+ 1 = 17 exceeds the cache capacity \(Ncache = 16\)"),
        (ok, dict(cache_seqlens=np.array([3., 15.])), TypeError,
         "cache_seqlens must be an int or an integer array"),
        (ok, dict(v=None), ValueError, "k and v .* go together"),
        (ok, dict(k=z(2, 2, 1, 4), v=z(2, 2, 1, 4)), ValueError,
         r"k must be \(B, Hkv, Nnew, d\) = \(2, 2, Nnew, 8\) to match q \(2, 4, 1, 8\) and k_cache"),
        (ok, dict(v_cache=z(2, 2, 15, 8)), ValueError, "k_cache and v_cache must have the same shape"),
        (ok, dict(k_cache=z(3, 2, 16, 8), v_cache=z(3, 2, 16, 8)), ValueError,
         r"k_cache must have one row per batch row of q \(B = 2\); got k_cache \(3, 2, 16, 8\), q \(2, 4, 1, 8\)"),
        (ok, dict(k_cache=z(2, 3, 16, 8), v_cache=z(2, 3, 16, 8), k=z(2, 3, 1, 8),
                  v=z(2, 3, 1, 8)), ValueError, "must be a multiple"),
        (ok, dict(k=z(2, 2, 1, 8, dt=np.float16)), TypeError, "must share one dtype"),
        (ok, dict(cache_seqlens=None), ValueError, "need cache_seqlens"),
        (ok, dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
        (paged, dict(cache_seqlens=np.array([8, 3], np.int32)), ValueError,
         r"exceeds the cache capacity \(max_pages · page_size = 2 · 4\)"),
        (paged, dict(block_table=np.array([[0, 1], [2, 5]], np.int32)), ValueError,
         r"block_table\[1, 1\] = 5 is out of range: the cache has 5 pages"),
        (paged, dict(block_table=np.array([[0, 1], [2, -1]], np.int32)), ValueError,
         r"block_table\[1, 1\] = -1 is out of range"),
        (paged, dict(block_table=np.array([[0, 1], [2, 3]], np.float32)), TypeError,
         "block_table must be an integer array"),
        (paged, dict(block_table=np.array([[0, 1], [0, 1]], np.int32)), ValueError,
         r"row 0 would write its new key 0 into page 0, which another row also uses: pages shared between rows are read-only"),
        (paged, dict(block_table=np.array([[0, 1]], np.int32)), ValueError,
         r"block_table must have one row per batch row of q \(B = 2\)"),
    ]


@pytest.mark.parametrize("base,change,exc,words", cache_error_cases())
def test_kvcache_errors_change_nothing(base, change, exc, words):
    args = dict(base, **change)
    rng = np.random.default_rng(0)
    for n in ("k_cache", "v_cache"):
        args[n] = rng.standard_normal(args[n].shape).astype(args[n].dtype)
    for n in ("k", "v"):
        if args.get(n) is not None:
            args[n] = np.ones_like(args[n])
    before = args["k_cache"].copy(), args["v_cache"].copy()
    q, kc, vc = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    sl = args.pop("cache_seqlens")
    with pytest.raises(exc, match=words):
        cuflash.flash_attention_with_kvcache(q, kc, vc, sl, **args)
    assert kc.tobytes() == before[0].tobytes() and vc.tobytes() == before[1].tobytes()
