"""Tile plans: on-chip memory turned into block sizes (the public names of `cuflash.plans`,
whose modules mirror the kernels' traits headers one for one).

* the papers' rule, `paper_block_sizes(M, d)`: for M elements of SRAM,
  Bc = ceil(M / 4d) and Br = min(Bc, d) (FlashAttention, Algorithm 1, line 1);
* the choosers, one per pass: `forward_path` and `backward_path` give the plans a call
  runs and why; `simt_forward_plan` and `simt_backward_plans` are the SIMT kernels' alone;
* the plans, frozen dataclasses with their traits' shared-memory formulas: `SimtFwdPlan`,
  `TcPlan` (`Tf32Plan` for float32), `SimtBwdPlan`, `BwdPreprocessPlan`, `TcBwdPlan`
  (`Tf32BwdPlan`), `DqSumPlan`, `SoftmaxPlan`;
* the finite set of specializations, `every_plan()` and `specializations()`, which the
  compile gate compiles;
* the device: `device_limits()`, `occupancy(...)`, split-KV (`split_kv_count` within a
  launch, `split_kv_calls` over separate calls), the 5-GEMM backward's `dq_workers`.
"""
from .plans.base import DTYPE_NAMES, ELEMENTS, dtype_name
from .plans.catalog import every_plan, specializations
from .plans.choose import TC_MIN_CC, backward_path, forward_path
from .plans.device import (DQ_PARTS_MAX, DQ_PARTS_TILE_COST, MAX_CALL_SPLITS, MAX_SPLITS,
                           MIN_KEYS_PER_CALL, SM90_DQ_PARTS_TILE_COST, SM90_PARTIAL_TILES,
                           device_limits, dq_workers, occupancy, split_kv_calls,
                           split_kv_count)
from .plans.paper import paper_block_sizes
from .plans.simt_bwd import (BWD_HEAD_DIM_BUCKETS, BWD_KERNELS, BwdPreprocessPlan, SimtBwdPlan,
                             all_simt_bwd_plans, bwd_head_dim_bucket, bwd_head_dim_chunks,
                             bwd_preprocess_plan, bwd_smem_bytes, simt_backward_plans)
from .plans.simt_fwd import (HEAD_DIM_BUCKETS, SimtFwdPlan, all_simt_fwd_plans,
                             attention_smem_bytes, head_dim_bucket, simt_forward_plan)
from .plans.sm90_bwd import (Sm90BwdPlan, Sm90DqSumPlan, all_sm90_bwd_plans, sm90_bwd_plans,
                             sm90_dq_parts_plans)
from .plans.sm90_fwd import (SM90_DTYPES, SM90_HEAD_DIMS, SM90_SPLIT_HEAD_DIMS,
                             SM90_TF32_HEAD_DIMS, Sm90FwdPlan, all_sm90_fwd_plans, sm90_fwd_plan)
from .plans.softmax import (SOFTMAX_COLS_MIN_Q, SOFTMAX_THREADS, SoftmaxPlan, all_softmax_plans,
                            plan_softmax)
from .plans.tc_bwd import (TC_BWD_HEAD_DIMS, TC_BWD_KERNELS, DqSumPlan, TcBwdPlan,
                           Tf32BwdPlan, all_tc_bwd_plans, all_tf32_bwd_plans,
                           tc_bwd_smem_bytes)
from .plans.tc_fwd import (TC_DTYPES, TC_HEAD_DIMS, TF32_DTYPE, TF32_HEAD_DIMS, TcPlan,
                           Tf32Plan, all_tc_plans, all_tf32_plans, tc_smem_bytes)

__all__ = [
    "DTYPE_NAMES", "ELEMENTS", "dtype_name", "every_plan", "specializations", "TC_MIN_CC",
    "backward_path", "forward_path", "MAX_CALL_SPLITS", "MAX_SPLITS", "MIN_KEYS_PER_CALL",
    "device_limits", "occupancy", "split_kv_calls", "split_kv_count", "paper_block_sizes",
    "DQ_PARTS_MAX", "DQ_PARTS_TILE_COST", "SM90_DQ_PARTS_TILE_COST", "SM90_PARTIAL_TILES", "dq_workers", "DqSumPlan",
    "BWD_HEAD_DIM_BUCKETS", "BWD_KERNELS", "BwdPreprocessPlan", "SimtBwdPlan",
    "all_simt_bwd_plans", "bwd_head_dim_bucket", "bwd_head_dim_chunks", "bwd_preprocess_plan",
    "bwd_smem_bytes", "simt_backward_plans", "HEAD_DIM_BUCKETS", "SimtFwdPlan",
    "all_simt_fwd_plans", "attention_smem_bytes", "head_dim_bucket", "simt_forward_plan",
    "Sm90BwdPlan", "Sm90DqSumPlan", "all_sm90_bwd_plans", "sm90_bwd_plans", "sm90_dq_parts_plans", "SM90_DTYPES", "SM90_HEAD_DIMS", "SM90_SPLIT_HEAD_DIMS", "SM90_TF32_HEAD_DIMS", "Sm90FwdPlan", "all_sm90_fwd_plans", "sm90_fwd_plan",
    "SOFTMAX_COLS_MIN_Q", "SOFTMAX_THREADS", "SoftmaxPlan", "all_softmax_plans", "plan_softmax",
    "TC_BWD_HEAD_DIMS", "TC_BWD_KERNELS", "TcBwdPlan", "Tf32BwdPlan",
    "all_tc_bwd_plans", "all_tf32_bwd_plans", "tc_bwd_smem_bytes", "TC_DTYPES", "TC_HEAD_DIMS",
    "TF32_DTYPE", "TF32_HEAD_DIMS", "TcPlan", "Tf32Plan", "all_tc_plans", "all_tf32_plans",
    "tc_smem_bytes",
]
