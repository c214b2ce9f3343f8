"""Variants on the CPU backend: what a sliding window saves, what a bias costs in memory.

1. Window: causal attention with a window of `w` keys visits only the blocks of its band,
   so it should cost about w/N of the full square. Validated against the float64
   reference on a slice of rows first, then timed (`--repeat` interleaved runs, medians
   of the per-run ratios, wall and CPU time): the full square through the same variant
   loops (`window=(-1, -1)`: every block, no per-element test), and the default forward
   (the plain path), against causal+window. The ideal ratio is the share of N² the
   band's tiles compute.
2. Bias memory: peak memory traced (tracemalloc: NumPy's allocations) during a forward
   and a backward with a per-head (B, H, N, N) bias and with a broadcast (1, 1, N, N) bias,
   beyond the inputs and the bias the caller holds. A bias that is read in place adds
   nothing of size N × N; dbias is the bias's own size.

    python benchmarks/bench_variants.py [--n 8192] [--window 256] [--mem-n 16384]
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


def traced_peak(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, out


def bias_memory(n, d, heads):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, heads, n, d), np.float32) for _ in range(3))
    io = 3 * q.nbytes  # o, do-sized outputs for scale
    print(f"bias memory: N={n}, d={d}, {heads} head(s), float32 "
          f"(q, k, v {q.nbytes / 2**20:.0f} MiB each; N×N float32 = {n * n * 4 / 2**30:.2f} GiB)")
    for name, shape in (("per-head (B, H, N, N)", (1, heads, n, n)),
                        ("broadcast (1, 1, N, N)", (1, 1, n, n))):
        bias = np.empty(shape, np.float32)
        bias[...] = rng.standard_normal((1, 1, 1, n), np.float32)  # cheap to fill
        peak_f, (o, lse) = traced_peak(lambda: cuflash.flash_attention(
            q, k, v, bias=bias, return_lse=True))
        peak_0, _ = traced_peak(lambda: cuflash.flash_attention(q, k, v, window=(-1, -1),
                                                                return_lse=True))
        peak_b, grads = traced_peak(lambda: cuflash.flash_attention_backward(
            o, q, k, v, o, lse, bias=bias, return_dbias=True))
        mib = lambda x: x / 2**20  # noqa: E731
        print(f"  {name}: bias {mib(bias.nbytes):8.0f} MiB | forward peak {mib(peak_f):7.1f} "
              f"MiB (same loops without bias {mib(peak_0):7.1f} MiB) | backward peak "
              f"{mib(peak_b):8.1f} MiB (dbias itself {mib(grads[3].nbytes):8.0f} MiB)")
        del bias, grads
    del io


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--mem-n", type=int, default=16384)
    ap.add_argument("--mem-heads", type=int, default=1)
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args(argv)
    window_ratio(args.n, args.window, args.d, args.repeat)
    if not args.skip_memory:
        bias_memory(args.mem_n, args.d, args.mem_heads)


if __name__ == "__main__":
    main()
