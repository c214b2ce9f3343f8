"""Serving benchmark: KV-cache decoding tokens/s, and varlen vs padded at equal tokens.

Validates first (each configuration against the float64 reference on one row or one
sequence), then times. Decode: Nq = 1, cache lengths 4k–64k, batch 1…64, contiguous and
paged (page 256), on the NumPy backend — and on the CUDA backend, with flash-attn's
flash_attn_with_kvcache beside it, where a GPU (and flash-attn) is present. Varlen: B
sequences of random lengths packed, against the same batch padded to the longest
(flash_attention on (B, H, max, d) with the padding's keys hidden by a bool mask).
Writes a CSV to benchmarks/results/.

    python benchmarks/bench_serving.py            # the full sweep
    python benchmarks/bench_serving.py --quick    # a few configurations
"""
import argparse
import csv
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402
from cuflash import reference as R  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def best_of(fn, repeats):
    """(best, median) seconds of `repeats` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times), float(np.median(times))


def decode_case(xp, B, L, H, Hkv, d, paged, dtype, rng):
    page = 256
    q = xp.asarray(rng.standard_normal((B, H, 1, d)).astype(dtype))
    lens = np.full(B, L - 1, np.int32)
    kn = xp.asarray(rng.standard_normal((B, Hkv, 1, d)).astype(dtype))
    vn = xp.asarray(rng.standard_normal((B, Hkv, 1, d)).astype(dtype))
    if paged:
        pages = L // page
        kc = xp.asarray(rng.standard_normal((B * pages, Hkv, page, d)).astype(dtype))
        vc = xp.asarray(rng.standard_normal((B * pages, Hkv, page, d)).astype(dtype))
        table = rng.permutation(B * pages).reshape(B, pages).astype(np.int32)
        extra = dict(block_table=xp.asarray(table))
    else:
        kc = xp.asarray(rng.standard_normal((B, Hkv, L, d)).astype(dtype))
        vc = xp.asarray(rng.standard_normal((B, Hkv, L, d)).astype(dtype))
        extra = {}
    return q, kc, vc, xp.asarray(lens), kn, vn, extra


def to_np(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def validate_decode(backend, q, kc, vc, lens, kn, vn, extra):
    o = cuflash.flash_attention_with_kvcache(q, kc, vc, lens, k=kn, v=vn, causal=True,
                                             backend=backend, **extra)
    L = int(to_np(lens)[0]) + 1
    if "block_table" in extra:
        t = to_np(extra["block_table"])[0]
        keys = to_np(kc)[t].transpose(1, 0, 2, 3).reshape(kc.shape[1], -1, kc.shape[3])[:, :L]
        vals = to_np(vc)[t].transpose(1, 0, 2, 3).reshape(kc.shape[1], -1, kc.shape[3])[:, :L]
    else:
        keys, vals = to_np(kc)[0, :, :L], to_np(vc)[0, :, :L]
    ref = R.naive_attention(to_np(q)[0], keys, vals, causal=True)
    err = np.abs(to_np(o)[0] - ref).max()
    assert err < 1e-4, f"decode validation failed: max error {err}"


def bench_decode(args, writer):
    rng = np.random.default_rng(0)
    H, Hkv, d = 32, 8, 128
    backends = [("numpy", np)]
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            backends.append(("cuda", cupy))
    except Exception:
        pass
    lengths = [4096, 16384] if args.quick else [4096, 16384, 65536]
    batches = [1, 8] if args.quick else [1, 8, 64]
    print(f"\ndecode: Nq=1, H={H}, Hkv={Hkv}, d={d}, float32, one new token appended")
    print(f"{'backend':8} {'layout':10} {'B':>3} {'cache':>6} {'splits':>6} "
          f"{'ms (best/median)':>18} {'tokens/s':>10} {'GB/s (K+V read)':>16}")
    for name, xp in backends:
        for paged in (False, True):
            for L in lengths:
                for B in batches:
                    if name == "numpy" and B * L > (2 ** 20 if args.quick else 2 ** 22):
                        continue  # K+V of B·L·Hkv·d floats beyond this is minutes per step
                    case = decode_case(xp, B, L, H, Hkv, d, paged, np.float32, rng)
                    q, kc, vc, lens, kn, vn, extra = case
                    validate_decode(name, *case)
                    for splits in (1, 0):
                        def step():
                            cuflash.flash_attention_with_kvcache(
                                q, kc, vc, lens, k=kn, v=vn, causal=True, backend=name,
                                num_splits=splits, **extra)
                            if name == "cuda":
                                xp.cuda.Device().synchronize()
                        best, med = best_of(step, args.repeats)
                        gb = 2 * B * L * Hkv * d * 4 / best / 1e9
                        layout = "paged" if paged else "contiguous"
                        print(f"{name:8} {layout:10} {B:>3} {L:>6} {splits or 'auto':>6} "
                              f"{best * 1e3:>8.2f} / {med * 1e3:<8.2f} {B / best:>10.1f} "
                              f"{gb:>16.2f}")
                        writer.writerow(["decode", name, layout, B, L, splits, best, med,
                                         B / best])
    try:
        import flash_attn  # noqa: F401
        print("flash-attn is installed: compare with flash_attn_with_kvcache on the GPU")
    except ImportError:
        print("(flash-attn not installed: no flash_attn_with_kvcache column)")


def bench_varlen(args, writer):
    rng = np.random.default_rng(1)
    H, d, B = 8, 64, 16
    total = 4096 if args.quick else 8192
    print(f"\nvarlen vs padded: B={B}, H={H}, d={d}, float32, causal, total {total} tokens")
    print(f"{'lengths':24} {'max':>5} {'varlen ms':>10} {'padded ms':>10} {'padded/varlen':>14} "
          f"{'padded, no mask ms':>19} {'ratio':>7}")
    for kind in ("equal", "uniform", "one long"):
        if kind == "equal":
            lens = np.full(B, total // B)
        elif kind == "uniform":
            w = rng.uniform(0.1, 1.0, B)
            lens = np.maximum(1, np.round(w / w.sum() * total)).astype(int)
        else:
            lens = np.full(B, total // (4 * B))
            lens[0] = total - lens[1:].sum()
        cu = np.r_[0, np.cumsum(lens)].astype(np.int32)
        n = int(cu[-1])
        q, k, v = (rng.standard_normal((H, n, d)).astype(np.float32) for _ in range(3))
        mx = int(lens.max())
        qp, kp, vp = (np.zeros((B, H, mx, d), np.float32) for _ in range(3))
        keep = np.zeros((B, 1, 1, mx), bool)
        for b in range(B):
            s = slice(cu[b], cu[b + 1])
            # right-aligned (left padding), so bottom-right causal matches per sequence
            qp[b, :, mx - lens[b]:], kp[b, :, mx - lens[b]:], vp[b, :, mx - lens[b]:] = \
                q[:, s], k[:, s], v[:, s]
            keep[b, ..., mx - lens[b]:] = True
        o = cuflash.flash_attention_varlen(q, k, v, cu, cu, causal=True)
        op = cuflash.flash_attention(qp, kp, vp, causal=True, mask=keep)
        for b in range(B):   # validate: the two agree on the real rows
            s = slice(cu[b], cu[b + 1])
            assert np.abs(op[b, :, mx - lens[b]:] - o[:, s]).max() < 1e-4
        tv, _ = best_of(lambda: cuflash.flash_attention_varlen(q, k, v, cu, cu, causal=True),
                        args.repeats)
        tp, _ = best_of(lambda: cuflash.flash_attention(qp, kp, vp, causal=True, mask=keep),
                        args.repeats)
        # The same padded work without the mask (wrong on the padding, for the work alone):
        tn, _ = best_of(lambda: cuflash.flash_attention(qp, kp, vp, causal=True), args.repeats)
        print(f"{kind:24} {mx:>5} {tv * 1e3:>10.1f} {tp * 1e3:>10.1f} {tp / tv:>13.2f}× "
              f"{tn * 1e3:>19.1f} {tn / tv:>6.2f}×")
        writer.writerow(["varlen", "numpy", kind, B, mx, n, tv, tp, tp / tv])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "bench_serving.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["bench", "backend", "layout_or_lengths", "B", "N", "splits_or_total",
                         "best_s", "median_s_or_padded_s", "tokens_per_s_or_ratio"])
        bench_decode(args, writer)
        bench_varlen(args, writer)


if __name__ == "__main__":
    main()
