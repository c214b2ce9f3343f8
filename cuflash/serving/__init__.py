"""Serving real workloads: variable-length batches, KV-cache decoding (contiguous or
paged, split-KV) and the lse merge behind them (docs/serving.md).

Built on the backends' attention: every function runs on "numpy", "emulator" and "cuda".
"""
from .kvcache import flash_attention_with_kvcache
from ..merge import merge_states
from .varlen import flash_attention_varlen, flash_attention_varlen_backward

__all__ = ["flash_attention_varlen", "flash_attention_varlen_backward",
           "flash_attention_with_kvcache", "merge_states"]
