"""The worker threads the backend spreads its tasks over.

A task is one call of a function on one item (a head range to prepare, a Q tile or
a K/V tile of a head range with its steps); the workers take tasks in list order.
NumPy releases the GIL inside BLAS and inside ufunc loops, so the workers run the
big tile operations in parallel. Tasks that add into shared sums (the backward's dQ
and dbias) run in fixed lanes instead (`lanes`), so that every sum has one order.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def usable_cores():
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


_POOLS = {}  # workers → ThreadPoolExecutor, made on first use
_POOLS_LOCK = threading.Lock()


def _forget_pools_after_fork():
    # A forked child inherits the pool objects but none of their threads.
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _blas_one_thread_here():
    """Pool initializer: make BLAS single-threaded in this worker thread only.

    The workers already split the tiles over the cores; a multi-threaded BLAS
    inside each of them oversubscribes the cores (measured 1.6× slower on 2
    cores). OpenBLAS ≥ 0.3.27 has a per-thread setting,
    `openblas_set_num_threads_local`, which leaves every other thread (and the
    user's own BLAS calls) alone. Where it is missing nothing changes.
    """
    try:
        import ctypes
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
        for path in paths:
            fn = getattr(ctypes.CDLL(path), "openblas_set_num_threads_local", None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                fn(1)
    except (OSError, ValueError, AttributeError):  # pragma: no cover - non-Linux / no OpenBLAS
        pass


def run_tasks(fn, tasks, workers):
    """[fn(task) for task in tasks], run on a pool of `workers` threads.

    Even with one worker the tasks run in the pool, where BLAS is single-threaded:
    a multi-threaded OpenBLAS call on a tile this small spends its time waking
    threads (and, on a loaded machine, waiting for them: measured up to 25× slower).
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix="cuflash-np",
                initializer=_blas_one_thread_here)

    def quiet(task):
        # NaN and ±inf propagate as the API promises: exp(inf − inf) and
        # 0·inf inside a row are the defined result, not a warning.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return fn(task)

    return list(pool.map(quiet, tasks))


def lanes(tasks, workers, cost):
    """The tasks dealt into at most `workers` lists, each run in order by one pool task.

    Floating-point sums depend on their order, so a sum that crosses tasks is kept per
    lane and the lanes' sums are added in lane order: the result depends on the inputs
    and the worker count only, never on which thread ran what when. Deterministic
    longest-first dealing (each task, biggest `cost` first, to the lane with the least
    cost so far) keeps the lanes about as balanced as the pool's own queue.
    """
    out = [[] for _ in range(max(1, min(workers, len(tasks))))]
    load = [0] * len(out)
    for task in sorted(tasks, key=lambda t: -cost(t)):  # stable: ties keep list order
        i = load.index(min(load))
        out[i].append(task)
        load[i] += cost(task)
    return out
