// A launch that runs as long as asked: every block passes `steps` rounds of a value around its
// threads through shared memory, two barriers per round. Each thread ends with out = steps.
extern "C" __global__ void spin(float* out, int steps) {
    __shared__ float ring[64];
    float v = 0.0f;
    for (int s = 0; s < steps; ++s) {
        ring[threadIdx.x] = v + 1.0f;
        __syncthreads();
        v = ring[(threadIdx.x + 1) % blockDim.x];
        __syncthreads();
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}
