// Norms: one block per group of `group` elements (a row, or a head), a block-wide sum of squares.

// RMSNorm of each group: `x̂ · w` or `x̂ · (1 + w)`; `w[c % w_len]` for column `c` of a row of `cols`
// (w one group long: per-head weights; w one row long: `qwen4_exp`'s grouped norm). With `z`: the
// gated forms, `· silu(z)` (`gate` 1) or `· sigmoid(z)` (`gate` 2).
// flops: fp32 4 * cols * blocks
// ptx: bar.sync, shfl.sync.bfly.b32
// budget: 40 registers
extern "C" __global__ void rms_norm_f32(float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ z,
                                        unsigned cols, unsigned group, unsigned w_len, float eps, int one_plus, int gate) {
    SHARED(float, scratch, [32]);
    float* g = x + (size_t)blockIdx.x * group;
    float ss = 0.0f;
    for (unsigned j = threadIdx.x; j < group; j += blockDim.x) ss += g[j] * g[j];
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)group + eps);
    const size_t base = (size_t)blockIdx.x * group;
    for (unsigned j = threadIdx.x; j < group; j += blockDim.x) {
        const float wi = w[(unsigned)((base + j) % cols) % w_len];
        const float v = g[j] * r;
        if (gate == 0) g[j] = one_plus ? v * (1.0f + wi) : v * wi;
        else if (gate == 1) g[j] = (wi * v) * silu_f(z[base + j]);
        else g[j] = (wi * v) * sigmoid_f(z[base + j]);
    }
}

// `x += y` over each row of `cols`, then the row's RMSNorm into `out` (`x̂ · w` or `x̂ · (1 + w)`):
// `add_f32` and `rms_norm_f32` (a group of one row) in one launch with the same arithmetic — each sum,
// then the block's sum of squares in the same order — so the same bits, a launch and a copy fewer.
// flops: fp32 5 * cols * blocks
// ptx: bar.sync, shfl.sync.bfly.b32
// budget: 40 registers
extern "C" __global__ void add_rms_norm_f32(float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                                            float* __restrict__ out, unsigned cols, float eps, int one_plus) {
    SHARED(float, scratch, [32]);
    const size_t base = (size_t)blockIdx.x * cols;
    float ss = 0.0f;
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = x[base + j] + y[base + j];
        x[base + j] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)cols + eps);
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = x[base + j] * r, wi = w[j];
        out[base + j] = one_plus ? v * (1.0f + wi) : v * wi;
    }
}

// L2 normalisation of each group: `x / sqrt(Σx² + eps)`.
// flops: fp32 3 * group * blocks
// ptx: bar.sync, shfl.sync.bfly.b32
// budget: 32 registers
extern "C" __global__ void l2_norm_f32(float* __restrict__ x, unsigned group, float eps) {
    SHARED(float, scratch, [32]);
    float* g = x + (size_t)blockIdx.x * group;
    float ss = 0.0f;
    for (unsigned j = threadIdx.x; j < group; j += blockDim.x) ss += g[j] * g[j];
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss + eps);
    for (unsigned j = threadIdx.x; j < group; j += blockDim.x) g[j] *= r;
}

// LayerNorm of each row: `(x − mean) / sqrt(var + eps) · w + b`.
// flops: fp32 6 * cols * blocks
// ptx: bar.sync, shfl.sync.bfly.b32
// budget: 40 registers
extern "C" __global__ void layer_norm_f32(float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                                          unsigned cols, float eps) {
    SHARED(float, scratch, [32]);
    float* g = x + (size_t)blockIdx.x * cols;
    float s = 0.0f;
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) s += g[j];
    const float mean = block_sum(s, scratch) / (float)cols;
    float v = 0.0f;
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) v += (g[j] - mean) * (g[j] - mean);
    const float r = 1.0f / sqrtf(block_sum(v, scratch) / (float)cols + eps);
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) g[j] = (g[j] - mean) * r * w[j] + b[j];
}
