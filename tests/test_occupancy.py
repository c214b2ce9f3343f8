"""The occupancy model (tiling.occupancy), worked by hand on an A100's limits."""
import pytest

from cuflash import tiling
from cuflash.emulator import archs

A100 = archs.gpu_limits("sm_80")   # 2048 threads, 32 blocks, 64K registers, 164 KB per SM


@pytest.mark.parametrize("threads,smem,regs,blocks", [
    (256, 0, 64, 4),            # registers: 64·32 = 2048 per warp, ×8 warps → 65536/16384
    (128, 48 * 1024, 32, 3),    # shared memory: (48 KB + 1 KB reserve) fits 3× in 164 KB
    (128, 48 * 1024, 255, 2),   # 255 registers round up to 256: 8192 per warp, 2 blocks
    (256, 0, 33, 6),            # 33·32 = 1056 registers per warp allocate 1280: 6, not 7
    (128, 41 * 1024, 32, 3),    # 41 KB + the 1 KB reserve fits 3×, not 4×
    (1024, 0, 16, 2),           # warp slots: 64 warps per SM, 32 per block
    (32, 0, 16, 32),            # block slots: 32 per SM
    (128, 200 * 1024, 32, 0),   # more shared memory than the SM has: none fit
])
def test_occupancy_by_hand(threads, smem, regs, blocks):
    assert tiling.occupancy(A100, threads=threads, smem_bytes=smem, registers=regs) == blocks
