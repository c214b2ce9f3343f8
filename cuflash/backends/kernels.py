"""The CUDA-kernel backends: one launch path for the GPU ("cuda") and the CPU emulator.

Both backends run the very same `.cu` sources. They differ only in

* the module class: `cupy.RawModule` (NVRTC, on the GPU) or `cuflash.emulator.RawModule`
  (g++, fibers on the CPU), and
* the array module: cupy or numpy,

plus where the device limits come from (the device's attributes, or the representative
sm_80 limits in `tiling.EMULATOR_LIMITS`). Everything else — plan choice, argument
marshalling, grid shapes — is the code below, shared.

Kernel arguments are arrays (passed as device pointers) and NumPy scalars of the exact C
parameter types (np.int32 for int, np.int64 for long long, the accumulation type for
scales); CuPy and the emulator both take those.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from .. import _dtypes, compiler, tiling

FWD_THREADS = tiling.NUM_WARPS * 32
SOFTMAX_THREADS = 128
# softmax_cols_kernel (one thread per line) once there are this many lines side by side
# along the contiguous Q axis; otherwise one block per line (softmax_rows_kernel).
SOFTMAX_COLS_MIN_Q = 32
SOFTMAX_SOURCE = "online_softmax.cu"
_INT32_MAX = 2**31 - 1


def _softmax_names():
    return [f"softmax_{kind}_kernel<{_dtypes.c_type(dt)}, {SOFTMAX_THREADS}>"
            for kind in ("rows", "cols") for dt in _dtypes.SUPPORTED]


def specializations() -> dict[str, list[str]]:
    """Every kernel specialization the library can launch: forward, softmax, backward.

    {source filename: [name expression, ...]}: finite (all tile plans, dtypes and head-dim
    buckets), for the compile gate.
    """
    out: dict[str, list[str]] = {}
    for plan in tiling.all_plans():
        out.setdefault(plan.source, []).append(plan.name_expression)
    out[SOFTMAX_SOURCE] = _softmax_names()
    bwd = out.setdefault(tiling.BWD_SOURCE, [])
    bwd.extend(p.name_expression for p in tiling.all_bwd_plans())
    return out


# -- argument marshalling, shared by the forward, softmax and backward launches ---------

_GRID_YZ_MAX = 65535


def elem_strides(a) -> tuple[np.int64, ...]:
    """Element strides of every axis of `a`, as the kernels' `long long` parameters."""
    return tuple(np.int64(s // a.itemsize) for s in a.strides)


def i32(n: int, what: str) -> np.int32:
    """`n` as a kernel `int` parameter; ValueError naming `what` when it does not fit."""
    if n > _INT32_MAX:
        raise ValueError(f"{what}={n} exceeds the kernels' 32-bit index range (max {_INT32_MAX})")
    return np.int32(n)


def check_grid_yz(n: int, what: str) -> None:
    """A grid's y or z extent (at most 65535 blocks): say which axis to split."""
    if n > _GRID_YZ_MAX:
        raise ValueError(f"{what}={n} exceeds the kernels' grid limit ({_GRID_YZ_MAX}); "
                         f"split that axis into several calls")


def prepare(xp, a):
    """`a` itself when the kernels can read it in place (unit last-axis stride, no
    negative strides); a contiguous copy otherwise."""
    st = a.strides
    if (a.shape[-1] > 1 and st[-1] != a.itemsize) or any(s < 0 for s in st):
        return xp.ascontiguousarray(a)
    return a


class KernelBackend:
    """A backend that runs cuflash's CUDA C kernels (see module docstring)."""

    def __init__(self, name, xp, module_class, *, device_key, limits, checked=False):
        self.name = name
        self.xp = xp
        self._module_class = module_class
        self._device_key = device_key    # () -> hashable id of the current device
        self._limits = limits            # () -> {"max_smem", "sm_count", "cc"}
        self.checked = checked
        self._functions = {}
        self._lock = threading.Lock()

    def __repr__(self):
        return f"<cuflash kernel backend {self.name!r}{' (checked)' if self.checked else ''}>"

    # -- kernels ------------------------------------------------------------------------

    def limits(self) -> dict:
        """{'max_smem', 'sm_count', 'cc'} of the device the kernels run on."""
        return self._limits()

    def get_function(self, source: str, name_expression: str, smem_bytes: int = 0):
        """The kernel `name_expression` of `cuflash/kernels/<source>`, memoised per
        (device, source, name expression), with its dynamic shared memory limit raised to
        `smem_bytes` when that is above the 48 KB default."""
        key = (self._device_key(), source, name_expression)
        with self._lock:
            fn = self._functions.get(key)
            if fn is None:
                kwargs = dict(code=compiler.read_source(source), options=compiler.nvrtc_options(),
                              name_expressions=[name_expression])
                if self.checked:
                    kwargs["checked"] = True
                module = self._module_class(**kwargs)
                fn = module.get_function(name_expression)
                self._functions[key] = fn
            if smem_bytes > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem_bytes:
                fn.max_dynamic_shared_size_bytes = smem_bytes
        return fn

    # -- forward ------------------------------------------------------------------------

    def plan(self, d, dtype, algorithm="fa2") -> tiling.KernelPlan:
        return tiling.plan_forward(d, dtype, algorithm=algorithm, **self.limits())

    def forward(self, q, k, v, *, causal, scale, algorithm="fa2"):
        """o, lse for q (B, Hq, Nq, d), k and v (B, Hkv, Nk, d); see backends/__init__."""
        xp = self.xp
        q, k, v = (prepare(xp, a) for a in (q, k, v))
        B, Hq, Nq, d = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        dtype = q.dtype
        acc = _dtypes.accum_dtype(dtype)
        plan = self.plan(d, dtype, algorithm)
        n_chunks = -(-d // plan.head_dim_bucket)
        o = xp.empty((B, Hq, Nq, d), dtype=dtype)
        lse = xp.empty((B, Hq, Nq), dtype=acc)
        if o.size == 0 and lse.size == 0:
            return o, lse
        strides = []
        for a in (q, k, v, o):
            strides += elem_strides(a)[:3]
        scale = acc.type(scale)  # the kernels fold in log2(e) themselves (common.cuh)
        sizes = [i32(Hq, "heads"), i32(Hq // Hkv, "group"), i32(Nq, "Nq"), i32(Nk, "Nk"),
                 i32(d, "d")]
        fn = self.get_function(plan.source, plan.name_expression, plan.smem_bytes)
        if plan.kernel == "flash_fwd":
            num_m_blocks = -(-Nq // plan.block_m)
            grid = num_m_blocks * n_chunks * Hq * B
            args = (q, k, v, o, lse, *sizes, *strides, scale, np.int32(bool(causal)),
                    np.int32(num_m_blocks), np.int32(n_chunks))
        else:  # FA1: one block per (batch, head) [x head-dim chunk]; O, ℓ, m in global memory
            o_acc = xp.empty((B, Hq, Nq, d), dtype=acc)
            l_buf = xp.empty((n_chunks, B, Hq, Nq), dtype=acc)
            m_buf = xp.empty((n_chunks, B, Hq, Nq), dtype=acc)
            grid = n_chunks * Hq * B
            args = (q, k, v, o, lse, o_acc, l_buf, m_buf, i32(B, "batch"), *sizes, *strides,
                    scale, np.int32(bool(causal)), np.int32(n_chunks))
        i32(grid, "grid size (blocks = query blocks x heads x batch)")
        fn((grid,), (plan.num_threads,), args, shared_mem=plan.smem_bytes)
        return o, lse

    # -- backward -----------------------------------------------------------------------

    def backward(self, do, q, k, v, o, lse, *, causal, scale):
        from .kernel_backward import backward  # the backward kernels' launch path
        return backward(self, do, q, k, v, o, lse, causal=causal, scale=scale)

    # -- softmax ------------------------------------------------------------------------

    def softmax(self, x):
        """softmax over axis 1 of x (P, n, Q), as scipy.special.softmax(x, axis=1)."""
        xp = self.xp
        if any(s < 0 for s in x.strides):
            x = xp.ascontiguousarray(x)
        P, n, Q = x.shape
        y = xp.empty((P, n, Q), dtype=x.dtype)
        if y.size == 0:
            return y
        c = _dtypes.c_type(x.dtype)
        xs, ys = elem_strides(x), elem_strides(y)
        lines = P * Q
        if Q >= SOFTMAX_COLS_MIN_Q:
            # One thread per (p, q) line: neighbouring threads read neighbouring q.
            name = f"softmax_cols_kernel<{c}, {SOFTMAX_THREADS}>"
            grid = -(-lines // SOFTMAX_THREADS)
        else:
            # One block per line; its threads stride along n and merge their (m, ℓ).
            name = f"softmax_rows_kernel<{c}, {SOFTMAX_THREADS}>"
            grid = lines
        i32(grid, "grid size (softmax lines)")
        fn = self.get_function(SOFTMAX_SOURCE, name)
        fn((grid,), (SOFTMAX_THREADS,), (x, y, i32(P, "P"), i32(n, "n"), i32(Q, "Q"), *xs, *ys))
        return y


# -- the two backends ------------------------------------------------------------------

@functools.cache
def _cuda_backend():
    import cupy
    return KernelBackend("cuda", cupy, cupy.RawModule,
                         device_key=lambda: cupy.cuda.Device().id,
                         limits=lambda: _cuda_limits(cupy.cuda.Device().id))


@functools.cache
def _cuda_limits(device_id):
    return tiling.device_limits()


def cuda_backend():
    """The GPU backend (CuPy + NVRTC). RuntimeError when CuPy or a CUDA device is missing."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("backend='cuda' needs CuPy (pip install 'cuflash[cuda12]'); "
                           f"importing it failed: {e}. Use backend='numpy' or 'emulator'.") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, no device
        raise RuntimeError(f"backend='cuda' needs a CUDA device, but CuPy finds none ({e}). "
                           "Use backend='numpy' or backend='emulator'.") from None
    if n == 0:
        raise RuntimeError("backend='cuda' needs a CUDA device, but CuPy finds none. "
                           "Use backend='numpy' or backend='emulator'.")
    return _cuda_backend()


@functools.cache
def emulator_backend(checked: bool = False):
    """The CPU-emulator backend: the same kernels on NumPy arrays (ml_dtypes bfloat16).

    `checked=True` runs every launch with race and out-of-bounds checking.
    """
    from .. import emulator
    return KernelBackend("emulator", np, emulator.RawModule,
                         device_key=lambda: "cpu",
                         limits=lambda: dict(tiling.EMULATOR_LIMITS), checked=checked)
