// Reverse each block's chunk through dynamic shared memory (two views of one extern buffer).
extern "C" __global__ void reverse_chunks(const float* __restrict__ x, float* __restrict__ y, int n) {
    extern __shared__ float buf[];
    const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    if (base + t < n) buf[t] = x[base + t];
    __syncthreads();
    const int m = min((int)blockDim.x, n - base);
    if (t < m) y[base + t] = buf[m - 1 - t];
}
