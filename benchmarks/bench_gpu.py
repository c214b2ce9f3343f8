"""GPU benchmark: cuflash forward, backward and forward+backward against its peers, in one
run on one CUDA device. Peers, each where installed: PyTorch SDPA with each of its fused
backends forced in turn (torch-flash, torch-cudnn, torch-efficient), JAX's
`dot_product_attention(implementation="cudnn")` (jax-cudnn) and flash-attn; cuflash's own
mma.sync two-kernel backward (cuflash-2kernel: the default off sm_90, where the Hopper
backward is); on an sm_90 GPU cuflash's Hopper forward on a persistent
grid, which the planner does not run (cuflash-sm90, 16-bit, d = 64 and 128: one block per
SM walking the tiles; its backward the planner's) and its Hopper backward as two passes,
seven GEMMs per tile (cuflash-sm90-2pass: the A/B of the five-GEMM default); cuflash's
float32 with allow_tf32=True
(cuflash-tf32: on sm_90a the forward's tf32 wgmma) and its backward with
deterministic=False (cuflash-atomic: dQ by atomics where the five-GEMM backward runs) on
request (`--peers ... cuflash-tf32 cuflash-atomic`), and CuPy naive attention
(`--peers ... cupy-naive`). The headline is the ratio of cuflash's rate
to each peer's.

Every row of the CSV says what ran: a timing (status ok), or why there is none:
unavailable (not installed, no device), unsupported (the peer refuses the dtype or shape),
invalid (wrong numbers), error (it raised), budget (the time budget was spent first).
Each implementation is validated against the float64 reference on a small problem for
every (dtype, d, causal) before it is timed; one that fails is not timed.

Timers: CuPy (cuflash, cupy-naive) with `cupyx.profiler.benchmark` (events on the current
stream), PyTorch with CUDA events on its current stream, JAX with the wall clock around
batches of calls ended by `block_until_ready` (its work runs on streams of its own). Each
measurement takes the median of up to --repeat runs after a warm-up, fewer (at least one)
once --max-seconds have gone.

FLOPs follow FlashAttention's convention (cuflash.flops):
    forward  = 4 · B · H · Nq · Nk · d        (two matmuls, 2 FLOPs per multiply-add)
               halved for causal (half the score matrix is masked)
    backward = 2.5 · forward                   (five matmuls instead of two)

Sizes run in ascending N; with --budget SECONDS the sweep stops adding sizes once the
budget is spent and records the rest as `budget` rows. The CSV is rewritten after every
configuration, so a run cut short keeps what it measured.

Writes bench_gpu.csv and bench_gpu.png to benchmarks/results/ (or --out).

    python benchmarks/bench_gpu.py [--dtype float16 bfloat16 float32] [--d 64 128 256]
                                   [--seqlens 1024 ... 16384] [--causal both]
                                   [--peers torch-flash ...] [--budget 540]
    python benchmarks/bench_gpu.py --dry-run    # no GPU needed: plans, validation, peers

`--dry-run` runs everything that needs no GPU: the sweep it would time, the kernel each
configuration takes on every architecture the compile gate covers (with the reason),
cuflash validated against the reference by the CPU emulator running the same kernels,
and which peers are installed. It writes benchmarks/results/bench_gpu_plans.csv and
times nothing.
"""
from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import pathlib
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from cuflash.flops import attention_flops  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODES = ("fwd", "bwd", "fwd+bwd")
# cuflash-2kernel: cuflash's mma.sync two-kernel backward, the A/B of the Hopper one
PEERS = ("torch-flash", "torch-cudnn", "torch-efficient", "jax-cudnn", "flash-attn",
         "cuflash-2kernel", "cuflash-sm90", "cuflash-sm90-2pass")
EXTRA_PEERS = ("cupy-naive", "cuflash-tf32", "cuflash-atomic")
SIXTEEN_BIT = ("float16", "bfloat16")
ALL_DTYPES = ("float16", "bfloat16", "float32")
# Validation tolerance on max|x − ref| / max(1, max|ref|): 16-bit inputs round the output
# and P to 8–11 bits; float32 peers may use split-tf32 (≈ fp32) but never plain tf32.
TOLERANCE = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-4, "float64": 1e-10}
VALIDATION_N = 256   # a multiple of 64: cuDNN's fused attention asks for it on older builds
FIELDS = ("impl", "device", "dtype", "causal", "B", "H", "N", "d", "mode", "status", "ms",
          "tflops", "mem_mib", "timer", "note")


def _dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16
        return np.dtype(bfloat16)
    return np.dtype(name)


def _median_time(run_once, n_repeat, max_s):
    """Median of up to n_repeat timings of run_once() (seconds each), at least one, fewer
    once max_s seconds have gone."""
    times, start = [], time.perf_counter()
    while len(times) < n_repeat and (not times or time.perf_counter() - start < max_s):
        times.append(run_once())
    return float(np.median(times))


def _one_line(e, limit=300):
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:limit]


# ── implementations ──────────────────────────────────────────────────────────────────
# Each makes its own inputs on its own device (no array crosses frameworks), gives the
# three passes as callables, and times them with its framework's clock. Arrays are
# (B, H, N, d) unless the implementation says otherwise; fwd() returns o, bwd() returns
# (dq, dk, dv) and fwd_bwd() returns (o, (dq, dk, dv)).

class Impl:
    name = ""
    dtypes = ALL_DTYPES
    timer = ""

    def missing(self):
        """Why this implementation cannot run on this machine, or None."""
        return None

    def unsupported(self, dtype_name, d):
        if dtype_name not in self.dtypes:
            return f"{self.name} takes {'/'.join(self.dtypes)} only"
        return None

    def describe(self, q, k, v, do):
        """What runs for these inputs (kernel, library version), for the CSV's note."""
        return ""

    def peak_reset(self):
        pass

    def peak_mib(self):
        return float("nan")

    def release(self):
        pass


class _CupyImpl(Impl):
    timer = "cupyx.profiler.benchmark"

    def missing(self):
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() == 0:
                return "CuPy sees no CUDA device"
        except Exception as e:  # no CuPy, no driver
            return f"CuPy cannot reach a CUDA device ({_one_line(e)})"
        return None

    @property
    def cp(self):
        import cupy
        return cupy

    def from_host(self, arrays):
        return [self.cp.asarray(a) for a in arrays]

    def random(self, shape, dtype_name):
        if not hasattr(self, "_rng"):
            self._rng = self.cp.random.default_rng(0)
        return self._rng.standard_normal(shape, dtype=self.cp.float32).astype(_dtype(dtype_name))

    def to_host(self, x):
        return np.asarray(self.cp.asnumpy(x)).astype(np.float64)

    def time(self, fn, n_repeat, max_s):
        from cupyx.profiler import benchmark
        fn()  # warm-up: compiles, allocates
        res = benchmark(fn, n_repeat=n_repeat, n_warmup=1, max_duration=max_s)
        return float(np.median(res.gpu_times[0]))

    def peak_reset(self):
        self.cp.cuda.Device().synchronize()
        pool = self.cp.get_default_memory_pool()
        pool.free_all_blocks()
        self._base = pool.total_bytes()

    def peak_mib(self):
        # the pool keeps every block it grew to: its growth is the pass's peak
        return (self.cp.get_default_memory_pool().total_bytes() - self._base) / 2**20

    def release(self):
        self.cp.get_default_memory_pool().free_all_blocks()


class Cuflash(_CupyImpl):
    name = "cuflash"
    dtypes = ALL_DTYPES
    # the keywords of its calls (the variants below: allow_tf32, deterministic=False)
    forward_kw, backward_kw = {}, {}

    def describe(self, q, k, v, do):
        from cuflash import tiling
        from cuflash.backends import kernel_backward, kernel_backward_sm90, kernel_forward, kernels
        backend = kernels.cuda_backend()
        tf32 = {"allow_tf32": True} if self.forward_kw.get("allow_tf32") else {}
        fwd = kernel_forward.forward_plan(backend, q, k, v, scale=q.shape[-1] ** -0.5, **tf32)
        pair, _ = kernel_backward.backward_plans(backend, do, q, k, v, plain=True, **tf32)
        workers = ""
        if isinstance(pair[0], tiling.Sm90BwdPlan):   # the Hopper pair, five GEMMs or seven
            pair, w = kernel_backward_sm90.five_gemm_pair(
                backend, pair, units=k.shape[0] * k.shape[1], Nk=k.shape[2],
                deterministic=self.backward_kw.get("deterministic", True))
            workers = f" ({w} workers)" if w else ""
        return f"{fwd.name_expression}; {pair[0].name_expression}{workers}; {pair[1].name_expression}"

    def passes(self, q, k, v, do, causal, scale):
        import cuflash
        kw = dict(causal=causal, scale=scale, backend="cuda", **self.forward_kw)
        bkw = {**kw, **self.backward_kw}
        o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **kw)

        def fwd():
            return cuflash.flash_attention(q, k, v, **kw)

        def bwd():
            return cuflash.flash_attention_backward(do, q, k, v, o, lse, **bkw)

        def fwd_bwd():
            o2, lse2 = cuflash.flash_attention(q, k, v, return_lse=True, **kw)
            return o2, cuflash.flash_attention_backward(do, q, k, v, o2, lse2, **bkw)
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


class CuflashTf32(Cuflash):
    """cuflash's float32 with allow_tf32=True: one-pass tf32 (on sm_90a the forward's wgmma,
    flash_fwd_sm90.cu), 10-bit products, validated as 16-bit inputs are."""
    name = "cuflash-tf32"
    dtypes = ("float32",)
    tolerance = {"float32": TOLERANCE["float16"]}
    forward_kw = {"allow_tf32": True}


class CuflashAtomic(Cuflash):
    """cuflash's backward with deterministic=False: dQ added by atomics from the dK/dV
    blocks (16-bit; the mma.sync five-GEMM backward at d <= 128, the Hopper one)."""
    name = "cuflash-atomic"
    backward_kw = {"deterministic": False}


class CuflashTwoKernels(Cuflash):
    """cuflash's mma.sync backward with dQ from a kernel of its own (seven GEMMs per tile, no
    dQ partials): the default's kernels off sm_90 (where the 5-GEMM backward's tile cost
    does not beat them, `tiling.DQ_PARTS_TILE_COST`), on sm_90 the measure of the Hopper
    backward against them."""
    name = "cuflash-2kernel"

    def describe(self, q, k, v, do):
        from cuflash.backends import kernel_backward, kernels
        backend = kernels.cuda_backend()
        (dkdv, dq), _ = kernel_backward.backward_plans(backend, do, q, k, v, dq_parts=False)
        return f"{dkdv.name_expression}; {dq.name_expression}"

    def passes(self, q, k, v, do, causal, scale):
        import cuflash
        from cuflash.backends import kernel_backward, kernels
        backend = kernels.cuda_backend()
        kw = dict(causal=causal, scale=scale, backend="cuda")
        o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **kw)

        def fwd():
            return cuflash.flash_attention(q, k, v, **kw)

        def bwd(o=o, lse=lse):
            return kernel_backward.backward(backend, do, q, k, v, o, lse, causal=causal,
                                            scale=scale, dq_workers=0)

        def fwd_bwd():
            o2, lse2 = cuflash.flash_attention(q, k, v, return_lse=True, **kw)
            return o2, bwd(o2, lse2)
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


class CuflashSm90(Cuflash):
    """cuflash's Hopper forward (flash_fwd_sm90.cu) as the planner does not run it, on an
    sm_90 GPU: on a persistent grid (one block per SM walking the tiles, against the
    planner's one block per tile); the backward the planner's (on sm_90: flash_bwd_sm90.cu's
    wgmma passes, dK/dV then dQ)."""
    name = "cuflash-sm90"
    dtypes = SIXTEEN_BIT

    def missing(self):
        why = super().missing()
        if why:
            return why
        from cuflash.backends import kernels
        cc = tuple(kernels.cuda_backend().limits()["cc"])
        return None if cc == (9, 0) else f"needs an sm_90 GPU (this one is cc {cc})"

    def unsupported(self, dtype_name, d):
        from cuflash.backends import kernel_forward_sm90
        if d not in kernel_forward_sm90.HEAD_DIMS:
            return f"{self.name} takes d in {kernel_forward_sm90.HEAD_DIMS} only"
        return super().unsupported(dtype_name, d)

    def describe(self, q, k, v, do):
        from cuflash import tiling
        return "; ".join([f"{tiling.sm90_fwd_plan(q.dtype.name, q.shape[-1]).name_expression} "
                          f"(persistent)", *(p.name_expression for p in
                                             tiling.sm90_bwd_plans(q.dtype.name, q.shape[-1]))])

    def passes(self, q, k, v, do, causal, scale):
        from cuflash.backends import kernel_backward, kernel_forward_sm90, kernels
        backend = kernels.cuda_backend()
        persistent = dict(causal=causal, scale=scale, num_blocks=backend.limits()["sm_count"])

        def fwd():
            return kernel_forward_sm90.forward_sm90(backend, q, k, v, **persistent)[0]

        def backward(o, lse):
            return kernel_backward.backward(backend, do, q, k, v, o, lse, causal=causal,
                                            scale=scale)

        o, lse = kernel_forward_sm90.forward_sm90(backend, q, k, v, **persistent)

        def bwd():
            return backward(o, lse)

        def fwd_bwd():
            o2, lse2 = kernel_forward_sm90.forward_sm90(backend, q, k, v, **persistent)
            return o2, backward(o2, lse2)
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


class CuflashSm90TwoPasses(CuflashSm90):
    """cuflash's Hopper backward as two passes (dK/dV, then dQ: seven GEMMs per tile) on an
    sm_90 GPU, against the planner's five-GEMM pair (`tiling.SM90_DQ_PARTS_TILE_COST`);
    the forward the planner's."""
    name = "cuflash-sm90-2pass"

    def describe(self, q, k, v, do):
        from cuflash import tiling
        return "; ".join(p.name_expression for p in tiling.sm90_bwd_plans(q.dtype.name, q.shape[-1]))

    def passes(self, q, k, v, do, causal, scale):
        import cuflash
        from cuflash.backends import kernel_backward, kernel_backward_sm90, kernels
        backend = kernels.cuda_backend()
        kw = dict(causal=causal, scale=scale, backend="cuda")

        def backward(o, lse):
            Dvec, _ = kernel_backward.preprocess(backend, do, o, lse)
            return kernel_backward_sm90.backward_sm90(backend, do, q, k, v, lse, Dvec,
                                                      causal=causal, scale=scale, dq_workers=0)

        o, lse = cuflash.flash_attention(q, k, v, return_lse=True, **kw)

        def fwd():
            return cuflash.flash_attention(q, k, v, **kw)

        def bwd():
            return backward(o, lse)

        def fwd_bwd():
            o2, lse2 = cuflash.flash_attention(q, k, v, return_lse=True, **kw)
            return o2, backward(o2, lse2)
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


class CupyNaive(_CupyImpl):
    """S = scale·Q Kᵀ, P = softmax(S), O = P V in CuPy, materialising S (N×N), with the
    backward of the seed equations; matmuls in the input dtype (cuBLAS)."""
    name = "cupy-naive"

    def passes(self, q, k, v, do, causal, scale):
        cp = self.cp
        N = q.shape[-2]
        mask = (cp.arange(N)[None, :] > cp.arange(N)[:, None]) if causal else None

        def probs():
            s = (q @ k.swapaxes(-1, -2)).astype(cp.float32) * scale
            if mask is not None:
                s = cp.where(mask, -cp.inf, s)
            p = cp.exp(s - s.max(axis=-1, keepdims=True))  # max-subtracted: no overflow
            return p / p.sum(axis=-1, keepdims=True)

        def fwd():
            return probs().astype(q.dtype) @ v

        o = fwd()

        def bwd(o=o):
            p = probs()
            dv = p.astype(q.dtype).swapaxes(-1, -2) @ do
            dp = (do @ v.swapaxes(-1, -2)).astype(cp.float32)
            D = (do.astype(cp.float32) * o.astype(cp.float32)).sum(-1, keepdims=True)
            ds = (p * (dp - D)).astype(q.dtype)
            return (ds @ k) * scale, (ds.swapaxes(-1, -2) @ q) * scale, dv

        def fwd_bwd():
            o2 = fwd()
            return o2, bwd(o2)
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


class _TorchImpl(Impl):
    timer = "torch.cuda.Event"
    layout = (0, 1, 2, 3)   # from (B, H, N, d) to the implementation's layout
    device = "cuda"

    def missing(self):
        try:
            import torch
        except ImportError:
            return "PyTorch is not installed"
        except Exception as e:
            return f"importing PyTorch failed ({_one_line(e)})"
        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA device"
        return None

    @property
    def torch(self):
        import torch
        return torch

    def _tdtype(self, dtype_name):
        return getattr(self.torch, dtype_name)

    def from_host(self, arrays):
        # float32 holds every float16/bfloat16 value exactly: the device copy is the same data
        return [self.torch.from_numpy(np.ascontiguousarray(
                    np.asarray(a, np.float32).transpose(self.layout)))
                .to(self.device, self._tdtype(a.dtype.name)) for a in arrays]

    def random(self, shape, dtype_name):
        shape = tuple(shape[i] for i in self.layout)
        return self.torch.randn(shape, device=self.device, dtype=self._tdtype(dtype_name))

    def to_host(self, x):
        return x.detach().double().cpu().numpy().transpose(np.argsort(self.layout))

    def time(self, fn, n_repeat, max_s):
        torch = self.torch
        fn()  # warm-up: kernel selection, workspace
        torch.cuda.synchronize()

        def once():
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return _median_time(once, n_repeat, max_s)

    def peak_reset(self):
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self._base = self.torch.cuda.memory_allocated()

    def peak_mib(self):
        return (self.torch.cuda.max_memory_allocated() - self._base) / 2**20

    def release(self):
        self.torch.cuda.empty_cache()

    def attend(self, q, k, v, causal, scale):
        raise NotImplementedError

    def passes(self, q, k, v, do, causal, scale):
        torch = self.torch
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))

        def attend():
            return self.attend(q, k, v, causal, scale)

        def fwd():
            with torch.no_grad():
                return attend()

        out = attend()

        def bwd():
            return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

        def fwd_bwd():
            o = attend()
            return o, torch.autograd.grad(o, (q, k, v), do)
        return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


class TorchSDPA(_TorchImpl):
    """PyTorch's scaled_dot_product_attention restricted to one fused backend."""

    def __init__(self, name, backend, dtypes):
        self.name, self.backend, self.dtypes = name, backend, dtypes

    def missing(self):
        why = super().missing()
        if why is None:
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
            except ImportError as e:
                return f"this PyTorch has no torch.nn.attention.sdpa_kernel ({e})"
            if not hasattr(SDPBackend, self.backend):
                return f"this PyTorch ({self.torch.__version__}) has no SDPA backend {self.backend}"
        return why

    def describe(self, q, k, v, do):
        return f"torch {self.torch.__version__}, SDPBackend.{self.backend}"

    def attend(self, q, k, v, causal, scale):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # square problems only, where torch's top-left causal mask is cuflash's bottom-right one
        with sdpa_kernel(getattr(SDPBackend, self.backend)):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


class FlashAttn(_TorchImpl):
    name = "flash-attn"
    dtypes = SIXTEEN_BIT
    layout = (0, 2, 1, 3)   # flash_attn_func takes (B, N, H, d)

    def missing(self):
        why = super().missing()
        if why is None:
            try:
                import flash_attn  # noqa: F401
            except ImportError:
                return "flash-attn is not installed"
            except Exception as e:
                return f"importing flash-attn failed ({_one_line(e)})"
        return why

    def describe(self, q, k, v, do):
        import flash_attn
        return f"flash-attn {flash_attn.__version__}"

    def attend(self, q, k, v, causal, scale):
        from flash_attn import flash_attn_func
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)


class JaxCudnn(Impl):
    """jax.nn.dot_product_attention(implementation="cudnn"), jitted per shape."""
    name = "jax-cudnn"
    dtypes = SIXTEEN_BIT
    timer = "wall clock, block_until_ready"

    def missing(self):
        # JAX takes 75% of the GPU at start-up unless told not to: CuPy and PyTorch share it
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        try:
            import jax
        except ImportError:
            return "JAX is not installed"
        except Exception as e:
            return f"importing JAX failed ({_one_line(e)})"
        try:
            jax.devices("gpu")
        except Exception as e:
            return f"JAX sees no CUDA device ({_one_line(e, 160)})"
        return None

    @property
    def jax(self):
        import jax
        return jax

    def from_host(self, arrays):
        return [self.jax.device_put(np.ascontiguousarray(a.transpose(0, 2, 1, 3)),
                                    self.jax.devices("gpu")[0]) for a in arrays]

    def random(self, shape, dtype_name):
        B, H, N, d = shape
        self._key, key = self.jax.random.split(getattr(self, "_key", self.jax.random.PRNGKey(0)))
        with self.jax.default_device(self.jax.devices("gpu")[0]):
            return self.jax.random.normal(key, (B, N, H, d), dtype=getattr(self.jax.numpy, dtype_name))

    def to_host(self, x):
        return np.asarray(x).astype(np.float64).transpose(0, 2, 1, 3)

    def describe(self, q, k, v, do):
        return f"jax {self.jax.__version__}, implementation='cudnn'"

    def passes(self, q, k, v, do, causal, scale):
        jax = self.jax
        f = functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=causal,
                              implementation="cudnn")
        fwd = jax.jit(f)

        def vjp(q, k, v, do):
            o, pullback = jax.vjp(f, q, k, v)
            return o, pullback(do)
        fwd_bwd = jax.jit(vjp)
        _, pullback = jax.vjp(f, q, k, v)
        bwd = jax.jit(lambda pullback, do: pullback(do))   # the pullback is a pytree: jit takes it
        return {"fwd": lambda: fwd(q, k, v), "bwd": lambda: bwd(pullback, do),
                "fwd+bwd": lambda: fwd_bwd(q, k, v, do)}

    def time(self, fn, n_repeat, max_s):
        block = self.jax.block_until_ready
        block(fn())  # warm-up: compiles
        t0 = time.perf_counter()
        block(fn())
        one = time.perf_counter() - t0
        # batches of ≥ 2 ms, so the dispatch of each call overlaps the previous call's work
        calls = max(1, min(50, int(2e-3 / max(one, 1e-6))))

        def once():
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn()
            block(out)
            return (time.perf_counter() - t0) / calls
        return _median_time(once, n_repeat, max_s)


def make_impls(names):
    """The implementations called `names`, cuflash first."""
    makers = {
        "cuflash": Cuflash,
        "torch-flash": lambda: TorchSDPA("torch-flash", "FLASH_ATTENTION", SIXTEEN_BIT),
        "torch-cudnn": lambda: TorchSDPA("torch-cudnn", "CUDNN_ATTENTION", SIXTEEN_BIT),
        "torch-efficient": lambda: TorchSDPA("torch-efficient", "EFFICIENT_ATTENTION", ALL_DTYPES),
        "jax-cudnn": JaxCudnn,
        "flash-attn": FlashAttn,
        "cupy-naive": CupyNaive,
        "cuflash-2kernel": CuflashTwoKernels,
        "cuflash-sm90": CuflashSm90,
        "cuflash-sm90-2pass": CuflashSm90TwoPasses,
        "cuflash-tf32": CuflashTf32,
        "cuflash-atomic": CuflashAtomic,
    }
    return [makers[n]() for n in dict.fromkeys(["cuflash", *names])]


# ── validation ───────────────────────────────────────────────────────────────────────

# What PyTorch raises when the one backend allowed refuses the inputs (2.11; 2.13)
_REFUSED = ("No available kernel", "No viable backend")


def _failure(e, caught=()):
    """(status, note) for an exception: `unsupported` where the implementation refuses the
    problem (PyTorch's forced backend finds no kernel, JAX's NotImplementedError), else
    `error`. PyTorch says why a backend refused in warnings: the first three are kept."""
    note = _one_line(e)
    if caught:
        note += " | " + " ".join(" ".join(str(w.message).split()) for w in caught[:3])[:300]
    refused = isinstance(e, NotImplementedError) or any(s in str(e) for s in _REFUSED)
    return ("unsupported" if refused else "error"), note


def validate(impl, dtype_name, d, causal):
    """('ok', errors) or (status, why) for `impl` on B=1, H=2, N=256: the forward's o and
    the gradients of forward+backward against the float64 reference."""
    from cuflash import reference
    dtype = _dtype(dtype_name)
    rng = np.random.default_rng(d)
    host = [rng.standard_normal((1, 2, VALIDATION_N, d)).astype(dtype) for _ in range(4)]
    q, k, v, do = host
    scale = 1.0 / math.sqrt(d)
    o_ref, lse_ref = reference.naive_attention(q, k, v, causal=causal, scale=scale,
                                               return_lse=True)
    # the gradients of the reference forward's o, rounded to dtype as every output is
    g_ref = reference.attention_backward(do, q, k, v, o_ref.astype(dtype), lse_ref,
                                         causal=causal, scale=scale)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            passes = impl.passes(*impl.from_host(host), causal, scale)
            o = impl.to_host(passes["fwd"]())
            grads = [impl.to_host(g) for g in passes["fwd+bwd"]()[1]]
        except Exception as e:
            return _failure(e, caught)
    errs = [np.max(np.abs(x - r)) / max(1.0, np.max(np.abs(r)))
            for x, r in zip((o, *grads), (o_ref, *g_ref))]
    text = "max rel err o/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs)
    tolerance = getattr(impl, "tolerance", {}).get(dtype_name, TOLERANCE[dtype_name])
    # NaN compares false with everything: test for "good", never for "bad"
    if all(e <= tolerance for e in errs):
        return "ok", text
    return "invalid", f"{text} > {tolerance:g}"


# ── the sweep ────────────────────────────────────────────────────────────────────────

def sweep(args):
    """Every timed configuration (dtype name, causal, d, N, B), in ascending N so that a
    spent budget drops the largest sizes."""
    return [(dt, causal, d, N, max(1, args.tokens // N)) for N in sorted(set(args.seqlens))
            for dt in args.dtype for causal in args.causals for d in args.d]


def measure(impl, B, H, N, d, dtype_name, causal, n_repeat, max_s):
    """{mode: (status, seconds, MiB, note)} of one configuration on one implementation."""
    shape = (B, H, N, d)
    out = {}
    try:
        q, k, v, do = (impl.random(shape, dtype_name) for _ in range(4))
        passes = impl.passes(q, k, v, do, causal, 1.0 / math.sqrt(d))
    except Exception as e:  # out of memory and the like: every pass says so
        status, note = _failure(e)
        return {m: (status, float("nan"), float("nan"), note) for m in MODES}
    try:
        what = impl.describe(q, k, v, do)
    except Exception as e:  # only the note suffers
        what = f"(which kernel is unknown: {_one_line(e, 100)})"
    for mode in MODES:
        try:
            impl.peak_reset()
            t = impl.time(passes[mode], n_repeat, max_s)
            out[mode] = ("ok", t, impl.peak_mib(), what)
        except Exception as e:
            status, note = _failure(e)
            out[mode] = (status, float("nan"), float("nan"), note)
    del q, k, v, do, passes
    impl.release()
    return out


def run_sweep(impls, configs, *, heads, n_repeat, max_s, budget=None, device="",
              clock=time.perf_counter, log=print, on_config=None):
    """Rows for every (configuration, implementation, pass); see the module docstring for
    the statuses. Validation runs once per (implementation, dtype, d, causal), before the
    first timing that needs it. `on_config(rows)` is called after each configuration."""
    rows, checked, stopped = [], {}, None
    start = clock()
    missing = {impl.name: impl.missing() for impl in impls}
    for dt, causal, d, N, B in configs:
        if stopped is None and budget is not None and clock() - start >= budget:
            stopped = N
            log(f"time budget of {budget:.0f} s spent: from {dt} causal={causal} d={d} N={N} "
                f"on, nothing is timed")
        base = dict(device=device, dtype=dt, causal=causal, B=B, H=heads, N=N, d=d)
        for impl in impls:
            if stopped is not None:
                status, note = "budget", f"not timed: the {budget:.0f} s budget was spent"
            elif missing[impl.name]:
                status, note = "unavailable", missing[impl.name]
            elif impl.unsupported(dt, d):
                status, note = "unsupported", impl.unsupported(dt, d)
            else:
                key = (impl.name, dt, d, causal)
                if key not in checked:
                    checked[key] = validate(impl, dt, d, causal)
                    log(f"  validate {impl.name:15s} {dt:8s} d={d:<3d} causal={causal!s:5s} "
                        f"{checked[key][0]}: {checked[key][1]}")
                status, note = checked[key]
            if status != "ok":
                res = {m: (status, float("nan"), float("nan"), note) for m in MODES}
            else:
                res = measure(impl, B, heads, N, d, dt, causal, n_repeat, max_s)
            for mode, (st, t, mem, why) in res.items():
                flops = attention_flops(B, heads, N, N, d, causal=causal, pass_=mode)
                rows.append(dict(impl=impl.name, **base, mode=mode, status=st, ms=t * 1e3,
                                 tflops=flops / t / 1e12, mem_mib=mem, timer=impl.timer,
                                 note=why))
                if st == "ok":
                    log(f"{impl.name:15s} {dt:8s} {causal!s:5s} d={d:<3d} N={N:<5d} B={B:<3d} "
                        f"{mode:7s} {t * 1e3:9.3f} ms {flops / t / 1e12:7.1f} TFLOP/s")
        if on_config is not None:
            on_config(rows)
    return rows


def ratios(rows):
    """{(dtype, causal, d, N, mode): {peer: cuflash's rate / peer's}} where both timed."""
    rates = {}
    for r in rows:
        if r["status"] == "ok":
            key = (r["dtype"], r["causal"], r["d"], r["N"], r["mode"])
            rates.setdefault(key, {})[r["impl"]] = r["tflops"]
    return {key: {p: got["cuflash"] / tf for p, tf in got.items() if p != "cuflash"}
            for key, got in rates.items() if "cuflash" in got}


def write_csv(rows, path):
    peers = sorted({r["impl"] for r in rows} - {"cuflash"})
    by_key = ratios(rows)
    tmp = path.with_name(path.name + ".tmp")   # then renamed: a run stopped mid-write keeps the last CSV
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*FIELDS, *(f"vs_{p}" for p in peers)])
        w.writeheader()
        for r in rows:
            extra = {}
            if r["impl"] == "cuflash":
                got = by_key.get((r["dtype"], r["causal"], r["d"], r["N"], r["mode"]), {})
                extra = {f"vs_{p}": got.get(p, float("nan")) for p in peers}
            w.writerow({**r, **extra})
    os.replace(tmp, path)


def read_csv(path):
    """The rows of a bench_gpu.csv with their types back."""
    conv = dict(causal=lambda s: s == "True", B=int, H=int, N=int, d=int, ms=float,
                tflops=float, mem_mib=float)
    with open(path, newline="") as f:
        return [{k: conv.get(k, str)(v) for k, v in r.items() if k in FIELDS}
                for r in csv.DictReader(f)]


# ── the command ──────────────────────────────────────────────────────────────────────

def _gpu_or_exit():
    why = Cuflash().missing()
    if why:
        print(f"bench_gpu: no CUDA GPU available ({why}); this benchmark needs one. "
              "Use --dry-run here, or `python -m cuflash bench` for the CPU benchmark.",
              file=sys.stderr)
        sys.exit(2)
    import cupy
    return cupy


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=list(ALL_DTYPES), choices=ALL_DTYPES)
    ap.add_argument("--d", type=_positive_int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=_positive_int, nargs="+",
                    default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--tokens", type=_positive_int, default=16384,
                    help="B·N per run (batch = tokens/N)")
    ap.add_argument("--heads", type=_positive_int, default=16)
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS + EXTRA_PEERS,
                    help="peers to time besides cuflash (default: %(default)s)")
    ap.add_argument("--repeat", type=_positive_int, default=10, help="timed runs per measurement")
    ap.add_argument("--max-seconds", type=_positive_float, default=0.5,
                    help="stop repeating a measurement after this long (it keeps ≥ 1 run)")
    ap.add_argument("--budget", type=_positive_float, default=None,
                    help="seconds for the whole run: then sizes stop being added")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where CSV and plot go")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: list the sweep, the kernel plans per arch, validate cuflash "
                         "in the CPU emulator, list the peers; times nothing")
    args = ap.parse_args(argv)
    args.causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    return args


def _compile_kernels(combo):
    """Run cuflash once at (dtype, d), forward and backward, so its kernels are compiled."""
    import cupy
    import cuflash
    dt, d = combo
    x = cupy.asarray(np.random.default_rng(0).standard_normal((1, 1, 128, d)).astype(_dtype(dt)))
    o, lse = cuflash.flash_attention(x, x, x, return_lse=True, backend="cuda")
    cuflash.flash_attention_backward(x, x, x, x, o, lse, backend="cuda")
    cupy.cuda.Device().synchronize()


def compile_in_parallel(args, log=print):
    """NVRTC takes seconds per kernel and compiles one at a time per process: compile every
    (dtype, d) in a pool of processes first, and the timed run loads them from CuPy's disk
    cache. Best effort: what fails here compiles again, serially, when first used."""
    import concurrent.futures
    import multiprocessing
    combos = [(dt, d) for dt in args.dtype for d in args.d]
    t0 = time.perf_counter()
    try:
        with concurrent.futures.ProcessPoolExecutor(
                min(8, len(combos), os.cpu_count() or 1),
                mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile_kernels, combos))
        log(f"compiled cuflash's kernels for {len(combos)} (dtype, d) in "
            f"{time.perf_counter() - t0:.0f} s")
    except Exception as e:
        log(f"parallel compilation skipped ({_one_line(e)}); kernels compile when first used")


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    t_start = time.perf_counter()
    cp = _gpu_or_exit()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    device = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {device}")
    impls = make_impls(args.peers)
    for impl in impls:
        print(f"  {impl.name:15s} {impl.missing() or 'ready'} (timer: {impl.timer})")
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = args.out / "bench_gpu.csv"
    compile_in_parallel(args)
    budget = None if args.budget is None else max(0.0, args.budget - (time.perf_counter() - t_start))
    rows = run_sweep(impls, sweep(args), heads=args.heads, n_repeat=args.repeat,
                     max_s=args.max_seconds, budget=budget, device=device,
                     on_config=lambda rows: write_csv(rows, csv_path))
    write_csv(rows, csv_path)
    print(f"wrote {csv_path}")
    print_ratios(rows)
    plot(rows, args.out / "bench_gpu.png")
    bad = [r for r in rows if r["impl"] == "cuflash" and r["status"] in ("invalid", "error")]
    if bad:
        print(f"bench_gpu: cuflash failed {len(bad)} measurements (status invalid/error in "
              f"{csv_path})", file=sys.stderr)
    return 1 if bad else 0


def print_ratios(rows):
    table = ratios(rows)
    peers = sorted({p for v in table.values() for p in v})
    print("\ncuflash's rate over each peer's (> 1: cuflash faster):")
    print(f"{'dtype':9s} {'causal':6s} {'d':>4s} {'N':>6s} {'mode':7s} "
          + " ".join(f"{p:>15s}" for p in peers))
    for (dt, causal, d, N, mode), got in table.items():
        print(f"{dt:9s} {causal!s:6s} {d:4d} {N:6d} {mode:7s} "
              + " ".join(f"{got.get(p, float('nan')):15.2f}" for p in peers))


def dry_run(args):
    """Everything the benchmark does that needs no GPU (see the module docstring)."""
    from cuflash import compiler, reference, tiling
    from cuflash.backends.kernels import emulator_backend, emulator_limits
    from cuflash.emulator import archs

    configs = sweep(args)
    print(f"bench_gpu --dry-run: no GPU timings exist yet; this run times nothing.\n"
          f"The sweep a GPU run would time: {len(configs)} configurations x {len(MODES)} "
          f"passes ({', '.join(MODES)}): dtypes {args.dtype}, d {args.d}, N "
          f"{sorted(set(args.seqlens))} in that order, causal {list(args.causals)}, "
          f"{args.tokens} tokens per run, {args.heads} heads; "
          + (f"sizes stop being added after {args.budget:.0f} s." if args.budget
             else "no time budget."))

    print("\nthe forward kernel each (dtype, d) takes, per architecture:")
    rows = []
    gate_archs = [a for a in compiler.GATE_ARCHS if a in archs.ARCHS]
    for name in args.dtype:
        for d in args.d:
            for arch in gate_archs:
                limits = emulator_limits(arch)
                plan, reason = tiling.forward_path(d, _dtype(name), limits["cc"],
                                                   max_smem=limits["max_smem"],
                                                   sm_count=limits["sm_count"])
                rows.append(dict(dtype=name, d=d, arch=arch, gpu=archs.get_arch(arch).limits.gpu,
                                 kernel=plan.name_expression, smem=plan.smem_bytes,
                                 threads=plan.num_threads, path=reason))
                print(f"  {name:9s} d={d:<4d} {arch}  {plan.name_expression:50s} {reason}")

    print("\ncuflash validated against the float64 reference in the CPU emulator (sm_80):")
    rng = np.random.default_rng(0)
    ok = True
    be = emulator_backend(arch="sm_80")
    for name in args.dtype:
        dtype = _dtype(name)
        q, k, v, do = (rng.standard_normal((1, 2, n, 64)).astype(dtype) for n in (40, 56, 56, 40))
        for causal in args.causals:
            o, lse = be.forward(q, k, v, causal=causal, scale=0.125, algorithm="fa2")
            grads = be.backward(do, q, k, v, o, lse, causal=causal, scale=0.125)
            o_ref = reference.naive_attention(q, k, v, causal=causal, scale=0.125)
            g_ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                 scale=0.125)
            errs = [np.max(np.abs(np.asarray(x, np.float64) - r)) / max(1.0, np.max(np.abs(r)))
                    for x, r in zip((o, *grads), (o_ref, *g_ref))]
            good = all(e <= TOLERANCE[name] for e in errs)   # a NaN is not good
            ok &= good
            print(f"  {name:9s} causal={causal!s:5s} max rel err o/dq/dk/dv = "
                  + " ".join(f"{e:.1e}" for e in errs) + ("  ok" if good else "  FAILED"))

    print("\npeers a GPU run would compare against:")
    for impl in make_impls(args.peers)[1:]:
        refused = [dt for dt in args.dtype if impl.unsupported(dt, 64)]
        print(f"  {impl.name:15s} {impl.missing() or 'ready'}"
              + (f" ({', '.join(refused)}: {impl.name} takes {'/'.join(impl.dtypes)} only)"
                 if refused else ""))

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_gpu_plans.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {path}\nno GPU timings exist yet: run without --dry-run on a CUDA machine "
          f"for bench_gpu.csv and bench_gpu.png.")
    return 0 if ok else 1


def plot(rows, path):
    """TFLOP/s over N: one row of panels per (dtype, causal), one column per (pass, d),
    every implementation that was timed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    timed = [r for r in rows if r["status"] == "ok"]
    if not timed:
        print(f"nothing was timed: no plot ({path})")
        return
    lines = sorted({(r["dtype"], r["causal"]) for r in timed},
                   key=lambda x: (ALL_DTYPES.index(x[0]) if x[0] in ALL_DTYPES else 9, x[1]))
    cols = [(m, d) for m in MODES for d in sorted({r["d"] for r in timed})]
    fig, axes = plt.subplots(len(lines), len(cols), figsize=(3.2 * len(cols), 2.8 * len(lines)),
                             squeeze=False)
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    for i, (dt, causal) in enumerate(lines):
        for j, (mode, d) in enumerate(cols):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted((r["N"], r["tflops"]) for r in timed
                             if (r["impl"], r["dtype"], r["causal"], r["d"], r["mode"])
                             == (impl, dt, causal, d, mode))
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=impl,
                            lw=2.5 if impl == "cuflash" else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} {dt} d={d}{' causal' if causal else ''}", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if i == len(lines) - 1:
                ax.set_xlabel("N", fontsize=8)
            if j == 0:
                ax.set_ylabel("TFLOP/s", fontsize=8)
    legend = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    fig.legend(legend.values(), legend.keys(), loc="upper right", fontsize=8)
    fig.suptitle(f"cuflash and peers, {timed[0]['device']}")
    fig.tight_layout(rect=(0, 0, 0.93, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
