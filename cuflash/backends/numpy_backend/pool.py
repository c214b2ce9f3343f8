"""The worker threads the backend spreads its tasks over, and BLAS held at one thread
while they run.

A task is one call of a function on one item (a head range to prepare, a Q tile or
a K/V tile of a head range with its steps). The calling thread and `workers − 1` pool
threads take the tasks in list order, so that a call hands work to one thread fewer
than it has workers and waits on no future while it could compute. NumPy releases the
GIL inside BLAS and inside ufunc loops, so the threads run the big tile operations in
parallel. Tasks that add into shared sums (the backward's dQ and dbias) run in fixed
lanes instead (`lanes`), so that every sum has one order.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import OpenBLASController, ThreadpoolController


def usable_cores():
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


_POOLS = {}  # helper threads → ThreadPoolExecutor, made on first use
_POOLS_LOCK = threading.Lock()


class OneBlasThread:
    """BLAS at one thread while any call of the backend runs its tasks, and back to
    what it was when the last one returns.

    The threads already split the tiles over the cores; a multi-threaded BLAS inside
    each of them oversubscribes the cores (the forward at N = 1024–2048 took 12% longer
    on 2 cores; on a loaded machine, a multi-threaded call on a tile this small waited
    up to 25× its time for its threads). NumPy's OpenBLAS has one thread count for the
    whole process (its `openblas_set_num_threads_local` sets that one too), so the
    count is lowered for the span of the tasks only, and a user's own matmuls between
    calls keep every core. threadpoolctl knows the BLAS libraries (OpenBLAS, MKL, BLIS)
    and how each sets and reads its count. Calls from several threads at once share
    one lowering: the first in saves the counts, the last out restores them, under one
    lock, whichever threads those are.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._limiter = None
        self._controller = None

    def __enter__(self):
        with self._lock:
            if self._depth == 0:
                if self._controller is None:  # NumPy's BLAS is loaded with NumPy
                    self._controller = ThreadpoolController()
                self._limiter = _as_this_thread(
                    lambda: self._controller.limit(limits=1, user_api="blas"))
            self._depth += 1

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._restore()

    def _restore(self):
        _as_this_thread(self._limiter.restore_original_limits)
        self._limiter = None

    def after_fork_in_child(self):
        # The child has none of the parent's calls, only their lowered counts.
        self._lock = threading.Lock()
        if self._depth:
            self._depth = 0
            self._restore()


def _as_this_thread(change):
    """Run `change` (of OpenBLAS's count) with this thread as threadpoolctl's one
    thread allowed to set a process-wide OpenBLAS count, and no thread after it: the
    first and the last call in may be different threads, and a user's own limits
    elsewhere must not make ours a silent no-op."""
    clear = getattr(OpenBLASController, "clear_controlling_thread", None)
    if clear is None:  # threadpoolctl < 3.8: every thread may set the count
        return change()
    clear(force=True)
    try:
        return change()
    finally:
        clear()


ONE_BLAS_THREAD = OneBlasThread()


def _forget_pools_after_fork():
    # A forked child inherits the pool objects but none of their threads.
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()
    ONE_BLAS_THREAD.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _helpers(n):
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = ThreadPoolExecutor(
                max_workers=n, thread_name_prefix="cuflash-np")
    return pool


def run_tasks(fn, tasks, workers):
    """[fn(task) for task in tasks], run by the calling thread and `workers − 1` pool
    threads, with BLAS at one thread (`OneBlasThread`).

    Each thread takes the next task not yet taken, until none is left. A task that
    raises stops the others taking more; the call returns (or raises the first
    error) only when every thread has finished, so no task of a failed call is
    still writing into its arrays.
    """
    tasks = list(tasks)
    results = [None] * len(tasks)
    queue = iter(range(len(tasks)))
    taking = threading.Lock()
    failed = []

    def take_tasks():
        # NaN and ±inf propagate as the API promises: exp(inf − inf) and
        # 0·inf inside a row are the defined result, not a warning.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            while not failed:
                with taking:
                    i = next(queue, None)
                if i is None:
                    return
                try:
                    results[i] = fn(tasks[i])
                except BaseException:
                    failed.append(True)
                    raise

    with ONE_BLAS_THREAD:
        n = min(workers, len(tasks)) - 1
        helpers = [_helpers(workers - 1).submit(take_tasks) for _ in range(n)] if n > 0 else []
        try:
            take_tasks()
        finally:
            for helper in helpers:   # wait for all of them before anything else
                helper.exception()
        for helper in helpers:
            helper.result()          # a helper's error, if the caller had none
    return results


class Once:
    """`fn(item)` run once per item, by the first task that asks for it; a task asking
    while it runs waits for it. (One failed run leaves the item to the next asker.)"""

    def __init__(self, fn):
        self._fn = fn
        self._done = set()
        self._locks = {}
        self._locks_lock = threading.Lock()

    def __call__(self, item):
        if item in self._done:
            return
        with self._locks_lock:
            lock = self._locks.setdefault(item, threading.Lock())
        with lock:
            if item not in self._done:
                self._fn(item)
                self._done.add(item)


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
