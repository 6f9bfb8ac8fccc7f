// Sampling where the logits are: a decode step reads back one id per sequence instead of its logits.
// The rule is `osprey_backend::sampling` (the host sampler's): the grammar's mask, the penalties and the
// bias; greedy, or temperature, top-k, top-p, min-p and one draw with the row's uniform number.
//
// No sort: candidates are ordered by a 64-bit key, the value's total-order bits above the complement of
// the index (a larger key comes first: the larger value, the lower index on ties, as the host sorts), so
// every cut the host makes on its sorted list — keep the first k, the shortest prefix holding top-p of the
// mass, the candidate where the cumulative mass passes u — is "the largest key K whose keys ≥ K hold at
// least X", found digit by digit from the top (a radix select: 4 bits a level, a pass over the row each).
// Sums are in double, as the host's, but in a fixed tree order, not left to right: a draw can differ from
// the host's only where u lies within rounding of a boundary. Deterministic: no atomics.

// The per-row settings `sample_rows` reads (`src/backend/sample.rs` writes them): 12 words a row, then
// each row's edits (4 words: token, flags, subtract, bias) and grammar mask.
#define SAMPLE_HEADER 12u
#define EDIT_REPEAT 1u
#define EDIT_SUBTRACT 2u
#define EDIT_BIAS 4u

// The key of value `v` at column `j`: `f32::total_cmp`'s order in the high 32 bits (a larger value, a
// larger key), the index's complement in the low `bits` (the lower index, the larger key).
__device__ __forceinline__ uint64_t sample_key(float v, unsigned j, unsigned bits) {
    uint32_t u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)u << bits) | (uint64_t)(((1u << bits) - 1u) - j);
}

// Which columns a search counts: key ≥ `lo`, and with `floor` > 0 a mass ≥ `floor` (min-p; the row's
// best, key `top`, always stays).
struct SampleSet {
    uint64_t lo;
    double floor;
    uint64_t top;
};

// Sums `c[16]` (doubles) and `n[16]` over a warp so that lane `l` ends with digit `l / 2`'s totals in
// `c[0]`, `n[0]`: each step a lane keeps half its digits and takes its partner's sums of them (16
// shuffles each, not 16 × 5), in a fixed order.
__device__ __forceinline__ void sample_warp_digits(double* c, unsigned* n, unsigned lane) {
#pragma unroll
    for (unsigned half = 8, o = 16; half >= 1; half >>= 1, o >>= 1) {
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (unsigned i = 0; i < half; ++i) {
            const double cs = upper ? c[i] : c[i + half], ck = upper ? c[i + half] : c[i];
            const unsigned ns = upper ? n[i] : n[i + half], nk = upper ? n[i + half] : n[i];
            c[i] = ck + __shfl_xor_sync(0xffffffffu, cs, (int)o);
            n[i] = nk + __shfl_xor_sync(0xffffffffu, ns, (int)o);
        }
    }
    c[0] += __shfl_xor_sync(0xffffffffu, c[0], 1);
    n[0] += __shfl_xor_sync(0xffffffffu, n[0], 1);
}

// The largest key K of the set whose members with key ≥ K hold more than `need` (`strict`) or at least
// `need` — of mass `m`, or of count with `by_count` —; the set's smallest key when none does. Every
// thread of the block calls it and gets the key. `red_c`, `red_n`: 16 × 32 shared; `chosen`: 1 shared.
__device__ uint64_t sample_search(const float* y, const double* m, unsigned cols, unsigned bits, SampleSet set,
                                  bool by_count, double need, bool strict, double* red_c, unsigned* red_n,
                                  uint64_t* chosen) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const unsigned levels = (32 + bits + 3) / 4;
    uint64_t prefix = 0;
    double base_c = 0.0;
    unsigned base_n = 0;
    for (unsigned level = levels; level-- > 0;) {
        const unsigned s = level * 4;
        const uint64_t high = (s + 4 >= 64) ? 0ull : ~((1ull << (s + 4)) - 1ull);
        double c[16];
        unsigned n[16];
#pragma unroll
        for (unsigned d = 0; d < 16; ++d) {
            c[d] = 0.0;
            n[d] = 0;
        }
        for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) {
            const uint64_t k = sample_key(y[j], j, bits);
            if (k < set.lo || (k & high) != prefix) continue;
            const double mj = m[j];
            if (set.floor > 0.0 && !(mj >= set.floor) && k != set.top) continue;
            const unsigned d = (unsigned)(k >> s) & 15u;
            // Constant indices keep the arrays in registers.
#pragma unroll
            for (unsigned e = 0; e < 16; ++e) {
                if (e == d) {
                    c[e] += mj;
                    n[e] += 1;
                }
            }
        }
        sample_warp_digits(c, n, lane);
        if (lane % 2 == 0) {
            red_c[(lane / 2) * 32 + warp] = c[0];
            red_n[(lane / 2) * 32 + warp] = n[0];
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            // From the largest digit down: the first whose members (with every larger key's) hold `need`.
            int pick = -1, lowest = -1;
            double lowest_c = 0.0;
            unsigned lowest_n = 0;
            for (int d = 15; d >= 0; --d) {
                double td = 0.0;
                unsigned tn = 0;
                for (unsigned w = 0; w < warps; ++w) {
                    td += red_c[d * 32 + w];
                    tn += red_n[d * 32 + w];
                }
                if (tn == 0) continue;
                const double have_c = base_c + td;
                const unsigned have_n = base_n + tn;
                const bool enough = by_count ? (strict ? (double)have_n > need : (double)have_n >= need)
                                             : (strict ? have_c > need : have_c >= need);
                if (enough) {
                    pick = d;
                    break;
                }
                base_c = have_c;
                base_n = have_n;
                lowest = d;
                lowest_c = td;
                lowest_n = tn;
            }
            // None holds it: the smallest digit, toward the set's smallest key.
            if (pick < 0) {
                pick = lowest;
                base_c -= lowest_c;
                base_n -= lowest_n;
            }
            chosen[0] = prefix | ((uint64_t)pick << s);
        }
        __syncthreads();
        // Thread 0 writes `chosen` again only after the next level's barrier, when every thread has read it.
        prefix = chosen[0];
    }
    return prefix;
}

// The sum of `m` over the set, in the block's fixed order (every thread gets it). `red_c`: 32 shared.
__device__ double sample_mass(const float* y, const double* m, unsigned cols, unsigned bits, SampleSet set,
                              double* red_c) {
    double acc = 0.0;
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) {
        const uint64_t k = sample_key(y[j], j, bits);
        if (k < set.lo) continue;
        if (set.floor > 0.0 && !(m[j] >= set.floor) && k != set.top) continue;
        acc += m[j];
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (lane == 0) red_c[warp] = acc;
    __syncthreads();
    double t = 0.0;
    for (unsigned w = 0; w < warps; ++w) t += red_c[w];
    __syncthreads();
    return t;
}

// `out[first + r]` = the token row `r` of `x` draws (`rows` × `cols` f32) under its settings in `params`
// (row `first + r`'s). `y`, `m`: scratch, `rows` × `cols` each (the processed logits, their masses).
// One block per row; the first index of the maximum when greedy (NaN never wins; a row of NaN gives 0).
// flops: fp32 rows * cols * 60
// ptx: shfl.sync.bfly.b32, bar.sync
// budget: 96 registers
extern "C" __global__ void sample_rows(const float* __restrict__ x, const uint32_t* __restrict__ params,
                                       float* __restrict__ y_all, double* __restrict__ m_all,
                                       int32_t* __restrict__ out, unsigned rows, unsigned cols, unsigned first) {
    SHARED(double, red_c, [16 * 32]);
    SHARED(unsigned, red_n, [16 * 32]);
    SHARED(uint64_t, chosen, [1]);
    SHARED(uint64_t, bests, [32]);
    SHARED(float, vals, [32]);
    SHARED(int32_t, idxs, [32]);
    const unsigned r = blockIdx.x;
    if (r >= rows) return;  // the whole block: `r` is the block's
    const uint32_t* h = params + (size_t)(first + r) * SAMPLE_HEADER;
    const float temperature = __uint_as_float(h[0]), top_p = __uint_as_float(h[2]), min_p = __uint_as_float(h[3]);
    const float penalty = __uint_as_float(h[4]);
    const unsigned top_k = h[1], n_edits = h[5], at_edits = h[6], at_mask = h[7], mask_words = h[8];
    const bool masked = h[9] != 0;
    const double u = __longlong_as_double((long long)(((uint64_t)h[11] << 32) | (uint64_t)h[10]));
    const float* row = x + (size_t)r * cols;
    float* y = y_all + (size_t)r * cols;
    double* m = m_all + (size_t)r * cols;

    // The grammar's mask, then each edited token's penalties and bias (each token once: no race). Plain
    // greedy (neither) reads the logits as they are: one pass over the row, as a bare argmax.
    const bool greedy = !(temperature > 0.0f), plain = !masked && n_edits == 0;
    for (unsigned j = threadIdx.x; j < cols && !(greedy && plain); j += blockDim.x) {
        const bool allowed = !masked || (j / 32 < mask_words && ((params[at_mask + j / 32] >> (j % 32)) & 1u));
        y[j] = allowed ? row[j] : -INFINITY_F;
    }
    __syncthreads();
    for (unsigned e = threadIdx.x; e < n_edits; e += blockDim.x) {
        const uint32_t* ed = params + at_edits + 4 * e;
        const unsigned t = ed[0], flags = ed[1];
        if (t >= cols) continue;
        float v = y[t];
        if (flags & EDIT_REPEAT) v = v > 0.0f ? v / penalty : v * penalty;
        if (flags & EDIT_SUBTRACT) v -= __uint_as_float(ed[2]);
        if (flags & EDIT_BIAS) v += __uint_as_float(ed[3]);
        y[t] = v;
    }
    __syncthreads();

    if (greedy) {
        // (value, index) pairs, the larger value, the lower index on ties; an empty one loses.
        const float* src = plain ? row : y;
        float bv = 0.0f;
        int bi = -1;
        for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) {
            const float v = src[j];
            if (v == v && (bi < 0 || v > bv)) {
                bv = v;
                bi = (int)j;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
                bv = ov;
                bi = oi;
            }
        }
        const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
        if (lane == 0) {
            vals[warp] = bv;
            idxs[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (unsigned w = 1; w < warps; ++w) {
                if (idxs[w] >= 0 && (bi < 0 || vals[w] > bv || (vals[w] == bv && idxs[w] < bi))) {
                    bv = vals[w];
                    bi = idxs[w];
                }
            }
            out[first + r] = bi < 0 ? 0 : bi;
        }
        return;
    }

    // Temperature, then the best key (the host's first candidate) and each column's mass e^(v − best).
    unsigned bits = 1;
    while (bits < 31 && (1u << bits) < cols) ++bits;
    uint64_t best = 0;
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) {
        y[j] = y[j] / temperature;
        const uint64_t k = sample_key(y[j], j, bits);
        best = k > best ? k : best;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const uint64_t ok = __shfl_xor_sync(0xffffffffu, best, o);
        best = ok > best ? ok : best;
    }
    {
        const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
        if (lane == 0) bests[warp] = best;
        __syncthreads();
        for (unsigned w = 0; w < warps; ++w) best = bests[w] > best ? bests[w] : best;
    }
    const float vmax = y[((1u << bits) - 1u) - (unsigned)(best & ((1ull << bits) - 1ull))];
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) m[j] = exp((double)(y[j] - vmax));
    __syncthreads();

    // Top-k: the k-th key. Top-p: the shortest prefix holding top-p of the top-k's mass. Min-p: a mass of
    // at least min-p (the best's is 1). The draw: the first key whose cumulative mass passes u × total.
    SampleSet set = {0ull, 0.0, best};
    if (top_k > 0 && top_k < cols) set.lo = sample_search(y, m, cols, bits, set, true, (double)top_k, false, red_c, red_n, chosen);
    if (top_p < 1.0f) {
        const double z = sample_mass(y, m, cols, bits, set, red_c);
        set.lo = sample_search(y, m, cols, bits, set, false, (double)top_p * z, false, red_c, red_n, chosen);
    }
    if (min_p > 0.0f) set.floor = (double)min_p;
    const double total = sample_mass(y, m, cols, bits, set, red_c);
    const uint64_t k = sample_search(y, m, cols, bits, set, false, u * total, true, red_c, red_n, chosen);
    if (threadIdx.x == 0) out[first + r] = (int32_t)(((1u << bits) - 1u) - (unsigned)(k & ((1ull << bits) - 1ull)));
}
