// A block mask's tile kinds on the device (programmable/block_mask.py): mask_mod evaluated
// at every (query, key) of each tile of a (B or 1, H or 1, Nq, Nk) grid, one thread block
// per tile, one byte out per tile:
//
//   kinds[b, h, i, j] = EMPTY    no key of the tile is visible to any of its rows
//                       FULL     every key is visible to every row
//                       PARTIAL  otherwise
//
// The call's mask_mod is compiled in before this source (programmable/cuda_c.py:
// cuflash_mask_mod, its captured arrays as CUFLASH_MOD_PARAMS), in the accumulation type
// of the attention calls the block mask serves, as the attention kernels compile it.
#include "common.cuh"
#include "variants.cuh"  // TileKind, the kinds the attention kernels read

namespace cuflash {

// The mods' record: CUFLASH_MOD_RECORD is ", cuflash_mods{...}", a trailing argument.
__device__ __forceinline__ cuflash_mods mods_record(int, const cuflash_mods& m) { return m; }

}  // namespace cuflash

// Grid: (key blocks, query blocks, B·H); kinds (B, H, query blocks, key blocks), C order.
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
block_mask_kernel(unsigned char* __restrict__ kinds, int H, int Nq, int Nk, int block_q,
                  int block_k CUFLASH_MOD_PARAMS) {
    const cuflash_mods mods = cuflash::mods_record(0 CUFLASH_MOD_RECORD);
    const int j = blockIdx.x, i = blockIdx.y;
    const int b = blockIdx.z / H, h = blockIdx.z % H;
    const int q0 = i * block_q, k0 = j * block_k;
    const int rows = min(block_q, Nq - q0), cols = min(block_k, Nk - k0);
    bool seen = false, hidden = false;  // this thread's share of the tile
    for (int e = threadIdx.x; e < rows * cols; e += THREADS) {
        const bool visible = cuflash_mask_mod(b, h, q0 + e / cols, k0 + e % cols, mods);
        seen |= visible;
        hidden |= !visible;
    }
    const bool any_seen = __syncthreads_or(seen), any_hidden = __syncthreads_or(hidden);
    if (threadIdx.x == 0)
        kinds[((long long)blockIdx.z * gridDim.y + i) * gridDim.x + j] =
            !any_seen ? cuflash::kTileEmpty : any_hidden ? cuflash::kTilePartial : cuflash::kTileFull;
}
