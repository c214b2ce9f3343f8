"""Programmable attention on the CPU backend: what a score_mod, a mask_mod and a block mask
cost against plain attention, and what a block mask costs to make.

1. Mods: forward and backward, float32, B=1, H=8, N=2048, d=64 (--n, --heads, --d; every
   case causal with --causal): plain,
   the built-in softcap / ALiBi / bias, and the same written as score_mods, a T5-style table
   lookup, a document mask_mod, and the document mask as a block mask. Interleaved runs,
   each timed against the plain call of its repetition: the median of those paired ratios
   (--repeat), and the median time.
2. Block mask at N=16384 (--mask-n): the time and peak memory (tracemalloc) of
   `cuflash.block_mask` for a document mask, and its tiles.
3. Translation and compilation of one specialization: translating a score_mod, and
   building its generated kernel (the T5 table and the document mask in the SIMT forward)
   for the emulator (g++) and, where NVRTC is installed, NVRTC + ptxas for sm_80.

Writes benchmarks/results/bench_mods.csv (bench_mods_causal.csv with --causal).

    python benchmarks/bench_mods.py [--n 2048] [--repeat 7] [--mask-n 16384] [--causal]
"""
import argparse
import csv
import os
import statistics
import tempfile
import time
import tracemalloc

import numpy as np

import cuflash
from cuflash.programmable import translate
from machine import machine

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cases(N, H, rng):
    """{name: flash_attention keyword arguments}, the mods closing over their arrays."""
    slopes = np.linspace(0.05, 0.5, H).astype(np.float32)
    bias = rng.standard_normal((1, H, N, N)).astype(np.float32)
    table = rng.standard_normal((H, 32)).astype(np.float32)
    doc = np.repeat(np.arange(8), -(-N // 8))[:N]

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * np.tanh(score / 20.0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * abs(q_idx - kv_idx)

    def dense_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    def table_lookup(score, b, h, q_idx, kv_idx):
        return score + table[h, min(abs(q_idx - kv_idx) // 64, 31)]

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return {
        "plain": {},
        "softcap (built-in)": dict(softcap=20.0),
        "softcap (score_mod)": dict(score_mod=softcap),
        "alibi (built-in)": dict(alibi_slopes=slopes),
        "alibi (score_mod)": dict(score_mod=alibi),
        "bias (built-in)": dict(bias=bias),
        "bias (score_mod)": dict(score_mod=dense_bias),
        "table lookup (score_mod)": dict(score_mod=table_lookup),
        "document (mask_mod)": dict(mask_mod=document),
        "document (block_mask)": dict(block_mask=cuflash.block_mask(document, None, None, N, N)),
    }


def time_mods(N, H, d, repeat, causal=False):
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, H, N, d), np.float32) for _ in range(4))
    runs = {name: dict(kw, causal=causal) for name, kw in cases(N, H, rng).items()}
    saved = {name: cuflash.flash_attention(q, k, v, return_lse=True, **kw)
             for name, kw in runs.items()}
    fwd = {name: [] for name in runs}
    bwd = {name: [] for name in runs}
    for _ in range(repeat):
        for name, kw in runs.items():
            o, lse = saved[name]
            t0 = time.perf_counter()
            cuflash.flash_attention(q, k, v, **kw)
            t1 = time.perf_counter()
            cuflash.flash_attention_backward(do, q, k, v, o, lse, **kw)
            t2 = time.perf_counter()
            fwd[name].append(t1 - t0)
            bwd[name].append(t2 - t1)
    rows = []
    for name in runs:
        for kind, t in (("fwd", fwd), ("bwd", bwd)):
            ratio = statistics.median(a / b for a, b in zip(t[name], t["plain"]))
            rows.append((name, kind, statistics.median(t[name]) * 1e3, ratio))
    return rows


def block_mask_cost(N):
    doc = np.repeat(np.arange(16), -(-N // 16))[:N]

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    cuflash.block_mask(document, None, None, 256, 256)  # translation warmed
    tracemalloc.start()
    t0 = time.perf_counter()
    bm = cuflash.block_mask(document, None, None, N, N)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return bm, seconds, peak


def compile_times():
    table = np.zeros((8, 32), np.float32)
    doc = np.zeros(4096, np.int64)

    def table_lookup(score, b, h, q_idx, kv_idx):
        return score + table[h, min(abs(q_idx - kv_idx) // 64, 31)]

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    t0 = time.perf_counter()
    for _ in range(100):
        sm = translate(table_lookup, "score_mod")
    out = {"translate a score_mod": (time.perf_counter() - t0) / 100}
    mm = translate(document, "mask_mod")
    from cuflash import compiler, emulator
    from cuflash.programmable.cuda_c import kernel_mods
    mods = kernel_mods(np, sm, mm, np.float32)
    name = "flash_fwd_kernel<float, 64, 64, 32, 4>"
    code = mods.code + compiler.read_source("flash_fwd.cu")
    with tempfile.TemporaryDirectory() as cache:   # a fresh cache: built, not found
        os.environ["CUFLASH_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        emulator.RawModule(code=code, options=compiler.nvrtc_options(),
                           name_expressions=[name]).get_function(name)
        out["emulator build (g++), SIMT forward"] = time.perf_counter() - t0
        del os.environ["CUFLASH_CACHE_DIR"]
    try:
        from cuflash import compile_gate
        t0 = time.perf_counter()
        [row] = compile_gate.compile_one(code, [name], "sm_80", options=compile_gate.gate_options("sm_80"))
        out["NVRTC + ptxas, SIMT forward, sm_80"] = time.perf_counter() - t0
    except Exception as e:  # no NVRTC here: say so
        out[f"NVRTC + ptxas: not measured ({type(e).__name__})"] = float("nan")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--mask-n", type=int, default=16384)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    where = machine()
    print(f"# cuflash programmable attention, CPU backend — {where['cpu']}, {os.cpu_count()} "
          f"CPUs ({where['simd']}), numpy {np.__version__} with {where['blas']}")
    rows = time_mods(args.n, args.heads, args.d, args.repeat, args.causal)
    print(f"\nB=1, H={args.heads}, N={args.n}, d={args.d}, float32{', causal' * args.causal}; "
          f"medians of {args.repeat} interleaved runs")
    print(f"{'':28} {'pass':4} {'ms':>8} {'× plain':>8}")
    for name, kind, ms, ratio in rows:
        print(f"{name:28} {kind:4} {ms:8.1f} {ratio:8.2f}")
    bm, seconds, peak = block_mask_cost(args.mask_n)
    print(f"\nblock_mask of a causal document mask, N={args.mask_n}: {seconds:.2f} s, peak "
          f"{peak / 2**20:.1f} MiB traced (N×N bools would be {args.mask_n**2 / 2**20:.0f} MiB); "
          f"{bm!r}")
    times = compile_times()
    print()
    for what, s in times.items():
        print(f"{what:40} {s * 1e3:9.1f} ms")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_mods_causal.csv" if args.causal else "bench_mods.csv")
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["case", "pass", "median_ms", "paired_vs_plain", "N", "H", "d", "cpu", "blas",
                    "causal"])
        for name, kind, ms, ratio in rows:
            w.writerow([name, kind, f"{ms:.2f}", f"{ratio:.3f}", args.n, args.heads, args.d,
                        where["cpu"], where["blas"], args.causal])
        w.writerow(["block_mask document N", "make", f"{seconds * 1e3:.1f}",
                    f"peak {peak / 2**20:.1f} MiB", args.mask_n, 1, ""])
        for what, s in times.items():
            w.writerow([what, "compile", f"{s * 1e3:.1f}", "", "", "", ""])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
