// Gated DeltaNet: the causal conv, the gates, and the delta rule's recurrent form (the chunked form is
// delta_chunked.cu). Each in the CPU's order of operations per output element, so decode agrees with
// the CPU to the bit.

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

// The recurrent rule holds a head's state on chip: a block of 32 threads owns 32 columns of one value
// head's `[dk, dv]` state (a thread its column `j`, as the CPU's loop over `j`), read into shared memory
// once, advanced through every token of the launch, and written back once — where the state was read
// three times and written twice per token from global memory. 32 KB of shared memory at `dk` 256
// (`DELTA_DK_MAX`, common.cuh).

// Column `j` (`< dv`) of a head's state `s [dk, dv]` into / out of this thread's slab column (stride 32).
__device__ __forceinline__ void slab_load(float* col, const float* s, unsigned j, unsigned dk, unsigned dv) {
    for (unsigned i = 0; i < dk; ++i) col[i * DELTA_COLS] = s[(size_t)i * dv + j];
}
__device__ __forceinline__ void slab_store(const float* col, float* s, unsigned j, unsigned dk, unsigned dv) {
    for (unsigned i = 0; i < dk; ++i) s[(size_t)i * dv + j] = col[i * DELTA_COLS];
}

// Row `t`'s state: `states` itself, or with `table` the address at `states[t]`.
__device__ __forceinline__ float* state_of(void* states, unsigned table, unsigned t) {
    return table ? (float*)((const uint64_t*)states)[t] : (float*)states;
}

// One token on one state column (`col`, stride 32): decay, the delta against the state's prediction, the
// update and the output, in the CPU's order of operations (`gated_delta_recurrent`) → the output.
__device__ __forceinline__ float delta_slab_token(float* col, const float* qt, const float* kt, float v, float g,
                                                  float beta, unsigned dk) {
    const float decay = expf(g);
    for (unsigned i = 0; i < dk; ++i) col[i * DELTA_COLS] *= decay;
    float delta = v;
    for (unsigned i = 0; i < dk; ++i) delta -= col[i * DELTA_COLS] * kt[i];
    delta *= beta;
    float o = 0.0f;
    for (unsigned i = 0; i < dk; ++i) {
        col[i * DELTA_COLS] += kt[i] * delta;
        o += col[i * DELTA_COLS] * qt[i];
    }
    return o;
}

// The gated delta rule, recurrent form, on prepared inputs (`q`, `k [·, nk, dk]` normalised, `v [·, nv,
// dv]`, `g`, `beta [·, nv]`): with `table` 0, the `n` tokens in order on the one state `states [nv, dk,
// dv]` (a verify segment, or any caller's recurrent call); with `table` 1, `states` is a table of
// addresses and token `blockIdx.y` advances the state at `states[blockIdx.y]` (a decode step of `n`
// sequences). Block `x`: value head `x / ⌈dv/32⌉`, its
// columns from `32·(x mod ⌈dv/32⌉)`; 32 threads. `out [n, nv·dv]`.
// flops: fp32 7 * dk * dv * nv * n
// ptx: ex2.approx.ftz.f32, ld.shared.f32
// budget: 40 registers
extern "C" __global__ void gated_delta_slab(const float* __restrict__ q, const float* __restrict__ k,
                                            const float* __restrict__ v, const float* __restrict__ g,
                                            const float* __restrict__ beta, void* __restrict__ states, unsigned table,
                                            float* __restrict__ out, unsigned n, unsigned nk, unsigned nv, unsigned dk,
                                            unsigned dv) {
    SHARED(float, slab, [DELTA_DK_MAX * DELTA_COLS]);
    const unsigned groups = (dv + DELTA_COLS - 1) / DELTA_COLS;
    const unsigned h = blockIdx.x / groups, kh = h / (nv / nk), j = (blockIdx.x % groups) * DELTA_COLS + threadIdx.x;
    const unsigned t0 = table ? blockIdx.y : 0, t1 = table ? blockIdx.y + 1 : n;
    if (j >= dv || t0 >= n) return;  // the thread's column alone: no barrier below
    float* s = state_of(states, table, t0) + (size_t)h * dk * dv;
    float* col = slab + threadIdx.x;
    slab_load(col, s, j, dk, dv);
    for (unsigned t = t0; t < t1; ++t) {
        const float* qt = q + ((size_t)t * nk + kh) * dk;
        const float* kt = k + ((size_t)t * nk + kh) * dk;
        const size_t gi = (size_t)t * nv + h;
        out[gi * dv + j] = delta_slab_token(col, qt, kt, v[gi * dv + j], g[gi], beta[gi], dk);
    }
    slab_store(col, s, j, dk, dv);
}

// A decode step from the conv's output, fused: for token `blockIdx.y` (row `row0 + y` of `a`, `b`), its
// `conv` row split into q | k | v, q and k L2-normalised (`eps` 1e-6, the sum of squares in the CPU's
// order), q scaled by `q_scale`, the gates β = sigmoid(b), g = neg_a · softplus(a + dt_bias), and the
// recurrent rule on the state of row `y` (`states` as `gated_delta_slab`'s) — the CPU's split, `l2_norm`, `scale`,
// `delta_gates` and `gated_delta` in one launch instead of six. Blocks as `gated_delta_slab`'s.
// flops: fp32 (7 * dk * 32 + 4 * dk) * blocks
// ptx: ex2.approx.ftz.f32, ld.shared.f32, bar.sync
// budget: 48 registers
extern "C" __global__ void gated_delta_step(const float* __restrict__ conv, const float* __restrict__ a,
                                            const float* __restrict__ b, unsigned row0, const float* __restrict__ neg_a,
                                            const float* __restrict__ dt_bias, float q_scale, void* __restrict__ states,
                                            unsigned table, float* __restrict__ out, unsigned nk, unsigned nv,
                                            unsigned dk, unsigned dv) {
    SHARED(float, slab, [DELTA_DK_MAX * DELTA_COLS]);
    SHARED(float, qk, [2 * DELTA_DK_MAX]);
    const unsigned groups = (dv + DELTA_COLS - 1) / DELTA_COLS;
    const unsigned h = blockIdx.x / groups, kh = h / (nv / nk), j = (blockIdx.x % groups) * DELTA_COLS + threadIdx.x;
    const unsigned t = blockIdx.y, kd = nk * dk;
    const float* row = conv + (size_t)t * (2 * kd + nv * dv);
    const float *qr = row + (size_t)kh * dk, *kr = row + kd + (size_t)kh * dk;
    // Every thread sums the squares itself, in order (a serial sum is the CPU's; a tree is not).
    float sq = 0.0f, sk = 0.0f;
    for (unsigned i = 0; i < dk; ++i) {
        sq += qr[i] * qr[i];
        sk += kr[i] * kr[i];
    }
    const float rq = 1.0f / sqrtf(sq + 1e-6f), rk = 1.0f / sqrtf(sk + 1e-6f);
    for (unsigned i = threadIdx.x; i < dk; i += blockDim.x) {
        qk[i] = qr[i] * rq * q_scale;
        qk[dk + i] = kr[i] * rk;
    }
    __syncthreads();
    if (j >= dv) return;
    const size_t gi = (size_t)(row0 + t) * nv + h;
    const float beta = sigmoid_f(b[gi]), x = a[gi] + dt_bias[h];
    const float g = neg_a[h] * (x > 20.0f ? x : log1pf(expf(x)));
    float* s = state_of(states, table, t) + (size_t)h * dk * dv;
    float* col = slab + threadIdx.x;
    slab_load(col, s, j, dk, dv);
    out[((size_t)t * nv + h) * dv + j] = delta_slab_token(col, qk, qk + dk, row[2 * kd + (size_t)h * dv + j], g, beta, dk);
    slab_store(col, s, j, dk, dv);
}
