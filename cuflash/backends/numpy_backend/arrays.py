"""Array helpers shared by the forward, FA1 and backward loops: GQA views, casts,
[x | 1] copies, the split of the score scale, the rescue of a huge V, and the buffers
kept from call to call (per-worker scratch, a call's prepared copies)."""
import math
import os
import threading

import numpy as np


def grouped_heads(q, k, v):
    """Sizes and GQA views: the G query heads of one K/V head are axis 1 of q4
    (BH, G, Nq, d); k3 and v3 are (BH, Nk, d), with BH = B · Hkv. Views where the
    strides allow merging B and Hkv into one axis, else copies (numpy.reshape)."""
    B, Hq, Nq, d = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    BH = B * Hkv
    return (B, Hq, Nq, d, Hkv, Nk, G, BH, q.reshape(BH, G, Nq, d),
            k.reshape(BH, Nk, d), v.reshape(BH, Nk, d))


def as_dtype(x, dtype):
    """x in dtype, without a copy when it already is (the per-tile cast for 16-bit)."""
    return x if x.dtype == dtype else x.astype(dtype)


def with_ones(x, out, factor=1.0):
    """out = [factor·x | 1]: x (..., n, d) widened into out (..., n, d + 1), last column ones."""
    if factor == 1:
        np.copyto(out[..., :-1], x, casting="unsafe")
    else:
        np.multiply(x, factor, out=out[..., :-1], casting="unsafe")
    out[..., -1] = 1


def split_scale(c, dtype):
    """(c_q, c_k) with c_q·c_k = c exactly: the factors of the score scale c applied to
    q and to k, S = (c_q·q)·(c_k·k)ᵀ.

    Either order alone overflows where the score does not: c·q with c = 1e38 (float32,
    q ~ 1, k ~ 1e-6: scores ~1e33), q·k with q = k = 1e200 (float64, c = 1e-300).
    An extreme c (c = f·2^e, |e| beyond a quarter of the dtype's exponent range) is
    split evenly, c_k = 2^⌊e/2⌋: a power of two, so k's factor rounds nothing. Ordinary
    scales keep c_k = 1 (no pass over K).
    """
    e = math.frexp(c)[1]
    if abs(e) <= np.finfo(dtype).maxexp // 4:
        return c, 1.0
    c_k = math.ldexp(1.0, e // 2)
    return c / c_k, c_k


def column_shift(V, Nk, dtype):
    """Per column of V (..., n, d): 2^-s with s ≥ 0 the fewest bits that bring the
    column's largest |V| below 2^(maxexp − ⌈log2(Nk + 1)⌉ − 1), or None if no column
    needs it. Then P̃ V' (P̃ ≤ 1, at most Nk keys) cannot overflow, and o = (P̃ V'/ℓ)·2^s
    is exact: powers of two round nothing. Non-finite columns need no shift."""
    top = np.finfo(dtype).maxexp - math.ceil(math.log2(Nk + 1)) - 1
    with np.errstate(invalid="ignore"):
        peak = np.max(np.abs(V), axis=-2)
    e = np.frexp(np.where(np.isfinite(peak), peak, 0))[1]
    s = np.maximum(e - top, 0)
    if not s.any():
        return None
    return np.ldexp(np.ones((), dtype), -s).astype(dtype)


class Scratch:
    """A flat scratch buffer handing out contiguous views of any smaller shape.

    Reusing one allocation per worker avoids re-faulting fresh pages on every tile.
    """

    def __init__(self, dtype):
        self.dtype = dtype
        self.flat = np.empty(0, dtype)

    def get(self, shape):
        n = math.prod(shape)
        if self.flat.size < n:
            self.flat = np.empty(n, self.dtype)
        return self.flat[:n].reshape(shape)


class WorkerScratch:
    """Named Scratch buffers of one dtype, each made on first use: ws.S, ws.PV, …"""

    def __init__(self, dtype):
        self.dtype = dtype

    def __getattr__(self, name):  # only reached for a name not made yet
        if name.startswith("__"):
            raise AttributeError(name)
        buf = Scratch(self.dtype)
        setattr(self, name, buf)
        return buf


_WORKER = threading.local()
_EVERY_WORKERS = []  # each thread's {dtype: WorkerScratch}, for release_buffers
_EVERY_LOCK = threading.Lock()


def worker_scratch(dtype):
    """This thread's WorkerScratch for `dtype`, kept from one call to the next: a pool
    worker's tile buffers (a score tile is up to `CpuConfig.tile_budget` / d bytes) stay
    on pages it has already touched. One task runs at a time on a thread, so a task
    owns its thread's buffers until it returns."""
    kept = getattr(_WORKER, "scratch", None)
    if kept is None:
        kept = _WORKER.scratch = {}
        with _EVERY_LOCK:
            _EVERY_WORKERS.append(kept)
    dtype = np.dtype(dtype)
    if dtype not in kept:
        kept[dtype] = WorkerScratch(dtype)
    return kept[dtype]


class Reused:
    """The per-call O(N·d) copies (the prepared [Q | ·], [K | 1], [V | 1]) on buffers
    kept for later calls, up to `limit` bytes in all.

    A fresh allocation this size is fresh pages, each faulted in on first touch: at
    N = 1024, d = 64, 8 heads, ~1550 faults and ~4 ms of system time per forward. Calls
    past the limit (where the N² work dwarfs the faults) allocate as before. Each call
    takes a buffer of its own, so concurrent calls never share one.
    """

    def __init__(self, limit):
        self.limit = limit
        self._free = []
        self._lock = threading.Lock()

    def take(self, *specs):
        """(buffer, arrays): uninitialised arrays of the (shape, dtype) `specs` on one
        buffer, kept or fresh. Give the buffer back once the call's tasks have all
        returned (`pool.run_tasks` returns, or raises, only then)."""
        sizes = [-(-math.prod(shape) * np.dtype(dtype).itemsize // 64) * 64
                 for shape, dtype in specs]
        total = sum(sizes)
        buf = None
        if total <= self.limit:
            with self._lock:
                fits = [i for i, b in enumerate(self._free) if b.size >= total]
                if fits:
                    buf = self._free.pop(min(fits, key=lambda i: self._free[i].size))
        if buf is None:
            buf = np.empty(total, np.uint8)
        starts = np.cumsum([0] + sizes)
        return buf, [buf[a:a + math.prod(shape) * np.dtype(dtype).itemsize]
                     .view(dtype).reshape(shape) for a, (shape, dtype) in zip(starts, specs)]

    def release(self):
        """Drop every kept buffer."""
        with self._lock:
            self._free.clear()

    def give_back(self, buf):
        """Keep `buf` (from take) for a later call, within the limit (the oldest go first)."""
        if buf.size > self.limit:
            return
        with self._lock:
            self._free.append(buf)
            while sum(b.size for b in self._free) > self.limit:
                self._free.pop(0)


CALL_BUFFERS = Reused(32 << 20)


def _new_locks_after_fork():
    # A forked child has only the forking thread: a lock another thread held stays held.
    global _EVERY_LOCK
    CALL_BUFFERS._lock = threading.Lock()
    _EVERY_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_after_fork)


def release_buffers():
    """Free every buffer kept between calls (CALL_BUFFERS and each worker's tile buffers),
    e.g. before measuring a call's memory or to give it back between a program's phases:
    the next calls allocate afresh. Buffers a running call holds stay with it."""
    CALL_BUFFERS.release()
    with _EVERY_LOCK:
        for kept in _EVERY_WORKERS:
            kept.clear()
