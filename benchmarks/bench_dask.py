"""Dask benchmark: cuflash.dask.flash_attention on a LocalCluster of 1 and of 2 worker
processes, on a problem 4× larger than one chunk's memory.

q, k, v (1, H, N, d) float32, chunked in 4 along the queries and 4 along the keys: each
task holds one query block and one key chunk (1/4 of each input), and the 4 partials of
a query block are merged by merge_states. Each worker process is pinned to its own core
(so the NumPy backend inside it runs one thread) and BLAS to one thread. Validates
against one flash_attention call on the whole arrays first, then times.

    python benchmarks/bench_dask.py [--n 8192] [--repeats 3]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # inherited by the worker processes
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cuflash  # noqa: E402


def pin(i):
    def run():
        os.sched_setaffinity(0, {i % os.cpu_count()})
        return sorted(os.sched_getaffinity(0))
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import dask.array as da
    import distributed
    import cuflash.dask as cdask

    H, N, d = args.heads, args.n, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, N, d)).astype(np.float32) for _ in range(3))
    chunks = (1, H, N // 4, d)
    print(f"q, k, v (1, {H}, {N}, {d}) float32: {q.nbytes / 2**20:.0f} MiB each; "
          f"chunks {chunks}: {q.nbytes / 4 / 2**20:.0f} MiB; 4×4 (query, key) tasks, causal")
    t = time.perf_counter()
    ref = cuflash.flash_attention(q, k, v, causal=True)
    print(f"one flash_attention call in this process (NumPy backend, all cores): "
          f"{time.perf_counter() - t:.2f} s")
    for n_workers in (1, 2):
        with distributed.LocalCluster(n_workers=n_workers, threads_per_worker=1,
                                      processes=True, host="127.0.0.1",
                                      dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client:
            for i, w in enumerate(sorted(client.scheduler_info()["workers"])):
                client.run(pin(i), workers=[w])
            qd, kd, vd = (client.scatter(x) for x in (q, k, v))
            qd, kd, vd = (da.from_delayed(x, x_.shape, dtype=x_.dtype).rechunk(chunks)
                          for x, x_ in ((qd, q), (kd, k), (vd, v)))
            qd, kd, vd = client.persist([qd, kd, vd])
            o = cdask.flash_attention(qd, kd, vd, causal=True)
            err = np.abs(o.compute() - ref).max()
            assert err < 1e-4, f"validation failed: max error {err}"
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                o.compute()
                times.append(time.perf_counter() - t)
            print(f"{n_workers} worker process(es), 1 core each: best {min(times):.2f} s, "
                  f"median {np.median(times):.2f} s (max error vs one call {err:.1e})")


if __name__ == "__main__":
    main()
