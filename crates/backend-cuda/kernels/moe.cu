// Routed experts: the outputs of one expert's tokens into their entries of `partials`, and the
// per-token sum of the entries in ascending expert order.

// `partials[entries[i]] = d[i] · weights[entries[i]]` for `n` rows of `h`.
// flops: fp32 n * h
// ptx: ld.global.nc.f32
// budget: 32 registers
extern "C" __global__ void moe_scatter_rows(float* __restrict__ partials, const int32_t* __restrict__ entries,
                                            const float* __restrict__ weights, const float* __restrict__ d,
                                            unsigned n, unsigned h) {
    for (size_t x = blockIdx.x * (size_t)blockDim.x + threadIdx.x; x < (size_t)n * h; x += (size_t)gridDim.x * blockDim.x) {
        const size_t i = x / h, c = x % h;
        const int32_t en = entries[i];
        partials[(size_t)en * h + c] = d[x] * weights[en];
    }
}

// `out[t] = 0 + partials[t·k] + … + partials[t·k + k − 1]`, in that order; with `with_shared`,
// then `+= sigmoid(gate[t]) · shared[t]` as `add_sigmoid_gated_f32` adds it (a MoE layer's shared expert,
// one launch fewer, the same bits).
// flops: fp32 t * k * h
// ptx: ld.global.nc.f32
// budget: 40 registers
extern "C" __global__ void moe_combine(const float* __restrict__ partials, float* __restrict__ out, unsigned t, unsigned k,
                                       unsigned h, int with_shared, const float* __restrict__ shared,
                                       const float* __restrict__ gate) {
    for (size_t x = blockIdx.x * (size_t)blockDim.x + threadIdx.x; x < (size_t)t * h; x += (size_t)gridDim.x * blockDim.x) {
        const size_t i = x / h, c = x % h;
        float acc = 0.0f;
        for (unsigned j = 0; j < k; ++j) acc += partials[((size_t)i * k + j) * h + c];
        if (with_shared) acc += sigmoid_f(gate[i]) * shared[x];
        out[x] = acc;
    }
}

// The routed experts' groups built on the device from the router's ids (no host routing, as ggml's
// MUL_MAT_ID takes its ids tensor): every entry `i` of `ids [n = T·k]` goes to the slot `slot_of[ids[i]]`
// holds its expert in (every routed expert is in a slot). Groups are the occupied slots in ascending
// order, at most `groups`: group `g` has `rows[g]` rows from `row0[g]` of the gathered batch, and its
// three projections' weight, scales and global scale (`w`, `s`, `glob` `[3, groups]`, from the pool's
// per-slot tables `slot_w`, `slot_s`, `slot_g` `[3, slots]`); the batch's row `r` is entry `entries[r]`
// of token `tokens[r]`. Groups past the occupied ones get no rows. One thread: a decode step has a few
// dozen entries (a parallel version comes with the fused expert kernels).
// flops: none
// ptx: ld.global.nc.u32, st.global.u64
// budget: 40 registers
extern "C" __global__ void moe_align(const int32_t* __restrict__ ids, const int32_t* __restrict__ slot_of, unsigned n,
                                     unsigned k, unsigned slots, unsigned groups, const uint64_t* __restrict__ slot_w,
                                     const uint64_t* __restrict__ slot_s, const float* __restrict__ slot_g,
                                     uint32_t* __restrict__ row0, uint32_t* __restrict__ rows, uint64_t* __restrict__ w,
                                     uint64_t* __restrict__ s, float* __restrict__ glob, int32_t* __restrict__ entries,
                                     int32_t* __restrict__ tokens) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned g = 0, at = 0;
    for (unsigned slot = 0; slot < slots && g < groups; ++slot) {
        unsigned c = 0;
        for (unsigned i = 0; i < n; ++i) {
            if (slot_of[ids[i]] != (int32_t)slot) continue;
            entries[at + c] = (int32_t)i;
            tokens[at + c] = (int32_t)(i / k);
            ++c;
        }
        if (c == 0) continue;
        row0[g] = at;
        rows[g] = c;
        for (unsigned p = 0; p < 3; ++p) {
            w[p * groups + g] = slot_w[p * slots + slot];
            s[p * groups + g] = slot_s[p * slots + slot];
            glob[p * groups + g] = slot_g[p * slots + slot];
        }
        at += c;
        ++g;
    }
    for (; g < groups; ++g) {
        row0[g] = at;
        rows[g] = 0;
    }
}
