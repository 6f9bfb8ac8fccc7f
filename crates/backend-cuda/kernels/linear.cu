// `out [m, n] = x [m, k] · wᵀ` for a weight `[n, k]` stored as f32 (`wtype` 0), bf16 (1), f16 (2) or
// NVFP4 (3: `w` two e2m1 codes per byte, even column low; `scales` one e4m3 per 16; `global`), f32
// activations and accumulation. First version, for parity: 16×16 output tiles, k in steps of 16
// through shared memory (the later fast paths — warp-per-row GEMV with dp4a, mma.sync tiles, cuBLAS
// for bf16 — must agree with this one).

#define TILE 16

__device__ __forceinline__ float weight_at(const void* w, const uint8_t* scales, float global, int wtype, size_t row,
                                           unsigned k, unsigned col) {
    // Weights are read-only for the kernel's life: through the read-only cache (`ld.global.nc`), also
    // where a weight's address comes from a table (`linear_grouped_gemv`), not a restricted parameter.
    const size_t i = row * k + col;
    if (wtype == 0) return __ldg((const float*)w + i);
    if (wtype == 1) return bf16_to_f32(__ldg((const uint16_t*)w + i));
    if (wtype == 2) return f16_to_f32(__ldg((const uint16_t*)w + i));
    const uint8_t byte = __ldg((const uint8_t*)w + i / 2);
    const uint32_t code = (col % 2 == 0) ? (byte & 0xfu) : (byte >> 4);
    return e2m1_to_f32(code) * (e4m3_to_f32(__ldg(scales + i / 16)) * global);
}

// One output of a 16×16 tile: row `row` of `x` against weight row `wrow`, `k` in steps of 16 through the
// block's shared tiles `xs` and `ws` (the same arithmetic for `linear_tiled` and `linear_grouped`).
__device__ __forceinline__ float tile_dot(const float* x, const void* w, const uint8_t* scales, float global, int wtype,
                                          unsigned m, unsigned n, unsigned k, unsigned row, unsigned wrow,
                                          float (*xs)[TILE + 1], float (*ws)[TILE + 1]) {
    const unsigned tx = threadIdx.x, ty = threadIdx.y;
    float acc = 0.0f;
    for (unsigned k0 = 0; k0 < k; k0 += TILE) {
        xs[ty][tx] = (row < m && k0 + tx < k) ? x[(size_t)row * k + k0 + tx] : 0.0f;
        ws[ty][tx] = (wrow < n && k0 + tx < k) ? weight_at(w, scales, global, wtype, wrow, k, k0 + tx) : 0.0f;
        __syncthreads();
        for (unsigned j = 0; j < TILE; ++j) acc += xs[ty][j] * ws[tx][j];
        __syncthreads();
    }
    return acc;
}

// flops: fp32 2 * threads * k
// ptx: bar.sync, ld.shared.f32
// budget: 64 registers
extern "C" __global__ void linear_tiled(const float* __restrict__ x, const void* __restrict__ w, const uint8_t* __restrict__ scales,
                                        float global, int wtype, float* __restrict__ out, unsigned m, unsigned n, unsigned k) {
    SHARED(float, xs, [TILE][TILE + 1]);
    SHARED(float, ws, [TILE][TILE + 1]);
    const unsigned row = blockIdx.y * TILE + threadIdx.y;  // of x and out
    const unsigned col = blockIdx.x * TILE + threadIdx.x;  // of out: a row of w
    const unsigned wrow = blockIdx.x * TILE + threadIdx.y;  // the w row this thread loads
    const float acc = tile_dot(x, w, scales, global, wtype, m, n, k, row, wrow, xs, ws);
    if (row < m && col < n) out[(size_t)row * n + col] = acc;
}

// Eight weights of row `row` from column `c` (a multiple of 8) as f32, in one load where the type allows:
// 16 bytes of bf16 or f16 (`ld.global.nc.v4`), two of f32, four bytes of NVFP4 codes and their scale.
__device__ __forceinline__ void weights8(const void* w, const uint8_t* scales, float global, int wtype, size_t row,
                                         unsigned k, unsigned c, float (&v)[8]) {
    const size_t i = row * k + c;
    if (wtype == 0) {
        const uint4 a = __ldg((const uint4*)((const float*)w + i)), b = __ldg((const uint4*)((const float*)w + i) + 1);
        const uint32_t u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        for (unsigned e = 0; e < 8; ++e) v[e] = __uint_as_float(u[e]);
    } else if (wtype == 1 || wtype == 2) {
        const uint4 a = __ldg((const uint4*)((const uint16_t*)w + i));
        const uint32_t u[4] = {a.x, a.y, a.z, a.w};
        for (unsigned e = 0; e < 8; ++e) {
            const uint16_t h = (uint16_t)(u[e / 2] >> (16 * (e % 2)));
            v[e] = wtype == 1 ? bf16_to_f32(h) : f16_to_f32(h);
        }
    } else {
        const uint32_t codes = __ldg((const uint32_t*)((const uint8_t*)w + i / 2));
        const float s = e4m3_to_f32(__ldg(scales + i / 16)) * global;
        for (unsigned e = 0; e < 8; ++e) v[e] = e2m1_to_f32(codes >> (4 * e)) * s;
    }
}

// The sums of rows `r0 .. r0 + 8` (those < `m`) of `x` against weight row `col`, by the calling warp
// (lane `lane`): `put(r, sum)` for each, on every lane (a callback: its row is a constant once unrolled,
// so the sums stay in registers). Where `k` is a multiple of 8 a lane takes 8 neighbouring columns a step
// in one vector load (`weights8`; the activations likewise), else one column a step; then the warp's
// sum. A row's arithmetic does not depend on the others (`linear_gemv`, `linear_grouped_gemv` and
// `linear_gemv_swiglu` agree to the bit on it).
template <typename Put>
__device__ __forceinline__ void gemv_sums(const float* __restrict__ x, const void* __restrict__ w,
                                          const uint8_t* __restrict__ scales, float global, int wtype, unsigned r0,
                                          unsigned m, unsigned k, unsigned col, unsigned lane, Put put) {
    const bool wide = k % 8 == 0;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    if (wide) {
        for (unsigned j = lane * 8; j < k; j += 256) {
            float wv[8];
            weights8(w, scales, global, wtype, col, k, j, wv);
#pragma unroll
            for (unsigned r = 0; r < 8; ++r) {
                if (r0 + r >= m) break;
                const uint4* xr = (const uint4*)(x + (size_t)(r0 + r) * k + j);
                const uint4 a = __ldg(xr), b = __ldg(xr + 1);
                const uint32_t u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
                for (unsigned e = 0; e < 8; ++e) acc[r] += __uint_as_float(u[e]) * wv[e];
            }
        }
    } else {
        for (unsigned j = lane; j < k; j += 32) {
            const float wv = weight_at(w, scales, global, wtype, col, k, j);
#pragma unroll
            for (unsigned r = 0; r < 8; ++r)
                if (r0 + r < m) acc[r] += x[(size_t)(r0 + r) * k + j] * wv;
        }
    }
#pragma unroll
    for (unsigned r = 0; r < 8; ++r) {
        if (r0 + r >= m) break;
        put(r, warp_sum(acc[r]));
    }
}

// `out[r·n + col]` for rows `r` < `m` of `x`, by the calling warp: the weight row read once for up to 8
// rows at a time (`gemv_sums`), lane 0 writing.
__device__ __forceinline__ void gemv_rows(const float* __restrict__ x, const void* __restrict__ w,
                                          const uint8_t* __restrict__ scales, float global, int wtype,
                                          float* __restrict__ out, unsigned m, unsigned n, unsigned k, unsigned col,
                                          unsigned lane) {
    for (unsigned r0 = 0; r0 < m; r0 += 8) {
        gemv_sums(x, w, scales, global, wtype, r0, m, k, col, lane, [&](unsigned r, float v) {
            if (lane == 0) out[(size_t)(r0 + r) * n + col] = v;
        });
    }
}

// Decode-shaped products (`m` ≤ 8 rows): one warp per output column (a weight row), the weight read once
// for all `m` rows (`gemv_rows`). Same weight types as `linear_tiled`. Registers: 39 on sm_80, 68 on
// sm_120 (its scheduler keeps the rows' vector loads in flight).
// flops: fp32 2 * m * n * k + 2 * n * k
// ptx: shfl.sync.bfly.b32, ld.global.nc.u8, ld.global.nc.v4.u32
// budget: 72 registers
extern "C" __global__ void linear_gemv(const float* __restrict__ x, const void* __restrict__ w, const uint8_t* __restrict__ scales,
                                       float global, int wtype, float* __restrict__ out, unsigned m, unsigned n, unsigned k) {
    const unsigned col = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (col >= n) return;  // a whole warp leaves together: `col` is the warp's
    gemv_rows(x, w, scales, global, wtype, out, m, n, k, col, lane);
}

// Up to four weights of one input width against the same rows in one launch (a layer's projections of
// one input; an MLP's gate and up): warps for weight 0's `n0` columns as `linear_gemv` with `w0` into
// `o0`, then weight 1's `n1` into `o1`, and so on (`n` 0: no weight; each its own type) — the bits of one
// `linear_gemv` launch per weight.
// flops: fp32 2 * m * (n0 + n1 + n2 + n3) * k + 2 * (n0 + n1 + n2 + n3) * k
// ptx: shfl.sync.bfly.b32, ld.global.nc.v4.u32
// budget: 80 registers
extern "C" __global__ void linear_gemv_many(const float* __restrict__ x, unsigned m, unsigned k, const void* __restrict__ w0,
                                            const uint8_t* __restrict__ s0, float g0, int t0, float* __restrict__ o0,
                                            unsigned n0, const void* __restrict__ w1, const uint8_t* __restrict__ s1,
                                            float g1, int t1, float* __restrict__ o1, unsigned n1,
                                            const void* __restrict__ w2, const uint8_t* __restrict__ s2, float g2,
                                            int t2, float* __restrict__ o2, unsigned n2, const void* __restrict__ w3,
                                            const uint8_t* __restrict__ s3, float g3, int t3, float* __restrict__ o3,
                                            unsigned n3) {
    unsigned col = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const unsigned lane = threadIdx.x % 32;
    // Whole warps take one branch: `col` is the warp's.
    if (col < n0) return gemv_rows(x, w0, s0, g0, t0, o0, m, n0, k, col, lane);
    col -= n0;
    if (col < n1) return gemv_rows(x, w1, s1, g1, t1, o1, m, n1, k, col, lane);
    col -= n1;
    if (col < n2) return gemv_rows(x, w2, s2, g2, t2, o2, m, n2, k, col, lane);
    col -= n2;
    if (col < n3) gemv_rows(x, w3, s3, g3, t3, o3, m, n3, k, col, lane);
}

// SwiGLU's first half for decode-shaped rows (`m` ≤ 8): warp `col` takes the gate's and the up
// projection's weight row `col`, both sums for every row (`gemv_sums`, the bits of `linear_gemv`), and
// writes `silu(g) · u` as `silu_mul_f32` computes it: `linear_gemv_many` and `silu_mul_f32` in one
// launch with their bits, the gate and up never stored.
// flops: fp32 4 * m * n * k + 4 * n * k + 5 * m * n
// ptx: shfl.sync.bfly.b32, ld.global.nc.v4.u32
// budget: 80 registers
extern "C" __global__ void linear_gemv_swiglu(const float* __restrict__ x, const void* __restrict__ w1,
                                              const uint8_t* __restrict__ s1, float g1, const void* __restrict__ w2,
                                              const uint8_t* __restrict__ s2, float g2, int wtype, float* __restrict__ out,
                                              unsigned m, unsigned n, unsigned k) {
    const unsigned col = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (col >= n) return;  // a whole warp leaves together: `col` is the warp's
    float g[8], u[8];
    gemv_sums(x, w1, s1, g1, wtype, 0, m, k, col, lane, [&](unsigned r, float v) { g[r] = v; });
    gemv_sums(x, w2, s2, g2, wtype, 0, m, k, col, lane, [&](unsigned r, float v) { u[r] = v; });
#pragma unroll
    for (unsigned r = 0; r < 8; ++r) {
        if (r >= m) break;
        if (lane == 0) out[(size_t)r * n + col] = silu_f(g[r]) * u[r];
    }
}

// The routed experts of a decode-shaped wave (a step of at most 8 tokens, so at most 8 rows a group):
// group `g` (blockIdx.z) as `linear_gemv` over its `rows[g]` rows from `row0[g]` with its own weight —
// each weight row read once, not once per 16-row tile of which one row is used (`linear_grouped`). A
// group with no rows leaves at once.
// flops: fp32 4 * threads / 32 * k
// ptx: shfl.sync.bfly.b32, ld.global.nc.u8, ld.global.nc.v4.u32
// budget: 80 registers
extern "C" __global__ void linear_grouped_gemv(const float* __restrict__ x, const uint64_t* __restrict__ w,
                                               const uint64_t* __restrict__ scales, const float* __restrict__ global,
                                               const uint32_t* __restrict__ row0, const uint32_t* __restrict__ rows,
                                               int wtype, float* __restrict__ out, unsigned n, unsigned k) {
    const unsigned g = blockIdx.z, m = rows[g];
    const unsigned col = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (col >= n || m == 0) return;  // the whole warp: `col` and `g` are the warp's
    gemv_rows(x + (size_t)row0[g] * k, (const void*)w[g], (const uint8_t*)scales[g], global[g], wtype,
              out + (size_t)row0[g] * n, m, n, k, col, lane);
}

// The routed experts of one wave in one launch (a grouped GEMM): group `g` (blockIdx.z) multiplies its
// `rows[g]` rows of `x`, starting at row `row0[g]`, by its own weight (`w[g]`, `scales[g]`, `global[g]`;
// one type for all) into the same rows of `out [·, n]` — tile for tile what `linear_tiled` computes.
// flops: fp32 2 * threads * k
// ptx: bar.sync, ld.shared.f32
// budget: 64 registers
extern "C" __global__ void linear_grouped(const float* __restrict__ x, const uint64_t* __restrict__ w, const uint64_t* __restrict__ scales,
                                          const float* __restrict__ global, const uint32_t* __restrict__ row0,
                                          const uint32_t* __restrict__ rows, int wtype, float* __restrict__ out, unsigned n,
                                          unsigned k) {
    SHARED(float, xs, [TILE][TILE + 1]);
    SHARED(float, ws, [TILE][TILE + 1]);
    const unsigned g = blockIdx.z, m = rows[g];
    if (blockIdx.y * TILE >= m) return;  // the whole block: this group has fewer row tiles
    const float* xg = x + (size_t)row0[g] * k;
    float* og = out + (size_t)row0[g] * n;
    const unsigned row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    const unsigned wrow = blockIdx.x * TILE + threadIdx.y;
    const float acc = tile_dot(xg, (const void*)w[g], (const uint8_t*)scales[g], global[g], wtype, m, n, k, row, wrow, xs, ws);
    if (row < m && col < n) og[(size_t)row * n + col] = acc;
}
