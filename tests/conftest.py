"""Shared fixtures: the backends every API test body runs on, the emulator backends and
inputs of the kernel tests, the plain low-precision implementations and the tolerance rule."""
import shutil

import numpy as np
import pytest
import scipy.special

from cuflash import _dtypes, reference
from cuflash.backends import kernels


def have_toolchain() -> bool:
    """NVRTC (through CuPy) and the matching ptxas are installed. Only their absence gives
    False, so the tests that need them skip; a toolchain that is there but fails raises,
    so those tests fail instead of skipping quietly."""
    try:
        from cupy.cuda import nvrtc
    except ImportError:
        return False
    from cuflash import compile_gate
    for probe, absent in ((nvrtc.getVersion, "failed to load"),       # CuPy finds no libnvrtc
                          (compile_gate.ptxas_path, "ptxas not found")):
        try:
            probe()
        except RuntimeError as e:
            if absent not in str(e):
                raise
            return False
    return True


def _cuda_device_count():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


HAS_GPU = _cuda_device_count() > 0
HAS_GXX = shutil.which("g++") is not None


def hopper_gpu_backend():
    """The CUDA backend of an sm_90 GPU (wgmma, TMA: the Hopper kernels' tests); skips the
    test without one."""
    if not HAS_GPU:
        pytest.skip("no CUDA device")
    from cuflash.backends import kernels
    be = kernels.cuda_backend()
    if not be.limits()["sm90a"]:
        pytest.skip(f"wgmma and TMA need an sm_90 GPU, this is {be.limits()['cc']}")
    return be

BACKEND_PARAMS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("emulator", id="emulator",
                 marks=pytest.mark.skipif(not HAS_GXX, reason="the emulator needs g++")),
    pytest.param("cuda", id="cuda",
                 marks=[pytest.mark.gpu,
                        pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")]),
]


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    return request.param


def to_backend(backend, *arrays):
    """Host arrays as the backend takes them (CuPy arrays for "cuda")."""
    if backend == "cuda":
        import cupy
        out = [cupy.asarray(a) for a in arrays]
    else:
        out = list(arrays)
    return out[0] if len(out) == 1 else out


def to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


DTYPES = [pytest.param(d, id=str(d)) for d in _dtypes.SUPPORTED]


# -- the kernel tests' emulator backends and inputs -----------------------------------------

class RecordingBackend(kernels.KernelBackend):
    """A kernel backend that notes the plan of every launch, so that a test asserts the
    kernel that ran rather than the one the planner says it would pick."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launched = []
        self.mods_launched = []  # the KernelMods of each launch (None: no mods compiled in)
        self.functions = []      # the kernel of each launch (the emulator's: last_traffic)

    def get_function(self, plan, mods=None):
        self.launched.append(plan)
        self.mods_launched.append(mods)
        self.functions.append(super().get_function(plan, mods))
        return self.functions[-1]

    def take_launches(self) -> list:
        """The plans launched since the last call, in launch order."""
        out, self.launched = self.launched, []
        return out


def emulator_backend(arch, *, max_smem=None, cc=None, checked=False, schedule="round-robin",
                     seed=0) -> RecordingBackend:
    """The emulator on `arch` ("sm_80"), recording its launches. `max_smem` below the arch's
    limit makes the planner pick a smaller tile; `cc` is the compute capability the planner
    sees (cc=(7, 0): no tensor cores, so the SIMT kernels, on the same emulated arch and its
    builds); `checked`, `schedule` and `seed` as `cuflash.emulator.RawModule` takes them."""
    from cuflash import emulator
    from cuflash.emulator import archs
    arch = archs.get_arch(arch).name
    lim = kernels.emulator_limits(arch)
    if max_smem is not None:
        lim["max_smem"] = max_smem
    if cc is not None:
        lim["cc"] = cc
    return RecordingBackend("emulator", np, emulator.RawModule, device_key=lambda: "cpu",
                            limits=lambda: dict(lim),
                            module_options=dict(checked=checked, schedule=schedule, seed=seed,
                                                arch=arch),
                            encode_tensor_map=emulator.tma.encode_tiled)


def attention_inputs(B, Hq, Hkv, Nq, Nk, d, dtype, *, seed=0):
    """q, k, v, do in `dtype`, standard normal: q and do (B, Hq, Nq, d), k and v
    (B, Hkv, Nk, d), drawn in that order from one generator seeded with `seed`."""
    rng = np.random.default_rng(seed)
    shapes = ((B, Hq, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d), (B, Hq, Nq, d))
    return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def backward_inputs(B, Hq, Hkv, Nq, Nk, d, dtype, *, causal, seed=0):
    """([do, q, k, v, o, lse], scale): `attention_inputs` with o and lse from the float64
    reference forward (o rounded to `dtype`, lse stored in the accumulation dtype), so the
    errors a backward shows are its own; scale = 1/√d."""
    q, k, v, do = attention_inputs(B, Hq, Hkv, Nq, Nk, d, dtype, seed=seed)
    scale = 1.0 / np.sqrt(d)
    o, lse = reference.naive_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    return [do, q, k, v, o.astype(dtype), lse.astype(_dtypes.lse_dtype(q.dtype))], scale


def round_to(x, dtype):
    """x rounded to dtype and back to float64: one low-precision store. `dtype` may be a
    rounding function instead, for a format NumPy lacks (round_tf32)."""
    if callable(dtype) and not isinstance(dtype, type):
        return dtype(x)
    return np.asarray(x).astype(dtype).astype(np.float64)


def round_tf32(x):
    """x rounded to tf32 as cvt.rna.tf32.f32 does (10 fraction bits, ties away from zero),
    as float64; x is first stored in float32."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


# -- the plain low-precision implementation FlashAttention's rule compares with ----------

def _heads(q, k):
    """(query heads per K/V head, head axis) for inputs of 2 or more dimensions."""
    if q.ndim < 3:
        return 1, None
    return q.shape[-3] // k.shape[-3], -3


def _plain_scores(q, k, r, *, scale, causal, window, softcap, alibi_slopes, bias, mask):
    """(S, T) of the plain implementations: S = scale·q·kᵀ with the variants in the
    documented order (softcap, − ALiBi, + bias; causal, window and mask hide keys with
    −inf), each step stored by `r`; T = tanh(S/softcap) before the cap (None without).
    k has one head per query head."""
    from cuflash import reference
    nq, nk = q.shape[-2], k.shape[-2]
    s = r(scale * (q @ np.swapaxes(k, -1, -2)))
    t = None
    if softcap is not None:
        t = np.tanh(s / softcap)
        s = r(softcap * t)
    if alibi_slopes is not None:
        dist = np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :])
        s = r(s - np.asarray(alibi_slopes, np.float64)[..., None, None] * dist)
    if bias is not None:
        s = r(s + np.asarray(bias, np.float64))
    hidden = ~reference.visible_keys(nq, nk, causal=causal, window=window)
    if mask is not None:
        hidden = hidden | ~np.asarray(mask, bool)
    return np.where(hidden, -np.inf, s), t


def plain_attention(q, k, v, *, causal, scale, dtype, window=None, softcap=None,
                    alibi_slopes=None, bias=None, mask=None, dropout_p=0.0, seed=None):
    """Attention as a plain implementation in `dtype` computes it: S, P and O each stored
    in `dtype` (sums in float64), with the variants applied to S in the documented order
    (docs/api.md), each step stored in `dtype`: softcap, − ALiBi, + bias, then causal,
    window and mask hide keys; dropout multiplies P by keep/(1 − p). q is (B, Hq, Nq, d)
    when a variant is given. Returns (O, P); rows that see no key get P = 0 (P is the
    pre-dropout one)."""
    from cuflash import variants
    r = lambda x: round_to(x, dtype)  # noqa: E731
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group, axis = _heads(q, k)
    if group > 1:
        k, v = np.repeat(k, group, axis=axis), np.repeat(v, group, axis=axis)
    s, _ = _plain_scores(q, k, r, scale=scale, causal=causal, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask)
    seen = np.any(s != -np.inf, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = r(np.where(seen, scipy.special.softmax(s, axis=-1), 0.0))
    pv = p
    if dropout_p:
        keep = variants.dropout_mask(s.shape, dropout_p, seed)
        pv = r(p * keep / (1.0 - dropout_p))
    return r(pv @ v), p


def plain_lse(q, k, *, causal, scale, dtype, window=None, softcap=None, alibi_slopes=None,
              bias=None, mask=None):
    """lse of the plain implementation in `dtype`: the natural log-sum-exp (in float64) of
    its scores S, each step stored in `dtype`; −inf for rows that see no key."""
    r = lambda x: round_to(x, dtype)  # noqa: E731
    q, k = (np.asarray(a, np.float64) for a in (q, k))
    group, axis = _heads(q, k)
    if group > 1:
        k = np.repeat(k, group, axis=axis)
    s, _ = _plain_scores(q, k, r, scale=scale, causal=causal, window=window, softcap=softcap,
                         alibi_slopes=alibi_slopes, bias=bias, mask=mask)
    with np.errstate(divide="ignore"):   # a row without keys: log 0 = −inf, as the contract says
        return scipy.special.logsumexp(s, axis=-1)


def truncate_tf32(x):
    """x truncated to tf32 (its low 13 bits cleared), as a tensor core reads a float32
    operand that nothing rounded first (a wgmma's from shared memory), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


def plain_tf32_attention(q, k, v, *, causal, scale, dropout_p=0.0, seed=None, qk=round_tf32,
                         **variants):
    """O of a plain one-pass tf32 implementation, as a framework with tf32 matmuls computes
    it: S from q and k made tf32 by `qk` (round_tf32, or truncate_tf32 as a GEMM fed
    straight from memory reads them), the variants and softmax in float32
    (`plain_attention`), then P (after dropout) and V rounded to tf32 for P V, products
    exact, O stored in float32."""
    from cuflash import variants as _variants
    _, p = plain_attention(qk(q), qk(k), v, causal=causal, scale=scale,
                           dtype=np.float32, **variants)
    if dropout_p:
        p = round_to(p * _variants.dropout_mask(p.shape, dropout_p, seed) / (1 - dropout_p),
                     np.float32)
    group, axis = _heads(q, k)
    v = np.asarray(v, np.float64)
    if group > 1:
        v = np.repeat(v, group, axis=axis)
    return round_to(round_tf32(p) @ round_tf32(v), np.float32)


def plain_backward(do, q, k, v, o, lse, *, causal, scale, dtype, window=None, softcap=None,
                   alibi_slopes=None, bias=None, mask=None, dropout_p=0.0, seed=None):
    """The backward's equations with every intermediate stored in `dtype`:
    P = exp(Z − lse), dV = (P ∘ K)ᵀ dO, dP = (dO Vᵀ) ∘ K, D = rowsum(dO ∘ O),
    dZ = P ∘ (dP − D), dS = dZ ∘ (1 − T²) (softcap), dQ = dS K · scale, dK = dSᵀ Q · scale
    (dK, dV summed over each GQA group), with Z the variants' scores (S without them),
    T = tanh(S/softcap) and K = keep/(1 − p) (1 without dropout); q is (B, Hq, Nq, d) when
    a variant is given."""
    from cuflash import variants
    r = lambda x: round_to(x, dtype)  # noqa: E731
    do, q, k, v, o = (r(x) for x in (do, q, k, v, o))
    group, axis = _heads(q, k)
    ke, ve = (np.repeat(x, group, axis=axis) for x in (k, v)) if group > 1 else (k, v)
    s, t = _plain_scores(q, ke, r, scale=scale, causal=causal, window=window,
                         softcap=softcap, alibi_slopes=alibi_slopes, bias=bias, mask=mask)
    lse = np.asarray(lse, np.float64)
    p = r(np.exp(s - np.where(lse == -np.inf, np.inf, lse)[..., None]))
    keep = 1.0
    if dropout_p:
        keep = variants.dropout_mask(s.shape, dropout_p, seed) / (1.0 - dropout_p)
    dv = r(np.swapaxes(r(p * keep), -1, -2) @ do)
    dp = r(r(do @ np.swapaxes(ve, -1, -2)) * keep)
    ds = r(p * (dp - r(np.sum(do * o, axis=-1, keepdims=True))))
    if t is not None:
        ds = r(ds * (1 - t * t))
    dq = r((ds @ ke) * scale)
    dk = r((np.swapaxes(ds, -1, -2) @ q) * scale)
    if group > 1:
        grouped = k.shape[:-3] + (k.shape[-3], group) + k.shape[-2:]
        dk, dv = (x.reshape(grouped).sum(axis=-3) for x in (dk, dv))
    return dq, dk, dv


# -- tolerances --------------------------------------------------------------------------

# Absolute floor of the low-precision rule, relative to max(1, max|ref|): near each format's
# own rounding of attention outputs of size ~0.1 (fp16 keeps 11 significant bits, bf16 8;
# tf32, the tensor cores' one-pass float32 operands, 11 as fp16).
LOWP_FLOOR = {np.dtype(np.float16): 1e-5, _dtypes.BFLOAT16: 1e-4, round_tf32: 1e-5}
# float32 and float64 are compared with a fixed relative bound: their plain error is
# below what a blocked sum order changes.
FULL_PRECISION_TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-10}


def _precision(dtype):
    """np.dtype(dtype), or `dtype` itself when it is a rounding function (round_tf32)."""
    return dtype if callable(dtype) and not isinstance(dtype, type) else np.dtype(dtype)


def error_bound(ref, plain, dtype, *, factor=2.0):
    """FlashAttention's rule: factor · max|plain − ref| + floor for the low precisions
    (16-bit dtypes; round_tf32 for one-pass tf32), a fixed relative bound for float32 and
    float64 (where `plain` may be None)."""
    finite = np.isfinite(ref)
    scale = max(1.0, float(np.max(np.abs(ref[finite])))) if finite.any() else 1.0
    dtype = _precision(dtype)
    if dtype in FULL_PRECISION_TOL:
        return FULL_PRECISION_TOL[dtype] * scale
    assert plain is not None, f"the {dtype} rule needs the plain low-precision result"
    plain = np.asarray(plain, np.float64)
    plain_err = np.max(np.abs(plain[finite] - ref[finite])) if finite.any() else 0.0
    return factor * plain_err + LOWP_FLOOR[dtype] * scale


def assert_close_to_reference(out, ref, plain, dtype, *, factor=2.0, what="output"):
    """max|out − ref| <= error_bound(ref, plain, dtype, factor); non-finite reference
    entries (NaN rows, ±inf) must be reproduced exactly."""
    out = to_host(out).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=f"NaN pattern of {what}")
    np.testing.assert_array_equal(out[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)])
    if not finite.any():
        return
    err = np.max(np.abs(out[finite] - ref[finite]))
    bound = error_bound(ref, plain, dtype, factor=factor)
    name = getattr(_precision(dtype), "__name__", _precision(dtype))
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} ({name})"


def assert_lse_close(lse, ref_lse, dtype, *, plain=None, precision=None):
    """lse of inputs in `dtype` against the float64 reference's: stored in the accumulation
    dtype, −inf exactly where the reference has it, the rest within `error_bound`'s rule
    for `precision` — by default the accumulation dtype, where the scores are computed;
    round_tf32 with `plain` = `plain_lse` of tf32 operands for one-pass tf32."""
    lse = to_host(lse)
    assert lse.dtype == _dtypes.lse_dtype(dtype), (lse.dtype, dtype)
    assert_close_to_reference(lse, ref_lse, plain, precision or lse.dtype, what="lse")


def packed(rng, lengths_q, lengths_k, hq, hkv, d, dtype=np.float32):
    """Varlen inputs: q (hq, Σ lengths_q, d), k and v (hkv, Σ lengths_k, d) uniform in
    [-1, 1), and their cu_seqlens."""
    cq, ck = (np.r_[0, np.cumsum(n)].astype(np.int32) for n in (lengths_q, lengths_k))
    q = rng.uniform(-1, 1, (hq, cq[-1], d)).astype(dtype)
    k = rng.uniform(-1, 1, (hkv, ck[-1], d)).astype(dtype)
    v = rng.uniform(-1, 1, (hkv, ck[-1], d)).astype(dtype)
    return q, k, v, cq, ck


def seqs(cu):
    """The row slices of the packed sequences of cu_seqlens `cu`."""
    return [slice(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


# -- attention variants' options, as the kernel tests draw them ----------------------------

def variant_options(names, dtype, shape, seed=1):
    """The user's options (as flash_attention takes them) by name, for a (B, Hq, Hkv, Nq,
    Nk, d) problem."""
    B, Hq, _, Nq, Nk, _ = shape
    rng = np.random.default_rng(seed)
    opts = {}
    for n in names:
        if n == "causal":
            opts["causal"] = True
        elif n == "window":
            opts["window"] = (20, 4)
        elif n == "window_left":
            opts["window"] = (90, -1)
        elif n == "softcap":
            opts["softcap"] = 0.7
        elif n == "alibi":
            opts["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, Hq))
        elif n == "bias":               # the input dtype, full shape
            opts["bias"] = rng.uniform(-1, 1, (B, Hq, Nq, Nk)).astype(dtype)
        elif n == "bias_f32":           # float32, broadcast over batch and query rows
            opts["bias"] = rng.uniform(-1, 1, (1, Hq, 1, Nk)).astype(np.float32)
        elif n == "mask":
            m = rng.random((B, 1, Nq, Nk)) > 0.3
            m[0, 0, 3] = False          # a row that sees no key
            opts["mask"] = m
        elif n == "dropout":
            opts["dropout_p"], opts["seed"] = 0.3, 1234
        else:
            raise KeyError(n)
    return opts


# The bias shapes dbias is tested for: each broadcast the kernels write it for.
DBIAS_LAYOUTS = {
    "full": lambda B, H, Nq, Nk: (B, H, Nq, Nk),
    "head+batch-broadcast": lambda B, H, Nq, Nk: (1, 1, Nq, Nk),
    "batch-broadcast": lambda B, H, Nq, Nk: (1, H, Nq, Nk),
    "query-broadcast": lambda B, H, Nq, Nk: (B, H, 1, Nk),
    "query+head-broadcast": lambda B, H, Nq, Nk: (B, 1, 1, Nk),
    "key-broadcast": lambda B, H, Nq, Nk: (B, H, Nq, 1),
}


def variants_of(opts, xp=np):
    """cuflash.variants.Variants from 4-D options (what cuflash.api hands a backend), its
    arrays on `xp`'s device."""
    from cuflash import variants
    alibi, bias, mask = opts.get("alibi_slopes"), opts.get("bias"), opts.get("mask")
    return variants.Variants(
        window=opts.get("window"), softcap=opts.get("softcap"),
        alibi=None if alibi is None else xp.ascontiguousarray(xp.asarray(alibi, np.float32)),
        bias=None if bias is None else xp.asarray(bias),
        mask=None if mask is None else xp.asarray(mask),
        dropout_p=opts.get("dropout_p", 0.0), seed=opts.get("seed", 0))
