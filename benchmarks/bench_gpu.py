"""GPU benchmark: cuflash forward and backward against CuPy naive attention (and PyTorch
SDPA / flash-attn when importable), on one CUDA device.

Validates first (every implementation against a float64 reference on a small problem),
then times with `cupyx.profiler.benchmark` (GPU time, events on the current stream).

FLOPs follow FlashAttention's convention:
    forward  = 4 · B · H · Nq · Nk · d        (two matmuls, 2 FLOPs per multiply-add)
               halved for causal (half the score matrix is masked)
    backward = 2.5 · forward                   (five matmuls instead of two)

Writes benchmarks/results/bench_gpu.csv and bench_gpu.png.

    python benchmarks/bench_gpu.py [--dtype float16] [--d 64 128] [--seqlens 512 1024 2048]
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


def torch_sdpa_impl(cp, q, k, v, causal, scale):
    import torch
    import torch.nn.functional as F
    tq, tk, tv = (torch.as_tensor(x, device="cuda").requires_grad_(True) for x in (q, k, v))
    Nq, Nk = q.shape[-2], k.shape[-2]
    mask = None
    if causal and Nq != Nk:  # torch's is_causal is top-left aligned; cuflash's bottom-right
        i = torch.arange(Nq, device="cuda")[:, None]
        j = torch.arange(Nk, device="cuda")[None, :]
        mask = ~(j > i + (Nk - Nq))

    def run():
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


def available_impls(dtype):
    impls = {"cuflash": cuflash_impl, "cupy-naive": cupy_naive_impl}
    try:
        import torch
        if torch.cuda.is_available():
            impls["torch-sdpa"] = torch_sdpa_impl
            try:
                import flash_attn  # noqa: F401
                if np.dtype(dtype).itemsize == 2:  # flash-attn: fp16/bf16 only
                    impls["flash-attn"] = flash_attn_impl
            except ImportError:
                pass
    except ImportError:
        pass
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
    for mode in ("fwd", "bwd"):
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
            fn = fwd if mode == "fwd" else (lambda: bwd(do))
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "float64"])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--tokens", type=int, default=16384, help="B·N per run (batch = tokens/N)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)

    cp = _gpu_or_exit()
    if args.dtype == "bfloat16":
        from ml_dtypes import bfloat16 as dtype
    else:
        dtype = np.dtype(args.dtype)
    dtype = np.dtype(dtype)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    dev_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {dev_name}, dtype {dtype}")

    impls = available_impls(dtype)
    for causal in (False, True):
        ok = validate(cp, impls, dtype, causal)
        if not ok.get("cuflash", False):
            print("bench_gpu: cuflash failed validation; not timing.", file=sys.stderr)
            return 1
        impls = {n: f for n, f in impls.items() if ok.get(n)}

    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    hdr = f"{'impl':11s} {'causal':6s} {'d':>4s} {'N':>6s} {'B':>4s} {'mode':4s} " \
          f"{'ms':>9s} {'TFLOP/s':>8s} {'MiB':>8s} {'vs naive':>8s}"
    print(hdr)
    for causal in (False, True):
        for d in args.d:
            for N in args.seqlens:
                B = max(1, args.tokens // N)
                res = {n: time_one(cp, n, f, B, args.heads, N, d, dtype, causal, args.repeat)
                       for n, f in impls.items()}
                for name, r in res.items():
                    for mode, (t, tf, mem) in r.items():
                        naive_t = res.get("cupy-naive", {}).get(mode, (float("nan"),))[0]
                        ratio = naive_t / t if t == t and naive_t == naive_t else float("nan")
                        rows.append(dict(impl=name, device=dev_name, dtype=str(dtype),
                                         causal=causal, B=B, H=args.heads, N=N, d=d, mode=mode,
                                         ms=t * 1e3, tflops=tf, mem_mib=mem,
                                         speedup_vs_naive=ratio))
                        print(f"{name:11s} {causal!s:6s} {d:4d} {N:6d} {B:4d} {mode:4s} "
                              f"{t * 1e3:9.3f} {tf:8.2f} {mem:8.1f} {ratio:8.2f}")

    csv_path = RESULTS / "bench_gpu.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {csv_path}")
    plot(rows, RESULTS / "bench_gpu.png", args)
    return 0


def plot(rows, path, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    combos = [(c, d) for c in (False, True) for d in args.d]
    fig, axes = plt.subplots(2, len(combos), figsize=(4 * len(combos), 7), squeeze=False)
    for col, (causal, d) in enumerate(combos):
        for r_i, mode in enumerate(("fwd", "bwd")):
            ax = axes[r_i][col]
            for impl in sorted({r["impl"] for r in rows}):
                pts = [(r["N"], r["tflops"]) for r in rows
                       if r["impl"] == impl and r["causal"] == causal and r["d"] == d
                       and r["mode"] == mode]
                if pts:
                    ax.plot(*zip(*sorted(pts)), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode} d={d} {'causal' if causal else 'full'}")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"cuflash vs peers ({rows[0]['device']}, {rows[0]['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
