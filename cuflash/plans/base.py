"""What every plan is: a frozen dataclass naming its kernel family and its element type.

Plans carry the element type by name, with the C type and sizes from `ELEMENTS`, never as
a NumPy dtype: bfloat16 is a NumPy dtype only where ml_dtypes is installed, while the
specializations (what the compile gate builds, what `info` lists) are the same on any host.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _dtypes
from ..families import FAMILIES


class Element(NamedTuple):
    c_type: str        # the kernels' template argument
    bytes: int
    accum_bytes: int   # float64 accumulates in float64, every other type in float32


ELEMENTS = {
    "float16": Element("__half", 2, 4),
    "bfloat16": Element("__nv_bfloat16", 2, 4),
    "float32": Element("float", 4, 4),
    "float64": Element("double", 8, 8),
}
DTYPE_NAMES = tuple(ELEMENTS)


def dtype_name(dtype) -> str:
    """The name in `ELEMENTS` of `dtype` (a NumPy dtype, a scalar type or a name such as
    "bfloat16", which needs no ml_dtypes); TypeError for any other."""
    if isinstance(dtype, str) and dtype in ELEMENTS:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in ELEMENTS:
        raise TypeError(f"dtype must be one of {_dtypes.SUPPORTED_NAMES}; "
                        f"got {name or repr(dtype)}")
    return name


class Plan:
    """What every plan offers: the fields `kernel` (a name in `families.FAMILIES`) and
    `dtype` (a name in `ELEMENTS`), and `num_threads`, `smem_bytes` (its family's formula),
    `source` and `name_expression` for the launch and the gate. `dynamic_smem`: whether
    smem_bytes is the launch's dynamic shared memory (else the kernel's static arrays);
    `arch_specific`: whether the kernel is built for the device's architecture-specific
    target (sm_90a), which runs on that architecture alone."""

    dynamic_smem = False
    arch_specific = False

    @property
    def element(self) -> Element:
        return ELEMENTS[self.dtype]

    @property
    def accum_bytes(self) -> int:
        return self.element.accum_bytes

    @property
    def dynamic_smem_bytes(self) -> int:
        """The launch's dynamic shared memory: `smem_bytes` where the kernel takes its
        tiles that way, else 0 (static arrays, or none)."""
        return self.smem_bytes if self.dynamic_smem else 0

    @property
    def source(self) -> str:
        return FAMILIES[self.kernel].source

    def _instantiate(self, *template_args) -> str:
        """`<kernel>_kernel<ctype, args...>`: the name expression NVRTC instantiates."""
        args = ", ".join([self.element.c_type, *map(str, template_args)])
        return f"{FAMILIES[self.kernel].function}<{args}>"


def backward_score_tile(own_rows: int, streamed_rows: int, owns_keys: bool) -> tuple:
    """(query rows, keys) of a backward kernel's score tiles, a block mask's granularity:
    a dK/dV block owns keys and streams query tiles (owns_keys), a dQ block the reverse."""
    return (streamed_rows, own_rows) if owns_keys else (own_rows, streamed_rows)


def flag(value: bool) -> str:
    """A bool template argument as C++ spells it."""
    return "true" if value else "false"
