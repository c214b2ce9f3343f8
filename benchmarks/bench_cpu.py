"""CPU benchmark: cuflash's NumPy backend vs naive NumPy attention and PyTorch SDPA.

cuflash's forward and backward are the compiled kernels where this CPU and compiler
allow them (their widest build, or the one `--native` names; the header says which),
and then the NumPy tiles alone (`CpuConfig(native="off")`) are timed beside them as
"tiles".

Validates first (against cuflash.reference on a small case, against PyTorch on the
real case), then times. FLOPs follow FlashAttention's convention: forward
4·B·H·Nq·Nk·d (halved when causal), backward 2.5× forward. The contenders are
timed in turn within each repetition, so that a busy machine slows them alike;
each gets the median and the best (minimum) of its runs — the best is timeit's
convention on a shared machine, where slower runs are mostly interference — and,
against PyTorch, the median of the per-repetition ratios ("paired"), which a machine
whose speed drifts between repetitions disturbs least. The calls run back to back, as
in a loop over layers: PyTorch's OpenMP threads and NumPy's OpenBLAS threads are made
to sleep as soon as a call returns (OMP_WAIT_POLICY=PASSIVE and OPENBLAS_THREAD_TIMEOUT=4,
unless set already; the first left PyTorch's own times the same here), so that they do
not spin on the cores the next contender needs: a forward right after a 2-thread NumPy
matmul took 24.3 ms against 12.5 with OpenBLAS's threads asleep (N = 1024, d = 64; the
naive contender's matmuls are such). `--settle S`
idles S seconds before every call instead, the method of earlier results: on a
virtual machine the first milliseconds after an idle pause run slower, by more for
the contender that touches more fresh memory.
The header and every CSV row name the CPU (model, SIMD flags) and the BLAS kernels
NumPy runs (OpenBLAS's core, and OPENBLAS_CORETYPE where it is set): every ratio
depends on both.
Every N times the forward and the backward (against PyTorch's forward+backward); the
main N also the naive backward and the validation against PyTorch. Writes a CSV and a
PNG (forward, and forward+backward, causal or not, over N) to benchmarks/results/.

    python benchmarks/bench_cpu.py            # B=1, H=8, N=2048, d=64 + sweep N, 15 repetitions
    python benchmarks/bench_cpu.py --quick    # a smaller, faster run (3 repetitions)
    python benchmarks/bench_cpu.py --headdim 128 --sweep 1024 2048 4096 8192 --tag zen5_d128
"""
import argparse
import csv
import dataclasses
import math
import os
import sys
import time
import tracemalloc

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before PyTorch starts its threads
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # before NumPy loads OpenBLAS

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cuflash import reference as R  # noqa: E402
from cuflash.backends import numpy_backend as nb  # noqa: E402
from cuflash.backends.numpy_backend import native  # noqa: E402
from cuflash.flops import attention_flops  # noqa: E402
from machine import machine  # noqa: E402

try:
    import torch
except ImportError:  # the benchmark runs without PyTorch, minus its columns
    torch = None

BK = nb.BACKEND  # main() sets the build of the compiled kernels (--native)
TILES = nb.NumpyBackend(dataclasses.replace(nb.DEFAULT_CONFIG, native="off"))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SETTLE_S = 0.0    # idle pause before every timed call (see time_interleaved)
REPEATS = 15      # repetitions by default: the paired ratio is a median of this many


# ------------------------------------------------------------------ contenders
def naive_forward(q, k, v, causal, scale):
    """Plain NumPy attention in the input dtype: the N×N scores are materialised."""
    S = (q * q.dtype.type(scale)) @ np.swapaxes(k, -1, -2)
    if causal:
        S[..., R.causal_mask(q.shape[-2], k.shape[-2])] = -np.inf
    S -= S.max(axis=-1, keepdims=True)
    np.exp(S, out=S)
    S /= S.sum(axis=-1, keepdims=True)
    return S @ v, S


def naive_backward(do, q, k, v, o, P, scale):
    """Plain NumPy backward from the stored N×N probabilities P."""
    dv = np.swapaxes(P, -1, -2) @ do
    dP = do @ np.swapaxes(v, -1, -2)
    dP -= np.sum(do * o, axis=-1, keepdims=True)
    dP *= P
    dq = (dP @ k) * q.dtype.type(scale)
    dk = (np.swapaxes(dP, -1, -2) @ q) * q.dtype.type(scale)
    return dq, dk, dv


def torch_forward(tq, tk, tv, causal):
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)


def torch_forward_backward(tq, tk, tv, tdo, causal):
    q, k, v = (x.detach().requires_grad_() for x in (tq, tk, tv))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    o.backward(tdo)
    return o.detach(), q.grad, k.grad, v.grad


# ------------------------------------------------------------------ helpers
def time_interleaved(fns, repeats, warmup=1, settle=SETTLE_S):
    """The seconds of each fn's runs (an array), the fns run in turn inside every
    repetition, so that run i of two fns saw the machine in about the same state.

    Each repetition runs the fns in a new (seeded) random order, so that no fn always
    follows the same one: a call's predecessor changes its time (the memory it freed,
    the caches it left; the naive contender sweeps N² floats through them).

    Each timed call starts after a `settle` pause (0 by default, see the module's
    docstring): with OpenMP's default wait policy PyTorch's threads keep spinning on
    the cores for a while after a call returns, which slowed the contender timed right
    after it by ~10% (measured on 2 cores); the pause was the remedy before
    OMP_WAIT_POLICY=PASSIVE.
    """
    for f in fns.values():
        for _ in range(warmup):
            f()
    times = {name: [] for name in fns}
    order = np.random.default_rng(0)
    for _ in range(repeats):
        for name in order.permutation(list(fns)):
            time.sleep(settle)
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: np.array(t) for name, t in times.items()}


def summary(runs, yardstick=None):
    """(median, best) seconds of `runs`, and against the yardstick's runs from the same
    repetitions: (ratio of medians, ratio of bests, median of per-repetition ratios).
    The paired ratio holds up best when the machine's speed drifts between repetitions."""
    sec, best = float(np.median(runs)), float(np.min(runs))
    if yardstick is None:
        return sec, best, (float("nan"),) * 3
    return sec, best, (sec / float(np.median(yardstick)), best / float(np.min(yardstick)),
                       float(np.median(runs / yardstick)))


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def validate_small():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 203, 59)).astype(np.float32)
    k = rng.standard_normal((1, 2, 113, 59)).astype(np.float32)
    v = rng.standard_normal((1, 2, 113, 59)).astype(np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    scale = 1 / math.sqrt(q.shape[-1])
    worst = 0.0
    for causal in (False, True):
        o_ref, lse_ref = R.naive_attention(q, k, v, causal=causal, return_lse=True)
        g_ref = R.attention_backward(do, q, k, v, o_ref, lse_ref, causal=causal)
        for bk, algorithm in ((TILES, "fa2"), (BK, "fa1"), (BK, "fa2")):
            o, lse = bk.forward(q, k, v, causal=causal, scale=scale, algorithm=algorithm)
            worst = max(worst, max_err(o, o_ref))
        g = BK.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
        worst = max(worst, *(max_err(a, b) for a, b in zip(g, g_ref)))
    assert worst < 1e-4, f"validation against the reference failed: max error {worst}"
    return worst


# ------------------------------------------------------------------ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller sweep")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed repetitions (default {REPEATS}, --quick 3)")
    ap.add_argument("--sweep", type=int, nargs="*", default=None, help="sequence lengths")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="seconds idle before every timed call (default 0)")
    ap.add_argument("--native", default="auto", choices=native.CHOICES,
                    help="the compiled kernels' build (CpuConfig.native; default auto)")
    ap.add_argument("--tag", default="", help="suffix of the CSV and PNG names")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    global BK
    BK = nb.NumpyBackend(dataclasses.replace(nb.DEFAULT_CONFIG, native=args.native))
    use_torch = torch is not None and not args.no_torch
    repeats = args.repeats or (3 if args.quick else REPEATS)
    sweep = args.sweep if args.sweep is not None else ([512, 1024] if args.quick
                                                      else [512, 1024, 2048, 4096])
    os.makedirs(args.out, exist_ok=True)

    where = machine()
    print(f"# cuflash CPU benchmark — {where['cpu']}, {os.cpu_count()} CPUs ({where['simd']}), "
          f"numpy {np.__version__} with {where['blas']} ({where['exp']} per float32)"
          + (f", torch {torch.__version__} ({torch.get_num_threads()} threads, "
             f"{torch.backends.cpu.get_cpu_capability()})" if use_torch else "")
          + (f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "")
          + (f", {args.settle} s idle before each call" if args.settle else ""))
    lib, why = native.library(args.native)
    print(f"forward and backward: the compiled kernels ({native.build(args.native)} build); "
          "\"tiles\": the NumPy tiles alone" if lib else
          f"forward and backward: the NumPy tiles (the compiled kernels are not available: {why})")
    if not use_torch:
        print("PyTorch " + ("left out (--no-torch)" if torch is not None else
                            "is not installed (pip install torch)")
              + ": no torch columns, no validation against it")
    err = validate_small()
    print(f"validation vs cuflash.reference (float32, GQA, causal/non-causal, fa1/fa2, bwd): "
          f"max error {err:.2e}  OK")

    rows = []
    B, H, d = args.batch, args.heads, args.headdim
    main_N = args.seqlen
    for N in sorted(set(sweep) | {main_N}):
        full = N == main_N  # the main case also times backward and validates vs torch
        rng = np.random.default_rng(N)
        q, k, v, do = (rng.standard_normal((B, H, N, d)).astype(np.float32) for _ in range(4))
        scale = 1 / math.sqrt(d)
        if use_torch:
            tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, do))
        for causal in (False, True):
            o, lse = BK.forward(q, k, v, causal=causal, scale=scale)
            if use_torch and full:
                to, tdq, tdk, tdv = torch_forward_backward(tq, tk, tv, tdo, causal)
                dq, dk, dv = BK.backward(do, q, k, v, o, lse, causal=causal, scale=scale)
                e_o = max_err(o, to.numpy())
                e_g = max(max_err(a, b.numpy()) for a, b in zip((dq, dk, dv), (tdq, tdk, tdv)))
                assert e_o < 1e-4 and e_g < 1e-3, f"cuflash vs torch: o {e_o}, grads {e_g}"
                print(f"validation vs torch SDPA (N={N}, causal={causal}): "
                      f"o {e_o:.1e}, grads {e_g:.1e}  OK")
            fns = {"cuflash fwd": lambda: BK.forward(q, k, v, causal=causal, scale=scale)}
            if lib is not None:
                fns["tiles fwd"] = lambda: TILES.forward(q, k, v, causal=causal, scale=scale)
            if N <= 4096:
                fns["naive fwd"] = lambda: naive_forward(q, k, v, causal, scale)
            if use_torch:
                fns["torch fwd"] = lambda: torch_forward(tq, tk, tv, causal)
            fns["cuflash bwd"] = lambda: BK.backward(do, q, k, v, o, lse, causal=causal,
                                                     scale=scale)
            if lib is not None:
                fns["tiles bwd"] = lambda: TILES.backward(do, q, k, v, o, lse, causal=causal,
                                                          scale=scale)
            if use_torch:
                fns["torch fwd+bwd"] = lambda: torch_forward_backward(tq, tk, tv, tdo, causal)
            if full:
                o_n, P_n = naive_forward(q, k, v, causal, scale)
                fns["naive bwd"] = lambda: naive_backward(do, q, k, v, o_n, P_n, scale)
            t = time_interleaved(fns, repeats, settle=args.settle)
            for impl in ("cuflash", "tiles", "naive"):
                if f"{impl} fwd" in t and f"{impl} bwd" in t:
                    t[f"{impl} fwd+bwd"] = t[f"{impl} fwd"] + t[f"{impl} bwd"]
            for name, runs in t.items():
                kind = name.split()[-1]
                flops = attention_flops(B, H, N, N, d, causal=causal, pass_=kind)
                sec, best, (vs, best_vs, paired) = summary(runs, t.get(f"torch {kind}"))
                rows.append(dict(impl=name.split()[0], pass_=kind, B=B, H=H, N=N, d=d,
                                 causal=causal, ms=sec * 1e3, best_ms=best * 1e3,
                                 gflops=flops / sec / 1e9, vs_torch=vs,
                                 best_vs_torch=best_vs, paired_vs_torch=paired))
            if use_torch:  # the speed target: bwd alone vs torch fwd+bwd
                sec, best, (vs, best_vs, paired) = summary(t["cuflash bwd"], t["torch fwd+bwd"])
                rows.append(dict(impl="cuflash", pass_="bwd/torch fwd+bwd", B=B, H=H, N=N, d=d,
                                 causal=causal, ms=sec * 1e3, best_ms=best * 1e3,
                                 gflops=float("nan"), vs_torch=vs,
                                 best_vs_torch=best_vs, paired_vs_torch=paired))

    # -- widely spread scores: q × 30, most weights underflow (a sharp, trained head) --
    spread = {}
    if not args.quick:
        rng = np.random.default_rng(2)
        q, k, v, do = (rng.standard_normal((B, H, main_N, d)).astype(np.float32)
                       for _ in range(4))
        q *= 30
        scale = 1 / math.sqrt(d)
        o, lse = BK.forward(q, k, v, causal=False, scale=scale)
        fns = {"cuflash fwd": lambda: BK.forward(q, k, v, causal=False, scale=scale),
               "cuflash bwd": lambda: BK.backward(do, q, k, v, o, lse, causal=False,
                                                  scale=scale)}
        if use_torch:
            tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, do))
            fns["torch fwd"] = lambda: torch_forward(tq, tk, tv, False)
            fns["torch fwd+bwd"] = lambda: torch_forward_backward(tq, tk, tv, tdo, False)
        spread = {name: summary(runs)[:2]
                  for name, runs in time_interleaved(fns, max(3, repeats // 2),
                                                     settle=args.settle).items()}

    # -- memory: one head, N = 16384, d = 64, float32 --
    Nm = 16384
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, Nm, 64)).astype(np.float32) for _ in range(3))
    mem = {}
    for causal in (False, True):
        nb.release_buffers()  # kept from earlier calls, they would not count
        tracemalloc.start()
        o, lse = BK.forward(q, k, v, causal=causal, scale=1 / 8)  # d = 64
        mem[f"fwd causal={causal}"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    nb.release_buffers()
    tracemalloc.start()
    BK.backward(np.ones_like(q), q, k, v, o, lse, causal=True, scale=1 / 8)
    mem["bwd causal=True"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    naive_bytes = Nm * Nm * 4

    # -- report --
    hdr = (f"{'impl':8} {'pass':18} {'N':>5} {'causal':>6} {'median ms':>9} {'GFLOP/s':>8} "
           f"{'vs torch':>8} {'best ms':>9} {'vs torch':>8} {'paired':>8}")
    print("\n" + hdr + "\n" + "-" * len(hdr))

    def ratio(x):
        return "" if math.isnan(x) else f"{x:7.2f}x"

    for r in rows:
        g = "" if math.isnan(r["gflops"]) else f"{r['gflops']:8.1f}"
        print(f"{r['impl']:8} {r['pass_']:18} {r['N']:5d} {str(r['causal']):>6} "
              f"{r['ms']:9.1f} {g:>8} {ratio(r['vs_torch']):>8} {r['best_ms']:9.1f} "
              f"{ratio(r['best_vs_torch']):>8} {ratio(r['paired_vs_torch']):>8}")
    if spread:
        print(f"\nscores spread wide (q × 30), N={main_N}, causal=False — median (best) ms:")
        for name, (sec, best) in spread.items():
            print(f"  {name:14} {sec * 1e3:9.1f} ({best * 1e3:.1f})")
    print(f"\npeak extra memory, one head N={Nm} d=64 float32 (tracemalloc, outputs included):")
    for name, b in mem.items():
        print(f"  cuflash {name:18} {b / 2**20:7.1f} MiB")
    print(f"  naive scores alone          {naive_bytes / 2**20:7.1f} MiB  (N×N float32)")

    stem = "bench_cpu" + (f"_{args.tag}" if args.tag else "")
    csv_path = os.path.join(args.out, stem + ".csv")
    with open(csv_path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["impl", "pass", "B", "H", "N", "d", "causal", "median_ms", "gflops",
                    "vs_torch", "best_ms", "best_vs_torch", "paired_vs_torch", "cpu", "simd",
                    "blas", "settle_s", "exp"])
        for r in rows:
            w.writerow([r["impl"], r["pass_"], r["B"], r["H"], r["N"], r["d"], r["causal"],
                        f"{r['ms']:.3f}", f"{r['gflops']:.2f}", f"{r['vs_torch']:.3f}",
                        f"{r['best_ms']:.3f}", f"{r['best_vs_torch']:.3f}",
                        f"{r['paired_vs_torch']:.3f}", where["cpu"], where["simd"],
                        where["blas"], args.settle, where["exp"]])
        for name, (sec, best) in spread.items():
            impl, kind = name.split()
            w.writerow([impl, f"{kind} q×30", B, H, main_N, d, False, f"{sec * 1e3:.3f}",
                        "", "", f"{best * 1e3:.3f}", "", ""])
        for name, b in mem.items():
            w.writerow(["cuflash", f"peak memory {name}", 1, 1, Nm, 64, "", "", "",
                        f"{b / 2**20:.2f} MiB", "", "", ""])
        w.writerow(["naive", "scores memory", 1, 1, Nm, 64, "", "", "",
                    f"{naive_bytes / 2**20:.2f} MiB", "", "", ""])
        if hasattr(os, "getloadavg"):  # timings on a busy machine are not comparable
            w.writerow(["machine", f"load average {os.getloadavg()[0]:.1f} on "
                        f"{os.cpu_count()} CPUs", "", "", "", "", "", "", "", "", "", "", ""])
    if hasattr(os, "getloadavg"):
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (timings above ~1 on "
              f"{os.cpu_count()} CPUs are inflated, ratios less so)")
    print(f"\nwrote {csv_path}")

    if not args.no_plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        # forward above, forward + backward below (FLOPs 3.5× the forward's); causal right
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharey="row")
        for row, (kind, what) in enumerate((("fwd", "forward"), ("fwd+bwd", "forward+backward"))):
            for ax, causal in zip(axes[row], (False, True)):
                for impl, style in (("cuflash", "o-"), ("tiles", "o:"), ("torch", "s--"),
                                    ("naive", "^:")):
                    pts = [(r["N"], r["gflops"]) for r in rows if r["impl"] == impl
                           and r["pass_"] == kind and r["causal"] == causal]
                    if pts:
                        ax.plot(*zip(*sorted(pts)), style, label=f"{impl} {what}")
                ax.set_xscale("log", base=2)
                ax.set_xlabel("sequence length N")
                ax.set_title(f"B={B}, H={H}, d={d}, float32, causal={causal}")
                ax.grid(alpha=0.3)
            axes[row][0].set_ylabel(f"{what} GFLOP/s")
            axes[row][0].legend()
        fig.tight_layout()
        png = os.path.join(args.out, stem + ".png")
        fig.savefig(png, dpi=120)
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
