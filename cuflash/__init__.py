"""cuflash: FlashAttention for CuPy.

Exact attention that never builds the N×N score matrix, as CUDA C kernels compiled at
run time by CuPy (NVRTC), with a NumPy backend for machines without a GPU and an
emulator that runs the very same kernels on the CPU.

    >>> import numpy as np, cuflash
    >>> q = k = v = np.random.default_rng(0).standard_normal((2, 8, 128, 64), np.float32)
    >>> o = cuflash.flash_attention(q, k, v, causal=True)
"""
from .api import flash_attention, flash_attention_backward, online_softmax
from .variants import dropout_mask
from .programmable import BlockMask, block_mask
from .serving import (flash_attention_varlen, flash_attention_varlen_backward,
                      flash_attention_with_kvcache, merge_states)

__version__ = "0.1.0"
__all__ = ["flash_attention", "flash_attention_backward", "online_softmax",
           "dropout_mask", "flash_attention_varlen", "flash_attention_varlen_backward",
           "flash_attention_with_kvcache", "merge_states", "block_mask", "BlockMask",
           "reference", "tiling", "emulator", "dask"]


def __getattr__(name):
    # Submodules load on first use: `emulator` needs g++, `tiling` may query CuPy,
    # `dask` needs the optional dask extra.
    if name in ("reference", "tiling", "emulator", "dask"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'cuflash' has no attribute {name!r}")
