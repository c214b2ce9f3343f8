// mask.cuh — which keys a query row may see by index alone (causal, sliding window), in
// one place.
//
// Both are aligned to the bottom-right corner (FlashAttention-2 >= 2.1, and what KV-cache
// decoding needs), with off = Nk − Nq: query i sees key j when
//     i + off − left ≤ j ≤ i + off + right      (window; −1 = unbounded on that side)
//     j ≤ i + off                               (causal: intersects with the window)
// Keys j >= Nk (the padding of a partial last tile) are always masked. The bool mask and
// the other variants are in variants.cuh.
#pragma once

namespace cuflash {

struct CausalMask {
    int Nq, Nk;
    bool causal;
    int left = -1, right = -1;  // the window; −1: unbounded on that side

    // How far right of the diagonal a row sees: −1 unbounded; causal caps it at 0.
    __device__ __forceinline__ int reach_right() const {
        return causal ? 0 : right;
    }

    // The last key (exclusive) any row in [m0, m1) can see: block skipping stops the key
    // loop there, so tiles entirely right of the diagonal (or window) are never loaded.
    __device__ __forceinline__ int key_end(int m1) const {
        const int r = reach_right();
        if (r < 0) return Nk;
        const int end = m1 + (Nk - Nq) + r;  // row m1 - 1 sees keys j <= m1 - 1 + off + r
        return end < 0 ? 0 : (end < Nk ? end : Nk);
    }

    // The first key any row >= m0 can see: a window's left edge. The key loop starts at
    // the tile holding it, so tiles entirely left of the window are never loaded.
    __device__ __forceinline__ int key_begin(int m0) const {
        if (left < 0) return 0;
        const int begin = m0 + (Nk - Nq) - left;
        return begin < 0 ? 0 : (begin < Nk ? begin : Nk);
    }

    // The first query row that can see key n0 (and so any key of a block starting there):
    // row i sees key j once j <= i + off + reach. The backward's dK/dV kernel starts its
    // query loop there, so tiles entirely above the diagonal are never loaded.
    __device__ __forceinline__ int first_row(int n0) const {
        const int r = reach_right();
        if (r < 0) return 0;
        const int first = n0 - (Nk - Nq) - r;
        return first < 0 ? 0 : first;
    }

    // The last query row (exclusive) that can see key n1 − 1 (or any key before it): the
    // window's left edge, for the dK/dV kernel's query loop.
    __device__ __forceinline__ int row_end(int n1) const {
        if (left < 0) return Nq;
        const int end = n1 - (Nk - Nq) + left;  // row i sees key n1 − 1 while i <= this − 1
        return end < 0 ? 0 : (end < Nq ? end : Nq);
    }

    // Whether a tile of rows >= m0 and keys [n0, n0 + block_n) may need the per-element
    // test: keys below the diagonal, in range and with no left window edge are visible to
    // every row of the block, so those tiles skip it.
    __device__ __forceinline__ bool tile_needs_mask(int m0, int n0, int block_n) const {
        if (n0 + block_n > Nk) return true;                              // partial tile
        if (left >= 0) return true;                                      // a window's left edge
        const int r = reach_right();
        return r >= 0 && (n0 + block_n - 1 > m0 + (Nk - Nq) + r);      // crosses the diagonal
    }

    // Whether every row of [m0, m1) sees every key of [n0, n1): keys in range, no diagonal
    // and no window edge inside. The Hopper backward's steps skip the per-score test there.
    __device__ __forceinline__ bool sees_all(int m0, int m1, int n0, int n1) const {
        const int r = reach_right();
        return n1 <= Nk && !(r >= 0 && n1 - 1 > m0 + (Nk - Nq) + r) &&
               !(left >= 0 && n0 < m1 - 1 + (Nk - Nq) - left);
    }

    // The key tiles [lo, hi) of [t_begin, t_end) that every row of [m0, m1) sees whole
    // (no partial tile, no diagonal, no window edge crosses them): the forward runs them
    // without the per-element test. Empty (lo = hi) when there are none.
    __device__ __forceinline__ void full_tiles(int m0, int m1, int block_n, int t_begin,
                                               int t_end, int& lo, int& hi) const {
        int key_lo = 0, key_hi = Nk;  // keys every row of the block sees
        if (left >= 0) key_lo = m1 - 1 + (Nk - Nq) - left;
        const int r = reach_right();
        if (r >= 0 && m0 + (Nk - Nq) + r + 1 < key_hi) key_hi = m0 + (Nk - Nq) + r + 1;
        lo = key_lo <= 0 ? 0 : (key_lo + block_n - 1) / block_n;
        hi = key_hi <= 0 ? 0 : key_hi / block_n;
        lo = lo < t_begin ? t_begin : (lo > t_end ? t_end : lo);
        hi = hi < lo ? lo : (hi > t_end ? t_end : hi);
    }

    __device__ __forceinline__ bool masked(int i, int j) const {
        const int r = reach_right();
        return j >= Nk || (r >= 0 && j > i + (Nk - Nq) + r) ||
               (left >= 0 && j < i + (Nk - Nq) - left);
    }
};

}  // namespace cuflash
