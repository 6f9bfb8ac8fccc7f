// NeoX rotation of every `head_dim`-wide head of each row with that row's tables (`half` cosines and
// sines): dims `f` and `f + half` rotate together, dims from `2·half` on pass through. Serves both
// (m)RoPE (tables from the positions' sections) and the vision tower's 2-D rotary.

// flops: fp32 6 * rows * (cols / head_dim) * half
// ptx: ld.global.nc.f32
// budget: 40 registers
extern "C" __global__ void rotate_half_f32(float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                           unsigned rows, unsigned cols, unsigned head_dim, unsigned half) {
    const unsigned heads = cols / head_dim;
    const size_t total = (size_t)rows * heads * half;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / ((size_t)heads * half);
        const unsigned h = (unsigned)((i / half) % heads), f = (unsigned)(i % half);
        float* head = x + r * cols + (size_t)h * head_dim;
        const float c = cos_t[r * half + f], s = sin_t[r * half + f];
        const float a = head[f], b = head[f + half];
        head[f] = a * c - b * s;
        head[f + half] = b * c + a * s;
    }
}
