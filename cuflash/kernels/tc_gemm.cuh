// tc_gemm.cuh — the two products of every tensor-core kernel, on either instruction set.
//
// Each warp owns 16 rows of its block, or 32 (two row tiles) in the 16-bit forward (Q_i in
// the forward and the dQ kernel, K_j and V_j in the dK/dV kernel) and streams the other
// operands in tiles; every product is one of two shapes:
//   gemm_own_rows   c += own · rowsᵀ       the warp's own rows (A) times a tile's rows (B):
//                                          S = Q_i K_jᵀ, dP = dO_i V_jᵀ, Sᵀ = K_j Q_iᵀ, …
//   gemm_c_tile     acc += c · tile        C fragments as A times a tile (B transposed):
//                                          P̃ V_j, dS K_j, Pᵀ dO_i, dSᵀ Q_i
// For f16/bf16 (kTf32 false) they are tc_tile.cuh's gemm_qk_tc / gemm_pv_tc (ldmatrix,
// ldmatrix.trans, m16n8k16 or 2 x m16n8k8); for float32 tf32_tile.cuh's gemm_qk_tf32 /
// gemm_pv_tf32 (32-bit shared loads, m16n8k8 .tf32, split or one-pass: kSplit), where a C
// fragment becomes an A fragment with its k index permuted. The kernels are written once
// against these and the traits' shared names (kQInRegs, kQFrags, kSTiles, kPVSteps,
// kOTiles, OwnFrag, kTf32, kSplit).
#pragma once

#include "mma.cuh"
#include "tc_tile.cuh"
#include "tf32_tile.cuh"

namespace cuflash {

// The own operands' A fragments before the mma: 16-bit pairs as ldmatrix gives them, or
// float32 values, rounded (split) to tf32 at each mma.
template <typename T> struct OwnFragment { using type = FragA; };
template <> struct OwnFragment<float> { using type = Tf32A; };

// The own operands' A fragments into registers, once per block (when kQInRegs), for the
// warp's R row tiles (R = 2: the 16-bit forward's 32-row warps; float32 has R = 1).
template <class Tr, int R, typename T>
__device__ __forceinline__ void load_own_fragments(typename Tr::OwnFrag (&f)[R][Tr::kQFrags],
                                                   const T* sOwn, int warp_row0, int lane) {
    if constexpr (Tr::kTf32) {
        static_assert(R == 1, "the float32 products run one row tile per warp");
        load_q_fragments_tf32<Tr>(f[0], sOwn, warp_row0, lane >> 2, lane % 4);
    } else {
        load_q_fragments<Tr>(f, sOwn, warp_row0, lane);
    }
}

// c += own · rowsᵀ: the warp's R·16 own rows (A: f, or sOwn) times the streamed tile's rows.
template <class Tr, int R, typename T>
__device__ __forceinline__ void gemm_own_rows(FragC (&c)[R][Tr::kSTiles],
                                              const typename Tr::OwnFrag (&f)[R][Tr::kQFrags],
                                              const T* sOwn, int warp_row0, const T* sRows,
                                              int lane) {
    if constexpr (Tr::kTf32) {
        static_assert(R == 1, "the float32 products run one row tile per warp");
        gemm_qk_tf32<Tr, Tr::kSplit>(c[0], f[0], sOwn, warp_row0, sRows, lane >> 2, lane % 4);
    } else {
        gemm_qk_tc<Tr>(c, f, sOwn, warp_row0, sRows, lane);
    }
}

// acc += c · tile[:, col0 : col0 + kOTiles·8]: C fragments (P̃, dS or their transposes) as
// A fragments times the streamed tile, for R row tiles. A head-dim chunk starts on a whole
// swizzle period (8 chunks of 16 bytes), so its columns are the tile's at sTile + col0:
// one pointer, rather than col0 in every fragment's address (which ptxas hoisted out of
// the loop, one register each).
template <class Tr, int R, typename T>
__device__ __forceinline__ void gemm_c_tile(FragC (&acc)[R][Tr::kOTiles], const FragC (&c)[R][Tr::kSTiles],
                                            const T* sTile, int lane, int col0 = 0) {
    if constexpr (Tr::kTf32) {
        static_assert(R == 1, "the float32 products run one row tile per warp");
        gemm_pv_tf32<Tr, Tr::kSplit>(acc[0], c[0], sTile + col0, lane >> 2, lane % 4);
    } else {
        gemm_pv_tc<Tr>(acc, c, sTile + col0, lane);
    }
}

// The same for one row tile's fragment arrays (the backward's 16-row warps): viewed as
// arrays of one row tile.
template <typename F, int N>
__device__ __forceinline__ F (&one_row_tile(F (&x)[N]))[1][N] {
    return reinterpret_cast<F (&)[1][N]>(x);
}

template <class Tr, typename T>
__device__ __forceinline__ void load_own_fragments(typename Tr::OwnFrag (&f)[Tr::kQFrags],
                                                   const T* sOwn, int warp_row0, int lane) {
    load_own_fragments<Tr>(one_row_tile(f), sOwn, warp_row0, lane);
}

template <class Tr, typename T>
__device__ __forceinline__ void gemm_own_rows(FragC (&c)[Tr::kSTiles],
                                              const typename Tr::OwnFrag (&f)[Tr::kQFrags],
                                              const T* sOwn, int warp_row0, const T* sRows,
                                              int lane) {
    gemm_own_rows<Tr>(one_row_tile(c), one_row_tile(f), sOwn, warp_row0, sRows, lane);
}

template <class Tr, typename T>
__device__ __forceinline__ void gemm_c_tile(FragC (&acc)[Tr::kOTiles], const FragC (&c)[Tr::kSTiles],
                                            const T* sTile, int lane, int col0 = 0) {
    gemm_c_tile<Tr>(one_row_tile(acc), one_row_tile(c), sTile, lane, col0);
}

// Two neighbouring columns (x, y) of a thread's C fragment into a shared tile of T, at p.
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float x, float y) {
    if constexpr (sizeof(T) == 4) *reinterpret_cast<float2*>(p) = make_float2(x, y);
    else *reinterpret_cast<unsigned*>(p) = pack2<T>(x, y);
}

}  // namespace cuflash
