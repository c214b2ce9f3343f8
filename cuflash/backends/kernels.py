"""The CUDA-kernel backends: one launch path for the GPU ("cuda") and the CPU emulator.

Both backends run the very same `.cu` sources. They differ only in

* the module class: `cupy.RawModule` (NVRTC, on the GPU) or `cuflash.emulator.RawModule`
  (g++, fibers on the CPU, with its options: checked mode, thread schedule, emulated arch),
* the array module: cupy or numpy,
* where the device limits come from: the device's attributes, or the limits of the GPU
  the emulator stands for (`cuflash.emulator.archs`),
* who encodes the tensor maps of TMA copies: the driver (`tensor_map.driver_encode_tiled`)
  or the emulator (`cuflash.emulator.tma.encode_tiled`), with the same arguments.

Everything else is shared: `KernelBackend` compiles and memoises kernels and delegates
to the launch modules `kernel_forward`, `kernel_backward` and `kernel_softmax`, which
take their plans from `cuflash.plans` and marshal arguments with `marshal`.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np

from .. import compiler
from ..plans.device import device_limits
from . import kernel_backward, kernel_forward, kernel_softmax


class KernelBackend:
    """A backend that runs cuflash's CUDA C kernels (see module docstring).

    `module_options` are passed to every module the backend compiles (the emulator's
    `checked`, `schedule`, `seed`, `arch`).
    """

    def __init__(self, name, xp, module_class, *, device_key, limits, module_options=None,
                 device_of=None, encode_tensor_map=None):
        self.name = name
        self.xp = xp
        self._module_class = module_class
        self.encode_tensor_map = encode_tensor_map   # cuTensorMapEncodeTiled's arguments -> a map
        self._device_key = device_key    # () -> hashable id of the current device
        self._limits = limits            # () -> {"max_smem", "sm_count", "cc"}
        self.module_options = dict(module_options or {})
        # array -> context manager making the array's device current, so the kernels
        # launch, allocate and plan there (the emulator has one device: nothing to do)
        self._device_of = device_of or (lambda a: contextlib.nullcontext())
        self._functions = {}
        self._lock = threading.Lock()

    def __repr__(self):
        opts = "".join(f", {k}={v!r}" for k, v in self.module_options.items())
        return f"<cuflash kernel backend {self.name!r}{opts}>"

    def limits(self) -> dict:
        """{'max_smem', 'sm_count', 'cc', 'sm90a'} of the device the kernels run on."""
        return self._limits()

    def get_function(self, plan, mods=None):
        """The kernel of `plan` (its source and name expression), memoised per device, with
        its dynamic shared-memory limit raised to the plan's when above the default.
        `mods` (programmable.cuda_c.KernelMods): a call's score_mod / mask_mod, compiled
        in before the source (a specialization of its own, memoised by their key)."""
        key = (self._device_key(), plan.source, plan.name_expression, mods and mods.key)
        with self._lock:
            fn = self._functions.get(key)
            if fn is None:
                options = compiler.nvrtc_options()
                if plan.arch_specific:   # wgmma, setmaxnreg: the device's "a" target
                    options += compiler.arch_specific_options(self.limits()["cc"])
                code = compiler.read_source(plan.source)
                module = self._module_class(code=code if mods is None else mods.code + code,
                                            options=options,
                                            name_expressions=[plan.name_expression],
                                            **self.module_options)
                fn = module.get_function(plan.name_expression)
                # by default a launch may take 48 KiB less the kernel's static arrays; the
                # name expression fixes the tile, so once per function (not per launch)
                if fn.max_dynamic_shared_size_bytes < plan.dynamic_smem_bytes:
                    fn.max_dynamic_shared_size_bytes = plan.dynamic_smem_bytes
                self._functions[key] = fn
        return fn

    def kernel_mods(self, variants, acc, grads=False):
        """The KernelMods of a call's score_mod / mask_mod (None without), its block
        mask's, and with `grads` the score_mod's arrays' gradients: indices outside a
        captured array are clamped, except in the emulator's checked mode, which reports
        the read."""
        if variants is None or (variants.score_mod is None and variants.mask_mod is None):
            return None
        from ..programmable.cuda_c import kernel_mods
        clamp = not (self.name == "emulator" and self.module_options.get("checked"))
        return kernel_mods(self.xp, variants.score_mod, variants.mask_mod, acc, clamp=clamp,
                           block_mask=variants.block_mask is not None, grads=grads)

    def module(self, source, name_expressions=()):
        """A module of `source` (a file of cuflash/kernels) compiled with the options of the
        run-time path and the device's architecture-specific target (sm_90a on an H100)."""
        cc = self.limits()["cc"]
        return self._module_class(code=compiler.read_source(source),
                                  options=compiler.nvrtc_options() + compiler.arch_specific_options(cc),
                                  name_expressions=list(name_expressions), **self.module_options)

    def forward(self, q, k, v, *, causal, scale, algorithm="fa2", variants=None,
                allow_tf32=False, segments=None, num_splits=None):
        with self._device_of(q):
            return kernel_forward.forward(self, q, k, v, causal=causal, scale=scale,
                                          algorithm=algorithm, variants=variants,
                                          allow_tf32=allow_tf32, segments=segments,
                                          num_splits=num_splits)

    def backward(self, do, q, k, v, o, lse, *, causal, scale, variants=None,
                 return_dbias=False, allow_tf32=False, segments=None, return_mod_grads=False,
                 deterministic=True):
        with self._device_of(q):
            return kernel_backward.backward(self, do, q, k, v, o, lse, causal=causal,
                                            scale=scale, variants=variants,
                                            return_dbias=return_dbias, allow_tf32=allow_tf32,
                                            segments=segments,
                                            return_mod_grads=return_mod_grads,
                                            deterministic=deterministic)

    def softmax(self, x):
        with self._device_of(x):
            return kernel_softmax.softmax(self, x)


# -- the two backends ------------------------------------------------------------------

@functools.cache
def _cuda_backend():
    import cupy
    from .tensor_map import driver_encode_tiled
    return KernelBackend("cuda", cupy, cupy.RawModule,
                         device_key=lambda: cupy.cuda.Device().id,
                         limits=lambda: _cuda_limits(cupy.cuda.Device().id),
                         device_of=lambda a: a.device, encode_tensor_map=driver_encode_tiled)


@functools.cache
def _cuda_limits(device_id):
    return device_limits()


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


def emulator_limits(arch=None) -> dict:
    """{'max_smem', 'sm_count', 'cc', 'sm90a'} of the GPU the emulator stands for on `arch`
    (default: $CUFLASH_EMULATOR_ARCH, else sm_80, an A100); `sm90a` on "sm_90a" alone."""
    from ..emulator import archs
    a = archs.get_arch(arch)
    return {"max_smem": a.limits.shared_per_block_optin, "sm_count": a.limits.sm_count,
            "cc": divmod(a.cuda_arch // 10, 10), "sm90a": a.name == "sm_90a"}


def emulator_backend(checked: bool = False, schedule: str = "round-robin", seed: int = 0,
                     arch: str | None = None):
    """The CPU-emulator backend: the same kernels on NumPy arrays (ml_dtypes bfloat16).

    `checked=True` runs every launch with race and out-of-bounds checking; `schedule`
    ("round-robin", "reversed", "random" with `seed`) orders the threads of a block;
    `arch` is the emulated GPU (default: $CUFLASH_EMULATOR_ARCH, else sm_80), whose limits
    choose the tile plans.
    """
    from ..emulator import archs
    return _emulator_backend(bool(checked), schedule, int(seed), archs.get_arch(arch).name)


@functools.cache
def _emulator_backend(checked, schedule, seed, arch):
    from .. import emulator
    return KernelBackend("emulator", np, emulator.RawModule, device_key=lambda: "cpu",
                         limits=lambda: emulator_limits(arch),
                         module_options=dict(checked=checked, schedule=schedule, seed=seed,
                                             arch=arch),
                         encode_tensor_map=emulator.tma.encode_tiled)
