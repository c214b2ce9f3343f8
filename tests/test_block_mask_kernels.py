"""Block masks in the CUDA kernels, run in the emulator's checked mode: every family the
mma.sync and SIMT paths launch (forward, dK/dV, dQ, the 5-GEMM backward's dK/dV with dQ
partials) gives the dense mask_mod's result, and reads only the tiles the block mask leaves
non-empty — counted from the bytes each launch read of q or k (the emulator's
last_traffic), against the tiles worked out from the mask written out densely."""
import numpy as np
import pytest

from cuflash import variants as _variants
from cuflash.reference import naive_attention
from cuflash.backends import kernel_backward, kernel_backward_sm90, kernel_forward
from cuflash.backends import kernel_forward_sm90
from cuflash.programmable import block_mask

from conftest import (HAS_GPU, HAS_GXX, assert_close_to_reference, assert_lse_close, attention_inputs,
                      emulator_backend, plain_tf32_attention, round_tf32)
from test_programmable import _DeviceArray, reference

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

N, D = 256, 32
DOCS = np.repeat(np.arange(4), 64)  # four documents of 64 tokens


def document(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx]


def sliding(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (kv_idx > q_idx - 48)


def dilated(b, h, q_idx, kv_idx):
    """Key blocks 0 (whole) and 6 (two keys in three) of eight of 64: the tiles a query
    tile visits are not contiguous (five empty ones between, a count no ring depth
    divides), so a ring of visited tiles must skip inside the range."""
    blk = kv_idx // 64
    return (blk == 0) | ((blk == 6) & (kv_idx % 3 != q_idx % 3))


# (mask_mod, block_size, Nq, Nk)
PATTERNS = [pytest.param(document, 64, N, N, id="document"),
            pytest.param(sliding, (32, 64), N, N, id="sliding"),
            pytest.param(dilated, 64, 128, 512, id="dilated")]


def visited_tiles(dense, tile, block):
    """The kernel tiles (rows, keys) = `tile` whose span of mask blocks (`block`) holds
    any visible key of the dense (Nq, Nk) mask."""
    (Nq, Nk), (tr, tk), (bq, bk) = dense.shape, tile, block

    def span(i, t, b, n):  # the mask blocks kernel tile i overlaps, as rows
        return slice(i * t // b * b, min(((min((i + 1) * t, n) - 1) // b + 1) * b, n))

    return sum(bool(dense[span(i, tr, bq, Nq), span(j, tk, bk, Nk)].any())
               for i in range(-(-Nq // tr)) for j in range(-(-Nk // tk)))


def _references(q, k, v, do, scale, fn, dtype):
    """The float64 reference, and for 16-bit inputs the one with P̃ rounded to 16 bits
    (FlashAttention's rule: the error bound is a multiple of that one's error)."""
    ref = reference(q, k, v, do, scale=scale, mask_mod=fn)
    plain = (reference(q, k, v, do, scale=scale, mask_mod=fn, p_dtype=np.float16)
             if dtype == np.float16 else None)
    return ref, plain


def _assert_grads(grads, ref, plain, dtype):
    for g, r, p, what in zip(grads, ref[2:], (None,) * 3 if plain is None else plain[2:],
                             ("dq", "dk", "dv")):
        assert_close_to_reference(g, r, p, dtype, factor=4.0, what=what)


FAMILIES = [pytest.param("sm_80", (7, 0), np.float32, 0, id="simt-float32"),
            pytest.param("sm_80", None, np.float64, 0, id="simt-float64"),
            pytest.param("sm_80", None, np.float16, 0, id="mma.sync-float16"),
            # workers asked for: a mask_mod still takes the two kernels (the 5-GEMM
            # kernel's scores are plain)
            pytest.param("sm_80", None, np.float16, 2, id="mma.sync-float16-workers"),
            pytest.param("sm_80", None, np.float32, 0, id="tf32-float32"),
            # the other archs the mma.sync kernels target: Turing, Hopper without its own
            # kernels, consumer Blackwell (their own tiles and rings)
            pytest.param("sm_75", None, np.float16, 0, id="mma.sync-float16-sm_75"),
            pytest.param("sm_90", None, np.float16, 0, id="mma.sync-float16-sm_90"),
            pytest.param("sm_120", None, np.float16, 0, id="mma.sync-float16-sm_120")]


@pytest.mark.parametrize("arch,cc,dtype,workers,fn,block,Nq,Nk", [
    pytest.param(*f.values, *p.values, id=f"{p.id}-{f.id}",
                 # the other archs run the dilated mask by default, the rest `-m slow`
                 marks=pytest.mark.slow if f.values[0] != "sm_80" and p.id != "dilated" else ())
    for p in PATTERNS for f in FAMILIES])
def test_kernels_skip_empty_tiles(arch, cc, dtype, workers, fn, block, Nq, Nk):
    be = emulator_backend(arch, cc=cc, checked=True)
    Hq = 2  # two query heads on one K/V head: each reads the K/V head's tiles
    q, k, v, do = attention_inputs(1, Hq, 1, Nq, Nk, D, dtype, seed=3)
    acc = np.float64 if dtype == np.float64 else np.float32
    bm = block_mask(fn, None, None, Nq, Nk, block_size=block, dtype=acc)
    assert 0 < bm.sparsity() < 1
    var = _variants.Variants(mask_mod=bm.mod, block_mask=bm)
    scale = D ** -0.5
    ref, plain = _references(q, k, v, do, scale, fn, dtype)

    # one split for the dilated mask (a block's ring walks all its key tiles), split-KV's
    # choice for the others (each split skips the empty tiles of its share)
    o, lse = kernel_forward.forward(be, q, k, v, causal=False, scale=scale, algorithm="fa2",
                                    variants=var, num_splits=1 if fn is dilated else None)
    assert_close_to_reference(o, ref[0], plain and plain[0], dtype, what="o")
    assert_lse_close(lse, ref[1], dtype)
    dense = np.broadcast_to(fn(0, 0, np.arange(Nq)[:, None], np.arange(Nk)[None, :]), (Nq, Nk))
    item = np.dtype(dtype).itemsize

    def rows_read(fn_, arg, plan, streamed):  # the streamed operand's tiles, as bytes
        rows = plan.score_tile[streamed]
        return fn_.last_traffic[arg][0] // (rows * D * item)

    (plan,), (kernel,) = be.launched, be.functions
    want = visited_tiles(dense, plan.score_tile, bm.block)
    assert want < -(-Nq // plan.score_tile[0]) * -(-Nk // plan.score_tile[1])  # skipped
    assert rows_read(kernel, 1, plan, 1) == Hq * want   # K tiles, per query head

    be.launched, be.functions = [], []
    grads = kernel_backward.backward(be, do, q, k, v, o, lse, causal=False, scale=scale,
                                     variants=var, dq_workers=workers or None)
    _assert_grads(grads, ref, plain, dtype)
    launched = {p.kernel: (p, f) for p, f in zip(be.launched, be.functions)}
    dkdv = launched.get("flash_bwd_dkdv_tc") or launched["flash_bwd_dkdv"]
    assert rows_read(dkdv[1], 0, dkdv[0], 0) == Hq * visited_tiles(
        dense, dkdv[0].score_tile, bm.block)  # Q tiles, per query head of the group
    assert not getattr(dkdv[0], "dq_parts", False)
    dq = launched.get("flash_bwd_dq_tc") or launched.get("flash_bwd_dq")
    assert rows_read(dq[1], 1, dq[0], 1) == Hq * visited_tiles(dense, dq[0].score_tile,
                                                                 bm.block)


def test_public_api_on_the_emulator():
    """flash_attention(..., block_mask=) on the emulator gives the NumPy backend's result;
    a causal call adds its own mask to the block mask's (both skip their tiles)."""
    import cuflash
    q, k, v, do = attention_inputs(2, 2, 1, N, N, 16, np.float32, seed=5)
    bm = block_mask(sliding, None, None, N, N, block_size=32)
    for causal in (False, True):
        got = cuflash.flash_attention(q, k, v, block_mask=bm, causal=causal, return_lse=True,
                                      backend="emulator")
        want = cuflash.flash_attention(q, k, v, mask_mod=sliding, causal=causal,
                                       return_lse=True, backend="numpy")
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
        g_grads = cuflash.flash_attention_backward(do, q, k, v, *got, block_mask=bm,
                                                   causal=causal, backend="emulator")
        w_grads = cuflash.flash_attention_backward(do, q, k, v, *want, mask_mod=sliding,
                                                   causal=causal, backend="numpy")
        for g, w in zip(g_grads, w_grads):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("fn,block,Nq,Nk", PATTERNS)
def test_hopper_kernels_skip_empty_tiles(fn, block, Nq, Nk):
    """The Hopper forward's producer and consumers, and the backward passes' (the 5-GEMM
    dK/dV pass, and the two passes), walk the same non-empty tiles: their TMA loads of k
    (forward, dQ) and q (dK/dV) count them."""
    be = emulator_backend("sm_90a", checked=True)
    Hq, d = 2, 64
    q, k, v, do = attention_inputs(1, Hq, 1, Nq, Nk, d, np.float16, seed=3)
    # the tensor maps read (B, N, H, d) in place
    q, k, v, do = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                   for x in (q, k, v, do))
    bm = block_mask(fn, None, None, Nq, Nk, block_size=block)
    var = _variants.Variants(mask_mod=bm.mod, block_mask=bm)
    scale = d ** -0.5
    ref, plain = _references(q, k, v, do, scale, fn, np.float16)
    o, lse = kernel_forward_sm90.forward_sm90(be, q, k, v, causal=False, scale=scale,
                                              variants=var)
    assert_close_to_reference(o, ref[0], plain[0], np.float16, what="o")
    assert_lse_close(lse, ref[1], np.float16)
    dense = np.broadcast_to(fn(0, 0, np.arange(Nq)[:, None], np.arange(Nk)[None, :]), (Nq, Nk))
    tile_bytes = d * 2  # a row of a 16-bit tile

    def tiles_read(plan, fn_, arg, streamed):
        return fn_.last_traffic[arg][0] // (plan.score_tile[streamed] * tile_bytes)

    (plan,), (kernel,) = be.launched, be.functions
    assert tiles_read(plan, kernel, 1, 1) == Hq * visited_tiles(dense, plan.score_tile, bm.block)
    be.launched, be.functions = [], []
    Dvec = np.sum(do.astype(np.float32) * o.astype(np.float32), axis=-1)
    for workers in (8, 0):   # the five GEMMs, the two passes
        grads = kernel_backward_sm90.backward_sm90(be, do, q, k, v, lse, Dvec, causal=False,
                                                   scale=scale, variants=var, dq_workers=workers)
        _assert_grads(grads, ref, plain, np.float16)
        (p_dkdv, p_dq), (f_dkdv, f_dq) = be.launched, be.functions
        be.launched, be.functions = [], []
        assert tiles_read(p_dkdv, f_dkdv, 0, 0) == Hq * visited_tiles(dense, p_dkdv.score_tile,
                                                                      bm.block)
        if workers == 0:
            assert tiles_read(p_dq, f_dq, 1, 1) == Hq * visited_tiles(dense, p_dq.score_tile,
                                                                      bm.block)


@pytest.mark.parametrize("fn,block,Nq,Nk", PATTERNS[:2])
def test_hopper_tf32_forward_skips_empty_tiles(fn, block, Nq, Nk):
    """The float32 (one-pass tf32) Hopper forward with a block mask: its producer's TMA
    thread, the warps that round K_j and write V_jᵀ, and the consumers walk the same
    non-empty tiles (64-key ones), in checked mode; O by the tf32 rule."""
    be = emulator_backend("sm_90a", checked=True)
    Hq, d = 2, 64
    q, k, v = attention_inputs(1, Hq, 1, Nq, Nk, d, np.float32, seed=3)[:3]
    bm = block_mask(fn, None, None, Nq, Nk, block_size=block)
    var = _variants.Variants(mask_mod=bm.mod, block_mask=bm)
    dense = np.broadcast_to(fn(0, 0, np.arange(Nq)[:, None], np.arange(Nk)[None, :]), (Nq, Nk))
    o, lse = kernel_forward_sm90.forward_sm90(be, q, k, v, causal=False, scale=d ** -0.5,
                                              variants=var)
    kr, vr = (np.repeat(x, Hq, axis=1) for x in (k, v))
    ref = naive_attention(q, kr, vr, causal=False, scale=d ** -0.5, mask=dense)
    plain = plain_tf32_attention(q, kr, vr, causal=False, scale=d ** -0.5, mask=dense)
    assert_close_to_reference(o, ref, plain, round_tf32, what="o")
    (plan,), (kernel,) = be.launched, be.functions
    assert plan.dtype == "float32" and plan.score_tile == (128, 64)
    assert kernel.last_traffic[1][0] // (64 * d * 4) == Hq * visited_tiles(dense, plan.score_tile,
                                                                           bm.block)


def test_hopper_block_mask_under_causal():
    """The Hopper kernels with causal on top of a block mask whose visited tiles leave a
    gap (Nk > Nq: the diagonal bottom-right): the causal range, then the block mask's
    tiles within it."""
    be = emulator_backend("sm_90a", checked=True)
    Nq, Nk, d = 256, 384, 64
    q, k, v, do = attention_inputs(1, 2, 1, Nq, Nk, d, np.float16, seed=3)
    q, k, v, do = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                   for x in (q, k, v, do))

    def gaps(b, h, q_idx, kv_idx):  # key blocks 0, 4 and 5 of six, under the diagonal
        blk = kv_idx // 64
        return ((blk == 0) | (blk == 4) | (blk == 5)) & (kv_idx <= q_idx + Nk - Nq)

    bm = block_mask(gaps, None, None, Nq, Nk, block_size=64)
    var = _variants.Variants(mask_mod=bm.mod, block_mask=bm)
    ref, plain = _references(q, k, v, do, d ** -0.5, gaps, np.float16)
    o, lse = kernel_forward_sm90.forward_sm90(be, q, k, v, causal=True, scale=d ** -0.5,
                                              variants=var)
    assert_close_to_reference(o, ref[0], plain[0], np.float16, what="o")
    Dvec = np.sum(do.astype(np.float32) * o.astype(np.float32), axis=-1)
    grads = kernel_backward_sm90.backward_sm90(be, do, q, k, v, lse, Dvec, causal=True,
                                               scale=d ** -0.5, variants=var)
    _assert_grads(grads, ref, plain, np.float16)


# -- the block mask's own kernel (block_mask.cu) -----------------------------------------

SLOPES = np.array([0.5, 0.25, 0.125])


def by_head(b, h, q_idx, kv_idx):
    """A float computation per head and batch row: keys within 8 / slope of the query
    (16, 32, 64 for heads 0–2), shifted by the batch row."""
    return np.abs(q_idx - kv_idx - b) * SLOPES[h] <= 4.0


def dense_kinds(fn, B, H, Nq, Nk, block):
    """The tile kinds from the user's function applied to the whole index grid (it is
    NumPy code), worked out tile by tile: 0 empty, 1 partial, 2 full."""
    b, h, i, j = np.ogrid[:B, :H, :Nq, :Nk]
    dense = np.broadcast_to(fn(b, h, i, j), (B, H, Nq, Nk))
    bq, bk = (block, block) if np.isscalar(block) else block
    out = np.empty((B, H, -(-Nq // bq), -(-Nk // bk)), np.uint8)
    for x in range(out.shape[2]):
        for y in range(out.shape[3]):
            t = dense[:, :, x * bq:(x + 1) * bq, y * bk:(y + 1) * bk]
            out[:, :, x, y] = np.where(~t.any(axis=(2, 3)), 0, np.where(t.all(axis=(2, 3)), 2, 1))
    return out


@pytest.mark.parametrize("fn,B,H,block,Nq,Nk,dtype", [
    pytest.param(document, None, None, 64, N, N, np.float32, id="document"),
    pytest.param(sliding, None, None, (32, 48), 250, 190, np.float32, id="sliding-ragged"),
    pytest.param(dilated, None, None, 64, 128, 512, np.float64, id="dilated-float64"),
    pytest.param(by_head, 2, 3, (16, 40), 100, 130, np.float32, id="by-head")])
def test_block_mask_on_the_device(fn, B, H, block, Nq, Nk, dtype):
    """block_mask's kernel in the emulator (checked mode: every read of a captured array
    inside it; and under a random schedule) gives the kinds of the dense mask, as the host
    path does."""
    want = dense_kinds(fn, B or 1, H or 1, Nq, Nk, block)
    host = block_mask(fn, B, H, Nq, Nk, block_size=block, dtype=dtype, backend="numpy")
    np.testing.assert_array_equal(host.kinds, want)
    got = block_mask(fn, B, H, Nq, Nk, block_size=block, dtype=dtype, backend="emulator")
    np.testing.assert_array_equal(got.kinds, want)
    assert (got.block, got.dtype, got.shape) == (host.block, host.dtype, host.shape)
    from cuflash.programmable.block_mask import _device_kinds
    bq, bk = (block, block) if np.isscalar(block) else block
    for be in (emulator_backend("sm_80", checked=True),
               emulator_backend("sm_80", schedule="random", seed=3)):
        np.testing.assert_array_equal(
            _device_kinds(be, got.mod, B or 1, H or 1, Nq, Nk, bq, bk, dtype), want)


def _past_the_end(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx + 1]


_docs_device = _DeviceArray(DOCS)   # what block_mask sees of a CuPy array


def _document_on_device(b, h, q_idx, kv_idx):
    return _docs_device[q_idx] == _docs_device[kv_idx]


def test_block_mask_on_the_device_reads_and_limits():
    """A read past a captured array: reported in checked mode, clamped otherwise (as the
    attention kernels); grids the kernel cannot launch are a ValueError naming the limit."""
    from cuflash.emulator import EmulatorError
    from cuflash.programmable import translate
    from cuflash.programmable.block_mask import _device_kinds
    mod = translate(_past_the_end, "mask_mod")
    with pytest.raises(EmulatorError, match=r"out-of-bounds global read .* \(in cuflash_mask_mod\("):
        _device_kinds(emulator_backend("sm_80", checked=True), mod, 1, 1, N, N, 64, 64,
                      np.float32)

    def clamped(b, h, q_idx, kv_idx):
        return DOCS[q_idx] == DOCS[np.minimum(kv_idx + 1, N - 1)]

    got = block_mask(_past_the_end, None, None, N, N, block_size=64, backend="emulator")
    np.testing.assert_array_equal(got.kinds, dense_kinds(clamped, 1, 1, N, N, 64))
    with pytest.raises(ValueError, match=r"block_mask on backend='emulator': query blocks "
                                         r"⌈Nq / block_size⌉ = 70000 exceeds 65535"):
        block_mask(document, None, None, 70000, 64, block_size=(1, 64), backend="emulator")
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', "):
        block_mask(document, None, None, N, N, backend="gpu")
    with pytest.raises(TypeError, match=r"backend='emulator' computes on NumPy arrays in host "
                                        r"memory; _docs_device is .* on the GPU"):
        block_mask(_document_on_device, None, None, N, N, backend="emulator")



@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_block_mask_on_the_gpu():
    """block_mask's kernel through NVRTC: the kinds of the dense mask, for captured
    arrays on the device (backend="auto" takes the GPU) and on the host (backend="cuda")."""
    import cupy
    docs = cupy.asarray(DOCS)

    def document_here(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    got = block_mask(document_here, None, None, N, N, block_size=(32, 64))
    np.testing.assert_array_equal(got.kinds, dense_kinds(document, 1, 1, N, N, (32, 64)))
    got = block_mask(by_head, 2, 3, 100, 130, block_size=(16, 40), backend="cuda")
    np.testing.assert_array_equal(got.kinds, dense_kinds(by_head, 2, 3, 100, 130, (16, 40)))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_on_the_gpu(dtype):
    """A block mask and the buffer gradients through NVRTC on the device's kernels (the
    Hopper forward on an H100), against the NumPy backend on the same inputs."""
    import cupy
    import cuflash
    from test_programmable_kernels import by_position, col_bias, row_bias
    Nq, Nk = 70, 150
    q, k, v, do = attention_inputs(2, 4, 2, Nq, Nk, 64, dtype, seed=13)

    def sliding_here(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + Nk - Nq) & (kv_idx > q_idx + Nk - Nq - 48)

    acc = np.float64 if dtype == np.float64 else np.float32
    bm = block_mask(sliding_here, None, None, Nq, Nk, block_size=32, dtype=acc)
    kw = dict(block_mask=bm, score_mod=by_position)
    want = cuflash.flash_attention(q, k, v, return_lse=True, backend="numpy", **kw)
    *w_grads, w_mod = cuflash.flash_attention_backward(do, q, k, v, *want, backend="numpy",
                                                       return_mod_grads=True, **kw)
    qg, kg, vg, dog = (cupy.asarray(x) for x in (q, k, v, do))
    got = cuflash.flash_attention(qg, kg, vg, return_lse=True, **kw)
    *g_grads, g_mod = cuflash.flash_attention_backward(dog, qg, kg, vg, *got,
                                                       return_mod_grads=True, **kw)
    tol = {np.float16: 2e-2, np.float32: 1e-4, np.float64: 1e-10}[dtype]
    for g, w in zip((*got, *g_grads), (*want, *w_grads)):
        np.testing.assert_allclose(cupy.asnumpy(g).astype(np.float64), w.astype(np.float64),
                                   rtol=tol, atol=tol)
    for name in ("row_bias", "col_bias"):
        np.testing.assert_allclose(cupy.asnumpy(g_mod[name]), w_mod[name], rtol=tol * 10,
                                   atol=tol * 10)
