// Gated DeltaNet: the causal conv, the gates, and the delta rule. Each in the CPU's order of
// operations per output element, so decode (the recurrent form) agrees with the CPU to the bit.

// Depthwise causal conv (`w [c, kernel]`) then silu over `n` rows from `row0` of `x`, from and
// advancing `state` (the last `kernel − 1` inputs, `[kernel − 1, c]`). One thread per channel.
// flops: fp32 2 * kernel * n * c + 4 * n * c
// ptx: ex2.approx.ftz.f32
// budget: 40 registers
extern "C" __global__ void causal_conv_silu(const float* __restrict__ x, unsigned row0, unsigned n, unsigned c,
                                            const float* __restrict__ w, unsigned kernel, float* __restrict__ state,
                                            float* __restrict__ out) {
    const unsigned hist = kernel - 1;
    for (unsigned ch = blockIdx.x * blockDim.x + threadIdx.x; ch < c; ch += gridDim.x * blockDim.x) {
        // Row r of [state; x].
#define PADDED(r) ((r) < hist ? state[(size_t)(r) * c + ch] : x[(size_t)(row0 + (r) - hist) * c + ch])
        for (unsigned t = 0; t < n; ++t) {
            float o = 0.0f;
            for (unsigned j = 0; j < kernel; ++j) o += w[(size_t)ch * kernel + j] * PADDED(t + j);
            out[(size_t)t * c + ch] = silu_f(o);
        }
        // The new state: the last `hist` rows of [state; x] (kernels up to 8 wide).
        float next[8];
        for (unsigned r = 0; r < hist && r < 8; ++r) next[r] = PADDED(n + r);
        for (unsigned r = 0; r < hist && r < 8; ++r) state[(size_t)r * c + ch] = next[r];
#undef PADDED
    }
}

// One decode token for each of `n` sequences: row `i` of `x` continues the conv state at `states[i]`
// (`[kernel − 1, c]`), exactly as `causal_conv_silu` with `row0 = i`, `n = 1` computes it. One thread
// per (row, channel); 48 registers where the one-sequence kernel takes 40: the row's state address
// from the table and the row/channel split of the index.
// flops: fp32 2 * kernel * n * c + 4 * n * c
// ptx: ex2.approx.ftz.f32
// budget: 48 registers
extern "C" __global__ void causal_conv_silu_rows(const float* __restrict__ x, unsigned n, unsigned c,
                                                 const float* __restrict__ w, unsigned kernel,
                                                 const uint64_t* __restrict__ states, float* __restrict__ out) {
    const unsigned hist = kernel - 1;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n * c; i += gridDim.x * blockDim.x) {
        const unsigned row = i / c, ch = i % c;
        float* state = (float*)states[row];
#define PADDED(r) ((r) < hist ? state[(size_t)(r) * c + ch] : x[(size_t)(row + (r) - hist) * c + ch])
        float o = 0.0f;
        for (unsigned j = 0; j < kernel; ++j) o += w[(size_t)ch * kernel + j] * PADDED(j);
        out[(size_t)row * c + ch] = silu_f(o);
        float next[8];
        for (unsigned r = 0; r < hist && r < 8; ++r) next[r] = PADDED(1 + r);
        for (unsigned r = 0; r < hist && r < 8; ++r) state[(size_t)r * c + ch] = next[r];
#undef PADDED
    }
}

// β = sigmoid(b), g = neg_a · softplus(a + dt_bias) for `n` rows from `row0` of `[·, nv]` inputs.
// flops: fp32 8 * n * nv
// ptx: ex2.approx.ftz.f32
// budget: 32 registers
extern "C" __global__ void delta_gates(const float* __restrict__ a, const float* __restrict__ b, unsigned row0, unsigned n,
                                       unsigned nv, const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                       float* __restrict__ beta, float* __restrict__ g) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n * nv; i += gridDim.x * blockDim.x) {
        const unsigned h = i % nv;
        const size_t src = (size_t)row0 * nv + i;
        beta[i] = sigmoid_f(b[src]);
        const float x = a[src] + dt_bias[h];
        g[i] = neg_a[h] * (x > 20.0f ? x : log1pf(expf(x)));
    }
}

// Token `t` of head `h` (key head `kh`), state column `j` of `st` (the head's `[dk, dv]`): decay, the
// delta against the state's prediction, the update and the output, in the CPU's order of operations.
__device__ __forceinline__ void delta_token(const float* q, const float* k, const float* v, const float* g,
                                            const float* beta, float* st, float* out, unsigned t, unsigned h,
                                            unsigned kh, unsigned j, unsigned nk, unsigned nv, unsigned dk,
                                            unsigned dv) {
    const float* qt = q + ((size_t)t * nk + kh) * dk;
    const float* kt = k + ((size_t)t * nk + kh) * dk;
    const float decay = expf(g[(size_t)t * nv + h]);
    for (unsigned i = 0; i < dk; ++i) st[(size_t)i * dv + j] *= decay;
    float delta = v[((size_t)t * nv + h) * dv + j];
    for (unsigned i = 0; i < dk; ++i) delta -= st[(size_t)i * dv + j] * kt[i];
    delta *= beta[(size_t)t * nv + h];
    float o = 0.0f;
    for (unsigned i = 0; i < dk; ++i) {
        st[(size_t)i * dv + j] += kt[i] * delta;
        o += st[(size_t)i * dv + j] * qt[i];
    }
    out[((size_t)t * nv + h) * dv + j] = o;
}

// The gated delta rule token by token over `n` tokens, advancing `state [nv, dk, dv]`: one block per
// value head, one thread per state column `j` (columns are independent), `out [n, nv, dv]`.
// flops: fp32 7 * dk * dv * nv * n
// ptx: ex2.approx.ftz.f32
// budget: 40 registers
extern "C" __global__ void gated_delta_recurrent(const float* __restrict__ q, const float* __restrict__ k,
                                                 const float* __restrict__ v, const float* __restrict__ g,
                                                 const float* __restrict__ beta, float* __restrict__ state,
                                                 float* __restrict__ out, unsigned n, unsigned nk, unsigned nv,
                                                 unsigned dk, unsigned dv) {
    const unsigned h = blockIdx.x, kh = h / (nv / nk);
    float* st = state + (size_t)h * dk * dv;
    for (unsigned j = threadIdx.x; j < dv; j += blockDim.x) {
        for (unsigned t = 0; t < n; ++t) delta_token(q, k, v, g, beta, st, out, t, h, kh, j, nk, nv, dk, dv);
    }
}

// One decode token for each of `n` sequences (`blockIdx.y`): row `t` of the inputs advances the state at
// `states[t]`, exactly as `gated_delta_recurrent` over that row alone (`delta_token`).
// flops: fp32 7 * dk * dv * nv * n
// ptx: ex2.approx.ftz.f32
// budget: 40 registers
extern "C" __global__ void gated_delta_rows(const float* __restrict__ q, const float* __restrict__ k,
                                            const float* __restrict__ v, const float* __restrict__ g,
                                            const float* __restrict__ beta, const uint64_t* __restrict__ states,
                                            float* __restrict__ out, unsigned n, unsigned nk, unsigned nv, unsigned dk,
                                            unsigned dv) {
    const unsigned h = blockIdx.x, t = blockIdx.y, kh = h / (nv / nk);
    if (t >= n) return;  // the whole block
    float* st = (float*)states[t] + (size_t)h * dk * dv;
    for (unsigned j = threadIdx.x; j < dv; j += blockDim.x) delta_token(q, k, v, g, beta, st, out, t, h, kh, j, nk, nv, dk, dv);
}
