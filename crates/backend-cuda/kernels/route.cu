// The router: per row of `experts` logits, softmax, the `k` most probable (ties to the lower id),
// renormalised over the kept `k` when `renorm`, written in ascending id order. One thread per row, in
// the CPU's order of operations (max, exponentials, a sequential sum), so the weights match it.

// flops: fp32 rows * experts * (k + 4)
// ptx: ex2.approx.ftz.f32
// budget: 40 registers
extern "C" __global__ void route_topk(const float* __restrict__ logits, int32_t* __restrict__ ids, float* __restrict__ weights,
                                      unsigned rows, unsigned experts, unsigned k, int renorm) {
    const unsigned r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* l = logits + (size_t)r * experts;
    float mx = -INFINITY_F;
    for (unsigned e = 0; e < experts; ++e) mx = fmaxf(mx, l[e]);
    float sum = 0.0f;
    for (unsigned e = 0; e < experts; ++e) sum += expf(l[e] - mx);
    int32_t* out_ids = ids + (size_t)r * k;
    float* out_w = weights + (size_t)r * k;
    // Selection by repeated arg-max: the j-th pick is the best not yet taken, lower id on ties.
    float kept = 0.0f;
    for (unsigned j = 0; j < k; ++j) {
        int best = -1;
        float bp = 0.0f;
        for (unsigned e = 0; e < experts; ++e) {
            bool taken = false;
            for (unsigned t = 0; t < j; ++t) taken |= out_ids[t] == (int32_t)e;
            if (taken) continue;
            const float p = expf(l[e] - mx) / sum;
            if (best < 0 || p > bp) {
                best = (int)e;
                bp = p;
            }
        }
        out_ids[j] = best;
        out_w[j] = bp;
        kept += bp;
    }
    if (renorm)
        for (unsigned j = 0; j < k; ++j) out_w[j] /= kept;
    // Ascending ids (insertion sort of k pairs).
    for (unsigned j = 1; j < k; ++j)
        for (unsigned t = j; t > 0 && out_ids[t - 1] > out_ids[t]; --t) {
            const int32_t i = out_ids[t];
            out_ids[t] = out_ids[t - 1];
            out_ids[t - 1] = i;
            const float w = out_w[t];
            out_w[t] = out_w[t - 1];
            out_w[t - 1] = w;
        }
}
