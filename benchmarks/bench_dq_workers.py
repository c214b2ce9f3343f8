"""GPU benchmark of the 5-GEMM backward's workers: the mma.sync backward timed for worker
counts W (`dq_workers=W`) and for the two-kernel backward (W = 0), against the count the
model picks (`cuflash.tiling.dq_workers`: waves of one dK/dV block per SM). It decides
`DQ_PARTS_TILE_COST` (plans/device.py), so whether the default backward off sm_90 runs
five GEMMs or two kernels.

    python benchmarks/bench_dq_workers.py [--d 64 128] [--shapes 1x16x16384 4x16x4096 16x16x1024]
                                          [--dtype float16] [--counts all] [--out benchmarks/results]
    python benchmarks/bench_dq_workers.py --dry-run [--sm-count 132]   # no GPU: the plan

Each shape is B x H x N (H query and K/V heads, Nq = Nk = N, not causal). `--counts all`
times W = 0 … 16; `--counts model` only W = 0, the count the model would run were a
5-GEMM tile worth its five GEMMs (5/7 of a two-kernel tile) and FlashAttention-2's
⌈SMs / (B·H)⌉ (what tools/gpu_check.py runs). Prints one table per shape (ms per backward,
the model's W marked) and a line per shape with the best 5-GEMM time over the two-kernel
one, and writes bench_dq_workers.csv: shape, d, W, ms, TFLOP/s (FlashAttention's
convention: the backward is 2.5 forwards), and whether the model picks that W.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def _shape(text):
    try:
        B, H, N = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BxHxN such as 1x16x16384, got {text!r}")
    if min(B, H, N) < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return B, H, N


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--d", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--shapes", nargs="+", type=_shape,
                    default=[(1, 16, 16384), (4, 16, 4096), (16, 16, 1024)])
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    ap.add_argument("--counts", choices=("all", "model"), default="all",
                    help="the worker counts to time (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the counts it would time")
    ap.add_argument("--sm-count", type=int, default=132,
                    help="the SMs --dry-run plans for (default: an H100's %(default)s)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    if args.dry_run:
        return dry_run(args)
    import cupy as cp
    from cupyx.profiler import benchmark

    import cuflash
    from cuflash import _dtypes, flops, tiling
    from cuflash.backends import kernel_backward, kernels

    backend = kernels.cuda_backend()
    sm_count = backend.limits()["sm_count"]
    dtype = cp.float16 if args.dtype == "float16" else _dtypes.BFLOAT16
    rng = cp.random.default_rng(0)
    rows = []
    for B, H, N in args.shapes:
        for d in args.d:
            q, k, v, do = (rng.standard_normal((B, H, N, d), dtype=cp.float32).astype(dtype)
                           for _ in range(4))
            scale = d ** -0.5
            o, lse = cuflash.flash_attention(q, k, v, scale=scale, return_lse=True, backend="cuda")
            (p_dkdv, _), _ = kernel_backward.backward_plans(backend, do, q, k, v)
            if not p_dkdv.dq_parts:
                print(f"\nB={B} H={H} N={N} d={d}: two kernels only (no 5-GEMM tile)")
                continue
            key_blocks = -(-N // p_dkdv.block_rows)
            model = tiling.dq_workers(B * H, key_blocks, sm_count)
            work = flops.attention_flops(B, H, N, N, d, causal=False, pass_="bwd")
            print(f"\nB={B} H={H} N={N} d={d} {args.dtype}: {key_blocks} key blocks, "
                  f"{sm_count} SMs, the model picks W={model}")
            ms_at = {}
            for w in counts(args.counts, B * H, key_blocks, sm_count):
                def run():
                    return kernel_backward.backward(backend, do, q, k, v, o, lse, causal=False,
                                                    scale=scale, dq_workers=w)
                run()
                ms = float(np.median(benchmark(run, n_repeat=args.repeat, n_warmup=1).gpu_times[0])) * 1e3
                ms_at[w] = ms
                rows.append({"B": B, "H": H, "N": N, "d": d, "dtype": args.dtype, "W": w,
                             "ms": f"{ms:.3f}", "tflops": f"{work / ms / 1e9:.1f}",
                             "model": int(w == model)})
                print(f"  W={w:2d}{' (two kernels)' if w == 0 else '':14s} {ms:8.3f} ms "
                      f"{work / ms / 1e9:7.1f} TFLOP/s{'  <- model' if w == model else ''}")
            best = min((w for w in ms_at if w), key=ms_at.get, default=None)
            if best is not None:
                print(f"  five GEMMs at best (W={best}) over two kernels: "
                      f"{ms_at[best] / ms_at[0]:.3f} (DQ_PARTS_TILE_COST = {tiling.DQ_PARTS_TILE_COST})")
            write_csv(rows, args.out / "bench_dq_workers.csv")  # after each: a run cut short keeps it
    print(f"wrote {args.out / 'bench_dq_workers.csv'}" if rows else "nothing timed")
    return 0 if rows else 1


FIELDS = ("B", "H", "N", "d", "dtype", "W", "ms", "tflops", "model")


def write_csv(rows, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path):
    """bench_dq_workers.csv's rows, numbers as numbers."""
    with open(path, newline="") as f:
        return [{k: (v if k == "dtype" else float(v) if k in ("ms", "tflops") else int(v))
                 for k, v in row.items()} for row in csv.DictReader(f)]


def best_over_two_kernels(rows):
    """{(B, H, N, d, dtype): (W, its ms, the two kernels' ms)}: per shape the fastest 5-GEMM
    count against W = 0, where both were timed."""
    shapes = {}
    for r in rows:
        shapes.setdefault(tuple(r[k] for k in ("B", "H", "N", "d", "dtype")), {})[r["W"]] = r["ms"]
    out = {}
    for key, ms in shapes.items():
        best = min((w for w in ms if w > 0), key=ms.get, default=None)
        if 0 in ms and best is not None:
            out[key] = (best, ms[best], ms[0])
    return out


def counts(which, units, key_blocks, sm_count):
    """The worker counts to time, W = 0 (two kernels) first: every count up to the key
    blocks and DQ_PARTS_MAX, or ("model") the model's count with a 5-GEMM tile at 5/7 of
    a two-kernel tile and FlashAttention-2's ⌈SMs / units⌉."""
    from cuflash import tiling
    top = min(key_blocks, tiling.DQ_PARTS_MAX)
    if which == "all":
        return [0, *range(1, top + 1)]
    fa2 = min(-(-sm_count // units), top)
    return sorted({0, tiling.dq_workers(units, key_blocks, sm_count, tile_cost=5 / 7), fa2})


def dry_run(args):
    """The counts a GPU run would time on `args.sm_count` SMs, from the planner's 5-GEMM
    tiles for an sm_90 GPU (227 KB of shared memory)."""
    from cuflash import tiling
    print(f"bench_dq_workers --dry-run: nothing is timed; {args.sm_count} SMs assumed.")
    for B, H, N in args.shapes:
        for d in args.d:
            (p_dkdv, _), _ = tiling.backward_path(d, args.dtype, (9, 0), max_smem=227 * 1024,
                                                  sm_count=args.sm_count)
            if not p_dkdv.dq_parts:
                print(f"  B={B} H={H} N={N} d={d}: two kernels only (no 5-GEMM tile)")
                continue
            key_blocks = -(-N // p_dkdv.block_rows)
            w = counts(args.counts, B * H, key_blocks, args.sm_count)
            print(f"  B={B} H={H} N={N} d={d}: {key_blocks} key blocks of {p_dkdv.block_rows}, "
                  f"W = {' '.join(map(str, w))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
