// Helpers every kernel may use, compiled by NVRTC (after prelude_gpu.cuh) and by the host compiler
// (after emu/cuda_emu.hpp). Conversions are bit operations so that both agree to the bit.

#define INFINITY_F __uint_as_float(0x7f800000u)

// bf16 bits → f32 (exact).
__device__ __forceinline__ float bf16_to_f32(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }

// f32 → bf16 bits, rounded to nearest even (NaN stays a quiet NaN), as the CPU backend rounds.
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// f16 bits → f32 (exact, subnormals included).
__device__ __forceinline__ float f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)(h & 0x8000u)) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        float v = (float)man * 5.9604644775390625e-8f;  // man · 2^-24
        return sign ? -v : v;
    }
    if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// e4m3 (FN: no infinities, 0x7f/0xff NaN) → f32.
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) {
    uint32_t sign = b & 0x80u, exp = (b >> 3) & 0xfu, man = b & 0x7u;
    float v;
    if (exp == 0) v = (float)man * 0.001953125f;  // man/8 · 2^-6
    else if (exp == 15 && man == 7) v = __uint_as_float(0x7fc00000u);
    else v = __uint_as_float(((exp + 120u) << 23) | (man << 20));
    return sign ? -v : v;
}

// e2m1 code (low 4 bits) → f32: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
__device__ __forceinline__ float e2m1_to_f32(uint32_t c) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[c & 7u];
    return (c & 8u) ? -v : v;
}

__device__ __forceinline__ unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum over the 32 lanes of a warp (every lane gets it).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of `blockDim.x` threads (a multiple of 32, at most 1024); every thread gets it.
// `scratch` is 32 floats of shared memory; the trailing barrier lets the caller reuse it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}


// Maximum over a block of `blockDim.x` threads (a multiple of 32); every thread gets it.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : -INFINITY_F;
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    __syncthreads();
    return t;
}

// Element `d` of KV head `kvh` of pool row `prow` (f32 or bf16 pool).
__device__ __forceinline__ float pool_at(const void* pool, int bf16, size_t prow, unsigned kv_row, unsigned kvh,
                                         unsigned head_dim, unsigned d) {
    const size_t i = prow * kv_row + (size_t)kvh * head_dim + d;
    return bf16 ? bf16_to_f32(((const uint16_t*)pool)[i]) : ((const float*)pool)[i];
}

// Pool row of position `pos`'s K row (`v` false) or V row (`v` true) in a sequence's paged KV: page `p`
// keeps its K rows at `p·2·page_size ..`, its V rows `page_size` further.
__device__ __forceinline__ size_t paged_row(const int32_t* table, unsigned page_size, unsigned pos, bool v) {
    return (size_t)table[pos / page_size] * 2 * page_size + (v ? page_size : 0) + pos % page_size;
}

// `q · K[pos]` for one query head against KV head `kvh` of the paged pool.
__device__ __forceinline__ float paged_dot(const float* qv, const void* pool, int bf16, const int32_t* table,
                                           unsigned page_size, unsigned pos, unsigned kv_row, unsigned kvh,
                                           unsigned head_dim) {
    const size_t krow = paged_row(table, page_size, pos, false);
    float dot = 0.0f;
    for (unsigned d = 0; d < head_dim; ++d) dot += qv[d] * pool_at(pool, bf16, krow, kv_row, kvh, head_dim, d);
    return dot;
}

// Softmax over the scores in `s[0..len)` (scaled already) in place; returns the sum of exponentials.
__device__ __forceinline__ float softmax_row(float* s, unsigned len, float* red) {
    float mx = -INFINITY_F;
    for (unsigned j = threadIdx.x; j < len; j += blockDim.x) mx = fmaxf(mx, s[j]);
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (unsigned j = threadIdx.x; j < len; j += blockDim.x) {
        const float e = expf(s[j] - mx);
        s[j] = e;
        sum += e;
    }
    sum = block_sum(sum, red);  // its barriers also publish every s[j]
    return sum;
}
