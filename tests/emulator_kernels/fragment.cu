// An 8x8 tile C held by one warp in the mma.m16n8k8 accumulator layout (PTX ISA, "Matrix
// Fragments for mma.m16n8k8", rows 0-7): lane holds C[g][2t] and C[g][2t+1], g = lane >> 2,
// t = lane % 4. The warp transposes C through shared memory: each lane stores its fragment at
// (FRAG_ROW(lane), 2t), then reads Cᵀ's fragment back. A wrong FRAG_ROW is a wrong layout.
#ifndef FRAG_ROW
#define FRAG_ROW(lane) ((lane) >> 2)
#endif

extern "C" __global__ void fragment_transpose(const float* c, float* ct) {
    __shared__ float tile[8][8];
    const int lane = threadIdx.x;
    const int g = lane >> 2, t = lane % 4;
    const float c0 = c[g * 8 + 2 * t], c1 = c[g * 8 + 2 * t + 1];
    tile[FRAG_ROW(lane)][2 * t] = c0;  // the fragment's store
    tile[FRAG_ROW(lane)][2 * t + 1] = c1;
    __syncwarp();
    // Cᵀ[g][2t] = C[2t][g]
    ct[g * 8 + 2 * t] = tile[2 * t][g];
    ct[g * 8 + 2 * t + 1] = tile[2 * t + 1][g];
}
