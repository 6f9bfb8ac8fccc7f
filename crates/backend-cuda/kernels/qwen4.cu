// `qwen4_exp`'s ops: hyper-connections, PLE, QSA. In the CPU's order of operations per output, so
// most agree with it to the bit.

// `out[i] = (Σ_s m_s ⊙ xn_s) / hc` over the `hc` streams of each row (`m`, `xn` `[n, hc·h]`).
// flops: fp32 2 * n * hc * h
// ptx: ld.global.nc.f32
// budget: 40 registers
extern "C" __global__ void hc_combine(const float* __restrict__ m, const float* __restrict__ xn, float* __restrict__ out,
                                      unsigned n, unsigned hc, unsigned h) {
    for (size_t x = blockIdx.x * (size_t)blockDim.x + threadIdx.x; x < (size_t)n * h; x += (size_t)gridDim.x * blockDim.x) {
        const size_t i = x / h, j = x % h;
        float acc = 0.0f;
        for (unsigned s = 0; s < hc; ++s) acc += m[(i * hc + s) * h + j] * xn[(i * hc + s) * h + j];
        out[x] = acc / (float)hc;
    }
}

// `x_s += inj_s · out` for each stream (`x [n, hc·h]`, `out [n, h]`, `inj [n, hc]`).
// flops: fp32 2 * n * hc * h
// ptx: ld.global.nc.f32
// budget: 32 registers
extern "C" __global__ void hc_inject(float* __restrict__ x, const float* __restrict__ out, const float* __restrict__ inj,
                                     unsigned n, unsigned hc, unsigned h) {
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < (size_t)n * hc * h; e += (size_t)gridDim.x * blockDim.x) {
        const size_t i = e / ((size_t)hc * h), s = (e / h) % hc, j = e % h;
        x[e] += inj[i * hc + s] * out[i * h + j];
    }
}

// PLE's gate per (row, stream): `g = Σ k·q / √h` (one thread, in order), `sign(g)·sqrt(max(|g|, 1e-6))`,
// then `sigmoid(g) · v` into the stream. One block per (row, stream).
// flops: fp32 2 * h * blocks + h * blocks
// ptx: bar.sync, ld.shared.f32
// budget: 40 registers
extern "C" __global__ void ple_gate(const float* __restrict__ k, const float* __restrict__ q, const float* __restrict__ v,
                                    float* __restrict__ out, unsigned hc, unsigned h) {
    SHARED(float, gate, );
    const size_t i = blockIdx.x / hc, at = (size_t)blockIdx.x * h;
    if (threadIdx.x == 0) {
        float g = 0.0f;
        for (unsigned j = 0; j < h; ++j) g += k[at + j] * q[at + j];
        g = g / sqrtf((float)h);
        const float sign = g > 0.0f ? 1.0f : (g < 0.0f ? -1.0f : 0.0f);
        g = sqrtf(fmaxf(fabsf(g), 1e-6f)) * sign;
        gate = 1.0f / (1.0f + expf(-g));
    }
    __syncthreads();
    for (unsigned j = threadIdx.x; j < h; j += blockDim.x) out[at + j] = gate * v[i * h + j];
}

// Causal depthwise conv with `dilation`, no bias, then silu, from and advancing `state` (the last
// `(kernel − 1)·dilation` inputs, oldest first): `x [n, c]`, `w [c, kernel]`. One thread per channel.
// flops: fp32 2 * kernel * n * c + 4 * n * c
// ptx: ex2.approx.ftz.f32
// budget: 40 registers
extern "C" __global__ void causal_conv_dilated_silu(const float* __restrict__ x, unsigned n, unsigned c, const float* __restrict__ w,
                                                    unsigned kernel, unsigned dilation, float* __restrict__ state,
                                                    float* __restrict__ out) {
    const unsigned past = (kernel - 1) * dilation;
    for (unsigned ch = blockIdx.x * blockDim.x + threadIdx.x; ch < c; ch += gridDim.x * blockDim.x) {
#define ALL(r) ((r) < past ? state[(size_t)(r) * c + ch] : x[(size_t)((r) - past) * c + ch])
        for (unsigned t = 0; t < n; ++t) {
            float acc = 0.0f;
            for (unsigned j = 0; j < kernel; ++j) acc += w[(size_t)ch * kernel + j] * ALL(t + j * dilation);
            out[(size_t)t * c + ch] = acc / (1.0f + expf(-acc));
        }
        // Ascending: row r reads row n + r of [state; x], which a later step overwrites, never an earlier.
        for (unsigned r = 0; r < past; ++r) state[(size_t)r * c + ch] = ALL(n + r);
#undef ALL
    }
}

// Mean of `n` rows from `row0` of `x` per column (summed in row order, then divided).
// flops: fp32 n * cols
// ptx: ld.global.nc.f32
// budget: 40 registers
extern "C" __global__ void mean_rows(const float* __restrict__ x, unsigned row0, unsigned n, unsigned cols, float* __restrict__ out) {
    for (unsigned c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (unsigned t = 0; t < n; ++t) acc += x[(size_t)(row0 + t) * cols + c];
        out[c] = acc / (float)n;
    }
}

// QSA block selection: row `j` (token `past + j`) scores each of its `(past + j + 1) / ratio` complete
// blocks as `scale · Σ_h max(0, q_h · key)` and keeps the `top` best (ties to the lower block), ascending,
// padded with −1. One thread per row.
// flops: fp32 2 * n * heads * d * (past + n) / ratio * top
// ptx: ld.global.nc.f32
// budget: 48 registers
extern "C" __global__ void qsa_select(const float* __restrict__ q, unsigned row0, unsigned n, const float* __restrict__ keys,
                                      unsigned past, unsigned ratio, unsigned top, unsigned heads, unsigned d, float scale,
                                      int32_t* __restrict__ out) {
    const unsigned j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    const unsigned complete = (past + j + 1) / ratio;
    const float* qr = q + (size_t)(row0 + j) * heads * d;
    int32_t* o = out + (size_t)j * top;
    unsigned kept = 0;
    for (; kept < top && kept < complete; ++kept) {
        int best = -1;
        float bs = 0.0f;
        for (unsigned blk = 0; blk < complete; ++blk) {
            bool taken = false;
            for (unsigned t = 0; t < kept; ++t) taken |= o[t] == (int32_t)blk;
            if (taken) continue;
            float s = 0.0f;
            for (unsigned h = 0; h < heads; ++h) {
                float dot = 0.0f;
                for (unsigned e = 0; e < d; ++e) dot += qr[h * d + e] * keys[(size_t)blk * d + e];
                s += fmaxf(dot, 0.0f);
            }
            s *= scale;
            if (best < 0 || s > bs) {
                best = (int)blk;
                bs = s;
            }
        }
        o[kept] = best;
    }
    for (unsigned t = kept; t < top; ++t) o[t] = -1;
    // Ascending block ids among the kept (insertion sort of at most `top`).
    for (unsigned a = 1; a < kept; ++a)
        for (unsigned b = a; b > 0 && o[b - 1] > o[b]; --b) {
            const int32_t x = o[b];
            o[b] = o[b - 1];
            o[b - 1] = x;
        }
}

// The key position of index `t` of a QSA row: its selected blocks' positions in order, then its own
// incomplete block's (`tail ..= p`).
__device__ __forceinline__ unsigned selected_pos(const int32_t* blocks, unsigned nb, unsigned ratio, unsigned tail, unsigned t) {
    return t < nb * ratio ? (unsigned)blocks[t / ratio] * ratio + t % ratio : tail + (t - nb * ratio);
}

// Attention of `n` rows from `row0` (tokens `past..`) over each row's selected blocks and its own
// incomplete block, over the paged K/V as in `attention_paged`. One block per (row, head).
// flops: fp32 4 * head_dim * blocks * (top * ratio + ratio)
// ptx: bar.sync, shfl.sync.bfly.b32, ex2.approx.ftz.f32
// budget: 48 registers
extern "C" __global__ void attention_selected(const float* __restrict__ q, float* __restrict__ out, const void* __restrict__ pool,
                                              int pool_bf16, const int32_t* __restrict__ table, unsigned page_size,
                                              const int32_t* __restrict__ blocks, unsigned top, unsigned row0,
                                              unsigned past, unsigned ratio, unsigned heads, unsigned kv_heads,
                                              unsigned head_dim, float scale, float* __restrict__ scratch, unsigned stride) {
    SHARED(float, red, [32]);
    const unsigned i = blockIdx.x / heads, h = blockIdx.x % heads;
    const unsigned kvh = h / (heads / kv_heads), kv_row = kv_heads * head_dim, qcols = heads * head_dim;
    const unsigned p = past + i;
    const int32_t* bl = blocks + (size_t)i * top;
    unsigned nb = 0;
    while (nb < top && bl[nb] >= 0) ++nb;
    const unsigned tail = (p + 1) / ratio * ratio, len = nb * ratio + (p + 1 - tail);
    const float* qv = q + (size_t)(row0 + i) * qcols + (size_t)h * head_dim;
    float* s = scratch + (size_t)blockIdx.x * stride;
    for (unsigned t = threadIdx.x; t < len; t += blockDim.x) {
        const unsigned pos = selected_pos(bl, nb, ratio, tail, t);
        s[t] = paged_dot(qv, pool, pool_bf16, table, page_size, pos, kv_row, kvh, head_dim) * scale;
    }
    const float sum = softmax_row(s, len, red);
    float* o = out + (size_t)(row0 + i) * qcols + (size_t)h * head_dim;
    for (unsigned d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (unsigned t = 0; t < len; ++t) {
            const size_t vrow = paged_row(table, page_size, selected_pos(bl, nb, ratio, tail, t), true);
            acc += s[t] / sum * pool_at(pool, pool_bf16, vrow, kv_row, kvh, head_dim, d);
        }
        o[d] = acc;
    }
}
