// mask.cuh — which keys a query row may see, in one place.
//
// Causal attention is aligned to the bottom-right corner (FlashAttention-2 >= 2.1, and
// what KV-cache decoding needs): key j is masked for query i when j > i + (Nk - Nq).
// Keys j >= Nk (the padding of a partial last tile) are always masked.
#pragma once

namespace cuflash {

struct CausalMask {
    int Nq, Nk;
    bool causal;

    // The last key (exclusive) any row in [m0, m1) can see: causal block skipping stops
    // the key loop there, so tiles entirely above the diagonal are never loaded.
    __device__ __forceinline__ int key_end(int m1) const {
        if (!causal) return Nk;
        const int end = m1 + (Nk - Nq);  // row m1 - 1 sees keys j <= m1 - 1 + Nk - Nq
        return end < 0 ? 0 : (end < Nk ? end : Nk);
    }

    // The first query row that can see key n0 (and so any key of a block starting there):
    // row i sees key j once j <= i + (Nk - Nq). The backward's dK/dV kernel starts its
    // query loop there, so tiles entirely above the diagonal are never loaded.
    __device__ __forceinline__ int first_row(int n0) const {
        if (!causal) return 0;
        const int first = n0 - (Nk - Nq);
        return first < 0 ? 0 : first;
    }

    // The first key (exclusive) from which a tile may need masking for rows >= m0: keys
    // below it are visible to every row of the block (and in range), so those tiles skip
    // the per-element test.
    __device__ __forceinline__ bool tile_needs_mask(int m0, int n0, int block_n) const {
        if (n0 + block_n > Nk) return true;                             // partial tile
        return causal && (n0 + block_n - 1 > m0 + (Nk - Nq));          // crosses the diagonal
    }

    __device__ __forceinline__ bool masked(int i, int j) const {
        return j >= Nk || (causal && j > i + (Nk - Nq));
    }
};

}  // namespace cuflash
