"""What the device gives a plan: its limits, the occupancy model, split-KV (how many
key ranges keep every SM busy when the query blocks alone would not), and the 5-GEMM
backward's workers."""
from __future__ import annotations

import math


def device_limits():
    """{'max_smem', 'sm_count', 'cc', 'sm90a'} of the current CuPy device; `sm90a`: it runs
    sm_90a's architecture-specific code (every compute capability 9.0 GPU does)."""
    import cupy
    dev = cupy.cuda.Device()
    attrs = dev.attributes
    cc = dev.compute_capability  # "80", "90", "100", "120": the minor is the last digit
    return {
        "max_smem": int(attrs["MaxSharedMemoryPerBlockOptin"]),
        "sm_count": int(attrs["MultiProcessorCount"]),
        "cc": (int(cc[:-1]), int(cc[-1])),
        "sm90a": cc == "90",
    }


def occupancy(limits, *, threads: int, smem_bytes: int, registers: int) -> int:
    """Resident blocks per SM of a kernel, by the CUDA occupancy calculator's rules:
    the fewest allowed by the SM's block slots, its warp slots, its registers (allocated
    per warp in units of 256) and its shared memory (static + dynamic + the per-block
    reserve, in units of 128 bytes). `limits` is a `cuflash.emulator.archs.GpuLimits`."""
    warps = -(-threads // 32)
    by_warps = limits.max_threads_per_sm // 32 // warps
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = limits.registers_per_sm // (regs_per_warp * warps) if registers > 0 else by_warps
    smem = -(-(smem_bytes + limits.shared_reserved_per_block) // 128) * 128
    by_smem = limits.shared_per_sm // smem if smem else by_warps
    return max(0, min(limits.max_blocks_per_sm, by_warps, by_regs, by_smem))


# ── split-KV: two rules, because a split costs two different things ─────────────────────
#
# Within one launch (seqlens.cuh, `split_kv_count`): a split is one more block on the
# grid and one more lse-weighted term in the merge, both small next to a key tile, so
# the rule follows FlashAttention-2's `num_splits_heuristic` and its cap of 128.
# Over separate calls (`split_kv_calls`: the NumPy backend, or cache pages the kernels
# cannot read in place): a split is a whole attention call on a view of the cache and a
# merge pass over O, so each must bring MIN_KEYS_PER_CALL keys and there are few of them.

MAX_SPLITS = 128            # FlashAttention-2's cap
SPLIT_FULL_WAVES = 0.8      # this many blocks per SM (as a fraction) already fill the GPU
SPLIT_EFFICIENCY = 0.85     # take the fewest splits within this fraction of the best
MAX_CALL_SPLITS = 16        # above this the merge costs more than the calls save
MIN_KEYS_PER_CALL = 256     # a call on fewer keys is mostly call overhead
CALL_QUERY_BLOCK = 64       # query rows per unit of work, as the kernels' tiles


def split_kv_count(blocks: int, key_tiles: int, sm_count) -> int:
    """How many key ranges (split-KV) a forward launch of `blocks` blocks (query blocks ×
    heads × batch, and head-dim chunks), each walking `key_tiles` key tiles, should cut the
    keys into on `sm_count` SMs. FlashAttention-2's rule: no split once the blocks fill
    SPLIT_FULL_WAVES of the SMs; else, of the split counts s ≤ min(MAX_SPLITS, SMs, key
    tiles) that change the tiles per split, the fewest whose wave efficiency
    (blocks·s / SMs) / ⌈blocks·s / SMs⌉ is within SPLIT_EFFICIENCY of the best. The merge
    (one lse-weighted sum per split) is not modelled: it is small next to the tiles."""
    if not sm_count or blocks <= 0 or blocks >= SPLIT_FULL_WAVES * sm_count:
        return 1
    cap = min(MAX_SPLITS, sm_count, key_tiles)
    if cap <= 1:
        return 1

    def efficiency(s):
        waves = blocks * s / sm_count
        return waves / math.ceil(waves)

    counts = [s for s in range(1, cap + 1)
              if s == 1 or -(-key_tiles // s) != -(-key_tiles // (s - 1))]
    best = max(efficiency(s) for s in counts)
    return next(s for s in counts if efficiency(s) >= SPLIT_EFFICIENCY * best)


def split_kv_calls(units: int, batch: int, heads: int, nq: int, max_keys: int) -> int:
    """How many separate attention calls a KV-cache step cuts each row's keys into on
    `units` parallel units (SMs, or the NumPy backend's workers): none while the (row,
    head, CALL_QUERY_BLOCK-query block) tiles fill SPLIT_FULL_WAVES of the units; else
    enough to fill them, each call on at least MIN_KEYS_PER_CALL keys, at most
    MAX_CALL_SPLITS. An empty batch has nothing to split."""
    tiles = batch * heads * math.ceil(max(nq, 1) / CALL_QUERY_BLOCK)
    if tiles == 0 or tiles >= SPLIT_FULL_WAVES * units:
        return 1
    return max(1, min(math.ceil(units / tiles), math.ceil(max_keys / MIN_KEYS_PER_CALL),
                      MAX_CALL_SPLITS))


# ── the 5-GEMM backward's workers ───────────────────────────────────────────────────────
#
# A worker is a dK/dV block that walks key blocks w, w + W, … of one (batch, K/V head) and
# adds dS K_j into its own float32 partial of dQ; flash_bwd_dq_sum adds the W partials in
# order. The model counts tile-times: a dK/dV block fills an SM (8 warps at the register
# limit), so W workers per unit take ⌈W·units / SMs⌉ waves of ⌈key blocks / W⌉ tiles; the
# two-kernel backward takes ⌈key blocks·units / SMs⌉ waves of one tile (and its dQ kernel
# as many). FlashAttention-2's rule, ⌈SMs / units⌉ workers, bounds W (and so the partials'
# memory) but can overshoot the SMs by a few blocks and take two waves where one would do
# (on an H100, 9 workers × 16 heads = 144 blocks for 132 SMs: measured 1.76× slower than 8).
#
# DQ_PARTS_TILE_COST: a 5-GEMM tile's time over a two-kernel tile's (its 7 GEMMs), measured
# on an H100 (benchmarks/bench_dq_workers.py, results/bench_dq_workers.csv): 0.95–1.08 at
# equal waves, so 1. Five GEMMs would make it 5/7; the dQ partials' red.add and the one
# block per SM take the rest. With finer blocks the two kernels never take more waves, so
# they run until the 5-GEMM tile gets cheaper; `dq_workers=W` asks for the 5-GEMM pass.
#
# SM90_DQ_PARTS_TILE_COST: the same for the Hopper pair (flash_bwd_sm90.cu; its workers hold
# two partials, one per consumer warpgroup), from the static model until a GPU measures it
# (bench_gpu.py's cuflash-sm90-2pass): the 5-GEMM dK/dV pass issues 1676 (D = 128) and 1473
# (D = 64) instructions per 128x128 block per SMSP, counted through the adding thread,
# against the two passes' 2354 and 2192 (docs/kernels.md): 0.71 and 0.67, taken as 0.72.
# Its partials' memory is counted apart, as it does not shrink with the keys: each float32
# partial is zeroed, written back from the adds and read by the sum, 12 bytes per element
# of dQ. SM90_PARTIAL_TILES is that in tile-times per (batch, K/V head), a tile being one
# SM's 14 FLOPs per row and column of dQ for each of its 128 keys: 12 · 1.37 / (14 · 128),
# 1.37 the FLOPs one SM's two passes run while the HBM moves a byte on an H100 (the two
# passes measured 386 TFLOP/s by the 5-GEMM count at B·H = 64, N = 4096, d = 128,
# results/bench_gpu_persistent_head_by_head.csv: 7/5 · 386 / 132 SMs = 4.1 per SM,
# against about 3.0 TB/s of HBM3). So the partials cost more than the GEMMs they save at
# N = 1024 with few heads, and little at N = 16384.

DQ_PARTS_MAX = 16   # partials per (batch, K/V head): at most 16 float32 copies of dQ
DQ_PARTS_TILE_COST = 1.0
SM90_DQ_PARTS_TILE_COST = 0.72
SM90_PARTIAL_TILES = 12 * 1.37 / (14 * 128)


def dq_workers(units: int, key_blocks: int, sm_count,
               tile_cost: float = DQ_PARTS_TILE_COST, most: int = DQ_PARTS_MAX,
               partial_tiles: float = 0.0, partials_per_worker: int = 1) -> int:
    """Workers W per (batch, K/V head) of the 5-GEMM backward for `units` (batch × K/V
    heads) over `key_blocks` key blocks each on `sm_count` SMs: up to FlashAttention-2's
    ⌈SMs / units⌉ (at most the key blocks and `most`), the fewest whose waves, and
    partials' memory, take the least time in the model above; 0 where the two-kernel
    backward takes no longer (`tile_cost`: a 5-GEMM tile's time in two-kernel tiles;
    `partial_tiles`: a partial's memory pass per unit, `partials_per_worker` of them) or the
    SM count is unknown."""
    if not sm_count or units <= 0 or key_blocks <= 0:
        return 0

    def time(w):
        return (tile_cost * -(-w * units // sm_count) * -(-key_blocks // w)
                + partial_tiles * units * partials_per_worker * w)

    w = min(range(1, min(-(-sm_count // units), key_blocks, most) + 1), key=time)
    return w if time(w) < -(-key_blocks * units // sm_count) else 0
