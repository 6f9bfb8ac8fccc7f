// Row moves: gathers, scatters, column splits, typed copies.

// `out[r] = x[ids[r]]` for rows of `cols` elements of `esize` bytes (4, 2 or 1).
// flops: none
// ptx: ld.global.nc.u8
// budget: 32 registers
extern "C" __global__ void gather_rows(const uint8_t* __restrict__ x, const int32_t* __restrict__ ids, uint8_t* __restrict__ out,
                                       unsigned rows, unsigned cols, unsigned esize) {
    const size_t row_bytes = (size_t)cols * esize;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < rows * row_bytes; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / row_bytes, c = i % row_bytes;
        out[i] = x[(size_t)ids[r] * row_bytes + c];
    }
}

// Up to four consecutive parts of each of `heads` groups of `gw` columns of every row of `x`, from column
// `off` of a group: part `i`, `w_i` columns, into `out_i` (`[rows, heads · w_i]`), in one launch (a
// GDN layer's q, k and v; attention's query and gate). A part of width 0 is not written.
// flops: none
// ptx: ld.global.nc.f32
// budget: 40 registers
extern "C" __global__ void split_cols_f32(const float* __restrict__ x, float* __restrict__ o0, float* __restrict__ o1,
                                          float* __restrict__ o2, float* __restrict__ o3, unsigned rows, unsigned heads,
                                          unsigned gw, unsigned off, unsigned w0, unsigned w1, unsigned w2, unsigned w3) {
    const unsigned ws = w0 + w1 + w2 + w3, oc = heads * ws;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)rows * oc; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / oc;
        const unsigned c = (unsigned)(i % oc), h = c / ws, j = c % ws;
        const float v = x[r * heads * gw + h * gw + off + j];
        const size_t rh = r * heads + h;
        if (j < w0) o0[rh * w0 + j] = v;
        else if (j < w0 + w1) o1[rh * w1 + (j - w0)] = v;
        else if (j < w0 + w1 + w2) o2[rh * w2 + (j - w0 - w1)] = v;
        else o3[rh * w3 + (j - w0 - w1 - w2)] = v;
    }
}

// f32 → bf16 bits, rounded to nearest even (a bf16 KV pool's row writes).
// flops: none
// ptx: st.global.u16
// budget: 32 registers
extern "C" __global__ void f32_to_bf16_rows(const float* __restrict__ src, uint16_t* __restrict__ dst, unsigned n) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = f32_to_bf16(src[i]);
}

// Rows `ids` of an embedding table (f32 `dtype` 0, bf16 1, f16 2), widened to f32.
// flops: none
// ptx: ld.global.nc.u16
// budget: 32 registers
extern "C" __global__ void embed_rows(const void* __restrict__ table, int dtype, const int32_t* __restrict__ ids,
                                      float* __restrict__ out, unsigned n, unsigned cols) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (size_t)n * cols; i += (size_t)gridDim.x * blockDim.x) {
        const size_t src = (size_t)ids[i / cols] * cols + i % cols;
        if (dtype == 0) out[i] = ((const float*)table)[src];
        else if (dtype == 1) out[i] = bf16_to_f32(((const uint16_t*)table)[src]);
        else out[i] = f16_to_f32(((const uint16_t*)table)[src]);
    }
}

// NVFP4 codes (two e2m1 per byte, even column low) with their e4m3 scales per 16 and global scale →
// bf16 bits, rounded to nearest even (a weight widened for the bf16 GEMM of a prefill).
// flops: fp32 2 * n
// ptx: ld.global.nc.u8, st.global.u16
// budget: 32 registers
extern "C" __global__ void nvfp4_to_bf16(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, float global,
                                         uint16_t* __restrict__ out, unsigned n) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const uint8_t byte = codes[i / 2];
        const float v = e2m1_to_f32(i % 2 == 0 ? (byte & 0xfu) : (byte >> 4)) * (e4m3_to_f32(scales[i / 16]) * global);
        out[i] = f32_to_bf16(v);
    }
}
