// Routed experts: the outputs of one expert's tokens into their entries of `partials`, and the
// per-token sum of the entries in ascending expert order.

// `partials[entries[i]] = d[i] · weights[entries[i]]` for `n` rows of `h`.
// flops: fp32 n * h
// ptx: ld.global.nc.f32
// budget: 32 registers
extern "C" __global__ void moe_scatter_rows(float* __restrict__ partials, const int32_t* __restrict__ entries,
                                            const float* __restrict__ weights, const float* __restrict__ d,
                                            unsigned n, unsigned h) {
    for (size_t x = blockIdx.x * (size_t)blockDim.x + threadIdx.x; x < (size_t)n * h; x += (size_t)gridDim.x * blockDim.x) {
        const size_t i = x / h, c = x % h;
        const int32_t en = entries[i];
        partials[(size_t)en * h + c] = d[x] * weights[en];
    }
}

// `out[t] = 0 + partials[t·k] + … + partials[t·k + k − 1]`, in that order.
// flops: fp32 t * k * h
// ptx: ld.global.nc.f32
// budget: 40 registers
extern "C" __global__ void moe_combine(const float* __restrict__ partials, float* __restrict__ out, unsigned t, unsigned k,
                                       unsigned h) {
    for (size_t x = blockIdx.x * (size_t)blockDim.x + threadIdx.x; x < (size_t)t * h; x += (size_t)gridDim.x * blockDim.x) {
        const size_t i = x / h, c = x % h;
        float acc = 0.0f;
        for (unsigned j = 0; j < k; ++j) acc += partials[((size_t)i * k + j) * h + c];
        out[x] = acc;
    }
}
