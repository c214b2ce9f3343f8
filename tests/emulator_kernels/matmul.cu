// Tiled matrix multiply C = A @ B (row-major, float or double), TILE x TILE threads per block.
#include "emu_test_helpers.cuh"

template <typename T, int TILE>
__global__ void matmul(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    __shared__ T As[TILE][TILE];
    __shared__ T Bs[TILE][TILE + 1];
    const int row = blockIdx.y * TILE + threadIdx.y;
    const int col = blockIdx.x * TILE + threadIdx.x;
    T acc = T(0);
    for (int k0 = 0; k0 < K; k0 += TILE) {
        As[threadIdx.y][threadIdx.x] = load_or_zero(A, row, k0 + threadIdx.x, M, K);
        Bs[threadIdx.y][threadIdx.x] = load_or_zero(B, k0 + threadIdx.y, col, K, N);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; ++k) acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) C[(long)row * N + col] = acc;
}
