// NVFP4 × int8 GEMMs on tensor cores for prefill-shaped products (more than 8 rows) at the fast
// activations: W4A8 as ggml's MMQ, with NVFP4's 16-value blocks. Activations come quantised per block
// (`quantize_q8`, the CPU's rule, so the device takes the CPU's integers); a block's 16×16 products are
// one `mma.sync.m16n8k16` on int8 (2·e2m1 codes are integers), exact in int32, then scaled once by the
// activation's and the weight's block scales into f32; the row's sum by `global / 2` once.
//
// A block of 4 warps computes a tile (`mma_q8_tile`). The k
// dimension goes 32 values (two blocks) a step through shared memory, two stages deep: the next step's
// activations (`ldmatrix` rows), their scales and the packed weights are copied with `cp.async` while
// the tensor cores work on this one. Weight codes become int8 fragments in registers (`prmt`), so the
// weights are read as packed bytes only. Needs `k` a multiple of 32.

#define GA 48  // bytes a staged activation row: 32, padded so ldmatrix's eight rows meet no bank twice

// Rows `[r0, r0 + BM)` ∩ `[0, m)` of `xq`/`xd` against columns `[c0, c0 + BN)` ∩ `[0, n)` of NVFP4 `w`
// into `out [·, n]` (the rows relative to `xq`, `xd` and `out` alike), by 4 warps: `WR` of them along
// the rows, each `MT` m16 tiles tall and four n8 tiles (32 columns) wide, so BM = WR·MT·16 and
// BN = (4 / WR)·32. Dense products take 64 × 64 (WR = MT = 2); an expert's few rows (a 512-token chunk
// gives Qwen3.5's 256 experts 16 rows each) take 16 × 128 (WR = MT = 1), so the tensor cores do not
// multiply padding.
template <unsigned WR, unsigned MT>
__device__ __forceinline__ void mma_q8_tile(const uint8_t* __restrict__ xq, const float* __restrict__ xd, unsigned m,
                                            const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales,
                                            float global, float* __restrict__ out, unsigned n, unsigned k, unsigned r0,
                                            unsigned c0) {
    constexpr unsigned BM = WR * MT * 16, BN = (4 / WR) * 32;
    SHARED(uint4, as, [2][BM * GA / 16]);
    SHARED(float2, ds, [2][BM]);
    SHARED(uint4, wq, [2][BN]);
    SHARED(float2, wsc, [2][BN]);
    const unsigned tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const unsigned wm = warp / (4 / WR), wn = warp % (4 / WR);
    const unsigned kb16 = k / 16, steps = k / 32;
    // One step's operands into stage `buf`: 16 bytes of an activation row a copy, a row's two scales,
    // a column's 16 packed bytes and its two scales. Rows and columns past the edges are zero-filled
    // (their products are never stored).
    auto stage = [&](unsigned s, unsigned buf) {
        for (unsigned i = tid; i < BM * 2; i += 128) {
            const unsigned r = i / 2, hf = i % 2;
            const bool in = r0 + r < m;
            cp_async16((uint8_t*)as[buf] + r * GA + hf * 16, xq + (size_t)(in ? r0 + r : 0) * k + s * 32 + hf * 16,
                       in ? 16u : 0u);
        }
        for (unsigned r = tid; r < BM; r += 128) {
            const bool in = r0 + r < m;
            cp_async8(&ds[buf][r], xd + (size_t)(in ? r0 + r : 0) * kb16 + 2 * s, in ? 8u : 0u);
        }
        for (unsigned c = tid; c < BN; c += 128) {
            const bool in = c0 + c < n;
            const size_t col = in ? c0 + c : 0;
            cp_async16(&wq[buf][c], w + col * (k / 2) + s * 16, in ? 16u : 0u);
            const uint16_t sc = in ? __ldg((const uint16_t*)(scales + col * kb16) + s) : (uint16_t)0;
            wsc[buf][c].x = e4m3_to_f32((uint8_t)(sc & 0xffu));
            wsc[buf][c].y = e4m3_to_f32((uint8_t)(sc >> 8));
        }
        cp_async_commit();
    };
    float acc[MT][4][4];
#pragma unroll
    for (unsigned i = 0; i < MT; ++i)
#pragma unroll
        for (unsigned j = 0; j < 4; ++j)
#pragma unroll
            for (unsigned e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    stage(0, 0);
    for (unsigned s = 0; s < steps; ++s) {
        const unsigned buf = s % 2;
        if (s + 1 < steps) {
            stage(s + 1, buf ^ 1u);
            cp_async_wait<1>();  // this step's group has landed; the next one may still be in flight
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const uint8_t* ab = (const uint8_t*)as[buf];
        const uint8_t* wb = (const uint8_t*)wq[buf];
        // A fragments, four 8-row matrices a `ldmatrix`: two m16 tiles of one block of k (MT = 2, one
        // load per block), or one tile's two blocks (MT = 1, one load a step).
        const unsigned mat = lane / 8;
        uint32_t a[2][4];
        if (MT == 2) {
            for (unsigned kb = 0; kb < 2; ++kb)
                ldmatrix_x4(a[kb], ab + (wm * 32 + (mat / 2) * 16 + (mat % 2) * 8 + lane % 8) * GA + kb * 16);
        } else {
            ldmatrix_x4(a[0], ab + (wm * 16 + (mat % 2) * 8 + lane % 8) * GA + (mat / 2) * 16);
        }
#pragma unroll
        for (unsigned kb = 0; kb < 2; ++kb) {
#pragma unroll
            for (unsigned j = 0; j < 4; ++j) {
                const unsigned col = wn * 32 + j * 8 + g;
                const uint32_t b = (uint32_t)e2m1x4_to_i8(*(const uint16_t*)(wb + col * 16 + kb * 8 + 2 * t));
                const unsigned cj = wn * 32 + j * 8 + 2 * t;
                const float w0 = kb ? wsc[buf][cj].y : wsc[buf][cj].x, w1 = kb ? wsc[buf][cj + 1].y : wsc[buf][cj + 1].x;
#pragma unroll
                for (unsigned i = 0; i < MT; ++i) {
                    // Tile i's fragment of block kb: (a[kb][2i], a[kb][2i + 1]) or, with MT = 1,
                    // (a[0][2kb], a[0][2kb + 1]).
                    const uint32_t a0 = MT == 2 ? a[kb][2 * i] : a[0][2 * kb];
                    const uint32_t a1 = MT == 2 ? a[kb][2 * i + 1] : a[0][2 * kb + 1];
                    int d[4];
                    mma_s8_16816(d, a0, a1, b);
                    const unsigned ri = wm * MT * 16 + i * 16 + g;
                    const float x0 = kb ? ds[buf][ri].y : ds[buf][ri].x, x1 = kb ? ds[buf][ri + 8].y : ds[buf][ri + 8].x;
                    acc[i][j][0] += (float)d[0] * (x0 * w0);
                    acc[i][j][1] += (float)d[1] * (x0 * w1);
                    acc[i][j][2] += (float)d[2] * (x1 * w0);
                    acc[i][j][3] += (float)d[3] * (x1 * w1);
                }
            }
        }
        __syncthreads();  // every warp is done with `buf` before the step after next restages it
    }
    const float f = global * 0.5f;
#pragma unroll
    for (unsigned i = 0; i < MT; ++i)
#pragma unroll
        for (unsigned j = 0; j < 4; ++j)
#pragma unroll
            for (unsigned e = 0; e < 4; ++e) {
                const unsigned r = r0 + wm * MT * 16 + i * 16 + g + (e / 2) * 8;
                const unsigned c = c0 + wn * 32 + j * 8 + 2 * t + e % 2;
                if (r < m && c < n) out[(size_t)r * n + c] = acc[i][j][e] * f;
            }
}

// `out [m, n] = x · wᵀ` for `m` quantised rows (`xq [m, k]` int8, `xd [m, k/16]`) and an NVFP4 weight
// `[n, k]`: 64 × 64 tiles (blockIdx.x columns, blockIdx.y rows), 128 threads.
// flops: int8 2 * blocks * 4096 * k
// ptx: mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32, ldmatrix.sync.aligned.m8n8.x4.shared.b16, cp.async.cg.shared.global, prmt.b32
// budget: 112 registers
extern "C" __global__ void linear_mma_q8(const uint8_t* __restrict__ xq, const float* __restrict__ xd,
                                         const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales, float global,
                                         float* __restrict__ out, unsigned m, unsigned n, unsigned k) {
    mma_q8_tile<2, 2>(xq, xd, m, w, scales, global, out, n, k, blockIdx.y * 64, blockIdx.x * 64);
}

// The routed experts of a prefill-shaped wave in one launch: group `g` (blockIdx.z) multiplies its
// `rows[g]` quantised rows from `row0[g]` by its own NVFP4 weight (`w[g]`, `scales[g]`, `global[g]`) into
// the same rows of `out [·, n]`, as `linear_mma_q8` does, in 16 × 128 tiles. A block past its group's
// rows leaves (and does no work).
// flops: int8 2 * blocks * 2048 * k
// ptx: mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32, ldmatrix.sync.aligned.m8n8.x4.shared.b16, cp.async.cg.shared.global
// budget: 112 registers
extern "C" __global__ void linear_grouped_mma_q8(const uint8_t* __restrict__ xq, const float* __restrict__ xd,
                                                 const uint64_t* __restrict__ w, const uint64_t* __restrict__ scales,
                                                 const float* __restrict__ global, const uint32_t* __restrict__ row0,
                                                 const uint32_t* __restrict__ rows, float* __restrict__ out, unsigned n,
                                                 unsigned k) {
    const unsigned g = blockIdx.z, m = rows[g];
    if (blockIdx.y * 16 >= m) return;  // the whole block
    const size_t r = row0[g];
    mma_q8_tile<1, 1>(xq + r * k, xd + r * (k / 16), m, (const uint8_t*)w[g], (const uint8_t*)scales[g], global[g],
                      out + r * n, n, k, blockIdx.y * 16, blockIdx.x * 128);
}
