"""score_mod and mask_mod compiled into the CUDA kernels, run in the emulator: the SIMT
kernels, mma.sync tensor cores (16-bit), tf32 (float32) and the Hopper kernels, forward
and backward, against test_programmable's per-element Python reference; the gradients of
the arrays a score_mod captures (return_mod_grads), against finite differences."""
import numpy as np
import pytest

from cuflash import variants as _variants
from cuflash.backends import kernel_backward, kernel_backward_sm90, kernel_forward
from cuflash.backends import kernel_forward_sm90
from cuflash.emulator import EmulatorError
from cuflash.programmable import translate
from cuflash.programmable.cuda_c import kernel_mods

from conftest import (HAS_GPU, HAS_GXX, assert_close_to_reference, assert_lse_close, attention_inputs,
                      emulator_backend, to_host)
import test_programmable
from test_programmable import document_mask, reference, swin_bias, t5_bias

pytestmark = pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")

NQ, NK, H = 130, 270, 2  # test_programmable's sizes (its examples index with them)
F16, F32, F64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))


def soft_distance(score, b, h, q_idx, kv_idx):
    """Nonlinear in the score (the derivative's product and tanh rules), integer distance."""
    d = abs(q_idx + NK - NQ - kv_idx)
    return 4.0 * np.tanh(score * score / 4.0 + score) - 0.01 * d / (1 + h)


def _variants_of(score_mod=None, mask_mod=None, **builtin):
    return _variants.Variants(
        score_mod=None if score_mod is None else translate(score_mod, "score_mod"),
        mask_mod=None if mask_mod is None else translate(mask_mod, "mask_mod"), **builtin)


def _forward_backward(be, q, k, v, do, o, lse, var, *, hopper):
    if hopper:
        o_k, lse_k = kernel_forward_sm90.forward_sm90(be, q, k, v, causal=False, scale=32 ** -0.5,
                                                      variants=var)
        Dvec = np.sum(do.astype(np.float32) * o.astype(np.float32), axis=-1)
        grads = kernel_backward_sm90.backward_sm90(be, do, q, k, v, lse.astype(np.float32), Dvec,
                                                   causal=False, scale=32 ** -0.5, variants=var,
                                                   dq_workers=8)   # the five GEMMs
        return o_k, lse_k, grads
    o_k, lse_k = kernel_forward.forward(be, q, k, v, causal=False, scale=32 ** -0.5,
                                        algorithm="fa2", variants=var)
    grads = kernel_backward.backward(be, do, q, k, v, o, lse, causal=False, scale=32 ** -0.5,
                                     variants=var)
    return o_k, lse_k, grads


KERNELS = [("simt", "sm_80", (7, 0), F32), ("simt", "sm_80", None, F64),
           ("mma.sync", "sm_80", None, F16), ("tf32", "sm_80", None, F32),
           ("hopper", "sm_90a", None, F16)]
MODS = {"t5+document": dict(score_mod=t5_bias, mask_mod=document_mask),
        "soft_distance": dict(score_mod=soft_distance), "swin": dict(score_mod=swin_bias)}
# Every family with the table and the document mask; the nonlinear score_mod on two of them
# (its derivative is the same generated code everywhere); the rest with `-m slow`.
FAST = {("t5+document", k) for k in range(len(KERNELS))} | {("soft_distance", 1),
                                                             ("soft_distance", 2)}


@pytest.mark.parametrize("kernel,arch,cc,dtype,mods", [
    pytest.param(*KERNELS[k], MODS[m], id=f"{m}-{KERNELS[k][0]}-{KERNELS[k][3]}",
                 marks=() if (m, k) in FAST else pytest.mark.slow)
    for m in MODS for k in range(len(KERNELS))])
def test_kernels_run_the_mods(kernel, arch, cc, dtype, mods):
    be = emulator_backend(arch, cc=cc, checked=kernel in ("simt", "hopper"))
    q, k, v, do = attention_inputs(1, H, 1, NQ, NK, 32 if kernel != "hopper" else 64, dtype, seed=4)
    if kernel == "hopper":  # its tensor maps read (B, N, H, d) in place
        q, k, v, do = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
                       for x in (q, k, v, do))
    scale = 32 ** -0.5
    ref = reference(q, k, v, do, scale=scale, **mods)
    o, lse = ref[0].astype(dtype), ref[1]
    var = _variants_of(**mods)
    o_k, lse_k, grads = _forward_backward(be, q, k, v, do, o, lse, var, hopper=kernel == "hopper")
    plain = None
    if dtype == F16:
        plain = reference(q, k, v, do, scale=scale, p_dtype=np.float16, **mods)
    assert_close_to_reference(o_k, ref[0], plain and plain[0], dtype, what="o")
    assert_lse_close(lse_k, ref[1], dtype)
    for g, r, p, what in zip(grads, ref[2:], (None,) * 3 if plain is None else plain[2:],
                             ("dq", "dk", "dv")):
        assert_close_to_reference(g, r, p, dtype, factor=4.0, what=what)
    # the kernels named ran, every attention pass with the mods compiled in (D = rowsum(dO∘O)
    # has no score)
    launched = {p.name_expression.split("<")[0]: m for p, m in zip(be.launched, be.mods_launched)}
    fwd, dkdv, dq = {"simt": ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq"),
                     "mma.sync": ("flash_fwd_tc", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc"),
                     "tf32": ("flash_fwd_tc", "flash_bwd_dkdv_tc", "flash_bwd_dq_tc"),
                     "hopper": ("flash_fwd_sm90", "flash_bwd_dkdv_sm90", None)}[kernel]
    for name in (fwd, dkdv, dq) if dq else (fwd, dkdv):
        assert launched.get(f"{name}_kernel") is not None, (name, list(launched))
    if not dq:   # the Hopper backward's five GEMMs: dQ, the sum of the dK/dV pass's partials
        assert "flash_bwd_dq_sum_sm90_kernel" in launched
    assert all(m is None for n, m in launched.items() if "preprocess" in n or "_sum" in n)
    if kernel in ("tf32", "simt") and dtype == F32:   # float32: which of the two ran
        assert any(("float" in p.name_expression) for p in be.launched)


def _edge(score, b, h, q_idx, kv_idx):
    return score + ramp[kv_idx + 1]


ramp = np.arange(40, dtype=np.float32) * 0.5   # one entry per key


# ------------------------------------------------------------------ buffer gradients
CAP = 3.0


def _fd_gradients(q, k, v, do, scale, softcap, biased, arrays):
    """{name: ∂(Σ o·do)/∂array} of float64 attention whose biased scores are
    biased(S, Nq, Nk) (then softcap·tanh(·/softcap)), by central differences on every entry
    of each captured array in `arrays` ({name: array}, perturbed in place and restored)."""
    G = q.shape[1] // k.shape[1]
    K, V = (np.repeat(x.astype(np.float64), G, axis=1) for x in (k, v))
    S = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), K) * scale

    def loss():
        Z = biased(S, *S.shape[2:])
        if softcap:
            Z = softcap * np.tanh(Z / softcap)
        P = np.exp(Z - Z.max(axis=-1, keepdims=True))
        return float(((P / P.sum(axis=-1, keepdims=True)) @ V * do).sum())

    grads = {}
    for name, arr in arrays.items():
        saved, out = arr.copy(), np.zeros(arr.shape)
        try:
            for idx in np.ndindex(arr.shape):
                losses = []
                for step in (1e-3, -1e-3):
                    arr[idx] = saved[idx] + step
                    losses.append((float(arr[idx]), loss()))
                arr[idx] = saved[idx]
                (e_up, up), (e_down, down) = losses
                out[idx] = (up - down) / (e_up - e_down)  # the steps float32 could store
        finally:
            arr[...] = saved
        grads[name] = out
    return grads


def _t5_biased(S, Nq, Nk):
    buckets = np.array([[test_programmable.t5_bucket(j - i) for j in range(Nk)]
                        for i in range(Nq)])
    return S + test_programmable.t5_table.astype(np.float64)[None, :, buckets]


_rng = np.random.default_rng(12)
# row_bias: the head of a longer buffer, so that a read past its end lands in memory no
# kernel argument holds (the emulator's checked mode reports it)
row_bias = np.concatenate([_rng.standard_normal(70), np.zeros(256)]).astype(np.float32)[:70]
col_bias = _rng.standard_normal(150).astype(np.float64)


def by_position(score, b, h, q_idx, kv_idx):
    """Two arrays indexed by the positions themselves: a padding row or key reads past
    them unless the kernel clamps it (the square keeps the read alive in the gradient's
    code); two arrays, so their gradients sit side by side."""
    r = row_bias[q_idx]
    return score + r * r * (h + 1) + col_bias[kv_idx]


def _by_position_biased(S, Nq, Nk):
    heads = np.arange(S.shape[1])[None, :, None, None] + 1
    return S + (row_bias.astype(np.float64) ** 2)[:, None] * heads + col_bias[None, :]


GRAD_MODS = {"t5": (t5_bias, _t5_biased, {"t5_table": test_programmable.t5_table}),
             "by_position": (by_position, _by_position_biased,
                             {"row_bias": row_bias, "col_bias": col_bias})}


# One case per family by default (each of the three on some family); the rest `-m slow`.
GRAD_CASES = [("t5", False), ("t5", True), ("by_position", False)]
GRAD_FAST = {(0, 0), (1, 1), (2, 2), (3, 1), (4, 2)}  # (family, case)


@pytest.mark.parametrize("kernel,arch,cc,dtype,mod,softcap", [
    pytest.param(*KERNELS[f], *GRAD_CASES[c], id=f"{GRAD_CASES[c][0]}"
                 f"{'-softcap' if GRAD_CASES[c][1] else ''}-{KERNELS[f][0]}-{KERNELS[f][3]}",
                 marks=() if (f, c) in GRAD_FAST else pytest.mark.slow)
    for f in range(len(KERNELS)) for c in range(len(GRAD_CASES))])
def test_kernels_return_buffer_gradients(kernel, arch, cc, dtype, mod, softcap):
    """return_mod_grads on the kernels: the dQ kernel's warps add ds·∂score_mod/∂entry into
    partials of their own (in checked mode: no race, no read past an array), summed on the
    host; against finite differences of the float64 reference. An sm_90a device runs the
    mma.sync backward for it."""
    be = emulator_backend(arch, cc=cc, checked=True)
    Nq, Nk = 70, 150  # edge tiles: padding rows and keys call the vjp with dS = 0
    q, k, v, do = attention_inputs(1, H, 1, Nq, Nk, 32, dtype, seed=8)
    scale = 32 ** -0.5
    score_mod, biased, arrays = GRAD_MODS[mod]
    cap = CAP if softcap else None
    fd = _fd_gradients(q, k, v, do.astype(np.float64), scale, cap, biased, arrays)

    def softcapped(score, b, h, q_idx, kv_idx):  # the reference's one score_mod
        return CAP * np.tanh(score_mod(score, b, h, q_idx, kv_idx) / CAP)

    ref = reference(q, k, v, do, scale=scale, score_mod=softcapped if softcap else score_mod)
    var = _variants_of(score_mod=score_mod, softcap=cap)
    out = kernel_backward.backward(be, do, q, k, v, ref[0].astype(dtype), ref[1], causal=False,
                                   scale=scale, variants=var, return_mod_grads=True)
    assert set(out[3]) == set(arrays)
    for name, g in out[3].items():
        assert g.shape == arrays[name].shape and g.dtype == arrays[name].dtype
        tol = {F64: 1e-5, F32: 1e-4, F16: 2e-2}[dtype] * max(1.0, np.abs(fd[name]).max())
        assert np.abs(g - fd[name]).max() <= tol, (name, np.abs(g - fd[name]).max(), tol)
    assert {p.kernel for p in be.launched} >= {"flash_bwd_dq_tc" if dtype != F64 and cc is None
                                               else "flash_bwd_dq"}


@pytest.mark.parametrize("dtype,d", [(F64, 320), (F32, 256)], ids=["simt-float64", "tf32-float32"])
def test_buffer_gradients_with_head_dim_chunks(dtype, d):
    """Head dims the dQ kernels split over blocks (SIMT above 256, tf32 at 256 in chunks of
    128): every chunk's block sees the whole dS, one adds the gradients."""
    be = emulator_backend("sm_80")
    q, k, v, do = attention_inputs(1, H, 1, 40, 72, d, dtype, seed=9)
    scale = d ** -0.5
    score_mod, biased, arrays = GRAD_MODS["t5"]
    fd = _fd_gradients(q, k, v, do.astype(np.float64), scale, None, biased, arrays)
    ref = reference(q, k, v, do, scale=scale, score_mod=score_mod)
    out = kernel_backward.backward(be, do, q, k, v, ref[0].astype(dtype), ref[1], causal=False,
                                   scale=scale, variants=_variants_of(score_mod=score_mod),
                                   return_mod_grads=True)
    dq_plan = next(p for p in be.launched if p.kernel.startswith("flash_bwd_dq"))
    assert (dq_plan.chunked if dtype == F64 else dq_plan.num_d_chunks(d) > 1), dq_plan
    g = out[3]["t5_table"]
    tol = {F64: 1e-5, F32: 1e-4}[dtype] * max(1.0, np.abs(fd["t5_table"]).max())
    assert np.abs(g - fd["t5_table"]).max() <= tol


def test_public_api_buffer_gradients(monkeypatch):
    """flash_attention_backward(..., return_mod_grads=True) on the emulator: the NumPy
    backend's gradients (finite-difference tested in test_programmable); past the partials'
    memory limit, a ValueError naming the arrays."""
    import cuflash
    q, k, v, do = attention_inputs(2, H, 1, 70, 150, 16, F32, seed=10)
    o, lse = cuflash.flash_attention(q, k, v, score_mod=by_position, return_lse=True)
    kw = dict(score_mod=by_position, return_mod_grads=True)
    *_, got = cuflash.flash_attention_backward(do, q, k, v, o, lse, backend="emulator", **kw)
    *_, want = cuflash.flash_attention_backward(do, q, k, v, o, lse, backend="numpy", **kw)
    assert set(got) == set(want) == {"row_bias", "col_bias"}
    for name in want:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(kernel_backward, "_MOD_GRAD_BYTES", 1 << 10)
    with pytest.raises(ValueError, match=r"return_mod_grads: the kernels add the gradients of "
                                         r"row_bias \(70 entries\), col_bias \(150 entries\) "
                                         r"into one partial per dQ warp, \d+ of them"):
        cuflash.flash_attention_backward(do, q, k, v, o, lse, backend="emulator", **kw)


def test_out_of_range_reads():
    """ramp[kv_idx + 1] reads one past the end at the last key: the emulator's checked mode
    reports the read; elsewhere the index is clamped to the array's edge."""
    q, k, v, do = attention_inputs(1, 1, 1, NQ, 40, 32, F64, seed=1)
    var = _variants_of(score_mod=_edge)
    with pytest.raises(EmulatorError, match=r"out-of-bounds global read .* \(in cuflash_score_mod\("):
        kernel_forward.forward(emulator_backend("sm_80", checked=True), q, k, v, causal=False,
                               scale=0.2, algorithm="fa2", variants=var)
    o, _ = kernel_forward.forward(emulator_backend("sm_80"), q, k, v, causal=False, scale=0.2,
                                  algorithm="fa2", variants=var)

    def clamped(score, b, h, q_idx, kv_idx):
        return score + ramp[min(kv_idx + 1, 39)]

    ref, _ = reference(q, k, v, scale=0.2, score_mod=clamped)
    np.testing.assert_allclose(to_host(o), ref, rtol=1e-12, atol=1e-12)


def test_generated_code_and_key():
    """One specialization per expression and buffer dtypes: the key ignores the values."""
    sm, mm = translate(t5_bias, "score_mod"), translate(document_mask, "mask_mod")
    a = kernel_mods(np, sm, mm, np.float32)
    b = kernel_mods(np, sm, None, np.float32)
    assert a.key != b.key and a.flags == 64 | 128 and b.flags == 64
    assert "#define CUFLASH_SCORE_MOD 1" in a.code and "#define CUFLASH_MASK_MOD 1" in a.code
    assert "CUFLASH_MASK_MOD" not in b.code
    assert [n for n, _ in a.buffers] == ["t5_table", "doc_id"]
    assert a.buffers[1][1].dtype == np.int64 and a.buffers[0][1].dtype == np.float32
    assert kernel_mods(np, sm, mm, np.float64).buffers[0][1].dtype == np.float64


def every_operation(score, b, h, q_idx, kv_idx):
    """The subset's operations, on negative operands too (Python's floor division and
    modulo, NumPy's for floats), in one score_mod."""
    d = q_idx - kv_idx
    i = d // 7 + d % 5 - (-d) // 3 + ((d << 2) >> 1) + (d & 12) - (d | 3) + (d ^ 5) + 2 ** 3
    f = score * 0.5
    g = f // 0.3 + f % 0.7 - (-f) % 0.4 + f ** 2 + abs(f) ** 0.5 + np.exp(-f * f) + np.log1p(f * f)
    x = np.where(((d > 0) & ~(d == 3)) | (h == 1), g, -g) + np.clip(f, -0.2, 0.3)
    x = x + min(i, 4) * 0.01 + max(f, 0.1) + np.minimum(f, -0.1) + np.sign(d) * 0.1
    x = x + (np.floor(f) if not d < -5 else np.ceil(f)) + np.trunc(f * 3) + np.exp2(-abs(f))
    return (x + np.sqrt(f * f + 1) - np.tanh(f) + np.arctan(f) + float(i % 3)
            + int(f * 10) * 0.01 + abs(d) % 4 + np.log(2 + np.cos(f) + np.sin(f)))


@pytest.mark.parametrize("backend", ["numpy", "emulator"])
def test_every_operation(backend):
    import cuflash
    q, k, v, _ = attention_inputs(1, 2, 2, 40, 50, 8, F64, seed=9)
    o = cuflash.flash_attention(q, k, v, score_mod=every_operation, backend=backend)
    ref, _ = reference(q, k, v, scale=8 ** -0.5, score_mod=every_operation)
    np.testing.assert_allclose(to_host(o), ref, rtol=1e-11, atol=1e-12)


seq_table = np.array([[0.5, -0.5], [1.0, 0.0], [-1.0, 2.0], [0.25, 0.75]])


def per_sequence(score, b, h, q_idx, kv_idx):
    return score + seq_table[b, h] * 0.1 * (q_idx - kv_idx)


def local(b, h, q_idx, kv_idx):
    return abs(q_idx - kv_idx) <= 8 * (b + 1)


@pytest.mark.parametrize("backend", ["numpy", "emulator"])
def test_packed_sequences_see_their_own_index(backend):
    """flash_attention_varlen: b is the sequence's index, q_idx and kv_idx its positions."""
    import cuflash
    from conftest import packed
    rng = np.random.default_rng(5)
    lq, lk = [50, 0, 70, 33], [60, 10, 65, 33]
    q, k, v, cq, ck = packed(rng, lq, lk, 2, 1, 16, np.float64)
    o, lse = cuflash.flash_attention_varlen(q, k, v, cq, ck, score_mod=per_sequence,
                                            mask_mod=local, return_lse=True, backend=backend)
    do = rng.standard_normal(o.shape)
    grads = cuflash.flash_attention_varlen_backward(do, q, k, v, o, lse, cq, ck,
                                                    score_mod=per_sequence, mask_mod=local,
                                                    backend=backend)
    for b in range(4):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if lq[b] == 0:
            continue
        ref = reference(q[None, :, rq], k[None, :, rk], v[None, :, rk], do[None, :, rq],
                        scale=16 ** -0.5,
                        score_mod=lambda s, _, h, i, j: per_sequence(s, b, h, i, j),
                        mask_mod=lambda _, h, i, j: local(b, h, i, j))
        np.testing.assert_allclose(to_host(o)[:, rq], ref[0][0], rtol=1e-10, atol=1e-12)
        for g, r, rows in zip(grads, ref[2:], (rq, rk, rk)):
            np.testing.assert_allclose(to_host(g)[:, rows], r[0], rtol=1e-9, atol=1e-11)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [F16, F32, F64])
@pytest.mark.parametrize("mods", [dict(score_mod=t5_bias, mask_mod=document_mask),
                                  dict(score_mod=soft_distance)],
                         ids=["t5+document", "soft_distance"])
def test_on_the_gpu(dtype, mods):
    """The generated code through NVRTC on the device's kernels (the Hopper ones on an
    H100), forward and backward, against the per-element reference."""
    import cupy
    import cuflash
    q, k, v, do = attention_inputs(1, H, 1, NQ, NK, 64, dtype, seed=6)
    ref = reference(q, k, v, do, scale=0.125, **mods)
    plain = reference(q, k, v, do, scale=0.125, p_dtype=np.float16, **mods) if dtype == F16 else None
    qg, kg, vg, dog = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cuflash.flash_attention(qg, kg, vg, return_lse=True, **mods)
    grads = cuflash.flash_attention_backward(dog, qg, kg, vg, o, lse, **mods)
    assert_close_to_reference(o, ref[0], plain and plain[0], dtype, what="o")
    for g, r, p, what in zip(grads, ref[2:], (None,) * 3 if plain is None else plain[2:],
                             ("dq", "dk", "dv")):
        assert_close_to_reference(g, r, p, dtype, factor=4.0, what=what)


def test_fa1_kernel_runs_the_mods():
    """algorithm="fa1": flash_fwd_fa1.cu takes the same generated chain."""
    be = emulator_backend("sm_80", cc=(7, 0))
    q, k, v, _ = attention_inputs(1, H, 1, NQ, NK, 32, F64, seed=10)
    var = _variants_of(score_mod=t5_bias, mask_mod=document_mask)
    o, lse = kernel_forward.forward(be, q, k, v, causal=False, scale=0.2, algorithm="fa1",
                                    variants=var)
    ref = reference(q, k, v, scale=0.2, score_mod=t5_bias, mask_mod=document_mask)
    np.testing.assert_allclose(to_host(o), ref[0], rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(to_host(lse), ref[1], rtol=1e-11, atol=1e-12)
    assert [p.name_expression.split("<")[0] for p in be.launched] == ["flash_fwd_fa1_kernel"]
    assert be.mods_launched[0] is not None


def decode_bias(score, b, h, q_idx, kv_idx):
    return score - 0.05 * (h + 1) * abs(kv_idx - cache_len[b] + 3 - q_idx) + seq_table[b, h]


def not_sink(b, h, q_idx, kv_idx):
    return (kv_idx >= 2) | (kv_idx == 0)


cache_len = np.array([37, 90, 5])


@pytest.mark.parametrize("backend,page,num_splits", [("numpy", None, 3), ("numpy", 16, 2),
                                                     ("emulator", None, 0),
                                                     ("emulator", 64, 0)])
def test_kv_cache_sees_cache_positions(backend, page, num_splits):
    """flash_attention_with_kvcache: kv_idx is the key's position in the cache (also in
    the NumPy backend's chunks, and through a paged cache's block table)."""
    import cuflash
    rng = np.random.default_rng(11)
    B, H, nq, d, cap = 3, 2, 3, 16, 128
    q = rng.standard_normal((B, H, nq, d))
    k = rng.standard_normal((B, H, cap, d))
    v = rng.standard_normal((B, H, cap, d))
    kc, vc, table = k, v, None
    if page is not None:   # the same keys in pages, in a shuffled order
        pages = cap // page
        perm = rng.permutation(B * pages)
        kc = np.empty((B * pages, H, page, d))
        vc = np.empty_like(kc)
        table = perm.reshape(B, pages)
        for b in range(B):
            for p in range(pages):
                kc[table[b, p]] = k[b, :, p * page:(p + 1) * page]
                vc[table[b, p]] = v[b, :, p * page:(p + 1) * page]
    o = cuflash.flash_attention_with_kvcache(q, kc, vc, cache_len, block_table=table,
                                             causal=True, score_mod=decode_bias,
                                             mask_mod=not_sink, num_splits=num_splits,
                                             backend=backend)
    for b in range(B):
        L = cache_len[b]
        ref, _ = reference(q[b:b + 1], k[b:b + 1, :, :L], v[b:b + 1, :, :L], scale=d ** -0.5,
                           score_mod=lambda s, _, h, i, j: decode_bias(s, b, h, i, j),
                           mask_mod=lambda _, h, i, j: not_sink(b, h, i, j) and j <= i + L - nq)
        np.testing.assert_allclose(to_host(o)[b], ref[0], rtol=1e-10, atol=1e-12)
