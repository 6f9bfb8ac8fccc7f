// NVFP4 × int8 products for decode-shaped steps (at most 8 rows a weight), the fast activations
// (`Precision::Int8`): the CPU's `osprey_kernels::q8` on a GPU, as ggml's `mmvq.cu` does it. Activations
// are quantised once to int8 per 16-value block (`d = max|x| / 127`, `q = round(x / d)`: the CPU's rule,
// so both take the same integers); a block's dot product is then an exact integer sum — 2·e2m1 is an
// integer in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12} — scaled once by the weight's e4m3 block scale and the
// activation scale, and the row's sum once by `global / 2`.
//
// A weight row goes through a warp 32 columns a lane at a time: 16 packed bytes in one vector load
// (`ld.global.nc.v4`), their codes to int8 by a register table (`prmt`), four `dp4a` a block. Each
// weight is read once for every row of the step. A row's arithmetic does not depend on the others, nor
// on which kernel of this file computes it: the three agree to the bit on a row.
//
// Needs `k` a multiple of 32 (the host takes this path where it is a multiple of 64, as the CPU does).

// `Σ 2·w·q` over one 16-column block: its 8 packed weight bytes `w0`, `w1` against its 16 int8
// activations `a` (four words).
__device__ __forceinline__ int block_dot(uint32_t w0, uint32_t w1, uint4 a) {
    int s = __dp4a(e2m1x4_to_i8(w0 & 0xffffu), (int)a.x, 0);
    s = __dp4a(e2m1x4_to_i8(w0 >> 16), (int)a.y, s);
    s = __dp4a(e2m1x4_to_i8(w1 & 0xffffu), (int)a.z, s);
    return __dp4a(e2m1x4_to_i8(w1 >> 16), (int)a.w, s);
}

// One 16-value block `v` quantised: its 16 int8 into `q` (16-byte aligned), its scale into `*d`. The
// CPU's rule to the bit (`q8::quantize`): `inv = 127 / amax`, `q = round(v · inv)` half away from zero.
__device__ __forceinline__ void quant16(const float* v, uint8_t* q, float* d) {
    float amax = 0.0f;
    for (unsigned j = 0; j < 16; ++j) amax = fmaxf(amax, fabsf(v[j]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    uint32_t words[4] = {0u, 0u, 0u, 0u};
    for (unsigned j = 0; j < 16; ++j) {
        const float r = roundf(v[j] * inv);
        const int qi = r == r ? (int)fminf(fmaxf(r, -127.0f), 127.0f) : 0;  // NaN to 0, as the CPU's `as i8`
        words[j / 4] |= ((uint32_t)qi & 0xffu) << (8 * (j % 4));
    }
    *(uint4*)q = make_uint4(words[0], words[1], words[2], words[3]);
    *d = amax / 127.0f;
}

// The 16 values of global memory at `src` quantised (`quant16`): the activations' quantisation, where
// `quantize_q8` and `moe_gate_up_q8` read them.
__device__ __forceinline__ void quant16_from(const float* __restrict__ src, uint8_t* q, float* d) {
    float v[16];
    for (unsigned i = 0; i < 16; ++i) v[i] = __ldg(src + i);
    quant16(v, q, d);
}

// Rows `r` < `m` (at most 8) of the quantised activations (`xq [m, k]` int8, `xd [m, k/16]`) against
// NVFP4 weight row `col`, by the calling warp (lane `lane`): `put(r, sum)` for each, on every lane. A
// callback, not an array: its row index is a constant once the loop is unrolled, so the sums stay in
// registers (an array indexed by a runtime row goes to local memory).
// A load of the quantised activations: through the read-only cache from global memory, plainly from
// shared memory (where `moe_gate_up_q8` quantised them; `ld.global.nc` cannot read shared memory).
template <bool GLOBAL, typename T>
__device__ __forceinline__ T load_x(const T* p) {
    return GLOBAL ? __ldg(p) : *p;
}

template <typename Put, bool GLOBAL = true>
__device__ __forceinline__ void q8_rows(const uint8_t* __restrict__ xq, const float* __restrict__ xd,
                                        const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales, float global,
                                        unsigned m, unsigned k, unsigned col, unsigned lane, Put put) {
    const uint4* wrow = (const uint4*)(w + (size_t)col * (k / 2));
    const uint16_t* srow = (const uint16_t*)(scales + (size_t)col * (k / 16));
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (unsigned seg = lane; seg < k / 32; seg += 32) {
        const uint4 wv = __ldg(wrow + seg);
        const uint16_t sc = __ldg(srow + seg);
        const float ws0 = e4m3_to_f32((uint8_t)(sc & 0xffu)), ws1 = e4m3_to_f32((uint8_t)(sc >> 8));
#pragma unroll
        for (unsigned r = 0; r < 8; ++r) {
            if (r >= m) break;
            const uint4* xr = (const uint4*)(xq + (size_t)r * k) + 2 * seg;
            const float* dr = xd + (size_t)r * (k / 16) + 2 * seg;
            acc[r] += (float)block_dot(wv.x, wv.y, load_x<GLOBAL>(xr)) * (ws0 * load_x<GLOBAL>(dr));
            acc[r] += (float)block_dot(wv.z, wv.w, load_x<GLOBAL>(xr + 1)) * (ws1 * load_x<GLOBAL>(dr + 1));
        }
    }
#pragma unroll
    for (unsigned r = 0; r < 8; ++r) {
        if (r >= m) break;
        put(r, warp_sum(acc[r]) * global * 0.5f);
    }
}

// `q [rows, k]`, `d [rows, k/16]`: row `r` of `x [·, k]` quantised (row `ids[r]` where `gather`: the
// routed experts' rows gathered in the same pass). A thread a 16-value block.
// flops: fp32 4 * rows * k
// ptx: ld.global.nc.f32, st.global.v4.u32
// budget: 40 registers
extern "C" __global__ void quantize_q8(const float* __restrict__ x, const int32_t* __restrict__ ids, int gather,
                                       uint8_t* __restrict__ q, float* __restrict__ d, unsigned rows, unsigned k) {
    const unsigned per_row = k / 16;
    for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < (size_t)rows * per_row;
         b += (size_t)gridDim.x * blockDim.x) {
        const size_t r = b / per_row, j = b % per_row;
        const size_t src = gather ? (size_t)ids[r] : r;
        quant16_from(x + src * k + j * 16, q + r * k + j * 16, d + b);
    }
}

// `out [m, n] = x · wᵀ` for `m` ≤ 8 quantised rows and an NVFP4 weight `[n, k]`: a warp per output
// column. dp4a does four multiply-adds at half the FP32 rate (sm_86/89): `m·n·k` FP32-equivalent, plus
// the codes' table lookups (~1.5 instructions a weight) once for every row.
// flops: fp32 m * n * k + 3 * n * k
// ptx: ld.global.nc.v4.u32, prmt.b32, dp4a.s32.s32, shfl.sync.bfly.b32
// budget: 64 registers
extern "C" __global__ void linear_q8_gemv(const uint8_t* __restrict__ xq, const float* __restrict__ xd,
                                          const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales, float global,
                                          float* __restrict__ out, unsigned m, unsigned n, unsigned k) {
    const unsigned col = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (col >= n) return;  // a whole warp leaves together: `col` is the warp's
    q8_rows(xq, xd, w, scales, global, m, k, col, lane, [&](unsigned r, float v) {
        if (lane == 0) out[(size_t)r * n + col] = v;
    });
}

// The widest hidden size `moe_gate_up_q8` quantises into shared memory (8 rows: 32 KiB and 8 KiB).
#define GU_MAX_HIDDEN 4096

// The routed experts' gate and up projections and SwiGLU in one pass, its input quantised on the way in
// and its output for the down projection: group `g` (blockIdx.z: an expert with `rows[g]` ≤ 8 rows from
// `row0[g]` of the batch, row `r` being row `tokens[r]` of `x [·, hidden]`; projection `p`'s weight
// `w[p·groups + g]`, `s[…]`, `glob[…]`) quantises its rows into shared memory (`quant16`: the bits of
// `quantize_q8`), then gives `silu(gate)·up` for 16 columns a block (a warp each), quantised into
// `hq [·, inter]`, `hd [·, inter/16]` — the same bits as the gather's quantisation, the two products,
// `silu_mul_f32` and `quantize_q8` one after another. Each of a group's blocks quantises its rows again
// (hidden/16 blocks of 16 values a row, a few per thread): the launch it saves costs more. Needs
// `hidden` ≤ GU_MAX_HIDDEN. Registers: 64 on sm_80, 86 on sm_120 (its scheduler keeps the rows' loads in
// flight); 512 threads of 88 fit an SM's 64 K.
// flops: fp32 8 * threads / 32 * hidden + 4 * blocks * 8 * hidden
// ptx: ld.global.nc.v4.u32, prmt.b32, dp4a.s32.s32, bar.sync
// budget: 88 registers
extern "C" __global__ void moe_gate_up_q8(const float* __restrict__ x, const int32_t* __restrict__ tokens,
                                          const uint64_t* __restrict__ w, const uint64_t* __restrict__ s,
                                          const float* __restrict__ glob, const uint32_t* __restrict__ row0,
                                          const uint32_t* __restrict__ rows, unsigned groups, uint8_t* __restrict__ hq,
                                          float* __restrict__ hd, unsigned inter, unsigned hidden) {
    SHARED(uint4, xs, [8 * GU_MAX_HIDDEN / 16]);
    SHARED(float, xds, [8 * GU_MAX_HIDDEN / 16]);
    SHARED(float, h, [8][16]);
    const unsigned g = blockIdx.z, m = rows[g], r0 = row0[g];
    if (m == 0) return;  // the whole block: `g` is the block's
    const unsigned per_row = hidden / 16;
    uint8_t* xq = (uint8_t*)xs;
    for (unsigned b = threadIdx.x; b < m * per_row; b += blockDim.x) {
        const unsigned r = b / per_row, j = b % per_row;
        quant16_from(x + (size_t)tokens[r0 + r] * hidden + j * 16, xq + r * hidden + j * 16, xds + b);
    }
    __syncthreads();
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, col = blockIdx.x * 16 + warp;
    float gate[8];
    auto put_gate = [&](unsigned r, float v) { gate[r] = v; };
    q8_rows<decltype(put_gate), false>(xq, xds, (const uint8_t*)w[g], (const uint8_t*)s[g], glob[g], m, hidden, col, lane,
                                       put_gate);
    auto put_up = [&](unsigned r, float v) {
        if (lane == 0) h[r][warp] = silu_f(gate[r]) * v;
    };
    q8_rows<decltype(put_up), false>(xq, xds, (const uint8_t*)w[groups + g], (const uint8_t*)s[groups + g], glob[groups + g],
                                     m, hidden, col, lane, put_up);
    __syncthreads();
    if (threadIdx.x < m) {
        const size_t row = r0 + threadIdx.x;
        quant16(h[threadIdx.x], hq + row * inter + blockIdx.x * 16, hd + row * (inter / 16) + blockIdx.x);
    }
}

// The routed experts' down projection, each output times its routing weight into its entry of
// `partials` (`moe_scatter_rows` fused): group `g`'s rows of `hq`, `hd` against projection 2's weight
// (`w[2·groups + g]`, …); row `r` of the batch is entry `entries[r]`. A warp per output column.
// Registers: 57 on sm_80, 80 on sm_120 (its scheduler keeps the rows' loads in flight).
// flops: fp32 4 * threads / 32 * inter
// ptx: ld.global.nc.v4.u32, prmt.b32, dp4a.s32.s32, shfl.sync.bfly.b32
// budget: 80 registers
extern "C" __global__ void moe_down_q8(const uint8_t* __restrict__ hq, const float* __restrict__ hd,
                                       const uint64_t* __restrict__ w, const uint64_t* __restrict__ s,
                                       const float* __restrict__ glob, const uint32_t* __restrict__ row0,
                                       const uint32_t* __restrict__ rows, unsigned groups,
                                       const int32_t* __restrict__ entries, const float* __restrict__ weights,
                                       float* __restrict__ partials, unsigned hidden, unsigned inter) {
    const unsigned g = blockIdx.z, m = rows[g], r0 = row0[g];
    const unsigned col = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (col >= hidden || m == 0) return;  // the whole warp: `col` and `g` are the warp's
    const unsigned p = 2 * groups + g;
    q8_rows(hq + (size_t)r0 * inter, hd + (size_t)r0 * (inter / 16), (const uint8_t*)w[p], (const uint8_t*)s[p], glob[p], m,
            inter, col, lane, [&](unsigned r, float v) {
                if (lane != 0) return;
                const int32_t en = entries[r0 + r];
                partials[(size_t)en * hidden + col] = v * weights[en];
            });
}
