// Attention. Causal attention over a sequence's paged KV is flash attention (`attention_flash`, below:
// online softmax over K/V tiles in shared memory, the context split across blocks for decode, no score
// stored); bidirectional attention (the vision towers) is still parity-first: one block per (query row,
// head), scores of every key into a scratch row, a block-wide max and sum, then each thread one output
// dimension. GQA: head h reads KV head h / (heads / kv_heads).

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

// Flash attention over the paged KV (FlashAttention-2's loop, flash-decoding's split): a block takes
// query row `blockIdx.x` of the launch, up to `hchunk` query heads of one KV head (`blockIdx.y`: KV head,
// then chunk of its heads) and split `blockIdx.z` of the positions it sees. The launch's rows may come
// from several sequences (a decode step's, in one launch): row `i`'s `FlashRow` names its sequence's page
// table, its row of `q` and `out`, the positions it sees (its token's position + 1) and its split width,
// which its own sequence's plan set, so a row computes the same bits in any launch. K and V come through
// shared memory 16 positions a tile, read once for all the block's query heads; each head keeps a
// running maximum and sum (online softmax), so no score is ever stored beyond its tile: memory does not
// grow with the context. With one split a launch writes the output; with several, `part [rows, heads,
// splits, head_dim + 2]` (the unnormalised sums, the maximum, the sum of exponentials; a split past a
// row's positions writes an empty one) for `attention_combine`.
struct FlashRow {
    unsigned long long table;  // the sequence's page ids (i32), a device address
    unsigned q_row, len, span, pad;
};

#define FT 16        // positions a tile
#define FMAX_D 256   // the widest head
#define FMAX_QD 2048 // query heads × head width a block holds (16 sums a thread at 128 threads)

// flops: fp32 4 * head_dim * heads * keys
// ptx: bar.sync, ld.shared.f32, ex2.approx.ftz.f32
// budget: 64 registers
extern "C" __global__ void attention_flash(const float* __restrict__ q, float* __restrict__ out, const void* __restrict__ pool,
                                           int pool_bf16, const FlashRow* __restrict__ desc, unsigned page_size,
                                           unsigned rows, unsigned keys, unsigned heads, unsigned kv_heads,
                                           unsigned head_dim, float scale, unsigned hchunk, float* __restrict__ part) {
    SHARED(float, qs, [FMAX_QD]);
    SHARED(float, ks, [FT][FMAX_D]);
    SHARED(float, vs, [FT][FMAX_D]);
    SHARED(float, ss, [32][FT]);
    SHARED(float, mrun, [32]);
    SHARED(float, lrun, [32]);
    SHARED(float, corr, [32]);
    const unsigned i = blockIdx.x, group = heads / kv_heads, chunks = (group + hchunk - 1) / hchunk;
    if (i >= rows) return;  // the whole block
    const unsigned kvh = blockIdx.y / chunks, h0 = kvh * group + (blockIdx.y % chunks) * hchunk;
    const unsigned hc = umin(hchunk, kvh * group + group - h0), items = hc * head_dim;
    const FlashRow r = desc[i];
    const int32_t* table = (const int32_t*)r.table;
    const unsigned len = r.len, p0 = blockIdx.z * r.span, p1 = umin(p0 + r.span, len);
    const unsigned kv_row = kv_heads * head_dim, qcols = heads * head_dim;
    const float* qrow = q + (size_t)r.q_row * qcols + (size_t)h0 * head_dim;
    for (unsigned x = threadIdx.x; x < items; x += blockDim.x) qs[x] = qrow[x];
    if (threadIdx.x < hc) {
        mrun[threadIdx.x] = -INFINITY_F;
        lrun[threadIdx.x] = 0.0f;
    }
    float acc[FMAX_QD / 128];
#pragma unroll
    for (unsigned it = 0; it < FMAX_QD / 128; ++it) acc[it] = 0.0f;
    (void)keys;  // the declared arithmetic's (Σ len over the rows)
    for (unsigned t0 = p0; t0 < p1; t0 += FT) {
        const unsigned tn = umin(FT, p1 - t0);
        __syncthreads();  // the last tile's readers are done (and q, the maxima and sums are published)
        for (unsigned x = threadIdx.x; x < tn * head_dim; x += blockDim.x) {
            const unsigned j = x / head_dim, d = x % head_dim;
            ks[j][d] = pool_at(pool, pool_bf16, paged_row(table, page_size, t0 + j, false), kv_row, kvh, head_dim, d);
            vs[j][d] = pool_at(pool, pool_bf16, paged_row(table, page_size, t0 + j, true), kv_row, kvh, head_dim, d);
        }
        __syncthreads();
        for (unsigned x = threadIdx.x; x < hc * FT; x += blockDim.x) {
            const unsigned g = x / FT, j = x % FT;
            float dot = 0.0f;
            if (j < tn)
                for (unsigned d = 0; d < head_dim; ++d) dot += qs[g * head_dim + d] * ks[j][d];
            ss[g][j] = j < tn ? dot * scale : -INFINITY_F;
        }
        __syncthreads();
        if (threadIdx.x < hc) {
            const unsigned g = threadIdx.x;
            float mx = mrun[g];
            for (unsigned j = 0; j < tn; ++j) mx = fmaxf(mx, ss[g][j]);
            const float c = expf(mrun[g] - mx);  // 0 at the first tile (the running maximum is −∞)
            float sum = 0.0f;
            for (unsigned j = 0; j < FT; ++j) {
                const float p = j < tn ? expf(ss[g][j] - mx) : 0.0f;
                ss[g][j] = p;
                sum += p;
            }
            lrun[g] = lrun[g] * c + sum;
            mrun[g] = mx;
            corr[g] = c;
        }
        __syncthreads();
#pragma unroll
        for (unsigned it = 0; it < FMAX_QD / 128; ++it) {
            const unsigned x = threadIdx.x + it * blockDim.x;
            if (x >= items) break;
            const unsigned g = x / head_dim, d = x % head_dim;
            float a = acc[it] * corr[g];
            for (unsigned j = 0; j < tn; ++j) a += ss[g][j] * vs[j][d];
            acc[it] = a;
        }
    }
    __syncthreads();  // the final maxima and sums (also where the split saw no position)
    const unsigned splits = gridDim.z;
#pragma unroll
    for (unsigned it = 0; it < FMAX_QD / 128; ++it) {
        const unsigned x = threadIdx.x + it * blockDim.x;
        if (x >= items) break;
        const unsigned g = x / head_dim, d = x % head_dim;
        const size_t h = h0 + g;
        if (splits == 1) {
            out[(size_t)r.q_row * qcols + h * head_dim + d] = acc[it] / lrun[g];
        } else {
            float* pp = part + (((size_t)i * heads + h) * splits + blockIdx.z) * (head_dim + 2);
            pp[d] = acc[it];
            if (d == 0) {
                pp[head_dim] = mrun[g];
                pp[head_dim + 1] = lrun[g];
            }
        }
    }
}

// The splits of `attention_flash` joined: for query row `i` (blockIdx.x / heads) and head `h`, each
// split's sums rescaled to the largest maximum, added in split order, over the summed exponentials
// (empty splits skipped: a row that saw one split gets `acc / l` exactly, as without a combine).
// flops: fp32 4 * rows * heads * head_dim * splits
// ptx: ld.global.nc.f32, ex2.approx.ftz.f32
// budget: 56 registers
extern "C" __global__ void attention_combine(const float* __restrict__ part, float* __restrict__ out,
                                             const FlashRow* __restrict__ desc, unsigned rows, unsigned heads,
                                             unsigned head_dim, unsigned splits) {
    const unsigned i = blockIdx.x / heads, h = blockIdx.x % heads;
    if (i >= rows) return;
    const float* pp = part + ((size_t)i * heads + h) * splits * (head_dim + 2);
    float m = -INFINITY_F;
    for (unsigned s = 0; s < splits; ++s) m = fmaxf(m, pp[(size_t)s * (head_dim + 2) + head_dim]);
    float l = 0.0f;
    for (unsigned s = 0; s < splits; ++s) {
        const float* ps = pp + (size_t)s * (head_dim + 2);
        if (ps[head_dim + 1] > 0.0f) l += ps[head_dim + 1] * expf(ps[head_dim] - m);
    }
    for (unsigned d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (unsigned s = 0; s < splits; ++s) {
            const float* ps = pp + (size_t)s * (head_dim + 2);
            if (ps[head_dim + 1] > 0.0f) o += ps[d] * expf(ps[head_dim] - m);
        }
        out[(size_t)desc[i].q_row * heads * head_dim + (size_t)h * head_dim + d] = o / l;
    }
}
