"""The choosers: which kernels a call runs, and why, in words. One per pass:
`forward_path` and `backward_path` take tensor cores where dtype, device, head dim and
alignment allow (wgmma on sm_90a for the calls the Hopper kernels take), and the SIMT plans
(`simt_forward_plan`, `simt_backward_plans`) otherwise, saying what refused the tensor
cores."""
from __future__ import annotations

from .base import ELEMENTS, dtype_name
from .simt_bwd import simt_backward_plans
from .simt_fwd import simt_forward_plan
from .sm90_bwd import SM90_BWD_HEAD_DIMS, sm90_bwd_plans
from .sm90_fwd import (SM90_DTYPES, SM90_HEAD_DIMS, SM90_SPLIT_HEAD_DIMS, SM90_TF32_HEAD_DIMS,
                       sm90_fwd_plan)
from .tc_bwd import (TC_BWD_HEAD_DIMS, TC_BWD_KERNELS, DqSumPlan, dq_parts_tiles,
                     tc_bwd_candidates)
from .tc_fwd import TC_HEAD_DIMS, TF32_DTYPE, TF32_HEAD_DIMS, tc_fwd_candidates

# The first compute capability whose mma.sync takes each type (mma.cuh's TensorCores<T>):
# m16n8k8 .f16 on sm_75; m16n8k16 .bf16, m16n8k8 .tf32, cvt.rna.tf32.f32 and cp.async on
# sm_80. Every later GPU runs these too (Blackwell sm_100 and sm_120 included).
TC_MIN_CC = {"float16": (7, 5), "bfloat16": (8, 0), TF32_DTYPE: (8, 0)}


def _what(dtype):
    """The reasons' name for a type's tensor-core kernels."""
    return "float32 (tf32)" if dtype == TF32_DTYPE else dtype


def _instruction(dtype, cc, allow_tf32):
    """The reason's words for the mma a tensor-core plan runs on `cc`."""
    sm = f"sm_{cc[0]}{cc[1]}"
    if dtype == TF32_DTYPE:
        mode = ("one-pass tf32 (allow_tf32=True)" if allow_tf32
                else "split tf32, 3 mma per product (allow_tf32=True: one)")
        return f"mma.m16n8k8.tf32 on {sm}, {mode}"
    return f"{'mma.m16n8k16' if cc >= (8, 0) else '2 x mma.m16n8k8'} on {sm}"


def _tensor_core_refusal(d, dtype, cc, aligned, *, head_dims, operands):
    """Why the tensor-core kernels for `dtype` cannot take head dim d on a device of
    compute capability `cc`, or None when they can: cc at least TC_MIN_CC, d a multiple
    of a 16-byte chunk's elements up to head_dims[-1], and `operands` (the arrays read by
    16-byte loads) `aligned`. One wording for every tensor-core path."""
    what, need = _what(dtype), TC_MIN_CC[dtype]
    elems = 16 // ELEMENTS[dtype].bytes
    if cc < need:
        return (f"SIMT: {what} tensor cores need sm_{need[0]}{need[1]}; the device is "
                f"sm_{cc[0]}{cc[1]}")
    if d % elems:
        return (f"SIMT: head dim d={d} is not a multiple of {elems} ({what} tensor-core rows "
                f"are whole 16-byte chunks)")
    if d > head_dims[-1]:
        return f"SIMT: head dim d={d} > {head_dims[-1]}, the largest {what} tensor-core tile"
    if not aligned:
        return (f"SIMT: {operands} is not 16-byte aligned (a base pointer, or a batch, head or "
                f"row stride that is not a multiple of {elems} elements)")
    return None


def _no_tile_fits(dtype, D, max_smem, pass_=""):
    return (f"SIMT: no {_what(dtype)} tensor-core {pass_}tile for D={D} fits {max_smem} "
            f"bytes of shared memory per block")


def _one_of(values):
    """(64, 128, 256) as "64, 128 or 256"."""
    *head, last = map(str, values)
    return f"{', '.join(head)} or {last}" if head else last


def _first_fit(plans, max_smem):
    return next((p for p in plans if p.smem_bytes <= max_smem), None)


def forward_path(d: int, dtype, cc=None, aligned: bool = True, *, max_smem: int,
                 sm_count=None, sm90a: bool = False, algorithm: str = "fa2",
                 allow_tf32: bool = False, plain: bool = False, varlen: bool = False):
    """(plan, reason): the forward kernel a call takes, and why, in words.

    Tensor cores (`TcPlan`) where `algorithm` is "fa2", the dtype is float16 (sm_75+),
    bfloat16 or float32 (sm_80+; `Tf32Plan`: split tf32 by default, one-pass with
    `allow_tf32`), d's rows are whole 16-byte chunks (a multiple of 8, of 4 for float32)
    up to 256, the inputs allow 16-byte loads (`aligned`: base pointers and strides) and a
    tile fits `max_smem` bytes of shared memory per block; the SIMT kernel
    (`simt_forward_plan`) otherwise. `cc` is the device's (major, minor) compute
    capability, None when unknown (SIMT); `sm_count` is accepted so that a device's limits
    pass as keywords. Attention variants (window, softcap, ALiBi, bias, mask, dropout) do
    not change the mma.sync and SIMT paths: those kernels take them (kernels/variants.cuh).

    The Hopper forward (`Sm90FwdPlan`: wgmma, TMA) where the device runs sm_90a code
    (`sm90a`, from its limits), the call is `plain` (q, k, v strided as TMA reads them, a
    positive scale; packed sequences, KV caches and split-KV or not), the dtype float16
    or bfloat16 with d 64, 128 or 256, or float32 as split tf32 with d 64 or, with
    `allow_tf32`, one-pass tf32 with d 64 or 128, and the tile fits; `varlen`
    (lengths per batch row: packed sequences, a KV cache) picks its specialization for them."""
    name = dtype_name(dtype)

    def simt():
        return simt_forward_plan(d, name, max_smem=max_smem, algorithm=algorithm)

    if algorithm != "fa2":
        return simt(), f"SIMT: algorithm={algorithm!r} runs the FA1 loop order (SIMT only)"
    if name not in TC_MIN_CC:
        return simt(), (f"SIMT: {name} has no tensor-core path (float16, bfloat16 and "
                        f"float32 do)")
    if cc is None:
        return simt(), "SIMT: the device's compute capability is unknown"
    cc = tuple(cc)
    head_dims = TF32_HEAD_DIMS if name == TF32_DTYPE else TC_HEAD_DIMS
    why = _tensor_core_refusal(d, name, cc, aligned, head_dims=head_dims,
                               operands="q, k or v")
    if why:
        return simt(), why
    hopper = sm90_fwd_plan(name, d, varlen, allow_tf32) if sm90a else None
    if hopper is not None and plain and hopper.smem_bytes <= max_smem:
        return hopper, ("tensor cores: wgmma on sm_90a, fed by TMA from a producer warpgroup "
                        "(a plain call)")
    D = next(b for b in head_dims if d <= b)
    plan = _first_fit(tc_fwd_candidates(name, D, split=not allow_tf32, cc=cc), max_smem)
    if plan is None:
        return simt(), _no_tile_fits(name, D, max_smem)
    why = f"tensor cores: {_instruction(name, cc, allow_tf32)}"
    if sm90a and (name in SM90_DTYPES or name == TF32_DTYPE):   # the Hopper forward did not
        takes = (f"d = {_one_of(SM90_HEAD_DIMS)}" if name in SM90_DTYPES else   # take it
                 f"d = {_one_of(SM90_SPLIT_HEAD_DIMS)} as split tf32, "
                 f"{_one_of(SM90_TF32_HEAD_DIMS)} with allow_tf32=True (one-pass tf32),")
        why += (f" (the sm_90a wgmma forward takes {takes} and plain calls: q, k, v with rows "
                f"whole and strides multiples of 16 bytes, a positive scale)")
    return plan, why


def backward_path(d: int, dtype, cc=None, aligned: bool = True, *, max_smem: int,
                  sm_count=None, sm90a: bool = False, allow_tf32: bool = False,
                  dq_parts: bool = True, plain: bool = False):
    """((dkdv_plan, dq_plan), reason): the backward kernels a call takes, and why.

    Tensor cores (two `TcBwdPlan`s) where the dtype is float16 (sm_75+), bfloat16 or
    float32 (sm_80+; `Tf32BwdPlan`s: split tf32, or one-pass with `allow_tf32`), d's rows
    are whole 16-byte chunks up to 256, q, k, v and dO allow 16-byte loads (`aligned`) and
    a tile of each kernel fits `max_smem` (the first candidate that does: for 128 < d ≤ 256
    the dK/dV plan may split dK, dV into 128-column chunks, `TcBwdPlan.num_d_chunks`);
    otherwise the SIMT kernels of `simt_backward_plans`. Attention variants (window,
    softcap, ALiBi, bias, mask, dropout) and dbias (every kernel family writes it) take
    the same path as a plain call. The reason names the instruction and, for chunked
    plans, the chunks. `cc`, `sm_count` and `sm90a` as for `forward_path`.

    `dq_parts` (16-bit, one head-dim chunk, the tile fits): the 5-GEMM backward instead,
    (the dK/dV plan with DQ_PARTS, `DqSumPlan`): the dK/dV blocks also accumulate dQ in
    float32 partials that flash_bwd_dq_sum adds in order (`device.dq_workers` sizes them;
    where it gives 0, and for dbias, the caller asks again without).

    The Hopper backward (two `Sm90BwdPlan`s: the dK/dV pass, then the dQ pass; wgmma, TMA;
    the call swaps in the 5-GEMM pair, `kernel_backward_sm90.five_gemm_pair`)
    where the device runs sm_90a code (`sm90a`), the call is `plain` (q, k, v, dO strided as
    TMA reads them, a positive scale; any variant, dbias, packed sequences), the dtype
    float16 or bfloat16, d 64 or 128, and both tiles fit."""
    name = dtype_name(dtype)

    def simt():
        return simt_backward_plans(d, name, max_smem=max_smem)

    if name not in TC_MIN_CC:
        return simt(), (f"SIMT: {name} has no tensor-core backward (float16, bfloat16 "
                        f"and float32 do)")
    if cc is None:
        return simt(), "SIMT: the device's compute capability is unknown"
    cc = tuple(cc)
    head_dims = TF32_HEAD_DIMS if name == TF32_DTYPE else TC_BWD_HEAD_DIMS
    why = _tensor_core_refusal(d, name, cc, aligned, head_dims=head_dims,
                               operands="q, k, v or dO")
    if why:
        return simt(), why
    hopper = sm90_bwd_plans(name, d) if sm90a else None
    if hopper is not None and plain and all(p.smem_bytes <= max_smem for p in hopper):
        return hopper, ("tensor cores: wgmma on sm_90a, fed by TMA from a producer warpgroup; "
                        "five GEMMs (dK/dV adding dQ's parts into float32 partials, summed in "
                        "order) where the worker model takes them, else dK/dV then dQ")
    D = next(b for b in head_dims if d <= b)
    fits = tuple(_first_fit(tc_bwd_candidates(kernel, name, D, split=not allow_tf32, cc=cc),
                            max_smem) for kernel in TC_BWD_KERNELS)
    if None in fits:
        return simt(), _no_tile_fits(name, D, max_smem, "backward ")
    chunks = "".join(f", {p.kernel} in {p.num_d_chunks(d)} head-dim chunks of {p.chunk_cols}"
                     for p in fits if p.num_d_chunks(d) > 1)
    why = f"tensor cores: {_instruction(name, cc, allow_tf32)}{chunks}"
    fused = _first_fit(dq_parts_tiles(name, D, cc), max_smem) if dq_parts else None
    if sm90a and name in SM90_DTYPES:   # the Hopper backward was there and did not take it
        why += (f" (the sm_90a wgmma backward takes d = "
                f"{_one_of(SM90_BWD_HEAD_DIMS)} and plain calls: q, k, v, dO with "
                f"rows whole and strides multiples of 16 bytes, a positive scale)")
    if fused is not None:
        return ((fused, DqSumPlan(name)),
                f"{why}, 5 GEMMs (dQ from the dK/dV blocks in float32 partials)")
    return fits, why
