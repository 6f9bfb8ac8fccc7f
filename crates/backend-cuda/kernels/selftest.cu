// Kernels that check the emulation itself (tests/cuda/emulator.rs): each has a twin with a planted
// bug that the emulated device must expose, as a GPU would.

// Reverses each block's 64-element slice through shared memory (a write, a barrier, a read).
// budget: 32 registers
extern "C" __global__ void selftest_reverse(const float* __restrict__ x, float* __restrict__ out, int sync) {
    __shared__ float s[64];
    const unsigned t = threadIdx.x, base = blockIdx.x * 64;
    s[t] = x[base + t];
    if (sync) __syncthreads();  // `sync` 0: the planted bug, a read before the other threads wrote
    out[base + t] = s[63 - t];
}

// Each lane gets the sum of its warp (a butterfly of shuffles), or reads lane `bad` (a planted bug when
// `bad` is past the warp).
// budget: 32 registers
extern "C" __global__ void selftest_warp(const float* __restrict__ x, float* __restrict__ out, int bad) {
    float v = x[threadIdx.x];
    if (bad >= 0) v = __shfl_sync(0xffffffffu, v, bad);
    else v = warp_sum(v);
    out[threadIdx.x] = v;
}

// Half the block waits at `__syncthreads`; the other half exits (`mode` 0: allowed, exited threads
// count as arrived) or waits at `__syncwarp` instead (1: a planted deadlock).
// budget: 32 registers
extern "C" __global__ void selftest_diverge(float* __restrict__ out, int mode) {
    if (threadIdx.x < 16) __syncthreads();
    else if (mode == 1) __syncwarp();
    out[threadIdx.x] = 1.0f;
}

// Copies `n` values, or `n + 1` (`plant` 1: the off-by-one a bounds checker must catch). The ASan build
// of the emulated kernels (tests/cuda/asan.rs) runs it on a buffer of exactly `n`.
// budget: 32 registers
extern "C" __global__ void selftest_copy(const float* __restrict__ x, float* __restrict__ out, unsigned n, int plant) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n + (plant ? 1u : 0u); i += gridDim.x * blockDim.x)
        out[i % n] = x[i];
}
