"""GPU benchmark of the 5-GEMM backward's workers: the backward timed for every worker count
W = 1 … 16 (`dq_workers=W`) and for the two-kernel backward (W = 0), against the count the
model picks (`cuflash.tiling.dq_workers`: waves of one dK/dV block per SM).

    python benchmarks/bench_dq_workers.py [--d 64 128] [--shapes 1x16x16384 4x16x4096 16x16x1024]
                                          [--dtype float16] [--out benchmarks/results]

Each shape is B x H x N (H query and K/V heads, Nq = Nk = N, not causal). Prints one table
per shape (ms per backward, the model's W marked) and writes bench_dq_workers.csv: shape,
d, W, ms, TFLOP/s (FlashAttention's convention: the backward is 2.5 forwards), and whether
the model picks that W.
"""
from __future__ import annotations

import argparse
import csv
import pathlib

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
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)

    import sys
    sys.path.insert(0, str(REPO))
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
            key_blocks = -(-N // p_dkdv.block_rows)
            model = tiling.dq_workers(B * H, key_blocks, sm_count)
            work = flops.attention_flops(B, H, N, N, d, causal=False, pass_="bwd")
            print(f"\nB={B} H={H} N={N} d={d} {args.dtype}: {key_blocks} key blocks, "
                  f"{sm_count} SMs, the model picks W={model}")
            for w in [0, *range(1, min(key_blocks, tiling.DQ_PARTS_MAX) + 1)]:
                def run():
                    return kernel_backward.backward(backend, do, q, k, v, o, lse, causal=False,
                                                    scale=scale, dq_workers=w)
                run()
                ms = float(np.median(benchmark(run, n_repeat=args.repeat, n_warmup=1).gpu_times[0])) * 1e3
                rows.append({"B": B, "H": H, "N": N, "d": d, "dtype": args.dtype, "W": w,
                             "ms": f"{ms:.3f}", "tflops": f"{work / ms / 1e9:.1f}",
                             "model": int(w == model)})
                print(f"  W={w:2d}{' (two kernels)' if w == 0 else '':14s} {ms:8.3f} ms "
                      f"{work / ms / 1e9:7.1f} TFLOP/s{'  <- model' if w == model else ''}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_dq_workers.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
