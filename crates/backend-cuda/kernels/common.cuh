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

// `2·e2m1` of the four codes in bits 0..15 of `codes` (column order: a code's nibble is its column) as
// four int8 in one word: the magnitude's three bits pick a byte of the positive and the negative table
// (`prmt` reads 3-bit selectors), the sign bit picks between the two.
__device__ __forceinline__ int e2m1x4_to_i8(uint32_t codes) {
    const uint32_t sel = codes & 0x7777u;
    const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, sel);  // 0, 1, 2, 3 | 4, 6, 8, 12
    const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);  // their negatives
    return (int)__byte_perm(pos, neg, 0x3210u | ((codes & 0x8888u) >> 1));
}

// Gated DeltaNet on chip (recurrent.cu, delta_chunked.cu): the largest key head dimension a block's
// shared state slab holds (Qwen3.5/3.6 and qwen4_exp use 128), and the state columns a block owns.
#define DELTA_DK_MAX 256u
#define DELTA_COLS 32u

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

// Tensor cores (sm_80+), after the PTX ISA's fragment layouts. A lane of a warp is group `g = lane / 4`,
// index `t = lane % 4` (blocks are one-dimensional, whole warps).
//
// `mma_s8_16816`: `mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32` with a zero accumulator. D (16×8
// s32) = A (16×16 s8, row-major) · B (16×8 s8, column-major). A lane holds `a0` = A[g][4t..4t+3],
// `a1` = A[g+8][4t..4t+3] and `b` = B[4t..4t+3][g] (4 bytes each, low byte first) and gets
// `d` = {D[g][2t], D[g][2t+1], D[g+8][2t], D[g+8][2t+1]}.
// `ldmatrix_x4`: `ldmatrix.sync.aligned.m8n8.x4.shared.b16`. Lane L gives the address of row L % 8 of
// matrix L / 8 (8 × 16 bytes each, rows 16-byte aligned); register j gets the 4 bytes at (lane % 4)·4 of
// row lane / 4 of matrix j.
// The twins compute the same from those layouts with shuffles: the emulated device's instructions, and
// on a GPU what `selftest_mma` checks the instructions against.
__device__ __forceinline__ void mma_s8_16816_twin(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (unsigned q = 0; q < 4; ++q) {
        const int r0 = (int)__shfl_sync(0xffffffffu, a0, g * 4 + q);
        const int r1 = (int)__shfl_sync(0xffffffffu, a1, g * 4 + q);
        const int c0 = (int)__shfl_sync(0xffffffffu, b, (2 * t) * 4 + q);
        const int c1 = (int)__shfl_sync(0xffffffffu, b, (2 * t + 1) * 4 + q);
        s0 = __dp4a(r0, c0, s0);
        s1 = __dp4a(r0, c1, s1);
        s2 = __dp4a(r1, c0, s2);
        s3 = __dp4a(r1, c1, s3);
    }
    d[0] = s0;
    d[1] = s1;
    d[2] = s2;
    d[3] = s3;
}

__device__ __forceinline__ void ldmatrix_x4_twin(uint32_t (&r)[4], const void* row) {
    const unsigned lane = threadIdx.x % 32;
#ifndef OSPREY_GPU
    if (reinterpret_cast<std::uintptr_t>(row) % 16 != 0) emu::fault("ldmatrix: a row address not 16-byte aligned");
#endif
    for (unsigned j = 0; j < 4; ++j) {
        const uint64_t a = __shfl_sync(0xffffffffu, (uint64_t)row, j * 8 + lane / 4);
        r[j] = *(const uint32_t*)((const uint8_t*)a + (lane % 4) * 4);
    }
}

#ifdef OSPREY_GPU
__device__ __forceinline__ void mma_s8_16816(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b), "r"(0));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(row)));
}
// cp.async (sm_80+): `src_bytes` of the 16 (8) read, the rest zero-filled; `.cg` bypasses L1.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src, unsigned src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
#else
__device__ __forceinline__ void mma_s8_16816(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
    mma_s8_16816_twin(d, a0, a1, b);
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) { ldmatrix_x4_twin(r, row); }
#endif
