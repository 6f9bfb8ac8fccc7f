// NeoX rotation of every `head_dim`-wide head of each row with that row's tables (`half` cosines and
// sines): dims `f` and `f + half` rotate together, dims from `2·half` on pass through. Serves both
// (m)RoPE (tables from the positions' sections) and the vision tower's 2-D rotary.

// flops: fp32 6 * rows * (cols / head_dim) * half
// ptx: ld.global.nc.f32
// budget: 40 registers
extern "C" __global__ void rotate_half_f32(float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                           unsigned rows, unsigned cols, unsigned head_dim, unsigned half) {
    const unsigned heads = cols / head_dim;
    const size_t total = (size_t)rows * heads * half;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / ((size_t)heads * half);
        const unsigned h = (unsigned)((i / half) % heads), f = (unsigned)(i % half);
        float* head = x + r * cols + (size_t)h * head_dim;
        const float c = cos_t[r * half + f], s = sin_t[r * half + f];
        const float a = head[f], b = head[f + half];
        head[f] = a * c - b * s;
        head[f + half] = b * c + a * s;
    }
}

// Per-head RMSNorm then NeoX rotation of one head, `src` → the block's shared `hs` (`head_dim` floats)
// and from there to `dst` (f32, or bf16 rounded as `f32_to_bf16_rows` rounds, where `dst16`): the norm is
// `rms_norm_f32`'s arithmetic for a group of one head (each thread's sum of squares over `j +=
// blockDim.x`, then `block_sum`, launched with the same threads), the rotation `rotate_half_f32`'s, so
// the bits of those two launches and the copy.
__device__ __forceinline__ void norm_rotate_head(const float* src, float* dst, uint16_t* dst16, float* hs, const float* w,
                                                 float eps, int one_plus, const float* cos_r, const float* sin_r,
                                                 unsigned head_dim, unsigned half, float* scratch) {
    float ss = 0.0f;
    for (unsigned j = threadIdx.x; j < head_dim; j += blockDim.x) ss += src[j] * src[j];
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)head_dim + eps);
    for (unsigned j = threadIdx.x; j < head_dim; j += blockDim.x) {
        const float v = src[j] * r, wi = w[j];
        hs[j] = one_plus ? v * (1.0f + wi) : v * wi;
    }
    __syncthreads();
    for (unsigned j = threadIdx.x; j < head_dim; j += blockDim.x) {
        float o = hs[j];
        if (j < half) o = hs[j] * cos_r[j] - hs[j + half] * sin_r[j];
        else if (j < 2 * half) o = hs[j] * cos_r[j - half] + hs[j - half] * sin_r[j - half];
        if (dst16) dst16[j] = f32_to_bf16(o);
        else dst[j] = o;
    }
}

// `rms_norm_f32` (a group of one head, `x̂ · w` or `x̂ · (1 + w)`) then `rotate_half_f32` with each row's
// tables, in place: block `blockIdx.x` is head `blockIdx.x % heads` of row `blockIdx.x / heads`.
// flops: fp32 10 * head_dim * blocks
// ptx: bar.sync, shfl.sync.bfly.b32
// budget: 40 registers
extern "C" __global__ void rms_norm_rope_f32(float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ cos_t,
                                             const float* __restrict__ sin_t, unsigned heads, unsigned head_dim,
                                             unsigned half, float eps, int one_plus) {
    SHARED(float, scratch, [32]);
    SHARED(float, hs, [256]);
    const unsigned row = blockIdx.x / heads;
    float* head = x + (size_t)blockIdx.x * head_dim;
    // Every thread has read its elements (the sum of squares) before any is written back.
    norm_rotate_head(head, head, nullptr, hs, w, eps, one_plus, cos_t + (size_t)row * half, sin_t + (size_t)row * half,
                     head_dim, half, scratch);
}

// A step's new K and V rows into a layer's paged pool, for every sequence of the step at once: entry `e`
// of `slots` is a pair (row of `k` and `v`, pool row of its K; its V is `page_size` rows further), block
// `blockIdx.x` is KV head `blockIdx.x % kv_heads` of entry `blockIdx.x / kv_heads`. K is normed per head
// and rotated on the way (`rms_norm_rope_f32`'s bits, RoPE fused into the write), V copied; an f32 or a
// bf16 pool (`pool_bf16`: rounded as `write_rows` rounds).
// flops: fp32 10 * head_dim * blocks
// ptx: bar.sync, shfl.sync.bfly.b32
// budget: 48 registers
extern "C" __global__ void kv_write_rope(const float* __restrict__ k, const float* __restrict__ v, void* __restrict__ pool,
                                         int pool_bf16, const uint32_t* __restrict__ slots, unsigned page_size,
                                         unsigned kv_heads, unsigned head_dim, const float* __restrict__ w,
                                         const float* __restrict__ cos_t, const float* __restrict__ sin_t, unsigned half,
                                         float eps, int one_plus) {
    SHARED(float, scratch, [32]);
    SHARED(float, hs, [256]);
    const unsigned e = blockIdx.x / kv_heads, h = blockIdx.x % kv_heads, kv_row = kv_heads * head_dim;
    const unsigned src = slots[2 * e], krow = slots[2 * e + 1];
    const size_t at = (size_t)src * kv_row + (size_t)h * head_dim;
    const size_t kout = (size_t)krow * kv_row + (size_t)h * head_dim, vout = kout + (size_t)page_size * kv_row;
    float* pf = pool_bf16 ? nullptr : (float*)pool;
    uint16_t* pb = pool_bf16 ? (uint16_t*)pool : nullptr;
    norm_rotate_head(k + at, pf ? pf + kout : nullptr, pb ? pb + kout : nullptr, hs, w, eps, one_plus,
                     cos_t + (size_t)src * half, sin_t + (size_t)src * half, head_dim, half, scratch);
    for (unsigned j = threadIdx.x; j < head_dim; j += blockDim.x) {
        if (pb) pb[vout + j] = f32_to_bf16(v[at + j]);
        else pf[vout + j] = v[at + j];
    }
}
