// Element-wise ops over f32 tensors, grid-stride loops (any grid covers any length).

#define GRID_STRIDE(i, n) for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)

// flops: fp32 n
// ptx: ld.global.nc.f32
// budget: 32 registers
extern "C" __global__ void add_f32(float* __restrict__ x, const float* __restrict__ y, unsigned n) {
    GRID_STRIDE(i, n) x[i] += y[i];
}

// flops: fp32 n
// ptx: ld.global.nc.f32
// budget: 32 registers
extern "C" __global__ void add_bias_f32(float* __restrict__ x, const float* __restrict__ bias, unsigned n, unsigned cols) {
    GRID_STRIDE(i, n) x[i] += bias[i % cols];
}

// flops: fp32 n
// ptx: none
// budget: 32 registers
extern "C" __global__ void scale_f32(float* __restrict__ x, float s, unsigned n) {
    GRID_STRIDE(i, n) x[i] *= s;
}

// flops: fp32 5 * n
// ptx: ld.global.nc.f32, ex2.approx.ftz.f32
// budget: 32 registers
extern "C" __global__ void silu_mul_f32(float* __restrict__ gate, const float* __restrict__ up, unsigned n) {
    GRID_STRIDE(i, n) gate[i] = silu_f(gate[i]) * up[i];
}

// flops: fp32 5 * n
// ptx: ld.global.nc.f32, ex2.approx.ftz.f32
// budget: 32 registers
extern "C" __global__ void sigmoid_mul_f32(float* __restrict__ x, const float* __restrict__ gate, unsigned n) {
    GRID_STRIDE(i, n) x[i] *= sigmoid_f(gate[i]);
}

// `out[i] += sigmoid(gate[row]) · y[i]`, one gate per row of `cols`.
// flops: fp32 6 * n
// ptx: ld.global.nc.f32, ex2.approx.ftz.f32
// budget: 32 registers
extern "C" __global__ void add_sigmoid_gated_f32(float* __restrict__ out, const float* __restrict__ y,
                                                 const float* __restrict__ gate, unsigned n, unsigned cols) {
    GRID_STRIDE(i, n) out[i] += sigmoid_f(gate[i / cols]) * y[i];
}

// GELU: the tanh approximation written as the CPU writes it (`x / (1 + e^(-2k(x + 0.044715x³)))`), or
// the exact erf form.
// flops: fp32 8 * n
// ptx: ex2.approx.ftz.f32
// budget: 32 registers
extern "C" __global__ void gelu_f32(float* __restrict__ x, unsigned n, int tanh_form) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        if (tanh_form) {
            const float k2 = 2.0f * 0.7978846f;
            x[i] = v / (1.0f + expf(-k2 * (v + 0.044715f * v * v * v)));
        } else {
            x[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
        }
    }
}

// `x = silu(x)` (`sigmoid` = 0) or `x = sigmoid(x)` (1).
// flops: fp32 4 * n
// ptx: ex2.approx.ftz.f32
// budget: 32 registers
extern "C" __global__ void activate_f32(float* __restrict__ x, unsigned n, int sigmoid) {
    GRID_STRIDE(i, n) x[i] = sigmoid ? sigmoid_f(x[i]) : silu_f(x[i]);
}
