"""The kernel families: which `.cu` source and which `__global__` template each launch runs.

One table, read by the API's checks (which forward algorithms exist), the planner
(`cuflash.tiling`: a plan names its family), the compile gate's list of
specializations and the launch. A new kernel family is one new entry here, plus its
plans in `tiling`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelFamily:
    """A `__global__` function template `<name>_kernel` in `cuflash/kernels/<source>`."""

    name: str     # e.g. "flash_fwd"
    source: str   # e.g. "flash_fwd.cu"

    @property
    def function(self) -> str:
        return f"{self.name}_kernel"


FLASH_FWD = KernelFamily("flash_fwd", "flash_fwd.cu")                    # FA2 forward
FLASH_FWD_FA1 = KernelFamily("flash_fwd_fa1", "flash_fwd_fa1.cu")        # FA1 forward
FLASH_FWD_TC = KernelFamily("flash_fwd_tc", "flash_fwd_tc.cu")           # FA2 forward on mma.sync
FLASH_FWD_SM90 = KernelFamily("flash_fwd_sm90", "flash_fwd_sm90.cu")     # forward on wgmma (sm_90a)
FLASH_BWD_PREPROCESS = KernelFamily("flash_bwd_preprocess", "flash_bwd.cu")  # D = rowsum(dO∘O)
FLASH_BWD_DKDV = KernelFamily("flash_bwd_dkdv", "flash_bwd.cu")
FLASH_BWD_DQ = KernelFamily("flash_bwd_dq", "flash_bwd.cu")
FLASH_BWD_DKDV_TC = KernelFamily("flash_bwd_dkdv_tc", "flash_bwd_tc.cu")  # dK, dV on mma.sync
FLASH_BWD_DQ_TC = KernelFamily("flash_bwd_dq_tc", "flash_bwd_tc.cu")      # dQ on mma.sync
FLASH_BWD_DQ_SUM = KernelFamily("flash_bwd_dq_sum", "flash_bwd_tc.cu")    # dQ from its partials
FLASH_BWD_DKDV_SM90 = KernelFamily("flash_bwd_dkdv_sm90", "flash_bwd_sm90.cu")  # dK, dV on wgmma
FLASH_BWD_DQ_SM90 = KernelFamily("flash_bwd_dq_sm90", "flash_bwd_sm90.cu")      # dQ on wgmma
FLASH_BWD_DQ_SUM_SM90 = KernelFamily("flash_bwd_dq_sum_sm90", "flash_bwd_sm90.cu")  # its partials
SOFTMAX_ROWS = KernelFamily("softmax_rows", "online_softmax.cu")         # one block per line
SOFTMAX_COLS = KernelFamily("softmax_cols", "online_softmax.cu")         # one thread per line
BLOCK_MASK = KernelFamily("block_mask", "block_mask.cu")                 # a block mask's tile kinds

FAMILIES = {f.name: f for f in (FLASH_FWD, FLASH_FWD_FA1, FLASH_FWD_TC, FLASH_FWD_SM90,
                                FLASH_BWD_PREPROCESS,
                                FLASH_BWD_DKDV, FLASH_BWD_DQ, FLASH_BWD_DKDV_TC, FLASH_BWD_DQ_TC,
                                FLASH_BWD_DQ_SUM, FLASH_BWD_DKDV_SM90, FLASH_BWD_DQ_SM90,
                                FLASH_BWD_DQ_SUM_SM90,
                                SOFTMAX_ROWS, SOFTMAX_COLS, BLOCK_MASK)}

# The public API's `algorithm=` values and the forward family each one runs. "fa2" runs
# FLASH_FWD_TC (float16, bfloat16; float32 on tf32) instead where tensor cores apply
# (`tiling.forward_path`).
FORWARD_ALGORITHMS = {"fa2": FLASH_FWD, "fa1": FLASH_FWD_FA1}
