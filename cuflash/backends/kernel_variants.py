"""The variants' kernel arguments: `cuflash.variants.Variants` as the run-time parameters
every attention kernel takes (`CUFLASH_VARIANT_PARAMS` in kernels/variants.cuh, in the
same order). One specialization serves every combination of options: they are flags
and pointers, not template parameters, so the compile gate's list does not grow.
"""
from __future__ import annotations

import numpy as np

from ..variants import PLAIN

# Bits of VariantFlag (kernels/variants.cuh).
SOFTCAP, ALIBI, BIAS, BIAS_F32, MASK, DROPOUT = 1, 2, 4, 8, 16, 32


def _strides4(a):
    """Element strides of a compact 4-D bias or mask: 0 along its size-1 (broadcast) axes."""
    return tuple(np.int64(0 if n == 1 else s // a.itemsize) for n, s in zip(a.shape, a.strides))


def score_plain(variants) -> bool:
    """Whether a call's scores are plain for the kernels (`!var.scores() && !var.dropout()`
    in kernels/variants.cuh): no option but the window, a mask the plain loops apply."""
    return set((variants or PLAIN).active()) <= {"window"}


def variant_args(xp, variants, acc, mods=None, plan=None, grad_part=None) -> tuple:
    """The arguments after a kernel's own: flags, softcap, ALiBi slopes, bias, mask,
    dropout's threshold and key, 1/(1 − p), window, and with `mods` (KernelMods, the
    call's score_mod / mask_mod compiled in) their captured arrays — with a block mask
    the kinds of `plan`'s score tiles, with the score_mod's gradients `grad_part` (the
    partials the dQ launch adds them into). Absent arrays are a 1-element dummy (never
    read or written: their flag is off, or the kernel adds no gradient)."""
    var = variants or PLAIN
    if var.batch0 and var.dropout_p > 0:
        # The kernels draw the sequence index of a packed batch from the launch itself
        # (kernels/seqlens.cuh); batch0 serves the NumPy backend's per-sequence calls.
        raise ValueError(f"Variants.batch0 = {var.batch0}: the kernels take dropout's batch "
                         f"index from the launch (batch0 must be 0)")
    if var.kv0:
        raise ValueError(f"Variants.kv0 = {var.kv0}: the kernels read a KV cache whole "
                         f"(kv0 must be 0)")
    acc = np.dtype(acc)
    flags = 0
    dummy = xp.zeros(1, dtype=acc)
    zeros4 = (np.int64(0),) * 4
    if var.softcap is not None:
        flags |= SOFTCAP
    alibi, alibi_sb = dummy, np.int64(0)
    if var.alibi is not None:
        flags |= ALIBI
        alibi = xp.ascontiguousarray(var.alibi, dtype=acc)
        alibi_sb = np.int64(0 if alibi.shape[0] == 1 else alibi.shape[1])
    bias, bias_st = dummy, zeros4
    if var.bias is not None:
        flags |= BIAS | (BIAS_F32 if var.bias.dtype == np.float32 else 0)
        bias, bias_st = var.bias, _strides4(var.bias)
    mask, mask_st = xp.zeros(1, dtype=np.bool_), zeros4
    if var.mask is not None:
        flags |= MASK
        mask, mask_st = var.mask, _strides4(var.mask)
    if var.dropout_p > 0:
        flags |= DROPOUT
    left, right = var.window if var.window is not None else (-1, -1)
    extra = ()
    if mods is not None:
        from ..programmable.cuda_c import mod_args
        flags |= mods.flags
        tiles = var.block_mask.kernel_tiles(*plan.score_tile, xp) if mods.block_mask else None
        extra = mod_args(mods, tiles, dummy if grad_part is None else grad_part)
    return (np.int32(flags), acc.type(var.softcap or 1.0), alibi, alibi_sb, bias, *bias_st,
            mask, *mask_st, np.uint32(var.threshold), np.uint32(var.seed & 0xFFFFFFFF),
            np.uint32(var.seed >> 32), acc.type(var.keep_scale), np.int32(left),
            np.int32(right)) + extra


def dbias_launch(xp, variants, acc, *, B, Hq, Nq, Nk):
    """Where the kernels write dbias: (dbias, its four element strides, heads per block,
    batches per block, cols) — the first four the dQ kernel's, cols the dK/dV kernel's.

    A bias with its query axis (or Nq = 1): dbias has the compact shape of variants.bias,
    zeroed (the dQ kernel adds dS into it, one thread per element: flash_bwd.cu). A bias
    broadcast over heads (or batch) makes each dQ block loop over all Hq heads (B batches)
    in turn instead of the grid spreading them. cols is a 1-element dummy.

    A bias broadcast over query rows (Nq > 1): a dQ block owns only some rows, so the dK/dV
    kernel, whose block sees every row of its keys, adds cols = Σ_i dS_ij into a zeroed,
    contiguous (B, Hq, Nk) buffer (O(N), not O(N²)); `dbias_from_cols` sums it over the bias's other
    broadcast axes. The dQ kernel writes nothing (dbias is then a dummy).

    variants None (no dbias wanted): dummies, never written."""
    dummy = xp.zeros(1, dtype=acc)
    if variants is None:
        return dummy, (np.int64(0),) * 4, 1, 1, dummy
    bb, bh, bq, _ = variants.bias.shape
    if bq == 1 and Nq > 1:
        return dummy, (np.int64(0),) * 4, 1, 1, xp.zeros((B, Hq, Nk), dtype=acc)
    dbias = xp.zeros(variants.bias.shape, dtype=acc)
    return dbias, _strides4(dbias), (Hq if bh == 1 else 1), (B if bb == 1 else 1), dummy


def dbias_from_cols(cols, shape):
    """dbias of compact shape (B or 1, Hq or 1, 1, Nk or 1) from the dK/dV kernel's column
    sums cols (B, Hq, Nk): summed over the bias's broadcast axes by the array module's
    reduction (a fixed order, no atomics: the same bits every run)."""
    B, Hq, Nk = cols.shape
    d4 = cols.reshape(B, Hq, 1, Nk)
    axes = tuple(a for a, (n, full) in enumerate(zip(shape, d4.shape)) if n == 1 < full)
    return d4.sum(axis=axes, keepdims=True) if axes else d4
