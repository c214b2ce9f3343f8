"""Variants on the CPU backend: what a sliding window saves, what a bias costs in memory.

1. Window: causal attention with a window of `w` keys visits only the blocks of its band,
   so it should cost about w/N of the full square. Validated against the float64
   reference on a slice of rows first, then timed (`--repeat` interleaved runs, medians
   of the per-run ratios, wall and CPU time): the full square through the same variant
   loops (`window=(-1, -1)`: every block, no per-element test), and the default forward
   (the plain path), against causal+window. The ideal ratio is the share of N² the
   band's tiles compute.
2. Bias memory: the peak memory a forward, a backward and a backward with dbias allocate
   beyond the arrays alive before the call (the inputs and the bias the caller holds),
   traced (tracemalloc: NumPy's allocations) and resident (the VmHWM growth), with a
   per-head (1, H, N, N) bias, a broadcast (1, 1, N, N) bias and no bias, for each
   `--mem-heads` (with one head the two bias shapes coincide). A bias read in place adds
   nothing of size N × N; dbias is the bias's own size.

    python benchmarks/bench_variants.py [--n 8192] [--window 256] [--repeat 7]
        [--mem-n 16384] [--mem-heads 1 2] [--skip-window] [--skip-memory]
"""
import argparse
import statistics
import time
import tracemalloc

import numpy as np

import cuflash
from cuflash import reference


def timed(fn):
    """(wall, CPU) seconds of one call; CPU time sums the pool's threads, so it moves
    less than wall time when other processes share the cores."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def band_fraction(n, w):
    """The scores the NumPy variant loops compute for causal+window(w, 0), over N²: the
    ideal cost ratio for their tile sizes (the band alone is about w/N)."""
    from cuflash.backends.numpy_backend import variants as loops
    br, bc = loops._tile_sizes(n, n, 1, True, (w, 0))
    sched = loops.variant_schedule(n, n, br, bc, causal=True, window=(w, 0))
    computed = sum((r1 - r0) * (c1 - c0) for r0, r1, steps in sched for c0, c1, _ in steps)
    return computed / n**2, br, bc


def window_ratio(n, w, d, repeat):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, d), np.float32) for _ in range(3))
    # -- validate: the last 64 rows against the float64 reference (keys they can see)
    o = cuflash.flash_attention(q, k, v, causal=True, window=(w, 0))
    rows = slice(n - 64, n)
    keys = slice(n - 64 - w, n)
    ref = reference.naive_attention(q[..., rows, :], k[..., keys, :], v[..., keys, :],
                                    causal=True, window=(w, 0))
    err = float(np.abs(o[..., rows, :] - ref).max())
    assert err < 1e-4, err
    runs = {"band": lambda: cuflash.flash_attention(q, k, v, causal=True, window=(w, 0)),
            "square": lambda: cuflash.flash_attention(q, k, v, window=(-1, -1)),
            "plain": lambda: cuflash.flash_attention(q, k, v)}
    # Interleaved: each repeat times all three back to back, so load from other processes
    # hits them alike; the ratios are medians of the per-repeat ratios.
    t = {name: [] for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            t[name].append(timed(fn))
    med = lambda xs: statistics.median(xs)  # noqa: E731
    wall = {name: med([x[0] for x in ts]) for name, ts in t.items()}
    ratio = {(name, i): med([b[i] / s[i] for b, s in zip(t["band"], t[name])])
             for name in ("square", "plain") for i in (0, 1)}
    frac, br, bc = band_fraction(n, w)
    print(f"window: N={n}, d={d}, causal+window({w}, 0), float32, max err {err:.1e}, "
          f"{repeat} interleaved repeats")
    print(f"  causal+window      {wall['band'] * 1e3:9.1f} ms")
    for name, what in (("square", "same variant loops"), ("plain", "default forward")):
        print(f"  full square ({what}) {wall[name] * 1e3:9.1f} ms   ratio wall "
              f"{ratio[name, 0]:.4f}, CPU {ratio[name, 1]:.4f}")
    print(f"  w/N = {w / n:.4f}; keys seen per row / N = {(w + 1) / n:.4f}; scores the "
          f"{br} x {bc} tiles compute / N² = {frac:.4f} (the ideal ratio)")


def _proc_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def peak_extra(fn):
    """(traced, rss, fn()): the peak bytes fn allocates beyond what was live before —
    traced: NumPy's allocations (tracemalloc), which is what the code under test asks
    for; rss: the growth of the resident set's high-water mark (Linux: VmHWM, reset
    through /proc/self/clear_refs), which also sees BLAS buffers and thread stacks (None
    where it cannot be reset)."""
    rss0 = None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        rss0 = _proc_kib("VmRSS")
    except OSError:
        pass
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = fn()
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = None if rss0 is None else (_proc_kib("VmHWM") - rss0) * 1024
    return traced, rss, out


def bias_memory(n, d, heads):
    """Peak extra memory of a forward and a backward (without and with dbias) with a
    per-head (1, H, N, N) bias and a broadcast (1, 1, N, N) bias, against the same
    calls without a bias. With one head the two shapes are the same array."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, heads, n, d), np.float32) for _ in range(3))
    mib = lambda x: "      -" if x is None else f"{x / 2**20:7.1f}"  # noqa: E731
    print(f"bias memory: N={n}, d={d}, {heads} head(s), float32 (q, k, v, o, dq, dk, dv "
          f"{q.nbytes / 2**20:.0f} MiB each; N×N float32 = {n * n * 4 / 2**20:.0f} MiB); "
          f"peak MiB beyond the live arrays, traced (NumPy) / resident")
    no_bias = dict(window=(-1, -1))  # the variant loops, without a bias
    _, _, (o, lse) = peak_extra(lambda: cuflash.flash_attention(q, k, v, return_lse=True,
                                                                **no_bias))
    rows = [("no bias (same loops)", None)]
    shapes = [("per-head (1, H, N, N)", (1, heads, n, n)),
              ("broadcast (1, 1, N, N)", (1, 1, n, n))]
    rows += shapes if heads > 1 else shapes[1:]
    for name, shape in rows:
        opts = dict(no_bias)
        if shape is not None:
            bias = np.empty(shape, np.float32)
            bias[...] = rng.standard_normal((1, 1, 1, n), np.float32)  # cheap to fill
            opts["bias"] = bias
        fwd = peak_extra(lambda: cuflash.flash_attention(q, k, v, return_lse=True, **opts))
        bwd = peak_extra(lambda: cuflash.flash_attention_backward(o, q, k, v, o, lse, **opts))
        line = (f"  {name:24s} bias {mib(None if shape is None else bias.nbytes)} | forward "
                f"{mib(fwd[0])} / {mib(fwd[1])} | backward {mib(bwd[0])} / {mib(bwd[1])}")
        if shape is not None:
            bwd_db = peak_extra(lambda: cuflash.flash_attention_backward(
                o, q, k, v, o, lse, return_dbias=True, **opts))
            line += (f" | with dbias {mib(bwd_db[0])} / {mib(bwd_db[1])} (dbias itself "
                     f"{mib(bwd_db[2][3].nbytes)})")
            del bias, opts, bwd_db
        print(line, flush=True)
        del fwd, bwd


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--mem-n", type=int, default=16384)
    ap.add_argument("--mem-heads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-window", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_window:
        window_ratio(args.n, args.window, args.d, args.repeat)
    if not args.skip_memory:
        for heads in args.mem_heads:
            bias_memory(args.mem_n, args.d, heads)


if __name__ == "__main__":
    main()
