// Sampling where the logits are: a greedy step reads back one id per sequence instead of its logits.

// `out[r]` = the first index of row `r`'s maximum over `cols` columns of `x` (NaN never wins; a row of
// NaN gives 0): one block per row, each thread the best of its strided columns, then a block reduction
// of (value, index) pairs that keeps the larger value, the lower index on ties.
// flops: fp32 rows * cols
// ptx: shfl.sync.bfly.b32, bar.sync
// budget: 40 registers
extern "C" __global__ void argmax_rows(const float* __restrict__ x, int32_t* __restrict__ out, unsigned rows, unsigned cols) {
    SHARED(float, vals, [32]);
    SHARED(int32_t, idxs, [32]);
    const unsigned r = blockIdx.x;
    if (r >= rows) return;  // the whole block: `r` is the block's
    const float* row = x + (size_t)r * cols;
    float bv = 0.0f;
    int bi = -1;
    for (unsigned j = threadIdx.x; j < cols; j += blockDim.x) {
        const float v = row[j];
        if (v == v && (bi < 0 || v > bv)) {
            bv = v;
            bi = (int)j;
        }
    }
    // (value, index) pairs: an empty one (index −1) always loses.
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
        out[r] = bi < 0 ? 0 : bi;
    }
}
