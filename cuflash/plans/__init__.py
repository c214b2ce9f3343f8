"""Tile plans: on-chip memory turned into block sizes, one module per C++ traits header.

  paper      the papers' rule, `paper_block_sizes(M, d)`
  base       what every plan is (`Plan`), element types by name (`ELEMENTS`)
  simt_fwd   SIMT forward, `AttnTileTraits` (kernels/attn_tile.cuh)
  tc_fwd     tensor-core forward, `TcTileTraits` and `Tf32TileTraits` (tc_tile.cuh,
             tf32_tile.cuh)
  simt_bwd   SIMT backward, `BwdTileTraits` (bwd_tile.cuh)
  tc_bwd     tensor-core backward, `TcBwdTraits` (tc_bwd_tile.cuh)
  sm90_fwd   the Hopper forward, `Sm90FwdTraits` (flash_fwd_sm90.cu, sm_90a)
  sm90_bwd   the Hopper backward, `Sm90BwdTraits`, `Sm90BwdDqTraits` (flash_bwd_sm90.cu)
  softmax    online softmax (online_softmax.cu)
  choose     `forward_path`, `backward_path`: which plans a call takes, and why
  device     device limits, the occupancy model, split-KV, the 5-GEMM backward's workers
  catalog    `every_plan`, `specializations`: what the compile gate compiles

A plan is a frozen dataclass naming its kernel family (`families.py`) and carrying the
family's template parameters; its shared-memory size comes from one formula that mirrors
its traits struct term for term, checked against ptxas by the compile gate.
`cuflash.tiling` re-exports the public names.
"""
