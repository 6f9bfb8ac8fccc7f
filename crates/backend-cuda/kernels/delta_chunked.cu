// Gated DeltaNet's chunked form on the device (prefill): the CPU's `gated_delta_chunked` (UT transform,
// chunks of 64 tokens counted from the start of the call) in two kernels. The part of a chunk that does
// not depend on the state — the cumulative decay, the masked products with kᵀ and the two unit-lower
// solves — runs for every chunk of a window at once (`gated_delta_chunk_prep`); only the part that needs
// the state runs chunk after chunk (`gated_delta_chunk_state`), with the state on chip throughout.

#define DELTA_CHUNK 64u

// Scratch of a window of chunks, for chunk `w` of the window and value head `h` (`b = w·nv + h`):
// `xs` X [64, dv] = (I + L)⁻¹(v·β), `ys` Y [64, dk] = (I + L)⁻¹(k·β·e^cum), `qks` A [64, 64] =
// (q·kᵀ)∘decay (lower, the diagonal included), `cum [64]` the cumulative log decay; L is the strictly
// lower (kβ·kᵀ)∘decay.

// The state-free part of chunk `blockIdx.y` of the window from token `t0` (of `n`), value head
// `blockIdx.x`, in the CPU's order of operations per element. 256 threads: the products a thread per
// element of the 64×64 tile, the solves a thread per column of [X | Y] by forward substitution.
// flops: fp32 2 * 64 * 64 * dk * blocks + 64 * 64 * (dk + dv) * blocks
// ptx: ex2.approx.ftz.f32, bar.sync
// budget: 48 registers
extern "C" __global__ void gated_delta_chunk_prep(const float* __restrict__ q, const float* __restrict__ k,
                                                  const float* __restrict__ v, const float* __restrict__ g,
                                                  const float* __restrict__ beta, unsigned t0, unsigned n,
                                                  float* __restrict__ xs, float* __restrict__ ys, float* __restrict__ qks,
                                                  float* __restrict__ cum, unsigned nk, unsigned nv, unsigned dk,
                                                  unsigned dv) {
    SHARED(float, L, [DELTA_CHUNK * DELTA_CHUNK]);
    SHARED(float, cs, [DELTA_CHUNK]);
    SHARED(float, bs, [DELTA_CHUNK]);
    const unsigned h = blockIdx.x, kh = h / (nv / nk), s0 = t0 + blockIdx.y * DELTA_CHUNK;
    const unsigned c = umin(DELTA_CHUNK, n - s0);
    const size_t bi = (size_t)blockIdx.y * nv + h;
    float *xb = xs + bi * DELTA_CHUNK * dv, *yb = ys + bi * DELTA_CHUNK * dk;
    float *ab = qks + bi * DELTA_CHUNK * DELTA_CHUNK, *cb = cum + bi * DELTA_CHUNK;
#define QROW(t) (q + ((size_t)(s0 + (t)) * nk + kh) * dk)
#define KROW(t) (k + ((size_t)(s0 + (t)) * nk + kh) * dk)
    if (threadIdx.x == 0) {  // a running sum: serial, as the CPU's
        float acc = 0.0f;
        for (unsigned i = 0; i < c; ++i) {
            acc += g[(size_t)(s0 + i) * nv + h];
            cs[i] = acc;
            cb[i] = acc;
        }
    }
    for (unsigned i = threadIdx.x; i < c; i += blockDim.x) bs[i] = beta[(size_t)(s0 + i) * nv + h];
    __syncthreads();
    for (unsigned e = threadIdx.x; e < DELTA_CHUNK * DELTA_CHUNK; e += blockDim.x) {
        const unsigned i = e / DELTA_CHUNK, j = e % DELTA_CHUNK;
        float l = 0.0f, a = 0.0f;
        if (i < c && j <= i) {
            const float *ki = KROW(i), *kj = KROW(j), *qi = QROW(i);
            float kk = 0.0f, qk = 0.0f;
            for (unsigned d = 0; d < dk; ++d) {
                kk += ki[d] * bs[i] * kj[d];
                qk += qi[d] * kj[d];
            }
            const float decay = expf(cs[i] - cs[j]);
            if (j < i) l = kk * decay;
            a = qk * decay;
        }
        L[e] = l;
        ab[e] = a;
    }
    __syncthreads();
    for (unsigned col = threadIdx.x; col < dv + dk; col += blockDim.x) {
        const bool x = col < dv;
        const unsigned w = x ? dv : dk, cc = x ? col : col - dv;
        float* t = (x ? xb : yb) + cc;
        for (unsigned i = 0; i < c; ++i) {
            float acc = x ? v[((size_t)(s0 + i) * nv + h) * dv + cc] * bs[i] : KROW(i)[cc] * bs[i] * expf(cs[i]);
            for (unsigned j = 0; j < i; ++j) acc -= L[i * DELTA_CHUNK + j] * t[(size_t)j * w];
            t[(size_t)i * w] = acc;
        }
    }
#undef QROW
#undef KROW
}

// The state's part of `chunks` chunks from token `t0` (of `n`), one after another: per chunk
// v_new = X − Y·S, out = (q∘e^cum)·S + A·v_new, S ← S·e^last + (k∘e^(last−cum))ᵀ·v_new. Block `x`: value
// head `x / ⌈dv/32⌉` and 32 of its state columns, held in shared memory from the first chunk to the last
// (read and written once per window); 512 threads, a lane a column, 16 warps over rows (a chunk's rows
// are its critical path: 4 a warp for v_new and the output, 8 for the update).
// flops: fp32 (6 * 64 * dk * 32 + 64 * 64 * 32) * chunks * blocks
// ptx: ex2.approx.ftz.f32, bar.sync, ld.shared.f32
// budget: 40 registers
extern "C" __global__ void gated_delta_chunk_state(const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ xs, const float* __restrict__ ys,
                                                   const float* __restrict__ qks, const float* __restrict__ cum,
                                                   float* __restrict__ state, float* __restrict__ out, unsigned t0,
                                                   unsigned n, unsigned chunks, unsigned nk, unsigned nv, unsigned dk,
                                                   unsigned dv) {
    SHARED(float, slab, [DELTA_DK_MAX * DELTA_COLS]);
    SHARED(float, vn, [DELTA_CHUNK * DELTA_COLS]);
    SHARED(float, eq, [DELTA_CHUNK]);
    SHARED(float, ek, [DELTA_CHUNK]);
    const unsigned groups = (dv + DELTA_COLS - 1) / DELTA_COLS;
    const unsigned h = blockIdx.x / groups, kh = h / (nv / nk);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const unsigned j = (blockIdx.x % groups) * DELTA_COLS + lane;
    const bool live = j < dv;
    float* s = state + (size_t)h * dk * dv;
    for (unsigned i = warp; i < dk; i += warps) slab[i * DELTA_COLS + lane] = live ? s[(size_t)i * dv + j] : 0.0f;
    for (unsigned w = 0; w < chunks; ++w) {
        const unsigned s0 = t0 + w * DELTA_CHUNK, c = umin(DELTA_CHUNK, n - s0);
        const size_t bi = (size_t)w * nv + h;
        const float *xb = xs + bi * DELTA_CHUNK * dv, *yb = ys + bi * DELTA_CHUNK * dk;
        const float *ab = qks + bi * DELTA_CHUNK * DELTA_CHUNK, *cb = cum + bi * DELTA_CHUNK;
        const float last = cb[c - 1];
        for (unsigned t = threadIdx.x; t < c; t += blockDim.x) {
            eq[t] = expf(cb[t]);
            ek[t] = expf(last - cb[t]);
        }
        __syncthreads();  // the slab (first chunk: loaded; later: updated) and the decays
        for (unsigned t = warp; t < c; t += warps) {
            const float* yt = yb + (size_t)t * dk;
            float acc = 0.0f;
            for (unsigned i = 0; i < dk; ++i) acc += yt[i] * slab[i * DELTA_COLS + lane];
            vn[t * DELTA_COLS + lane] = live ? xb[(size_t)t * dv + j] - acc : 0.0f;
        }
        __syncthreads();
        for (unsigned t = warp; t < c; t += warps) {
            const float* qt = q + ((size_t)(s0 + t) * nk + kh) * dk;
            float o = 0.0f;
            for (unsigned i = 0; i < dk; ++i) o += qt[i] * eq[t] * slab[i * DELTA_COLS + lane];
            for (unsigned u = 0; u <= t; ++u) o += ab[t * DELTA_CHUNK + u] * vn[u * DELTA_COLS + lane];
            if (live) out[((size_t)(s0 + t) * nv + h) * dv + j] = o;
        }
        __syncthreads();  // every read of the slab before it is updated
        const float el = expf(last);
        for (unsigned i = warp; i < dk; i += warps) {
            float acc = slab[i * DELTA_COLS + lane] * el;
            for (unsigned t = 0; t < c; ++t) {
                acc += k[((size_t)(s0 + t) * nk + kh) * dk + i] * ek[t] * vn[t * DELTA_COLS + lane];
            }
            slab[i * DELTA_COLS + lane] = acc;
        }
        __syncthreads();  // the update before the next chunk's reads (and eq/ek rewrites)
    }
    for (unsigned i = warp; i < dk; i += warps) {
        if (live) s[(size_t)i * dv + j] = slab[i * DELTA_COLS + lane];
    }
}
