#!/usr/bin/env python3
"""What Hopper's asynchronous instructions cost in the CPU emulator, in microseconds of this
machine: one m64n128k16 wgmma per warpgroup (its 128 threads meet, the product is summed as
the tensor core's block model says, the accumulators land at the wait), one TMA box (64 x 128
fp16, 128-byte swizzle, through an mbarrier), and one mbarrier round trip (arrive, then wait).

Each figure is (time of a launch looping R times - time of the same launch looping 0 times) / R,
the best of --repeat runs, in normal and in checked mode.

  PYTHONPATH=. python benchmarks/bench_emulator_sm90.py
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cuflash import compiler  # noqa: E402
from cuflash.emulator import RawModule, tma  # noqa: E402

SOURCE = r"""
#include "sm90.cuh"
// R wgmma m64n128k16, operands K-major in 128-byte-swizzled rows
extern "C" __global__ void wgmma_loop(float* out, int r) {
    extern __shared__ __align__(1024) unsigned short tile[];   // A: 64 x 64, B: 128 x 64
    for (int i = threadIdx.x; i < (64 + 128) * 64; i += blockDim.x) tile[i] = 0x3c00;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    float acc[64];
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    const unsigned long long da = sm90::desc_k_major_sw128(tile), db = sm90::desc_k_major_sw128(tile + 64 * 64);
    for (int t = 0; t < r; ++t) {
        sm90::wgmma_fence();
        sm90::wgmma_m64n128k16_f16(acc, da, db, 1);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
    }
    out[threadIdx.x] = acc[0];
}
// R boxes of 64 x 128 fp16 through one mbarrier, by one thread; `tma` = 0: the round trip alone
extern "C" __global__ void tma_loop(const __grid_constant__ sm90::TensorMap map, int r, int tma) {
    extern __shared__ __align__(1024) unsigned short box[];
    __shared__ __align__(8) unsigned long long bar;
    if (threadIdx.x != 0) return;
    sm90::mbar_init(&bar, 1);
    for (int t = 0; t < r; ++t) {
        if (tma) {
            sm90::mbar_arrive_expect_tx(&bar, 64 * 128 * 2);
            sm90::tma_load_2d(box, map, 0, 0, &bar);
        } else {
            sm90::mbar_arrive(&bar);
        }
        sm90::mbar_wait(&bar, t & 1);
    }
}
"""


def per_iteration(launch, r, repeat):
    """Microseconds per loop iteration: (best time at r - best time at 0) / r."""
    def best(n):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            launch(n)
            times.append(time.perf_counter() - t0)
        return min(times)
    launch(0)   # build and load
    return (best(r) - best(0)) / r * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    x = np.zeros((128, 64), np.float16)
    tmap = tma.encode_tiled(6, 2, x, [64, 128], [128], [64, 128], [1, 1], swizzle=3)
    out = np.zeros(128, np.float32)
    print("| operation | normal (µs) | checked (µs) |\n|---|---|---|")
    rows = {}
    for checked in (False, True):
        mod = RawModule(code=SOURCE, options=compiler.nvrtc_options(), arch="sm_90a", checked=checked)
        wg, tl = mod.get_function("wgmma_loop"), mod.get_function("tma_loop")
        wg.max_dynamic_shared_size_bytes = tl.max_dynamic_shared_size_bytes = 24 * 1024
        rows.setdefault("one wgmma m64n128k16 (a warpgroup)", []).append(per_iteration(
            lambda r: wg((1,), (128,), (out, np.int32(r)), shared_mem=24 * 1024), args.iterations, args.repeat))
        trip = per_iteration(lambda r: tl((1,), (32,), (tmap, np.int32(r), np.int32(0)), shared_mem=16 * 1024),
                             args.iterations, args.repeat)
        box = per_iteration(lambda r: tl((1,), (32,), (tmap, np.int32(r), np.int32(1)), shared_mem=16 * 1024),
                            args.iterations, args.repeat)
        rows.setdefault("one TMA box 64 x 128 fp16, 128-byte swizzle (less the round trip)", []).append(box - trip)
        rows.setdefault("one mbarrier round trip (arrive, try_wait)", []).append(trip)
    for name, (normal, checked) in rows.items():
        print(f"| {name} | {normal:.1f} | {checked:.1f} |")


if __name__ == "__main__":
    main()
