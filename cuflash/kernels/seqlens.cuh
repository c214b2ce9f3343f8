// seqlens.cuh — which rows and keys a forward block owns, in one place.
//
// Three layouts share the forward kernels; a block finds its sequence from its batch
// index b:
//   padded     (B, H, N, d): every batch row is Nq queries and Nk keys   (no index arrays)
//   varlen     (1, H, total, d), sequences packed along the rows: sequence b is rows
//              cu_seqlens[b] .. cu_seqlens[b + 1]                      (cu_seqlens_q, _k)
//   KV cache   padded keys of which batch row b uses the first seqused_k[b]
//   paged      keys in pages (num_pages, H, page_size, d): key n of batch row b is row
//              n % page_size of page block_table[b][n / page_size]; a key tile never
//              straddles two pages (the launch keeps page_size a multiple of BLOCK_N)
// The grid is sized for the longest sequence; a block past its own sequence's last query
// row returns before its first barrier.
//
// Split-KV: with num_splits > 1 the key tiles of every (query block, head, batch) are cut
// into num_splits contiguous ranges, one block each. Each block writes its partial O_i
// (normalised by its own ℓ) in the accumulation type to o_part and its partial lse, and
// the launch merges the partials by the lse rule (cuflash.merge_states) in a fixed order:
// deterministic. A range with no visible key gives O = 0, lse = −inf, which the merge
// ignores.
//
// lse (and o_part, one d-wide row per lse entry) of query row i of sequence b, head h,
// split s is entry s·lse_ss + b·lse_sb + h·lse_sh + start_q(b) + i.
#pragma once

#include "common.cuh"

namespace cuflash {

// The layout's scalars as one kernel argument (cuflash/backends/marshal.py's LAYOUT
// record), copied into Seqlens at entry; the index arrays are arguments of their own.
// Seqlens repeats the fields rather than deriving from SeqLayout: with the record as a
// base, ptxas spilled sm_120's split-tf32 dK/dV kernel (8 bytes at 255 registers).
struct SeqLayout {
    int table_stride, page_size;  // block_table's row stride, keys per page (paged cache)
    long long lse_sb, lse_sh, lse_ss;  // lse's batch, head and split strides
    int num_splits;
};

// Clip the key range [n_begin, n_end) to split `split`'s share of the ⌈Nk / block_n⌉ key
// tiles cut into num_splits (FlashAttention-2's split: the same tile count per split for
// every block); the mma.sync forwards' and the Hopper forward's rule.
__device__ __forceinline__ void clip_to_split(int split, int num_splits, int Nk, int block_n,
                                              int& n_begin, int& n_end) {
    if (num_splits <= 1) return;
    const int tiles = (Nk + block_n - 1) / block_n;
    const int per_split = (tiles + num_splits - 1) / num_splits;
    const int lo = split * per_split * block_n, hi = lo + per_split * block_n;
    n_begin = n_begin > lo ? n_begin : lo;
    n_end = n_end < hi ? n_end : hi;
    if (n_end < n_begin) n_end = n_begin;
}

struct Seqlens {
    const int* cu_q;    // (B + 1) row offsets of the packed q, o, lse, or nullptr
    const int* cu_k;    // (B + 1) row offsets of the packed k, v, or nullptr
    const int* used_k;  // (B) keys in use per batch row (a KV cache), or nullptr
    const int* block_table;  // (B, table_stride) page numbers (a paged cache), or nullptr
    int table_stride, page_size;
    long long lse_sb, lse_sh, lse_ss;
    int num_splits;

    __device__ __forceinline__ int start_q(int b) const { return cu_q ? cu_q[b] : 0; }
    __device__ __forceinline__ int start_k(int b) const { return cu_k ? cu_k[b] : 0; }
    // Batch row b's lengths (Nq, Nk: the padded ones).
    __device__ __forceinline__ int len_q(int b, int Nq) const {
        return cu_q ? cu_q[b + 1] - cu_q[b] : Nq;
    }
    __device__ __forceinline__ int len_k(int b, int Nk) const {
        return used_k ? used_k[b] : (cu_k ? cu_k[b + 1] - cu_k[b] : Nk);
    }

    // Row 0 of the key tile starting at key n0 of batch row b, in k or v (strides st) from
    // its head's base kv_h (the batch stride is the page stride of a paged cache).
    template <typename T>
    __device__ __forceinline__ const T* key_tile(const T* kv_h, const Strides& st, int b,
                                                 int n0) const {
        if (block_table) {
            const long long page = block_table[(long long)b * table_stride + n0 / page_size];
            return kv_h + page * st.b + (long long)(n0 % page_size) * st.r;
        }
        return kv_h + b * st.b + (start_k(b) + (long long)n0) * st.r;
    }

    // The entry of query row i (within its sequence) in lse and o_part.
    __device__ __forceinline__ long long lse_row(int split, int b, int h, int i) const {
        return split * lse_ss + b * lse_sb + h * lse_sh + start_q(b) + i;
    }

    // Clip the key range [n_begin, n_end) to split `split`'s share (cuflash::clip_to_split).
    __device__ __forceinline__ void clip_to_split(int split, int Nk, int block_n,
                                                  int& n_begin, int& n_end) const {
        cuflash::clip_to_split(split, num_splits, Nk, block_n, n_begin, n_end);
    }
};

}  // namespace cuflash

// The layout's kernel parameters, appended to every FA2 forward kernel's list before the
// variants' (the order of cuflash/backends/kernel_forward.py:layout_args), and the record.
#define CUFLASH_SEQLENS_PARAMS(A)                                                          \
    const int *cu_seqlens_q, const int *cu_seqlens_k, const int *seqused_k,                \
        const int *block_table, cuflash::SeqLayout layout, A *o_part
#define CUFLASH_SEQLENS                                                                    \
    cuflash::Seqlens {                                                                     \
        cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, layout.table_stride,           \
            layout.page_size, layout.lse_sb, layout.lse_sh, layout.lse_ss,                 \
            layout.num_splits                                                              \
    }

// The backward's share of it: packed sequences and the lse strides of the layout record
// (those of D = rowsum(dO ∘ O) too, lse's layout); no cache and no split, as constants.
#define CUFLASH_VARLEN_PARAMS                                                              \
    const int *cu_seqlens_q, const int *cu_seqlens_k, cuflash::SeqLayout layout
#define CUFLASH_VARLEN                                                                     \
    cuflash::Seqlens {                                                                     \
        cu_seqlens_q, cu_seqlens_k, nullptr, nullptr, 0, 0, layout.lse_sb, layout.lse_sh,  \
            0, 1                                                                           \
    }
