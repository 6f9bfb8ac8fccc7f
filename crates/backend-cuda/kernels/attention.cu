// Attention, parity-first: one block per (query row, head); scores of every visible position into a
// scratch row, a block-wide max and sum, then each thread one output dimension over the positions.
// GQA: head h reads KV head h / (heads / kv_heads). The flash-style tiled versions come later.

// Causal attention of `n` query rows starting at `row0` (tokens `past..past + n` of one sequence) over
// its paged K/V (`paged_row`). `scratch` holds `n · heads · stride` floats.
// flops: fp32 4 * head_dim * heads * ((blocks / heads) * past + (blocks / heads) * (blocks / heads + 1) / 2)
// ptx: bar.sync, shfl.sync.bfly.b32, ex2.approx.ftz.f32
// budget: 48 registers
extern "C" __global__ void attention_paged(const float* __restrict__ q, float* __restrict__ out, const void* __restrict__ pool,
                                           int pool_bf16, const int32_t* __restrict__ table, unsigned page_size,
                                           unsigned row0, unsigned past, unsigned heads, unsigned kv_heads,
                                           unsigned head_dim, float scale, float* __restrict__ scratch, unsigned stride) {
    SHARED(float, red, [32]);
    const unsigned i = blockIdx.x / heads, h = blockIdx.x % heads;
    const unsigned kvh = h / (heads / kv_heads), kv_row = kv_heads * head_dim, qcols = heads * head_dim;
    const unsigned len = past + i + 1;
    const float* qv = q + (size_t)(row0 + i) * qcols + (size_t)h * head_dim;
    float* s = scratch + (size_t)blockIdx.x * stride;
    for (unsigned j = threadIdx.x; j < len; j += blockDim.x)
        s[j] = paged_dot(qv, pool, pool_bf16, table, page_size, j, kv_row, kvh, head_dim) * scale;
    const float sum = softmax_row(s, len, red);
    float* o = out + (size_t)(row0 + i) * qcols + (size_t)h * head_dim;
    for (unsigned d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (unsigned j = 0; j < len; ++j) {
            acc += s[j] * pool_at(pool, pool_bf16, paged_row(table, page_size, j, true), kv_row, kvh, head_dim, d);
        }
        o[d] = acc / sum;
    }
}

// Bidirectional attention over rows `row0 .. row0 + n` of `q`, `k`, `v` (one image or frame group):
// every row sees all `n`.
// flops: fp32 4 * head_dim * n * blocks
// ptx: bar.sync, shfl.sync.bfly.b32, ex2.approx.ftz.f32
// budget: 48 registers
extern "C" __global__ void attention_full(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                                         float* __restrict__ out, unsigned row0, unsigned n, unsigned q0, unsigned heads,
                                         unsigned kv_heads, unsigned head_dim, float scale, float* __restrict__ scratch) {
    SHARED(float, red, [32]);
    // Query rows `q0 + blockIdx.x / heads` of the sequence (a launch covers a band of them, so the scratch
    // is bounded by the band, not the sequence), each over all `n` keys.
    const unsigned i = q0 + blockIdx.x / heads, h = blockIdx.x % heads;
    const unsigned kvh = h / (heads / kv_heads), kv_row = kv_heads * head_dim, qcols = heads * head_dim;
    const float* qv = q + (size_t)(row0 + i) * qcols + (size_t)h * head_dim;
    float* s = scratch + (size_t)blockIdx.x * n;
    for (unsigned j = threadIdx.x; j < n; j += blockDim.x) {
        const float* kr = k + (size_t)(row0 + j) * kv_row + (size_t)kvh * head_dim;
        float dot = 0.0f;
        for (unsigned d = 0; d < head_dim; ++d) dot += qv[d] * kr[d];
        s[j] = dot * scale;
    }
    const float sum = softmax_row(s, n, red);
    float* o = out + (size_t)(row0 + i) * qcols + (size_t)h * head_dim;
    for (unsigned d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (unsigned j = 0; j < n; ++j) acc += s[j] * v[(size_t)(row0 + j) * kv_row + (size_t)kvh * head_dim + d];
        o[d] = acc / sum;
    }
}
