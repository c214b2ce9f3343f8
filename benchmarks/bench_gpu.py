"""GPU benchmark: cuflash forward, backward and forward+backward against its peers, in one
run on one CUDA device: CuPy naive attention, and where installed PyTorch SDPA, cuDNN
(PyTorch SDPA restricted to its cuDNN backend, which runs cudnn-frontend's fused
attention) and flash-attn. The headline is the ratio of cuflash's rate to each peer's.

Validates first (every implementation against a float64 reference on a small problem),
then times with `cupyx.profiler.benchmark` (GPU time, events on the current stream).

FLOPs follow FlashAttention's convention (cuflash.flops):
    forward  = 4 · B · H · Nq · Nk · d        (two matmuls, 2 FLOPs per multiply-add)
               halved for causal (half the score matrix is masked)
    backward = 2.5 · forward                   (five matmuls instead of two)

Writes bench_gpu.csv and bench_gpu.png to benchmarks/results/ (or --out).

    python benchmarks/bench_gpu.py [--dtype float16 bfloat16] [--d 64 128 256]
                                   [--seqlens 512 ... 16384] [--causal both]
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
import math
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from cuflash.flops import attention_flops  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _gpu_or_exit():
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        n, why = 0, f"{type(e).__name__}: {e}"
    else:
        why = "CuPy sees 0 CUDA devices"
    if n == 0:
        print(f"bench_gpu: no CUDA GPU available ({why}); this benchmark needs one. "
              "Use `python -m cuflash bench` for the CPU benchmark.", file=sys.stderr)
        sys.exit(2)
    import cupy
    return cupy


# ── implementations: each returns fwd(q,k,v) -> o and bwd(do) -> grads callables ─────

def cuflash_impl(cp, q, k, v, causal, scale):
    import cuflash

    def fwd():
        return cuflash.flash_attention(q, k, v, causal=causal, scale=scale, backend="cuda")

    o, lse = cuflash.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                     backend="cuda")

    def bwd(do):
        return cuflash.flash_attention_backward(do, q, k, v, o, lse, causal=causal,
                                                scale=scale, backend="cuda")
    return fwd, bwd


def cupy_naive_impl(cp, q, k, v, causal, scale):
    """S = scale·Q Kᵀ, P = softmax(S), O = P V in CuPy, materialising S (N×N), with the
    backward of the seed equations. Accumulates in the input dtype's matmul (cuBLAS)."""
    Nq, Nk = q.shape[-2], k.shape[-2]
    mask = None
    if causal:
        i = cp.arange(Nq)[:, None]
        j = cp.arange(Nk)[None, :]
        mask = j > i + (Nk - Nq)

    def probs():
        s = (q @ k.swapaxes(-1, -2)).astype(cp.float32) * scale
        if mask is not None:
            s = cp.where(mask, -cp.inf, s)
        s = s - s.max(axis=-1, keepdims=True)
        p = cp.exp(s)
        return p / p.sum(axis=-1, keepdims=True)

    def fwd():
        return probs().astype(q.dtype) @ v

    o = fwd()

    def bwd(do):
        p = probs()
        pl = p.astype(q.dtype)
        dv = pl.swapaxes(-1, -2) @ do
        dp = (do @ v.swapaxes(-1, -2)).astype(cp.float32)
        D = (do.astype(cp.float32) * o.astype(cp.float32)).sum(-1, keepdims=True)
        ds = (p * (dp - D)).astype(q.dtype)
        return (ds @ k) * scale, (ds.swapaxes(-1, -2) @ q) * scale, dv
    return fwd, bwd


def torch_sdpa_impl(cp, q, k, v, causal, scale, sdpa_backend=None):
    """PyTorch's scaled_dot_product_attention; `sdpa_backend` restricts it to one of its
    kernels (torch.nn.attention.SDPBackend), None lets PyTorch choose."""
    import contextlib

    import torch
    import torch.nn.functional as F
    tq, tk, tv = (torch.as_tensor(x, device="cuda").requires_grad_(True) for x in (q, k, v))
    Nq, Nk = q.shape[-2], k.shape[-2]
    mask = None
    if causal and Nq != Nk:  # torch's is_causal is top-left aligned; cuflash's bottom-right
        i = torch.arange(Nq, device="cuda")[:, None]
        j = torch.arange(Nk, device="cuda")[None, :]
        mask = ~(j > i + (Nk - Nq))

    def only():
        if sdpa_backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel
        return sdpa_kernel(sdpa_backend)

    def run():
        with only():
            return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask,
                                                  is_causal=causal and mask is None, scale=scale)

    def fwd():
        with torch.no_grad():
            return run()

    out = run()

    def bwd(do):
        tdo = torch.as_tensor(do, device="cuda")
        return torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)
    return fwd, bwd


def cudnn_impl(cp, q, k, v, causal, scale):
    """cuDNN's fused attention (cudnn-frontend), through PyTorch SDPA's cuDNN backend."""
    from torch.nn.attention import SDPBackend
    return torch_sdpa_impl(cp, q, k, v, causal, scale, sdpa_backend=SDPBackend.CUDNN_ATTENTION)


def flash_attn_impl(cp, q, k, v, causal, scale):
    import torch
    from flash_attn import flash_attn_func  # (B, N, H, d) layout; bottom-right causal ≥ 2.1
    tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2).requires_grad_(True)
                  for x in (q, k, v))

    def fwd():
        with torch.no_grad():
            return flash_attn_func(tq, tk, tv, softmax_scale=scale, causal=causal)

    out = flash_attn_func(tq, tk, tv, softmax_scale=scale, causal=causal)

    def bwd(do):
        tdo = torch.as_tensor(do, device="cuda").transpose(1, 2)
        return torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)
    return fwd, bwd


PEERS = ("cupy-naive", "torch-sdpa", "cudnn", "flash-attn")


def _cupy_sees_a_gpu():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def peer_status(dtype):
    """{peer: None if it can run here, else why not} for `dtype`."""
    sixteen_bit = np.dtype(dtype).itemsize == 2
    status = {"cupy-naive": None if _cupy_sees_a_gpu() else "CuPy sees no CUDA device"}
    try:
        import torch
    except ImportError:
        return {**status, **{p: "PyTorch is not installed" for p in PEERS[1:]}}
    if not torch.cuda.is_available():
        return {**status, **{p: "PyTorch sees no CUDA device" for p in PEERS[1:]}}
    status["torch-sdpa"] = None
    try:
        from torch.nn.attention import SDPBackend
        has_cudnn = hasattr(SDPBackend, "CUDNN_ATTENTION")
    except ImportError:
        has_cudnn = False
    status["cudnn"] = (("cuDNN attention takes float16/bfloat16 only" if not sixteen_bit
                        else None) if has_cudnn else "this PyTorch has no cuDNN SDPA backend")
    try:
        import flash_attn  # noqa: F401
        status["flash-attn"] = None if sixteen_bit else "flash-attn takes float16/bfloat16 only"
    except ImportError:
        status["flash-attn"] = "flash-attn is not installed"
    return status


def available_impls(dtype):
    makers = {"cupy-naive": cupy_naive_impl, "torch-sdpa": torch_sdpa_impl,
              "cudnn": cudnn_impl, "flash-attn": flash_attn_impl}
    impls = {"cuflash": cuflash_impl}
    impls.update({p: makers[p] for p, why in peer_status(dtype).items() if why is None})
    return impls


def _host(x):
    if hasattr(x, "detach"):  # torch
        return x.detach().double().cpu().numpy()
    return np.asarray(x.get() if hasattr(x, "get") else x).astype(np.float64)


# ── validation ───────────────────────────────────────────────────────────────────────

def validate(cp, impls, dtype, causal):
    """Every implementation against the float64 reference on a small problem."""
    from cuflash import reference
    rng = np.random.default_rng(0)
    B, H, Nq, Nk, d = 1, 2, 200, 256, 64
    host = [rng.standard_normal((B, H, n, d)).astype(dtype) for n in (Nq, Nk, Nk, Nq)]
    q_h, k_h, v_h, do_h = host
    scale = 1.0 / math.sqrt(d)
    o_ref, lse_ref = reference.naive_attention(q_h, k_h, v_h, causal=causal, scale=scale,
                                               return_lse=True)
    # The backward reference from the reference forward's o/lse (rounded to dtype).
    g_ref = reference.attention_backward(do_h, q_h, k_h, v_h, o_ref.astype(dtype), lse_ref,
                                         causal=causal, scale=scale)
    q, k, v, do = (cp.asarray(x) for x in host)
    tol = 2e-2 if np.dtype(dtype).itemsize == 2 else 1e-4
    ok = {}
    for name, make in impls.items():
        try:
            fwd, bwd = make(cp, q, k, v, causal, scale)
            o = _host(fwd())
            if name == "flash-attn":
                o = o.transpose(0, 2, 1, 3)
            errs = [np.max(np.abs(o - o_ref))]
            grads = bwd(do)
            for g, r in zip(grads, g_ref):
                g = _host(g)
                if name == "flash-attn":
                    g = g.transpose(0, 2, 1, 3)
                errs.append(np.max(np.abs(g - r)) / max(1.0, np.max(np.abs(r))))
            good = max(errs) <= tol
            print(f"  validate {name:11s} causal={causal!s:5s} max err o/dq/dk/dv = "
                  + " ".join(f"{e:.2e}" for e in errs) + ("  ok" if good else "  FAILED"))
            ok[name] = good
        except Exception as e:
            print(f"  validate {name:11s} causal={causal}: skipped ({type(e).__name__}: {e})")
            ok[name] = False
    return ok


# ── timing ───────────────────────────────────────────────────────────────────────────

def _torch_peak():
    try:
        import torch
        return torch.cuda.max_memory_allocated()
    except Exception:
        return 0


MODES = ("fwd", "bwd", "fwd+bwd")


def time_one(cp, name, make, B, H, N, d, dtype, causal, n_repeat):
    """Median GPU time, TFLOP/s and extra memory (MiB: CuPy pool growth, or PyTorch's
    peak allocation for the torch-based peers) of the forward and the backward."""
    from cupyx.profiler import benchmark
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((B, H, N, d), dtype=cp.float32).astype(dtype)
                   for _ in range(4))
    scale = 1.0 / math.sqrt(d)
    pool = cp.get_default_memory_pool()
    out = {}
    for mode in MODES:
        try:
            cp.cuda.Device().synchronize()
            pool.free_all_blocks()
            base = pool.used_bytes()
            uses_torch = name in ("torch-sdpa", "flash-attn")
            if uses_torch:
                import torch
                torch.cuda.reset_peak_memory_stats()
                tbase = torch.cuda.memory_allocated()
            fwd, bwd = make(cp, q, k, v, causal, scale)
            fn = {"fwd": fwd, "bwd": lambda: bwd(do), "fwd+bwd": lambda: (fwd(), bwd(do))}[mode]
            fn()  # warm-up: compiles, autotunes, allocates
            res = benchmark(fn, n_repeat=n_repeat, n_warmup=3)
            t = float(np.median(res.gpu_times[0]))  # seconds
            mem = ((_torch_peak() - tbase) if uses_torch else (pool.total_bytes() - base)) / 2**20
            out[mode] = (t, attention_flops(B, H, N, N, d, causal=causal, pass_=mode) / t / 1e12, mem)
        except Exception as e:  # OOM (naive at long N) and the like: record, go on
            out[mode] = (float("nan"), float("nan"), float("nan"))
            print(f"    {mode}: {type(e).__name__}: {str(e)[:120]}")
            cp.get_default_memory_pool().free_all_blocks()
    return out


def _dtype(name):
    if name == "bfloat16":
        from ml_dtypes import bfloat16
        return np.dtype(bfloat16)
    return np.dtype(name)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["float16", "bfloat16", "float32"],
                    choices=["float16", "bfloat16", "float32", "float64"])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+",
                    default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "true", "false"], default="both")
    ap.add_argument("--tokens", type=int, default=16384, help="B·N per run (batch = tokens/N)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where CSV and plot go")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: list the sweep, the kernel plans per arch, validate cuflash "
                         "in the CPU emulator, list the peers; times nothing")
    args = ap.parse_args(argv)
    args.causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    return args


def sweep(args):
    """Every timed configuration: (dtype name, causal, d, N, B)."""
    return [(dt, causal, d, N, max(1, args.tokens // N)) for dt in args.dtype
            for causal in args.causals for d in args.d for N in args.seqlens]


def headline(rows):
    """cuflash's rate over each peer's, per configuration: the numbers that matter."""
    key = lambda r: (r["dtype"], r["causal"], r["d"], r["N"], r["mode"])  # noqa: E731
    rate = {(r["impl"],) + key(r): r["tflops"] for r in rows}
    for r in rows:
        if r["impl"] == "cuflash":
            for peer in PEERS:
                other = rate.get((peer,) + key(r), float("nan"))
                r[f"vs_{peer}"] = r["tflops"] / other if other == other and other else float("nan")
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    cp = _gpu_or_exit()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    dev_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {dev_name}")

    impls_by_dtype = {}
    for name in args.dtype:
        dtype = _dtype(name)
        impls = available_impls(dtype)
        for causal in args.causals:
            ok = validate(cp, impls, dtype, causal)
            if not ok.get("cuflash", False):
                print(f"bench_gpu: cuflash failed validation ({name}); not timing.",
                      file=sys.stderr)
                return 1
            impls = {n: f for n, f in impls.items() if ok.get(n)}
        impls_by_dtype[name] = impls

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'impl':11s} {'dtype':9s} {'causal':6s} {'d':>4s} {'N':>6s} {'B':>4s} {'mode':7s} "
          f"{'ms':>9s} {'TFLOP/s':>8s} {'MiB':>8s}")
    for name, causal, d, N, B in sweep(args):
        for impl, make in impls_by_dtype[name].items():
            res = time_one(cp, impl, make, B, args.heads, N, d, _dtype(name), causal, args.repeat)
            for mode, (t, tf, mem) in res.items():
                rows.append(dict(impl=impl, device=dev_name, dtype=name, causal=causal, B=B,
                                 H=args.heads, N=N, d=d, mode=mode, ms=t * 1e3, tflops=tf,
                                 mem_mib=mem))
                print(f"{impl:11s} {name:9s} {causal!s:6s} {d:4d} {N:6d} {B:4d} {mode:7s} "
                      f"{t * 1e3:9.3f} {tf:8.2f} {mem:8.1f}")
    headline(rows)
    print("\ncuflash's rate over each peer's (> 1: cuflash faster):")
    print(f"{'dtype':9s} {'causal':6s} {'d':>4s} {'N':>6s} {'mode':7s} "
          + " ".join(f"{p:>10s}" for p in PEERS))
    for r in rows:
        if r["impl"] == "cuflash":
            print(f"{r['dtype']:9s} {r['causal']!s:6s} {r['d']:4d} {r['N']:6d} {r['mode']:7s} "
                  + " ".join(f"{r['vs_' + p]:10.2f}" for p in PEERS))
    fields = list(dict.fromkeys(k for r in rows for k in r))
    csv_path = args.out / "bench_gpu.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {csv_path}")
    plot(rows, args.out / "bench_gpu.png", args)
    return 0


def dry_run(args):
    """Everything the benchmark does that needs no GPU (see the module docstring)."""
    from cuflash import compiler, reference, tiling
    from cuflash.backends.kernels import emulator_backend, emulator_limits
    from cuflash.emulator import archs

    configs = sweep(args)
    print(f"bench_gpu --dry-run: no GPU timings exist yet; this run times nothing.\n"
          f"The sweep a GPU run would time: {len(configs)} configurations x {len(MODES)} "
          f"passes ({', '.join(MODES)}): dtypes {args.dtype}, d {args.d}, N {args.seqlens}, "
          f"causal {list(args.causals)}, {args.tokens} tokens per run, {args.heads} heads.")

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
    for name in args.dtype:
        dtype = _dtype(name)
        be = emulator_backend(arch="sm_80")
        q, k, v, do = (rng.standard_normal((1, 2, n, 64)).astype(dtype) for n in (40, 56, 56, 40))
        for causal in args.causals:
            o, lse = be.forward(q, k, v, causal=causal, scale=0.125, algorithm="fa2")
            grads = be.backward(do, q, k, v, o, lse, causal=causal, scale=0.125)
            o_ref, lse_ref = reference.naive_attention(q, k, v, causal=causal, scale=0.125,
                                                       return_lse=True)
            g_ref = reference.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                 scale=0.125)
            tol = 2e-2 if dtype.itemsize == 2 else 1e-4
            errs = [np.max(np.abs(np.asarray(x, np.float64) - r)) / max(1.0, np.max(np.abs(r)))
                    for x, r in zip((o, *grads), (o_ref, *g_ref))]
            good = max(errs) <= tol
            ok &= good
            print(f"  {name:9s} causal={causal!s:5s} max rel err o/dq/dk/dv = "
                  + " ".join(f"{e:.1e}" for e in errs) + ("  ok" if good else "  FAILED"))

    print("\npeers a GPU run would compare against:")
    for name in args.dtype:
        status = peer_status(_dtype(name))
        print(f"  {name:9s} " + "; ".join(f"{p}: {'ready' if why is None else why}"
                                          for p, why in status.items()))

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_gpu_plans.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {path}\nno GPU timings exist yet: run without --dry-run on a CUDA machine "
          f"for bench_gpu.csv and bench_gpu.png.")
    return 0 if ok else 1


def plot(rows, path, args):
    """TFLOP/s over N, one panel per (pass, dtype, d, causal), every implementation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    combos = [(dt, c, d) for dt in args.dtype for c in args.causals for d in args.d]
    fig, axes = plt.subplots(len(MODES), len(combos), figsize=(4 * len(combos), 3.3 * len(MODES)),
                             squeeze=False)
    for col, (dt, causal, d) in enumerate(combos):
        for r_i, mode in enumerate(MODES):
            ax = axes[r_i][col]
            for impl in sorted({r["impl"] for r in rows}):
                pts = [(r["N"], r["tflops"]) for r in rows
                       if r["impl"] == impl and r["dtype"] == dt and r["causal"] == causal
                       and r["d"] == d and r["mode"] == mode]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} {dt} d={d} {'causal' if causal else 'full'}", fontsize=9)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"cuflash vs peers ({rows[0]['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
